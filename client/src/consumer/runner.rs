//! The consumer loop: claim, split the result into same-key chains, run each chain (one
//! message at a time, in id order) on the loop's own task until a handler waits, then on a
//! task of its own; record outcomes. A full claim of parallel work sends the next claim before
//! its rows run.

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

/// How long a claim's chains may run on the claim loop's task before the rest go to tasks of
/// their own (see `run`).
const INLINE_BUDGET: Duration = Duration::from_millis(1);

/// A claim sent before the rows of the claim before it ran (see `run`), with what it holds.
struct Ahead<'a> {
    claim: std::pin::Pin<Box<futures_util::future::MaybeDone<ClaimFuture<'a>>>>,
    permits: OwnedSemaphorePermit,
    acks: Option<(Uuid, Vec<i64>)>,
    claimed_at: Instant,
}

type ClaimFuture<'a> = std::pin::Pin<Box<dyn std::future::Future<Output = Result<Vec<Claimed>>> + Send + 'a>>;

/// One row of a claim result.
struct Claimed {
    id: i64,
    concurrency: Concurrency,
    attempt: u32,
    /// The claim's row, which holds the payload: decoded from there, not copied first.
    row: tokio_postgres::Row,
    token: Uuid,
    run_after: Option<i64>,
    produced_at: std::time::SystemTime,
    headers: Option<serde_json::Value>,
}

