//! The outcome writer: one task that records a consumer's outcomes in order, on a pooled
//! connection it holds only while it has something to write.
//!
//! Acks are pipelined: a chain puts its ack in a buffer and starts its next row at once. The
//! consumer's next claim takes the buffered acks along (`claim(..., ack_lease_token,
//! ack_message_ids)`: one round trip, one commit); when no claim comes soon, this task writes
//! them as one `ack_batch` per lease token. "Soon" does not count the time a claim is in
//! flight: a consumer draining a backlog sends its next claim before (or while) the rows of
//! the last one run, so acks made meanwhile ride along with a later claim instead of
//! costing a round trip of their own. Fails, delays and releases are answered (the chain
//! needs to know whether a failure dead-lettered), and each is written after the acks buffered
//! before it, so the server sees a chain's outcomes in order (but for an ack a claim queued
//! behind another carries, which may land after a later row's failure: the earlier row, still
//! unresolved, keeps the key's lane held meanwhile). An outcome is sent again with backoff
//! after a transient error (`Error::is_transient`: a lost connection, a session the server ended,
//! a lock timeout); outcomes are idempotent per lease token.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot, Notify};
use tracing::{debug, warn};
use uuid::Uuid;

use tokio_postgres::types::ToSql;
use tokio_postgres::Row;

use crate::backoff::Backoff;
use crate::consumer::last_chance::LastChance;
use crate::consumer::metrics::{Counters, Event};
use crate::error::Result;
use crate::pool::Pool;
use crate::sql;

pub(crate) enum Command {
    Fail {
        token: Uuid,
        id: i64,
        error: String,
        permanent: bool,
        retry_after: Option<Duration>,
        reply: oneshot::Sender<Option<String>>,
    },
    Delay {
        token: Uuid,
        id: i64,
        delay: Duration,
        reply: oneshot::Sender<bool>,
    },
    Release {
        token: Uuid,
        ids: Vec<i64>,
        reply: oneshot::Sender<Vec<i64>>,
    },
    Flush {
        reply: oneshot::Sender<()>,
    },
}

/// How long buffered acks wait for a claim to carry them before this task writes them.
const ACK_GRACE: Duration = Duration::from_millis(20);

/// How many times an outcome is sent again after a cancel (`57014`).
const CANCELS_RETRIED: u32 = 3;

/// How long buffered acks wait behind a slow claim (one waiting on a lock, say) at most.
const ACK_WAIT_LIMIT: Duration = Duration::from_millis(250);

/// Acks not written yet, in the order they were made, and whether this task is writing some it
/// took from here.
#[derive(Default)]
struct Acks {
    buffered: Vec<(Uuid, i64)>,
    writing: bool,
}

type AckBuffer = Arc<Mutex<Acks>>;

/// Sends outcomes to the writer task.
#[derive(Clone)]
pub(crate) struct Writer {
    tx: mpsc::UnboundedSender<Command>,
    acks: AckBuffer,
    acks_waiting: Arc<Notify>,
    claiming: Arc<AtomicBool>,
}

impl Writer {
    pub fn spawn(
        pool: Pool,
        stream: String,
        group: String,
        counters: Arc<Counters>,
        last_chance: LastChance,
    ) -> (Writer, tokio::task::JoinHandle<()>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let acks = AckBuffer::default();
        let acks_waiting = Arc::new(Notify::new());
        let claiming = Arc::new(AtomicBool::new(false));
        let task = WriterTask {
            pool,
            stream,
            group,
            counters,
            rx,
            acks: acks.clone(),
            acks_waiting: acks_waiting.clone(),
            claiming: claiming.clone(),
            conn: None,
            last_chance,
        };
        (Writer { tx, acks, acks_waiting, claiming }, tokio::spawn(task.run()))
    }

    /// Marks a claim in flight (`true`) or back (`false`): buffered acks wait for the next one.
    pub fn claiming(&self, in_flight: bool) {
        self.claiming.store(in_flight, Ordering::Release);
    }

    pub fn ack(&self, token: Uuid, id: i64) {
        self.acks.lock().unwrap().buffered.push((token, id));
        self.acks_waiting.notify_one();
    }

    /// Acks `ids`, all of lease `token`.
    pub fn ack_all(&self, token: Uuid, ids: Vec<i64>) {
        self.acks.lock().unwrap().buffered.extend(ids.into_iter().map(|id| (token, id)));
        self.acks_waiting.notify_one();
    }

