//! Bounded streams. Retention drops only what every group has committed (src/retention.rs), so
//! one forgotten group (a decommissioned service, a paused one, a poison message held) would
//! keep every message until the disk is full. A stream may be bounded (`alter_stream`'s
//! `max_age` and `max_bytes`, NULL: unbounded): past a bound, `maintain()` moves every group
//! that has not consumed the partitions out of bounds past them, counts what each lost
//! (`cursor_<id>.lost`, shown by `group_status`) and says so in the server log, and retention
//! then drops those partitions.
//!
//! Whole partitions go, oldest first, at most 8 a round (as many as a retention step drops): one
//! is out of bounds when its newest message is older than `max_age`, or when it and the newer
//! partitions hold more than `max_bytes`. The partition with the head always stays. A stream
//! without groups is not bounded: nothing consumes it, and retention keeps it for its first
//! group.
//!
//! What a group loses: the messages of those partitions it was never handed out, and the ones
//! handed out in ranges without an outcome yet (their ranges end: an outcome under their token
//! reports a lost lease; a lane hold stays until it ends, so no key of it runs twice). Its
//! exception rows stay, and their messages are archived when the partitions go: retries and
//! dead letters go on. `committed` moves past them too, so it no longer means that every id
//! below it is resolved; the exception counts still show them.
//!
//! Locks: a bound's steps of the lock order (docs/semantics.md, "One lock order"). The log's
//! sequence is taken EXCLUSIVE only if free (`ConditionalLockRelationOid`): `nextval` holds it
//! until its transaction ends, so with it no producer holds an id it has not committed or
//! rolled back, and every id up to the head is final.

use pgrx::pg_sys::{self, BuiltinOid::*};
use pgrx::spi::SpiClient;

use crate::error::named;
use crate::error::Result;
use crate::partition::Log;
use crate::statement::{Access, Columns, Statement};
use crate::stream::StreamRef;

/// The stream's bounds, as microseconds and bytes.
const BOUNDS: Statement = Statement {
    name: "bounds_of_stream",
    sql: "SELECT (extract(epoch FROM max_age) * 1e6)::int8 AS max_age, max_bytes, now() AS now
          FROM sqlstreams.stream WHERE id = $1",
    params: &[INT8OID],
};

/// The log's partitions, oldest first, each with the bytes of it and every newer one.
const PARTITIONS: Statement = Statement {
    name: "bounds_partitions",
    sql: "SELECT p.n, (sum(p.bytes) OVER (ORDER BY p.n DESC))::int8 AS bytes_from_here
          FROM (SELECT substring(c.relname FROM '_p([0-9]+)$')::int8 AS n,
                       pg_catalog.pg_total_relation_size(c.oid) AS bytes
                FROM pg_catalog.pg_inherits i JOIN pg_catalog.pg_class c ON c.oid = i.inhrelid
                WHERE i.inhparent = $1) p
          ORDER BY p.n",
    params: &[OIDOID],
};

/// Partitions moved past in one round at most.
const PARTITIONS_PER_ROUND: usize = 8;

/// The groups whose committed position is below `$1`.
const LAGGING: Statement = Statement {
    name: "bounds_lagging",
    sql: "SELECT consumer_group_id FROM sqlstreams.cursor_@id@ WHERE committed < $1 ORDER BY consumer_group_id",
    params: &[INT8OID],
};

/// Group `$1`'s ranges, lanes and cursor row, in the order outcomes lock them, each only if
/// free: whether every one of them was.
const LOCK_GROUP: Statement = Statement {
    name: "bounds_lock_group",
    sql: "SELECT (SELECT count(*) FROM (SELECT 1 FROM sqlstreams.range_lease_@id@
                                        WHERE consumer_group_id = $1 FOR UPDATE SKIP LOCKED) r)
                   = (SELECT count(*) FROM sqlstreams.range_lease_@id@ WHERE consumer_group_id = $1)
             AND (SELECT count(*) FROM (SELECT 1 FROM sqlstreams.lane_@id@ WHERE consumer_group_id = $1
                                        ORDER BY lane FOR UPDATE SKIP LOCKED) l)
                   = (SELECT count(*) FROM sqlstreams.lane_@id@ WHERE consumer_group_id = $1)
             AND (SELECT count(*) FROM (SELECT 1 FROM sqlstreams.cursor_@id@ WHERE consumer_group_id = $1
                                        FOR UPDATE SKIP LOCKED) c) = 1 AS locked",
    params: &[INT8OID],
};

/// What group `$1` loses when its position moves past `$2`: messages up to `$2` its lanes never
/// handed out, and messages of its ranges starting at or below `$2` that have no outcome.
const LOST: Statement = Statement {
    name: "bounds_lost",
    sql: "SELECT (SELECT count(*) FROM sqlstreams.message_log_@id@ m
                  JOIN sqlstreams.lane_@id@ l ON l.consumer_group_id = $1 AND l.lane = m.lane
                  WHERE m.id <= $2 AND m.id > l.claimed)
             + (SELECT count(*) FROM sqlstreams.range_lease_@id@ r CROSS JOIN LATERAL unnest(r.pending) p(id)
                WHERE r.consumer_group_id = $1 AND r.first_id <= $2
                  AND NOT EXISTS (SELECT 1 FROM sqlstreams.range_done_@id@ d
                                  WHERE d.consumer_group_id = $1 AND d.lease_token = r.lease_token
                                    AND d.message_id = p.id)) AS lost",
    params: &[INT8OID, INT8OID],
};