impl Claimed {
    /// The message key, read from the row when needed (most deliveries copy it only once,
    /// into the handler's `Delivery`).
    fn key(&self) -> Option<&str> {
        self.row.get(1)
    }
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
    let mut idle_floor = IDLE_FLOOR;
    let mut next_due = NextDue::Unknown;
    let mut fatal = None;
    // Whether the last claim was parallel work only (no chains): then the next claim may
    // overlap its handlers.
    let mut pipelined = true;
    let mut ahead: Option<Ahead<'_>> = None;
    while !stop.is_cancelled() {
        while chains.try_join_next().is_some() {}
        let (permits, acks, claimed_at, claimed) = match ahead.take() {
            Some(mut sent) => {
                sent.claim.as_mut().await;
                let claimed = sent.claim.as_mut().take_output().expect("an awaited claim has its output");
                (sent.permits, sent.acks, sent.claimed_at, claimed)
            }
            None => {
                // Claim again as soon as there is room for half a batch: the next claim's round
                // trip then overlaps the handlers still running, and the server never waits for
                // the consumer. A claim that came back as chains (same-key rows) is let finish
                // first: claiming behind it would only park its successors.
                let outstanding = ctx.outstanding.load(Ordering::Acquire);
                if outstanding > 0 && (!pipelined || outstanding > ctx.claim_again_at) {
                    tokio::select! {
                        _ = ctx.progress.notified() => {}
                        _ = stop.cancelled() => break,
                    }
                    continue;
                }
                let mut permits = tokio::select! {
                    permit = semaphore.clone().acquire_owned() => permit.expect("the semaphore is never closed"),
                    _ = stop.cancelled() => break,
                };
                let more = semaphore.available_permits().min(ctx.config.batch_size as usize - 1);
                if let Ok(more) = semaphore.clone().try_acquire_many_owned(more as u32) {
                    permits.merge(more);
                }
                // The last claim's acks go along with this claim (see the writer), so the server
                // sees its same-key rows resolved before it decides what to hand out next.
                let claimed_at = Instant::now();
                let acks = ctx.writer.take_acks();
                if !pipelined && ctx.writer.acks_pending() {
                    // Acks this claim does not carry (of another lease, or taken by the writer
                    // already) are written before it decides, or their keys' next rows are not
                    // handed out.
                    ctx.writer.flush().await;
                }
                ctx.writer.claiming(true);
                let claimed = claim(&ctx, permits.num_permits() as i32, acks.clone()).await;
                (permits, acks, claimed_at, claimed)
            }
        };
        ctx.writer.claiming(false);
        let asked = permits.num_permits();
        let mut permits = permits;
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
            let idle = idle_wait(&ctx, idle_floor, &mut next_due).await;
            if idle <= idle_floor {
                // Due now, yet nothing came: the work waits behind something that notifies.
                idle_floor = (idle_floor * 2).min(ctx.config.poll_interval);
            }
            tokio::select! {
                // Something changed: what next_due said may no longer hold.
                _ = wake.notified() => next_due = NextDue::Unknown,
                _ = tokio::time::sleep(idle) => {}
                _ = stop.cancelled() => break,
            }
            continue;
        }
        idle_floor = IDLE_FLOOR;
        // Work came, and its outcomes may set retries and delays: ask again when idle.
        next_due = NextDue::Unknown;
        ctx.counters.add(Event::Claimed, rows.len() as u64);
        ctx.outstanding.fetch_add(rows.len(), Ordering::AcqRel);
        let token = rows[0].token;
        ctx.leases.track(token, rows.len(), claimed_at);
        let row_count = rows.len();
        let split = chains_of(rows);
        // Claiming again while same-key rows of an ordered or exclusive key still run would
        // only park their successors; parallel work may overlap with the next claim.
        pipelined = split.iter().all(|chain| chain.len() == 1 && chain[0].concurrency == Concurrency::Parallel);
        if pipelined && row_count == asked && !stop.is_cancelled() {
            // A full claim of parallel work: more is likely waiting. The next claim goes out
            // now, with the acks made so far, and its round trip overlaps these rows' handlers.
            let wanted = semaphore.available_permits().min(ctx.config.batch_size as usize);
            if wanted >= room {
                if let Ok(next) = semaphore.clone().try_acquire_many_owned(wanted as u32) {
                    let (acks, claimed_at) = (ctx.writer.take_acks(), Instant::now());
                    ctx.writer.claiming(true);
                    let sent: ClaimFuture<'_> = Box::pin(claim(&ctx, wanted as i32, acks.clone()));
                    let mut claim = Box::pin(futures_util::future::maybe_done(sent));
                    // Its first poll sends it.
                    let _sent = futures_util::poll!(claim.as_mut());
                    ahead = Some(Ahead { claim, permits: next, acks, claimed_at });
                }
            }
        }
        // Chains first run here, on the claim loop's task, until their handler waits: a
        // handler that finishes when first polled (most do) then costs no task and no wake-up
        // of another thread. What waits, and everything once this claim's chains have had
        // INLINE_BUDGET of this task, is spread over at most one task per runtime worker, so
        // slow and CPU-heavy handlers still use every core and the next claim goes out.
        let now = Instant::now();
        let mut inline = Inline {
            // Shutting down past its grace: the rows are released, a round trip (`held_back`).
            until: if ctx.cancel.is_cancelled() { now } else { now + INLINE_BUDGET },
            // The lease as tracked above covers a handler's whole time until then.
            start_by: (claimed_at + ctx.config.lease).checked_sub(ctx.config.handler_timeout).unwrap_or(now),
            acked: Vec::with_capacity(row_count),
        };
        let mut split = split.into_iter();
        let waiting: Vec<ChainTask> = std::future::poll_fn(|cx| {
            let started = split.by_ref().filter_map(|chain| ctx.start_inline(chain, &mut permits, &mut inline, cx));
            std::task::Poll::Ready(started.collect())
        })
        .await;
        // Recorded once for all the rows that succeeded inline, before any task that follows
        // one of them in its chain can record an outcome.
        let acked = inline.acked.len();
        if acked > 0 {
            ctx.writer.ack_all(token, inline.acked);
            ctx.counters.add(Event::Succeeded, acked as u64);
            ctx.finished(token, acked);
        }
        // The permits of the chains finished here and of the rows the claim did not return.
        drop(permits);
        let tasks = workers.min(waiting.len());
        let mut buckets: Vec<Vec<_>> = (0..tasks).map(|_| Vec::new()).collect();
        for (i, chain) in waiting.into_iter().enumerate() {
            buckets[i % tasks].push(chain);
        }
        for bucket in buckets {
            chains.spawn(async move {
                let mut running: FuturesUnordered<_> = bucket.into_iter().collect();
                while running.next().await.is_some() {}
            });
        }
    }
    if let Some(mut sent) = ahead.take() {
        // Stopped with a claim sent ahead: its rows go back at once (not after their lease).
        sent.claim.as_mut().await;
        ctx.writer.claiming(false);
        match sent.claim.as_mut().take_output().expect("an awaited claim has its output") {
            Ok(rows) if !rows.is_empty() => {
                ctx.counters.add(Event::Claimed, rows.len() as u64);
                let released = ctx.writer.release(rows[0].token, rows.iter().map(|r| r.id).collect()).await;
                ctx.counters.add(Event::Released, released.len() as u64);
                ctx.note_all(rows.iter().filter(|r| released.contains(&r.id)), Event::Released);
            }
            Ok(_) => {}
            Err(_) => {
                if let Some((token, ids)) = sent.acks {
                    ctx.writer.return_acks(token, ids);
                }
            }
        }
    }
    drop(ahead);
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

