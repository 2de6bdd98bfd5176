//! Whether a row exists, read straight from one of the extension's indexes without a statement.
//!
//! A question of an index entry or two (is there any such row?) costs a statement about 35,000
//! instructions around a probe of a few thousand: the plan cache's check, a portal, the
//! executor's start and end. Here the table and the index are opened and locked as the
//! statement's plan would lock them (ACCESS SHARE, to the transaction's end), the index is
//! scanned with its first column equal to a group's id (`any`), and, for an index whose second
//! column is a time, with that time at or before a bound (`any_until`: a group's first row due by
//! then), under a snapshot taken as SPI takes one for a statement that may write (`Snapshot`),
//! and each visible row is filtered as the statement's `WHERE` would filter it, as
//! src/message/scan.rs reads a lane. Debug builds run the statement in the same snapshot
//! (`rows_in`) and compare.
//!
//! A table or an index not of the shape the install script made (another kind of table, row
//! security enabled, inheritance children, an index missing, not valid, not a btree over the
//! group's id first) is not read: the caller runs the statement instead.
//!
//! What a look at a relation's name and shape found (its oid by name, its columns, whether an
//! index fits, its predicate) is remembered by the backend until the next relcache invalidation
//! of any relation, or change of a schema (`generation`): more warily than Postgres, which reads
//! again only the entry invalidated. A relation is used only if no invalidation arrived while it was looked up
//! and locked (a rename or a drop sends one); else its name is looked up again. Looked up on
//! every claim, they were 1 to 2 % of its instructions (docs/benchmarks/cost-model.md, "A
//! twenty-eighth pass").

use std::ffi::CString;
use std::hash::Hash;
use std::thread::LocalKey;

use pgrx::pg_sys;
use pgrx::{PgList, PgRelation};

use super::{caller_context, Row};
use crate::catalog::Memo;
use crate::error::Result;

thread_local! {
    static OIDS: Memo<String, pg_sys::Oid> = Memo::new();
    static COLUMNS: Memo<(pg_sys::Oid, &'static str, pg_sys::Oid), Option<Column>> = Memo::new();
    static PRIMARY_KEYS: Memo<pg_sys::Oid, pg_sys::Oid> = Memo::new();
    static FITS: Memo<Fit, bool> = Memo::new();
}

/// A question of a relation's shape whose answer is remembered (`FITS`).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
enum Fit {
    GroupIndex { heap: pg_sys::Oid, index: pg_sys::Oid },
    TimeIndex { index: pg_sys::Oid, time: usize },
    HoldsEveryRowWith { index: pg_sys::Oid, status: usize, statuses: &'static [&'static str] },
    HoldsEveryRow { index: pg_sys::Oid },
}

/// Moves with every relcache invalidation the backend reads: what was found of relations before
/// is looked at again.
fn generation() -> u64 {
    crate::catalog::relations_generation()
}

/// `answer()` for `key`, as found in this generation if it was. The generation is read before
/// `answer` looks: an invalidation read while it looks leaves its answer for this time only.
fn remembered<K: Eq + Hash, V: Clone>(memo: &'static LocalKey<Memo<K, V>>, key: K, answer: impl FnOnce() -> V) -> V {
    let generation = Some(generation());
    if let Some(found) = memo.with(|memo| memo.get(&key, generation)) {
        return found;
    }
    let found = answer();
    memo.with(|memo| memo.put(key, generation, found.clone()));
    found
}

