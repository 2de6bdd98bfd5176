//! A lane's next messages, read straight from a partition's key as the executor's index scan
//! reads them, without a statement.
//!
//! A claim reads up to a batch of one lane's messages (`message::after`). Run through SPI, that
//! statement cost about as much around its scan as in it: the plan cache's check, a portal, the
//! executor's start and end, and a copy of every row into SPI's table. Here the partition's
//! primary key, `(lane, id)`, is scanned with three keys (`lane = l`, `id > after`,
//! `id <= upto`: the scan stops at the bound), with the snapshot SPI takes for such a statement:
//! the command counter advanced, then a new snapshot (claims run under READ COMMITTED). Each
//! visible row is deformed once and handed to the caller, which copies what it keeps before the
//! scan moves on. The partition and its key are locked as the statement locks them (ACCESS
//! SHARE, to the transaction's end).
//!
//! A partition of another shape than the install script's is read by the statement instead:
//! not a plain heap table, or one with inheritance children (a detached partition a DBA kept
//! under its name), a column missing, of another type or generated, row security enabled
//! (conservatively: the claim reads as the extension's owner, whom it does not apply to), or a
//! primary key other than an ascending btree on `(lane, id)` with the integer operators.

use pgrx::pg_sys;
use pgrx::PgRelation;

use crate::error::Result;
use crate::partition::LOG_COLUMNS;
use crate::statement::{self, probe, Row};

/// Which messages of a lane to read: ids in `(after, upto]`, at most `limit` of them.
#[derive(Clone, Copy, Debug)]
pub struct LaneRange {
    pub lane: i32,
    pub after: i64,
    pub upto: i64,
    pub limit: i32,
}