/// The shortest idle wait. Work that is due but that a claim did not hand out (a retry in a
/// lane another consumer holds) doubles it, up to `poll_interval`, until a claim finds work.
const IDLE_FLOOR: Duration = Duration::from_millis(20);

/// What `sqlstreams.next_due` last said, kept until something may have changed it: a
/// notification, or a claim that handed out work (whose outcomes may set retries and delays).
/// An idle consumer that polls again with nothing changed then costs one claim, not two calls.
/// Timed work another consumer sets (its retry) sends no notification: this consumer sees it
/// at its next `poll_interval` at the latest, and the consumer that set it sleeps until it.
#[derive(Clone, Copy, Debug)]
enum NextDue {
    Unknown,
    /// Nothing waits for a time.
    Nothing,
    At(Instant),
}

/// How long an idle consumer waits for a notification: until its group's next timed work
/// falls due (`sqlstreams.next_due`, asked when `known` may be out of date or its time has
/// come), at most `poll_interval`, and not less than `floor`. If the question fails,
/// `poll_interval`.
async fn idle_wait<T, H>(ctx: &Ctx<T, H>, floor: Duration, known: &mut NextDue) -> Duration {
    let floor = floor.min(ctx.config.poll_interval);
    let now = Instant::now();
    if matches!(*known, NextDue::Unknown) || matches!(*known, NextDue::At(at) if at <= now) {
        let asked = async {
            let conn = ctx.group.stream.pool.conn().await?;
            let row = conn.query_one(sql::NEXT_DUE_IN, &[&ctx.group.stream.name, &ctx.group.name]).await?;
            Ok::<_, crate::Error>(row.get::<_, Option<f64>>(0))
        };
        *known = match asked.await {
            Ok(Some(seconds)) => Duration::try_from_secs_f64(seconds.max(0.0))
                .ok()
                .and_then(|wait| now.checked_add(wait))
                .map_or(NextDue::Nothing, NextDue::At),
            Ok(None) => NextDue::Nothing,
            Err(e) => {
                debug!(error = %e, "sqlstreams: could not read when the group's next work falls due");
                NextDue::Unknown
            }
        };
    }
    match *known {
        NextDue::At(at) => at.saturating_duration_since(now).clamp(floor, ctx.config.poll_interval.max(floor)),
        NextDue::Nothing | NextDue::Unknown => ctx.config.poll_interval,
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

async fn claim<T, H>(ctx: &Ctx<T, H>, batch: i32, acks: Option<(Uuid, Vec<i64>)>) -> Result<Vec<Claimed>> {
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
                    &acks.as_ref().map(|a| a.0),
                    &acks.as_ref().map(|a| &a.1),
                ],
            )
            .await?;
        ctx.counters.claimed_in(started.elapsed());
        debug!(claimed = rows.len());
        Ok(rows
            .into_iter()
            .map(|r| Claimed {
                id: r.get(0),
                concurrency: r.get::<_, &str>(2).parse().unwrap_or(Concurrency::Parallel),
                attempt: r.get::<_, i32>(3).max(0) as u32,
                token: r.get(5),
                run_after: r.get(6),
                produced_at: r.get(7),
                headers: r.get(8),
                row: r,
            })
            .collect())
    }
    .instrument(span)
    .await
}

/// Splits a claim result into chains: a row with `run_after` follows the chain of that row.
fn chains_of(rows: Vec<Claimed>) -> Vec<Chain> {
    split_chains(rows, |row| (row.id, row.run_after))
}

