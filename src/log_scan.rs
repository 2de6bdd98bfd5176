//! Reading a lane's next messages straight from a partition's key, as the executor's index scan
//! does, without a statement.
//!
//! A claim reads up to a batch of one lane's messages (`message::after`). Run through SPI, that
//! statement cost about as much around its scan as in it: the plan cache's check, a portal, the
//! executor's start and end, and a copy of every row into SPI's table. Here the partition's
//! primary key, `(lane, id)`, is scanned with three keys (`lane = l`, `id > after`,
//! `id <= upto`, which stop the scan at the bound), with the snapshot SPI would take for the
//! statement: the command counter advanced, then the transaction's snapshot (a new one under READ
//! COMMITTED). Each visible row is deformed once and handed to the caller, which copies what it
//! keeps before the scan moves on. The partition is locked as the statement would lock it
//! (ACCESS SHARE, to the transaction's end).
//!
//! A partition that is not of the install script's shape (a column missing or of another type,
//! another primary key, row security) is read by the statement instead, which honours it.

use std::ffi::CStr;

use pgrx::pg_sys;
use pgrx::{PgMemoryContexts, PgTupleDesc};

use crate::error::Result;
use crate::statement::Row;

/// Which messages of a lane to read: ids in `(after, upto]`, at most `limit` of them.
#[derive(Clone, Copy, Debug)]
pub struct LaneRange {
    pub lane: i32,
    pub after: i64,
    pub upto: i64,
    pub limit: i32,
}