/// The extension's relation `name`, locked and opened: by the oid it had when it was last looked
/// up by name in this generation, or else looked up now. An invalidation read while the name was
/// looked up or the relation locked may mean that the name names another relation now (renamed,
/// dropped, swapped while the lock was waited for): the name is looked up again, and the lock
/// kept when it names the same relation, else moved to the one it names, as
/// `RangeVarGetRelidExtended` does: it stops at the first look-up that names the relation it holds.
fn open_named(name: &str) -> Option<PgRelation> {
    let lock = pg_sys::AccessShareLock as pg_sys::LOCKMODE;
    let first = generation();
    let mut looked_up = first;
    let remembered = OIDS.with(|oids| oids.get(name, Some(first)));
    let mut oid = match remembered {
        Some(oid) => oid,
        None => oid_of(name)?,
    };
    // SAFETY: locks by oid, whether or not the relation still exists, as a statement's plan does;
    // a lock let go here is one this function took.
    unsafe { pg_sys::LockRelationOid(oid, lock) };
    while generation() != looked_up {
        pgrx::check_for_interrupts!();
        looked_up = generation();
        let again = oid_of(name);
        if again == Some(oid) {
            break;
        }
        // SAFETY: as above.
        unsafe { pg_sys::UnlockRelationOid(oid, lock) };
        oid = again?;
        // SAFETY: as above.
        unsafe { pg_sys::LockRelationOid(oid, lock) };
    }
    if remembered.is_none() || looked_up != first {
        OIDS.with(|oids| oids.put(name.to_owned(), Some(looked_up), oid));
    }
    open_locked(oid)
}

/// The extension's table `name`, opened and locked, when it is a plain heap table without
/// inheritance children or row security (the extension's owner, whom the claim runs as, may be
/// subject to it when it is forced).
pub fn table(name: &str) -> Option<PgRelation> {
    open_named(name).filter(plain)
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
    group_index(heap, open_named(name)?)
}

/// `heap`'s primary key, when it is a `group_index` of it.
pub fn primary_key(heap: &PgRelation) -> Option<GroupIndex> {
    // SAFETY: the relation is open.
    let oid = remembered(&PRIMARY_KEYS, heap.oid(), || unsafe {
        #[cfg(not(feature = "pg18"))]
        let oid = pg_sys::RelationGetPrimaryKeyIndex(heap.as_ptr());
        #[cfg(feature = "pg18")]
        let oid = pg_sys::RelationGetPrimaryKeyIndex(heap.as_ptr(), false);
        oid
    });
    if oid == pg_sys::InvalidOid {
        return None;
    }
    group_index(heap, lock_and_open(oid)?)
}

/// A `group_index` whose second key column is a `timestamptz` column of the table, ascending,
/// in the type's default btree order (`time_index`): a group's rows in the order of that time.
pub struct TimeIndex(GroupIndex);

impl TimeIndex {
    pub fn relation(&self) -> &PgRelation {
        self.0.relation()
    }
}

/// The extension's index `name`, when it is a `TimeIndex` of `heap` over column `time`.
pub fn time_index(heap: &PgRelation, name: &str, time: Column) -> Option<TimeIndex> {
    let index = index(heap, name)?;
    let relation = index.relation();
    // SAFETY: an open btree index (`group_index`): its index row, and its key columns' options,
    // operator families and input types, are there for each of its key columns; a catalog look-up.
    let fits = remembered(&FITS, Fit::TimeIndex { index: relation.oid(), time: time.attnum }, || unsafe {
        let form = &*relation.rd_index;
        form.indnkeyatts >= 2
            && form.indkey.values.as_slice(2)[1] as usize == time.attnum
            && time.type_oid == pg_sys::TIMESTAMPTZOID
            && *relation.rd_indoption.add(1) as u32 & pg_sys::INDOPTION_DESC == 0
            && *relation.rd_opcintype.add(1) == pg_sys::TIMESTAMPTZOID
            && *relation.rd_opfamily.add(1) == pg_sys::get_opclass_family(pg_sys::TIMESTAMPTZ_BTREE_OPS_OID)
    });
    fits.then_some(TimeIndex(index))
}

