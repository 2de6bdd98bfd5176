//! Consumer groups and consumers that run handlers.

mod claims;
mod delivery;
mod executor;
mod handler;
mod idle;
mod last_chance;
mod leases;
mod listener;
mod metrics;
mod runner;
mod writer;

#[cfg(feature = "testing")]
pub(crate) use metrics::Event;
#[cfg(feature = "testing")]
pub(crate) use runner::Noted;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub use delivery::{Delivery, HandlerError};
pub use handler::Tx;
pub(crate) use handler::{Handle, InTransaction, Plain};
pub use metrics::Metrics;

use crate::error::{Error, Result};
use crate::sql;
use crate::stream::Stream;
use crate::Concurrency;
use metrics::Counters;

/// Where a new group starts reading.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum StartAt {
    /// Every message of the stream.
    #[default]
    Beginning,
    /// Only messages produced after the group is created.
    Head,
}

/// A group's settings (stored in the database, shared by all its consumers) and this
/// consumer's runtime settings.
#[derive(Clone, Debug)]
pub struct ConsumerConfig {
    /// A policy for every keyed message of the group, whatever producers asked for.
    /// `None`: each message's own request applies (keyed messages default to parallel).
    pub concurrency_override: Option<Concurrency>,
    /// Retries after the first failed run (default 3: four runs in all), then dead.
    pub max_retries: u32,
    /// Wait before the first retry (default 1 s); the backoff is
    /// `min(backoff_cap, backoff_base * backoff_exponent^(attempts - 1))`.
    pub backoff_base: Duration,
    /// Longest wait between retries (default 5 minutes).
    pub backoff_cap: Duration,
    /// Growth of the wait per failure (default 2).
    pub backoff_exponent: f64,
    /// Requested delays allowed per message before it is dead-lettered; `None`: unbounded.
    pub max_delays: Option<u32>,
    /// Times an expired range is handed out again before its messages are quarantined.
    pub max_reclaims: u32,
    /// Where the group starts when it is created (ignored for an existing group).
    pub start_at: StartAt,
    /// What [`ConsumerGroup::register`] does when the group exists with other settings: `false`
    /// (the default) refuses with [`Error::SettingsMismatch`], so a consumer started with a
    /// default configuration never silently turns an ordered group parallel; `true` stores
    /// this configuration's settings for every consumer of the group.
    pub update_settings: bool,

    /// Handlers this consumer runs at once (default 64). A chain of same-key messages counts
    /// once: it runs one message at a time, so a hot key stays serial whatever this is.
    pub message_concurrency: usize,
    /// Most messages one claim takes (default 100).
    pub batch_size: u32,
    /// A handler is cancelled and its delivery counted as failed after this (default 30 s).
    pub handler_timeout: Duration,
    /// Lease of each claim (default 60 s), extended while its handlers run. Must be longer
    /// than `handler_timeout`: a message is only started when its lease covers the timeout.
    pub lease: Duration,
    /// The longest an idle consumer waits for work without a notification (default 1 s). It
    /// wakes earlier when a retry, a delay, a lease or a lane hold of its group falls due
    /// (`sqlstreams.next_due`), which nothing notifies.
    pub poll_interval: Duration,
    /// How often the consumer reads its group's lag for the `sqlstreams_lag_messages` and
    /// `sqlstreams_oldest_unresolved_seconds` gauges (default 15 s; `None`: never). Each
    /// reading is one `group_status` call.
    pub lag_interval: Option<Duration>,
}

impl Default for ConsumerConfig {
    fn default() -> Self {
        ConsumerConfig {
            concurrency_override: None,
            max_retries: 3,
            backoff_base: Duration::from_secs(1),
            backoff_cap: Duration::from_secs(300),
            backoff_exponent: 2.0,
            max_delays: None,
            max_reclaims: 2,
            start_at: StartAt::Beginning,
            update_settings: false,
            message_concurrency: 64,
            batch_size: 100,
            handler_timeout: Duration::from_secs(30),
            lease: Duration::from_secs(60),
            poll_interval: Duration::from_secs(1),
            lag_interval: Some(Duration::from_secs(15)),
        }
    }
}