/// `read` of each row of `range` in partition `oid`, in id order, its values those of `columns`
/// (columns of the log, by name) in that order; `None` when the partition is not of the shape
/// this reads, having read nothing. Called inside the claim's SPI connection.
pub fn lane_after<T>(
    oid: pg_sys::Oid,
    columns: &[&str],
    range: LaneRange,
    mut read: impl FnMut(&Row<'_>) -> Result<T>,
) -> Result<Option<Vec<T>>> {
    if range.limit <= 0 || range.upto <= range.after {
        return Ok(Some(vec![]));
    }
    // SAFETY: the partition is locked and opened by oid in a transaction (the caller holds the
    // log's lock, under which no partition is dropped: src/partition.rs), and closed when
    // `heap` drops; an ERROR aborts the transaction, whose resource owner releases what is open.
    let heap = unsafe {
        pg_sys::LockRelationOid(oid, pg_sys::AccessShareLock as pg_sys::LOCKMODE);
        PgRelation::with_lock(oid, pg_sys::NoLock as pg_sys::LOCKMODE)
    };
    let Some(attnums) = attnums(&heap, columns) else { return Ok(None) };
    let Some(index) = key_index(&heap) else { return Ok(None) };
    let snapshot = probe::Snapshot::take();
    // SAFETY: both relations are open and locked, `index` is `heap`'s key as `key_index` found
    // it, `attnums` are `heap`'s, and the snapshot is registered.
    let found = unsafe { scan(&heap, &index, snapshot.as_ptr(), &attnums, range, &mut read) };
    found.map(Some)
}

/// The rows of `range`, each handed to `read` while the scan is on it.
///
/// # Safety
/// `heap` and `index` are open and locked, `index` being `key_index(heap)`; `attnums` are
/// `attnums(heap, ..)`; `snapshot` is registered.
unsafe fn scan<T>(
    heap: &PgRelation,
    index: &PgRelation,
    snapshot: pg_sys::Snapshot,
    attnums: &[(usize, pg_sys::Oid)],
    range: LaneRange,
    read: &mut impl FnMut(&Row<'_>) -> Result<T>,
) -> Result<Vec<T>> {
    // SAFETY: the caller's promises. The keys are on the index's two columns, int4 and int8
    // (`key_index`), with the integer family's operators; the slot is the heap's own kind.
    unsafe {
        #[cfg(not(feature = "pg18"))]
        let scan = pg_sys::index_beginscan(heap.as_ptr(), index.as_ptr(), snapshot, 3, 0);
        #[cfg(feature = "pg18")]
        let scan = pg_sys::index_beginscan(heap.as_ptr(), index.as_ptr(), snapshot, std::ptr::null_mut(), 3, 0);
        let mut keys: [pg_sys::ScanKeyData; 3] = std::mem::zeroed();
        let mut key = |at: usize, column: i16, strategy: u32, procedure: u32, value: pg_sys::Datum| {
            pg_sys::ScanKeyInit(&mut keys[at], column, strategy as u16, pg_sys::Oid::from(procedure), value)
        };
        key(0, 1, pg_sys::BTEqualStrategyNumber, pg_sys::F_INT4EQ, range.lane.into());
        key(1, 2, pg_sys::BTGreaterStrategyNumber, pg_sys::F_INT8GT, range.after.into());
        key(2, 2, pg_sys::BTLessEqualStrategyNumber, pg_sys::F_INT8LE, range.upto.into());
        pg_sys::index_rescan(scan, keys.as_mut_ptr(), 3, std::ptr::null_mut(), 0);
        let slot = pg_sys::table_slot_create(heap.as_ptr(), std::ptr::null_mut());
        let caller = statement::caller_context();
        let types: Vec<pg_sys::Oid> = attnums.iter().map(|(_, type_oid)| *type_oid).collect();
        let mut values = vec![pg_sys::Datum::from(0); attnums.len()];
        let mut nulls = vec![true; attnums.len()];
        let mut found = Vec::new();
        let mut failed = None;
        while found.len() < range.limit as usize
            && pg_sys::index_getnext_slot(scan, pg_sys::ScanDirection::ForwardScanDirection, slot)
        {
            pgrx::check_for_interrupts!();
            pg_sys::slot_getallattrs(slot);
            for (i, (attnum, _)) in attnums.iter().enumerate() {
                values[i] = *(*slot).tts_values.add(attnum - 1);
                nulls[i] = *(*slot).tts_isnull.add(attnum - 1);
            }
            // The values are the row's in the heap's buffer, of `types`, until the scan moves on.
            match read(&Row::of(&values, &nulls, &types, caller)) {
                Ok(row) => found.push(row),
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
        }
        pg_sys::ExecDropSingleTupleTableSlot(slot);
        pg_sys::index_endscan(scan);
        failed.map_or(Ok(found), Err)
    }
}

/// The attribute number and type of each of `columns` in `heap`, a plain heap table without
/// inheritance children or row security; `None` when it is not one, or when a column is missing,
/// generated, or of another type than the log's.
fn attnums(heap: &PgRelation, columns: &[&str]) -> Option<Vec<(usize, pg_sys::Oid)>> {
    if !probe::plain(heap) {
        return None;
    }
    columns
        .iter()
        .map(|name| {
            let (column, type_oid, _) = LOG_COLUMNS.iter().find(|(column, _, _)| column == name)?;
            Some((probe::column(heap, column, *type_oid)?.attnum, *type_oid))
        })
        .collect()
}

/// `heap`'s primary key, opened and locked as an index scan locks it, when it is the log's: a
/// btree on `(lane, id)` (int4 and int8, which the scan's keys compare as such), both ascending,
/// with the integer operators, and usable by every snapshot (no `indcheckxmin`, which makes the
/// planner wait before it uses an index built over broken HOT chains).
fn key_index(heap: &PgRelation) -> Option<PgRelation> {
    let (lane, id) =
        (probe::column(heap, "lane", pg_sys::INT4OID)?.attnum, probe::column(heap, "id", pg_sys::INT8OID)?.attnum);
    // SAFETY: the relation is open; the oid it names is an index of it, locked then opened, and
    // closed when `index` drops.
    unsafe {
        #[cfg(not(feature = "pg18"))]
        let oid = pg_sys::RelationGetPrimaryKeyIndex(heap.as_ptr());
        #[cfg(feature = "pg18")]
        let oid = pg_sys::RelationGetPrimaryKeyIndex(heap.as_ptr(), false);
        if oid == pg_sys::InvalidOid {
            return None;
        }
        pg_sys::LockRelationOid(oid, pg_sys::AccessShareLock as pg_sys::LOCKMODE);
        let index = PgRelation::with_lock(oid, pg_sys::NoLock as pg_sys::LOCKMODE);
        let form = &*index.rd_index;
        let key = form.indkey.values.as_slice(form.indnatts as usize);
        let ascending = |i: usize| *index.rd_indoption.add(i) as u32 & pg_sys::INDOPTION_DESC == 0;
        let integers = |i: usize| *index.rd_opfamily.add(i) == pg_sys::INTEGER_BTREE_FAM_OID;
        let fits = form.indnkeyatts == 2
            && !form.indcheckxmin
            && key[0] as usize == lane
            && key[1] as usize == id
            && ascending(0)
            && ascending(1)
            && integers(0)
            && integers(1);
        fits.then_some(index)
    }
}
