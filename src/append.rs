//! Appending messages to the log, as `COPY` does: each partition's rows in one call of its
//! table's `multi_insert`, then their index entries.
//!
//! An `INSERT` writes one WAL record per row, and its header, block reference and tuple header
//! come to about 45 bytes beside a message of 250. `multi_insert` writes one record per heap page
//! for all the rows it puts there, with 8 bytes of its own per row. It also skips the executor's
//! work per row (a plan, `sqlstreams.lane` called in SQL, the partition routing). And the rows go
//! in lane order, which an `INSERT` would pay a sort for.
//!
//! Only a partition of the shape the install script makes is written this way: attached to the
//! log, the log's columns in their order, no trigger, rule or row security on it or on the log,
//! no check but the concurrency one, and no deferred unique index. Anything a DBA added (an audit trigger, a
//! check, a column) sends the produce to the `INSERT` (src/produce.rs), which honours it. The
//! rows' values are what that `INSERT` writes: its defaults (`produced_at` is the transaction's
//! start, `now()`) and `sqlstreams.lane` (src/lanes.rs `of_message`); a test compares the two.

use pgrx::pg_sys;
use pgrx::{IntoDatum, PgMemoryContexts, PgRelation};

use crate::concurrency::Concurrency;
use crate::partition::{self, Writable};
use crate::stream::StreamRef;

/// One message to append.
pub struct Message<'a> {
    pub id: i64,
    pub key: Option<&'a str>,
    /// A jsonb datum.
    pub payload: pg_sys::Datum,
    /// A jsonb datum (a JSON object).
    pub headers: Option<pg_sys::Datum>,
}

/// What every message of one produce shares.
pub struct Shared {
    pub concurrency: Option<Concurrency>,
    pub compaction: bool,
    pub deliver_after: Option<pgrx::datum::Interval>,
}

/// The log's columns, in their order in every partition (install script, `message_log_@id@`).
const COLUMNS: [(&str, pg_sys::Oid); 9] = [
    ("id", pg_sys::INT8OID),
    ("message_key", pg_sys::TEXTOID),
    ("concurrency", pg_sys::TEXTOID),
    ("compaction", pg_sys::BOOLOID),
    ("payload", pg_sys::JSONBOID),
    ("produced_at", pg_sys::TIMESTAMPTZOID),
    ("lane", pg_sys::INT4OID),
    ("headers", pg_sys::JSONBOID),
    ("deliver_at", pg_sys::TIMESTAMPTZOID),
];