    /// Takes the buffered acks of one lease token, to send along with a claim.
    pub fn take_acks(&self) -> Option<(Uuid, Vec<i64>)> {
        let acks = &mut self.acks.lock().unwrap().buffered;
        let token = acks.first()?.0;
        let mut ids = Vec::new();
        acks.retain(|(t, id)| {
            let mine = *t == token;
            if mine {
                ids.push(*id);
            }
            !mine
        });
        Some((token, ids))
    }

    /// Puts acks back (a claim that carried them failed); they are idempotent.
    pub fn return_acks(&self, token: Uuid, ids: Vec<i64>) {
        self.acks.lock().unwrap().buffered.extend(ids.into_iter().map(|id| (token, id)));
        self.acks_waiting.notify_one();
    }

    /// The message's new status ('ready' or 'dead'), or `None` when the lease was lost.
    pub async fn fail(
        &self,
        token: Uuid,
        id: i64,
        error: String,
        permanent: bool,
        retry_after: Option<Duration>,
    ) -> Option<String> {
        let (reply, answer) = oneshot::channel();
        self.tx.send(Command::Fail { token, id, error, permanent, retry_after, reply }).ok()?;
        answer.await.ok().flatten()
    }

    /// Whether the delay was recorded.
    pub async fn delay(&self, token: Uuid, id: i64, delay: Duration) -> bool {
        let (reply, answer) = oneshot::channel();
        if self.tx.send(Command::Delay { token, id, delay, reply }).is_err() {
            return false;
        }
        answer.await.unwrap_or(false)
    }

    /// The ids released.
    pub async fn release(&self, token: Uuid, ids: Vec<i64>) -> Vec<i64> {
        let (reply, answer) = oneshot::channel();
        if self.tx.send(Command::Release { token, ids, reply }).is_err() {
            return vec![];
        }
        answer.await.unwrap_or_default()
    }

    /// Whether acks are buffered or being written (`flush` writes and waits for them).
    pub fn acks_pending(&self) -> bool {
        let acks = self.acks.lock().unwrap();
        acks.writing || !acks.buffered.is_empty()
    }

    /// Resolves once everything sent before it is written.
    pub async fn flush(&self) {
        let (reply, answer) = oneshot::channel();
        if self.tx.send(Command::Flush { reply }).is_ok() {
            let _written = answer.await;
        }
    }
}

struct WriterTask {
    pool: Pool,
    stream: String,
    group: String,
    counters: Arc<Counters>,
    rx: mpsc::UnboundedReceiver<Command>,
    acks: AckBuffer,
    acks_waiting: Arc<Notify>,
    claiming: Arc<AtomicBool>,
    conn: Option<deadpool_postgres::Object>,
    last_chance: LastChance,
}

impl WriterTask {
    async fn run(mut self) {
        loop {
            if self.rx.is_empty() {
                // Nothing to write: the connection goes back to the pool meanwhile, for claims
                // and other consumers.
                self.conn = None;
            }
            let command = tokio::select! {
                command = self.rx.recv() => command,
                _ = self.acks_waiting.notified() => {
                    // A claim about to be sent carries the acks; write them only if none comes
                    // within the grace period after the one in flight (or another outcome must
                    // follow them).
                    let claiming = self.claiming.clone();
                    let no_claim_soon = async move {
                        let since = tokio::time::Instant::now();
                        tokio::time::sleep(ACK_GRACE).await;
                        while claiming.load(Ordering::Acquire) && since.elapsed() < ACK_WAIT_LIMIT {
                            tokio::time::sleep(ACK_GRACE).await;
                        }
                    };
                    tokio::select! {
                        command = self.rx.recv() => command,
                        _ = no_claim_soon => {
                            self.write_acks().await;
                            continue;
                        }
                    }
                }
            };
            let Some(command) = command else {
                self.write_acks().await;
                return; // every sender is gone: the consumer has stopped
            };
            self.handle(command).await;
        }
    }

