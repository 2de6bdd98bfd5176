//! Text arguments in the database's encoding.
//!
//! pgrx's `&str` and `String` arguments fail with an internal error (XX000, its own message) on
//! a text that is not ASCII in a database whose encoding is not UTF8, since Rust's strings are
//! UTF-8. The extension takes its text arguments as one of these instead:
//!
//! - `Text`, for names and words (streams, groups, policies, privileges): read as UTF-8 where
//!   it is (`utf8` says where), and refused with 22023 where it is not;
//! - `RawText`, the bytes, for what is taken as the caller wrote it: keys (refused by produce
//!   where they would not read back, src/produce.rs), a failure's error message (kept escaped
//!   where it would not), and a role's name (looked up by its bytes, src/admin/grants.rs).
//!
//! Messages show such texts with `shown`.

use std::borrow::Cow;
use std::cell::OnceCell;
use std::fmt::Write;

use pgrx::callconv::{Arg, ArgAbi};
use pgrx::nullable::Nullable;
use pgrx::pg_sys;
use pgrx::pg_sys::panic::ErrorReport;
use pgrx::PgLogLevel;

use crate::error::{quoted, StreamError};

/// The longest text a varlena holds (`MaxAllocSize` less the header).
pub const MAX_TEXT: usize = 0x3fff_ffff - pg_sys::VARHDRSZ;

/// How a database's texts read as UTF-8, as pgrx decides it.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Encoding {
    /// UTF8: valid UTF-8, but for a text cast from another database's bytes (a role's name).
    Utf8,
    /// SQL_ASCII: any bytes; those that are valid UTF-8 read as such.
    SqlAscii,
    /// Any other: all extend ASCII, and only ASCII reads the same as UTF-8.
    Other,
}

thread_local! {
    /// The database's encoding, read once per backend (it never changes).
    static ENCODING: OnceCell<Encoding> = const { OnceCell::new() };
}

fn encoding() -> Encoding {
    ENCODING.with(|e| {
        *e.get_or_init(|| {
            // SAFETY: reads the backend's database encoding.
            match unsafe { pg_sys::GetDatabaseEncoding() } as u32 {
                pg_sys::pg_enc::PG_UTF8 => Encoding::Utf8,
                pg_sys::pg_enc::PG_SQL_ASCII => Encoding::SqlAscii,
                _ => Encoding::Other,
            }
        })
    })
}

/// `text` as a message to the client and the server log can carry it in this database's
/// encoding: as it is in a UTF8 or an SQL_ASCII database; in any other, its ASCII, with `?` for
/// the rest (an error caught from Postgres comes decoded as UTF-8, and the bytes it had in the
/// database's encoding are lost; sent as they are, a multibyte encoding refuses them).
pub fn sendable(text: &str) -> Cow<'_, str> {
    if encoding() != Encoding::Other || text.is_ascii() {
        return Cow::Borrowed(text);
    }
    Cow::Owned(text.chars().map(|c| if c.is_ascii() { c } else { '?' }).collect())
}

/// The bytes of a text as UTF-8, where they read so: valid UTF-8 in a UTF8 or an SQL_ASCII
/// database (pgrx's rule), ASCII in any other (all extend ASCII). Checked in a UTF8 database too:
/// a text can carry bytes of another encoding there (a role's name, cast from the catalog every
/// database shares).
pub fn utf8(bytes: &[u8]) -> Option<&str> {
    match encoding() {
        Encoding::Utf8 | Encoding::SqlAscii => std::str::from_utf8(bytes).ok(),
        // SAFETY: ASCII is UTF-8.
        Encoding::Other => bytes.is_ascii().then(|| unsafe { std::str::from_utf8_unchecked(bytes) }),
    }
}

/// `utf8`, unchecked in a UTF8 database: for the texts the extension wrote itself (keys it read
/// back), which went through `utf8` on their way in.
///
/// # Safety
/// In a UTF8 database, `bytes` are valid UTF-8.
pub unsafe fn utf8_trusted(bytes: &[u8]) -> Option<&str> {
    match encoding() {
        // SAFETY: the caller's promise.
        Encoding::Utf8 => Some(unsafe { std::str::from_utf8_unchecked(bytes) }),
        _ => utf8(bytes),
    }
}

/// A text as a message shows it: as it is where it reads as UTF-8 and the server can show it (any
/// valid UTF-8 in a UTF8 or SQL_ASCII database, ASCII in another), else `escaped`. Safe for any
/// bytes: a role's name comes from the catalog every database shares, in the encoding of the
/// database it was created from.
pub struct Shown {
    pub text: String,
    escaped: bool,
    /// Whether an `E'...'` literal can spell the bytes here: they are valid text in this
    /// database's encoding (a name from a database of another encoding may not be).
    spellable: bool,
}

