//! `seek`: moves a group's position, backwards to replay or forwards to skip.
//!
//! After a seek to position P, the group's next claims hand out the messages after P, and the
//! group has forgotten everything it had open: its ranges end (outcomes under their tokens
//! report a lost lease), its exception rows go (a replay delivers those messages again, a skip
//! skips them, dead ones included), its lanes are free, and `claimed` and `committed` are P.
//! Messages that retention dropped are gone: a replay starts at the oldest one kept.
//!
//! Locks: the seek's steps of the lock order (docs/semantics.md, "One lock order"), which
//! takes the group's rows in the order outcomes do. A claim that commits while the seek waits is
//! ordered before it: what it handed out stays handed out (a replay delivers it again).

use pgrx::pg_sys::BuiltinOid::*;
use pgrx::prelude::*;

use crate::error::{SqlResult, StreamError};
use crate::names::validate_name;
use crate::notify;
use crate::statement::{self, Columns, Statement};
use crate::text::Text;

const LOCK: Statement = Statement {
    name: "seek_lock",
    sql: "SELECT (SELECT count(*) FROM (SELECT 1 FROM sqlstreams.exception_queue_@id@
                                        WHERE consumer_group_id = $1 FOR UPDATE) e)
               + (SELECT count(*) FROM (SELECT 1 FROM sqlstreams.range_lease_@id@
                                        WHERE consumer_group_id = $1 FOR UPDATE) r)
               + (SELECT count(*) FROM (SELECT 1 FROM sqlstreams.lane_@id@ WHERE consumer_group_id = $1
                                        ORDER BY lane FOR UPDATE) l)
               + (SELECT count(*) FROM (SELECT 1 FROM sqlstreams.cursor_@id@ WHERE consumer_group_id = $1
                                        FOR UPDATE) c) AS locked",
    params: &[INT8OID],
};

/// The position for a time: the last message produced before it, the newest such of each of
/// the stream's `$2` lanes (the log is keyed by lane and id).
const POSITION_AT: Statement = Statement {
    name: "seek_position_at",
    sql: "SELECT coalesce(max(n.id), 0) AS position FROM generate_series(0, $2 - 1) AS l(lane)
          CROSS JOIN LATERAL (SELECT m.id FROM sqlstreams.message_log_@id@ m
                              WHERE m.lane = l.lane AND m.produced_at < $1
                              ORDER BY m.id DESC LIMIT 1) n",
    params: &[TIMESTAMPTZOID, INT4OID],
};

const MOVE: Statement = Statement {
    name: "seek_move",
    sql: "WITH e AS (DELETE FROM sqlstreams.exception_queue_@id@ WHERE consumer_group_id = $1),
               r AS (DELETE FROM sqlstreams.range_lease_@id@ WHERE consumer_group_id = $1),
               d AS (DELETE FROM sqlstreams.range_done_@id@ WHERE consumer_group_id = $1),
               l AS (UPDATE sqlstreams.lane_@id@ SET claimed = $2, held_by = NULL, held_until = NULL
                     WHERE consumer_group_id = $1)
          UPDATE sqlstreams.cursor_@id@ SET claimed = $2, committed = $2 WHERE consumer_group_id = $1",
    params: &[INT8OID, INT8OID],
};

/// Moves a group to just after message `to_id`, or after the last message produced before
/// `to_time` (one of them): backwards replays, forwards skips. Everything the group had open is
/// forgotten (see the module documentation in docs/sql-api.md). Returns the new position.
/// Admins only.
#[pg_extern(volatile, parallel_unsafe, sql = false)]
fn seek(
    stream: Option<Text<'_>>,
    group_name: Option<Text<'_>>,
    to_id: default!(Option<i64>, "NULL"),
    to_time: default!(Option<TimestampWithTimeZone>, "NULL"),
) -> SqlResult<i64> {
    crate::standby::refuse_writes("seek")?;
    let stream = validate_name("stream", stream.as_deref())?;
    let group_name = validate_name("group", group_name.as_deref())?;
    if to_id.is_some() == to_time.is_some() {
        return Err(StreamError::invalid(
            "seek needs exactly one of to_id and to_time",
            "Pass to_id => a message id (0 for the beginning), or to_time => a timestamp.",
        )
        .into());
    }
    if let Some(id) = to_id.filter(|&id| id < 0) {
        return Err(StreamError::invalid(
            format!("to_id must not be negative, not {id}"),
            "Pass 0 to replay from the beginning.",
        )
        .into());
    }
    Ok(crate::admin::exclusive_admin_call(stream, group_name, "seek consumer groups", |client, g| {
        LOCK.run(client, g.stream.id, &[g.id.into()])?;
        let head = crate::head::read(g.stream.id)?;
        let position = match (to_id, to_time) {
            (Some(id), _) => id,
            (None, Some(time)) => POSITION_AT
                .run(client, g.stream.id, &[statement::timestamptz(time.into_inner()), g.stream.lanes.into()])?
                .first()
                .required("position")?,
            (None, None) => unreachable!("checked above"),
        }
        .min(head);
        MOVE.run(client, g.stream.id, &[g.id.into(), position.into()])?;
        notify::signal(g.stream.id);
        Ok(position)
    })?)
}
