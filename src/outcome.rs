//! Handler outcomes: `ack`, `ack_batch`, `fail`, `delay`.
//!
//! Each outcome names the lease token of the delivery it answers. A token that no longer holds
//! the message (the lease expired and another consumer took it over, or the outcome was already
//! recorded) changes nothing and reports "lease lost". A first delivery that succeeds writes no
//! exception row; it only leaves its range's pending list. What each outcome does to a row is in
//! src/exception_queue/lifecycle.rs.
//!
//! Locks: an outcome's steps of the lock order (docs/semantics.md, "One lock order").

use pgrx::prelude::*;
use pgrx::spi::SpiClient;

use crate::backoff;
use crate::backoff::Setback;
use crate::clock;
use crate::commit::consumer_call;
use crate::error::{Result, SqlResult, StreamError};
use crate::exception_queue::{self, Status, Waker};
use crate::group::GroupRef;
use crate::key::Key;
use crate::lanes;
use crate::locks;
use crate::message;
use crate::names::{self, positive_micros, Answer};
use crate::notify;
use crate::own_claims;
use crate::range;
use crate::text::{RawText, Text};
use crate::token;

/// What an ack recorded.
pub struct Acked {
    /// The ids recorded, in order (an id whose lease was lost is left out).
    pub recorded: Vec<i64>,
    /// The lanes whose hold by the token ended here: nothing the token handed out from them is
    /// left unresolved.
    pub released_lanes: Vec<i32>,
}

/// Records success for `ids` delivered under `token`; returns the ids that were recorded.
pub fn ack(stream: &str, group_name: &str, token: pgrx::Uuid, ids: &[i64]) -> Result<Vec<i64>> {
    consumer_call(stream, group_name, |client, group| Ok(ack_in(client, group, token, ids, Signal::Now)?.recorded))
}

/// Whether freeing a lane signals idle consumers. A claim carrying acks may take the lanes it
/// frees right back, so it signals itself only for the lanes it leaves (src/claim.rs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Signal {
    Now,
    Later,
}

/// What every outcome does once its rows are recorded: wakes the rows parked behind the keys it
/// resolved, and frees the token's lanes whose work is all resolved (unless the outcome freed
/// them already: `released`). Returns the lanes freed.
pub(crate) fn settle(
    client: &SpiClient<'_>,
    group: &GroupRef,
    token: pgrx::Uuid,
    keys: &[String],
    now: i64,
    signal: Signal,
    released: Option<range::Released>,
) -> Result<Vec<i32>> {
    let waker = match &released {
        Some(r) => Waker::HeldLanes(&r.lanes),
        None => Waker::Outcome,
    };
    exception_queue::after_resolution(client, group, keys, now, waker)?;
    let released = match released {
        Some(r) => r.lanes,
        None => lanes::release(client, group, token)?,
    };
    // In a capped group every outcome may make room for a consumer the cap left idle.
    if (!released.is_empty() || group.max_inflight.is_some()) && signal == Signal::Now {
        notify::signal(group.stream.id);
    }
    Ok(released)
}

/// `ack` inside an open SPI connection (a claim carrying acks uses it too).
pub fn ack_in(
    client: &SpiClient<'_>,
    group: &GroupRef,
    token: pgrx::Uuid,
    ids: &[i64],
    signal: Signal,
) -> Result<Acked> {
    // A token no consumer holds (src/token.rs) resolves nothing, whoever names it.
    if token::is_no_ones(token) {
        return Ok(Acked { recorded: vec![], released_lanes: vec![] });
    }
    locks::token(token);
    let stream_id = group.stream.id;
    let mut done = exception_queue::succeed(client, group, token, ids)?;
    let mut released = None;
    if done.len() < ids.len() {
        let mut rest: Vec<i64> = ids.iter().copied().filter(|id| !done.iter().any(|(d, _)| d == id)).collect();
        if range::may_cover(token, &rest) {
            let (with_keys, instead) = match lanes::end_holds_with_ranges(group, token) {
                Some(end_holds) => (true, Some(end_holds)),
                None => match own_claims::keyed_lanes(token) {
                    Some(lanes) if lanes.is_empty() => (false, None),
                    Some(lanes) => {
                        // Step 4's wake locks, before the ranges' rows: its statement reads the
                        // keys only while a row is parked (`DELETE_TOKEN_KEYS_IF_PARKED`).
                        locks::lanes_shared(group.id, &lanes);
                        let statement = &exception_queue::DELETE_TOKEN_KEYS_IF_PARKED;
                        (true, Some(range::Instead { statement, lanes: None }))
                    }
                    None => (true, None),
                },
            };
            let covered = range::resolve_covered(client, stream_id, group.id, token, with_keys, instead)?;
            done.extend(covered.resolved);
            rest.retain(|id| !covered.answered.contains(id));
            released = covered.released;
        }
        if !rest.is_empty() {
            let mut ranges = range::for_token(client, stream_id, group.id, token)?;
            done.extend(ranges.remove(&rest));
            ranges.store(client, stream_id, group.id)?;
        }
    }
    let keys = exception_queue::distinct_keys(done.iter().map(|(_, k)| k));
    // Lanes the ranges' statement freed are settled (signalled) even when nothing was resolved.
    let released_lanes = if done.is_empty() && released.as_ref().is_none_or(|r| r.lanes.is_empty()) {
        vec![]
    } else {
        settle(client, group, token, &keys, clock::now(), signal, released)?
    };
    let mut recorded: Vec<i64> = done.into_iter().map(|(id, _)| id).collect();
    recorded.sort_unstable();
    Ok(Acked { recorded, released_lanes })
}

