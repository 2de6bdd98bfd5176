//! Statements over tables whose rows come and go, planned by index whatever the statistics say.
//!
//! A stream's open ranges (`range_lease`, `range_done`) are written and deleted by nearly every
//! claim and outcome, and its exception rows (`exception_queue`) come and go with failures and
//! retries: a few live rows among the dead rows of recent calls, and often none. Postgres plans
//! a statement at its first execution in a backend and keeps the plan (src/statement.rs). A
//! plan made while such a table was empty or nearly so, once a `VACUUM` or `ANALYZE` has
//! recorded its statistics (a table never vacuumed is assumed to have 10 pages), scans it
//! sequentially, and every later execution reads every page the dead rows fill until something
//! makes Postgres plan it again: 175 pages a statement after 1,400 claims of an ordered drain
//! (docs/benchmarks/cost-model.md, "Plans made on an empty table"). A bitmap scan is no better:
//! it reads every entry its condition matches and marks none dead, where an index scan marks
//! the dead entries it passes so that later scans skip them.
//!
//! So the statements listed below run with sequential and bitmap scans off, and so are planned
//! that way (inside their first execution, and again after an invalidation). Each is answered
//! by a plain scan of one index per table it reads, joined by nested loops (hash and merge
//! joins are off too: either would read a whole side). `claim_due_rows` and
//! `claim_due_isolated` are not listed: they read a lane's due retries and expired leases, an
//! `OR` of two partial indexes' conditions that only a bitmap scan combines (src/claim.rs).
//!
//! And by which index: every index of these tables leads with the group, and on a table the
//! planner takes for a page or two each is costed at one row, so they tie, and the one that
//! wins may walk every entry of the group (an ack looking its token up through the expiry
//! index reads all the ranges deleted since the last vacuum). While a listed statement is
//! planned, a table under `ASSUMED_PAGES` pages is costed as `ASSUMED_PAGES` pages of at least
//! `ASSUMED_ROWS` rows (Postgres assumes 10 pages of a table never vacuumed), so that the
//! index matching more of the condition selects fewer rows and wins.

use std::cell::Cell;

use pgrx::pg_sys;
use pgrx::prelude::*;
use pgrx::PgList;

/// The statements of the claim and outcome paths that read those tables through their indexes.
const BY_INDEX: &[&str] = &[
    "gate_any_blocker",
    "gate_check",
    "lanes_candidates",
    "lanes_free",
    "lanes_end_holds_with_ranges",
    "lanes_release",
    "range_for_token",
    "range_oldest_expired",
    "range_done",
    "range_lease",
    "range_split",
    "range_delete",
    "range_delete_token",
    "eq_delete_token_keys_if_parked",
    "lease_lock_held",
    "lease_extend",
    "due_next",
    "eq_update",
    "eq_inflight",
    "eq_succeed_rows",
    "eq_give_back_rows",
    "eq_defer_chain_rows",
    "eq_any_inflight",
    "eq_any_parked",
    "eq_wake",
    "inflight_count",
];

/// The size a listed statement's plan assumes of a table the planner finds smaller.
const ASSUMED_PAGES: pg_sys::BlockNumber = 10;
/// The rows it assumes at least: without statistics an equality selects 1/200 of them, so the
/// group alone 5 and the group and a token 1.
const ASSUMED_ROWS: f64 = 1000.0;

thread_local! {
    /// True while a listed statement runs (and is planned).
    static GUIDED: Cell<bool> = const { Cell::new(false) };
}

/// The hook that was installed before ours, called first.
static mut PREVIOUS_HOOK: pg_sys::get_relation_info_hook_type = None;

/// Installs the planner hook (once, from `_PG_init`).
pub fn init() {
    // SAFETY: at library load, before any planning of ours; chains to the hook installed before.
    unsafe {
        PREVIOUS_HOOK = pg_sys::get_relation_info_hook;
        pg_sys::get_relation_info_hook = Some(assume_a_size);
    }
}

