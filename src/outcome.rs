//! Handler outcomes: `ack`, `ack_batch`, `fail`, `delay`.
//!
//! Each outcome names the lease token of the delivery it answers. A token that no longer holds
//! the message (the lease expired and another consumer took it over, or the outcome was already
//! recorded) changes nothing and reports "lease lost". A first delivery that succeeds writes no
//! exception row; it only leaves its range's pending list.
//!
//! Locks, in the order of src/locks.rs: the token lock, the token's rows, then the clock, then
//! the keys' locks (shared) for wake-ups. Outcomes never touch the cursor row.

use pgrx::pg_sys::{self, BuiltinOid::*};
use pgrx::prelude::*;
use pgrx::spi::SpiClient;

use crate::backoff;
use crate::error::{Result, SqlResult, StreamError};
use crate::exception_queue::{self, NewRow, Status};
use crate::group::{self, GroupRef};
use crate::locks;
use crate::message;
use crate::names::{self, positive_micros, validate_name};
use crate::policy::Policy;
use crate::range::{self, RangeLease};
use crate::statement::{self, Statement};

const ACK_ROWS: Statement = Statement {
    name: "outcome_ack_rows",
    sql: "DELETE FROM sqlstreams.exception_queue_@id@
          WHERE consumer_group_id = $1 AND lease_token = $2 AND status = 'inflight' AND message_id = ANY($3)
          RETURNING message_id, message_key",
    params: &[INT8OID, UUIDOID, INT8ARRAYOID],
};

const INFLIGHT_ROW: Statement = Statement {
    name: "outcome_inflight_row",
    sql: "SELECT message_key, concurrency, attempts, delays FROM sqlstreams.exception_queue_@id@
          WHERE consumer_group_id = $1 AND message_id = $2 AND status = 'inflight' AND lease_token = $3
          FOR UPDATE",
    params: &[INT8OID, INT8OID, UUIDOID],
};

const RECORD_FAILURE: Statement = Statement {
    name: "outcome_record_failure",
    sql: "UPDATE sqlstreams.exception_queue_@id@
          SET status = $3, attempts = $4, delays = $5, can_run_after = $6, last_error = coalesce($7, last_error),
              lease_token = NULL, lease_expires_at = NULL, parked = false, updated_at = $8
          WHERE consumer_group_id = $1 AND message_id = $2",
    params: &[INT8OID, INT8OID, TEXTOID, INT4OID, INT4OID, TIMESTAMPTZOID, TEXTOID, TIMESTAMPTZOID],
};

/// The rest of a failed row's chain in the exception queue: later inflight rows of its key under
/// the same token. Ordered rows wait for the failed row's retry; exclusive ones only for the key.
const DEFER_CHAIN_ROWS: Statement = Statement {
    name: "outcome_defer_chain_rows",
    sql: "UPDATE sqlstreams.exception_queue_@id@
          SET status = 'deferred', lease_token = NULL, lease_expires_at = NULL, parked = true,
              can_run_after = CASE WHEN concurrency = 'ordered' THEN $5 ELSE $6 END, updated_at = $6
          WHERE consumer_group_id = $1 AND message_key = $3 AND lease_token = $2 AND status = 'inflight'
            AND message_id > $4 AND concurrency <> 'parallel'",
    params: &[INT8OID, UUIDOID, TEXTOID, INT8OID, TIMESTAMPTZOID, TIMESTAMPTZOID],
};

/// What a failure or delay does to a message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Decision {
    Retry {
        attempts: i32,
        delays: i32,
        can_run_after: i64,
    },
    /// `note` replaces the caller's error text (why the budget dead-lettered it).
    Dead {
        attempts: i32,
        delays: i32,
        note: Option<&'static str>,
    },
}

impl Decision {
    fn status(self) -> Status {
        match self {
            Decision::Retry { .. } => Status::Ready,
            Decision::Dead { .. } => Status::Dead,
        }
    }
}

fn now() -> i64 {
    // SAFETY: reads the clock.
    unsafe { pg_sys::GetCurrentTimestamp() }
}

/// Records success for `ids` delivered under `token`; returns the ids that were recorded.
pub fn ack(stream: &str, group_name: &str, token: pgrx::Uuid, ids: &[i64]) -> Result<Vec<i64>> {
    crate::commit::consumer_call(|| {
        Spi::connect_mut(|client| {
            let group = group::lookup(client, stream, group_name)?;
            ack_in(client, &group, token, ids)
        })
    })
}

/// `ack` inside an open SPI connection (a claim carrying acks uses it too).
pub fn ack_in(client: &SpiClient<'_>, group: &GroupRef, token: pgrx::Uuid, ids: &[i64]) -> Result<Vec<i64>> {
    locks::token(token);
    let stream_id = group.stream.id;
    let mut done: Vec<(i64, Option<String>)> = Vec::new();
    for row in ACK_ROWS.run(client, stream_id, &[group.id.into(), token.into(), ids.to_vec().into()])? {
        done.push((row.get(1)?.expect("message_id"), row.get(2)?));
    }
    if done.len() < ids.len() {
        if let Some(mut range) = range::for_token(client, stream_id, group.id, token)? {
            let removed = range.remove(ids);
            if !removed.is_empty() {
                range::store_pending(client, stream_id, group.id, &range)?;
                done.extend(removed);
            }
        }
    }
    let keys = exception_queue::distinct_keys(done.iter().map(|(_, k)| k));
    exception_queue::after_outcome(client, group, Some(token), &keys, now())?;
    let mut recorded: Vec<i64> = done.into_iter().map(|(id, _)| id).collect();
    recorded.sort_unstable();
    Ok(recorded)
}

