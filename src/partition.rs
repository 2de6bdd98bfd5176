//! Partitions of `message_log_<id>`: blocks of `partition_size` ids, created ahead of the head
//! by `sqlstreams.add_partitions` (the DDL lives in the versioned install script), partition
//! `n` (`message_log_<id>_p<n>`) holding ids `n * partition_size + 1 ..= (n + 1) * partition_size`.
//!
//! The claim path reads the partitions it needs by name (`Statement::exec_in`, or by oid from
//! the partition's key, src/message/scan.rs), never through the partitioned log: PostgreSQL 15
//! locks every partition of the log at each execution of a cached plan over it, before run-time
//! pruning skips them, and a lateral lookup into the log cannot be pruned at planning at all. A
//! stream that keeps its history (retention not caught up, a group far behind) would otherwise
//! pay for every partition on every claim.

use std::ffi::CString;

use pgrx::pg_sys::{self, BuiltinOid::*};
use pgrx::spi::SpiClient;

use crate::error::{Result, StreamError};
use crate::statement::{Access, Columns, Part, Statement};
use crate::stream::StreamRef;

/// The log's columns, in their order in every partition the install script makes, with their
/// types and whether each is NOT NULL (`message_log_@id@`): what src/append.rs writes directly,
/// and what src/message/scan.rs finds by name to read directly.
pub const LOG_COLUMNS: [(&str, pg_sys::Oid, bool); 9] = [
    ("id", pg_sys::INT8OID, true),
    ("message_key", pg_sys::TEXTOID, false),
    ("concurrency", pg_sys::TEXTOID, false),
    ("compaction", pg_sys::BOOLOID, true),
    ("payload", pg_sys::JSONBOID, true),
    ("produced_at", pg_sys::TIMESTAMPTZOID, true),
    ("lane", pg_sys::INT4OID, true),
    ("headers", pg_sys::JSONBOID, false),
    ("deliver_at", pg_sys::TIMESTAMPTZOID, false),
];

pub use crate::statement::probe::is_named;

const ADD: Statement = Statement {
    name: "partition_add",
    sql: "SELECT sqlstreams.add_partitions($1, $2, $3) AS through",
    params: &[INT8OID, INT8OID, BOOLOID],
};

/// Who asks for partitions, and how much they may wait for them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Need {
    /// A producer about to insert `id`: only when no partition holds it yet, and then it waits
    /// for another transaction creating that partition (it cannot insert without it). Creating
    /// ahead is left to claims and `maintain()`, so a long producer transaction never holds
    /// other producers back. The insert then takes its partitions' locks first (`lock_for_insert`).
    Now,
    /// Claims and `maintain()`: keep half a partition of headroom ahead of the head, skipping
    /// the work when another transaction is creating partitions right now.
    Ahead,
}

/// The partition that holds (or will hold) message `id`.
pub fn of(stream: &StreamRef, id: i64) -> Part {
    (id - 1).div_euclid(stream.partition_size)
}

/// The stream's log, locked for reading: which of its partitions exist.
///
/// Opening it takes the log's ACCESS SHARE lock, as any statement over the log does: retention
/// and `drop_stream` drop partitions under the log's ACCESS EXCLUSIVE lock, so a drop committed
/// before is seen here and none happens until this transaction ends. Partitions are created
/// ahead of the head, so every id up to a fence's safe head has its partition, unless retention
/// dropped it, or its producer rolled back: then no group needs its messages (the archive keeps
/// the dead letters' ones), or it has none.
///
/// Existence comes from the syscache, brought up to date when the log is opened: the lock is
/// taken again without reading the catalog's invalidations when this transaction already holds
/// it, and a partition looked up before another transaction attached it (one whose producer
/// rolled back, below the safe head) would stay missing from the cache, its messages passed over
/// for good. A partition the cache does not know is looked for once more (`exists`). No
/// partition is dropped while the lock is held.
pub struct Log<'a> {
    stream: &'a StreamRef,
    oid: pg_sys::Oid,
    namespace: pg_sys::Oid,
}

/// The oldest partition of the log `$1` (by oid).
const OLDEST: Statement = Statement {
    name: "partition_oldest",
    sql: "SELECT min(substring(c.relname FROM '_p([0-9]+)$')::int8) AS part
          FROM pg_catalog.pg_inherits i JOIN pg_catalog.pg_class c ON c.oid = i.inhrelid
          WHERE i.inhparent = $1",
    params: &[OIDOID],
};

/// The oid of relation `$1` in namespace `$2`, as committed now (`Log::exists`).
const CREATED: Statement = Statement {
    name: "partition_created",
    sql: "SELECT c.oid::int8 FROM pg_catalog.pg_class c WHERE c.relname = $1::name AND c.relnamespace = $2",
    params: &[TEXTOID, OIDOID],
};

