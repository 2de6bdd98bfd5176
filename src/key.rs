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
