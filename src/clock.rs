//! The one clock every decision reads: Postgres' current time, in microseconds since the
//! Postgres epoch (the representation of `timestamptz`).
//!
//! A caller reads it after the locks it waits for (src/locks.rs), so a lease or a backoff never
//! starts before the moment it is recorded.

use pgrx::pg_sys;

/// Now, in Postgres microseconds.
pub fn now() -> i64 {
    // SAFETY: reads the clock.
    unsafe { pg_sys::GetCurrentTimestamp() }
}
