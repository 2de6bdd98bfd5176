//! Running a claim's chains: each handler called, awaited within its deadline, and its outcome
//! recorded (acks through the writer, failures and delays at once). A chain runs on the claim
//! loop's task while its handlers finish when first polled, then on a task of its own.

use std::any::Any;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use futures_util::FutureExt;
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::sync::OwnedSemaphorePermit;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{warn, Instrument};
use uuid::Uuid;

use super::claims::{Chain, Claimed};
use super::delivery::{Delivery, HandlerError};
use super::handler::{Handle, Tx};
use super::metrics::Event;
use super::runner::{Ctx, Noted};
use crate::error::Result;
use crate::{sql, Headers};

/// How long a claim's chains may run on the claim loop's task before the rest go to tasks of
/// their own (see `ClaimLoop::dispatch`).
pub(super) const INLINE_BUDGET: Duration = Duration::from_millis(1);

/// How a delivery ended, before it is recorded.
enum Outcome {
    Success,
    Failed(HandlerError),
    Panicked(String),
    TimedOut,
    Cancelled,
    Undecodable(String),
}

/// What the chains run inline during one claim's dispatch share: until when they may run
/// inline, until when a row may start without a lease check, and the ids that succeeded (acked
/// and counted together afterwards).
pub(super) struct Inline {
    pub until: Instant,
    pub start_by: Instant,
    pub acked: Vec<i64>,
}

/// The rest of a chain, run as a task: boxed, so that it can move to another task after its
/// first poll.
pub(super) type ChainTask = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>;

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
    pub(super) fn start_inline(
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

    pub(super) fn note_all<'r>(&self, rows: impl Iterator<Item = &'r Claimed>, event: Event) {
        if self.journal.is_some() {
            rows.for_each(|row| self.note(row, event, None));
        }
    }

    pub(super) fn finished(&self, token: Uuid, rows: usize) {
        self.leases.finished(token, rows);
        let before = self.outstanding.fetch_sub(rows, Ordering::AcqRel);
        // The claim loop waits for all work to finish, or for room for half a batch (see
        // `ClaimLoop::claim_now`): wake it only when one of those is crossed, not for every row.
        let after = before - rows;
        if after == 0 || (before > self.claim_again_at && after <= self.claim_again_at) {
            self.progress.notify_one();
        }
    }

    /// True when `row` must not start, and with it `rest`, the rows after it in its chain:
    /// the consumer is shutting down (they are released) or their lease is lost (released too
    /// when it ran out here before it was renewed). They are then counted and finished.
    async fn held_back(&self, row: &Claimed, rest: &[Claimed]) -> bool {
        let rows = || std::iter::once(row).chain(rest);
        let event = if self.cancel.is_cancelled() {
            let released = self.writer.release(row.token, rows().map(|r| r.id).collect()).await;
            self.counters.add(Event::Released, released.len() as u64);
            Event::Released
        } else if !self.leases.covers(row.token, self.config.handler_timeout).await {
            let mut given_back = 0;
            if self.leases.lapsed(row.token) {
                // What is still this consumer's comes again at once, not after the renewed lease.
                given_back = self.writer.release(row.token, rows().map(|r| r.id).collect()).await.len();
                self.counters.add(Event::Released, given_back as u64);
            }
            self.counters.add(Event::LeaseLost, (1 + rest.len()).saturating_sub(given_back) as u64);
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
        let span = self.handler_span(&row);
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

    fn handler_span(&self, row: &Claimed) -> tracing::Span {
        let (stream, group) = (&self.group.stream.name, &self.group.name);
        crate::trace_context::process_span(stream, group, row.id, row.attempt, row.key(), row.headers.as_ref())
    }

    /// Calls the handler of a plain (not transactional) delivery.
    fn begin(&self, row: Claimed, started: Instant, deadline: Instant) -> Begun {
        let span = self.handler_span(&row);
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

    /// An outcome scheduled a retry or a delay, which nothing announces: the claim loop asks
    /// `next_due` again (see `NextDue`), now if it is idle.
    fn scheduled(&self) {
        self.timed_work.store(true, Ordering::Release);
        self.wake.notify_one();
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
                if recorded {
                    self.scheduled();
                }
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
                Some(_) => {
                    self.scheduled();
                    (Event::Failed, false)
                }
                None => (Event::LeaseLost, false),
            };
        c.add(event, 1);
        self.note(&row, event, noted.as_deref());
        resolved
    }
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