/// Which outcome a setback answers.
#[derive(Clone, Copy, PartialEq, Eq)]
enum SetbackKind {
    Fail,
    Delay,
}

/// Records a setback (a failure or a delay) of `id` under `token`: `decide` applies it to the
/// message's (attempts, delays) at `now`. Returns the new status; `None` when the lease was lost.
fn record_setback(
    kind: SetbackKind,
    stream: &str,
    group_name: &str,
    token: pgrx::Uuid,
    id: i64,
    error: Option<String>,
    decide: impl FnOnce(&GroupRef, i32, i32, i64) -> Setback,
) -> Result<Option<Status>> {
    consumer_call(stream, group_name, |client, group| {
        if token::is_no_ones(token) {
            return Ok(None);
        }
        let stream_id = group.stream.id;
        locks::token(token);
        let row = exception_queue::inflight(client, stream_id, group.id, id, token)?;
        let mut ranges = range::for_token(client, stream_id, group.id, token)?;
        // After the rows' locks: a backoff or a delay counts from when the outcome is recorded.
        let now = clock::now();
        let (key, concurrency, setback) = if let Some(row) = row {
            let setback = decide(group, row.attempts, row.delays, now);
            let update = exception_queue::setback_again(id, setback, error, now);
            exception_queue::update(client, stream_id, group.id, &[update], now)?;
            (row.key, row.concurrency, setback)
        } else if ranges.contains(id) {
            let addresses = ranges.addresses(&[id]);
            ranges.remove(&[id]);
            let Some(message) = message::candidates(client, group, &addresses)?.pop() else {
                return Err(StreamError::Internal(format!("pending message {id} is missing from the log")));
            };
            let setback = decide(group, 0, 0, now);
            let row = exception_queue::setback_first_delivery(&message, setback, error, now);
            exception_queue::insert(client, stream_id, group.id, &[row], now)?;
            (message.key.map(Key::into_string), message.concurrency, setback)
        } else {
            return Ok(None);
        };
        // The rest of the chain waits without running, except after a failure that
        // dead-lettered: `fail` returned 'dead', so the caller may start the next row. A delay
        // always stops the caller's chain (it returns only true), even one the delay budget
        // dead-lettered; its successors are then due at once.
        // A parallel message heads no chain: the gate never chains a row behind it.
        let chain_waits = match setback {
            _ if !concurrency.is_keyed_gate() => None,
            Setback::Retry { can_run_after, .. } => Some(can_run_after),
            Setback::Dead { .. } if kind == SetbackKind::Delay => Some(now),
            Setback::Dead { .. } => None,
        };
        if let (Some(until), Some(key)) = (chain_waits, key.as_deref()) {
            exception_queue::defer_chain(client, group, token, key, id, until, &mut ranges, now)?;
        }
        ranges.store(client, stream_id, group.id)?;
        settle(client, group, token, &exception_queue::distinct_keys([&key]), now, Signal::Now, None)?;
        Ok(Some(setback.status()))
    })
}

