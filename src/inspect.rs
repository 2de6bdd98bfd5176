//! What a user can always see: each group's progress, blocked keys, open leases and dead rows.
//! Read-only functions over a stream's table family (the views in sql/api.sql build on them).

use pgrx::pg_sys::panic::ErrorReport;
use pgrx::pg_sys::BuiltinOid::*;
use pgrx::prelude::*;

use crate::cursor::{self, committed_now, head_sql};
use crate::error::Result;
use crate::group::{self, GroupRef};
use crate::names::validate_name;
use crate::payload::RawJsonb;
use crate::statement::Statement;

/// A group's progress in one statement, so every figure describes the same moment (two
/// statements would let a claim move the cursor between them).
const PROGRESS: Statement = Statement {
    name: "inspect_progress",
    sql: concat!(
        "SELECT c.claimed, greatest(c.committed, ",
        committed_now!("c.claimed"),
        "), ",
        head_sql!(),
        ",
                (SELECT count(*) FROM sqlstreams.range_lease_@id@ WHERE consumer_group_id = $1),
                e.ready, e.inflight, e.deferred, e.dead, e.superseded
         FROM sqlstreams.cursor_@id@ c,
              LATERAL (SELECT count(*) FILTER (WHERE status = 'ready') AS ready,
                              count(*) FILTER (WHERE status = 'inflight') AS inflight,
                              count(*) FILTER (WHERE status = 'deferred') AS deferred,
                              count(*) FILTER (WHERE status = 'dead') AS dead,
                              count(*) FILTER (WHERE status = 'superseded') AS superseded
                       FROM sqlstreams.exception_queue_@id@ WHERE consumer_group_id = $1) e
         WHERE c.consumer_group_id = $1"
    ),
    params: &[INT8OID],
};

const BLOCKED_KEYS: Statement = Statement {
    name: "inspect_blocked_keys",
    sql: "SELECT DISTINCT ON (e.message_key)
                 e.message_key, e.message_id, e.status, e.attempts, e.can_run_after, e.last_error,
                 count(*) OVER (PARTITION BY e.message_key) - 1
          FROM sqlstreams.exception_queue_@id@ e
          WHERE e.consumer_group_id = $1 AND e.message_key IS NOT NULL
            AND e.status IN ('ready', 'inflight', 'deferred')
          ORDER BY e.message_key, e.message_id",
    params: &[INT8OID],
};

const DEAD: Statement = Statement {
    name: "inspect_dead",
    sql: "SELECT e.message_id, e.message_key, e.attempts, e.delays, e.last_error, e.updated_at, m.payload
          FROM sqlstreams.exception_queue_@id@ e
          JOIN sqlstreams.message_log_@id@ m ON m.id = e.message_id
          WHERE e.consumer_group_id = $1 AND e.status = 'dead'
          ORDER BY e.message_id",
    params: &[INT8OID],
};

const LEASES: Statement = Statement {
    name: "inspect_leases",
    sql: "SELECT 'range', first_id, last_id, NULL::text, lease_token, lease_expires_at, cardinality(pending)
          FROM sqlstreams.range_lease_@id@ WHERE consumer_group_id = $1
          UNION ALL
          SELECT 'exception', message_id, message_id, message_key, lease_token, lease_expires_at, 1
          FROM sqlstreams.exception_queue_@id@ WHERE consumer_group_id = $1 AND status = 'inflight'
          UNION ALL
          SELECT 'key', NULL, NULL, message_key, lease_token, lease_expires_at, NULL
          FROM sqlstreams.message_key_lease_@id@ WHERE consumer_group_id = $1
          ORDER BY 1, 2, 4",
    params: &[INT8OID],
};

fn resolve(stream: Option<&str>, group_name: Option<&str>) -> Result<GroupRef> {
    let stream = validate_name("stream", stream)?;
    let group_name = validate_name("group", group_name)?;
    Spi::connect(|client| group::lookup(client, stream, group_name))
}

/// A group's progress: (claimed, committed, head, lag, open ranges, ready, inflight, deferred,
/// dead, superseded). `committed` is computed live, so it can be ahead of the stored cursor.
fn progress(group: &GroupRef) -> Result<(i64, i64, i64, i64, i64, i64, i64, i64, i64, i64)> {
    Spi::connect(|client| {
        let row = PROGRESS.run(client, group.stream.id, &[group.id.into()])?.first();
        let n = |i: usize| -> Result<i64> { Ok(row.get::<i64>(i)?.unwrap_or(0)) };
        let (committed, head) = (n(2)?, n(3)?);
        Ok((n(1)?, committed, head, head - committed, n(4)?, n(5)?, n(6)?, n(7)?, n(8)?, n(9)?))
    })
}

type ProgressRow = (
    name!(claimed, i64),
    name!(committed, i64),
    name!(head, i64),
    name!(lag, i64),
    name!(open_ranges, i64),
    name!(ready, i64),
    name!(inflight, i64),
    name!(deferred, i64),
    name!(dead, i64),
    name!(superseded, i64),
);

