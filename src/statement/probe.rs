//! Whether a row exists, read straight from one of the extension's indexes without a statement.
//!
//! A question of an index entry or two (is there any such row?) costs a statement about 35,000
//! instructions around a probe of a few thousand: the plan cache's check, a portal, the
//! executor's start and end. Here the table and the index are opened and locked as the
//! statement's plan would lock them (ACCESS SHARE, to the transaction's end), the index is
//! scanned with its first column equal to a group's id, under a snapshot taken as SPI takes one
//! for a statement that may write (`Snapshot`), and each visible row is filtered as the
//! statement's `WHERE` would filter it, as src/message/scan.rs reads a lane.
//!
//! A table or an index not of the shape the install script made (another kind of table, row
//! security enabled, inheritance children, an index missing, not valid, not a btree over the
//! group's id first) is not read: the caller runs the statement instead.

use std::ffi::CString;

use pgrx::pg_sys;
use pgrx::PgRelation;

use super::{caller_context, Row};
use crate::error::Result;

/// The extension's table `name`, opened and locked, when it is a plain heap table without
/// inheritance children or row security (the extension's owner, whom the claim runs as, may be
/// subject to it when it is forced).
pub fn table(name: &str) -> Option<PgRelation> {
    lock_and_open(oid_of(name)?).filter(plain)
}

/// Whether `heap` is a plain heap table without inheritance children or row security.
pub fn plain(heap: &PgRelation) -> bool {
    let class = heap.rd_rel;
    // SAFETY: an open relation's catalog row.
    unsafe {
        (*class).relkind == pg_sys::RELKIND_RELATION as std::ffi::c_char
            && (*class).relam == pg_sys::HEAP_TABLE_AM_OID
            && !(*class).relhassubclass
            && !(*class).relrowsecurity
    }
}

/// An index of a table whose first key column is the table's `consumer_group_id` (`group_index`).
pub struct GroupIndex {
    index: PgRelation,
    heap: pg_sys::Oid,
}

impl GroupIndex {
    pub fn relation(&self) -> &PgRelation {
        &self.index
    }
}

/// The extension's index `name`, when it is a `group_index` of `heap`.
pub fn index(heap: &PgRelation, name: &str) -> Option<GroupIndex> {
    group_index(heap, lock_and_open(oid_of(name)?)?)
}

/// `heap`'s primary key, when it is a `group_index` of it.
pub fn primary_key(heap: &PgRelation) -> Option<GroupIndex> {
    // SAFETY: the relation is open.
    let oid = unsafe {
        #[cfg(not(feature = "pg18"))]
        let oid = pg_sys::RelationGetPrimaryKeyIndex(heap.as_ptr());
        #[cfg(feature = "pg18")]
        let oid = pg_sys::RelationGetPrimaryKeyIndex(heap.as_ptr(), false);
        oid
    };
    if oid == pg_sys::InvalidOid {
        return None;
    }
    group_index(heap, lock_and_open(oid)?)
}

/// `index`, when it is a valid btree index of `heap` whose first key column is `heap`'s
/// `consumer_group_id` (int8, compared with the integer operators), usable by every snapshot.
fn group_index(heap: &PgRelation, index: PgRelation) -> Option<GroupIndex> {
    let group = column(heap, "consumer_group_id", pg_sys::INT8OID)?;
    // SAFETY: an open relation's catalog row; its index row and operator families are read only
    // once it is known to be an index, which has them.
    let fits = unsafe {
        let class = &*index.rd_rel;
        class.relkind == pg_sys::RELKIND_INDEX as std::ffi::c_char
            && class.relam == pg_sys::BTREE_AM_OID
            && !index.rd_index.is_null()
            && {
                let form = &*index.rd_index;
                form.indrelid == heap.oid()
                    && form.indisvalid
                    && form.indisready
                    && form.indislive
                    && !form.indcheckxmin
                    && form.indnkeyatts >= 1
                    && form.indkey.values.as_slice(1)[0] as usize == group.attnum
                    && *index.rd_opfamily == pg_sys::INTEGER_BTREE_FAM_OID
            }
    };
    fits.then(|| GroupIndex { index, heap: heap.oid() })
}

/// A column of a table, as `column` found it.
#[derive(Clone, Copy, Debug)]
pub struct Column {
    pub attnum: usize,
    pub type_oid: pg_sys::Oid,
    pub collation: pg_sys::Oid,
}

/// `heap`'s column `name` of type `type_oid`, neither dropped nor generated.
pub fn column(heap: &PgRelation, name: &str, type_oid: pg_sys::Oid) -> Option<Column> {
    heap.tuple_desc().iter().enumerate().find_map(|(i, a)| {
        let fits = !a.attisdropped && a.attgenerated == 0 && a.atttypid == type_oid && is_named(a, name);
        fits.then_some(Column { attnum: i + 1, type_oid, collation: a.attcollation })
    })
}

/// Whether `attribute` (of an open relation's descriptor) is named `name`.
pub fn is_named(attribute: &pg_sys::FormData_pg_attribute, name: &str) -> bool {
    // SAFETY: an attribute's name is NUL-terminated within its fixed-size field.
    unsafe { std::ffi::CStr::from_ptr(attribute.attname.data.as_ptr()) }.to_bytes() == name.as_bytes()
}

