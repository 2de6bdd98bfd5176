//! Dead letters, for operators: `redrive` gives dead messages another run with a fresh retry
//! budget, `skip` resolves one for good, `purge_dead` removes old ones. Each changes exception
//! rows like an outcome (docs/semantics.md, "One lock order").

use pgrx::pg_sys::BuiltinOid::*;
use pgrx::prelude::*;

use crate::clock;
use crate::error::SqlResult;
use crate::exception_queue::{self, Waker};
use crate::names::{message_id, validate_name};
use crate::notify;
use crate::statement::{self, Columns, Statement};
use crate::text::Text;

/// The dead rows become ready, and the group's stored `committed` moves back below the first
/// of them: a redriven message is unresolved again, so `group_status`, its lag and
/// `oldest_unresolved_age` count it, and `maintain()` keeps the cursor there until it resolves
/// (its `greatest()` never moves a stored `committed` back). Its partition may be gone: retention
/// archived the message with its row, and retention only ever drops what is below every group's
/// stored position. The cursor row comes after the exception rows, as in a seek, and is locked
/// whenever a row was redriven, even when `committed` is below it now: a `maintain()` step
/// (`cursor::advance`, which takes the row only if free) whose snapshot still sees the row dead
/// would otherwise store a `committed` past it as this commits. One that holds the row first is
/// waited for, and `least()` then applies to what it stored.
const REDRIVE: Statement = Statement {
    name: "dead_redrive",
    sql: "WITH r AS (UPDATE sqlstreams.exception_queue_@id@
                     SET status = 'ready', attempts = 0, delays = 0, can_run_after = $3, parked = false,
                         lease_token = NULL, lease_expires_at = NULL, updated_at = $3
                     WHERE consumer_group_id = $1 AND status = 'dead'
                       AND ($2::bigint[] IS NULL OR message_id = ANY($2))
                     RETURNING message_id),
               c AS (UPDATE sqlstreams.cursor_@id@
                     SET committed = least(committed, (SELECT min(message_id) - 1 FROM r))
                     WHERE consumer_group_id = $1 AND EXISTS (SELECT FROM r))
          SELECT message_id FROM r",
    params: &[INT8OID, INT8ARRAYOID, TIMESTAMPTZOID],
};

const SKIP: Statement = Statement {
    name: "dead_skip",
    sql: "DELETE FROM sqlstreams.exception_queue_@id@
          WHERE consumer_group_id = $1 AND message_id = $2 AND status = 'dead'
          RETURNING message_key",
    params: &[INT8OID, INT8OID],
};

const PURGE: Statement = Statement {
    name: "dead_purge",
    sql: "DELETE FROM sqlstreams.exception_queue_@id@
          WHERE consumer_group_id = $1 AND status = 'dead' AND updated_at <= $2 - make_interval(secs => $3 / 1e6)
          RETURNING message_key",
    params: &[INT8OID, TIMESTAMPTZOID, INT8OID],
};

/// Gives dead messages of a group (all of them, or `message_ids`) another run: each is ready at
/// once with a fresh retry budget, and an ordered key's redriven messages run in id order.
/// Returns the ids redriven. Admins only.
#[pg_extern(volatile, parallel_unsafe, sql = false)]
fn redrive(
    stream: Option<Text<'_>>,
    group_name: Option<Text<'_>>,
    message_ids: default!(Option<Vec<Option<i64>>>, "NULL"),
) -> SqlResult<Vec<i64>> {
    crate::standby::refuse_writes("redrive")?;
    let stream = validate_name("stream", stream.as_deref())?;
    let group_name = validate_name("group", group_name.as_deref())?;
    let ids: Option<Vec<i64>> = message_ids.map(|ids| ids.into_iter().flatten().collect());
    Ok(crate::admin::admin_call(stream, group_name, "redrive dead messages", |client, g| {
        let now = clock::now();
        let mut redriven: Vec<i64> = REDRIVE
            .run(client, g.stream.id, &[g.id.into(), ids.into(), statement::timestamptz(now)])?
            .map(|row| row.required("message_id"))
            .collect::<crate::error::Result<_>>()?;
        redriven.sort_unstable();
        if !redriven.is_empty() {
            notify::signal(g.stream.id);
        }
        Ok(redriven)
    })?)
}

/// Resolves one dead message for good without running it: its row goes, and with
/// `on_dead = 'hold'` its ordered key goes on. Returns false when it was not dead. Admins only.
#[pg_extern(volatile, parallel_unsafe, sql = false)]
fn skip(stream: Option<Text<'_>>, group_name: Option<Text<'_>>, message_id: Option<i64>) -> SqlResult<bool> {
    crate::standby::refuse_writes("skip")?;
    let stream = validate_name("stream", stream.as_deref())?;
    let group_name = validate_name("group", group_name.as_deref())?;
    let id = self::message_id(message_id)?;
    Ok(crate::admin::admin_call(stream, group_name, "skip dead messages", |client, g| {
        let rows = SKIP.run(client, g.stream.id, &[g.id.into(), id.into()])?;
        if rows.is_empty() {
            return Ok(false);
        }
        let key: Option<String> = rows.first().value("message_key")?;
        exception_queue::after_resolution(
            client,
            g,
            &exception_queue::distinct_keys([&key]),
            clock::now(),
            Waker::Outcome,
        )?;
        notify::signal(g.stream.id);
        Ok(true)
    })?)
}

/// Removes a group's dead messages that died at least `older_than` ago (all of them by
/// default). With `on_dead = 'hold'` their ordered keys go on. Returns how many. Admins only.
#[pg_extern(volatile, parallel_unsafe, sql = false)]
fn purge_dead(
    stream: Option<Text<'_>>,
    group_name: Option<Text<'_>>,
    older_than: default!(Option<Interval>, "'0 seconds'"),
) -> SqlResult<i64> {
    crate::standby::refuse_writes("purge_dead")?;
    let stream = validate_name("stream", stream.as_deref())?;
    let group_name = validate_name("group", group_name.as_deref())?;
    let older = match older_than.map(|i| i.as_micros()) {
        Some(m) if m >= 0 => m.min(i64::MAX as i128) as i64,
        _ => {
            return Err(crate::error::StreamError::invalid(
                "older_than must be zero or positive",
                "Pass how long ago the messages died, such as '7 days', or '0' for all of them.",
            )
            .into())
        }
    };
    Ok(crate::admin::admin_call(stream, group_name, "purge dead messages", |client, g| {
        let now = clock::now();
        let keys: Vec<Option<String>> = PURGE
            .run(client, g.stream.id, &[g.id.into(), statement::timestamptz(now), older.into()])?
            .map(|row| row.value("message_key"))
            .collect::<crate::error::Result<_>>()?;
        let purged = keys.len() as i64;
        exception_queue::after_resolution(client, g, &exception_queue::distinct_keys(&keys), now, Waker::Outcome)?;
        Ok(purged)
    })?)
}