/// Records a failure or delay of `id` under `token`; `None` when the lease was lost.
fn record_failure(
    stream: &str,
    group_name: &str,
    token: pgrx::Uuid,
    id: i64,
    error: Option<String>,
    decide: impl FnOnce(&GroupRef, i32, i32, i64) -> Decision,
) -> Result<Option<Status>> {
    crate::commit::consumer_call(|| {
        Spi::connect_mut(|client| {
            let group = group::lookup(client, stream, group_name)?;
            let stream_id = group.stream.id;
            locks::token(token);
            let row = INFLIGHT_ROW.run(client, stream_id, &[group.id.into(), id.into(), token.into()])?.first();
            let mut range = range::for_token(client, stream_id, group.id, token)?;
            // After the rows' locks: a backoff or delay counts from when the outcome is recorded.
            let now = now();
            let (key, decision) = if !row.is_empty() {
                let decision = decide(&group, row.get(3)?.expect("attempts"), row.get(4)?.expect("delays"), now);
                let (status, attempts, delays, can_run_after) = columns(decision, now);
                let error = note(decision).or(error);
                RECORD_FAILURE.run(
                    client,
                    stream_id,
                    &[
                        group.id.into(),
                        id.into(),
                        status.as_str().into(),
                        attempts.into(),
                        delays.into(),
                        statement::timestamptz(can_run_after),
                        error.into(),
                        statement::timestamptz(now),
                    ],
                )?;
                (row.get::<String>(1)?, decision)
            } else if let Some(range) = range.as_mut().filter(|r| r.pending.contains(&id)) {
                range.remove(&[id]);
                let message = message::info(client, &group, &[id])?.pop().expect("a pending message exists");
                let decision = decide(&group, 0, 0, now);
                let (status, attempts, delays, can_run_after) = columns(decision, now);
                let error = note(decision).or(error);
                let row = NewRow {
                    message_id: id,
                    key: message.key.clone(),
                    policy: message.policy,
                    compaction: message.compaction,
                    status,
                    attempts,
                    delays,
                    can_run_after,
                    parked: false,
                    isolated: false,
                    last_error: error,
                };
                exception_queue::insert(client, stream_id, group.id, &[row], now)?;
                (message.key, decision)
            } else {
                return Ok(None);
            };
            if let (Decision::Retry { can_run_after, .. }, Some(key)) = (decision, key.as_deref()) {
                defer_chain(client, &group, token, key, id, can_run_after, range.as_mut(), now)?;
            }
            if let Some(range) = &range {
                range::store_pending(client, stream_id, group.id, range)?;
            }
            exception_queue::after_outcome(client, &group, Some(token), &exception_queue::distinct_keys([&key]), now)?;
            Ok(Some(decision.status()))
        })
    })
}

fn note(decision: Decision) -> Option<String> {
    match decision {
        Decision::Dead { note: Some(note), .. } => Some(note.to_string()),
        _ => None,
    }
}

fn columns(decision: Decision, now: i64) -> (Status, i32, i32, i64) {
    match decision {
        Decision::Retry { attempts, delays, can_run_after } => (Status::Ready, attempts, delays, can_run_after),
        Decision::Dead { attempts, delays, .. } => (Status::Dead, attempts, delays, now),
    }
}

/// When a chained row fails or is delayed, the rest of its chain is recorded deferred without
/// running: the later gated rows of its key under the same token, in the exception queue and in
/// the range. Ordered ones wait for the failed row (`ordered_until`); exclusive ones only for
/// the key, which `after_outcome` releases.
#[allow(clippy::too_many_arguments)]
fn defer_chain(
    client: &SpiClient<'_>,
    group: &GroupRef,
    token: pgrx::Uuid,
    key: &str,
    after: i64,
    ordered_until: i64,
    range: Option<&mut RangeLease>,
    now: i64,
) -> Result<()> {
    let stream_id = group.stream.id;
    DEFER_CHAIN_ROWS.run(
        client,
        stream_id,
        &[
            group.id.into(),
            token.into(),
            key.into(),
            after.into(),
            statement::timestamptz(ordered_until),
            statement::timestamptz(now),
        ],
    )?;
    let Some(range) = range else { return Ok(()) };
    let later = range.pending_after(key, after);
    if later.is_empty() {
        return Ok(());
    }
    let chained: Vec<_> =
        message::info(client, group, &later)?.into_iter().filter(|m| m.policy.is_keyed_gate()).collect();
    let ids: Vec<i64> = chained.iter().map(|m| m.message_id).collect();
    range.remove(&ids);
    let rows: Vec<NewRow> = chained
        .into_iter()
        .map(|m| NewRow {
            can_run_after: if m.policy == Policy::Ordered { ordered_until } else { now },
            message_id: m.message_id,
            key: m.key,
            policy: m.policy,
            compaction: m.compaction,
            status: Status::Deferred,
            attempts: 0,
            delays: 0,
            parked: true,
            isolated: false,
            last_error: None,
        })
        .collect();
    exception_queue::insert(client, stream_id, group.id, &rows, now)
}