impl<'a> Log<'a> {
    pub fn open(stream: &'a StreamRef) -> Result<Log<'a>> {
        Log::open_in(stream, pg_sys::AccessShareLock)
    }

    /// `open` with the log locked in `mode`.
    fn open_in(stream: &'a StreamRef, mode: u32) -> Result<Log<'a>> {
        let name = CString::new(format!("message_log_{}", stream.id)).expect("no NUL in a number");
        // SAFETY: a catalog lookup with a lock, in a transaction; RangeVarGetRelidExtended
        // looks again when the relation is dropped or renamed while it waits for the lock.
        let oid = unsafe {
            let relation = pg_sys::makeRangeVar(c"sqlstreams".as_ptr().cast_mut(), name.as_ptr().cast_mut(), -1);
            pg_sys::RangeVarGetRelidExtended(
                relation,
                mode as pg_sys::LOCKMODE,
                pg_sys::RVROption::RVR_MISSING_OK,
                None,
                std::ptr::null_mut(),
            )
        };
        if oid == pg_sys::InvalidOid {
            return Err(StreamError::UnknownStreamId(stream.id));
        }
        // SAFETY: processes pending catalog invalidations, as a first lock acquisition does.
        unsafe { pg_sys::AcceptInvalidationMessages() };
        // SAFETY: a syscache lookup of a relation this transaction has locked.
        Ok(Log { stream, oid, namespace: unsafe { pg_sys::get_rel_namespace(oid) } })
    }

    /// The log's oid.
    pub fn oid(&self) -> pg_sys::Oid {
        self.oid
    }

    /// Whether the syscache knows partition `part` (see `Log` for why its answer is current,
    /// and `exists` for when it is not).
    pub fn cached(&self, part: Part) -> bool {
        self.cached_oid(part) != pg_sys::InvalidOid
    }

    /// Partition `part`'s oid, when the syscache knows it (after `exists` said it exists).
    pub fn part_oid(&self, part: Part) -> Option<pg_sys::Oid> {
        Some(self.cached_oid(part)).filter(|oid| *oid != pg_sys::InvalidOid)
    }

    fn cached_oid(&self, part: Part) -> pg_sys::Oid {
        // SAFETY: a syscache lookup.
        unsafe { pg_sys::get_relname_relid(self.name(part).as_ptr(), self.namespace) }
    }

    fn name(&self, part: Part) -> CString {
        CString::new(format!("message_log_{}_p{part}", self.stream.id)).expect("no NUL in numbers")
    }

    /// Whether partition `part` exists. A transaction that created a partition becomes visible
    /// as committed a moment before its invalidations reach other backends, and a backend that
    /// looked the partition up before (a producer that created it once rolled back) keeps its
    /// cache's "no such relation" until they do: a claim whose fence has just proven that
    /// creator's messages safe would pass them over. So a partition the syscache does not know
    /// is looked for in `pg_class` with the newest snapshot; found, its lock is taken, which its
    /// creator holds until its invalidations are sent, and they are read with it.
    ///
    /// In parallel mode (an inspection function in a parallel plan) there is no newest snapshot
    /// to take, and the cache's answer stands: inspection reads its snapshot anyway.
    pub fn exists(&self, client: &SpiClient<'_>, part: Part) -> Result<bool> {
        let cached = self.cached(part);
        // SAFETY: reads this backend's parallel state.
        if cached || unsafe { pg_sys::IsInParallelMode() } {
            return Ok(cached);
        }
        let Some(oid) = self.created(client, part)? else {
            return Ok(false);
        };
        // SAFETY: takes a relation lock by oid in a transaction (it waits for the creator's end,
        // then reads the invalidations, as every first lock of a relation does).
        unsafe { pg_sys::LockRelationOid(oid, pg_sys::AccessShareLock as pg_sys::LOCKMODE) };
        Ok(self.cached(part))
    }

    /// Partition `part`'s oid as committed now, looked for in `pg_class` with the newest
    /// snapshot (not in the syscache, whose answer may be older: `exists`).
    fn created(&self, client: &SpiClient<'_>, part: Part) -> Result<Option<pg_sys::Oid>> {
        let name = self.name(part);
        let args = [
            // SAFETY: a text datum of a C string, and an oid datum.
            unsafe { pg_sys::Datum::from(pg_sys::cstring_to_text(name.as_ptr())) },
            pg_sys::Datum::from(self.namespace),
        ];
        let oid = CREATED.read_newest(client, 0, &args)?.first().and_then(|row| row[0]);
        Ok(oid.map(|oid| pg_sys::Oid::from(oid as u32)))
    }

    /// The partitions holding ids in `(after, upto]` that exist, oldest first; looked up as the
    /// caller goes on, so a reader that stops early looks at no more. Partitions are created and
    /// dropped in id order, so those kept are one run: when the first one wanted is gone, the
    /// walk starts at the oldest kept instead of looking up every partition retention dropped.
    pub fn holding<'s>(
        &'s self,
        client: &'s SpiClient<'s>,
        after: i64,
        upto: i64,
        access: Access,
    ) -> Result<impl Iterator<Item = Result<Part>> + 's> {
        let (mut first, last) =
            if upto > after { (of(self.stream, after + 1), of(self.stream, upto)) } else { (0, -1) };
        if first <= last && !self.cached(first) {
            first = match self.oldest(client, access)? {
                Some(oldest) => first.max(oldest),
                None => last + 1,
            };
        }
        Ok((first..=last).filter_map(move |part| match self.exists(client, part) {
            Ok(true) => Some(Ok(part)),
            Ok(false) => None,
            Err(e) => Some(Err(e)),
        }))
    }

