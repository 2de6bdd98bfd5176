//! The consumer loop: claim, split the result into same-key chains, run each chain on its own
//! task (one message at a time, in id order), record outcomes.

use std::any::Any;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_util::stream::FuturesUnordered;
use futures_util::{FutureExt, StreamExt};
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info_span, warn, Instrument};
use uuid::Uuid;

use super::delivery::{Delivery, HandlerError};
use super::handler::{Handle, Tx};
use super::leases::LeaseBook;
use super::listener;
use super::metrics::{Counters, Event};
use super::writer::Writer;
use super::{ConsumerConfig, ConsumerGroup};
use crate::backoff::Backoff;
use crate::error::Result;
use crate::{sql, Concurrency, Headers};

/// One row of a claim result.
struct Claimed {
    id: i64,
    key: Option<String>,
    concurrency: Concurrency,
    attempt: u32,
    payload: String,
    token: Uuid,
    run_after: Option<i64>,
    produced_at: std::time::SystemTime,
    headers: Option<serde_json::Value>,
}

/// What happened to one delivery, kept when a test asks for it (`Consumer::work_until_idle`).
#[cfg_attr(not(feature = "testing"), allow(dead_code))]
#[derive(Clone, Debug)]
pub(crate) struct Noted {
    pub id: i64,
    pub key: Option<String>,
    pub attempt: u32,
    pub event: Event,
    pub error: Option<String>,
}

pub(crate) type Journal = Arc<std::sync::Mutex<Vec<Noted>>>;

/// How a delivery ended, before it is recorded.
enum Outcome {
    Success,
    Failed(HandlerError),
    Panicked(String),
    TimedOut,
    Cancelled,
    Undecodable(String),
}

struct Ctx<T, H> {
    group: ConsumerGroup<T>,
    config: ConsumerConfig,
    handler: Arc<H>,
    counters: Arc<Counters>,
    writer: Writer,
    leases: Arc<LeaseBook>,
    /// Cancels running handlers (shutdown past its grace period).
    cancel: CancellationToken,
    /// Rows claimed and not finished, and a signal when that number drops.
    outstanding: AtomicUsize,
    progress: Notify,
    /// The claim loop claims again once no more than this many rows are outstanding (room
    /// for half a batch).
    claim_again_at: usize,
    /// Set by tests: every delivery's outcome, and stop once nothing is left to claim.
    journal: Option<Journal>,
}

/// How a running consumer is told to end: `stop` ends claiming (a graceful shutdown),
/// `cancel` cancels running handlers too.
pub(crate) struct Stops {
    pub stop: CancellationToken,
    pub cancel: CancellationToken,
}