impl ConsumerConfig {
    fn validate(&self) -> Result<()> {
        let problem = if self.message_concurrency == 0 {
            "message_concurrency must be at least 1"
        } else if !(1..=10_000).contains(&self.batch_size) {
            "batch_size must be between 1 and 10000"
        } else if self.handler_timeout.is_zero() {
            "handler_timeout must be positive"
        } else if self.lease <= self.handler_timeout {
            "lease must be longer than handler_timeout (a message only starts when its lease covers the timeout)"
        } else if self.poll_interval.is_zero() {
            "poll_interval must be positive"
        } else if self.lag_interval.is_some_and(|i| i.is_zero()) {
            "lag_interval must be positive (or None)"
        } else {
            return Ok(());
        };
        Err(Error::Config(problem.into()))
    }
}

/// A consumer group of a stream: every group receives every message.
pub struct ConsumerGroup<T> {
    pub(crate) stream: Stream<T>,
    pub(crate) name: String,
}

impl<T> Clone for ConsumerGroup<T> {
    fn clone(&self) -> Self {
        ConsumerGroup { stream: self.stream.clone(), name: self.name.clone() }
    }
}

impl<T> ConsumerGroup<T>
where
    T: Serialize + DeserializeOwned + Send + Sync + 'static,
{
    pub(crate) fn new(stream: Stream<T>, name: String) -> Self {
        ConsumerGroup { stream, name }
    }

    /// The group's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Creates the group, and returns a consumer. An existing group with other settings is
    /// refused with [`Error::SettingsMismatch`] naming them, unless
    /// [`ConsumerConfig::update_settings`] says to store this configuration's.
    pub async fn register(&self, config: ConsumerConfig) -> Result<Consumer<T>> {
        config.validate()?;
        let conn = self.stream.pool.conn().await?;
        if let Some(row) = conn.query_opt(sql::GROUP_SETTINGS, &[&self.stream.name, &self.name]).await? {
            let stored = Settings {
                concurrency_override: row.get(0),
                max_retries: row.get(1),
                backoff_base_micros: row.get(2),
                backoff_cap_micros: row.get(3),
                backoff_exponent: row.get(4),
                max_delays: row.get(5),
                max_reclaims: row.get(6),
            };
            let differences = stored.differences(&Settings::of(&config));
            if differences.is_empty() {
                drop(conn);
                let channel = self.stream.channel().await?;
                return Ok(Consumer {
                    group: self.clone(),
                    config,
                    channel,
                    counters: Arc::new(Counters::new(&self.stream.name, &self.name)),
                });
            }
            if !config.update_settings {
                return Err(Error::SettingsMismatch { group: self.name.clone(), differences });
            }
        }
        let start_at = match config.start_at {
            StartAt::Beginning => "beginning",
            StartAt::Head => "head",
        };
        conn.query_one(
            sql::CREATE_GROUP,
            &[
                &self.stream.name,
                &self.name,
                &config.concurrency_override.map(Concurrency::as_str),
                &(config.max_retries.min(i32::MAX as u32) as i32),
                &start_at,
                &config.backoff_base.as_secs_f64(),
                &config.backoff_cap.as_secs_f64(),
                &config.backoff_exponent,
                &config.max_delays.map(|d| d.min(i32::MAX as u32) as i32),
                &(config.max_reclaims.min(i32::MAX as u32) as i32),
            ],
        )
        .await?;
        drop(conn);
        let channel = self.stream.channel().await?;
        Ok(Consumer {
            group: self.clone(),
            config,
            channel,
            counters: Arc::new(Counters::new(&self.stream.name, &self.name)),
        })
    }
}

/// A registered consumer, ready to run a handler.
pub struct Consumer<T> {
    group: ConsumerGroup<T>,
    config: ConsumerConfig,
    /// The stream's wake-up channel.
    channel: String,
    counters: Arc<Counters>,
}

