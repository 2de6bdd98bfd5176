//! The outcome writer: one task and one connection that record a consumer's outcomes in order.
//!
//! Acks are pipelined: a chain hands its ack over and starts its next row at once, and
//! consecutive acks are written as one `ack_batch` per lease token. Fails, delays and releases
//! are answered (the chain needs to know whether a failure dead-lettered), and every outcome is
//! written after the acks queued before it, so the server sees a chain's outcomes in order. A
//! lost connection is retried with backoff; outcomes are idempotent per lease token.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use tracing::{debug, warn};
use uuid::Uuid;

use tokio_postgres::types::ToSql;
use tokio_postgres::Row;

use crate::client::Client;
use crate::consumer::metrics::Counters;
use crate::error::Result;
use crate::sql;

pub(crate) enum Command {
    Ack {
        token: Uuid,
        id: i64,
    },
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

/// Sends outcomes to the writer task.
#[derive(Clone)]
pub(crate) struct Writer {
    tx: mpsc::UnboundedSender<Command>,
}

/// Most acks written by one `ack_batch`.
const MAX_ACK_BATCH: usize = 1000;

impl Writer {
    pub fn spawn(
        client: Client,
        stream: String,
        group: String,
        counters: Arc<Counters>,
    ) -> (Writer, tokio::task::JoinHandle<()>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let task = tokio::spawn(WriterTask { client, stream, group, counters, rx, conn: None }.run());
        (Writer { tx }, task)
    }

    pub fn ack(&self, token: Uuid, id: i64) {
        let _sent = self.tx.send(Command::Ack { token, id });
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

    /// Resolves once everything sent before it is written.
    pub async fn flush(&self) {
        let (reply, answer) = oneshot::channel();
        if self.tx.send(Command::Flush { reply }).is_ok() {
            let _written = answer.await;
        }
    }
}

struct WriterTask {
    client: Client,
    stream: String,
    group: String,
    counters: Arc<Counters>,
    rx: mpsc::UnboundedReceiver<Command>,
    conn: Option<deadpool_postgres::Object>,
}

impl WriterTask {
    async fn run(mut self) {
        let mut next: Option<Command> = None;
        loop {
            let command = match next.take() {
                Some(command) => command,
                None => match self.rx.recv().await {
                    Some(command) => command,
                    None => return, // every sender is gone: the consumer has stopped
                },
            };
            match command {
                Command::Ack { token, id } => {
                    // Gather the acks queued behind this one, up to the first other command.
                    let mut acks = vec![(token, id)];
                    while acks.len() < MAX_ACK_BATCH {
                        match self.rx.try_recv() {
                            Ok(Command::Ack { token, id }) => acks.push((token, id)),
                            Ok(other) => {
                                next = Some(other);
                                break;
                            }
                            Err(_) => break,
                        }
                    }
                    self.write_acks(acks).await;
                }
                Command::Fail { token, id, error, permanent, retry_after, reply } => {
                    let (stream, group) = (self.stream.clone(), self.group.clone());
                    let retry_after = retry_after.map(|d| d.as_secs_f64());
                    let row = self
                        .query_one(sql::FAIL, &[&stream, &group, &token, &id, &error, &permanent, &retry_after])
                        .await;
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
    }

    /// Writes acks, one `ack_batch` per token, in the order the tokens first appear.
    async fn write_acks(&mut self, acks: Vec<(Uuid, i64)>) {
        let mut by_token: Vec<(Uuid, Vec<i64>)> = Vec::new();
        for (token, id) in acks {
            match by_token.iter_mut().find(|(t, _)| *t == token) {
                Some((_, ids)) => ids.push(id),
                None => by_token.push((token, vec![id])),
            }
        }
        let (stream, group) = (self.stream.clone(), self.group.clone());
        for (token, ids) in by_token {
            let row = self.query_one(sql::ACK_BATCH, &[&stream, &group, &token, &ids]).await;
            let recorded = row.map(|r| r.get::<_, Vec<i64>>(0).len()).unwrap_or(0);
            if recorded < ids.len() {
                let lost = (ids.len() - recorded) as u64;
                Counters::add(&self.counters.lease_lost, lost);
                warn!(lost, "sqlstreams: acks refused: their lease was lost (the messages will run again)");
            }
        }
    }

    /// Runs one statement, retrying with backoff across lost connections. A refusal by the
    /// server (not a connection problem) is final: it is logged and `None` is returned.
    async fn query_one(&mut self, statement: &str, params: &[&(dyn ToSql + Sync)]) -> Option<Row> {
        let mut backoff = Duration::from_millis(50);
        loop {
            let result = match self.connection().await {
                Ok(conn) => conn.query_one(statement, params).await.map_err(crate::Error::from),
                Err(e) => Err(e),
            };
            match result {
                Ok(row) => return Some(row),
                Err(e) if e.is_transient() => {
                    debug!(error = %e, "sqlstreams: outcome writer reconnecting");
                    self.conn = None;
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                }
                Err(e) => {
                    warn!(error = %e, statement, "sqlstreams: outcome refused");
                    return None;
                }
            }
        }
    }

    async fn connection(&mut self) -> Result<&tokio_postgres::Client> {
        if self.conn.as_ref().is_none_or(|c| c.is_closed()) {
            self.conn = Some(self.client.conn().await?);
        }
        Ok(self.conn.as_ref().expect("just connected"))
    }
}