pub(crate) async fn run<T, H>(
    group: ConsumerGroup<T>,
    config: ConsumerConfig,
    channel: String,
    handler: Arc<H>,
    counters: Arc<Counters>,
    stops: Stops,
    journal: Option<Journal>,
) -> Result<()>
where
    T: Serialize + DeserializeOwned + Send + Sync + 'static,
    H: Handle<T>,
{
    let Stops { stop, cancel } = stops;
    let pool = group.stream.pool.clone();
    let (stream, group_name) = (group.stream.name.clone(), group.name.clone());
    let (writer, writer_task) = Writer::spawn(pool.clone(), stream.clone(), group_name.clone(), counters.clone());
    let leases = Arc::new(LeaseBook::new(pool.clone(), stream, group_name, config.lease));
    let wake = Arc::new(Notify::new());
    let background = CancellationToken::new();
    let listener =
        listener::spawn(pool.config().clone(), pool.tls().clone(), channel, wake.clone(), background.clone());
    let heartbeat = tokio::spawn(heartbeat(leases.clone(), config.lease / 3, background.clone()));
    let lag = config.lag_interval.map(|every| {
        let (pool, counters, stop) = (pool.clone(), counters.clone(), background.clone());
        let (stream, group) = (group.stream.name.clone(), group.name.clone());
        tokio::spawn(read_lag(pool, stream, group, counters, every, stop))
    });
    let semaphore = Arc::new(Semaphore::new(config.message_concurrency));
    let room = (config.message_concurrency.min(config.batch_size as usize) / 2).max(1);
    let claim_again_at = config.message_concurrency - room;
    let ctx = Arc::new(Ctx {
        group,
        config,
        handler,
        counters,
        writer,
        leases,
        cancel,
        outstanding: AtomicUsize::new(0),
        progress: Notify::new(),
        claim_again_at,
        journal,
    });
    // Until idle (tests): a claim that found nothing after everything before it was written.
    let mut idle_after_flush = false;

    let mut chains = JoinSet::new();
    let workers = tokio::runtime::Handle::current().metrics().num_workers().max(1);
    let mut backoff = Backoff::new();
    let mut fatal = None;
    // Whether the last claim split into many chains: then the next claim may overlap it.
    let mut pipelined = true;
    while !stop.is_cancelled() {
        while chains.try_join_next().is_some() {}
        // Claim again as soon as there is room for half a batch: the next claim's round trip
        // then overlaps this one's handlers, and the server never waits for the consumer. A
        // claim that came back as chains (same-key rows) is let finish first: claiming behind
        // it would only park its successors.
        let outstanding = ctx.outstanding.load(Ordering::Acquire);
        if outstanding > 0 && (!pipelined || outstanding > ctx.claim_again_at) {
            tokio::select! {
                _ = ctx.progress.notified() => {}
                _ = stop.cancelled() => break,
            }
            continue;
        }
        let first = tokio::select! {
            permit = semaphore.clone().acquire_owned() => permit.expect("the semaphore is never closed"),
            _ = stop.cancelled() => break,
        };
        let mut permits = vec![first];
        while permits.len() < ctx.config.batch_size as usize {
            match semaphore.clone().try_acquire_owned() {
                Ok(permit) => permits.push(permit),
                Err(_) => break,
            }
        }
        // The last claim's acks go along with this claim (see the writer), so the server sees
        // its same-key rows resolved before it decides what to hand out next.
        let claimed_at = Instant::now();
        let acks = ctx.writer.take_acks();
        if !pipelined {
            // Acks the writer took before us must be written before this claim decides.
            ctx.writer.flush().await;
        }
        ctx.writer.claiming(true);
        let claimed = claim(&ctx, permits.len() as i32, acks.as_ref()).await;
        ctx.writer.claiming(false);
        let rows = match claimed {
            Ok(rows) => rows,
            Err(e) => {
                if let Some((token, ids)) = acks {
                    ctx.writer.return_acks(token, ids);
                }
                drop(permits);
                if e.is_unknown_object() || e.is_permission_denied() || ctx.journal.is_some() {
                    // Retrying cannot bring a dropped group or a revoked grant back (and a
                    // test wants to see any error).
                    error!(error = %e, "sqlstreams: claim refused; the consumer stops");
                    fatal = Some(e);
                    break;
                }
                warn!(error = %e, "sqlstreams: claim failed; retrying");
                tokio::select! {
                    _ = tokio::time::sleep(backoff.next()) => {}
                    _ = stop.cancelled() => break,
                }
                continue;
            }
        };
        backoff.reset();
        if rows.is_empty() && ctx.journal.is_some() {
            drop(permits);
            if ctx.outstanding.load(Ordering::Acquire) > 0 {
                tokio::select! {
                    _ = ctx.progress.notified() => {}
                    _ = stop.cancelled() => break,
                }
            } else if idle_after_flush {
                break;
            } else {
                ctx.writer.flush().await;
                idle_after_flush = true;
            }
            continue;
        }
        idle_after_flush = false;
        if rows.is_empty() {
            drop(permits);
            tokio::select! {
                _ = wake.notified() => {}
                _ = tokio::time::sleep(ctx.config.poll_interval) => {}
                _ = stop.cancelled() => break,
            }
            continue;
        }
        ctx.counters.add(Event::Claimed, rows.len() as u64);
        ctx.outstanding.fetch_add(rows.len(), Ordering::AcqRel);
        ctx.leases.track(rows[0].token, rows.len(), claimed_at);
        let row_count = rows.len();
        let split = chains_of(rows);
        // Claiming again while same-key rows of an ordered or exclusive key still run would
        // only park their successors; parallel work may overlap with the next claim.
        pipelined = split.iter().all(|chain| chain.len() == 1 && chain[0].concurrency == Concurrency::Parallel);
        let _ = row_count;
        // Chains run concurrently, spread over at most one task per runtime worker: handlers
        // still use every core, and a claim of a hundred rows costs a few spawns (and cross-
        // thread wake-ups), not a hundred.
        let mut buckets: Vec<Vec<(Vec<Claimed>, OwnedSemaphorePermit)>> = (0..workers).map(|_| Vec::new()).collect();
        for (i, chain) in split.into_iter().enumerate() {
            let permit = permits.pop().expect("a claim returns at most one row per permit");
            buckets[i % workers].push((chain, permit));
        }
        for bucket in buckets.into_iter().filter(|b| !b.is_empty()) {
            let ctx = ctx.clone();
            // The consumer's cancellation reaches each delivery's token through one token per
            // bucket, whose lock only this task takes.
            let scope = ctx.cancel.child_token();
            chains.spawn(async move {
                let mut running: FuturesUnordered<_> = bucket
                    .into_iter()
                    .map(|(chain, permit)| run_chain(ctx.clone(), chain, permit, scope.clone()))
                    .collect();
                while running.next().await.is_some() {}
            });
        }
    }
    while let Some(done) = chains.join_next().await {
        if let Err(e) = done {
            warn!(error = %e, "sqlstreams: a chain task failed");
        }
    }
    ctx.writer.flush().await;
    background.cancel();
    let _stopped = (listener.await, heartbeat.await);
    if let Some(lag) = lag {
        let _stopped = lag.await;
    }
    drop(ctx);
    let _written = writer_task.await;
    fatal.map_or(Ok(()), Err)
}