impl<T> Consumer<T>
where
    T: Serialize + DeserializeOwned + Send + Sync + 'static,
{
    /// This consumer's counters.
    pub fn metrics(&self) -> Metrics {
        self.counters.snapshot()
    }

    /// Starts running `handler` on a background task; stop it with [`RunningConsumer::shutdown`].
    ///
    /// Handlers are called on the consumer's task and stay there while they finish when first
    /// polled (most do: they need no I/O, or their I/O is buffered); one that waits moves to
    /// another task (at most one per runtime worker for a claim's waiting handlers), so waiting
    /// handlers run concurrently and the consumer claims on. Like
    /// any async code, a handler should not block its thread: put long synchronous work in
    /// `tokio::task::spawn_blocking`.
    pub fn start<H, F>(self, handler: H) -> RunningConsumer
    where
        H: Fn(Delivery<T>) -> F + Send + Sync + 'static,
        F: Future<Output = Result<(), HandlerError>> + Send + 'static,
    {
        self.spawn(Plain(handler))
    }

    /// Like [`Consumer::start`], for a handler whose work is in this database: each call gets
    /// an open transaction ([`Tx`]); when the handler succeeds, the message's ack is recorded
    /// in that transaction and it commits, so the handler's writes and the ack commit (or roll
    /// back) together: exactly once for effects in this database. A failed handler's
    /// transaction rolls back, and the failure is recorded as usual.
    ///
    /// Use it when the handler writes to this database; keep [`Consumer::start`] for handlers
    /// that call other systems (a transaction held open across a remote call only holds locks
    /// longer). Each running handler holds one pooled connection while it runs.
    pub fn start_in_transaction<H, F>(self, handler: H) -> RunningConsumer
    where
        H: Fn(Delivery<T>, Tx) -> F + Send + Sync + 'static,
        F: Future<Output = Result<(), HandlerError>> + Send + 'static,
    {
        self.spawn(InTransaction(handler))
    }

    fn spawn<H: Handle<T>>(self, handler: H) -> RunningConsumer {
        let stop = CancellationToken::new();
        let cancel = CancellationToken::new();
        let counters = self.counters.clone();
        let task = tokio::spawn(runner::run(
            self.group,
            self.config,
            self.channel,
            Arc::new(handler),
            counters.clone(),
            runner::Stops { stop: stop.clone(), cancel: cancel.clone() },
            None,
        ));
        RunningConsumer { stop, cancel, task, counters }
    }

    /// Runs `handler` as a consumer would until nothing is left to claim (see
    /// [`crate::testing`]).
    #[cfg(feature = "testing")]
    pub(crate) async fn work_until_idle_with<H: Handle<T>>(self, handler: H) -> Result<Vec<runner::Noted>> {
        let journal = runner::Journal::default();
        runner::run(
            self.group,
            self.config,
            self.channel,
            Arc::new(handler),
            self.counters.clone(),
            runner::Stops { stop: CancellationToken::new(), cancel: CancellationToken::new() },
            Some(journal.clone()),
        )
        .await?;
        let noted = journal.lock().unwrap().clone();
        Ok(noted)
    }

    /// Runs `handler` until `shutdown` resolves, then shuts down gracefully within
    /// `grace` (see [`RunningConsumer::shutdown`]).
    pub async fn run_until<H, F, S>(self, handler: H, shutdown: S, grace: Duration) -> Shutdown
    where
        H: Fn(Delivery<T>) -> F + Send + Sync + 'static,
        F: Future<Output = Result<(), HandlerError>> + Send + 'static,
        S: Future<Output = ()>,
    {
        let running = self.start(handler);
        shutdown.await;
        running.shutdown(grace).await
    }
}

/// A consumer running on a background task.
pub struct RunningConsumer {
    stop: CancellationToken,
    cancel: CancellationToken,
    task: JoinHandle<Result<()>>,
    counters: Arc<Counters>,
}

/// How a consumer ended.
#[derive(Debug)]
pub struct Shutdown {
    /// Every handler finished within the grace period (none had to be cancelled).
    pub drained: bool,
    /// The consumer's counters at the end.
    pub metrics: Metrics,
    /// Why the consumer stopped on its own, when it did: an error retrying cannot fix (its
    /// group or stream was dropped, or its role lost the right to consume).
    pub error: Option<Error>,
}

