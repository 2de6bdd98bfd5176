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

use pgrx::pg_sys;

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

/// The planner's `enable_seqscan` and `enable_bitmapscan` as they were before a statement
/// that reads by index; put back when dropped, also when the statement raised an error (pgrx
/// turns it into a panic that unwinds through this frame, `panic = "unwind"` in Cargo.toml,
/// before it re-raises it).
#[must_use]
pub struct ByIndex {
    seqscan: bool,
    bitmapscan: bool,
}

impl Drop for ByIndex {
    fn drop(&mut self) {
        // SAFETY: the planner's own settings, written back as they were; single-threaded backend.
        unsafe {
            pg_sys::enable_seqscan = self.seqscan;
            pg_sys::enable_bitmapscan = self.bitmapscan;
        }
    }
}

/// For a statement in `BY_INDEX`: turns sequential and bitmap scans off until the returned guard
/// is dropped. These are the planner's variables themselves, set without the GUC machinery: the
/// consumer functions already run under a nesting level of their own (their `SET` clauses), and
/// a second one per statement would cost more than the planner ever reads them. While the
/// statement runs, `SHOW` and the plans of the triggers it fires (the exception counts' on
/// `exception_queue`, which read only their transition tables) see them off too.
#[must_use]
pub fn guide(name: &str) -> Option<ByIndex> {
    if !BY_INDEX.contains(&name) {
        return None;
    }
    // SAFETY: reads and writes the planner's settings; `ByIndex` restores them.
    unsafe {
        let guard = ByIndex { seqscan: pg_sys::enable_seqscan, bitmapscan: pg_sys::enable_bitmapscan };
        pg_sys::enable_seqscan = false;
        pg_sys::enable_bitmapscan = false;
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
