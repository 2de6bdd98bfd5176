//! Set-returning functions that return their rows all at once (Postgres' materialize mode).
//!
//! pgrx's `TableIterator` and `SetOfIterator` return one row per call (value-per-call mode).
//! Postgres applies and undoes a function's declared settings (`SET search_path = ...`) around
//! each call: for `claim`, when it declared them, 101 times for a batch of 100, about an eighth
//! of the whole claim. A function that returns `srf::TableIterator` or `srf::SetOfIterator` is
//! called once, and its rows go into the tuplestore Postgres reads them from.

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
    cells: Cells,
    row: PhantomData<&'a Row>,
}

/// The rows of a function declared `RETURNS SETOF` a scalar type, returned all at once (named
/// like pgrx's for the same reason).
pub struct SetOfIterator<'a, T> {
    cells: Cells,
    row: PhantomData<&'a T>,
}

/// The rows' values as datums, row after row, and the memory of those that point into it.
///
/// A claim of 100 returns 700 values, and pgrx's conversions allocate one of every text and
/// uuid apart, each through a guarded call into Postgres (`palloc`): about 4 % of a claim's
/// instructions. Short texts (a key, a concurrency name) and uuids (a lease token) are
/// written here instead, into blocks that are never grown past their capacity, so a datum
/// stays valid until the rows are copied into the tuplestore (`put_rows`). A short text is a
/// varlena with a one-byte header, which Postgres stores as it is.
pub struct Cells {
    values: Vec<Option<pg_sys::Datum>>,
    blocks: Vec<Vec<u8>>,
}

/// Bytes of a block; a block is full when the next value does not fit.
const BLOCK: usize = 8192;

/// The longest text written as a short varlena (a one-byte header holds up to 127 bytes).
const SHORT_TEXT: usize = 126;

impl Cells {
    fn with_capacity(values: usize) -> Self {
        Cells { values: Vec::with_capacity(values), blocks: vec![] }
    }

    /// `len` bytes of a block, written by `write`; their address.
    fn bytes(&mut self, len: usize, write: impl FnOnce(&mut Vec<u8>)) -> *const u8 {
        debug_assert!(len <= BLOCK);
        if self.blocks.last().is_none_or(|b| b.capacity() - b.len() < len) {
            self.blocks.push(Vec::with_capacity(BLOCK));
        }
        let block = self.blocks.last_mut().expect("a block with room");
        let at = block.len();
        write(block);
        debug_assert_eq!(block.len(), at + len, "wrote what it said");
        // SAFETY: within the block's buffer, which never moves: it never grows past its capacity.
        unsafe { block.as_ptr().add(at) }
    }

    fn text(&mut self, text: &str) -> Option<pg_sys::Datum> {
        match self.short_text(text) {
            Some(datum) => Some(datum),
            None => text.into_datum(),
        }
    }

    /// `text` as a varlena with a one-byte header in a block; `None` when it is too long for one.
    fn short_text(&mut self, text: &str) -> Option<pg_sys::Datum> {
        if text.len() > SHORT_TEXT || cfg!(target_endian = "big") {
            return None;
        }
        let ptr = self.bytes(text.len() + 1, |block| {
            // A one-byte varlena header as a little-endian Postgres writes it (`SET_VARSIZE_1B`):
            // the total length shifted left, the low bit set.
            block.push((((text.len() + 1) as u8) << 1) | 1);
            block.extend_from_slice(text.as_bytes());
        });
        Some(pg_sys::Datum::from(ptr))
    }

    fn push(&mut self, value: Option<pg_sys::Datum>) {
        self.values.push(value);
    }
}

/// A value of a result column.
pub trait IntoCell {
    fn into_cell(self, cells: &mut Cells) -> Option<pg_sys::Datum>;
}

/// Values passed by value, or already a datum: pgrx's conversion allocates nothing.
macro_rules! by_into_datum {
    ($($t:ty),+) => {
        $(impl IntoCell for $t {
            fn into_cell(self, _: &mut Cells) -> Option<pg_sys::Datum> {
                self.into_datum()
            }
        })+
    };
}
by_into_datum!(i64, i32, bool, f64, pgrx::datum::TimestampWithTimeZone, crate::payload::RawJsonb);

impl<T: IntoCell> IntoCell for Option<T> {
    fn into_cell(self, cells: &mut Cells) -> Option<pg_sys::Datum> {
        self.and_then(|v| v.into_cell(cells))
    }
}

impl IntoCell for &str {
    fn into_cell(self, cells: &mut Cells) -> Option<pg_sys::Datum> {
        cells.text(self)
    }
}

impl IntoCell for String {
    fn into_cell(self, cells: &mut Cells) -> Option<pg_sys::Datum> {
        cells.text(&self)
    }
}

impl IntoCell for crate::key::Key {
    fn into_cell(self, cells: &mut Cells) -> Option<pg_sys::Datum> {
        cells.text(&self)
    }
}