/// While a listed statement is planned, sizes a table under `ASSUMED_PAGES` pages as
/// `ASSUMED_PAGES` pages of at least `ASSUMED_ROWS` rows, and each of its indexes as holding
/// them all (a partial index too: the planner applies its predicate's selectivity itself). An
/// inheritance parent is left as it is: its size is its children's.
#[pg_guard]
unsafe extern "C-unwind" fn assume_a_size(
    root: *mut pg_sys::PlannerInfo,
    relation: pg_sys::Oid,
    inherited: bool,
    rel: *mut pg_sys::RelOptInfo,
) {
    // SAFETY: the hook's contract: `rel` is the relation being planned, filled in by Postgres;
    // the previous hook is C and may raise an error, so it is called behind pgrx's guard.
    unsafe {
        if let Some(previous) = PREVIOUS_HOOK {
            pg_sys::ffi::pg_guard_ffi_boundary(|| previous(root, relation, inherited, rel));
        }
        if !GUIDED.get() || inherited || (*rel).pages >= ASSUMED_PAGES {
            return;
        }
        (*rel).pages = ASSUMED_PAGES;
        (*rel).tuples = (*rel).tuples.max(ASSUMED_ROWS);
        for index in PgList::<pg_sys::IndexOptInfo>::from_pg((*rel).indexlist).iter_ptr() {
            (*index).tuples = (*rel).tuples;
        }
    }
}

/// The planner's settings a listed statement turns off, and whether a listed statement ran, as
/// they were before a statement that reads by index; put back when dropped, also when the
/// statement raised an error (pgrx turns it into a panic that unwinds through this frame,
/// `panic = "unwind"` in Cargo.toml, before it re-raises it).
#[must_use]
pub struct ByIndex {
    seqscan: bool,
    bitmapscan: bool,
    hashjoin: bool,
    mergejoin: bool,
    guided: bool,
}

impl Drop for ByIndex {
    fn drop(&mut self) {
        // SAFETY: the planner's own settings, written back as they were; single-threaded backend.
        unsafe {
            pg_sys::enable_seqscan = self.seqscan;
            pg_sys::enable_bitmapscan = self.bitmapscan;
            pg_sys::enable_hashjoin = self.hashjoin;
            pg_sys::enable_mergejoin = self.mergejoin;
        }
        GUIDED.set(self.guided);
    }
}

/// For a statement in `BY_INDEX`: turns sequential and bitmap scans, hash and merge joins off,
/// and small tables' sizes up (`assume_a_size`), until the returned guard is dropped. These
/// are the planner's variables themselves, set without the GUC machinery: the consumer
/// functions already run under a nesting level of their own (their `SET` clauses), and a
/// second one per statement would cost more than the planner ever reads them. While the
/// statement runs, `SHOW` sees them off too, and whatever it fires is planned the same way: the
/// exception counts' triggers on `exception_queue` (which read only their transition tables),
/// and a user's own trigger on a stream's tables.
#[must_use]
pub fn guide(name: &str) -> Option<ByIndex> {
    if !BY_INDEX.contains(&name) {
        return None;
    }
    // SAFETY: reads and writes the planner's settings; `ByIndex` restores them.
    unsafe {
        let guard = ByIndex {
            seqscan: pg_sys::enable_seqscan,
            bitmapscan: pg_sys::enable_bitmapscan,
            hashjoin: pg_sys::enable_hashjoin,
            mergejoin: pg_sys::enable_mergejoin,
            guided: GUIDED.get(),
        };
        pg_sys::enable_seqscan = false;
        pg_sys::enable_bitmapscan = false;
        pg_sys::enable_hashjoin = false;
        pg_sys::enable_mergejoin = false;
        GUIDED.set(true);
        Some(guard)
    }
}

#[cfg(test)]
mod tests {
    use super::BY_INDEX;

    /// Every name listed is a statement of the library, once: a renamed statement would
    /// otherwise silently lose its guide.
    #[test]
    fn every_listed_statement_exists() {
        let sources = [
            include_str!("key_gate.rs"),
            include_str!("lanes.rs"),
            include_str!("lanes/holds.rs"),
            include_str!("range.rs"),
            include_str!("lease.rs"),
            include_str!("due.rs"),
            include_str!("claim.rs"),
            include_str!("exception_queue/mod.rs"),
            include_str!("exception_queue/lifecycle.rs"),
            include_str!("inflight_cap.rs"),
        ]
        .concat();
        for name in BY_INDEX {
            assert_eq!(sources.matches(&format!("name: \"{name}\"")).count(), 1, "statement {name}");
        }
    }
}