/// Appends `messages` (ids in order, every partition locked for the insert); `false` when a
/// partition or the log is not of the shape this writes, having written nothing: the caller
/// inserts them with SQL.
pub fn append(stream: &StreamRef, target: &Writable, messages: &[Message<'_>], shared: &Shared) -> bool {
    if messages.is_empty() {
        return true;
    }
    // SAFETY: the log and its partitions are locked ROW EXCLUSIVE by this transaction
    // (partition::lock_for_insert); they are opened without another lock and closed on drop.
    let log = unsafe { PgRelation::with_lock(target.log, pg_sys::NoLock as pg_sys::LOCKMODE) };
    if !plain(&log, false, stream.id) {
        return false;
    }
    let mut partitions = Vec::with_capacity(target.partitions.len());
    for &(part, oid) in &target.partitions {
        let Some(oid) = oid else { return false };
        if !attached(&log, oid) {
            return false;
        }
        // SAFETY: as above.
        let relation = unsafe { PgRelation::with_lock(oid, pg_sys::NoLock as pg_sys::LOCKMODE) };
        if !plain(&relation, true, stream.id) {
            return false;
        }
        partitions.push((part, relation));
    }
    let mut scratch = PgMemoryContexts::new("sqlstreams append");
    // SAFETY: everything allocated in the scratch context is used before it is deleted (its
    // drop), and the rows written are in the partitions' buffers by then.
    unsafe {
        scratch.switch_to(|_| {
            let values = Values::new(shared);
            let mut start = 0;
            for (part, relation) in &partitions {
                let end = start + messages[start..].iter().take_while(|m| partition::of(stream, m.id) == *part).count();
                if !write(relation, &messages[start..end], &values, stream.lanes) {
                    // Only before the first row of the first partition: `write` checks the
                    // indexes before it writes.
                    assert_eq!(start, 0, "a partition's indexes changed under its lock");
                    return false;
                }
                start = end;
            }
            assert_eq!(start, messages.len(), "every message has a partition in the target");
            true
        })
    }
}

/// Whether `partition` is attached to `log` (not detached, nor being detached, as a table of
/// the partition's name may be): the partitions an `INSERT` into the log routes to. Partitions
/// are in id order, so the ones a producer writes are found from the end.
fn attached(log: &PgRelation, partition: pg_sys::Oid) -> bool {
    // SAFETY: the descriptor of a partitioned table this transaction has locked, kept in its
    // relcache entry while the relation is open.
    unsafe {
        let desc = &*pg_sys::RelationGetPartitionDesc(log.as_ptr(), true);
        std::slice::from_raw_parts(desc.oids, desc.nparts.max(0) as usize).iter().rev().any(|&oid| oid == partition)
    }
}

/// Whether `relation` is a log (or partition) as the install script makes it.
fn plain(relation: &PgRelation, partition: bool, stream_id: i64) -> bool {
    // SAFETY: reads an open relation's descriptor and catalog row.
    unsafe {
        // The relcache's triggers and rules, not pg_class's flags, which stay set until a vacuum
        // after the last one is dropped.
        let form = &*relation.rd_rel;
        if !relation.trigdesc.is_null() || !relation.rd_rules.is_null() || form.relrowsecurity {
            return false;
        }
        if !partition {
            return true;
        }
        if form.relkind != pg_sys::RELKIND_RELATION as std::ffi::c_char {
            return false;
        }
        let desc = relation.tuple_desc();
        if desc.len() != COLUMNS.len() {
            return false;
        }
        let columns_match = desc.iter().zip(COLUMNS).all(|(attribute, (name, type_oid))| {
            !attribute.attisdropped
                && attribute.attgenerated == 0
                && attribute.atttypid == type_oid
                && std::ffi::CStr::from_ptr(attribute.attname.data.as_ptr()).to_bytes() == name.as_bytes()
        });
        if !columns_match {
            return false;
        }
        // The concurrency check, and no other: the values are checked here (`Concurrency`).
        let constraints = (*relation.rd_att).constr;
        constraints.is_null() || {
            let constraints = &*constraints;
            let concurrency_check = format!("message_log_{stream_id}_concurrency_check");
            (0..constraints.num_check as usize).all(|i| {
                let check = &*constraints.check.add(i);
                std::ffi::CStr::from_ptr(check.ccname).to_bytes() == concurrency_check.as_bytes()
            })
        }
    }
}

/// The values every row shares, as datums.
struct Values {
    concurrency: Option<pg_sys::Datum>,
    compaction: pg_sys::Datum,
    produced_at: pg_sys::Datum,
    deliver_at: Option<pg_sys::Datum>,
}

impl Values {
    /// In the scratch context.
    unsafe fn new(shared: &Shared) -> Values {
        // SAFETY: the transaction's start time, as now() reads it, and a function call on datums.
        let now = unsafe { pg_sys::GetCurrentTransactionStartTimestamp() };
        let deliver_at = shared.deliver_after.map(|after| unsafe {
            pgrx::fcinfo::direct_function_call_as_datum(
                pg_sys::timestamptz_pl_interval,
                &[Some(pg_sys::Datum::from(now)), after.into_datum()],
            )
            .expect("now() plus an interval is a time")
        });
        Values {
            concurrency: shared.concurrency.and_then(|c| c.as_str().into_datum()),
            compaction: pg_sys::Datum::from(shared.compaction),
            produced_at: pg_sys::Datum::from(now),
            deliver_at,
        }
    }
}

/// Writes `messages` into one partition; `false` before writing anything when one of its
/// indexes is not immediate (a deferred unique check needs the executor's after-trigger).
unsafe fn write(relation: &PgRelation, messages: &[Message<'_>], values: &Values, lanes: i32) -> bool {
    // SAFETY: a minimal executor state and result relation, as COPY sets up, for the indexes;
    // slots of the relation's own kind; all freed before returning.
    unsafe {
        let raw = relation.as_ptr();
        let estate = pg_sys::CreateExecutorState();
        let info = pg_sys::palloc0(std::mem::size_of::<pg_sys::ResultRelInfo>()).cast::<pg_sys::ResultRelInfo>();
        pg_sys::InitResultRelInfo(info, raw, 1, std::ptr::null_mut(), 0);
        pg_sys::ExecOpenIndices(info, false);
        let indexes = std::slice::from_raw_parts((*info).ri_IndexRelationDescs, (*info).ri_NumIndices.max(0) as usize);
        if indexes.iter().any(|index| !(*(**index).rd_index).indimmediate) {
            pg_sys::ExecCloseIndices(info);
            pg_sys::FreeExecutorState(estate);
            return false;
        }
        // A lane's messages of the batch side by side in the heap: a claim reads its lane's next
        // messages (src/message.rs), a keyed lane's every sixteenth or so, from fewer pages.
        let mut rows: Vec<(i32, &Message<'_>)> =
            messages.iter().map(|m| (crate::lanes::of_message(m.key, m.id, lanes), m)).collect();
        rows.sort_unstable_by_key(|(lane, message)| (*lane, message.id));
        let mut slots: Vec<*mut pg_sys::TupleTableSlot> = rows
            .into_iter()
            .map(|(lane, message)| {
                let slot = pg_sys::table_slot_create(raw, std::ptr::null_mut());
                let datums = std::slice::from_raw_parts_mut((*slot).tts_values, COLUMNS.len());
                let nulls = std::slice::from_raw_parts_mut((*slot).tts_isnull, COLUMNS.len());
                let row = [
                    Some(pg_sys::Datum::from(message.id)),
                    message.key.and_then(IntoDatum::into_datum),
                    values.concurrency,
                    Some(values.compaction),
                    Some(message.payload),
                    Some(values.produced_at),
                    Some(pg_sys::Datum::from(lane)),
                    message.headers,
                    values.deliver_at,
                ];
                for (i, value) in row.into_iter().enumerate() {
                    datums[i] = value.unwrap_or(pg_sys::Datum::from(0));
                    nulls[i] = value.is_none();
                }
                pg_sys::ExecStoreVirtualTuple(slot)
            })
            .collect();
        let multi_insert = (*(*raw).rd_tableam).multi_insert.expect("a table access method inserts");
        let command = pg_sys::GetCurrentCommandId(true);
        multi_insert(raw, slots.as_mut_ptr(), slots.len() as i32, command, 0, std::ptr::null_mut());
        for &slot in &slots {
            #[cfg(feature = "pg15")]
            let recheck = pg_sys::ExecInsertIndexTuples(
                info,
                slot,
                estate,
                false,
                false,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
            );
            #[cfg(not(feature = "pg15"))]
            let recheck = pg_sys::ExecInsertIndexTuples(
                info,
                slot,
                estate,
                false,
                false,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                false,
            );
            assert!(recheck.is_null(), "immediate indexes need no recheck");
        }
        for slot in slots {
            pg_sys::ExecDropSingleTupleTableSlot(slot);
        }
        pg_sys::ExecCloseIndices(info);
        pg_sys::FreeExecutorState(estate);
        true
    }
}
