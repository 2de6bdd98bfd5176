//! A hot standby runs queries but writes nothing. Every call that writes (produce, claims,
//! outcomes, streams, groups, grants, maintenance) is refused there first, with 25006 and its
//! name, rather than with whatever its first write meets (a claim's update gave 25006, a
//! produce's transaction id XX000). Inspection works, and reads what has been replayed.

use pgrx::pg_sys;

use crate::error::{Result, StreamError};

/// Refuses `function` on a server in recovery.
pub fn refuse_writes(function: &'static str) -> Result<()> {
    // SAFETY: reads shared memory state any backend may read.
    if unsafe { pg_sys::RecoveryInProgress() } {
        return Err(StreamError::Standby { function });
    }
    Ok(())
}