pub fn shown(bytes: &[u8]) -> Shown {
    let readable = match encoding() {
        Encoding::Other => bytes.is_ascii(),
        Encoding::Utf8 | Encoding::SqlAscii => std::str::from_utf8(bytes).is_ok(),
    };
    if readable {
        // SAFETY: checked just now (ASCII is UTF-8).
        let text = unsafe { std::str::from_utf8_unchecked(bytes) }.to_string();
        return Shown { text, escaped: false, spellable: true };
    }
    // SAFETY: reads `bytes.len()` bytes of `bytes`; never raises (noError).
    let spellable = i32::try_from(bytes.len()).is_ok_and(|len| unsafe {
        pg_sys::pg_verify_mbstr(pg_sys::GetDatabaseEncoding(), bytes.as_ptr().cast(), len, true)
    });
    Shown { text: escaped(bytes), escaped: true, spellable }
}

impl Shown {
    /// The text as an SQL literal that spells the same bytes (`E'...'` when escaped); `None`
    /// when no literal can here.
    pub fn literal(&self) -> Option<String> {
        let e = if self.escaped { "E" } else { "" };
        self.spellable.then(|| format!("{e}{}", quoted(Some(&self.text))))
    }
}

/// The bytes with every byte beyond ASCII written `\xNN` and every backslash doubled, as an
/// `E'...'` literal spells them: how a text that cannot be read as UTF-8 is shown, and kept (a
/// failure's error message, escaped as a whole).
fn escaped(bytes: &[u8]) -> String {
    escaped_at_most(bytes, usize::MAX)
}

/// `escaped`, cut to at most `max` bytes (with "..." after what it keeps): escaping may make a
/// text four times as long, past what a text can hold.
fn escaped_at_most(bytes: &[u8], max: usize) -> String {
    let unit = |b: u8| match b {
        b'\\' => 2,
        b if b.is_ascii() => 1,
        _ => 4,
    };
    // All of it when it fits; else what fits with the "..." after it.
    let whole: usize = bytes.iter().map(|&b| unit(b)).sum();
    let room = if whole <= max { whole } else { max.saturating_sub(3) };
    let mut out = String::with_capacity(room + 3);
    for &b in bytes {
        if out.len() + unit(b) > room {
            break;
        }
        match b {
            b'\\' => out.push_str("\\\\"),
            b if b.is_ascii() => out.push(b as char),
            b => {
                let _ = write!(out, "\\x{b:02x}");
            }
        }
    }
    if whole > max {
        out.push_str("...");
    }
    out
}

/// A `text` argument read as UTF-8, which it must be (`utf8`): refused, before the call does
/// anything, where it is not.
#[derive(Clone, Copy, Debug)]
pub struct Text<'a>(&'a str);

pgrx::impl_sql_translatable!(Text<'_>, "text");

impl std::ops::Deref for Text<'_> {
    type Target = str;

    fn deref(&self) -> &str {
        self.0
    }
}

impl<'a> Text<'a> {
    /// The text, for as long as the argument lives.
    pub fn into_str(self) -> &'a str {
        self.0
    }

    /// The argument at `index` (0-based), refused as a 22023 error when it cannot be read as
    /// UTF-8.
    fn checked(index: usize, text: RawText<'a>) -> Text<'a> {
        match text.utf8() {
            Some(text) => Text(text),
            None => {
                ErrorReport::from(refusal(&format!("argument {}", index + 1), text.0)).report(PgLogLevel::ERROR);
                unreachable!("an ERROR does not return")
            }
        }
    }
}

/// The refusal of a text that cannot be read as UTF-8 (`utf8`): `what` names it.
pub fn refusal(what: &str, bytes: &[u8]) -> StreamError {
    let (name, is_not) = described();
    let hint = match encoding() {
        Encoding::Utf8 => "Pass valid UTF-8 text.".to_string(),
        Encoding::SqlAscii => {
            "Pass ASCII or UTF-8 text in this database, or keep the streams in a UTF8 database.".to_string()
        }
        Encoding::Other => format!(
            "Pass ASCII text in this database, or keep the streams in a UTF8 database \
             (CREATE DATABASE ... ENCODING 'UTF8'): sqlstreams reads texts as UTF-8, and {name} \
             shares only ASCII with it."
        ),
    };
    StreamError::invalid(format!("{what} {} {is_not}, and the database's encoding is {name}", clipped(bytes)), hint)
}