/// `read` of each row of `range` in partition `oid`, in id order, its values in the order of
/// `columns` (each a name and type of the log); `None` when the partition is not of the shape
/// this reads, having read nothing.
pub fn lane_after<T>(
    oid: pg_sys::Oid,
    columns: &[(&CStr, pg_sys::Oid)],
    range: LaneRange,
    mut read: impl FnMut(&Row<'_>) -> Result<T>,
) -> Result<Option<Vec<T>>> {
    if range.limit <= 0 || range.upto <= range.after {
        return Ok(Some(vec![]));
    }
    // SAFETY: the partition is opened (and locked) by oid in a transaction; the caller holds the
    // log's lock, under which no partition is dropped (src/partition.rs). Everything opened here
    // is closed before returning; an ERROR in between aborts the transaction, whose resource
    // owner releases the scan, the slot's buffer pin and the snapshot.
    unsafe {
        let heap = pg_sys::relation_open(oid, pg_sys::AccessShareLock as pg_sys::LOCKMODE);
        let Some(attnums) = attnums(heap, columns) else {
            pg_sys::relation_close(heap, pg_sys::NoLock as pg_sys::LOCKMODE);
            return Ok(None);
        };
        let Some(index) = key_index(heap) else {
            pg_sys::relation_close(heap, pg_sys::NoLock as pg_sys::LOCKMODE);
            return Ok(None);
        };
        // What SPI does before a statement that may write: the call's earlier statements are
        // seen, and a new snapshot is taken under READ COMMITTED.
        pg_sys::CommandCounterIncrement();
        let snapshot = pg_sys::RegisterSnapshot(pg_sys::GetTransactionSnapshot());
        let found = scan(heap, index, snapshot, &attnums, columns, range, &mut read);
        pg_sys::UnregisterSnapshot(snapshot);
        pg_sys::index_close(index, pg_sys::NoLock as pg_sys::LOCKMODE);
        pg_sys::relation_close(heap, pg_sys::NoLock as pg_sys::LOCKMODE);
        found.map(Some)
    }
}

/// The rows of `range`, each handed to `read` while the scan is on it.
///
/// # Safety
/// `heap` and `index` are open and locked, `index` being `key_index(heap)`; `attnums` are
/// `attnums(heap, columns)`; `snapshot` is registered.
unsafe fn scan<T>(
    heap: pg_sys::Relation,
    index: pg_sys::Relation,
    snapshot: pg_sys::Snapshot,
    attnums: &[usize],
    columns: &[(&CStr, pg_sys::Oid)],
    range: LaneRange,
    read: &mut impl FnMut(&Row<'_>) -> Result<T>,
) -> Result<Vec<T>> {
    // SAFETY: the caller's promises; the keys are on the index's two int columns with the
    // integer family's operators, and the slot fits the heap.
    unsafe {
        #[cfg(not(feature = "pg18"))]
        let scan = pg_sys::index_beginscan(heap, index, snapshot, 3, 0);
        #[cfg(feature = "pg18")]
        let scan = pg_sys::index_beginscan(heap, index, snapshot, std::ptr::null_mut(), 3, 0);
        let mut keys: [pg_sys::ScanKeyData; 3] = std::mem::zeroed();
        let key =
            |entry: &mut pg_sys::ScanKeyData, column: i16, strategy: u32, procedure: u32, value: pg_sys::Datum| {
                pg_sys::ScanKeyInit(entry, column, strategy as u16, pg_sys::Oid::from(procedure), value)
            };
        key(&mut keys[0], 1, pg_sys::BTEqualStrategyNumber, pg_sys::F_INT4EQ, range.lane.into());
        key(&mut keys[1], 2, pg_sys::BTGreaterStrategyNumber, pg_sys::F_INT8GT, range.after.into());
        key(&mut keys[2], 2, pg_sys::BTLessEqualStrategyNumber, pg_sys::F_INT8LE, range.upto.into());
        pg_sys::index_rescan(scan, keys.as_mut_ptr(), 3, std::ptr::null_mut(), 0);
        let slot = pg_sys::table_slot_create(heap, std::ptr::null_mut());
        // Values the caller keeps are copied where `Deformed` copies them: the parent of SPI's
        // context, which outlives the call's SPI connection.
        let caller =
            PgMemoryContexts::CurrentMemoryContext.parent().expect("SPI runs in a context of its caller").value();
        let types: Vec<pg_sys::Oid> = columns.iter().map(|(_, oid)| *oid).collect();
        let mut values = vec![pg_sys::Datum::from(0); columns.len()];
        let mut nulls = vec![true; columns.len()];
        let mut found = Vec::with_capacity(range.limit as usize);
        let mut failed = None;
        while found.len() < range.limit as usize
            && pg_sys::index_getnext_slot(scan, pg_sys::ScanDirection::ForwardScanDirection, slot)
        {
            pgrx::check_for_interrupts!();
            pg_sys::slot_getallattrs(slot);
            for (i, &attnum) in attnums.iter().enumerate() {
                values[i] = *(*slot).tts_values.add(attnum - 1);
                nulls[i] = *(*slot).tts_isnull.add(attnum - 1);
            }
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
        match failed {
            Some(e) => Err(e),
            None => Ok(found),
        }
    }
}

/// The attribute number of each of `columns` in `heap`, found by name and of its type; `None`
/// when one is missing or of another type, or when `heap` is not a plain table without row
/// security.
///
/// # Safety
/// `heap` is open.
unsafe fn attnums(heap: pg_sys::Relation, columns: &[(&CStr, pg_sys::Oid)]) -> Option<Vec<usize>> {
    // SAFETY: an open relation's catalog row and tuple descriptor.
    unsafe {
        let class = &*(*heap).rd_rel;
        if class.relkind != pg_sys::RELKIND_RELATION as std::ffi::c_char || class.relrowsecurity {
            return None;
        }
        let desc = PgTupleDesc::from_pg_unchecked((*heap).rd_att);
        columns.iter().map(|(name, type_oid)| column(&desc, name, *type_oid)).collect()
    }
}

/// The attribute number of `heap`'s column `name` of type `type_oid`.
///
/// # Safety
/// `desc` is an open relation's.
unsafe fn column(desc: &PgTupleDesc<'_>, name: &CStr, type_oid: pg_sys::Oid) -> Option<usize> {
    // SAFETY: attribute names are NUL-terminated.
    desc.iter()
        .position(|a| {
            !a.attisdropped && a.atttypid == type_oid && unsafe { CStr::from_ptr(a.attname.data.as_ptr()) } == name
        })
        .map(|i| i + 1)
}

/// `heap`'s primary key, opened and locked, when it is the log's: a btree on `(lane, id)` (int4
/// and int8, which the scan's keys compare as such), both ascending, with the integer operators.
///
/// # Safety
/// `heap` is open.
unsafe fn key_index(heap: pg_sys::Relation) -> Option<pg_sys::Relation> {
    // SAFETY: catalog reads of an open relation and of the index it names; the index is opened
    // with the lock an index scan takes, and closed again when it is not the log's key.
    unsafe {
        #[cfg(not(feature = "pg18"))]
        let oid = pg_sys::RelationGetPrimaryKeyIndex(heap);
        #[cfg(feature = "pg18")]
        let oid = pg_sys::RelationGetPrimaryKeyIndex(heap, false);
        if oid == pg_sys::InvalidOid {
            return None;
        }
        let index = pg_sys::index_open(oid, pg_sys::AccessShareLock as pg_sys::LOCKMODE);
        let form = &*(*index).rd_index;
        let key = form.indkey.values.as_slice(form.indnatts as usize);
        let desc = PgTupleDesc::from_pg_unchecked((*heap).rd_att);
        let attnum = |name, type_oid| column(&desc, name, type_oid).map_or(0, |n| n as i16);
        let ascending = |i: usize| *(*index).rd_indoption.add(i) as u32 & pg_sys::INDOPTION_DESC == 0;
        let integers = |i: usize| *(*index).rd_opfamily.add(i) == pg_sys::INTEGER_BTREE_FAM_OID;
        let fits = (*(*index).rd_rel).relam == pg_sys::BTREE_AM_OID
            && form.indisvalid
            && form.indnkeyatts == 2
            && key.len() >= 2
            && key[0] == attnum(c"lane", pg_sys::INT4OID)
            && key[1] == attnum(c"id", pg_sys::INT8OID)
            && key[0] != 0
            && key[1] != 0
            && ascending(0)
            && ascending(1)
            && integers(0)
            && integers(1);
        if fits {
            Some(index)
        } else {
            pg_sys::index_close(index, pg_sys::NoLock as pg_sys::LOCKMODE);
            None
        }
    }
}
