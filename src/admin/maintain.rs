//! `maintain()`: the periodic housekeeping, as one idempotent function. Nothing depends on it
//! for correctness (claims create partitions ahead, producers when they must; group status is
//! computed live); running it from cron or a worker keeps that work off the hot paths and
//! stores each group's `claimed` and `committed`.

use pgrx::pg_sys::panic::ErrorReport;
use pgrx::prelude::*;

use crate::access;
use crate::error::{Result, StreamError};
use crate::partition::{self, Need};
use crate::range;
use crate::retention;
use crate::statement::{Columns, Statement};
use crate::stream::{self, StreamRef};
use crate::subtransaction::{caught, not_maintained, raise, Caught};
use crate::text::Text;

const STREAMS: Statement =
    Statement { name: "maintain_streams", sql: "SELECT name FROM sqlstreams.stream ORDER BY id", params: &[] };

/// Lane holds whose lease ran out (their consumer never came back). An expired hold frees its
/// lane either way; this keeps `open_leases` honest. Lanes a claim is taking are skipped.
const CLEAR_HOLDS: Statement = Statement {
    name: "maintain_clear_holds",
    sql: "UPDATE sqlstreams.lane_@id@ SET held_by = NULL, held_until = NULL
          WHERE (consumer_group_id, lane) IN (
              SELECT consumer_group_id, lane FROM sqlstreams.lane_@id@
              WHERE held_until <= now() FOR UPDATE SKIP LOCKED)",
    params: &[],
};

const PURGE_IDEMPOTENCY: Statement = Statement {
    name: "maintain_purge_idempotency",
    sql: "DELETE FROM sqlstreams.idempotency_key_@id@ WHERE expires_at <= now()",
    params: &[],
};

/// One stream's report: (name, partitions through, idempotency keys purged, cursors advanced,
/// expired lane holds cleared, partitions dropped, resolved exception rows purged).
type Report = (String, i64, i64, i64, i64, i64, i64);

/// Refuses a REPEATABLE READ or SERIALIZABLE transaction: the rows maintenance takes (cursor
/// rows, lane rows, exception counts) are updated by claims and commits all the time, and taking
/// one updated after the snapshot began is a serialization failure, so it would fail at random.
fn require_read_committed() -> Result<()> {
    if let Some(level) = crate::error::stricter_than_read_committed() {
        return Err(StreamError::WrongTransactionState {
            message: format!("maintain needs a READ COMMITTED transaction, not {level}"),
            hint: format!(
                "Under {level}, the rows that claims and commits update while it runs make it fail to \
                 serialize; run it in a READ COMMITTED transaction (BEGIN ISOLATION LEVEL READ COMMITTED). {}",
                crate::error::DEFAULT_ISOLATION_HINT
            ),
        });
    }
    Ok(())
}

/// Refuses a read-only transaction, which every step's first write would refuse less clearly.
pub(crate) fn require_read_write(function: &'static str) -> Result<()> {
    // SAFETY: reads this backend's transaction state.
    if unsafe { pgrx::pg_sys::XactReadOnly } {
        return Err(StreamError::ReadOnlyTransaction { function });
    }
    Ok(())
}

/// Every stream's housekeeping, in one transaction.
fn maintain_all() -> Result<Vec<Report>> {
    require_read_committed()?;
    // No stream's error, though every stream's step would meet it: refused before any runs.
    require_read_write("maintain()")?;
    access::as_owner(|caller| {
        Spi::connect_mut(|client| {
            caller.require_admin(client, "run maintain()")?;
            // A library the installed SQL does not match fails every stream alike: refused once,
            // with its hint, rather than left out stream by stream.
            crate::version::check_now(client, crate::statement::Access::Write)?;
            let mut names = Vec::new();
            for row in STREAMS.run(client, 0, &[])? {
                // A name this database cannot read as UTF-8 (a restore's: src/text.rs) is left
                // out, with a warning, as the worker leaves it.
                match row.required::<String>("name") {
                    Ok(name) => names.push(name),
                    Err(e) => Caught::from_error(&e).warn("sqlstreams: a stream is not maintained"),
                }
            }
            // Each stream in a subtransaction of its own: one that cannot be maintained (an
            // error of its own) is left out, with a warning, as the worker leaves it; what its
            // step did is rolled back, and the streams after it are maintained all the same.
            // What the steps that stand would say is said once every stream is done: a cancel
            // meanwhile rolls them all back.
            let mut steps = Vec::new();
            for name in &names {
                match caught(|| maintain_named(client, name).unwrap_or_else(raise)) {
                    Ok(step) => steps.extend(step),
                    Err(error) => not_maintained(name, &error),
                }
            }
            Ok(steps.into_iter().map(Step::stands).collect())
        })
    })
}

