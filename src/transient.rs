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
//! by a plain scan of one index per table it reads. `claim_due_rows` and `claim_due_isolated`
//! are not listed: they read a lane's due retries and expired leases, an `OR` of two partial
//! indexes' conditions that only a bitmap scan combines (src/claim.rs).
//!
//! Which index is the other half. Every index of these tables leads with the group, and on a
//! table the planner takes for a page or two it estimates one row whatever the condition, so
//! all of them cost the same: an ack's lookup of its token's ranges went through the expiry
//! index, reading every range of the group the last few hundred claims deleted, where the
//! token's index reads its own. While a listed statement is planned, a table smaller than
//! `ASSUMED_PAGES` is costed as that many pages of `ASSUMED_ROWS` rows, as Postgres itself
//! assumes 10 pages of a table never vacuumed: then a condition on more of an index's columns
//! selects fewer rows, and that index wins.

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

/// The size a listed statement's plan assumes of a table the planner finds smaller: with it,
/// a condition on the group alone selects 5 rows (Postgres' default selectivity of an equality
/// without statistics is 1/200), and one on the group and a token or an expiry selects one.
const ASSUMED_PAGES: pg_sys::BlockNumber = 10;
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

/// While a listed statement is planned, sizes a table smaller than `ASSUMED_PAGES` as
/// `ASSUMED_PAGES` pages of `ASSUMED_ROWS` rows, with its indexes (those without a predicate:
/// a partial index's rows are its own estimate).
#[pg_guard]
unsafe extern "C-unwind" fn assume_a_size(
    root: *mut pg_sys::PlannerInfo,
    relation: pg_sys::Oid,
    inherited: bool,
    rel: *mut pg_sys::RelOptInfo,
) {
    // SAFETY: the hook's contract: `rel` is the relation being planned, filled in by Postgres.
    unsafe {
        if let Some(previous) = PREVIOUS_HOOK {
            previous(root, relation, inherited, rel);
        }
        if !GUIDED.get() || (*rel).pages >= ASSUMED_PAGES {
            return;
        }
        (*rel).pages = ASSUMED_PAGES;
        (*rel).tuples = (*rel).tuples.max(ASSUMED_ROWS);
        for index in PgList::<pg_sys::IndexOptInfo>::from_pg((*rel).indexlist).iter_ptr() {
            if (*index).indpred.is_null() {
                (*index).tuples = (*rel).tuples;
            }
        }
    }
}

/// The planner's `enable_seqscan` and `enable_bitmapscan`, and whether a listed statement ran,
/// as they were before a statement that reads by index; put back when dropped, also when the
/// statement raised an error (pgrx turns it into a panic that unwinds through this frame,
/// `panic = "unwind"` in Cargo.toml, before it re-raises it).
#[must_use]
pub struct ByIndex {
    seqscan: bool,
    bitmapscan: bool,
    guided: bool,
}

impl Drop for ByIndex {
    fn drop(&mut self) {
        // SAFETY: the planner's own settings, written back as they were; single-threaded backend.
        unsafe {
            pg_sys::enable_seqscan = self.seqscan;
            pg_sys::enable_bitmapscan = self.bitmapscan;
        }
        GUIDED.set(self.guided);
    }
}

/// For a statement in `BY_INDEX`: turns sequential and bitmap scans off, and small tables' sizes
/// up (`assume_a_size`), until the returned guard is dropped. These are the planner's variables themselves, set without the GUC machinery: the
/// consumer functions already run under a nesting level of their own (their `SET` clauses), and
/// a second one per statement would cost more than the planner ever reads them. While the
/// statement runs, `SHOW` and the plans of the triggers it fires (the exception counts' on
/// `exception_queue`, which read only their transition tables) see them off too, and those
/// plans assume the same sizes.
#[must_use]
pub fn guide(name: &str) -> Option<ByIndex> {
    if !BY_INDEX.contains(&name) {
        return None;
    }
    // SAFETY: reads and writes the planner's settings; `ByIndex` restores them.
    unsafe {
        let guard =
            ByIndex { seqscan: pg_sys::enable_seqscan, bitmapscan: pg_sys::enable_bitmapscan, guided: GUIDED.get() };
        pg_sys::enable_seqscan = false;
        pg_sys::enable_bitmapscan = false;
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
