//! Settings (GUCs) an administrator or a session can change.
//!
//! - `sqlstreams.max_lease` (superuser): the longest lease a claim or `extend_lease` may ask
//!   for. A consumer that dies holding a very long lease would hold its keys back until it
//!   runs out; `break_lease` ends one early.
//! - `sqlstreams.notify` (any session): whether calls wake idle consumers with NOTIFY at
//!   commit. A transaction that will be prepared (`PREPARE TRANSACTION`) cannot NOTIFY; it
//!   sets this off first (`SET LOCAL sqlstreams.notify = off`), and consumers then find its
//!   messages by polling.

use pgrx::{GucContext, GucFlags, GucRegistry, GucSetting};

use crate::error::{Result, StreamError};

/// Seconds.
static MAX_LEASE: GucSetting<i32> = GucSetting::<i32>::new(86_400);
static NOTIFY: GucSetting<bool> = GucSetting::<bool>::new(true);

/// Registers the settings (from `_PG_init`).
pub fn init() {
    GucRegistry::define_int_guc(
        c"sqlstreams.max_lease",
        c"The longest lease a claim or extend_lease may ask for.",
        c"A consumer that dies holding a lease holds its keys back until the lease runs out.",
        &MAX_LEASE,
        1,
        i32::MAX,
        GucContext::Suset,
        GucFlags::UNIT_S,
    );
    GucRegistry::define_bool_guc(
        c"sqlstreams.notify",
        c"Whether sqlstreams wakes idle consumers with NOTIFY at commit.",
        c"Turn it off in a transaction that will be prepared (PREPARE TRANSACTION cannot NOTIFY).",
        &NOTIFY,
        GucContext::Userset,
        GucFlags::default(),
    );
}

/// Refuses a lease longer than `sqlstreams.max_lease` (22023).
pub fn check_lease(what: &str, micros: i64) -> Result<i64> {
    let max_seconds = i64::from(MAX_LEASE.get());
    if micros > max_seconds.saturating_mul(1_000_000) {
        return Err(StreamError::invalid(
            format!(
                "{what} {} is longer than sqlstreams.max_lease ({max_seconds} seconds)",
                crate::names::seconds(micros.into())
            ),
            format!(
                "Pass a {what} of at most {max_seconds} seconds and extend it with extend_lease while the handler \
                 runs, or ask an administrator to raise sqlstreams.max_lease."
            ),
        ));
    }
    Ok(micros)
}

/// Whether calls NOTIFY idle consumers.
pub fn notify() -> bool {
    NOTIFY.get()
}

/// Sets a user-settable server setting for this session, as `SET` would, with `action`:
/// `GUC_ACTION_LOCAL` for the rest of the transaction, `GUC_ACTION_SAVE` until the current GUC
/// nesting level is popped (as a function's `SET` clause does).
pub fn set(name: &std::ffi::CStr, value: &std::ffi::CStr, action: pgrx::pg_sys::GucAction::Type) {
    // SAFETY: valid NUL-terminated name and value of a user-settable setting; errors raise.
    unsafe {
        pgrx::pg_sys::set_config_option(
            name.as_ptr(),
            value.as_ptr(),
            pgrx::pg_sys::GucContext::PGC_USERSET,
            pgrx::pg_sys::GucSource::PGC_S_SESSION,
            action,
            true,
            pgrx::pg_sys::PGERROR as i32,
            false,
        );
    }
}