/// `chains_of` for any row type; `link` gives a row's id and its run_after.
fn split_chains<R>(rows: Vec<R>, link: impl Fn(&R) -> (i64, Option<i64>)) -> Vec<smallvec::SmallVec<[R; 1]>> {
    if rows.iter().all(|row| link(row).1.is_none()) {
        return rows.into_iter().map(|row| smallvec::smallvec![row]).collect();
    }
    // A claim's rows come in id order, and a row's run_after is an earlier row of the same
    // result: found by a binary search over the ids so far.
    let mut seen: Vec<(i64, usize)> = Vec::with_capacity(rows.len());
    let mut chains: Vec<smallvec::SmallVec<[R; 1]>> = Vec::with_capacity(rows.len());
    for row in rows {
        let (id, run_after) = link(&row);
        let index = match run_after.and_then(|p| seen.binary_search_by_key(&p, |(id, _)| *id).ok()) {
            Some(at) => seen[at].1,
            None => {
                chains.push(smallvec::SmallVec::new());
                chains.len() - 1
            }
        };
        match seen.last() {
            Some((last, _)) if *last >= id => {
                // Not in id order after all: keep the ids sorted.
                let at = seen.partition_point(|(seen_id, _)| *seen_id < id);
                seen.insert(at, (id, index));
            }
            _ => seen.push((id, index)),
        }
        chains[index].push(row);
    }
    chains
}

/// Rows of one claim that run one after the other (same key), in id order; mostly one row.
type Chain = smallvec::SmallVec<[Claimed; 1]>;

/// What the chains run inline during one claim's dispatch share: until when they may run
/// inline, until when a row may start without a lease check, and the ids that succeeded (acked
/// and counted together afterwards).
struct Inline {
    until: Instant,
    start_by: Instant,
    acked: Vec<i64>,
}

/// The rest of a chain, run as a task: boxed, so that it can move to another task after its
/// first poll.
type ChainTask = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>;

/// A delivery whose handler has been called.
struct Begun {
    row: Claimed,
    span: tracing::Span,
    started: Instant,
    state: Started,
}

enum Started {
    /// The handler's future, not finished when last polled.
    Running { handler: HandlerCall, cancel: CancellationToken, deadline: Instant },
    /// The handler finished (or never ran: undecodable payload, a panic in the call).
    Ended(Outcome),
}

type HandlerCall = futures_util::future::CatchUnwind<AssertUnwindSafe<super::handler::HandlerFuture>>;

/// Runs what is left of a chain, one row at a time in id order: `begun` (a row whose handler
/// was already called), then `rows`.
async fn run_chain<T, H>(
    ctx: Arc<Ctx<T, H>>,
    mut rows: smallvec::IntoIter<[Claimed; 1]>,
    mut begun: Option<Begun>,
    _permit: OwnedSemaphorePermit,
) where
    T: Serialize + DeserializeOwned + Send + Sync + 'static,
    H: Handle<T>,
{
    loop {
        let (token, resolved) = match begun.take() {
            Some(begun) => (begun.row.token, ctx.conclude(begun).await),
            None => {
                let Some(row) = rows.next() else { return };
                if ctx.held_back(&row, rows.as_slice()).await {
                    return;
                }
                (row.token, ctx.deliver(row).await)
            }
        };
        ctx.finished(token, 1);
        if !resolved && !rows.as_slice().is_empty() {
            // The row failed or was delayed: the server recorded the rest of its chain deferred.
            let rest = rows.as_slice();
            ctx.counters.add(Event::Deferred, rest.len() as u64);
            ctx.note_all(rest.iter(), Event::Deferred);
            ctx.finished(token, rest.len());
            return;
        }
    }
}