async fn heartbeat(leases: Arc<LeaseBook>, every: Duration, stop: CancellationToken) {
    loop {
        tokio::select! {
            _ = tokio::time::sleep(every) => leases.heartbeat().await,
            _ = stop.cancelled() => return,
        }
    }
}

/// Sets the lag gauges every `every`, until `stop`.
async fn read_lag(
    pool: crate::pool::Pool,
    stream: String,
    group: String,
    counters: Arc<Counters>,
    every: Duration,
    stop: CancellationToken,
) {
    loop {
        let reading = async {
            let conn = pool.conn().await?;
            let row = conn.query_one(sql::LAG, &[&stream, &group]).await?;
            Ok::<_, crate::Error>((row.get::<_, i64>(0), row.get::<_, f64>(1)))
        };
        match reading.await {
            Ok((messages, oldest)) => counters.lag(messages, oldest),
            Err(e) => debug!(error = %e, "sqlstreams: could not read the group's lag"),
        }
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = stop.cancelled() => return,
        }
    }
}

async fn claim<T, H>(ctx: &Ctx<T, H>, batch: i32, acks: Option<&(Uuid, Vec<i64>)>) -> Result<Vec<Claimed>> {
    let span = info_span!("sqlstreams.claim", stream = %ctx.group.stream.name, group = %ctx.group.name, batch);
    async {
        let started = Instant::now();
        let conn = ctx.group.stream.pool.conn().await?;
        let claim = conn.prepare_cached(sql::CLAIM).await?;
        let rows = conn
            .query(
                &claim,
                &[
                    &ctx.group.stream.name,
                    &ctx.group.name,
                    &batch,
                    &ctx.config.lease.as_secs_f64(),
                    &acks.map(|a| a.0),
                    &acks.map(|a| &a.1),
                ],
            )
            .await?;
        ctx.counters.claimed_in(started.elapsed());
        debug!(claimed = rows.len());
        Ok(rows
            .iter()
            .map(|r| Claimed {
                id: r.get(0),
                key: r.get(1),
                concurrency: r.get::<_, String>(2).parse().unwrap_or(Concurrency::Parallel),
                attempt: r.get::<_, i32>(3).max(0) as u32,
                payload: r.get(4),
                token: r.get(5),
                run_after: r.get(6),
                produced_at: r.get(7),
                headers: r.get(8),
            })
            .collect())
    }
    .instrument(span)
    .await
}

