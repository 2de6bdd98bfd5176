//! Set-returning functions that return their rows all at once (Postgres' materialize mode).
//!
//! pgrx's `TableIterator` and `SetOfIterator` return one row per call (value-per-call mode).
//! Every function of the API pins its settings (`SET search_path = ...`), and Postgres applies
//! and undoes a function's settings around each call: for `claim`, 101 times for a batch of 100,
//! about an eighth of the whole claim. A function that returns `srf::TableIterator` or `srf::SetOfIterator` is called once, and its
//! rows go into the tuplestore Postgres reads them from.

use std::marker::PhantomData;

use pgrx::callconv::{BoxRet, FcInfo};
use pgrx::datum::Datum;
use pgrx::pg_sys;
use pgrx::prelude::PgSqlErrorCode;
use pgrx::IntoDatum;

/// The rows of a function declared `RETURNS TABLE`, returned all at once. Named like pgrx's
/// value-per-call type on purpose: pgrx's schema generator reads a signature's return type by
/// its name, and writes `RETURNS TABLE` from the `name!` columns of a `TableIterator`.
pub struct TableIterator<'a, Row> {
    rows: Vec<Vec<Option<pg_sys::Datum>>>,
    row: PhantomData<&'a Row>,
}

/// The rows of a function declared `RETURNS SETOF` a scalar type, returned all at once (named
/// like pgrx's for the same reason).
pub struct SetOfIterator<'a, T> {
    rows: Vec<Vec<Option<pg_sys::Datum>>>,
    row: PhantomData<&'a T>,
}

/// A row's values, one per result column.
pub trait IntoRow {
    fn into_row(self) -> Vec<Option<pg_sys::Datum>>;
}

macro_rules! into_row {
    ($($t:ident $i:tt),+) => {
        impl<$($t: IntoDatum),+> IntoRow for ($($t,)+) {
            fn into_row(self) -> Vec<Option<pg_sys::Datum>> {
                vec![$(self.$i.into_datum()),+]
            }
        }
    };
}
into_row!(A 0, B 1, C 2, D 3, E 4, F 5, G 6);
into_row!(A 0, B 1, C 2, D 3, E 4, F 5, G 6, H 7, I 8);

impl<'a, Row: IntoRow> TableIterator<'a, Row> {
    pub fn new(rows: impl IntoIterator<Item = Row>) -> Self {
        TableIterator { rows: rows.into_iter().map(IntoRow::into_row).collect(), row: PhantomData }
    }
}

impl<'a, T: IntoDatum> SetOfIterator<'a, T> {
    pub fn new(values: impl IntoIterator<Item = T>) -> Self {
        SetOfIterator { rows: values.into_iter().map(|v| vec![v.into_datum()]).collect(), row: PhantomData }
    }
}

// SAFETY (both impls): the function is declared in SQL as returning a set of rows with one
// value for each of these values (`RETURNS TABLE`, or `RETURNS SETOF` a scalar type).
unsafe impl<Row> BoxRet for TableIterator<'_, Row> {
    unsafe fn box_into<'fcx>(self, fcinfo: &mut FcInfo<'fcx>) -> Datum<'fcx> {
        unsafe { put_rows(fcinfo, self.rows) }
    }
}

unsafe impl<T> BoxRet for SetOfIterator<'_, T> {
    unsafe fn box_into<'fcx>(self, fcinfo: &mut FcInfo<'fcx>) -> Datum<'fcx> {
        unsafe { put_rows(fcinfo, self.rows) }
    }
}

/// Puts `rows` in the call's tuplestore (`materialize`).
///
/// # Safety
/// `fcinfo` is the call of a set-returning function whose rows have these values.
unsafe fn put_rows<'fcx>(fcinfo: &mut FcInfo<'fcx>, rows: Vec<Vec<Option<pg_sys::Datum>>>) -> Datum<'fcx> {
    unsafe {
        let (store, desc) = materialize(fcinfo.as_mut_ptr());
        let width = (*desc).natts as usize;
        let mut values = vec![pg_sys::Datum::from(0); width];
        let mut nulls = vec![true; width];
        for row in rows {
            assert_eq!(row.len(), width, "a row of {} values for {} result columns", row.len(), width);
            for (i, value) in row.into_iter().enumerate() {
                values[i] = value.unwrap_or(pg_sys::Datum::from(0));
                nulls[i] = value.is_none();
            }
            pg_sys::tuplestore_putvalues(store, desc, values.as_mut_ptr(), nulls.as_mut_ptr());
        }
        // In materialize mode Postgres reads the tuplestore, not the result.
        fcinfo.return_raw_datum(pg_sys::Datum::from(0))
    }
}

/// Sets the call up for materialize mode (what `InitMaterializedSRF` does, which refuses a
/// function returning a set of a scalar type): the tuplestore and its row type, in the query's
/// memory, which outlives the call.
///
/// # Safety
/// `fcinfo` is the call of a set-returning function.
unsafe fn materialize(fcinfo: pg_sys::FunctionCallInfo) -> (*mut pg_sys::Tuplestorestate, pg_sys::TupleDesc) {
    unsafe {
        let rsinfo = (*fcinfo).resultinfo.cast::<pg_sys::ReturnSetInfo>();
        if rsinfo.is_null()
            || (*rsinfo).type_ != pg_sys::NodeTag::T_ReturnSetInfo
            || (*rsinfo).allowedModes & pg_sys::SetFunctionReturnMode::SFRM_Materialize as i32 == 0
        {
            pgrx::ereport!(
                ERROR,
                PgSqlErrorCode::ERRCODE_FEATURE_NOT_SUPPORTED,
                "set-valued function called in context that cannot accept a set"
            );
        }
        let old = pg_sys::MemoryContextSwitchTo((*(*rsinfo).econtext).ecxt_per_query_memory);
        // The row type the executor expects, as PostgreSQL's own set-returning functions take it
        // (`MAT_SRF_USE_EXPECTED_DESC`): for a function with OUT parameters, working it out
        // again from the catalog (`get_call_result_type`) costs every call a catalog lookup per
        // column.
        let expected = (*rsinfo).expectedDesc;
        let desc = if !expected.is_null() {
            pg_sys::CreateTupleDescCopy(expected)
        } else {
            let mut type_oid = pg_sys::InvalidOid;
            let mut desc: pg_sys::TupleDesc = std::ptr::null_mut();
            match pg_sys::get_call_result_type(fcinfo, &mut type_oid, &mut desc) {
                pg_sys::TypeFuncClass::TYPEFUNC_COMPOSITE => pg_sys::CreateTupleDescCopy(desc),
                pg_sys::TypeFuncClass::TYPEFUNC_SCALAR => {
                    let desc = pg_sys::CreateTemplateTupleDesc(1);
                    pg_sys::TupleDescInitEntry(desc, 1, c"value".as_ptr(), type_oid, -1, 0);
                    desc
                }
                _ => pgrx::error!("a set-returning function of sqlstreams has no row type"),
            }
        };
        let random = (*rsinfo).allowedModes & pg_sys::SetFunctionReturnMode::SFRM_Materialize_Random as i32 != 0;
        let store = pg_sys::tuplestore_begin_heap(random, false, pg_sys::work_mem);
        (*rsinfo).returnMode = pg_sys::SetFunctionReturnMode::SFRM_Materialize;
        (*rsinfo).setResult = store;
        (*rsinfo).setDesc = desc;
        pg_sys::MemoryContextSwitchTo(old);
        (store, desc)
    }
}