impl<T, H> Ctx<T, H>
where
    T: Serialize + DeserializeOwned + Send + Sync + 'static,
    H: Handle<T>,
{
    /// Runs `chain` on the calling task (`cx`) for as long as its handlers finish when first
    /// polled and `inline.until` has not passed; returns the rest as a task to spawn, with one
    /// of `permits`, if any.
    fn start_inline(
        self: &Arc<Self>,
        chain: Chain,
        permits: &mut OwnedSemaphorePermit,
        inline: &mut Inline,
        cx: &mut std::task::Context<'_>,
    ) -> Option<ChainTask> {
        let mut rows = chain.into_iter();
        let mut task = |rows, begun| {
            let permit = permits.split(1).expect("a claim returns at most one row per permit");
            Some(Box::pin(run_chain(self.clone(), rows, begun, permit)) as ChainTask)
        };
        if H::TRANSACTIONAL {
            // Its transaction takes a round trip before the handler runs.
            return task(rows, None);
        }
        // One clock reading per row: the previous handler's end and this one's start.
        let mut now = Instant::now();
        while !rows.as_slice().is_empty() {
            if now >= inline.until || now > inline.start_by {
                return task(rows, None);
            }
            let row = rows.next().expect("just looked");
            let mut begun = self.begin(row, now, now + self.config.handler_timeout);
            if let Started::Running { handler, .. } = &mut begun.state {
                if let std::task::Poll::Ready(result) = begun.span.in_scope(|| handler.poll_unpin(cx)) {
                    begun.state = Started::Ended(ended(result));
                }
            }
            if !matches!(begun.state, Started::Ended(Outcome::Success)) {
                return task(rows, Some(begun));
            }
            now = Instant::now();
            self.counters.handler_ran(now - begun.started);
            self.note(&begun.row, Event::Succeeded, None);
            inline.acked.push(begun.row.id);
        }
        None
    }

    /// Keeps `row`'s outcome for a test.
    fn note(&self, row: &Claimed, event: Event, error: Option<&str>) {
        if let Some(journal) = &self.journal {
            let noted = Noted {
                id: row.id,
                key: row.key().map(str::to_string),
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

    /// True when `row` must not start, and with it `rest`, the rows after it in its chain:
    /// the consumer is shutting down (they are released) or their lease is lost. They are
    /// then counted and finished.
    async fn held_back(&self, row: &Claimed, rest: &[Claimed]) -> bool {
        let rows = || std::iter::once(row).chain(rest);
        let event = if self.cancel.is_cancelled() {
            let released = self.writer.release(row.token, rows().map(|r| r.id).collect()).await;
            self.counters.add(Event::Released, released.len() as u64);
            Event::Released
        } else if !self.leases.covers(row.token, self.config.handler_timeout).await {
            self.counters.add(Event::LeaseLost, 1 + rest.len() as u64);
            Event::LeaseLost
        } else {
            return false;
        };
        self.note_all(rows(), event);
        self.finished(row.token, 1 + rest.len());
        true
    }

    /// Runs one delivery and records its outcome. True when the message resolved (succeeded or
    /// died), so the next row of its chain may start.
    async fn deliver(&self, row: Claimed) -> bool {
        let started = Instant::now();
        if !H::TRANSACTIONAL {
            return self.conclude(self.begin(row, started, started + self.config.handler_timeout)).await;
        }
        let span = handler_span(&row);
        let tx = match self.begin_transaction().await {
            Ok(tx) => tx,
            Err(e) => {
                let failed = Outcome::Failed(HandlerError::retry(format!("no transaction for the handler: {e}")));
                return self.record(row, failed).instrument(span).await;
            }
        };
        // The handler's time starts when it can run: after its transaction is open.
        let mut begun = self.call(row, span, started, Instant::now() + self.config.handler_timeout, Some(tx.clone()));
        let outcome = self.outcome(&mut begun).await;
        self.finish_transaction(begun.row, outcome, tx).instrument(begun.span).await
    }

    /// Calls the handler of a plain (not transactional) delivery.
    fn begin(&self, row: Claimed, started: Instant, deadline: Instant) -> Begun {
        let span = handler_span(&row);
        self.call(row, span, started, deadline, None)
    }

    /// Decodes the message and calls the handler; it has not been polled yet.
    fn call(&self, row: Claimed, span: tracing::Span, started: Instant, deadline: Instant, tx: Option<Tx>) -> Begun {
        // A `Deserialize` that panics is a failed delivery too, not the end of the claim loop.
        let decoded = std::panic::catch_unwind(AssertUnwindSafe(|| serde_json::from_str::<T>(row.row.get(4))));
        let message = match decoded {
            Ok(Ok(message)) => message,
            Ok(Err(e)) => {
                let error =
                    format!("the payload of message {} does not decode as {}: {e}", row.id, std::any::type_name::<T>());
                return Begun { row, span, started, state: Started::Ended(Outcome::Undecodable(error)) };
            }
            Err(panic) => {
                let error = format!("decoding the payload of message {} panicked: {}", row.id, panic_message(panic));
                return Begun {
                    row,
                    span,
                    started,
                    state: Started::Ended(Outcome::Failed(HandlerError::retry(error))),
                };
            }
        };
        // Its own token, not a child of the consumer's: the consumer's cancellation reaches a
        // running handler through `outcome`, and a child token takes the consumer token's lock
        // twice per delivery.
        let cancel = CancellationToken::new();
        let delivery = Delivery {
            message,
            id: row.id,
            key: row.key().map(str::to_string),
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
        let call = span.in_scope(|| std::panic::catch_unwind(AssertUnwindSafe(|| self.handler.call(delivery, tx))));
        let state = match call {
            Ok(future) => Started::Running { handler: AssertUnwindSafe(future).catch_unwind(), cancel, deadline },
            Err(panic) => Started::Ended(Outcome::Panicked(panic_message(panic))),
        };
        Begun { row, span, started, state }
    }

    /// Records a begun delivery's outcome once its handler has finished.
    async fn conclude(&self, mut begun: Begun) -> bool {
        let outcome = self.outcome(&mut begun).await;
        self.record(begun.row, outcome).instrument(begun.span).await
    }

    /// How the handler of `begun` ended: it runs until it finishes, its deadline passes or the
    /// consumer cancels it.
    async fn outcome(&self, begun: &mut Begun) -> Outcome {
        let outcome = match std::mem::replace(&mut begun.state, Started::Ended(Outcome::Cancelled)) {
            Started::Ended(outcome) => outcome,
            Started::Running { handler, cancel, deadline } => {
                self.wait_for(handler, cancel, deadline).instrument(begun.span.clone()).await
            }
        };
        self.counters.handler_ran(begun.started.elapsed());
        outcome
    }

    async fn wait_for(&self, mut handler: HandlerCall, cancel: CancellationToken, deadline: Instant) -> Outcome {
        // A handler that finishes at its first poll needs no deadline timer.
        if let std::task::Poll::Ready(result) = futures_util::poll!(&mut handler) {
            return ended(result);
        }
        tokio::select! {
            // A handler that finishes as it is cancelled has its result recorded.
            biased;
            result = &mut handler => ended(result),
            _ = tokio::time::sleep_until(deadline) => {
                cancel.cancel();
                Outcome::TimedOut
            }
            _ = self.cancel.cancelled() => {
                // Told to stop, a handler that then finishes at once has its result recorded.
                cancel.cancel();
                match futures_util::poll!(&mut handler) {
                    std::task::Poll::Ready(result) => ended(result),
                    std::task::Poll::Pending => Outcome::Cancelled,
                }
            }
        }
    }

    async fn begin_transaction(&self) -> Result<Tx> {
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

    /// A plain handler succeeded: its ack goes to the writer.
    fn succeeded(&self, row: &Claimed) {
        self.writer.ack(row.token, row.id);
        self.counters.add(Event::Succeeded, 1);
        self.note(row, Event::Succeeded, None);
    }

    async fn record(&self, row: Claimed, outcome: Outcome) -> bool {
        let c = &self.counters;
        let (error, permanent, retry_after) = match outcome {
            Outcome::Success => {
                self.succeeded(&row);
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

fn handler_span(row: &Claimed) -> tracing::Span {
    let span = info_span!("sqlstreams.handler", message_id = row.id, attempt = row.attempt, key = ?row.key());
    crate::trace_context::continue_trace(&span, row.headers.as_ref());
    span
}

fn ended(result: std::thread::Result<std::result::Result<(), HandlerError>>) -> Outcome {
    match result {
        Ok(Ok(())) => Outcome::Success,
        Ok(Err(e)) => Outcome::Failed(e),
        Err(panic) => Outcome::Panicked(panic_message(panic)),
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

#[cfg(test)]
mod tests {
    use super::split_chains;

    type Row = (i64, Option<i64>);

    fn ids(chains: Vec<smallvec::SmallVec<[Row; 1]>>) -> Vec<Vec<i64>> {
        chains.into_iter().map(|c| c.into_iter().map(|(id, _)| id).collect()).collect()
    }

    #[test]
    fn rows_without_run_after_are_chains_of_one() {
        let rows = vec![(1, None), (2, None), (5, None)];
        assert_eq!(ids(split_chains(rows, |r| *r)), [vec![1], vec![2], vec![5]]);
    }

    #[test]
    fn a_row_follows_the_chain_of_its_run_after() {
        // Keys a (1, 3, 6) and b (2, 4); 5 follows a row not in this claim: a chain of its own.
        let rows = vec![(1, None), (2, None), (3, Some(1)), (4, Some(2)), (5, Some(0)), (6, Some(3))];
        assert_eq!(ids(split_chains(rows, |r| *r)), [vec![1, 3, 6], vec![2, 4], vec![5]]);
    }

    #[test]
    fn rows_out_of_id_order_still_find_their_chain() {
        let rows = vec![(7, None), (3, None), (9, Some(3)), (8, Some(7)), (10, Some(9))];
        assert_eq!(ids(split_chains(rows, |r| *r)), [vec![7, 8], vec![3, 9, 10]]);
    }
}