/// Checks a value the extension read back from its own tables (`datum`, of type `type_oid`)
/// before pgrx converts it: a text, a varchar or an array of them must read as UTF-8 here
/// (`utf8`), where pgrx would panic (an internal error, `XX000`, with its source's location).
/// Every text the extension writes does; one that came another way does not, such as a UTF8
/// database's key restored into a LATIN1 database. Refused with `22021`, naming it. Nothing to
/// check in a UTF8 database, whose texts went through `utf8` on their way in, nor for other types.
pub fn check_stored(datum: pg_sys::Datum, is_null: bool, type_oid: pg_sys::Oid) -> Result<(), StreamError> {
    if is_null || !is_text(type_oid) || !checks_stored() {
        return Ok(());
    }
    let array = type_oid == pg_sys::TEXTARRAYOID || type_oid == pg_sys::VARCHARARRAYOID;
    if !array {
        return check_text(datum);
    }
    let (mut elements, mut nulls, mut count) = (std::ptr::null_mut(), std::ptr::null_mut(), 0);
    // SAFETY: an array of texts (or varchars, laid out alike: varlena, int-aligned), detoasted;
    // deconstruct_array fills `count` elements and null flags, pointing into the array. What
    // was allocated here is freed once the elements are checked.
    unsafe {
        let given = datum.cast_mut_ptr::<pg_sys::varlena>();
        let detoasted = pg_sys::pg_detoast_datum(given);
        let array = detoasted.cast::<pg_sys::ArrayType>();
        pg_sys::deconstruct_array(
            array,
            (*array).elemtype,
            -1,
            false,
            pg_sys::TYPALIGN_INT as _,
            &mut elements,
            &mut nulls,
            &mut count,
        );
        let count = usize::try_from(count).unwrap_or(0);
        let (values, null) = (std::slice::from_raw_parts(elements, count), std::slice::from_raw_parts(nulls, count));
        let checked = values.iter().zip(null).filter(|(_, null)| !**null).try_for_each(|(value, _)| check_text(*value));
        pg_sys::pfree(elements.cast());
        pg_sys::pfree(nulls.cast());
        if detoasted != given {
            pg_sys::pfree(detoasted.cast());
        }
        checked
    }
}

/// Whether `check_stored` looks at a value of type `type_oid`: a text, a varchar, or an array
/// of them.
#[inline]
pub fn is_text(type_oid: pg_sys::Oid) -> bool {
    type_oid == pg_sys::TEXTOID
        || type_oid == pg_sys::VARCHAROID
        || type_oid == pg_sys::TEXTARRAYOID
        || type_oid == pg_sys::VARCHARARRAYOID
}

/// Whether `check_stored` looks at anything: in a database whose encoding is not UTF8.
pub fn checks_stored() -> bool {
    encoding() != Encoding::Utf8
}

/// `check_stored` of one text or varchar datum that is not NULL.
fn check_text(value: pg_sys::Datum) -> Result<(), StreamError> {
    // SAFETY: a text or varchar datum that is not NULL, detoasted as pgrx detoasts it; the copy
    // detoasting makes (if any) is freed once read.
    unsafe {
        let given = value.cast_mut_ptr::<pg_sys::varlena>();
        let detoasted = pg_sys::pg_detoast_datum_packed(given);
        let bytes = pgrx::varlena::varlena_to_byte_slice(detoasted);
        let checked = match utf8(bytes) {
            Some(_) => Ok(()),
            None => Err(unreadable(bytes)),
        };
        if detoasted != given {
            pg_sys::pfree(detoasted.cast());
        }
        checked
    }
}

/// The refusal of a stored text that cannot be read as UTF-8 (`check_stored`).
fn unreadable(bytes: &[u8]) -> StreamError {
    let (name, is_not) = described();
    StreamError::UnreadableText {
        message: format!("a text stored in this database, {}, {is_not}, and the database's encoding is {name}", clipped(bytes)),
        hint: format!(
            "sqlstreams reads its texts as UTF-8 and writes only texts that read so in a {name} database; this one \
             came another way, such as a dump of a database of another encoding restored here. Restore that dump into a UTF8 database (CREATE DATABASE ... ENCODING \
             'UTF8'), or delete or rewrite what holds the text (docs/operations.md, \"Restoring onto another cluster\")."
        ),
    }
}

/// The database's encoding by name, and how a text that `utf8` does not read fails it.
fn described() -> (std::borrow::Cow<'static, str>, &'static str) {
    // SAFETY: the name of the backend's database encoding, a static string.
    let name = unsafe { std::ffi::CStr::from_ptr(pg_sys::GetDatabaseEncodingName()) }.to_string_lossy();
    let is_not = match encoding() {
        Encoding::Utf8 | Encoding::SqlAscii => "is not valid UTF-8",
        Encoding::Other => "is not ASCII",
    };
    (name, is_not)
}

