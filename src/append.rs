//! Appending messages to the log, as `COPY` does: each partition's rows in one call of its
//! table's `multi_insert`, then their index entries.
//!
//! An `INSERT` writes one WAL record per row, and its header, block reference and tuple header
//! come to about 45 bytes beside a message of 250. `multi_insert` writes one record per heap page
//! for all the rows it puts there, with 8 bytes of its own per row. It also skips the executor's
//! work per row (a plan, `sqlstreams.lane` called in SQL, the partition routing). And the rows go
//! in lane order, which an `INSERT` would pay a sort for.
//!
//! Only partitions of the shape the install script makes are written this way: attached to the
//! log with bounds that hold their ids, the log's columns in their order with their NOT NULLs, no
//! trigger, rule or row security on them or on the log, no check but the concurrency one, no
//! identity or generated column, no deferrable index, heap storage, no partition being detached,
//! and `produced_at` defaulting to `now()`. Anything a DBA
//! added (an audit trigger, a check, a column, a constraint) sends the whole produce to the
//! `INSERT` (src/produce.rs), which honours it; that is decided before the first row is written.
//! The rows' values are what that `INSERT` writes: its defaults (`produced_at` is the
//! transaction's start, `now()`) and `sqlstreams.lane` (src/stream.rs `lane`); a test
//! compares the two. Rows go in chunks (`CHUNK`, `CHUNK_BYTES`), as COPY flushes its buffers, so
//! a large batch holds no more than a chunk's tuples at once and answers a cancel between chunks.

use std::ops::Range;

use pgrx::pg_sys;
use pgrx::{IntoDatum, PgMemoryContexts, PgRelation};

use crate::concurrency::Concurrency;
use crate::partition::{self, Writable, LOG_COLUMNS};
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

/// Rows per `multi_insert` call, and bytes of payloads and headers after which a chunk ends (COPY
/// flushes its buffers at 1,000 rows or 64 kB).
const CHUNK: usize = 1000;
const CHUNK_BYTES: usize = 64 * 1024;

