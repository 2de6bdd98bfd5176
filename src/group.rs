//! Consumer groups: what the claim and outcome paths know of one, and resolving (stream, group)
//! names. Creating, changing and dropping groups is the operator API's (src/admin/groups.rs).

use pgrx::pg_sys::BuiltinOid::*;
use pgrx::spi::SpiClient;

use crate::backoff::Backoff;
use crate::catalog;
use crate::concurrency::Concurrency;
use crate::error::{Result, StreamError};
use crate::locks;
use crate::statement::{Access, Columns, Statement};
use crate::stream::StreamRef;
use crate::version;

/// A consumer group with its stream and settings.
#[derive(Clone, Debug)]
pub struct GroupRef {
    pub stream: StreamRef,
    pub id: i64,
    pub concurrency_override: Option<Concurrency>,
    pub max_retries: i32,
    pub backoff: Backoff,
    pub max_delays: Option<i32>,
    pub max_reclaims: i32,
    /// Claims hand out nothing while the group is paused (`pause_group`).
    pub paused: bool,
    /// An ordered key stops at its dead message (`on_dead = 'hold'`) instead of going on.
    pub hold_on_dead: bool,
    /// At most this many messages under unexpired leases at once (src/inflight_cap.rs).
    pub max_inflight: Option<i32>,
}

impl GroupRef {
    /// Whether any row of this group can be parked behind a same-key message.
    pub fn may_park(&self) -> bool {
        self.concurrency_override != Some(Concurrency::Parallel)
    }
}

/// A group's settings as `group_from` reads them, from `consumer_group g`.
macro_rules! settings_columns {
    () => {
        "g.concurrency_override, g.max_retries,
         (extract(epoch FROM g.backoff_base) * 1e6)::int8 AS backoff_base,
         (extract(epoch FROM g.backoff_cap) * 1e6)::int8 AS backoff_cap,
         g.backoff_exponent, g.max_delays, g.max_reclaims, g.paused, g.on_dead, g.max_inflight"
    };
}
pub(crate) use settings_columns;

const LOOKUP: Statement = Statement {
    name: "group_lookup",
    sql: concat!(
        "SELECT s.id AS stream_id, s.partition_size, s.partitions_through, s.schema_version, s.lanes,
                g.id AS group_id, ",
        settings_columns!(),
        "
          FROM sqlstreams.stream s
          LEFT JOIN sqlstreams.consumer_group g ON g.stream_id = s.id AND g.name = $2
          WHERE s.name = $1
          ORDER BY s.id DESC LIMIT 1 -- the newest of the name (see stream.rs LOOKUP)"
    ),
    params: &[TEXTOID, TEXTOID],
};

/// The group `group` of stream `stream`, or `UnknownStream` / `UnknownGroup`.
pub fn lookup(client: &SpiClient<'_>, stream: &str, group: &str, access: Access) -> Result<GroupRef> {
    // The stream's lock, then the group's (src/locks.rs): the lookup below sees what a drop or
    // a seek that held them left. Inspection (`Access::Read`) reads its snapshot and takes only
    // the stream's lock: an idle transaction that inspected a group never holds a seek or a
    // drop_group back, nor the claims that queue behind them.
    match access {
        Access::Read => {
            locks::stream_shared(stream, true);
            find(client, stream, group, access)
        }
        Access::Write => {
            locks::stream_and_group(stream, group, false);
            // Read after the locks: a drop that held them has sent its invalidations.
            let generation = catalog::generation_for_write();
            let key = (stream.to_string(), group.to_string());
            if let Some(found) = FOUND.with(|memo| memo.get(&key, generation)) {
                crate::stream::confirm(stream, found.stream.id)?;
                crate::quiet::touch(found.stream.id);
                return Ok(found);
            }
            let found = find(client, stream, group, access)?;
            FOUND.with(|memo| memo.put(key, generation, found.clone()));
            Ok(found)
        }
    }
}

thread_local! {
    /// Groups looked up by calls that may write, by stream and group name, until the catalog
    /// changes (src/catalog.rs).
    static FOUND: catalog::Memo<(String, String), GroupRef> = catalog::Memo::new();
}

/// `lookup` for `drop_group` and `seek`: the group's lock exclusive, before anything of the group.
pub(crate) fn lookup_exclusive(client: &SpiClient<'_>, stream: &str, group: &str) -> Result<GroupRef> {
    locks::stream_and_group(stream, group, true);
    find(client, stream, group, Access::Write)
}

/// The group, looked up once its locks are taken.
pub(crate) fn find(client: &SpiClient<'_>, stream: &str, group: &str, access: Access) -> Result<GroupRef> {
    version::check(client, access)?;
    let row = LOOKUP.exec(client, 0, &[stream.into(), group.into()], access)?.first();
    if row.is_empty() {
        return Err(StreamError::UnknownStream(stream.to_string()));
    }
    version::check_stream(stream, &row.required::<String>("schema_version")?)?;
    let stream_ref = StreamRef {
        id: row.required("stream_id")?,
        partition_size: row.required("partition_size")?,
        partitions_through: row.required("partitions_through")?,
        lanes: row.required("lanes")?,
    };
    crate::stream::confirm(stream, stream_ref.id)?;
    if access == Access::Write {
        // Before anything of the stream is changed or locked (src/quiet.rs).
        crate::quiet::touch(stream_ref.id);
    }
    let Some(id) = row.value::<i64>("group_id")? else {
        return Err(StreamError::UnknownGroup { stream: stream.to_string(), group: group.to_string() });
    };
    group_from(&row, stream_ref, id)
}

/// The settings columns of `LOOKUP` and `BY_ID`, as a `GroupRef` of `stream`.
pub(crate) fn group_from<R: Columns>(row: &R, stream: StreamRef, id: i64) -> Result<GroupRef> {
    Ok(GroupRef {
        stream,
        id,
        concurrency_override: row
            .value::<String>("concurrency_override")?
            .map(|c: String| Concurrency::from_stored(&c))
            .transpose()?,
        max_retries: row.required("max_retries")?,
        backoff: Backoff {
            base_micros: row.required("backoff_base")?,
            cap_micros: row.required("backoff_cap")?,
            exponent: row.required("backoff_exponent")?,
        },
        max_delays: row.value("max_delays")?,
        max_reclaims: row.required("max_reclaims")?,
        paused: row.required("paused")?,
        hold_on_dead: row.required::<String>("on_dead")? == "hold",
        max_inflight: row.value("max_inflight")?,
    })
}

const BY_ID: Statement = Statement {
    name: "group_by_id",
    sql: concat!("SELECT ", settings_columns!(), " FROM sqlstreams.consumer_group g WHERE g.id = $1"),
    params: &[INT8OID],
};

/// Group `id` of `stream`, for work that goes over every group of a stream (retention).
pub fn by_id(client: &SpiClient<'_>, stream: &StreamRef, id: i64) -> Result<GroupRef> {
    let row = BY_ID.run(client, 0, &[id.into()])?.first();
    if row.is_empty() {
        return Err(StreamError::Internal(format!("consumer group {id} disappeared")));
    }
    group_from(&row, stream.clone(), id)
}