/// Splits a claim result into chains: a row with `run_after` follows the chain of that row.
fn chains_of(rows: Vec<Claimed>) -> Vec<Vec<Claimed>> {
    let mut chains: Vec<Vec<Claimed>> = Vec::new();
    let mut chain_of: std::collections::HashMap<i64, usize> = std::collections::HashMap::new();
    for row in rows {
        let index = match row.run_after.and_then(|p| chain_of.get(&p).copied()) {
            Some(index) => index,
            None => {
                chains.push(Vec::new());
                chains.len() - 1
            }
        };
        chain_of.insert(row.id, index);
        chains[index].push(row);
    }
    chains
}

async fn run_chain<T, H>(
    ctx: Arc<Ctx<T, H>>,
    chain: Vec<Claimed>,
    _permit: OwnedSemaphorePermit,
    scope: CancellationToken,
) where
    T: Serialize + DeserializeOwned + Send + Sync + 'static,
    H: Handle<T>,
{
    let token = chain[0].token;
    let mut rows = chain.into_iter();
    let mut resolved = true;
    while let Some(row) = rows.next() {
        let rest = 1 + rows.len();
        if !resolved {
            // Its predecessor failed or was delayed: the server recorded the rest deferred.
            ctx.counters.add(Event::Deferred, rest as u64);
            ctx.note_all(std::iter::once(&row).chain(rows.as_slice()), Event::Deferred);
            ctx.finished(token, rest);
            break;
        }
        if ctx.cancel.is_cancelled() {
            let ids: Vec<i64> = std::iter::once(row.id).chain(rows.as_slice().iter().map(|r| r.id)).collect();
            let released = ctx.writer.release(token, ids).await;
            ctx.counters.add(Event::Released, released.len() as u64);
            ctx.note_all(std::iter::once(&row).chain(rows.as_slice()), Event::Released);
            ctx.finished(token, rest);
            break;
        }
        if !ctx.leases.covers(token, ctx.config.handler_timeout).await {
            ctx.counters.add(Event::LeaseLost, rest as u64);
            ctx.note_all(std::iter::once(&row).chain(rows.as_slice()), Event::LeaseLost);
            ctx.finished(token, rest);
            break;
        }
        resolved = ctx.deliver(row, &scope).await;
        ctx.finished(token, 1);
    }
}

