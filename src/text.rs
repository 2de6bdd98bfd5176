//! Text arguments in the database's encoding.
//!
//! pgrx's `&str` and `String` arguments fail with an internal error (XX000, its own message) on
//! a text that is not ASCII in a database whose encoding is not UTF8, since Rust's strings are
//! UTF-8. The extension takes its text arguments as one of these instead:
//!
//! - `Text`, for names and words (streams, groups, roles, policies): read as pgrx would, and
//!   refused with 22023 where pgrx would fail;
//! - `RawText`, the bytes, for what the extension keeps as the caller wrote it: keys (refused by
//!   produce where they would not read back, src/produce.rs) and a failure's error message (kept
//!   with its other bytes escaped).

use pgrx::callconv::{Arg, ArgAbi};
use pgrx::nullable::Nullable;
use pgrx::pg_sys;
use pgrx::pg_sys::panic::ErrorReport;
use pgrx::PgLogLevel;

use crate::error::StreamError;

/// A `text` argument read as UTF-8, which it must be (see `utf8`). Refused, before the call
/// does anything, where it is not.
#[derive(Clone, Copy, Debug)]
pub struct Text<'a>(&'a str);

pgrx::impl_sql_translatable!(Text<'_>, "text");

impl std::ops::Deref for Text<'_> {
    type Target = str;

    fn deref(&self) -> &str {
        self.0
    }
}

/// The argument at `index` (0-based), refused as a 22023 error when it is not UTF-8.
fn checked(index: usize, bytes: &[u8]) -> &str {
    match utf8(bytes) {
        Some(text) => text,
        None => {
            ErrorReport::from(refusal(index, bytes)).report(PgLogLevel::ERROR);
            unreachable!("an ERROR does not return")
        }
    }
}

fn refusal(index: usize, bytes: &[u8]) -> StreamError {
    StreamError::invalid(
        format!(
            "argument {} ('{}') is not ASCII, and the database's encoding, {}, is not UTF8",
            index + 1,
            escaped(bytes),
            encoding_name()
        ),
        "Pass ASCII text in this database, or keep the streams in a UTF8 database \
         (CREATE DATABASE ... ENCODING 'UTF8').",
    )
}

/// The text's bytes as UTF-8, where pgrx would take them so: always in a UTF8 database (Postgres
/// keeps its texts valid), when valid in an SQL_ASCII one (whose bytes may be anything), when
/// ASCII in any other (all extend ASCII).
pub fn utf8(bytes: &[u8]) -> Option<&str> {
    if bytes.is_ascii() || crate::statement::utf8_database() {
        // SAFETY: ASCII is UTF-8; a UTF8 database's texts are valid UTF-8.
        return Some(unsafe { std::str::from_utf8_unchecked(bytes) });
    }
    // SAFETY: reads the backend's database encoding.
    let sql_ascii = unsafe { pg_sys::GetDatabaseEncoding() } == pg_sys::pg_enc::PG_SQL_ASCII as i32;
    sql_ascii.then(|| std::str::from_utf8(bytes).ok()).flatten()
}

/// The bytes with every byte that is not ASCII written as `\xNN`: how a refusal shows a text, and
/// how a text that cannot be read as UTF-8 is kept (a failure's error message).
pub fn escaped(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len());
    for &b in bytes {
        if b.is_ascii() {
            out.push(b as char);
        } else {
            out.push_str(&format!("\\x{b:02x}"));
        }
    }
    out
}

fn encoding_name() -> String {
    // SAFETY: the name of the backend's database encoding, a static string.
    unsafe { std::ffi::CStr::from_ptr(pg_sys::GetDatabaseEncodingName()) }.to_string_lossy().into_owned()
}

// SAFETY: a `text` argument is a varlena, unboxed as `&[u8]` unboxes one (detoasted, packed).
unsafe impl<'fcx> ArgAbi<'fcx> for Text<'fcx> {
    unsafe fn unbox_arg_unchecked(arg: Arg<'_, 'fcx>) -> Self {
        let index = arg.index();
        // SAFETY: the caller's promise: a `text` argument that is not NULL.
        Text(checked(index, unsafe { <&'fcx [u8] as ArgAbi<'fcx>>::unbox_arg_unchecked(arg) }))
    }

    unsafe fn unbox_nullable_arg(arg: Arg<'_, 'fcx>) -> Nullable<Self> {
        let index = arg.index();
        // SAFETY: the caller's promise: a `text` argument; a null pointer reads as NULL.
        match unsafe { <&'fcx [u8] as ArgAbi<'fcx>>::unbox_nullable_arg(arg) } {
            Nullable::Valid(bytes) => Nullable::Valid(Text(checked(index, bytes))),
            Nullable::Null => Nullable::Null,
        }
    }
}

/// A `text` argument as its bytes, in the database's encoding.
#[derive(Clone, Copy, Debug)]
pub struct RawText<'a>(pub &'a [u8]);

pgrx::impl_sql_translatable!(RawText<'_>, "text");

impl RawText<'_> {
    /// The text as UTF-8 where it reads so (`utf8`), else with its other bytes escaped.
    pub fn or_escaped(&self) -> std::borrow::Cow<'_, str> {
        match utf8(self.0) {
            Some(text) => text.into(),
            None => escaped(self.0).into(),
        }
    }
}

// SAFETY: a `text` argument is a varlena, unboxed as `&[u8]` unboxes one (detoasted, packed).
unsafe impl<'fcx> ArgAbi<'fcx> for RawText<'fcx> {
    unsafe fn unbox_arg_unchecked(arg: Arg<'_, 'fcx>) -> Self {
        // SAFETY: the caller's promise: a `text` argument that is not NULL.
        RawText(unsafe { <&'fcx [u8] as ArgAbi<'fcx>>::unbox_arg_unchecked(arg) })
    }

    unsafe fn unbox_nullable_arg(arg: Arg<'_, 'fcx>) -> Nullable<Self> {
        // SAFETY: the caller's promise: a `text` argument; a null pointer reads as NULL.
        match unsafe { <&'fcx [u8] as ArgAbi<'fcx>>::unbox_nullable_arg(arg) } {
            Nullable::Valid(bytes) => Nullable::Valid(RawText(bytes)),
            Nullable::Null => Nullable::Null,
        }
    }
}

// SAFETY: an element of a `text[]` is a varlena, unboxed as `&[u8]` unboxes one.
unsafe impl pgrx::datum::UnboxDatum for RawText<'_> {
    type As<'src>
        = RawText<'src>
    where
        Self: 'src;

    unsafe fn unbox<'src>(datum: pgrx::datum::Datum<'src>) -> RawText<'src>
    where
        Self: 'src,
    {
        // SAFETY: the caller's promise: a `text` element that is not NULL.
        RawText(unsafe { <&[u8] as pgrx::datum::UnboxDatum>::unbox(datum) })
    }
}

#[cfg(test)]
mod tests {
    use super::escaped;

    #[test]
    fn only_bytes_beyond_ascii_are_escaped() {
        assert_eq!(escaped(b"caf\xe9 'x' \\ \n"), "caf\\xe9 'x' \\ \n");
        assert_eq!(escaped("日".as_bytes()), "\\xe6\\x97\\xa5");
    }
}