/// Whether `index` holds every row of its table whose text column `status` (an attribute number)
/// is one of `statuses`: it has no predicate, or one that names at least those, as Postgres keeps
/// the install script's `status IN (...)` (one `status = ANY (constant text[])`) and
/// `status = '...'`. Any other predicate (a narrower one would hide rows) and the caller asks by
/// statement.
pub fn holds_every_row_with(index: &PgRelation, status: usize, statuses: &'static [&'static str]) -> bool {
    remembered(&FITS, Fit::HoldsEveryRowWith { index: index.oid(), status, statuses }, || {
        predicate_names_every(index, status, statuses)
    })
}

/// `holds_every_row_with`, looked at.
fn predicate_names_every(index: &PgRelation, status: usize, statuses: &[&str]) -> bool {
    // SAFETY: the index is open; its predicate is a copy in the current memory context, of nodes
    // checked by tag before they are read as that node.
    unsafe {
        let predicate = PgList::<pg_sys::Node>::from_pg(pg_sys::RelationGetIndexPredicate(index.as_ptr()));
        if predicate.is_empty() {
            return true;
        }
        let Some(node) = predicate.get_ptr(0).filter(|_| predicate.len() == 1) else { return false };
        // The operator's arguments, and whether it is `=` of any element of an array.
        let (opno, args, of_array) = if pgrx::is_a(node, pg_sys::NodeTag::T_ScalarArrayOpExpr) {
            let any = &*node.cast::<pg_sys::ScalarArrayOpExpr>();
            if !any.useOr {
                return false;
            }
            (any.opno, any.args, true)
        } else if pgrx::is_a(node, pg_sys::NodeTag::T_OpExpr) {
            let op = &*node.cast::<pg_sys::OpExpr>();
            (op.opno, op.args, false)
        } else {
            return false;
        };
        let args = PgList::<pg_sys::Node>::from_pg(args);
        let (Some(column), Some(value)) = (args.get_ptr(0), args.get_ptr(1)) else { return false };
        let compares_status = opno == pg_sys::Oid::from(pg_sys::TextEqualOperator)
            && pgrx::is_a(column, pg_sys::NodeTag::T_Var)
            && (*column.cast::<pg_sys::Var>()).varattno as usize == status;
        if !compares_status || !pgrx::is_a(value, pg_sys::NodeTag::T_Const) {
            return false;
        }
        let value = &*value.cast::<pg_sys::Const>();
        let expected = if of_array { pg_sys::TEXTARRAYOID } else { pg_sys::TEXTOID };
        if value.consttype != expected || value.constisnull {
            return false;
        }
        // Bytes, not `str`: a DBA's predicate need not be UTF-8 in a database that is not.
        let listed: Vec<Option<Vec<u8>>> = if of_array {
            let Some(array) = <pgrx::datum::Array<'_, &[u8]> as pgrx::FromDatum>::from_datum(value.constvalue, false)
            else {
                return false;
            };
            array.iter().map(|s| s.map(<[u8]>::to_vec)).collect()
        } else {
            vec![<&[u8] as pgrx::FromDatum>::from_datum(value.constvalue, false).map(<[u8]>::to_vec)]
        };
        statuses.iter().all(|s| listed.iter().any(|l| l.as_deref() == Some(s.as_bytes())))
    }
}

/// Whether `index` has no predicate: it holds every row of its table.
pub fn holds_every_row(index: &PgRelation) -> bool {
    // SAFETY: the index is open; its predicate is a copy in the current memory context.
    remembered(&FITS, Fit::HoldsEveryRow { index: index.oid() }, || unsafe {
        PgList::<pg_sys::Node>::from_pg(pg_sys::RelationGetIndexPredicate(index.as_ptr())).is_empty()
    })
}

