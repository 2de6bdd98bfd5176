//! The exception counts (`exception_count_<id>`): how many exception rows each group has in each
//! status, so `group_status` sums a few rows instead of counting the queue.
//!
//! Statement triggers on the queue (`sqlstreams.exception_count_<id>()`, in the install script)
//! pass what each statement changed to `exception_counts_changed`, which adds it up in this
//! backend, per subtransaction: a subtransaction that rolls back takes its changes with it. Just
//! before the transaction commits (or is prepared), `flush` writes the sums, one row update per
//! group and status, however many statements changed the queue: into this backend's own row
//! (`writer` = its pid), locked with `SKIP LOCKED`, or a new row when that one is held (a
//! retention step is folding it). No two live backends share a row, so no commit waits for
//! another; an update of `delta` alone stays on its page (HOT), so the table stays a few pages.
//! Retention folds each group's rows into one per status (src/retention.rs).
//!
//! Only the library writes count rows (`writing`). A row inserted any other way is a restore's
//! copy of the source's counts, and the trigger `exception_count_restored` drops it: a
//! `--data-only` restore into tables made by a `--schema-only` one fires the queue's count
//! triggers as it loads the queue, which count its rows already (counted twice before). A
//! whole restore loads the counts before it creates any trigger, and keeps them.

use std::cell::{Cell, RefCell};

use pgrx::pg_sys::{self, BuiltinOid::*};
use pgrx::prelude::*;

use crate::error::{Result, SqlResult, StreamError};
use crate::exception_queue::Status;
use crate::statement::Statement;
use crate::text::RawText;

/// A change not written yet: `delta` rows of `group` entered (or left) `status`, in
/// subtransaction `sub`.
struct Pending {
    stream: i64,
    group: i64,
    status: Status,
    sub: pg_sys::SubTransactionId,
    delta: i64,
}

thread_local! {
    static PENDING: RefCell<Vec<Pending>> = const { RefCell::new(Vec::new()) };
    /// Set while the library itself writes count rows.
    static WRITING: Cell<bool> = const { Cell::new(false) };
}

/// Runs `write`, whose inserts of count rows the restore trigger lets through.
pub fn writing<T>(write: impl FnOnce() -> T) -> T {
    struct Reset(bool);
    impl Drop for Reset {
        fn drop(&mut self) {
            WRITING.with(|w| w.set(self.0));
        }
    }
    let _reset = Reset(WRITING.with(|w| w.replace(true)));
    write()
}

/// `BEFORE INSERT` on each `exception_count_<id>` (trigger `exception_count_restored`): keeps
/// the rows the library writes and drops any other, such as a data-only restore's.
#[pg_trigger(sql = false)]
fn exception_count_written<'a>(
    trigger: &'a pgrx::PgTrigger<'a>,
) -> std::result::Result<Option<PgHeapTuple<'a, AllocatedByPostgres>>, pgrx::PgTriggerError> {
    Ok(if WRITING.with(Cell::get) { trigger.new() } else { None })
}

/// Adds up one statement's changes to stream `stream_id`'s queue (called by its count trigger;
/// the three arrays are parallel). The statuses are taken as stored bytes, so that a call with a
/// status no queue row can hold (a caller's own, in any encoding) is refused as such, never
/// through pgrx's conversion to UTF-8.
#[pg_extern(volatile, parallel_unsafe, sql = false)]
fn exception_counts_changed(
    stream_id: i64,
    groups: Vec<Option<i64>>,
    statuses: Array<'_, RawText<'_>>,
    deltas: Vec<Option<i64>>,
) -> SqlResult<()> {
    if groups.len() != statuses.len() || groups.len() != deltas.len() {
        return Err(StreamError::Internal("exception count arrays differ in length".into()).into());
    }
    // SAFETY: reads the current subtransaction's id.
    let sub = unsafe { pg_sys::GetCurrentSubTransactionId() };
    // Every change checked before any is recorded.
    let changes = groups
        .into_iter()
        .zip(statuses.iter())
        .zip(deltas)
        .map(|((group, status), delta)| {
            let (Some(group), Some(status), Some(delta)) = (group, status, delta) else {
                return Err(StreamError::Internal("exception count arrays hold a NULL".into()));
            };
            let status = status.utf8().and_then(|s| Status::from_stored(s).ok()).ok_or_else(|| unknown(status))?;
            Ok(Pending { stream: stream_id, group, status, sub, delta })
        })
        .collect::<Result<Vec<_>>>()?;
    changes.into_iter().for_each(record);
    Ok(())
}

