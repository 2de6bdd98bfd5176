//! Lease tokens. A claim mints a random one (version 4) for what it hands out; expired work it
//! takes over and has no room for (the rest of a range it splits, expired ranges and rows of the
//! lane: src/claim/takeover.rs) gets a random one of version 8, which no claim mints: no
//! consumer holds it, and every claim's key gate can tell (src/key_gate.rs).

/// A new lease token for a claim: random (version 4).
pub fn new() -> pgrx::Uuid {
    pgrx::Uuid::from_bytes(*uuid::Uuid::new_v4().as_bytes())
}

/// A new token that no claim hands out, for what a claim took over and left for the next
/// (src/claim/takeover.rs): random too, but version 8, which no claim mints, so every claim's key
/// gate tells such a range or row, which no consumer holds, from a consumer's
/// (`held_by_a_consumer!`).
pub fn no_ones() -> pgrx::Uuid {
    pgrx::Uuid::from_bytes(*uuid::Uuid::new_v8(*uuid::Uuid::new_v4().as_bytes()).as_bytes())
}

/// Whether `token` is one `no_ones` minted: a call that names it answers as for a lease lost,
/// whoever read it (`open_leases` lists it), so no one can renew or resolve what it holds.
pub fn is_no_ones(token: pgrx::Uuid) -> bool {
    token.as_bytes()[6] >> 4 == 8
}

/// SQL: whether the token `$token` (an expression) may be a consumer's, not `no_ones`'s:
/// its version, the high half of its seventh byte, is not 8.
macro_rules! held_by_a_consumer {
    ($token:literal) => {
        concat!("get_byte(uuid_send(", $token, "), 6) >> 4 <> 8")
    };
}
pub(crate) use held_by_a_consumer;

#[cfg(test)]
mod tests {
    use super::*;

    /// `held_by_a_consumer!` reads a token's version as `get_byte(uuid_send(token), 6) >> 4`.
    #[test]
    fn no_ones_tokens_are_of_the_version_no_claim_mints() {
        assert_eq!(held_by_a_consumer!("t"), "get_byte(uuid_send(t), 6) >> 4 <> 8");
        for _ in 0..100 {
            assert_eq!(new().as_bytes()[6] >> 4, 4);
            assert_eq!(no_ones().as_bytes()[6] >> 4, 8);
            assert!(is_no_ones(no_ones()) && !is_no_ones(new()));
        }
        assert_ne!(no_ones(), no_ones(), "random");
    }
}
