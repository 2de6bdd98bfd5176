//! Statements over tables whose rows live briefly, planned as if the tables were not empty.
//!
//! A stream's open ranges (`range_lease`), unresolved exception rows (`exception_queue`) and
//! lane holds (`lane`) are rewritten or deleted by nearly every claim and outcome: a few live
//! rows among the dead rows of the last few hundred calls. Postgres plans a statement once per
//! backend and keeps the plan (src/statement.rs). A plan made while such a table was empty, or
//! after a `VACUUM` found it empty (0 pages and 0 rows, which the planner trusts), scans the
//! table sequentially, and every later execution reads every page the dead rows fill until a
//! `VACUUM` or `ANALYZE` makes Postgres plan it again: 175 pages a statement after 1,400
//! claims of an ordered drain (docs/benchmarks/cost-model.md, "Plans made on an empty table").
//! A bitmap scan of an index is no better: it reads every entry the condition matches, dead
//! ones too, where an index scan stops at the first live row and marks the dead entries it
//! passed so that later scans skip them.
//!
//! So the statements below run with sequential and bitmap scans off while they run (and so
//! while Postgres plans them, which it does inside their first executions and again after
//! an invalidation). Each of them has an index that answers it; with none the planner still
//! scans sequentially.

use pgrx::pg_sys;

/// Whether statement `name` reads one of the tables above by a condition one of its indexes
/// answers, on the claim and outcome paths.
fn by_index(name: &str) -> bool {
    matches!(
        name,
        "gate_any_blocker"
            | "gate_check"
            | "lanes_candidates"
            | "lanes_free"
            | "lanes_holders"
            | "lanes_end_holds_with_ranges"
            | "lanes_release"
            | "range_for_token"
            | "range_oldest_expired"
            | "range_done"
            | "range_lease"
            | "range_split"
            | "range_delete"
            | "range_delete_token"
            | "lease_lock_held"
            | "lease_extend"
            | "due_next"
            | "claim_due_rows"
            | "claim_due_isolated"
            | "eq_any_inflight"
            | "eq_any_parked"
            | "eq_wake"
            | "inflight_count"
    )
}

/// The planner's `enable_seqscan` and `enable_bitmapscan` as they were before a statement
/// that reads by index; put back when dropped, also when the statement raised an error (pgrx
/// unwinds through this frame before it re-raises the error).
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

/// For a statement that reads by index (`by_index`): turns sequential and bitmap scans off
/// until the returned guard is dropped. The settings are the planner's variables themselves,
/// set without the GUC machinery (a nesting level per statement costs more than the scans it
/// saves); nothing but the planner reads them while the statement runs.
pub fn guide(name: &str) -> Option<ByIndex> {
    if !by_index(name) {
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
    use super::by_index;

    /// Every name listed is a statement of the library: a renamed statement would otherwise
    /// silently lose its guide.
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
            include_str!("exception_queue/lifecycle.rs"),
            include_str!("inflight_cap.rs"),
        ]
        .concat();
        let listed: Vec<&str> = sources
            .split("name: \"")
            .skip(1)
            .filter_map(|rest| rest.split('"').next())
            .filter(|name| by_index(name))
            .collect();
        assert_eq!(listed.len(), 23, "listed statements found: {listed:?}");
        assert!(!by_index("message_after") && !by_index("cursor_read_fence_and_head"));
    }
}