/// A status no queue row can hold, shown as an SQL literal that spells it (its first 40 bytes).
fn unknown(status: RawText<'_>) -> StreamError {
    let bytes = status.bytes();
    let shown = crate::text::shown(&bytes[..bytes.len().min(40)]);
    let literal = shown.literal().unwrap_or_else(|| shown.text.clone());
    StreamError::Internal(format!("unknown exception-queue status {literal}"))
}

/// Adds one change to this transaction's pending ones.
fn record(change: Pending) {
    PENDING.with(|pending| {
        let mut pending = pending.borrow_mut();
        match pending.iter_mut().find(|p| {
            p.sub == change.sub && p.stream == change.stream && p.group == change.group && p.status == change.status
        }) {
            Some(p) => p.delta += change.delta,
            None => pending.push(change),
        }
    });
}

/// A subtransaction ended: a commit merges its changes into its parent's, a rollback drops
/// them. (Merged, not relabelled: a loop of statements each in a subtransaction of its own keeps
/// one entry per group and status, not one per statement.)
pub fn end_subtransaction(committed: bool, sub: pg_sys::SubTransactionId, parent: pg_sys::SubTransactionId) {
    PENDING.with(|pending| {
        let mut pending = pending.borrow_mut();
        let ended: Vec<Pending> = pending.extract_if(.., |p| p.sub == sub).collect();
        if !committed {
            return;
        }
        drop(pending);
        for child in ended {
            record(Pending { sub: parent, ..child });
        }
    });
}

/// This transaction's changes to group `group`'s counts not written yet, as (ready, inflight,
/// deferred, dead, superseded): `group_status` adds them, so it shows what the caller's own
/// transaction sees, as its other columns do.
pub fn unwritten(stream: i64, group: i64) -> [i64; 5] {
    let mut sums = [0; 5];
    PENDING.with(|pending| {
        for p in pending.borrow().iter().filter(|p| p.stream == stream && p.group == group) {
            sums[p.status as usize] += p.delta;
        }
    });
    sums
}

/// The transaction ended (committed, prepared or rolled back): nothing is pending any more.
pub fn forget() {
    PENDING.with(|pending| pending.borrow_mut().clear());
}

/// Whether this transaction changed counts not written yet.
pub fn pending() -> bool {
    PENDING.with(|pending| !pending.borrow().is_empty())
}

/// Adds `$3` to this backend's row for group `$1` and status `$2` if it can lock it now.
const ADD_TO_OWN_ROW: Statement = Statement {
    name: "counts_add_to_own_row",
    sql: "UPDATE sqlstreams.exception_count_@id@ SET delta = delta + $3
          WHERE ctid = (SELECT ctid FROM sqlstreams.exception_count_@id@
                        WHERE consumer_group_id = $1 AND status = $2 AND writer = pg_catalog.pg_backend_pid()
                        LIMIT 1 FOR UPDATE SKIP LOCKED)
          RETURNING 1",
    params: &[INT8OID, TEXTOID, INT8OID],
};

const ADD_ROW: Statement = Statement {
    name: "counts_add_row",
    sql: "INSERT INTO sqlstreams.exception_count_@id@ (consumer_group_id, status, delta, writer)
          VALUES ($1, $2, $3, pg_catalog.pg_backend_pid())",
    params: &[INT8OID, TEXTOID, INT8OID],
};