impl<T, H> Ctx<T, H>
where
    T: Serialize + DeserializeOwned + Send + Sync + 'static,
    H: Handle<T>,
{
    /// Keeps `row`'s outcome for a test.
    fn note(&self, row: &Claimed, event: Event, error: Option<&str>) {
        if let Some(journal) = &self.journal {
            let noted = Noted {
                id: row.id,
                key: row.key.clone(),
                attempt: row.attempt,
                event,
                error: error.map(str::to_string),
            };
            journal.lock().unwrap().push(noted);
        }
    }

    fn note_all<'r>(&self, rows: impl Iterator<Item = &'r Claimed>, event: Event) {
        if self.journal.is_some() {
            rows.for_each(|row| self.note(row, event, None));
        }
    }

    fn finished(&self, token: Uuid, rows: usize) {
        self.leases.finished(token, rows);
        let before = self.outstanding.fetch_sub(rows, Ordering::AcqRel);
        // The claim loop waits for all work to finish, or for room for half a batch (see
        // `run`): wake it only when one of those is crossed, not for every row.
        let after = before - rows;
        if after == 0 || (before > self.claim_again_at && after <= self.claim_again_at) {
            self.progress.notify_one();
        }
    }

    /// Runs one delivery and records its outcome. True when the message resolved (succeeded or
    /// died), so the next row of its chain may start.
    async fn deliver(&self, row: Claimed, scope: &CancellationToken) -> bool {
        let span = info_span!("sqlstreams.handler", message_id = row.id, attempt = row.attempt, key = ?row.key);
        crate::trace_context::continue_trace(&span, row.headers.as_ref());
        let started = Instant::now();
        let (outcome, tx) = self.execute(&row, started, scope).instrument(span.clone()).await;
        self.counters.handler_ran(started.elapsed());
        match tx {
            Some(tx) => self.finish_transaction(row, outcome, tx).instrument(span).await,
            None => self.record(row, outcome).instrument(span).await,
        }
    }

    /// Runs the handler; returns how it ended and, for a transactional handler, its open
    /// transaction.
    async fn execute(&self, row: &Claimed, started: Instant, scope: &CancellationToken) -> (Outcome, Option<Tx>) {
        let message: T = match serde_json::from_str(&row.payload) {
            Ok(message) => message,
            Err(e) => {
                let error =
                    format!("the payload of message {} does not decode as {}: {e}", row.id, std::any::type_name::<T>());
                return (Outcome::Undecodable(error), None);
            }
        };
        let tx = if H::TRANSACTIONAL {
            match self.begin().await {
                Ok(tx) => Some(tx),
                Err(e) => {
                    return (Outcome::Failed(HandlerError::retry(format!("no transaction for the handler: {e}"))), None)
                }
            }
        } else {
            None
        };
        let cancel = scope.child_token();
        // The handler's time starts when it can run: after its transaction is open.
        let deadline = if H::TRANSACTIONAL { Instant::now() } else { started } + self.config.handler_timeout;
        let delivery = Delivery {
            message,
            id: row.id,
            key: row.key.clone(),
            attempt: row.attempt,
            concurrency: row.concurrency,
            produced_at: row.produced_at,
            headers: match &row.headers {
                Some(serde_json::Value::Object(headers)) => headers.clone(),
                _ => Headers::new(),
            },
            cancel: cancel.clone(),
            deadline,
        };
        // A panic in the handler's synchronous part (before its future) is caught as well.
        let call = std::panic::catch_unwind(AssertUnwindSafe(|| self.handler.call(delivery, tx.clone())));
        let handler = match call {
            Ok(future) => AssertUnwindSafe(future).catch_unwind(),
            Err(panic) => return (Outcome::Panicked(panic_message(panic)), tx),
        };
        let mut handler = std::pin::pin!(handler);
        let ended = |result: std::thread::Result<std::result::Result<(), HandlerError>>| match result {
            Ok(Ok(())) => Outcome::Success,
            Ok(Err(e)) => Outcome::Failed(e),
            Err(panic) => Outcome::Panicked(panic_message(panic)),
        };
        // A handler that finishes at its first poll needs no deadline timer.
        if let std::task::Poll::Ready(result) = futures_util::poll!(handler.as_mut()) {
            return (ended(result), tx);
        }
        let outcome = tokio::select! {
            // A handler that finishes as it is cancelled has its result recorded.
            biased;
            result = handler.as_mut() => ended(result),
            _ = tokio::time::sleep_until(deadline) => {
                cancel.cancel();
                Outcome::TimedOut
            }
            _ = self.cancel.cancelled() => {
                // Told to stop, a handler that then finishes at once has its result recorded.
                cancel.cancel();
                match futures_util::poll!(handler.as_mut()) {
                    std::task::Poll::Ready(result) => ended(result),
                    std::task::Poll::Pending => Outcome::Cancelled,
                }
            }
        };
        (outcome, tx)
    }

    async fn begin(&self) -> Result<Tx> {
        let conn = self.group.stream.pool.conn().await?;
        conn.batch_execute("BEGIN").await?;
        Ok(Tx { conn: Arc::new(conn) })
    }

    /// A transactional handler ended: on success its transaction records the ack and commits
    /// (a lost lease rolls it back instead); otherwise it rolls back and the failure is
    /// recorded as for any handler.
    async fn finish_transaction(&self, row: Claimed, outcome: Outcome, tx: Tx) -> bool {
        if let Outcome::Success = outcome {
            let stream = &self.group.stream.name;
            let acked = tx.query_one(sql::ACK, &[stream, &self.group.name, &row.token, &row.id]).await;
            match acked {
                Ok(ack) if ack.get::<_, bool>(0) => match tx.batch_execute("COMMIT").await {
                    Ok(()) => {
                        self.counters.add(Event::Succeeded, 1);
                        self.note(&row, Event::Succeeded, None);
                        return true;
                    }
                    Err(e) => {
                        warn!(error = %e, "sqlstreams: the handler's transaction did not commit; it runs again");
                        return self.record(row, Outcome::Failed(HandlerError::retry(e))).await;
                    }
                },
                Ok(_) => {
                    let _ = tx.batch_execute("ROLLBACK").await;
                    self.counters.add(Event::LeaseLost, 1);
                    self.note(&row, Event::LeaseLost, None);
                    return false;
                }
                Err(e) => {
                    let _ = tx.batch_execute("ROLLBACK").await;
                    return self.record(row, Outcome::Failed(HandlerError::retry(e))).await;
                }
            }
        }
        let _ = tx.batch_execute("ROLLBACK").await;
        self.record(row, outcome).await
    }

    async fn record(&self, row: Claimed, outcome: Outcome) -> bool {
        let c = &self.counters;
        let (error, permanent, retry_after) = match outcome {
            Outcome::Success => {
                self.writer.ack(row.token, row.id);
                c.add(Event::Succeeded, 1);
                self.note(&row, Event::Succeeded, None);
                return true;
            }
            Outcome::Failed(HandlerError::Delay(after)) => {
                let after = after.max(Duration::from_millis(1));
                let recorded = self.writer.delay(row.token, row.id, after).await;
                let event = if recorded { Event::Delayed } else { Event::LeaseLost };
                c.add(event, 1);
                self.note(&row, event, None);
                return false;
            }
            Outcome::Failed(HandlerError::Retry { error, after }) => (error, false, after),
            Outcome::Failed(HandlerError::Permanent(error)) => (error, true, None),
            Outcome::Undecodable(error) => (error, true, None),
            Outcome::Panicked(message) => {
                c.add(Event::Panicked, 1);
                (format!("the handler panicked: {message}"), false, None)
            }
            Outcome::TimedOut => {
                c.add(Event::TimedOut, 1);
                (format!("the handler did not finish within {:?}", self.config.handler_timeout), false, None)
            }
            Outcome::Cancelled => {
                ("the consumer shut down while the handler ran".to_string(), false, Some(Duration::ZERO))
            }
        };
        let noted = self.journal.is_some().then(|| error.clone());
        let (event, resolved) =
            match self.writer.fail(row.token, row.id, error, permanent, retry_after).await.as_deref() {
                Some("dead") => (Event::Dead, true),
                Some(_) => (Event::Failed, false),
                None => (Event::LeaseLost, false),
            };
        c.add(event, 1);
        self.note(&row, event, noted.as_deref());
        resolved
    }
}

fn panic_message(panic: Box<dyn Any + Send>) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "(a non-string panic payload)".to_string()
    }
}