/// `index`, when it is a valid btree index of `heap` whose first key column is `heap`'s
/// `consumer_group_id` (int8, compared with the integer operators), usable by every snapshot.
fn group_index(heap: &PgRelation, index: PgRelation) -> Option<GroupIndex> {
    let group = column(heap, "consumer_group_id", pg_sys::INT8OID)?;
    // SAFETY: an open relation's catalog row; its index row and operator families are read only
    // once it is known to be an index, which has them.
    let fits = remembered(&FITS, Fit::GroupIndex { heap: heap.oid(), index: index.oid() }, || unsafe {
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
    });
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
pub fn column(heap: &PgRelation, name: &'static str, type_oid: pg_sys::Oid) -> Option<Column> {
    remembered(&COLUMNS, (heap.oid(), name, type_oid), || {
        heap.tuple_desc().iter().enumerate().find_map(|(i, a)| {
            let fits = !a.attisdropped && a.attgenerated == 0 && a.atttypid == type_oid && is_named(a, name);
            fits.then_some(Column { attnum: i + 1, type_oid, collation: a.attcollation })
        })
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
    // SAFETY: locks by oid, whether or not the relation still exists (the lock accepts
    // invalidations); `open_locked` lets the lock go when it opens nothing.
    unsafe { pg_sys::LockRelationOid(oid, pg_sys::AccessShareLock as pg_sys::LOCKMODE) };
    open_locked(oid)
}

/// Relation `oid`, which this transaction has just locked (ACCESS SHARE), opened; `None`, and the
/// lock let go, when it no longer exists.
fn open_locked(oid: pg_sys::Oid) -> Option<PgRelation> {
    // SAFETY: opened only if it still exists once locked. It is closed when the `PgRelation`
    // drops; the lock stays to the transaction's end, as a statement's does.
    unsafe {
        let relation = pg_sys::try_relation_open(oid, pg_sys::NoLock as pg_sys::LOCKMODE);
        if relation.is_null() {
            pg_sys::UnlockRelationOid(oid, pg_sys::AccessShareLock as pg_sys::LOCKMODE);
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

/// The rows `statement` (a read-only one) returns in `snapshot` exactly, as foreign keys' checks
/// run theirs: a one-off plan of its own, with the statement's planner settings
/// (src/transient.rs), run by `SPI_execute_snapshot` inside the caller's connection. Each row's
/// columns as datums, `None` for NULL: by-value columns only (bool, int4, int8, timestamptz), read
/// before the plan and rows are freed. For debug builds, which check that a direct read answers
/// as the statement it replaces.
#[cfg(debug_assertions)]
pub fn rows_in(
    snapshot: &Snapshot,
    statement: &super::Statement,
    stream_id: i64,
    args: &[pgrx::datum::DatumWithOid<'_>],
) -> Vec<Vec<Option<pg_sys::Datum>>> {
    let sql = CString::new(super::render(statement.sql, stream_id)).unwrap();
    let mut types: Vec<pg_sys::Oid> = args.iter().map(|a| a.oid()).collect();
    let mut values: Vec<pg_sys::Datum> =
        args.iter().map(|a| a.datum().map_or(pg_sys::Datum::from(0), |d| d.sans_lifetime())).collect();
    let mut nulls: Vec<std::ffi::c_char> =
        args.iter().map(|a| if a.datum().is_some() { b' ' } else { b'n' } as std::ffi::c_char).collect();
    let _planned = crate::transient::guide(statement.name);
    // SAFETY: inside an SPI connection; the plan takes the parameters given, of their types; its
    // rows are read, by value, before they and the plan are freed.
    unsafe {
        let plan = pg_sys::SPI_prepare(sql.as_ptr(), args.len() as i32, types.as_mut_ptr());
        assert!(!plan.is_null(), "{} prepares", statement.name);
        let status = pg_sys::SPI_execute_snapshot(
            plan,
            values.as_mut_ptr(),
            nulls.as_mut_ptr(),
            snapshot.as_ptr(),
            std::ptr::null_mut(),
            true,
            false,
            0,
        );
        assert_eq!(status, pg_sys::SPI_OK_SELECT as i32, "{} runs", statement.name);
        let table = pg_sys::SPI_tuptable;
        let columns = (*(*table).tupdesc).natts;
        let desc = pgrx::PgTupleDesc::from_pg_unchecked((*table).tupdesc);
        for (column, attribute) in desc.iter().enumerate() {
            debug_assert!(attribute.attbyval, "{}: column {} is read by value", statement.name, column + 1);
        }
        drop(desc);
        let rows = (0..pg_sys::SPI_processed as usize)
            .map(|i| {
                let row = *(*table).vals.add(i);
                (1..=columns)
                    .map(|column| {
                        let mut null = false;
                        let value = pg_sys::SPI_getbinval(row, (*table).tupdesc, column, &mut null);
                        (!null).then_some(value)
                    })
                    .collect()
            })
            .collect();
        pg_sys::SPI_freetuptable(table);
        pg_sys::SPI_freeplan(plan);
        rows
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
    filter: impl FnMut(&Row<'_>) -> Result<bool>,
) -> Result<bool> {
    scan(heap, index, snapshot, group, None, columns, filter)
}

/// `any`, of the rows whose time in `index`'s second column (a `TimeIndex`) is at or before
/// `until`: a scan that stops at the first entry past it, however many rows wait for a later
/// time, as a statement's `... AND t <= $2 ORDER BY t LIMIT 1` reads the index.
pub fn any_until(
    heap: &PgRelation,
    index: &TimeIndex,
    snapshot: &Snapshot,
    group: i64,
    until: pg_sys::TimestampTz,
    columns: &[Column],
    filter: impl FnMut(&Row<'_>) -> Result<bool>,
) -> Result<bool> {
    scan(heap, &index.0, snapshot, group, Some(until), columns, filter)
}

/// The scan of `any` and `any_until`: the index's entries of `group` (up to `until` in its second
/// column, when given), in the index's order, each visible row handed to `filter` until it says
/// yes or fails.
fn scan(
    heap: &PgRelation,
    index: &GroupIndex,
    snapshot: &Snapshot,
    group: i64,
    until: Option<pg_sys::TimestampTz>,
    columns: &[Column],
    mut filter: impl FnMut(&Row<'_>) -> Result<bool>,
) -> Result<bool> {
    assert_eq!(index.heap, heap.oid(), "an index of the table it scans");
    let desc = heap.tuple_desc();
    for c in columns {
        assert!(desc.get(c.attnum - 1).is_some_and(|a| a.atttypid == c.type_oid), "a column of the table");
    }
    // SAFETY: both relations are open and locked, `index` is an index of `heap` whose first key
    // column is an int8 compared with the integer operators (`group_index`) and, when `until`
    // is given, whose second is a timestamptz in the default btree order (`time_index`); the
    // snapshot is registered, and `columns` are `heap`'s, of their types (checked above). Each
    // row's values are read in the heap's buffer while the scan is on it.
    unsafe {
        let nkeys = if until.is_some() { 2 } else { 1 };
        let index = index.index.as_ptr();
        #[cfg(not(feature = "pg18"))]
        let scan = pg_sys::index_beginscan(heap.as_ptr(), index, snapshot.0, nkeys, 0);
        #[cfg(feature = "pg18")]
        let scan = pg_sys::index_beginscan(heap.as_ptr(), index, snapshot.0, std::ptr::null_mut(), nkeys, 0);
        let mut keys: [pg_sys::ScanKeyData; 2] = std::mem::zeroed();
        pg_sys::ScanKeyInit(
            &mut keys[0],
            1,
            pg_sys::BTEqualStrategyNumber as u16,
            pg_sys::Oid::from(pg_sys::F_INT8EQ),
            group.into(),
        );
        if let Some(until) = until {
            pg_sys::ScanKeyInit(
                &mut keys[1],
                2,
                pg_sys::BTLessEqualStrategyNumber as u16,
                pg_sys::Oid::from(pg_sys::F_TIMESTAMPTZ_LE),
                until.into(),
            );
        }
        pg_sys::index_rescan(scan, keys.as_mut_ptr(), nkeys, std::ptr::null_mut(), 0);
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