fn required<T>(what: &str, value: Option<T>) -> Result<T> {
    names::required(what, value, "from the claim result the outcome answers")
}

/// Records that the handler of a claimed message succeeded. Returns false when the lease behind
/// lease_token was lost (expired and taken over, or already resolved): nothing changed.
#[pg_extern(volatile, parallel_unsafe, name = "ack")]
fn ack_sql(
    stream: Option<&str>,
    group_name: Option<&str>,
    lease_token: Option<pgrx::Uuid>,
    message_id: Option<i64>,
) -> SqlResult<bool> {
    let stream = validate_name("stream", stream)?;
    let group_name = validate_name("group", group_name)?;
    let token = required("lease_token", lease_token)?;
    let id = required("message_id", message_id)?;
    Ok(!ack(stream, group_name, token, &[id])?.is_empty())
}

/// Records success for many messages of one claim in one call; returns the ids recorded (an id
/// whose lease was lost is left out).
#[pg_extern(volatile, parallel_unsafe)]
fn ack_batch(
    stream: Option<&str>,
    group_name: Option<&str>,
    lease_token: Option<pgrx::Uuid>,
    message_ids: Option<Vec<Option<i64>>>,
) -> SqlResult<Vec<i64>> {
    let stream = validate_name("stream", stream)?;
    let group_name = validate_name("group", group_name)?;
    let token = required("lease_token", lease_token)?;
    let ids: Vec<i64> = required("message_ids", message_ids)?.into_iter().flatten().collect();
    Ok(ack(stream, group_name, token, &ids)?)
}

/// Records that a handler failed. Returns the message's new status: 'ready' (a retry is
/// scheduled with backoff, or after retry_after) or 'dead' (permanent, or the retry budget is
/// spent); NULL when the lease was lost. The rest of its same-key chain is recorded deferred.
#[pg_extern(volatile, parallel_unsafe, name = "fail")]
fn fail_sql(
    stream: Option<&str>,
    group_name: Option<&str>,
    lease_token: Option<pgrx::Uuid>,
    message_id: Option<i64>,
    error: Option<String>,
    permanent: default!(Option<bool>, false),
    retry_after: default!(Option<Interval>, "NULL"),
) -> SqlResult<Option<String>> {
    let stream = validate_name("stream", stream)?;
    let group_name = validate_name("group", group_name)?;
    let token = required("lease_token", lease_token)?;
    let id = required("message_id", message_id)?;
    let retry_after = match retry_after.map(|i| i.as_micros()) {
        Some(m) if m < 0 => {
            return Err(StreamError::invalid(
                "retry_after must not be negative",
                "Pass zero (retry at once), a positive interval, or NULL for the group's backoff.",
            )
            .into())
        }
        other => other.map(|m| m.min(i64::MAX as i128) as i64),
    };
    let permanent = permanent.unwrap_or(false);
    let error = Some(error.unwrap_or_else(|| "(no error message)".to_string()));
    let status =
        record_failure(stream, group_name, token, id, error, |group, attempts, delays, now| {
            match backoff::fail(&group.backoff, group.max_retries, attempts, permanent, retry_after, now) {
                backoff::FailureOutcome::Retry { attempts, can_run_after } => {
                    Decision::Retry { attempts, delays, can_run_after }
                }
                backoff::FailureOutcome::Dead { attempts } => Decision::Dead { attempts, delays, note: None },
            }
        })?;
    Ok(status.map(|s| s.as_str().to_string()))
}

/// Asks for the message to run again after `delay`, without counting a failure. Returns false
/// when the lease was lost. The message stays unresolved, so an ordered key keeps waiting.
#[pg_extern(volatile, parallel_unsafe, name = "delay")]
fn delay_sql(
    stream: Option<&str>,
    group_name: Option<&str>,
    lease_token: Option<pgrx::Uuid>,
    message_id: Option<i64>,
    delay: Option<Interval>,
) -> SqlResult<bool> {
    let stream = validate_name("stream", stream)?;
    let group_name = validate_name("group", group_name)?;
    let token = required("lease_token", lease_token)?;
    let id = required("message_id", message_id)?;
    let delay = positive_micros("delay", delay.map(|d| d.as_micros()), "'10 seconds'")?;
    let status = record_failure(stream, group_name, token, id, None, |group, attempts, delays, now| {
        let delays = delays + 1;
        if group.max_delays.is_some_and(|max| delays > max) {
            Decision::Dead { attempts, delays, note: Some("dead-lettered: the group's max_delays budget is spent") }
        } else {
            Decision::Retry { attempts, delays, can_run_after: now.saturating_add(delay) }
        }
    })?;
    Ok(status.is_some())
}