/// One group's cursor, head, lag and exception-queue counts by status.
#[pg_extern(stable, parallel_safe)]
fn group_status(
    stream: Option<&str>,
    group_name: Option<&str>,
) -> std::result::Result<
    TableIterator<
        'static,
        (
            name!(claimed, i64),
            name!(committed, i64),
            name!(head, i64),
            name!(lag, i64),
            name!(open_ranges, i64),
            name!(ready, i64),
            name!(inflight, i64),
            name!(deferred, i64),
            name!(dead, i64),
            name!(superseded, i64),
        ),
    >,
    ErrorReport,
> {
    let group = resolve(stream, group_name)?;
    let row: ProgressRow = progress(&group)?;
    Ok(TableIterator::once(row))
}

/// Keys whose delivery waits in the exception queue: the oldest unresolved message of each key,
/// its status, and how many later messages of the key wait behind it.
#[pg_extern(stable, parallel_safe)]
fn blocked_keys(
    stream: Option<&str>,
    group_name: Option<&str>,
) -> std::result::Result<
    TableIterator<
        'static,
        (
            name!(message_key, String),
            name!(oldest_message_id, i64),
            name!(status, String),
            name!(attempts, i32),
            name!(can_run_after, TimestampWithTimeZone),
            name!(last_error, Option<String>),
            name!(waiting_behind, i64),
        ),
    >,
    ErrorReport,
> {
    let group = resolve(stream, group_name)?;
    let rows = Spi::connect(|client| -> Result<Vec<_>> {
        let mut out = Vec::new();
        for row in BLOCKED_KEYS.run(client, group.stream.id, &[group.id.into()])? {
            out.push((
                row.get(1)?.expect("key"),
                row.get(2)?.expect("id"),
                row.get(3)?.expect("status"),
                row.get(4)?.expect("attempts"),
                row.get(5)?.expect("can_run_after"),
                row.get(6)?,
                row.get(7)?.expect("count"),
            ));
        }
        Ok(out)
    })?;
    Ok(TableIterator::new(rows))
}

/// Dead-lettered messages of a group, for triage. A dead predecessor released its ordered
/// successors; it does not mean its business operation happened.
#[pg_extern(stable, parallel_safe)]
fn dead_messages(
    stream: Option<&str>,
    group_name: Option<&str>,
) -> std::result::Result<
    TableIterator<
        'static,
        (
            name!(message_id, i64),
            name!(message_key, Option<String>),
            name!(attempts, i32),
            name!(delays, i32),
            name!(last_error, Option<String>),
            name!(died_at, TimestampWithTimeZone),
            name!(payload, RawJsonb),
        ),
    >,
    ErrorReport,
> {
    let group = resolve(stream, group_name)?;
    let rows = Spi::connect(|client| -> Result<Vec<_>> {
        let mut out = Vec::new();
        for row in DEAD.run(client, group.stream.id, &[group.id.into()])? {
            out.push((
                row.get(1)?.expect("id"),
                row.get(2)?,
                row.get(3)?.expect("attempts"),
                row.get(4)?.expect("delays"),
                row.get(5)?,
                row.get(6)?.expect("updated_at"),
                row.get(7)?.expect("payload"),
            ));
        }
        Ok(out)
    })?;
    Ok(TableIterator::new(rows))
}

/// Leases a group holds right now: ranges, exception-queue deliveries and exclusive keys.
#[pg_extern(stable, parallel_safe)]
fn open_leases(
    stream: Option<&str>,
    group_name: Option<&str>,
) -> std::result::Result<
    TableIterator<
        'static,
        (
            name!(kind, String),
            name!(first_id, Option<i64>),
            name!(last_id, Option<i64>),
            name!(message_key, Option<String>),
            name!(lease_token, pgrx::Uuid),
            name!(lease_expires_at, TimestampWithTimeZone),
            name!(pending, Option<i32>),
        ),
    >,
    ErrorReport,
> {
    let group = resolve(stream, group_name)?;
    let rows = Spi::connect(|client| -> Result<Vec<_>> {
        let mut out = Vec::new();
        for row in LEASES.run(client, group.stream.id, &[group.id.into()])? {
            out.push((
                row.get(1)?.expect("kind"),
                row.get(2)?,
                row.get(3)?,
                row.get(4)?,
                row.get(5)?.expect("token"),
                row.get(6)?.expect("expiry"),
                row.get(7)?,
            ));
        }
        Ok(out)
    })?;
    Ok(TableIterator::new(rows))
}

/// The highest message id handed out on a stream (0 when none), by stream id.
#[pg_extern(stable, parallel_safe)]
fn stream_head(stream_id: i64) -> std::result::Result<i64, ErrorReport> {
    Ok(Spi::connect(|client| cursor::sequence_head(client, stream_id))?)
}
