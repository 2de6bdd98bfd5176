//! What a user can always see: each group's progress, blocked keys, open leases and dead rows.
//! Read-only functions over a stream's table family (the views in the install script build on them).

use std::collections::HashMap;

use pgrx::pg_sys::panic::ErrorReport;
use pgrx::pg_sys::BuiltinOid::*;
use pgrx::prelude::*;

use pgrx::spi::{SpiClient, SpiHeapTupleData};

use crate::access::{self, Caller, Right};
use crate::cursor::{self, committed_now, observed_head_sql};
use crate::error::{Result, StreamError};
use crate::exception_queue::{counts, unresolved};
use crate::group::{self, GroupRef};
use crate::lanes;
use crate::message::{self, Address};
use crate::names::validate_name;
use crate::partition::Log;
use crate::payload::RawJsonb;
use crate::statement::{Access, Columns, Statement};
use crate::stream::StreamRef;
use crate::text::Text;

/// A group's progress, given `$2`, how far it has handed out everything
/// (`lanes::claimed_through`). `group_status` is `stable`: its statements all read the
/// caller's snapshot, so its figures describe one moment (which partitions of the log exist is
/// read as it is now, as any query over the log does: one dropped since holds nothing a group
/// still needs).
const PROGRESS: Statement = Statement {
    name: "inspect_progress",
    sql: concat!(
        "SELECT greatest(p.committed, c.claimed, $2) AS claimed, p.committed, ",
        observed_head_sql!("$4"),
        " AS head,
                (SELECT count(*) FROM sqlstreams.range_lease_@id@ WHERE consumer_group_id = $1) AS open_ranges,
                e.ready, e.inflight, e.deferred, e.dead, e.superseded, c.lost,
                -- The lane of the message after the committed position, when an exception row
                -- or a range starts there: where to read when it was produced.
                (SELECT lane FROM sqlstreams.exception_queue_@id@
                 WHERE consumer_group_id = $1 AND message_id = p.committed + 1 AND status IN ",
        unresolved!(),
        " LIMIT 1) AS exception_lane,
                (SELECT lane FROM sqlstreams.range_lease_@id@
                 WHERE consumer_group_id = $1 AND first_id = p.committed + 1) AS range_lane,
                -- The bytes of the partitions the group's position keeps: those holding a
                -- message after it, but the head's (src/bounds.rs).
                (SELECT coalesce(sum(pg_catalog.pg_total_relation_size(pc.oid)), 0)::int8
                 FROM pg_catalog.pg_inherits i JOIN pg_catalog.pg_class pc ON pc.oid = i.inhrelid,
                      LATERAL (SELECT (substring(pc.relname FROM '_p([0-9]+)$')::int8 + 1) * $3 AS last_id) b
                 WHERE i.inhparent = 'sqlstreams.message_log_@id@'::regclass
                   AND b.last_id > p.committed AND b.last_id < ",
        observed_head_sql!("$4"),
        ") AS held_back_bytes
         FROM sqlstreams.cursor_@id@ c,
              LATERAL (SELECT greatest(c.committed, ",
        committed_now!("$2"),
        ") AS committed
                       OFFSET 0) p, -- computed once, not once per use above
              -- The counts are the sums of the group's rows in exception_count_<id> (kept by
              -- triggers on the queue): a row per status and writing backend, not per message.
              LATERAL (SELECT coalesce(sum(delta) FILTER (WHERE status = 'ready'), 0)::int8 AS ready,
                              coalesce(sum(delta) FILTER (WHERE status = 'inflight'), 0)::int8 AS inflight,
                              coalesce(sum(delta) FILTER (WHERE status = 'deferred'), 0)::int8 AS deferred,
                              coalesce(sum(delta) FILTER (WHERE status = 'dead'), 0)::int8 AS dead,
                              coalesce(sum(delta) FILTER (WHERE status = 'superseded'), 0)::int8 AS superseded
                       FROM sqlstreams.exception_count_@id@ WHERE consumer_group_id = $1) e
         WHERE c.consumer_group_id = $1"
    ),
    params: &[INT8OID, INT8OID, INT8OID, INT8OID],
};

const BLOCKED_KEYS: Statement = Statement {
    name: "inspect_blocked_keys",
    sql: concat!(
        "SELECT DISTINCT ON (e.message_key)
                e.message_key, e.message_id, e.status, e.attempts, e.can_run_after, e.last_error,
                count(*) OVER (PARTITION BY e.message_key) - 1 AS waiting_behind
         FROM sqlstreams.exception_queue_@id@ e
         WHERE e.consumer_group_id = $1 AND e.message_key IS NOT NULL
           AND (e.status IN ",
        unresolved!(),
        "
                -- A dead ordered message holds its key in a group with on_dead = 'hold'.
                OR (e.status = 'dead' AND e.concurrency = 'ordered'
                    AND (SELECT on_dead FROM sqlstreams.consumer_group WHERE id = $1) = 'hold'))
         ORDER BY e.message_key, e.message_id"
    ),
    params: &[INT8OID],
};

/// A group's dead rows; `dead_messages` adds their payloads (`message::read_by_id`).
const DEAD: Statement = Statement {
    name: "inspect_dead",
    sql: "SELECT message_id, message_key, attempts, delays, last_error, updated_at, lane
          FROM sqlstreams.exception_queue_@id@
          WHERE consumer_group_id = $1 AND status = 'dead'
          ORDER BY message_id",
    params: &[INT8OID],
};

const LEASES: Statement = Statement {
    name: "inspect_leases",
    sql: "SELECT 'range' AS kind, first_id, last_id, NULL::text AS message_key, lease_token, lease_expires_at,
                 (SELECT count(*) FROM unnest(r.pending) AS p(id)
                  WHERE NOT EXISTS (SELECT 1 FROM sqlstreams.range_done_@id@ d
                                    WHERE d.consumer_group_id = $1 AND d.lease_token = r.lease_token
                                      AND d.message_id = p.id))::int4 AS pending,
                 lane
          FROM sqlstreams.range_lease_@id@ r WHERE consumer_group_id = $1
          UNION ALL
          SELECT 'exception', message_id, message_id, message_key, lease_token, lease_expires_at, 1, lane
          FROM sqlstreams.exception_queue_@id@ WHERE consumer_group_id = $1 AND status = 'inflight'
          UNION ALL
          SELECT 'lane', NULL, NULL, NULL, held_by, held_until, NULL, lane
          FROM sqlstreams.lane_@id@ WHERE consumer_group_id = $1 AND held_by IS NOT NULL
          ORDER BY 1, 8, 2",
    params: &[INT8OID],
};

/// The group named by a call's arguments.
pub(crate) fn resolve(
    client: &SpiClient<'_>,
    caller: &Caller,
    stream: Option<&str>,
    group_name: Option<&str>,
) -> Result<GroupRef> {
    let stream = validate_name("stream", stream)?;
    let group_name = validate_name("group", group_name)?;
    let group = group::lookup(client, stream, group_name, Access::Read)?;
    caller.require(client, group.stream.id, stream, Right::Inspect(group_name))?;
    Ok(group)
}

/// Runs a read-only per-group listing and decodes each row: the body every inspection function
/// shares.
fn list<T>(
    stream: Option<&str>,
    group_name: Option<&str>,
    statement: &Statement,
    decode: impl Fn(&SpiHeapTupleData<'_>) -> Result<T>,
) -> Result<Vec<T>> {
    access::as_owner(|caller| {
        Spi::connect(|client| {
            let group = resolve(client, caller, stream, group_name)?;
            statement.read(client, group.stream.id, &[group.id.into()])?.map(|row| decode(&row)).collect()
        })
    })
}

/// One group's progress. `committed` is computed live, so it can be ahead of the stored cursor.
struct Progress {
    claimed: i64,
    committed: i64,
    head: i64,
    open_ranges: i64,
    ready: i64,
    inflight: i64,
    deferred: i64,
    dead: i64,
    superseded: i64,
    /// When the oldest message the group has not resolved was produced.
    oldest_unresolved_at: Option<TimestampWithTimeZone>,
    /// Messages a bound of the stream dropped before the group consumed them (src/bounds.rs).
    lost: i64,
    /// Bytes of the log the group's position keeps.
    held_back_bytes: i64,
}

fn progress(stream: Option<&str>, group_name: Option<&str>) -> Result<Progress> {
    access::as_owner(|caller| {
        Spi::connect(|client| {
            let group = resolve(client, caller, stream, group_name)?;
            let safe = cursor::read_fence(client, group.stream.id, group.id, Access::Read)?.safe;
            let first_unclaimed = lanes::first_unclaimed(client, &group.stream, group.id, safe, Access::Read)?;
            let handed_out = first_unclaimed.map_or(safe, |first| safe.min(first.id - 1));
            let row = PROGRESS
                .read(
                    client,
                    group.stream.id,
                    &[
                        group.id.into(),
                        handed_out.into(),
                        group.stream.partition_size.into(),
                        cursor::replayed_head(client, &group.stream)?.into(),
                    ],
                )?
                .first();
            if row.is_empty() {
                return Err(StreamError::Internal("the group has no cursor row".into()));
            }
            let committed: i64 = row.required("committed")?;
            let head: i64 = row.required("head")?;
            let starts_there = row.value::<i32>("exception_lane")?.or(row.value::<i32>("range_lane")?);
            // The stored counts, and what this transaction changed that is written at commit.
            let [ready, inflight, deferred, dead, superseded] = counts::unwritten(group.stream.id, group.id);
            Ok(Progress {
                claimed: row.required("claimed")?,
                committed,
                head,
                open_ranges: row.required("open_ranges")?,
                ready: row.required::<i64>("ready")? + ready,
                inflight: row.required::<i64>("inflight")? + inflight,
                deferred: row.required::<i64>("deferred")? + deferred,
                dead: row.required::<i64>("dead")? + dead,
                superseded: row.required::<i64>("superseded")? + superseded,
                oldest_unresolved_at: oldest_unresolved_at(
                    client,
                    &group.stream,
                    committed,
                    head,
                    starts_there,
                    first_unclaimed,
                )?,
                lost: row.required("lost")?,
                held_back_bytes: row.required("held_back_bytes")?,
            })
        })
    })
}

/// When the first message after `committed` (up to `head`) was produced. As a rule it is where
/// an exception row or a range starts (`starts_there`: its lane) or a lane's first unclaimed
/// message, so its lane is known; otherwise (a group caught up to its last proven head, or a
/// rolled-back producer's gap) every lane is probed for its first message after `committed`.
fn oldest_unresolved_at(
    client: &SpiClient<'_>,
    stream: &StreamRef,
    committed: i64,
    head: i64,
    starts_there: Option<i32>,
    first_unclaimed: Option<Address>,
) -> Result<Option<TimestampWithTimeZone>> {
    let next = committed + 1;
    let lane = starts_there.or(first_unclaimed.filter(|first| first.id == next).map(|first| first.lane));
    if let Some(lane) = lane {
        if let Some(at) = message::produced_at(client, stream, Address { lane, id: next }, Access::Read)? {
            return Ok(Some(at));
        }
    }
    message::produced_after(client, stream, committed, head, Access::Read)
}

/// One group's cursor, head, lag, exception-queue counts by status, and when its oldest
/// unresolved message was produced (NULL when it has resolved everything). Parallel restricted:
/// it adds this backend's unwritten count changes, which a parallel worker does not have.
#[pg_extern(stable, parallel_restricted, sql = false)]
fn group_status(
    stream: Option<Text<'_>>,
    group_name: Option<Text<'_>>,
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
            name!(oldest_unresolved_at, Option<TimestampWithTimeZone>),
            name!(lost, i64),
            name!(held_back_bytes, i64),
        ),
    >,
    ErrorReport,
> {
    let p = progress(stream.as_deref(), group_name.as_deref())?;
    Ok(TableIterator::once((
        p.claimed,
        p.committed,
        p.head,
        p.head - p.committed,
        p.open_ranges,
        p.ready,
        p.inflight,
        p.deferred,
        p.dead,
        p.superseded,
        p.oldest_unresolved_at,
        p.lost,
        p.held_back_bytes,
    )))
}

/// Keys whose delivery waits in the exception queue: the oldest unresolved message of each key,
/// its status, and how many later messages of the key wait behind it.
#[pg_extern(stable, parallel_safe, sql = false)]
fn blocked_keys(
    stream: Option<Text<'_>>,
    group_name: Option<Text<'_>>,
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
    let rows = list(stream.as_deref(), group_name.as_deref(), &BLOCKED_KEYS, |row| {
        Ok((
            row.required("message_key")?,
            row.required("message_id")?,
            row.required("status")?,
            row.required("attempts")?,
            row.required("can_run_after")?,
            row.value("last_error")?,
            row.required("waiting_behind")?,
        ))
    })?;
    Ok(TableIterator::new(rows))
}

/// Dead-lettered messages of a group, for triage. A dead predecessor released its ordered
/// successors; it does not mean its business operation happened.
#[pg_extern(stable, parallel_safe, sql = false)]
fn dead_messages(
    stream: Option<Text<'_>>,
    group_name: Option<Text<'_>>,
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
            // NULL only for a snapshot older than the drop of the message's partition.
            name!(payload, Option<RawJsonb>),
        ),
    >,
    ErrorReport,
> {
    let rows = access::as_owner(|caller| {
        Spi::connect(|client| {
            let group = resolve(client, caller, stream.as_deref(), group_name.as_deref())?;
            let mut addresses = Vec::new();
            let rows = DEAD
                .read(client, group.stream.id, &[group.id.into()])?
                .map(|row| {
                    addresses.push(Address { lane: row.required("lane")?, id: row.required("message_id")? });
                    Ok((
                        row.required::<i64>("message_id")?,
                        row.value::<String>("message_key")?,
                        row.required::<i32>("attempts")?,
                        row.required::<i32>("delays")?,
                        row.value::<String>("last_error")?,
                        row.required::<TimestampWithTimeZone>("updated_at")?,
                    ))
                })
                .collect::<Result<Vec<_>>>()?;
            // From the log or the archive. A partition dropped after the caller's snapshot began
            // is gone from both for that snapshot (its archived rows are newer): the row still
            // shows, with a NULL payload.
            let payloads: HashMap<i64, RawJsonb> = message::read_by_id(client, &group, &addresses, Access::Read)?
                .into_iter()
                .map(|m| (m.candidate.message_id, m.payload))
                .collect();
            Ok(rows
                .into_iter()
                .map(|(id, key, attempts, delays, error, died)| {
                    (id, key, attempts, delays, error, died, payloads.get(&id).copied())
                })
                .collect::<Vec<_>>())
        })
    })?;
    Ok(TableIterator::new(rows))
}

/// Leases a group holds right now: ranges, exception-queue deliveries and held lanes.
#[pg_extern(stable, parallel_safe, sql = false)]
fn open_leases(
    stream: Option<Text<'_>>,
    group_name: Option<Text<'_>>,
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
            name!(lane, Option<i32>),
        ),
    >,
    ErrorReport,
> {
    let rows = list(stream.as_deref(), group_name.as_deref(), &LEASES, |row| {
        Ok((
            row.required("kind")?,
            row.value("first_id")?,
            row.value("last_id")?,
            row.value("message_key")?,
            row.required("lease_token")?,
            row.required("lease_expires_at")?,
            row.value("pending")?,
            row.value("lane")?,
        ))
    })?;
    Ok(TableIterator::new(rows))
}

const STREAM_EXISTS: Statement = Statement {
    name: "inspect_stream_exists",
    sql: "SELECT (SELECT name FROM sqlstreams.stream WHERE id = $1) AS name",
    params: &[INT8OID],
};

/// The highest message id handed out on a stream (0 when none), by stream id.
#[pg_extern(stable, parallel_safe, sql = false)]
fn stream_head(stream_id: i64) -> std::result::Result<i64, ErrorReport> {
    Ok(access::as_owner(|caller| {
        Spi::connect(|client| {
            let row = STREAM_EXISTS.read(client, 0, &[stream_id.into()])?.first();
            let Some(name) = row.value::<String>("name")? else {
                return Err(StreamError::UnknownStreamId(stream_id));
            };
            crate::locks::stream_shared(&name, true);
            crate::stream::confirm(&name, stream_id)?;
            caller.require(client, stream_id, &name, Right::Observe)?;
            // The stream's lanes and partitions matter on a standby only (`replayed_head`).
            let replayed = if cursor::in_recovery() {
                cursor::replayed_head(client, &crate::stream::lookup_read(client, &name)?)?
            } else {
                None
            };
            cursor::observed_head_of(client, stream_id, replayed)
        })
    })?)
}

/// Up to `$3` messages with ids in `($1, $2]` in one partition of the log (src/partition.rs),
/// oldest first: every lane's (of the stream's `$4`) in the window, since the log is keyed by lane
/// and id. `peek` keeps the window about twice as wide as the rows it still wants. The bounds are
/// scalar, so each lane's scan stops at the window's end (src/message.rs, `FIRST_AFTER`).
const PEEK: Statement = Statement {
    name: "inspect_peek",
    sql: "SELECT n.id, n.message_key, n.produced_at, n.payload FROM generate_series(0, $4 - 1) AS l(lane)
          CROSS JOIN LATERAL (SELECT m.id, m.message_key, m.produced_at, m.payload
                              FROM sqlstreams.message_log_@id@_p@part@ m
                              WHERE m.lane = l.lane AND m.id > $1 AND m.id <= $2
                              ORDER BY m.id LIMIT $3) n
          ORDER BY n.id LIMIT $3",
    params: &[INT8OID, INT8OID, INT4OID, INT4OID],
};

/// The messages of a stream after `after_id`, oldest first (at most `max_messages`), without
/// claiming anything: what an operator's `tail` shows. Needs a consume grant on one of the
/// stream's groups (or pg_monitor).
#[pg_extern(stable, parallel_safe, sql = false)]
fn peek(
    stream: Option<Text<'_>>,
    after_id: default!(Option<i64>, 0),
    max_messages: default!(Option<i32>, 100),
) -> std::result::Result<
    TableIterator<
        'static,
        (
            name!(message_id, i64),
            name!(message_key, Option<String>),
            name!(produced_at, TimestampWithTimeZone),
            name!(payload, RawJsonb),
        ),
    >,
    ErrorReport,
> {
    let stream = validate_name("stream", stream.as_deref())?;
    let limit = match max_messages {
        Some(n) if (1..=10_000).contains(&n) => n,
        other => {
            return Err(StreamError::invalid(
                format!("max_messages {} is not valid", other.map_or("NULL".into(), |n| n.to_string())),
                "Pass between 1 and 10000.",
            )
            .into())
        }
    };
    let after = after_id.unwrap_or(0);
    let rows = access::as_owner(|caller| {
        Spi::connect(|client| {
            let s = crate::stream::lookup_read(client, stream)?;
            caller.require(client, s.id, stream, Right::ReadMessages)?;
            let head = cursor::observed_head(client, &s)?;
            let log = Log::open(&s)?;
            let mut rows = Vec::new();
            // Ids are dense but for the gaps of rolled-back or open producers: a window of twice
            // as many ids as rows still wanted reads at most that many rows. A window that finds
            // none ends in a gap, and the next one starts at the next message (a probe per lane).
            'parts: for part in log.holding(client, after, head, Access::Read)? {
                let part = part?;
                let end = log.last_id(part).min(head);
                let mut from = after.max(log.last_id(part) - s.partition_size);
                while from < end {
                    let room = limit - rows.len() as i32;
                    let upto = from.saturating_add(2 * i64::from(room)).min(end);
                    let args = [from.into(), upto.into(), room.into(), s.lanes.into()];
                    let before = rows.len();
                    for row in PEEK.exec_in(client, s.id, part, &args, Access::Read)? {
                        rows.push((
                            row.required("id")?,
                            row.value("message_key")?,
                            row.required("produced_at")?,
                            row.required("payload")?,
                        ));
                    }
                    if rows.len() as i32 == limit {
                        break 'parts;
                    }
                    from = if rows.len() > before || upto == end {
                        upto
                    } else {
                        match message::first_after(client, &s, part, upto, end, Access::Read)? {
                            Some((next, _)) => next - 1,
                            None => end,
                        }
                    };
                }
            }
            Ok(rows)
        })
    })?;
    Ok(TableIterator::new(rows))
}