/// How a message shows a text that cannot be read as UTF-8 here: up to 40 characters, as a
/// literal that spells its bytes where one can, then "..." if there is more, and the first byte
/// that cannot be read when it lies past those (`'aaa...'... (byte 51 is \xe9)`).
fn clipped(bytes: &[u8]) -> String {
    const SHOWN: usize = 40;
    let end = match std::str::from_utf8(bytes) {
        Ok(text) => text.char_indices().nth(SHOWN).map(|(end, _)| end),
        Err(_) if bytes.len() <= SHOWN => None,
        // Whole characters of a multibyte encoding (EUC_JP, ...), so the literal stays valid.
        // SAFETY: reads at most `len` bytes of `bytes`.
        Err(_) if encoding() == Encoding::Other => {
            let len = i32::try_from(bytes.len()).unwrap_or(i32::MAX);
            Some(unsafe { pg_sys::pg_mbcharcliplen(bytes.as_ptr().cast(), len, SHOWN as i32) } as usize)
        }
        // UTF-8's characters, and each byte that is not one as one.
        Err(_) => {
            let units = bytes
                .utf8_chunks()
                .flat_map(|chunk| chunk.valid().chars().map(char::len_utf8).chain(chunk.invalid().iter().map(|_| 1)));
            Some(units.take(SHOWN).sum())
        }
    };
    let (head, more) = match end {
        Some(end) if end < bytes.len() => (&bytes[..end], "..."),
        _ => (bytes, ""),
    };
    let first_unreadable = match encoding() {
        Encoding::Other => bytes.iter().position(|b| !b.is_ascii()),
        Encoding::Utf8 | Encoding::SqlAscii => std::str::from_utf8(bytes).err().map(|e| e.valid_up_to()),
    };
    let past = match first_unreadable {
        Some(at) if at >= head.len() => format!(" (byte {} is \\x{:02x})", at + 1, bytes[at]),
        _ => String::new(),
    };
    let shown = shown(head);
    format!("{}{more}{past}", shown.literal().unwrap_or_else(|| quoted(Some(&shown.text))))
}

// SAFETY: as `RawText`'s, which unboxes the argument.
unsafe impl<'fcx> ArgAbi<'fcx> for Text<'fcx> {
    unsafe fn unbox_arg_unchecked(arg: Arg<'_, 'fcx>) -> Self {
        let index = arg.index();
        // SAFETY: the caller's promise, passed on.
        Text::checked(index, unsafe { RawText::unbox_arg_unchecked(arg) })
    }

    unsafe fn unbox_nullable_arg(arg: Arg<'_, 'fcx>) -> Nullable<Self> {
        let index = arg.index();
        // SAFETY: the caller's promise, passed on.
        match unsafe { RawText::unbox_nullable_arg(arg) } {
            Nullable::Valid(text) => Nullable::Valid(Text::checked(index, text)),
            Nullable::Null => Nullable::Null,
        }
    }
}

/// A `text` argument (or element of a `text[]` argument) as its bytes, in the database's
/// encoding. Made only from a text value, so its bytes are one.
#[derive(Clone, Copy, Debug)]
pub struct RawText<'a>(&'a [u8]);

pgrx::impl_sql_translatable!(RawText<'_>, "text");

impl<'a> RawText<'a> {
    /// The text's bytes, in the database's encoding.
    pub fn bytes(&self) -> &'a [u8] {
        self.0
    }

    /// The text as UTF-8, where it reads so (`utf8`).
    pub fn utf8(&self) -> Option<&'a str> {
        utf8(self.0)
    }

    /// The text as UTF-8 where it reads so (`utf8`), else `escaped` as a whole; either way cut
    /// to at most `max` bytes, "..." included.
    pub fn kept(&self, max: usize) -> Cow<'a, str> {
        match self.utf8() {
            Some(text) if text.len() <= max => text.into(),
            Some(text) => {
                let mut end = max.saturating_sub(3);
                while !text.is_char_boundary(end) {
                    end -= 1;
                }
                format!("{}...", &text[..end]).into()
            }
            None => escaped_at_most(self.0, max).into(),
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
        assert_eq!(escaped(b"caf\xe9 'x' \\ \n"), "caf\\xe9 'x' \\\\ \n");
        assert_eq!(escaped("日".as_bytes()), "\\xe6\\x97\\xa5");
        assert_eq!(super::escaped_at_most(b"ab\xe9cd", 8), "ab\\xe9cd");
        assert_eq!(super::escaped_at_most(b"ab\xe9cd", 7), "ab...");
        assert_eq!(super::escaped_at_most(b"ab\xe9cdef", 9), "ab\\xe9...");
        assert_eq!(super::escaped_at_most(b"a\\b", 4), "a\\\\b");
    }
}
