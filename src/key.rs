//! A message's key as the claim path holds it. Every message of a key is in one lane
//! (src/lanes.rs), and the key gate (src/key_gate.rs) orders and excludes deliveries per key.
//! A claim holds the key of each message it hands out, and returns it as `text`.

/// A message's key: one of up to 24 bytes, as most keys are (a claim reads a hundred of them at
/// a time), is held without an allocation of its own.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Key(compact_str::CompactString);

pgrx::impl_sql_translatable!(Key, "text");

impl Key {
    /// A copy of `key`.
    pub fn new(key: &str) -> Key {
        Key(compact_str::CompactString::new(key))
    }

    /// The key as a `String`, for the paths that keep keys that way (exception rows, wake-ups).
    pub fn into_string(self) -> String {
        self.0.into_string()
    }
}

impl std::ops::Deref for Key {
    type Target = str;

    fn deref(&self) -> &str {
        &self.0
    }
}

impl From<String> for Key {
    fn from(key: String) -> Key {
        Key(key.into())
    }
}

/// A key argument (`text`) as its bytes, in the database's encoding. pgrx's `&str` fails, with
/// an internal error, on a text that is not ASCII in a database whose encoding is not UTF-8, and
/// its `text[]` of `String`s takes such a text as UTF-8 without a check; produce refuses such a
/// key with its own error instead (src/produce.rs).
#[derive(Clone, Copy, Debug)]
pub struct KeyText<'a>(pub &'a [u8]);

pgrx::impl_sql_translatable!(KeyText<'_>, "text");

// SAFETY: a `text` argument is a varlena, unboxed as `&[u8]` unboxes one (detoasted, packed).
unsafe impl<'fcx> pgrx::callconv::ArgAbi<'fcx> for KeyText<'fcx> {
    unsafe fn unbox_arg_unchecked(arg: pgrx::callconv::Arg<'_, 'fcx>) -> Self {
        // SAFETY: the caller's promise: a `text` argument that is not NULL.
        KeyText(unsafe { <&'fcx [u8] as pgrx::callconv::ArgAbi<'fcx>>::unbox_arg_unchecked(arg) })
    }

    unsafe fn unbox_nullable_arg(arg: pgrx::callconv::Arg<'_, 'fcx>) -> pgrx::nullable::Nullable<Self> {
        // SAFETY: the caller's promise: a `text` argument; a null pointer reads as NULL.
        match unsafe { <&'fcx [u8] as pgrx::callconv::ArgAbi<'fcx>>::unbox_nullable_arg(arg) } {
            pgrx::nullable::Nullable::Valid(bytes) => pgrx::nullable::Nullable::Valid(KeyText(bytes)),
            pgrx::nullable::Nullable::Null => pgrx::nullable::Nullable::Null,
        }
    }
}

// SAFETY: an element of a `text[]` is a varlena, unboxed as `&[u8]` unboxes one.
unsafe impl pgrx::datum::UnboxDatum for KeyText<'_> {
    type As<'src>
        = KeyText<'src>
    where
        Self: 'src;

    unsafe fn unbox<'src>(datum: pgrx::datum::Datum<'src>) -> KeyText<'src>
    where
        Self: 'src,
    {
        // SAFETY: the caller's promise: a `text` element that is not NULL.
        KeyText(unsafe { <&[u8] as pgrx::datum::UnboxDatum>::unbox(datum) })
    }
}

#[cfg(test)]
mod tests {
    use super::Key;

    #[test]
    fn a_key_keeps_its_bytes_short_or_long() {
        for key in ["", "k", "kéy-日本-🙂", &"k".repeat(24), &"k".repeat(25), &"日".repeat(342)] {
            assert_eq!(&*Key::new(key), key);
            assert_eq!(Key::from(key.to_string()).into_string(), key);
        }
    }
}
