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
//! joins are off too: either would read a whole side). The statements that read these tables
//! and are not listed are in `NOT_BY_INDEX`, each with why: `claim_due_rows` and
//! `claim_due_isolated` read a lane's due retries and expired leases, an `OR` of two partial
//! indexes' conditions that only a bitmap scan combines (src/claim/due_rows.rs); the rest are
//! sweeps and admins' calls. Debug builds check each statement they prepare against the two
//! lists (`check_listed`).
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
    "eq_take_over_left",
    "gate_check",
    "lanes_candidates",
    "lanes_free",
    "lanes_end_holds_with_ranges",
    "lanes_end_holds_with_ranges_nothing_waited",
    "lanes_release",
    "range_for_token",
    "range_oldest_expired",
    "range_oldest_expired_held",
    "range_done",
    "range_lease",
    "range_leave",
    "range_split",
    "range_delete",
    "range_delete_token",
    "eq_delete_token_keys_if_parked",
    "lease_lock_held",
    "lease_extend",
    "cursor_advance",
    "due_next",
    "due_until",
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

/// The tables whose rows come and go: a statement that reads one (`FROM`, `JOIN`, `USING`,
/// `UPDATE`; an `INSERT` only writes) is in `BY_INDEX` or in `NOT_BY_INDEX`.
const CHURNING: &[&str] = &["range_lease_", "range_done_", "exception_queue_"];

/// Why a statement that reads those tables is planned as Postgres likes.
const BITMAP_OR: &str = "an OR of two partial indexes' conditions, which only a bitmap scan combines";
const SWEEP: &str = "a sweep of a whole group or stream, once a minute or from maintain()";
const ADMIN: &str = "an admin's or a monitor's call, planned with the statistics it finds";

/// The statements that read those tables and are not in `BY_INDEX`, each with why.
const NOT_BY_INDEX: &[(&str, &str)] = &[
    ("claim_due_rows", BITMAP_OR),
    ("claim_due_rows_between", BITMAP_OR),
    ("claim_due_isolated", BITMAP_OR),
    ("range_purge_done", SWEEP),
    ("retention_purge_resolved", SWEEP),
    ("retention_purge_archive", SWEEP),
    ("retention_drop_heads", SWEEP),
    ("bounds_lock_group", SWEEP),
    ("bounds_lost", SWEEP),
    ("bounds_move", SWEEP),
    ("group_delete", ADMIN),
    ("group_held_keys", ADMIN),
    ("seek_lock", ADMIN),
    ("seek_move", ADMIN),
    ("dead_redrive", ADMIN),
    ("dead_skip", ADMIN),
    ("dead_purge", ADMIN),
    ("inspect_progress", ADMIN),
    ("inspect_blocked_keys", ADMIN),
    ("inspect_dead", ADMIN),
    ("inspect_leases", ADMIN),
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

/// Whether `sql` reads one of the tables whose rows come and go: names it anywhere but as the
/// target of an `INSERT` (which only writes it), in any case and spacing.
fn reads_churning(sql: &str) -> bool {
    let sql = sql.split_whitespace().collect::<Vec<_>>().join(" ").to_uppercase();
    CHURNING.iter().any(|table| {
        let named = format!("SQLSTREAMS.{}", table.to_uppercase());
        sql.match_indices(&named).any(|(at, _)| !sql[..at].ends_with("INSERT INTO "))
    })
}

/// Whether statement `name` is on `BY_INDEX` or `NOT_BY_INDEX`.
fn listed(name: &str) -> bool {
    BY_INDEX.contains(&name) || NOT_BY_INDEX.iter().any(|(exempt, _)| *exempt == name)
}

/// Checks, in debug builds (the test suites' builds), that statement `name` with text `sql` is on
/// `BY_INDEX` or `NOT_BY_INDEX` exactly when it reads a table whose rows come and go: every
/// statement the suites prepare is checked as it runs, whatever macro built its text, so a new
/// statement on those tables cannot silently be left to plans made on an empty table, nor a
/// list keep a statement that no longer reads them.
pub fn check_listed(name: &str, sql: &str) {
    if cfg!(debug_assertions) {
        let reads = reads_churning(sql);
        assert!(
            reads == listed(name),
            "statement {name} {}: BY_INDEX and NOT_BY_INDEX list the statements that do (src/transient.rs)",
            if reads { "reads a table whose rows come and go" } else { "reads no table whose rows come and go" }
        );
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
    use std::path::{Path, PathBuf};

    use super::{listed, reads_churning, BY_INDEX, NOT_BY_INDEX};

    /// The library's sources, `src/` and its modules' folders.
    fn sources() -> String {
        fn files(dir: &Path) -> Vec<PathBuf> {
            let entries = std::fs::read_dir(dir).expect("src").map(|entry| entry.expect("entry").path());
            entries.flat_map(|path| if path.is_dir() { files(&path) } else { vec![path] }).collect()
        }
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        files(&src)
            .into_iter()
            .filter(|path| path.extension().is_some_and(|e| e == "rs"))
            .map(|path| std::fs::read_to_string(path).expect("source"))
            .collect()
    }

    /// Every name listed is a statement of the library, once, and on one list: a renamed
    /// statement would otherwise silently lose its guide.
    #[test]
    fn every_listed_statement_exists() {
        let sources = sources();
        for name in BY_INDEX.iter().chain(NOT_BY_INDEX.iter().map(|(name, _)| name)) {
            assert_eq!(sources.matches(&format!("name: \"{name}\"")).count(), 1, "statement {name}");
        }
        for (name, _) in NOT_BY_INDEX {
            assert!(!BY_INDEX.contains(name), "statement {name} is on both lists");
        }
    }

    /// Every statement whose text is written out in its constant and reads those tables is on a
    /// list. (Text a macro builds is checked by `check_listed` when the suites run it.)
    #[test]
    fn every_statement_written_out_is_listed() {
        let sources = sources();
        let mut seen = 0;
        for constant in sources.split("Statement {").skip(1) {
            let Some(name) = constant.trim_start().strip_prefix("name: \"").and_then(|rest| rest.split('"').next())
            else {
                continue;
            };
            if reads_churning(constant.split("params:").next().unwrap_or_default()) {
                seen += 1;
                assert!(listed(name), "statement {name} reads a table whose rows come and go and is on no list");
            }
        }
        assert!(seen > 20, "the scan found the statements ({seen})");
    }

    #[test]
    fn an_insert_writes_and_a_scan_reads() {
        assert!(!reads_churning("INSERT INTO sqlstreams.range_done_@id@ (a) SELECT unnest($1)"));
        assert!(!reads_churning("SELECT 1 FROM sqlstreams.lane_@id@ WHERE x"));
        assert!(reads_churning("DELETE FROM sqlstreams.range_done_@id@ WHERE x"));
        assert!(reads_churning("UPDATE sqlstreams.exception_queue_7 SET x = 1"));
        assert!(reads_churning("SELECT 1 FROM t\n  JOIN   sqlstreams.range_lease_@id@ r ON true"));
        assert!(reads_churning("select 1 from sqlstreams.lane_1 l, sqlstreams.range_lease_1 r"));
        assert!(reads_churning("SELECT * FROM ONLY sqlstreams.exception_queue_1"));
        assert!(reads_churning(
            "INSERT INTO sqlstreams.range_lease_@id@ (a) SELECT a FROM sqlstreams.range_lease_@id@ WHERE x"
        ));
    }
}