    /// The oldest partition the log keeps.
    pub fn oldest(&self, client: &SpiClient<'_>, access: Access) -> Result<Option<Part>> {
        OLDEST.exec(client, 0, &[self.oid.into()], access)?.first().value("part")
    }

    /// The last id partition `part` holds.
    pub fn last_id(&self, part: Part) -> i64 {
        (part + 1).saturating_mul(self.stream.partition_size)
    }
}

/// Before an insert of ids `first..=last`: locks the log and the partitions that hold them, as
/// the insert will (ROW EXCLUSIVE, the log first), so this backend has read the invalidations of
/// the transaction that attached them (see `Log::exists` for why a committed partition may not be
/// known yet): without them the log's partition descriptor here lacks the new partition, and the
/// insert fails with "no partition of relation found for row" (23514). A partition attached since
/// this transaction locked the log, which the log's lock no longer brings news of, is read about
/// the same way.
pub fn lock_for_insert(client: &SpiClient<'_>, stream: &StreamRef, first: i64, last: i64) -> Result<Writable> {
    let log = Log::open_in(stream, pg_sys::RowExclusiveLock)?;
    let mut partitions = Vec::new();
    for part in of(stream, first)..=of(stream, last) {
        let cached = log.cached_oid(part);
        let oid = if cached != pg_sys::InvalidOid { Some(cached) } else { log.created(client, part)? };
        if let Some(oid) = oid {
            // SAFETY: takes a relation lock by oid in a transaction.
            unsafe { pg_sys::LockRelationOid(oid, pg_sys::RowExclusiveLock as pg_sys::LOCKMODE) };
        }
        partitions.push((part, oid));
    }
    Ok(Writable { log: log.oid, partitions })
}

/// The log and the partitions `lock_for_insert` locked, oldest first (`None`: no such partition).
pub struct Writable {
    pub log: pg_sys::Oid,
    pub partitions: Vec<(Part, Option<pg_sys::Oid>)>,
}

/// Whether message id `id` is close enough to the end of the partitions to add more.
/// Half a partition of headroom keeps producers from ever reaching a missing partition.
pub fn needs_more(stream: &StreamRef, id: i64) -> bool {
    id.saturating_add(headroom(stream.partition_size)) >= stream.partitions_through
}

fn headroom(partition_size: i64) -> i64 {
    (partition_size / 2).max(1)
}

/// Makes sure partitions cover `id` (`Need::Now`) or `id` plus headroom (`Need::Ahead`). Cheap
/// when they already do.
pub fn ensure(client: &SpiClient<'_>, stream: &StreamRef, id: i64, need: Need) -> Result<i64> {
    let mut through = stream.partitions_through;
    match need {
        Need::Now if id >= stream.partitions_through => {
            through = added(ADD.run(client, 0, &[stream.id.into(), id.into(), true.into()])?, through)?;
        }
        Need::Ahead if needs_more(stream, id) => {
            let upto = id.saturating_add(headroom(stream.partition_size));
            through = added(ADD.run(client, 0, &[stream.id.into(), upto.into(), false.into()])?, through)?;
        }
        _ => {}
    }
    Ok(through)
}

/// What `add_partitions` says the stream's partitions now reach (`known` when it left the
/// work to another transaction).
fn added(rows: pgrx::spi::SpiTupleTable<'_>, known: i64) -> Result<i64> {
    Ok(rows.first().value::<i64>("through")?.map_or(known, |through| through.max(known)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stream(partition_size: i64, partitions_through: i64) -> StreamRef {
        StreamRef { id: 1, partition_size, partitions_through, lanes: 16 }
    }

    #[test]
    fn headroom_is_half_a_partition() {
        let s = stream(1000, 1001); // one partition: ids 1..=1000
        assert!(!needs_more(&s, 499));
        assert!(needs_more(&s, 501));
        assert!(needs_more(&s, 5000));
        let tiny = stream(1, 2);
        assert!(needs_more(&tiny, 1));
    }
}