/// Appends `messages` (ids in order, every partition locked for the insert); `false` when the
/// log or a partition is not of the shape this writes, having written nothing: the caller
/// inserts them with SQL.
pub fn append(stream: &StreamRef, target: &Writable, messages: &[Message<'_>], shared: &Shared) -> bool {
    if messages.is_empty() {
        return true;
    }
    // SAFETY: the log and its partitions are locked ROW EXCLUSIVE by this transaction
    // (partition::lock_for_insert); they are opened without another lock and closed on drop.
    let log = unsafe { PgRelation::with_lock(target.log, pg_sys::NoLock as pg_sys::LOCKMODE) };
    if !plain(&log, None) || detaching(&log) {
        return false;
    }
    // Each partition with its messages (ids in order, partitions oldest first).
    let mut partitions: Vec<(PgRelation, Range<usize>)> = Vec::with_capacity(target.partitions.len());
    let mut start = 0;
    for &(part, oid) in &target.partitions {
        let end = start + messages[start..].iter().take_while(|m| partition::of(stream, m.id) == part).count();
        if end > start {
            let (first, last) = (messages[start].id, messages[end - 1].id);
            let Some(oid) = oid.filter(|&oid| routes_to(&log, oid, first, last)) else { return false };
            // SAFETY: as above.
            let relation = unsafe { PgRelation::with_lock(oid, pg_sys::NoLock as pg_sys::LOCKMODE) };
            if !plain(&relation, Some(stream.id)) {
                return false;
            }
            partitions.push((relation, start..end));
        }
        start = end;
    }
    assert_eq!(start, messages.len(), "every message has a partition in the target");
    let mut scratch = PgMemoryContexts::new("sqlstreams append");
    // SAFETY: everything allocated in the scratch context is used before it is deleted (its
    // drop); the executor state and the indexes are set up as COPY sets them up, and closed.
    unsafe {
        scratch.switch_to(|_| {
            let estate = pg_sys::CreateExecutorState();
            let mut opened = Vec::with_capacity(partitions.len());
            for (relation, _) in &partitions {
                let info = open_indexes(relation);
                opened.push(info);
                if !immediate(info) {
                    opened.into_iter().for_each(|info| pg_sys::ExecCloseIndices(info));
                    pg_sys::FreeExecutorState(estate);
                    return false;
                }
            }
            let values = Values::new(shared);
            for ((relation, range), &info) in partitions.iter().zip(&opened) {
                write(relation, info, estate, &messages[range.clone()], &values, stream.lanes);
            }
            opened.into_iter().for_each(|info| pg_sys::ExecCloseIndices(info));
            pg_sys::FreeExecutorState(estate);
            true
        })
    }
}

/// A slice of `count` items at `items`, which Postgres leaves NULL for none.
unsafe fn items<'a, T>(items: *const T, count: i32) -> &'a [T] {
    if items.is_null() || count <= 0 {
        return &[];
    }
    // SAFETY: the caller's array has `count` items.
    unsafe { std::slice::from_raw_parts(items, count as usize) }
}

/// Whether a partition of `log` is being detached (`DETACH PARTITION ... CONCURRENTLY`): whether an
/// `INSERT` still routes to it depends on its snapshot, which is not this call's to take.
fn detaching(log: &PgRelation) -> bool {
    // SAFETY: as in `routes_to`.
    unsafe { (*pg_sys::RelationGetPartitionDesc(log.as_ptr(), false)).detached_exist }
}

/// Whether an `INSERT` into `log` routes ids `first..=last` to `partition`: it is attached (a
/// table of the partition's name may be detached, or being detached), and its bounds, which a DBA
/// may have attached it with, hold them. Partitions are in id order, so the ones a producer
/// writes are found from the end.
fn routes_to(log: &PgRelation, partition: pg_sys::Oid, first: i64, last: i64) -> bool {
    // SAFETY: the descriptor of a partitioned table this transaction has locked, kept in its
    // relcache entry while the relation is open; a range bound's arrays have `ndatums` entries
    // of one datum (the log has one key column, `id`, an int8 passed by value).
    unsafe {
        let desc = &*pg_sys::RelationGetPartitionDesc(log.as_ptr(), true);
        let Some(index) = items(desc.oids, desc.nparts).iter().rposition(|&oid| oid == partition) else {
            return false;
        };
        let Some(bounds) = desc.boundinfo.as_ref() else { return false };
        if bounds.strategy as u32 != u32::from(b'r') {
            return false;
        }
        // For range partitions, indexes[j] is the partition whose upper bound is datums[j]; its
        // lower bound is datums[j - 1] (PostgreSQL's partbounds.c).
        let (datums, kinds) = (items(bounds.datums, bounds.ndatums), items(bounds.kind, bounds.ndatums));
        let Some(j) = items(bounds.indexes, bounds.nindexes).iter().rposition(|&i| i == index as i32) else {
            return false;
        };
        let bound = |k: usize| {
            (k < datums.len() && *kinds[k] == pg_sys::PartitionRangeDatumKind::PARTITION_RANGE_DATUM_VALUE)
                .then(|| (*datums[k]).value() as i64)
        };
        matches!((j.checked_sub(1).and_then(bound), bound(j)), (Some(lower), Some(upper)) if lower <= first && last < upper)
    }
}

/// Whether `relation` is the log (`stream` `None`) or one of its partitions as the install script
/// makes them.
fn plain(relation: &PgRelation, stream: Option<i64>) -> bool {
    // SAFETY: reads an open relation's descriptor and catalog row.
    unsafe {
        // The relcache's triggers and rules, not pg_class's flags, which stay set until a vacuum
        // after the last one is dropped.
        let form = &*relation.rd_rel;
        if !relation.trigdesc.is_null() || !relation.rd_rules.is_null() || form.relrowsecurity {
            return false;
        }
        let Some(stream_id) = stream else { return produced_at_is_now(relation) };
        if form.relkind != pg_sys::RELKIND_RELATION as std::ffi::c_char || form.relam != pg_sys::HEAP_TABLE_AM_OID {
            return false;
        }
        let desc = relation.tuple_desc();
        if desc.len() != LOG_COLUMNS.len() {
            return false;
        }
        let columns_match = desc.iter().zip(LOG_COLUMNS).all(|(attribute, (name, type_oid, not_null))| {
            !attribute.attisdropped
                && attribute.attgenerated == 0
                && attribute.attidentity == 0
                && attribute.atttypid == type_oid
                && attribute.attnotnull == not_null
                && partition::is_named(attribute, name)
        });
        if !columns_match {
            return false;
        }
        // The concurrency check, and no other: the values are checked here (`Concurrency`).
        let constraints = (*relation.rd_att).constr;
        constraints.is_null() || {
            let concurrency_check = format!("message_log_{stream_id}_concurrency_check");
            items((*constraints).check, i32::from((*constraints).num_check))
                .iter()
                .all(|check| std::ffi::CStr::from_ptr(check.ccname).to_bytes() == concurrency_check.as_bytes())
        }
    }
}

/// Whether the log's `produced_at` defaults to `now()`, as the install script makes it: an
/// `INSERT` into the log takes the log's default, and this writes the transaction's start.
fn produced_at_is_now(log: &PgRelation) -> bool {
    // SAFETY: reads an open relation's descriptor and its defaults' node strings.
    unsafe {
        let desc = log.tuple_desc();
        let Some(position) =
            desc.iter().position(|attribute| !attribute.attisdropped && partition::is_named(attribute, "produced_at"))
        else {
            return false;
        };
        let constraints = (*log.rd_att).constr;
        if constraints.is_null() {
            return false;
        }
        let now = format!("{{FUNCEXPR :funcid {} ", pg_sys::F_NOW);
        items((*constraints).defval, i32::from((*constraints).num_defval)).iter().any(|default| {
            default.adnum as usize == position + 1 && {
                let expression = std::ffi::CStr::from_ptr(default.adbin).to_string_lossy();
                expression.starts_with(&now) && expression.contains(":args <>")
            }
        })
    }
}

/// A result relation for `relation` with its indexes open, as COPY sets one up.
unsafe fn open_indexes(relation: &PgRelation) -> *mut pg_sys::ResultRelInfo {
    // SAFETY: InitResultRelInfo initializes the zeroed node; ExecOpenIndices opens the indexes
    // with the lock an insert takes (ExecCloseIndices closes them).
    unsafe {
        let info = pg_sys::palloc0(std::mem::size_of::<pg_sys::ResultRelInfo>()).cast::<pg_sys::ResultRelInfo>();
        pg_sys::InitResultRelInfo(info, relation.as_ptr(), 1, std::ptr::null_mut(), 0);
        pg_sys::ExecOpenIndices(info, false);
        info
    }
}

/// Whether every index of `info` checks at once (a deferrable unique or exclusion constraint's
/// check waits for the executor's after-trigger queue).
unsafe fn immediate(info: *mut pg_sys::ResultRelInfo) -> bool {
    // SAFETY: the index relations ExecOpenIndices opened.
    unsafe {
        items((*info).ri_IndexRelationDescs, (*info).ri_NumIndices)
            .iter()
            .all(|&index| (*(*index).rd_index).indimmediate)
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

/// Writes `messages` into one partition, in lane order, a chunk at a time.
unsafe fn write(
    relation: &PgRelation,
    info: *mut pg_sys::ResultRelInfo,
    estate: *mut pg_sys::EState,
    messages: &[Message<'_>],
    values: &Values,
    lanes: i32,
) {
    // A lane's messages of the batch side by side in the heap: a claim reads its lane's next
    // messages (src/message.rs), a keyed lane's every sixteenth or so, from fewer pages.
    let mut rows: Vec<(i32, &Message<'_>)> =
        messages.iter().map(|m| (crate::stream::lane(m.key, m.id, lanes), m)).collect();
    rows.sort_unstable_by_key(|(lane, message)| (*lane, message.id));
    let mut chunk_memory = PgMemoryContexts::new("sqlstreams append chunk");
    let mut begin = 0;
    while begin < rows.len() {
        let (mut end, mut bytes) = (begin, 0);
        while end < rows.len() && end - begin < CHUNK && bytes < CHUNK_BYTES {
            bytes += size(rows[end].1);
            end += 1;
        }
        let chunk = &rows[begin..end];
        begin = end;
        pgrx::check_for_interrupts!();
        // SAFETY: slots of the relation's own kind, filled and stored as virtual tuples, handed
        // to the table's multi_insert (which sets their tids) and then to the indexes; the
        // chunk's allocations (slots, tuples, keys) go with the chunk.
        unsafe {
            chunk_memory.switch_to(|_| {
                let raw = relation.as_ptr();
                let mut slots: Vec<*mut pg_sys::TupleTableSlot> =
                    chunk.iter().map(|&(lane, message)| fill(raw, message, lane, values)).collect();
                let command = pg_sys::GetCurrentCommandId(true);
                pg_sys::table_multi_insert(
                    raw,
                    slots.as_mut_ptr(),
                    slots.len() as i32,
                    command,
                    0,
                    std::ptr::null_mut(),
                );
                for &slot in &slots {
                    insert_index_entries(info, slot, estate);
                }
                slots.into_iter().for_each(|slot| pg_sys::ExecDropSingleTupleTableSlot(slot));
            });
            chunk_memory.reset();
        }
    }
}

/// The bytes of `message`'s payload and headers as they are in memory.
fn size(message: &Message<'_>) -> usize {
    // SAFETY: both are varlena datums (jsonb).
    let varlena = |datum: pg_sys::Datum| unsafe { pgrx::varlena::varsize_any(datum.cast_mut_ptr()) };
    varlena(message.payload) + message.headers.map_or(0, varlena)
}

/// A slot of `relation` holding `message`'s row.
unsafe fn fill(
    relation: pg_sys::Relation,
    message: &Message<'_>,
    lane: i32,
    values: &Values,
) -> *mut pg_sys::TupleTableSlot {
    // SAFETY: a new slot has `natts` values and nulls (the partition's, checked by `plain`).
    unsafe {
        let slot = pg_sys::table_slot_create(relation, std::ptr::null_mut());
        let datums = std::slice::from_raw_parts_mut((*slot).tts_values, LOG_COLUMNS.len());
        let nulls = std::slice::from_raw_parts_mut((*slot).tts_isnull, LOG_COLUMNS.len());
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
    }
}

/// The index entries of the row in `slot`, written at its tid; its expression memory freed after.
unsafe fn insert_index_entries(
    info: *mut pg_sys::ResultRelInfo,
    slot: *mut pg_sys::TupleTableSlot,
    estate: *mut pg_sys::EState,
) {
    // SAFETY: the indexes are open (`open_indexes`) and immediate (`immediate`): nothing is
    // left for a recheck.
    unsafe {
        #[cfg(feature = "pg15")]
        let recheck =
            pg_sys::ExecInsertIndexTuples(info, slot, estate, false, false, std::ptr::null_mut(), std::ptr::null_mut());
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
        let per_tuple = (*estate).es_per_tuple_exprcontext;
        if !per_tuple.is_null() {
            pg_sys::MemoryContextReset((*per_tuple).ecxt_per_tuple_memory);
        }
    }
}
