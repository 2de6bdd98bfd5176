//! The consumer loop: claim, split the result into same-key chains, run each chain (one
//! message at a time, in id order) on the loop's own task until a handler waits, then on a
//! task of its own; record outcomes. A full claim sends the next claim before its rows run,
//! and another once they have run, so that the server has the claim after it queued while it
//! runs one. The claim call and its chains are in claims.rs, running them in
//! executor.rs, the idle wait in idle.rs; acks and failures are written by the writer
//! (writer.rs).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_util::stream::FuturesUnordered;
use futures_util::StreamExt;
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, warn};
use uuid::Uuid;

use super::claims::{chains_of, claim, Claimed, Conn};
use super::executor::{ChainTask, Inline, INLINE_BUDGET};
use super::handler::Handle;
use super::idle::{idle_wait, NextDue, IDLE_FLOOR};
use super::last_chance::LastChance;
use super::leases::LeaseBook;
use super::listener;
use super::metrics::{Counters, Event};
use super::writer::Writer;
use super::{ConsumerConfig, ConsumerGroup};
use crate::backoff::Backoff;
use crate::error::Result;
use crate::pool::Pool;
use crate::{sql, Concurrency};

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

/// What the claim loop and the chains it runs share.
pub(super) struct Ctx<T, H> {
    pub group: ConsumerGroup<T>,
    pub config: ConsumerConfig,
    pub handler: Arc<H>,
    pub counters: Arc<Counters>,
    pub writer: Writer,
    pub leases: Arc<LeaseBook>,
    /// Cancels running handlers (shutdown past its grace period).
    pub cancel: CancellationToken,
    /// How long claims in flight are still waited for after `cancel`.
    pub last_chance: LastChance,
    /// Rows claimed and not finished, and a signal when that number drops.
    pub outstanding: AtomicUsize,
    pub progress: Notify,
    /// Permits for rows claimed and not finished: at most `message_concurrency`.
    pub semaphore: Arc<Semaphore>,
    /// The claim loop claims again once no more than this many rows are outstanding (room
    /// for half a batch).
    pub claim_again_at: usize,
    /// Notifications of the stream (new messages, resolved blockers, freed lanes), and this
    /// consumer's own retries and delays, which nothing else announces (`timed_work`).
    pub wake: Arc<Notify>,
    /// Set when an outcome of this consumer scheduled a retry or a delay: what `next_due` said
    /// before may be later than it.
    pub timed_work: AtomicBool,
    /// Set by tests: every delivery's outcome, and stop once nothing is left to claim.
    pub journal: Option<Journal>,
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
    let last_chance = LastChance::new(cancel.clone());
    let (writer, writer_task) =
        Writer::spawn(pool.clone(), stream.clone(), group_name.clone(), counters.clone(), last_chance.clone());
    let leases = Arc::new(LeaseBook::new(pool.clone(), stream, group_name, config.lease));
    let wake = Arc::new(Notify::new());
    let background = CancellationToken::new();
    let (listen, tls) = pool.listen().clone();
    let listener = listener::spawn(listen, tls, channel, wake.clone(), background.clone());
    let heartbeat = tokio::spawn(heartbeat(leases.clone(), config.lease / 3, background.clone()));
    let lag = config.lag_interval.map(|every| {
        let (pool, counters, stop) = (pool.clone(), counters.clone(), background.clone());
        let (stream, group) = (group.stream.name.clone(), group.name.clone());
        tokio::spawn(read_lag(pool, stream, group, counters, every, stop))
    });
    let room = (config.message_concurrency.min(config.batch_size as usize) / 2).max(1);
    let ctx = Arc::new(Ctx {
        claim_again_at: config.message_concurrency - room,
        semaphore: Arc::new(Semaphore::new(config.message_concurrency)),
        group,
        config,
        handler,
        counters,
        writer,
        leases,
        cancel,
        last_chance,
        outstanding: AtomicUsize::new(0),
        progress: Notify::new(),
        wake,
        timed_work: AtomicBool::new(false),
        journal,
    });
    let mut claims = ClaimLoop::new(ctx.clone(), room);
    claims.run(&stop).await;
    let fatal = claims.finish().await;
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

/// Claims in flight at once, at most: one the server runs, and the next, queued behind it on
/// the same connection while the consumer runs the rows before them.
const AHEAD: usize = 2;

/// A claim sent before the rows of the claim before it finished (see `ClaimLoop::dispatch`),
/// with what it holds.
struct Ahead {
    claim: std::pin::Pin<Box<futures_util::future::MaybeDone<ClaimFuture>>>,
    permits: OwnedSemaphorePermit,
    acks: Option<(Uuid, Vec<i64>)>,
    claimed_at: Instant,
    conn: Conn,
    /// Sent before the rows of a claim of ordered or exclusive work ran (see `Early`).
    early: bool,
}

type ClaimFuture = std::pin::Pin<Box<dyn std::future::Future<Output = Result<Vec<Claimed>>> + Send>>;

/// A claim that came back: its rows (or error), the permits it asked with, the acks it carried,
/// the connection it went out on (none: the pool gave none), whether it was sent `early`.
struct Sent {
    permits: OwnedSemaphorePermit,
    acks: Option<(Uuid, Vec<i64>)>,
    claimed_at: Instant,
    conn: Option<Conn>,
    result: Result<Vec<Claimed>>,
    early: bool,
}

impl Ahead {
    async fn land(mut self) -> Sent {
        self.claim.as_mut().await;
        let result = self.claim.as_mut().take_output().expect("an awaited claim has its output");
        let conn = Some(self.conn);
        Sent { permits: self.permits, acks: self.acks, claimed_at: self.claimed_at, conn, result, early: self.early }
    }
}

/// Whether a full claim of ordered or exclusive work sends the next claim before its rows run.
/// That claim can find work only in lanes no claim holds (this claim's stay held until its rows
/// have outcomes): where there are none (a stream of one lane, as many consumers as lanes) it
/// comes back empty, and costs the server a claim for nothing. So after one came back empty the
/// next such claims send none, one the first time, then twice as many each time (up to `MAX`),
/// until one sent finds work again.
#[derive(Debug, Default)]
struct Early {
    /// Full claims still to send none.
    skip: u32,
    /// How many to skip after the next miss.
    next: u32,
}

impl Early {
    const MAX: u32 = 64;

