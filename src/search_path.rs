//! The settings every statement of the library runs under: `search_path = pg_catalog, pg_temp`
//! and generic plans, so that nothing a caller or a stranger puts on their path can stand in
//! for a table, function or operator a statement names (and a plan kept for a session is not
//! planned again for every call, src/statement.rs).
//!
//! Most functions are declared with both settings (`SET` in their `CREATE FUNCTION`), which
//! Postgres applies around each call. `claim` and `claim_with_metadata` are declared without
//! them and run inside `when_needed`, because an idle claim answered from memory runs no
//! statement (src/quiet.rs) and so needs no settings: applying and restoring them was a large
//! part of such a call (docs/benchmarks/cost-model.md, "An idle claim sets no settings"). The
//! commit's count flush (src/exception_queue/counts.rs), which runs in no function, uses it too.
//!
//! src/statement.rs calls `pin` before it plans or runs any statement. Inside `when_needed`, the
//! first `pin` applies both settings the way a `SET` clause does, at a new nesting level, and
//! `when_needed` restores the caller's when it returns. An error restores nothing here: it
//! becomes a Postgres error, and the abort of the transaction or subtransaction restores them,
//! as it does for a `SET` clause (what catches an error and goes on, `subtransaction::caught`
//! for the maintenance worker and `maintain()`, rolls its subtransaction back first).
//! Outside `when_needed` the function's own `SET` clause pinned them; debug builds check the
//! search_path (a few internal functions, triggers among them, leave plans to the default).

use std::cell::Cell;
use std::ffi::CStr;

use pgrx::pg_sys;

/// The search_path of every statement of the library, and of its background worker.
pub const SEARCH_PATH: &CStr = c"pg_catalog, pg_temp";

/// Where the call in progress stands.
#[derive(Clone, Copy)]
enum Call {
    /// Not inside `when_needed`.
    Outside,
    /// Inside `when_needed`, no statement run yet.
    Unpinned,
    /// Inside `when_needed`, the settings applied at this nesting level.
    Pinned(i32),
}

thread_local! {
    static CALL: Cell<Call> = const { Cell::new(Call::Outside) };
    /// Whether this server has lz4 (`with_lz4_if`): unknown until a claim first asks for it.
    static LZ4: Cell<Option<bool>> = const { Cell::new(None) };
}

/// Runs `f`, whose statements pin the settings first; restores the caller's when it returns.
pub fn when_needed<T>(f: impl FnOnce() -> T) -> T {
    /// Puts the enclosing call's state back, and the settings when this call pinned them (not
    /// while unwinding: the abort does that).
    struct Scope(Call);
    impl Drop for Scope {
        fn drop(&mut self) {
            if let Call::Pinned(level) = CALL.replace(self.0) {
                if !std::thread::panicking() {
                    // SAFETY: closes the nesting level `pin` opened in this call, restoring the
                    // settings it saved, as fmgr_security_definer does after a call.
                    unsafe { pg_sys::AtEOXact_GUC(true, level) };
                }
            }
        }
    }
    let _scope = Scope(CALL.replace(Call::Unpinned));
    f()
}

/// Runs `f` with `default_toast_compression = lz4` when `wanted` and the server was built with
/// lz4, at a GUC nesting level of its own that closes when `f` returns (an error's abort closes
/// it otherwise): a claim's writes of its ranges of keyed messages, whose 100 ids and keys pass
/// the 2 kB at which Postgres compresses a row, and pglz took about 4 % of a keyed claim
/// (docs/benchmarks/cost-model.md, the twenty-fifth pass). Nothing else the claim writes: a row
/// that outlives its claim (an archived payload) stays as the caller's setting makes it. The
/// setting, not the ranges' table: a column's own `SET COMPRESSION lz4` goes into `pg_dump`'s
/// `CREATE TABLE` entry, and a server built without lz4 then refuses the table on restore.
pub fn with_lz4_if<T>(wanted: bool, f: impl FnOnce() -> T) -> T {
    if !wanted || LZ4.get() == Some(false) {
        return f();
    }
    // SAFETY: opens a nesting level and sets a user-settable setting at it, as a function's
    // `SET` clause does; a server without lz4 refuses the value (at DEBUG1, not ERROR), is not
    // asked again, and the level closes all the same.
    let level = unsafe {
        let level = pg_sys::NewGUCNestLevel();
        let set = pg_sys::set_config_option(
            c"default_toast_compression".as_ptr(),
            c"lz4".as_ptr(),
            pg_sys::GucContext::PGC_USERSET,
            pg_sys::GucSource::PGC_S_SESSION,
            pg_sys::GucAction::GUC_ACTION_SAVE,
            true,
            pg_sys::DEBUG1 as i32,
            false,
        );
        LZ4.set(Some(set > 0));
        level
    };
    let value = f();
    // SAFETY: closes the level opened above, restoring what was set at it.
    unsafe { pg_sys::AtEOXact_GUC(true, level) };
    value
}

/// Pins the settings for the statement about to run, unless they are in effect.
pub fn pin() {
    let call = CALL.get();
    if let Call::Outside = call {
        debug_assert!(path_pinned(), "a statement of the library runs without its search_path");
        return;
    }
    if path_pinned() && generic_plans() {
        return;
    }
    // SAFETY: opens a GUC nesting level, as fmgr does before applying a function's settings.
    let level = unsafe { pg_sys::NewGUCNestLevel() };
    for (name, value) in [(c"search_path", SEARCH_PATH), (c"plan_cache_mode", c"force_generic_plan")] {
        crate::settings::set(name, value, pg_sys::GucAction::GUC_ACTION_SAVE);
    }
    // The level to close when the call returns: the first this call opened, which closes any
    // after it, unless a rolled-back subtransaction closed it already (a level at or above the
    // new one is gone: `NewGUCNestLevel` counts up from the current level).
    let close = match call {
        Call::Pinned(first) if first < level => first,
        _ => level,
    };
    CALL.set(Call::Pinned(close));
}

/// Whether the search_path is the library's.
fn path_pinned() -> bool {
    // SAFETY: reads the setting's current value, set at startup.
    unsafe { !pg_sys::namespace_search_path.is_null() && CStr::from_ptr(pg_sys::namespace_search_path) == SEARCH_PATH }
}

/// Whether plans are generic.
fn generic_plans() -> bool {
    // SAFETY: reads the setting's current value.
    unsafe { pg_sys::plan_cache_mode == pg_sys::PlanCacheMode::PLAN_CACHE_MODE_FORCE_GENERIC_PLAN as i32 }
}
