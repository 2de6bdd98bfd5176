//! Streams: what the claim and produce paths know of one, and looking it up by name. Creating,
//! changing and dropping streams is the operator API's (src/admin/streams.rs).
//!
//! Each stream records the version its tables have (`schema_version`, src/admin/streams.rs
//! says where they are defined); a lookup refuses a stream whose tables are not the ones the
//! library was built for, instead of failing half-way through a call.

use std::ffi::CString;

use pgrx::pg_sys::{self, BuiltinOid::*};
use pgrx::spi::SpiClient;

use crate::error::{Result, StreamError};
use crate::locks;
use crate::statement::{Access, Columns, Statement};

/// What the claim and produce paths need to know about a stream.
#[derive(Clone, Debug)]
pub struct StreamRef {
    pub id: i64,
    pub partition_size: i64,
    pub partitions_through: i64,
    /// How many lanes its messages are spread over (src/lanes.rs).
    pub lanes: i32,
}

impl StreamRef {
    /// The lanes of `keys` in this stream, sorted, each once.
    pub fn lanes_of<'a>(&self, keys: impl IntoIterator<Item = &'a String>) -> Vec<i32> {
        let mut of: Vec<i32> = keys.into_iter().map(|key| lane(Some(key), 0, self.lanes)).collect();
        of.sort_unstable();
        of.dedup();
        of
    }
}

/// The lane of a message, as `sqlstreams.lane(message_key, message_id, lanes)` computes it (the
/// install script; `lanes` is a stream's, 1 to 1024): its key's `hashtext`, or blocks of 64 ids.
/// A stream's lanes never change, so a key's messages are always in one lane (src/lanes.rs).
pub fn lane(key: Option<&str>, id: i64, lanes: i32) -> i32 {
    let lanes = i64::from(lanes);
    let lane = match key {
        Some(key) => i64::from(crate::locks::hash(key.as_bytes())) % lanes,
        None => (id / 64) % lanes,
    };
    lane as i32
}

const LOOKUP: Statement = Statement {
    name: "stream_lookup",
    // The newest of the name: a REPEATABLE READ snapshot taken before a drop of the name
    // committed still sees the dropped stream's row beside one this transaction created since.
    sql: "SELECT id, partition_size, partitions_through, schema_version, lanes FROM sqlstreams.stream
          WHERE name = $1 ORDER BY id DESC LIMIT 1",
    params: &[TEXTOID],
};

/// The stream called `name`, or `UnknownStream`.
pub fn lookup(client: &SpiClient<'_>, name: &str) -> Result<StreamRef> {
    lookup_with(client, name, Access::Write)
}

/// `lookup` for a function declared `stable` (the caller's snapshot).
pub fn lookup_read(client: &SpiClient<'_>, name: &str) -> Result<StreamRef> {
    lookup_with(client, name, Access::Read)
}

fn lookup_with(client: &SpiClient<'_>, name: &str, access: Access) -> Result<StreamRef> {
    locks::stream_shared(name, true);
    if access == Access::Read {
        let stream = find(client, name, access)?;
        confirm(name, stream.id)?;
        return Ok(stream);
    }
    // As src/group.rs `lookup`: read after the lock, which a drop holds until it has sent its
    // invalidations. A produce of one message spent a tenth to a fifth of its CPU on the
    // lookup's statement otherwise (docs/benchmarks/cost-model.md).
    let generation = crate::catalog::generation_for_write();
    if let Some(found) = FOUND.with(|memo| memo.get(&name.to_string(), generation)) {
        confirm(name, found.id)?;
        crate::quiet::touch(found.id);
        return Ok(found);
    }
    let stream = find(client, name, access)?;
    confirm(name, stream.id)?;
    FOUND.with(|memo| memo.put(name.to_string(), generation, stream.clone()));
    Ok(stream)
}

thread_local! {
    /// Streams looked up by calls that may write, by name, until the catalog changes
    /// (src/catalog.rs).
    static FOUND: crate::catalog::Memo<String, StreamRef> = crate::catalog::Memo::new();
}

/// The stream called `name` as the caller's snapshot sees it, without its lock.
pub(crate) fn find(client: &SpiClient<'_>, name: &str, access: Access) -> Result<StreamRef> {
    crate::version::check(client, access)?;
    let row = LOOKUP.exec(client, 0, &[name.into()], access)?.first();
    if row.is_empty() {
        return Err(StreamError::UnknownStream(name.to_string()));
    }
    crate::version::check_stream(name, &row.required::<String>("schema_version")?)?;
    let id = row.required("id")?;
    if access == Access::Write {
        // Before anything of the stream is changed or locked (src/quiet.rs).
        crate::quiet::touch(id);
    }
    Ok(StreamRef {
        id,
        partition_size: row.required("partition_size")?,
        partitions_through: row.required("partitions_through")?,
        lanes: row.required("lanes")?,
    })
}

/// Confirms stream `id`, looked up as `name` after its lock was taken (src/locks.rs): a lookup
/// that read a snapshot older than the lock (a stable function's, or REPEATABLE READ's) may
/// have found a stream that a `drop_stream` dropped before this call took the lock; its
/// tables tell. (Checked at every lookup, not only when this call took the lock: a transaction
/// that held it already may hold it through another call, and the check is two catalog cache
/// lookups.)
pub fn confirm(name: &str, id: i64) -> Result<()> {
    if !tables_exist(id) {
        return Err(StreamError::UnknownStream(name.to_string()));
    }
    Ok(())
}

/// Takes the stream's lock, shared, unless a `drop_stream` holds it: whether it is held now
/// (`maintain()` skips a stream being dropped).
pub fn try_hold(name: &str) -> bool {
    locks::stream_shared(name, false) != locks::Held::Busy
}

/// Whether stream `id`'s tables exist, as the catalog says now.
fn tables_exist(id: i64) -> bool {
    let name = CString::new(format!("cursor_{id}")).expect("no NUL in a number");
    // SAFETY: catalog lookups in a transaction, after reading the invalidations of every
    // transaction that committed before this one took the stream's lock.
    unsafe {
        pg_sys::AcceptInvalidationMessages();
        let namespace = pg_sys::get_namespace_oid(c"sqlstreams".as_ptr(), true);
        namespace != pg_sys::InvalidOid && pg_sys::get_relname_relid(name.as_ptr(), namespace) != pg_sys::InvalidOid
    }
}
