//! The settings the library's SQL runs under, for the calls that pin them only when they run
//! SQL.
//!
//! Every statement of the library runs with `search_path = pg_catalog, pg_temp` and generic
//! plans: nothing a caller or a stranger puts on their path can stand in for a table, function
//! or operator the statement names. Most functions are declared with both settings (`SET` in
//! their `CREATE FUNCTION`), which Postgres applies around each call. An idle claim answered
//! from memory runs no statement (src/quiet.rs), and for it those two settings were a tenth of
//! the server's work: setting them, putting them back (in PostgreSQL 15 a walk over every
//! setting) and the caller's next statement finding its search_path anew
//! (docs/benchmarks/cost-model.md, "An idle claim pins its settings only when it runs SQL").
//!
//! So `claim` and `claim_with_metadata` are declared without them and run inside `when_needed`:
//! src/statement.rs calls `pin` before it plans or runs any statement, which applies both
//! settings the way a `SET` clause does, at a new nesting level, unless they are in effect
//! already; `when_needed` puts them back when the call returns. An error needs nothing of ours:
//! the abort of the transaction or subtransaction puts them back, as it does for a `SET`
//! clause. Outside `when_needed`, `pin` does nothing: the function's own `SET` clause pinned them.

use std::cell::Cell;
use std::ffi::CStr;

use pgrx::pg_sys;

const SEARCH_PATH: &CStr = c"pg_catalog, pg_temp";

thread_local! {
    /// Inside `when_needed`: the nesting level `pin` opened, if it did (`Some(None)`: not yet).
    static CALL: Cell<Option<Option<i32>>> = const { Cell::new(None) };
}

/// Runs `f`, a call declared without the settings; its statements pin them first.
pub fn when_needed<T>(f: impl FnOnce() -> T) -> T {
    /// Puts the outer call's state back, and the settings when this call pinned them (not while
    /// unwinding: the abort does that).
    struct Scope(Option<Option<i32>>);
    impl Drop for Scope {
        fn drop(&mut self) {
            if let Some(Some(level)) = CALL.replace(self.0) {
                if !std::thread::panicking() {
                    // SAFETY: closes the nesting level `pin` opened in this call, restoring the
                    // settings it saved, as fmgr_security_definer does after a call.
                    unsafe { pg_sys::AtEOXact_GUC(true, level) };
                }
            }
        }
    }
    let _scope = Scope(CALL.replace(Some(None)));
    f()
}

/// Pins the settings for the statement about to run, inside `when_needed` and when they are not
/// in effect (a subtransaction rolled back since may have taken them back).
pub fn pin() {
    let Some(opened) = CALL.get() else {
        return;
    };
    if pinned() {
        return;
    }
    // SAFETY: opens a nesting level and sets two user-settable parameters in it, saving the
    // caller's values, as a `SET` clause of a function's declaration does.
    let level = unsafe {
        let level = pg_sys::NewGUCNestLevel();
        for (name, value) in [(c"search_path", SEARCH_PATH), (c"plan_cache_mode", c"force_generic_plan")] {
            pg_sys::set_config_option(
                name.as_ptr(),
                value.as_ptr(),
                pg_sys::GucContext::PGC_USERSET,
                pg_sys::GucSource::PGC_S_SESSION,
                pg_sys::GucAction::GUC_ACTION_SAVE,
                true,
                pgrx::PgLogLevel::ERROR as i32,
                false,
            );
        }
        level
    };
    // The first level this call opened is the one to close: closing it closes any after it.
    CALL.set(Some(Some(opened.unwrap_or(level))));
}

/// Whether both settings are in effect.
fn pinned() -> bool {
    // SAFETY: reads two settings' current values; the search_path string is never null once the
    // settings are initialized.
    unsafe {
        pg_sys::plan_cache_mode == pg_sys::PlanCacheMode::PLAN_CACHE_MODE_FORCE_GENERIC_PLAN as i32
            && !pg_sys::namespace_search_path.is_null()
            && CStr::from_ptr(pg_sys::namespace_search_path) == SEARCH_PATH
    }
}