/// Writes this transaction's changes, summed per stream, group and status (at pre-commit).
pub fn flush() -> Result<()> {
    let mut sums: Vec<(i64, i64, Status, i64)> = PENDING
        .with(|pending| pending.borrow_mut().drain(..).map(|p| (p.stream, p.group, p.status, p.delta)).collect());
    sums.sort_by_key(|s| (s.0, s.1, s.2 as u8));
    sums.dedup_by(|later, first| {
        let same = (later.0, later.1, later.2) == (first.0, first.1, first.2);
        if same {
            first.3 += later.3;
        }
        same
    });
    sums.retain(|s| s.3 != 0 && table_exists(s.0));
    if sums.is_empty() {
        return Ok(());
    }
    // Under REPEATABLE READ a row a fold deleted after the snapshot was taken cannot be locked
    // (a serialization failure): such a transaction adds rows.
    // SAFETY: reads this backend's isolation level.
    let snapshot_isolation = unsafe { pg_sys::XactIsoLevel } >= pg_sys::XACT_REPEATABLE_READ as i32;
    // At pre-commit no function's settings are in effect: the statements pin them as a claim's
    // do (src/search_path.rs), so the caller's path cannot put its own functions or operators in
    // them (they run as the owner).
    crate::search_path::when_needed(|| {
        // SPI runs under the active snapshot, and at pre-commit there is none (deferred
        // triggers, which run just before, push one the same way).
        // SAFETY: pushed here and popped below; an abort pops it too.
        let pushed = unsafe {
            let none = !pg_sys::ActiveSnapshotSet();
            if none {
                pg_sys::PushActiveSnapshot(pg_sys::GetTransactionSnapshot());
            }
            none
        };
        let written = crate::access::as_owner(|_| {
            writing(|| {
                Spi::connect_mut(|client| {
                    for (stream, group, status, delta) in &sums {
                        let args = [(*group).into(), status.as_str().into(), (*delta).into()];
                        if snapshot_isolation || ADD_TO_OWN_ROW.run(client, *stream, &args)?.is_empty() {
                            ADD_ROW.run(client, *stream, &args)?;
                        }
                    }
                    Ok(())
                })
            })
        });
        if pushed {
            // SAFETY: pops what was pushed above.
            unsafe { pg_sys::PopActiveSnapshot() };
        }
        written
    })
}

/// Whether stream `stream_id`'s count table still exists (the stream may have been dropped
/// later in the same transaction).
fn table_exists(stream_id: i64) -> bool {
    let name = std::ffi::CString::new(format!("exception_count_{stream_id}")).expect("no NUL in a number");
    // SAFETY: two syscache lookups by name.
    unsafe {
        let schema = pg_sys::get_namespace_oid(c"sqlstreams".as_ptr(), true);
        schema != pg_sys::InvalidOid && pg_sys::get_relname_relid(name.as_ptr(), schema) != pg_sys::InvalidOid
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn change(sub: pg_sys::SubTransactionId, status: Status, delta: i64) -> Pending {
        Pending { stream: 7, group: 3, status, sub, delta }
    }

    #[test]
    fn a_committed_subtransaction_merges_into_its_parent() {
        forget();
        // A loop of statements, each in a subtransaction of its own that is released.
        for sub in 2..1002 {
            record(change(sub, Status::Ready, 1));
            end_subtransaction(true, sub, 1);
        }
        assert_eq!(PENDING.with(|p| p.borrow().len()), 1, "one entry per group and status, not per statement");
        assert_eq!(unwritten(7, 3), [1000, 0, 0, 0, 0]);
        forget();
    }

    #[test]
    fn a_rolled_back_subtransaction_takes_its_changes_and_its_childrens() {
        forget();
        record(change(1, Status::Ready, 1));
        record(change(2, Status::Ready, 5));
        record(change(3, Status::Dead, 2));
        end_subtransaction(true, 3, 2);
        end_subtransaction(false, 2, 1);
        record(change(4, Status::Inflight, -1));
        end_subtransaction(true, 4, 1);
        assert_eq!(unwritten(7, 3), [1, -1, 0, 0, 0]);
        assert_eq!(unwritten(7, 4), [0; 5], "another group");
        forget();
        assert!(!pending());
    }
}