/// The oid of relation `name` of schema `sqlstreams`, if there is one.
fn oid_of(name: &str) -> Option<pg_sys::Oid> {
    let name = CString::new(name).ok()?;
    // SAFETY: catalog lookups by name.
    let oid = unsafe {
        let schema = pg_sys::get_namespace_oid(c"sqlstreams".as_ptr(), true);
        if schema == pg_sys::InvalidOid {
            return None;
        }
        pg_sys::get_relname_relid(name.as_ptr(), schema)
    };
    (oid != pg_sys::InvalidOid).then_some(oid)
}

/// Relation `oid`, locked (ACCESS SHARE) and opened; `None`, keeping no lock, when it no longer
/// exists once locked.
fn lock_and_open(oid: pg_sys::Oid) -> Option<PgRelation> {
    let lock = pg_sys::AccessShareLock as pg_sys::LOCKMODE;
    // SAFETY: the relation is locked before it is opened, and opened only if it still exists
    // once locked (the lock accepts invalidations). It is closed when the `PgRelation` drops;
    // the lock stays to the transaction's end, as a statement's does.
    unsafe {
        pg_sys::LockRelationOid(oid, lock);
        let relation = pg_sys::try_relation_open(oid, pg_sys::NoLock as pg_sys::LOCKMODE);
        if relation.is_null() {
            pg_sys::UnlockRelationOid(oid, lock);
            return None;
        }
        Some(PgRelation::from_pg_owned(relation))
    }
}

/// A snapshot taken as SPI takes one for a statement that may write: the command counter
/// advanced (the transaction's earlier writes are seen), then a new snapshot under READ
/// COMMITTED. Reads under one `Snapshot` read one state, as one statement would. Registered while
/// it lives (an aborted transaction's resource owner lets it go too).
pub struct Snapshot(pg_sys::Snapshot);

impl Snapshot {
    pub fn take() -> Snapshot {
        // SAFETY: what SPI does before such a statement; registered until dropped.
        Snapshot(unsafe {
            pg_sys::CommandCounterIncrement();
            pg_sys::RegisterSnapshot(pg_sys::GetTransactionSnapshot())
        })
    }

    pub fn as_ptr(&self) -> pg_sys::Snapshot {
        self.0
    }
}

impl Drop for Snapshot {
    fn drop(&mut self) {
        // SAFETY: registered in `take`.
        unsafe { pg_sys::UnregisterSnapshot(self.0) };
    }
}

/// Whether any row of `heap` that `index` (a `group_index` of it) holds under group `group`
/// passes `filter`, which sees the row's `columns` (columns of `heap`) in that order. The index's
/// own predicate, if it has one, is the caller's to check.
pub fn any(
    heap: &PgRelation,
    index: &GroupIndex,
    snapshot: &Snapshot,
    group: i64,
    columns: &[Column],
    mut filter: impl FnMut(&Row<'_>) -> Result<bool>,
) -> Result<bool> {
    assert_eq!(index.heap, heap.oid(), "an index of the table it scans");
    let desc = heap.tuple_desc();
    for c in columns {
        assert!(desc.get(c.attnum - 1).is_some_and(|a| a.atttypid == c.type_oid), "a column of the table");
    }
    // SAFETY: both relations are open and locked, `index` is an index of `heap` whose first key
    // column is an int8 compared with the integer operators (`group_index`), the snapshot is
    // registered, and `columns` are `heap`'s, of their types (checked above). Each row's values
    // are read in the heap's buffer while the scan is on it.
    unsafe {
        let index = index.index.as_ptr();
        #[cfg(not(feature = "pg18"))]
        let scan = pg_sys::index_beginscan(heap.as_ptr(), index, snapshot.0, 1, 0);
        #[cfg(feature = "pg18")]
        let scan = pg_sys::index_beginscan(heap.as_ptr(), index, snapshot.0, std::ptr::null_mut(), 1, 0);
        let mut key: pg_sys::ScanKeyData = std::mem::zeroed();
        pg_sys::ScanKeyInit(
            &mut key,
            1,
            pg_sys::BTEqualStrategyNumber as u16,
            pg_sys::Oid::from(pg_sys::F_INT8EQ),
            group.into(),
        );
        pg_sys::index_rescan(scan, &mut key, 1, std::ptr::null_mut(), 0);
        let slot = pg_sys::table_slot_create(heap.as_ptr(), std::ptr::null_mut());
        let caller = caller_context();
        let types: Vec<pg_sys::Oid> = columns.iter().map(|c| c.type_oid).collect();
        let mut values = vec![pg_sys::Datum::from(0); columns.len()];
        let mut nulls = vec![true; columns.len()];
        let mut found = Ok(false);
        while pg_sys::index_getnext_slot(scan, pg_sys::ScanDirection::ForwardScanDirection, slot) {
            pgrx::check_for_interrupts!();
            for (i, c) in columns.iter().enumerate() {
                values[i] = pg_sys::slot_getattr(slot, c.attnum as i32, &mut nulls[i]);
            }
            found = filter(&Row::of(&values, &nulls, &types, caller));
            if !matches!(found, Ok(false)) {
                break;
            }
        }
        pg_sys::ExecDropSingleTupleTableSlot(slot);
        pg_sys::index_endscan(scan);
        found
    }
}
