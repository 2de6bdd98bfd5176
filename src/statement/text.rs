//! Texts in and out of statements without a call into Postgres per value: a claim reads and
//! writes a key per message it hands out, a hundred at a time.

use pgrx::datum::DatumWithOid;
use pgrx::pg_sys;

use super::Row;
use crate::error::Result;
use crate::text::MAX_TEXT;

impl Row<'_> {
    /// The text at `ordinal` (1-based) handed to `f` as a `&str`; `None` for SQL NULL. A value
    /// stored inline and uncompressed (a key or a policy's name, as a rule) is read where it
    /// lies, without the copy and the calls into Postgres `get` makes, where it reads as UTF-8
    /// (`text::utf8_trusted`: keys and names the extension wrote). Any other takes `get`'s way, which refuses one this database cannot read as UTF-8 (`text::check_stored`), then converts as pgrx does.
    pub fn text<R>(&self, ordinal: usize, f: impl FnOnce(&str) -> R) -> Result<Option<R>> {
        let i = ordinal - 1;
        debug_assert!([pg_sys::TEXTOID, pg_sys::VARCHAROID].contains(&self.types[i]), "column {ordinal} is text");
        if self.nulls[i] {
            return Ok(None);
        }
        let value = self.values[i].cast_mut_ptr::<pg_sys::varlena>();
        // SAFETY: a text datum that is not NULL points to a varlena, valid while the row is
        // (`Row::of`); its bytes are read only when they lie inline, with its length, and taken
        // as UTF-8 only where `utf8` reads them so (they are a text of this database).
        let inline = unsafe {
            use pgrx::varlena::*;
            let inline = (varatt_is_1b(value) && !varatt_is_1b_e(value)) || varatt_is_4b_u(value);
            let bytes = inline.then(|| varlena_to_byte_slice(value));
            bytes.and_then(|bytes| crate::text::utf8_trusted(bytes))
        };
        match inline {
            Some(text) => Ok(Some(f(text))),
            None => Ok(self.get::<String>(ordinal)?.map(|text| f(&text))),
        }
    }
}

/// A `text[]` parameter of `texts` (`None` a NULL element), made by one call into Postgres rather
/// than one per element as pgrx's conversion does: a claim passes a key per message it hands out.
pub fn text_array(texts: &[Option<&str>]) -> DatumWithOid<'static> {
    let count = texts.len();
    // The texts as varlenas with 4-byte headers, each at a 4-byte boundary (text's alignment),
    // in one buffer of words; `construct_md_array` copies them into the array.
    let words_of = |text: &str| (text.len() + pg_sys::VARHDRSZ).div_ceil(4);
    let mut words: Vec<u32> = Vec::with_capacity(texts.iter().flatten().map(|text| words_of(text)).sum());
    let mut starts: Vec<Option<usize>> = Vec::with_capacity(count);
    for text in texts {
        starts.push(text.map(|text| {
            assert!(text.len() <= MAX_TEXT, "a text of {} bytes is longer than a text can be", text.len());
            let start = words.len();
            words.resize(start + words_of(text), 0);
            // SAFETY: the words from `start` hold the header and the text's bytes.
            unsafe {
                let varlena = words.as_mut_ptr().add(start).cast::<pg_sys::varlena>();
                pgrx::varlena::set_varsize_4b(varlena, (text.len() + pg_sys::VARHDRSZ) as i32);
                let data = varlena.cast::<u8>().add(pg_sys::VARHDRSZ);
                std::ptr::copy_nonoverlapping(text.as_ptr(), data, text.len());
            }
            start
        }));
    }
    let base = words.as_mut_ptr();
    let mut nulls: Vec<bool> = starts.iter().map(Option::is_none).collect();
    // SAFETY: every start is inside `words`, which lives until the array is built.
    let mut elems: Vec<pg_sys::Datum> =
        starts.iter().map(|s| s.map_or(pg_sys::Datum::null(), |s| unsafe { base.add(s) }.into())).collect();
    let (mut dims, mut lower_bounds) = ([count as i32], [1]);
    // SAFETY: `elems` and `nulls` hold `count` entries, and each element that is not NULL is a
    // text with its length in its header.
    let array = unsafe {
        if count == 0 {
            pg_sys::construct_empty_array(pg_sys::TEXTOID)
        } else {
            let (elems, nulls) = (elems.as_mut_ptr(), nulls.as_mut_ptr());
            let (dims, lbs) = (dims.as_mut_ptr(), lower_bounds.as_mut_ptr());
            pg_sys::construct_md_array(
                elems,
                nulls,
                1,
                dims,
                lbs,
                pg_sys::TEXTOID,
                -1,
                false,
                pg_sys::TYPALIGN_INT as _,
            )
        }
    };
    // SAFETY: a text[] datum.
    unsafe { DatumWithOid::new(pg_sys::Datum::from(array), pg_sys::TEXTARRAYOID) }
}