/// Records that the handler of a claimed message succeeded. Returns false when the lease behind
/// lease_token was lost (expired and taken over, or already resolved): nothing changed.
#[pg_extern(volatile, parallel_unsafe, name = "ack", sql = false)]
fn ack_sql(
    stream: Option<Text<'_>>,
    group_name: Option<Text<'_>>,
    lease_token: Option<pgrx::Uuid>,
    message_id: Option<i64>,
) -> SqlResult<bool> {
    crate::standby::refuse_writes("ack")?;
    let a = Answer::validate(stream.as_deref(), group_name.as_deref(), lease_token)?;
    let id = names::message_id(message_id)?;
    Ok(!ack(a.stream, a.group, a.token, &[id])?.is_empty())
}

/// Records success for many messages of one claim in one call; returns the ids recorded (an id
/// whose lease was lost is left out).
#[pg_extern(volatile, parallel_unsafe, sql = false)]
fn ack_batch(
    stream: Option<Text<'_>>,
    group_name: Option<Text<'_>>,
    lease_token: Option<pgrx::Uuid>,
    message_ids: Option<Vec<Option<i64>>>,
) -> SqlResult<Vec<i64>> {
    crate::standby::refuse_writes("ack_batch")?;
    let a = Answer::validate(stream.as_deref(), group_name.as_deref(), lease_token)?;
    Ok(ack(a.stream, a.group, a.token, &names::message_ids("message_ids", message_ids)?)?)
}

/// The most of a failure's error message kept, in bytes: it is read back with its message's
/// other values in one row (`dead_messages`), and a row is built in one allocation of at most 1 GB.
const MAX_ERROR: usize = 1 << 20;

/// Records that a handler failed. Returns the message's new status: 'ready' (a retry is
/// scheduled with backoff, or after retry_after) or 'dead' (permanent, or the retry budget is
/// spent); NULL when the lease was lost. The rest of its same-key chain is recorded deferred.
#[pg_extern(volatile, parallel_unsafe, name = "fail", sql = false)]
fn fail_sql(
    stream: Option<Text<'_>>,
    group_name: Option<Text<'_>>,
    lease_token: Option<pgrx::Uuid>,
    message_id: Option<i64>,
    error: Option<RawText<'_>>,
    permanent: default!(Option<bool>, false),
    retry_after: default!(Option<Interval>, "NULL"),
) -> SqlResult<Option<String>> {
    crate::standby::refuse_writes("fail")?;
    let a = Answer::validate(stream.as_deref(), group_name.as_deref(), lease_token)?;
    let id = names::message_id(message_id)?;
    let retry_after = match retry_after.map(|i| i.as_micros()) {
        Some(m) if m < 0 => {
            return Err(StreamError::invalid(
                format!("retry_after must not be negative, not {}", names::seconds(m)),
                "Pass zero (retry at once), a positive interval, or NULL for the group's backoff.",
            )
            .into())
        }
        other => other.map(|m| m.min(i64::MAX as i128) as i64),
    };
    let permanent = permanent.unwrap_or(false);
    // Kept as written where it reads as UTF-8, else with its bytes beyond ASCII escaped (src/text.rs).
    let error = Some(error.map_or_else(|| "(no error message)".to_string(), |e| e.kept(MAX_ERROR).into_owned()));
    let status =
        record_setback(SetbackKind::Fail, a.stream, a.group, a.token, id, error, |group, attempts, delays, now| {
            backoff::fail(&group.backoff, group.max_retries, attempts, delays, permanent, retry_after, now)
        })?;
    Ok(status.map(|s| s.as_str().to_string()))
}

/// Asks for the message to run again after `delay`, without counting a failure. Returns false
/// when the lease was lost. The message stays unresolved, so an ordered key keeps waiting.
#[pg_extern(volatile, parallel_unsafe, name = "delay", sql = false)]
fn delay_sql(
    stream: Option<Text<'_>>,
    group_name: Option<Text<'_>>,
    lease_token: Option<pgrx::Uuid>,
    message_id: Option<i64>,
    delay: Option<Interval>,
) -> SqlResult<bool> {
    crate::standby::refuse_writes("delay")?;
    let a = Answer::validate(stream.as_deref(), group_name.as_deref(), lease_token)?;
    let id = names::message_id(message_id)?;
    let delay = positive_micros("delay", delay.map(|d| d.as_micros()), "'10 seconds'")?;
    let status =
        record_setback(SetbackKind::Delay, a.stream, a.group, a.token, id, None, |group, attempts, delays, now| {
            backoff::delay(group.max_delays, attempts, delays, delay, now)
        })?;
    Ok(status.is_some())
}