/// One stream's housekeeping in `maintain()`: none for a stream being dropped (skipped, not
/// waited for: this transaction may hold streams a caller's drop waits for, src/locks.rs) or
/// dropped since the list was read (unknown now).
fn maintain_named(client: &mut pgrx::spi::SpiClient<'_>, name: &str) -> Result<Option<Step>> {
    if !stream::try_hold(name) {
        return Ok(None);
    }
    match stream::lookup(client, name) {
        Err(StreamError::UnknownStream(_)) => Ok(None),
        found => Ok(Some(maintain_one(client, name.to_string(), found?)?)),
    }
}

/// One stream's housekeeping; nothing when the stream is being dropped right now.
fn maintain_stream_named(name: &str) -> Result<Vec<Report>> {
    require_read_committed()?;
    require_read_write("maintain_stream")?;
    access::as_owner(|caller| {
        Spi::connect_mut(|client| {
            caller.require_admin(client, "run maintain()")?;
            if !stream::try_hold(name) {
                return Ok(vec![]);
            }
            let stream = stream::lookup(client, name)?; // an unknown stream is an error, with its hint
            Ok(vec![maintain_one(client, name.to_string(), stream)?.stands()])
        })
    })
}

/// One stream's step done: its report, and the warnings it raises once the step stands.
struct Step {
    report: Report,
    warnings: Vec<String>,
}

impl Step {
    /// Raises the step's warnings (its subtransaction released and the call done: what they
    /// say stands) and returns its report.
    fn stands(self) -> Report {
        for warning in &self.warnings {
            warning!("{warning}");
        }
        self.report
    }
}

/// One stream's housekeeping, each part once: the stream as its caller looked it up, each
/// group's cursor stored once, before the bounds (which read it) and retention.
fn maintain_one(client: &mut pgrx::spi::SpiClient<'_>, name: String, stream: StreamRef) -> Result<Step> {
    let head = crate::head::read(stream.id)?;
    let through = partition::ensure(client, &stream, head, Need::Ahead)?;
    let purged = PURGE_IDEMPOTENCY.run(client, stream.id, &[])?.len() as i64;
    if let Some(missing) = retention::unrestored(client, &stream)? {
        let warning = format!(
            "sqlstreams: stream {} is maintained only in part: {missing}, as while a restore loads it; its \
             cursors, lane holds and retention wait until it is there",
            crate::error::named(&name)
        );
        return Ok(Step { report: (name, through, purged, 0, 0, 0, 0), warnings: vec![warning] });
    }
    let cleared = CLEAR_HOLDS.run(client, stream.id, &[])?.len() as i64;
    range::purge_done(client, stream.id)?;
    let groups = retention::groups_to_maintain(client, &stream)?;
    let advanced = retention::advance(client, &stream, &groups)?;
    let mut warnings = vec![];
    if crate::bounds::enforce(client, &name, &stream, &groups, &mut warnings)? > 0 {
        // A group moved past the bound may have resolved everything up to a point beyond it:
        // stored now, so this step's retention drops what it no longer needs.
        retention::advance(client, &stream, &groups)?;
    }
    let retained = retention::step(client, &stream, &groups)?;
    let report = (name, through, purged, advanced, cleared, retained.partitions_dropped, retained.rows_purged);
    Ok(Step { report, warnings })
}

/// Housekeeping for every stream: creates message_log partitions ahead of the head, purges
/// expired idempotency keys, stores each group's claimed and committed cursor, clears expired
/// lane holds, and applies retention (src/retention.rs). Idempotent; safe to run from cron at
/// any frequency.
#[pg_extern(volatile, parallel_unsafe, sql = false)]
fn maintain() -> std::result::Result<
    TableIterator<
        'static,
        (
            name!(stream, String),
            name!(partitions_through, i64),
            name!(idempotency_keys_purged, i64),
            name!(cursors_advanced, i64),
            name!(lane_holds_cleared, i64),
            name!(partitions_dropped, i64),
            name!(exception_rows_purged, i64),
        ),
    >,
    ErrorReport,
> {
    crate::standby::refuse_writes("maintain")?;
    Ok(TableIterator::new(maintain_all()?))
}

/// `maintain()` for one stream, in the caller's transaction: a cron job or worker that maintains
/// its streams one transaction each holds a stream's log (locked by a partition drop until
/// commit) only for that stream's step, not for every other stream's.
#[pg_extern(volatile, parallel_unsafe, sql = false)]
fn maintain_stream(
    stream_name: Option<Text<'_>>,
) -> std::result::Result<
    TableIterator<
        'static,
        (
            name!(stream, String),
            name!(partitions_through, i64),
            name!(idempotency_keys_purged, i64),
            name!(cursors_advanced, i64),
            name!(lane_holds_cleared, i64),
            name!(partitions_dropped, i64),
            name!(exception_rows_purged, i64),
        ),
    >,
    ErrorReport,
> {
    crate::standby::refuse_writes("maintain_stream")?;
    // Not STRICT: a NULL name is refused with 22023 like every other call's, not an empty result.
    let name = crate::names::validate_name("stream", stream_name.as_deref())?;
    Ok(TableIterator::new(maintain_stream_named(name)?))
}