    async fn handle(&mut self, command: Command) {
        // Every other outcome follows the acks made before it.
        self.write_acks().await;
        match command {
            Command::Fail { token, id, error, permanent, retry_after, reply } => {
                let (stream, group) = (self.stream.clone(), self.group.clone());
                let retry_after = retry_after.map(|d| d.as_secs_f64());
                let row =
                    self.query_one(sql::FAIL, &[&stream, &group, &token, &id, &error, &permanent, &retry_after]).await;
                let _sent = reply.send(row.and_then(|r| r.get(0)));
            }
            Command::Delay { token, id, delay, reply } => {
                let (stream, group) = (self.stream.clone(), self.group.clone());
                let row = self.query_one(sql::DELAY, &[&stream, &group, &token, &id, &delay.as_secs_f64()]).await;
                let _sent = reply.send(row.is_some_and(|r| r.get(0)));
            }
            Command::Release { token, ids, reply } => {
                let (stream, group) = (self.stream.clone(), self.group.clone());
                let row = self.query_one(sql::RELEASE, &[&stream, &group, &token, &ids]).await;
                let _sent = reply.send(row.map(|r| r.get(0)).unwrap_or_default());
            }
            Command::Flush { reply } => {
                let _sent = reply.send(());
            }
        }
    }

    /// Writes the buffered acks, one `ack_batch` per token, in the order the tokens appear.
    async fn write_acks(&mut self) {
        let acks = {
            let mut buffer = self.acks.lock().unwrap();
            buffer.writing = true;
            std::mem::take(&mut buffer.buffered)
        };
        let mut by_token: Vec<(Uuid, Vec<i64>)> = Vec::new();
        for (token, id) in acks {
            match by_token.iter_mut().find(|(t, _)| *t == token) {
                Some((_, ids)) => ids.push(id),
                None => by_token.push((token, vec![id])),
            }
        }
        let (stream, group) = (self.stream.clone(), self.group.clone());
        for (token, ids) in by_token {
            // Refused (logged by `query_one`): the messages run again after their lease.
            let Some(row) = self.query_one(sql::ACK_BATCH, &[&stream, &group, &token, &ids]).await else {
                continue;
            };
            let recorded = row.get::<_, Vec<i64>>(0).len();
            if recorded < ids.len() {
                let lost = (ids.len() - recorded) as u64;
                self.counters.add(Event::LeaseLost, lost);
                warn!(lost, "sqlstreams: acks refused: their lease was lost (the messages will run again)");
            }
        }
        self.acks.lock().unwrap().writing = false;
    }

    /// Runs one statement, retrying with backoff across lost connections and other transient
    /// errors, and a few times after a cancel (`57014`: `pg_cancel_backend`, or a
    /// `statement_timeout` that may well cancel it every time). A refusal by the server is final:
    /// it is logged and `None` is returned.
    async fn query_one(&mut self, statement: &str, params: &[&(dyn ToSql + Sync)]) -> Option<Row> {
        let mut backoff = Backoff::new();
        let mut cancels = 0;
        let last_chance = self.last_chance.clone();
        loop {
            let attempt = async {
                let conn = self.connection().await?;
                let prepared = conn.prepare_cached(statement).await?;
                Ok::<_, crate::Error>(conn.query_one(&prepared, params).await?)
            };
            let Some(result) = last_chance.within(attempt).await else {
                return self.abandon(statement);
            };
            let pause = match result {
                Ok(row) => return Some(row),
                Err(e) if e.is_transient() => {
                    debug!(error = %e, "sqlstreams: outcome writer reconnecting");
                    if let Some(conn) = self.conn.take() {
                        Pool::give_back(conn, &e);
                    }
                    backoff.next()
                }
                Err(e) if e.is_cancel() && cancels < CANCELS_RETRIED => {
                    debug!(error = %e, "sqlstreams: outcome cancelled; sending it again");
                    cancels += 1;
                    backoff.next()
                }
                Err(e) => {
                    warn!(error = %e, statement, "sqlstreams: outcome refused");
                    return None;
                }
            };
            if last_chance.within(tokio::time::sleep(pause)).await.is_none() {
                return self.abandon(statement);
            }
        }
    }

    /// Gives up on an outcome whose last chance ended (a statement still running is left to
    /// the server: its connection is closed).
    fn abandon(&mut self, statement: &str) -> Option<Row> {
        if let Some(conn) = self.conn.take() {
            drop(deadpool_postgres::Object::take(conn));
        }
        warn!(statement, "sqlstreams: outcome not recorded: the consumer stopped past its grace and the database did not take it in time (the message runs again after its lease)");
        None
    }

    async fn connection(&mut self) -> Result<&deadpool_postgres::Object> {
        if self.conn.as_ref().is_none_or(|c| c.is_closed()) {
            self.conn = Some(self.pool.conn().await?);
        }
        Ok(self.conn.as_ref().expect("just connected"))
    }
}