/// Moves group `$1` past `$2`, adding `$3` to what it lost: its ranges starting at or below
/// `$2` end, its lanes and cursor move up to `$2` (lane holds stay until they end).
const MOVE: Statement = Statement {
    name: "bounds_move",
    sql: "WITH gone AS (DELETE FROM sqlstreams.range_lease_@id@ WHERE consumer_group_id = $1 AND first_id <= $2),
               lanes AS (UPDATE sqlstreams.lane_@id@ SET claimed = greatest(claimed, $2)
                         WHERE consumer_group_id = $1)
          UPDATE sqlstreams.cursor_@id@
          SET claimed = greatest(claimed, $2), committed = greatest(committed, $2), lost = lost + $3
          WHERE consumer_group_id = $1",
    params: &[INT8OID, INT8OID, INT8OID],
};

/// The log, waiting at most 20 ms, and its sequence's oid.
const LOCK_LOG: Statement = Statement {
    name: "bounds_lock_log",
    sql: "SELECT sqlstreams.lock_log($1) AS locked, 'sqlstreams.message_log_@id@_seq'::regclass::oid AS sequence",
    params: &[INT8OID],
};

const GROUP_NAME: Statement = Statement {
    name: "bounds_group_name",
    sql: "SELECT name FROM sqlstreams.consumer_group WHERE id = $1",
    params: &[INT8OID],
};

/// Moves the groups of `stream` that hold back partitions out of its bounds past them (only
/// groups in `groups`, whose locks this transaction holds: a group held by a seek or a drop is
/// left, and then so is the move). Returns how many groups it moved; adds to `warnings` what
/// each group that lost messages lost, for the caller to raise once the move stands (a step
/// rolled back after it lost nothing).
pub fn enforce(
    client: &SpiClient<'_>,
    name: &str,
    stream: &StreamRef,
    groups: &[i64],
    warnings: &mut Vec<String>,
) -> Result<usize> {
    let bounds = BOUNDS.run(client, 0, &[stream.id.into()])?.first();
    let (max_age, max_bytes): (Option<i64>, Option<i64>) = (bounds.value("max_age")?, bounds.value("max_bytes")?);
    if max_age.is_none() && max_bytes.is_none() {
        return Ok(0);
    }
    let now: pgrx::datum::TimestampWithTimeZone = bounds.required("now")?;
    let oldest_kept = max_age.map(|age| now.into_inner() - age);
    let log = Log::open(stream)?;
    let head = crate::head::read(stream.id)?;
    // The end of the last partition out of bounds, oldest first; the head's partition stays.
    let mut through = 0;
    for row in PARTITIONS.run(client, 0, &[log.oid().into()])?.take(PARTITIONS_PER_ROUND) {
        let (part, bytes_from_here): (i64, i64) = (row.required("n")?, row.required("bytes_from_here")?);
        let end = log.last_id(part);
        if end >= head {
            break;
        }
        let too_big = max_bytes.is_some_and(|max| bytes_from_here > max);
        let too_old = match oldest_kept {
            Some(limit) => {
                // The partition's newest message (none: an empty partition).
                let newest = crate::message::newest(client, stream, part, 0, Access::Write)?;
                newest.is_none_or(|(_, at)| at.into_inner() < limit)
            }
            None => false,
        };
        if !(too_big || too_old) {
            break;
        }
        through = end;
    }
    if through == 0 {
        return Ok(0);
    }
    let mut lagging = Vec::new();
    for row in LAGGING.run(client, stream.id, &[through.into()])? {
        let group: i64 = row.required("consumer_group_id")?;
        if !groups.contains(&group) {
            return Ok(0);
        }
        lagging.push(group);
    }
    if lagging.is_empty() {
        return Ok(0);
    }
    for &group in &lagging {
        let locked: bool = LOCK_GROUP.run(client, stream.id, &[group.into()])?.first().required("locked")?;
        if !locked {
            return Ok(0);
        }
    }
    let locked = LOCK_LOG.run(client, stream.id, &[stream.id.into()])?.first();
    if !locked.required::<bool>("locked")? {
        return Ok(0);
    }
    let sequence: pg_sys::Oid = locked.required("sequence")?;
    // SAFETY: takes the sequence's lock only if no other transaction holds a conflicting one.
    if !unsafe { pg_sys::ConditionalLockRelationOid(sequence, pg_sys::ExclusiveLock as pg_sys::LOCKMODE) } {
        return Ok(0);
    }
    for &group in &lagging {
        let lost: i64 = LOST.run(client, stream.id, &[group.into(), through.into()])?.first().required("lost")?;
        MOVE.run(client, stream.id, &[group.into(), through.into(), lost.into()])?;
        if lost == 0 {
            continue;
        }
        let group_name: String = GROUP_NAME.run(client, 0, &[group.into()])?.first().required("name")?;
        warnings.push(format!(
            "sqlstreams: stream {} is past its bound: group {} lost {lost} message(s) it had not consumed, \
             and goes on after message {through}",
            named(name),
            named(&group_name),
        ));
    }
    Ok(lagging.len())
}