impl IntoCell for pgrx::Uuid {
    fn into_cell(self, cells: &mut Cells) -> Option<pg_sys::Datum> {
        // uuid is 16 bytes by reference, aligned to a byte.
        let ptr = cells.bytes(self.as_bytes().len(), |block| block.extend_from_slice(self.as_bytes()));
        Some(pg_sys::Datum::from(ptr))
    }
}

/// A row's values, one per result column.
pub trait IntoRow {
    const WIDTH: usize;
    fn into_row(self, cells: &mut Cells);
}

macro_rules! into_row {
    ($width:literal: $($t:ident $i:tt),+) => {
        impl<$($t: IntoCell),+> IntoRow for ($($t,)+) {
            const WIDTH: usize = $width;
            fn into_row(self, cells: &mut Cells) {
                $(let value = self.$i.into_cell(cells); cells.push(value);)+
            }
        }
    };
}
into_row!(7: A 0, B 1, C 2, D 3, E 4, F 5, G 6);
into_row!(9: A 0, B 1, C 2, D 3, E 4, F 5, G 6, H 7, I 8);

impl<'a, Row: IntoRow> TableIterator<'a, Row> {
    pub fn new(rows: impl IntoIterator<Item = Row>) -> Self {
        let rows = rows.into_iter();
        let mut cells = Cells::with_capacity(rows.size_hint().0 * Row::WIDTH);
        for row in rows {
            row.into_row(&mut cells);
        }
        TableIterator { cells, row: PhantomData }
    }
}

impl<'a, T: IntoCell> SetOfIterator<'a, T> {
    pub fn new(values: impl IntoIterator<Item = T>) -> Self {
        let values = values.into_iter();
        let mut cells = Cells::with_capacity(values.size_hint().0);
        for value in values {
            let value = value.into_cell(&mut cells);
            cells.push(value);
        }
        SetOfIterator { cells, row: PhantomData }
    }
}

unsafe impl<Row> BoxRet for TableIterator<'_, Row> {
    unsafe fn box_into<'fcx>(self, fcinfo: &mut FcInfo<'fcx>) -> Datum<'fcx> {
        unsafe { put_rows(fcinfo, self.cells) }
    }
}

unsafe impl<T> BoxRet for SetOfIterator<'_, T> {
    unsafe fn box_into<'fcx>(self, fcinfo: &mut FcInfo<'fcx>) -> Datum<'fcx> {
        unsafe { put_rows(fcinfo, self.cells) }
    }
}

/// Puts `rows` in the call's tuplestore (`materialize`).
///
/// # Safety
/// `fcinfo` is the call of a set-returning function whose rows have these values.
unsafe fn put_rows<'fcx>(fcinfo: &mut FcInfo<'fcx>, cells: Cells) -> Datum<'fcx> {
    unsafe {
        let (store, desc) = materialize(fcinfo.as_mut_ptr());
        let width = (*desc).natts as usize;
        assert_eq!(cells.values.len() % width.max(1), 0, "rows of {width} values");
        let mut values = vec![pg_sys::Datum::from(0); width];
        let mut nulls = vec![true; width];
        for row in cells.values.chunks_exact(width.max(1)) {
            for (i, value) in row.iter().enumerate() {
                values[i] = value.unwrap_or(pg_sys::Datum::from(0));
                nulls[i] = value.is_none();
            }
            // Copies the row, texts and uuids with it: `cells` may go after this.
            pg_sys::tuplestore_putvalues(store, desc, values.as_mut_ptr(), nulls.as_mut_ptr());
        }
        fcinfo.return_raw_datum(pg_sys::Datum::from(0))
    }
}

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

#[cfg(test)]
mod tests {
    use super::*;

    /// Texts written across many blocks keep their bytes where their datums point, each behind
    /// a one-byte header holding its total length.
    #[test]
    fn short_texts_stay_where_their_datums_point() {
        let mut cells = Cells::with_capacity(0);
        let texts: Vec<String> = (0..2000).map(|i| format!("{i:0>width$}", width = i % (SHORT_TEXT + 1))).collect();
        let datums: Vec<pg_sys::Datum> = texts.iter().map(|t| cells.short_text(t).expect("a short text")).collect();
        assert!(cells.blocks.len() > 10, "the texts fill many blocks");
        for (text, datum) in texts.iter().zip(datums) {
            let ptr = datum.cast_mut_ptr::<u8>().cast_const();
            // SAFETY: the datum points at a header and the text's bytes in one of `cells`' blocks.
            let (header, bytes) = unsafe { (*ptr, std::slice::from_raw_parts(ptr.add(1), text.len())) };
            assert_eq!(header & 1, 1, "a one-byte header");
            assert_eq!((header >> 1) as usize, text.len() + 1, "the total length");
            assert_eq!(bytes, text.as_bytes());
        }
        assert!(cells.short_text(&"x".repeat(SHORT_TEXT + 1)).is_none(), "longer texts are pgrx's");
    }
}