    /// Whether this full claim sends one.
    fn due(&mut self) -> bool {
        if self.skip == 0 {
            return true;
        }
        self.skip -= 1;
        false
    }

    /// What the last claim sent early found.
    fn found(&mut self, work: bool) {
        if work {
            self.next = 0;
        } else {
            self.next = (self.next * 2).clamp(1, Self::MAX);
            self.skip = self.next;
        }
    }
}

/// What the claim loop does next.
enum Step<T> {
    Go(T),
    Again,
    Stop,
}

/// The claim loop and what it carries from one claim to the next.
struct ClaimLoop<T, H> {
    ctx: Arc<Ctx<T, H>>,
    /// Room for half a batch: a claim sent ahead asks for at least this much.
    room: usize,
    /// Chains run as tasks, at most one per runtime worker per claim.
    chains: JoinSet<()>,
    workers: usize,
    backoff: Backoff,
    idle_floor: Duration,
    next_due: NextDue,
    /// Until idle (tests): a claim that found nothing after everything before it was written.
    idle_after_flush: bool,
    /// Whether the last claim was parallel work only (no chains): then a claim not sent ahead
    /// may overlap its handlers, and need not wait for the writer's acks.
    pipelined: bool,
    /// Claims in flight, oldest first (at most `AHEAD`).
    ahead: VecDeque<Ahead>,
    early: Early,
    /// Whether the pool has a connection besides the claims': the claims keep theirs while a
    /// backlog lasts when one is queued behind another, and the writer, the lease heartbeat and
    /// transactional handlers need one too.
    spare_connection: bool,
    /// An error that stops the consumer.
    fatal: Option<crate::Error>,
}

impl<T, H> ClaimLoop<T, H>
where
    T: Serialize + DeserializeOwned + Send + Sync + 'static,
    H: Handle<T>,
{
    fn new(ctx: Arc<Ctx<T, H>>, room: usize) -> Self {
        let spare_connection = ctx.group.stream.pool.deadpool().status().max_size > 1;
        ClaimLoop {
            ctx,
            room,
            chains: JoinSet::new(),
            workers: tokio::runtime::Handle::current().metrics().num_workers().max(1),
            backoff: Backoff::new(),
            idle_floor: IDLE_FLOOR,
            next_due: NextDue::Unknown,
            idle_after_flush: false,
            pipelined: true,
            ahead: VecDeque::with_capacity(AHEAD),
            early: Early::default(),
            spare_connection,
            fatal: None,
        }
    }

    /// Claims and dispatches until `stop`, or until a claim is refused for good.
    async fn run(&mut self, stop: &CancellationToken) {
        while !stop.is_cancelled() {
            while self.chains.try_join_next().is_some() {}
            let sent = match self.ahead.pop_front() {
                Some(ahead) => match land_within_last_chance(&self.ctx.last_chance, ahead).await {
                    Some(sent) => sent,
                    None => break,
                },
                None => match self.claim_now(stop).await {
                    Step::Go(sent) => sent,
                    Step::Again => continue,
                    Step::Stop => break,
                },
            };
            self.ctx.writer.claiming(!self.ahead.is_empty());
            let Sent { permits, acks, claimed_at, conn, result, early } = sent;
            if let (true, Ok(rows)) = (early, &result) {
                self.early.found(!rows.is_empty());
            }
            let step = match result {
                Err(e) => {
                    // Another claim in flight on the connection gives it back when it lands.
                    if let Some(conn) = conn.and_then(Arc::into_inner) {
                        Pool::give_back(conn, &e);
                    }
                    drop(permits);
                    self.refused(e, acks, stop).await
                }
                Ok(rows) if rows.is_empty() => {
                    // Not held while idle: the pool's connections are for whoever has work.
                    drop((permits, conn));
                    self.backoff.reset();
                    if !self.ahead.is_empty() {
                        // A claim queued behind this one came back too, or will: it is landed
                        // before the consumer waits, so that a notification that comes meanwhile
                        // wakes a consumer with nothing in flight, and the connection goes back.
                        Step::Again
                    } else if !self.pipelined && self.ctx.outstanding.load(Ordering::Acquire) > 0 {
                        // Sent ahead of ordered or exclusive rows that still run: the work left
                        // is likely in their lanes, which their outcomes free. The next claim
                        // waits for them and carries their acks (`claim_now`), as no
                        // notification need come.
                        Step::Again
                    } else {
                        self.idle(stop).await
                    }
                }
                Ok(rows) => {
                    self.backoff.reset();
                    self.idle_after_flush = false;
                    self.dispatch(rows, permits, claimed_at, conn, stop).await;
                    Step::Again
                }
            };
            if let Step::Stop = step {
                break;
            }
        }
    }

    /// Claims now, once there is room: as soon as there is room for half a batch, so that the
    /// claim's round trip overlaps the handlers still running and the server never waits for
    /// the consumer. After a claim with ordered or exclusive rows, it waits until every row
    /// handed out has finished and the acks not carried are written: they free those rows'
    /// lanes, where the next claim most likely finds work.
    async fn claim_now(&mut self, stop: &CancellationToken) -> Step<Sent> {
        let ctx = &self.ctx;
        let outstanding = ctx.outstanding.load(Ordering::Acquire);
        if outstanding > 0 && (!self.pipelined || outstanding > ctx.claim_again_at) {
            tokio::select! {
                _ = ctx.progress.notified() => return Step::Again,
                _ = stop.cancelled() => return Step::Stop,
            }
        }
        let mut permits = tokio::select! {
            permit = ctx.semaphore.clone().acquire_owned() => permit.expect("the semaphore is never closed"),
            _ = stop.cancelled() => return Step::Stop,
        };
        let more = ctx.semaphore.available_permits().min(ctx.config.batch_size as usize - 1);
        if let Ok(more) = ctx.semaphore.clone().try_acquire_many_owned(more as u32) {
            permits.merge(more);
        }
        // The last claim's acks go along with this claim (see the writer), so the server sees
        // its same-key rows resolved before it decides what to hand out next.
        let claimed_at = Instant::now();
        let acks = ctx.writer.take_acks();
        if !self.pipelined && ctx.writer.acks_pending() {
            // Acks this claim does not carry (of another lease, or taken by the writer already)
            // are written before it decides, or their keys' next rows are not handed out.
            ctx.writer.flush().await;
        }
        ctx.writer.claiming(true);
        // Taken after the flush: the writer may need the pool's last connection.
        let conn = match ctx.group.stream.pool.conn().await {
            Ok(conn) => Arc::new(conn),
            Err(e) => return Step::Go(Sent { permits, acks, claimed_at, conn: None, result: Err(e), early: false }),
        };
        let claiming = claim(ctx.clone(), conn.clone(), permits.num_permits() as i32, acks.clone());
        let Some(result) = ctx.last_chance.within(claiming).await else {
            abandoned();
            discard(conn);
            return Step::Stop;
        };
        Step::Go(Sent { permits, acks, claimed_at, conn: Some(conn), result, early: false })
    }

    /// A claim failed: retried after a pause, unless retrying cannot help.
    async fn refused(&mut self, e: crate::Error, acks: Option<(Uuid, Vec<i64>)>, stop: &CancellationToken) -> Step<()> {
        if let Some((token, ids)) = acks {
            self.ctx.writer.return_acks(token, ids);
        }
        if e.is_unknown_object() || e.is_permission_denied() || self.ctx.journal.is_some() {
            // Retrying cannot bring a dropped group or a revoked grant back (and a test wants
            // to see any error).
            error!(error = %e, "sqlstreams: claim refused; the consumer stops");
            self.fatal = Some(e);
            return Step::Stop;
        }
        warn!(error = %e, "sqlstreams: claim failed; retrying");
        if !self.ahead.is_empty() {
            // The claim queued behind it is landed first (its rows were handed out, or it failed
            // as well); the pause comes when a claim fails with nothing in flight.
            return Step::Again;
        }
        tokio::select! {
            _ = tokio::time::sleep(self.backoff.next()) => Step::Again,
            _ = stop.cancelled() => Step::Stop,
        }
    }

    /// A claim found nothing: wait for a notification or the group's next timed work (tests:
    /// stop once everything before was written and a claim still finds nothing).
    async fn idle(&mut self, stop: &CancellationToken) -> Step<()> {
        let ctx = &self.ctx;
        if ctx.journal.is_some() {
            if ctx.outstanding.load(Ordering::Acquire) > 0 {
                tokio::select! {
                    _ = ctx.progress.notified() => return Step::Again,
                    _ = stop.cancelled() => return Step::Stop,
                }
            } else if self.idle_after_flush {
                return Step::Stop;
            }
            ctx.writer.flush().await;
            self.idle_after_flush = true;
            return Step::Again;
        }
        if ctx.timed_work.swap(false, Ordering::AcqRel) {
            self.next_due = NextDue::Unknown;
        }
        let idle = idle_wait(ctx, self.idle_floor, &mut self.next_due).await;
        if idle <= self.idle_floor {
            // Due now, yet nothing came: the work waits behind something that notifies.
            self.idle_floor = (self.idle_floor * 2).min(ctx.config.poll_interval);
        }
        tokio::select! {
            // Something changed: what next_due said may no longer hold.
            _ = ctx.wake.notified() => self.next_due = NextDue::Unknown,
            _ = tokio::time::sleep(idle) => {}
            _ = stop.cancelled() => return Step::Stop,
        }
        Step::Again
    }

    /// Runs a claim's rows: its chains first on this task, until their handler waits, then
    /// spread over tasks. A full claim sends the next claim first (unless one is in flight, or
    /// `Early` says not to), on `conn`, the connection it came back on, and another once its
    /// rows have run (`send_ahead`).
    async fn dispatch(
        &mut self,
        rows: Vec<Claimed>,
        mut permits: OwnedSemaphorePermit,
        claimed_at: Instant,
        conn: Option<Conn>,
        stop: &CancellationToken,
    ) {
        let ctx = self.ctx.clone();
        self.idle_floor = IDLE_FLOOR;
        // Work came, and its outcomes may set retries and delays: ask again when idle.
        self.next_due = NextDue::Unknown;
        ctx.counters.add(Event::Claimed, rows.len() as u64);
        ctx.outstanding.fetch_add(rows.len(), Ordering::AcqRel);
        let (token, row_count, asked) = (rows[0].token, rows.len(), permits.num_permits());
        ctx.leases.track(token, row_count, claimed_at);
        let split = chains_of(rows);
        // Claiming again while same-key rows of an ordered or exclusive key still run finds
        // nothing of their keys (`claim_now` waits for them when nothing was sent ahead).
        self.pipelined = split.iter().all(|chain| chain.len() == 1 && chain[0].concurrency == Concurrency::Parallel);
        // A full claim: more is likely waiting. Ordered and exclusive work in it holds its lanes
        // until it has outcomes, so a claim sent ahead takes other lanes and never hands out its
        // keys' next messages (docs/semantics.md, "Lanes").
        let full = row_count == asked;
        if let Some(conn) = conn.filter(|_| full && self.ahead.is_empty() && !stop.is_cancelled()) {
            // `Early` counts only claims that could send one.
            if self.room_ahead().is_some() && (self.pipelined || self.early.due()) {
                self.send_ahead(conn, !self.pipelined).await;
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
        // Acked once for all the rows that succeeded inline, before any task that follows one of
        // them in its chain can record an outcome.
        let acked = inline.acked.len();
        if acked > 0 {
            ctx.writer.ack_all(token, inline.acked);
        }
        // The permits of the chains finished here and of the rows the claim did not return.
        drop(permits);
        // The claim sent above is the server's to run while this task waits for it: the one after
        // it goes out now, behind it on its connection and with these acks, so that the server
        // runs it as soon as the first is done instead of waiting a round trip for this consumer
        // to ask. Before the rows are counted: whoever sees them counted sees it sent.
        if full && (1..AHEAD).contains(&self.ahead.len()) && self.spare_connection && !stop.is_cancelled() {
            let conn = self.ahead[self.ahead.len() - 1].conn.clone();
            self.send_ahead(conn, false).await;
        }
        if acked > 0 {
            ctx.counters.add(Event::Succeeded, acked as u64);
            ctx.finished(token, acked);
        }
        let tasks = self.workers.min(waiting.len());
        let mut buckets: Vec<Vec<_>> = (0..tasks).map(|_| Vec::new()).collect();
        for (i, chain) in waiting.into_iter().enumerate() {
            buckets[i % tasks].push(chain);
        }
        for bucket in buckets {
            self.chains.spawn(async move {
                let mut running: FuturesUnordered<_> = bucket.into_iter().collect();
                while running.next().await.is_some() {}
            });
        }
    }

    /// A full claim: more is likely waiting. The next claim goes out now on `conn`, with the
    /// acks made so far, if there are permits for at least half a batch; its round trip overlaps
    /// these rows' handlers. On a connection with a claim in flight, the server runs it right
    /// after that one. `early`: sent before the rows of ordered or exclusive work ran.
    async fn send_ahead(&mut self, conn: Conn, early: bool) {
        let Some(wanted) = self.room_ahead() else { return };
        let ctx = &self.ctx;
        let Ok(permits) = ctx.semaphore.clone().try_acquire_many_owned(wanted as u32) else { return };
        let (acks, claimed_at) = (ctx.writer.take_acks(), Instant::now());
        ctx.writer.claiming(true);
        let sent: ClaimFuture = Box::pin(claim(ctx.clone(), conn.clone(), wanted as i32, acks.clone()));
        let mut claim = Box::pin(futures_util::future::maybe_done(sent));
        // Its first poll sends it.
        let _sent = futures_util::poll!(claim.as_mut());
        self.ahead.push_back(Ahead { claim, permits, acks, claimed_at, conn, early });
    }

    /// The rows a claim sent ahead would ask for: what the permits allow, up to a batch, if at
    /// least half a batch.
    fn room_ahead(&self) -> Option<usize> {
        let wanted = self.ctx.semaphore.available_permits().min(self.ctx.config.batch_size as usize);
        (wanted >= self.room).then_some(wanted)
    }

    /// After the loop: claims sent ahead give their rows back at once (not after their lease),
    /// and every chain finishes. Returns the error that stopped the consumer, if one did.
    async fn finish(mut self) -> Option<crate::Error> {
        let ctx = self.ctx.clone();
        // Every claim in flight lands before any rows are released: the connection they share
        // goes back to the pool first, where the writer finds it.
        let mut landed = Vec::with_capacity(self.ahead.len());
        while let Some(ahead) = self.ahead.pop_front() {
            let Some(Sent { acks, result, .. }) = land_within_last_chance(&ctx.last_chance, ahead).await else {
                break;
            };
            landed.push((acks, result));
        }
        ctx.writer.claiming(false);
        for (acks, result) in landed {
            match result {
                Ok(rows) if !rows.is_empty() => {
                    ctx.counters.add(Event::Claimed, rows.len() as u64);
                    let released = ctx.writer.release(rows[0].token, rows.iter().map(|r| r.id).collect()).await;
                    ctx.counters.add(Event::Released, released.len() as u64);
                    ctx.note_all(rows.iter().filter(|r| released.contains(&r.id)), Event::Released);
                }
                Ok(_) => {}
                Err(_) => {
                    if let Some((token, ids)) = acks {
                        ctx.writer.return_acks(token, ids);
                    }
                }
            }
        }
        while let Some(done) = self.chains.join_next().await {
            if let Err(e) = done {
                warn!(error = %e, "sqlstreams: a chain task failed");
            }
        }
        self.fatal
    }
}

/// Lands a claim sent ahead, unless the last chance ends first (see `abandoned`).
async fn land_within_last_chance(last_chance: &LastChance, ahead: Ahead) -> Option<Sent> {
    let conn = ahead.conn.clone();
    let landed = last_chance.within(ahead.land()).await;
    if landed.is_none() {
        abandoned();
        discard(conn);
    }
    landed
}

/// A claim in flight not waited for: the database did not answer within the last chance.
fn abandoned() {
    warn!("sqlstreams: a claim in flight was not waited for: the consumer stopped past its grace and the database did not answer in time (what it hands out runs after its lease)");
}

/// Drops a connection out of the pool once no claim in flight shares it (a statement may still
/// run on it).
fn discard(conn: Conn) {
    if let Some(conn) = Arc::into_inner(conn) {
        drop(deadpool_postgres::Object::take(conn));
    }
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

#[cfg(test)]
mod tests {
    use super::Early;

    /// Which of `n` full claims send one early, `found` saying what each one sent found.
    fn sends(early: &mut Early, n: usize, found: bool) -> Vec<bool> {
        (0..n)
            .map(|_| {
                let due = early.due();
                if due {
                    early.found(found);
                }
                due
            })
            .collect()
    }

    #[test]
    fn claims_sent_early_back_off_while_they_find_nothing() {
        let mut early = Early::default();
        let (t, f) = (true, false);
        assert_eq!(sends(&mut early, 3, true), [t, t, t]);
        // Misses skip one claim, then two, then four.
        assert_eq!(sends(&mut early, 11, false), [t, f, t, f, f, t, f, f, f, f, t]);
        // A claim sent early that finds work again resets the pause.
        assert_eq!(sends(&mut early, 8, true), [f; 8]);
        assert_eq!(sends(&mut early, 2, true), [t, t]);
        assert_eq!(sends(&mut early, 3, false), [t, f, t]);
    }

    #[test]
    fn the_pause_is_bounded() {
        let mut early = Early::default();
        let sent = sends(&mut early, 1000, false).iter().filter(|&&s| s).count();
        // Seven sent while the pause grows to 64 (after 1 + 2 + ... + 32 = 63 skipped, at the
        // 70th claim), then one in every 65: 14 more.
        assert_eq!(sent, 21);
    }
}