impl RunningConsumer {
    /// This consumer's counters.
    pub fn metrics(&self) -> Metrics {
        self.counters.snapshot()
    }

    /// Stops claiming, lets in-flight handlers finish for up to `grace`, then cancels the rest
    /// (their deliveries count as failed and run again later) and gives back every claimed
    /// message that did not start. Every outcome is recorded before this returns, but for those
    /// the database does not take within two seconds after `grace` (it is down, or ends every
    /// session): they are logged and given up, and their messages run again after their lease.
    pub async fn shutdown(self, grace: Duration) -> Shutdown {
        self.stop.cancel();
        let mut task = self.task;
        let (drained, ended) = match tokio::time::timeout(grace, &mut task).await {
            Ok(ended) => (true, ended),
            Err(_) => {
                self.cancel.cancel();
                (false, task.await)
            }
        };
        Shutdown { drained, metrics: self.counters.snapshot(), error: ended_with(ended) }
    }

    /// Whether the consumer has stopped on its own (see [`Shutdown::error`]).
    pub fn is_finished(&self) -> bool {
        self.task.is_finished()
    }

    /// Waits until the consumer stops on its own: after an error retrying cannot fix. Use
    /// [`RunningConsumer::shutdown`] to stop it.
    pub async fn join(self) -> Shutdown {
        let ended = self.task.await;
        Shutdown { drained: true, metrics: self.counters.snapshot(), error: ended_with(ended) }
    }
}

fn ended_with(ended: std::result::Result<Result<()>, tokio::task::JoinError>) -> Option<Error> {
    match ended {
        Ok(Ok(())) => None,
        Ok(Err(e)) => Some(e),
        Err(panic) => Some(Error::Config(format!("the consumer task failed: {panic}"))),
    }
}

/// A group's stored settings, as compared by `register`.
#[derive(Debug, PartialEq)]
struct Settings {
    concurrency_override: Option<String>,
    max_retries: i32,
    backoff_base_micros: i64,
    backoff_cap_micros: i64,
    backoff_exponent: f64,
    max_delays: Option<i32>,
    max_reclaims: i32,
}

impl Settings {
    fn of(config: &ConsumerConfig) -> Settings {
        Settings {
            concurrency_override: config.concurrency_override.map(|c| c.as_str().to_string()),
            max_retries: config.max_retries.min(i32::MAX as u32) as i32,
            backoff_base_micros: config.backoff_base.as_micros().min(i64::MAX as u128) as i64,
            backoff_cap_micros: config.backoff_cap.as_micros().min(i64::MAX as u128) as i64,
            backoff_exponent: config.backoff_exponent,
            max_delays: config.max_delays.map(|d| d.min(i32::MAX as u32) as i32),
            max_reclaims: config.max_reclaims.min(i32::MAX as u32) as i32,
        }
    }

    /// "name: stored → wanted" for every setting that differs.
    fn differences(&self, wanted: &Settings) -> Vec<String> {
        let mut out = Vec::new();
        let mut check = |name: &str, stored: String, want: String| {
            if stored != want {
                out.push(format!("{name}: {stored} → {want}"));
            }
        };
        check(
            "concurrency_override",
            format!("{:?}", self.concurrency_override),
            format!("{:?}", wanted.concurrency_override),
        );
        check("max_retries", self.max_retries.to_string(), wanted.max_retries.to_string());
        check("backoff_base", format!("{}µs", self.backoff_base_micros), format!("{}µs", wanted.backoff_base_micros));
        check("backoff_cap", format!("{}µs", self.backoff_cap_micros), format!("{}µs", wanted.backoff_cap_micros));
        check("backoff_exponent", self.backoff_exponent.to_string(), wanted.backoff_exponent.to_string());
        check("max_delays", format!("{:?}", self.max_delays), format!("{:?}", wanted.max_delays));
        check("max_reclaims", self.max_reclaims.to_string(), wanted.max_reclaims.to_string());
        out
    }
}
