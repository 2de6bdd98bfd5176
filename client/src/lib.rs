//! Async Rust client for sqlstreams: durable message streams inside PostgreSQL with consumer
//! groups and per-key `parallel`, `exclusive` and `ordered` delivery. The extension, its SQL API
//! (`docs/sql-api.md`) and its semantics (`docs/semantics.md`) live in the same repository.
//!
//! The client is thin: every decision (what may run, in which order, what a failure does) is
//! made inside Postgres by the extension's SQL functions. The client serializes messages, runs
//! handlers, and records their outcomes.
//!
//! ```no_run
//! use serde::{Deserialize, Serialize};
//! use sqlstreams_client::{Client, Concurrency, ConsumerConfig, HandlerError, ProduceOptions};
//!
//! #[derive(Serialize, Deserialize)]
//! struct BalanceAdjusted { account: String, delta: i64 }
//!
//! # async fn demo() -> Result<(), sqlstreams_client::Error> {
//! let client = Client::connect("postgres://postgres@localhost/app")?;
//! let adjustments = client.stream::<BalanceAdjusted>("ledger.adjustments");
//! adjustments.register().await?;
//! let ledger = adjustments.consumer("apply-balance");
//! let consumer = ledger
//!     .register(ConsumerConfig { concurrency_override: Some(Concurrency::Ordered), ..Default::default() })
//!     .await?;
//! let produced = adjustments
//!     .producer()
//!     .produce(
//!         &BalanceAdjusted { account: "acct-42".into(), delta: -500 },
//!         ProduceOptions { message_key: Some("acct-42".into()), ..Default::default() },
//!     )
//!     .await?;
//! let running = consumer.start(|delivery| async move {
//!     println!("apply {} to {}", delivery.message.delta, delivery.message.account);
//!     Ok::<(), HandlerError>(())
//! });
//! # let _ = produced;
//! running.shutdown(std::time::Duration::from_secs(10)).await;
//! # Ok(()) }
//! ```
//!
//! # Connecting
//!
//! [`Client::connect`] takes a libpq-style connection string and pools up to 16 connections;
//! [`Client::connect_with`] takes [`ClientOptions`] (the pool size, and a CA file to trust).
//! The client's first call checks that the database has the extension at
//! [`MIN_EXTENSION_VERSION`] or later ([`Client::check_extension`] checks at once); otherwise
//! every call fails with [`Error::Extension`], which says what to run, until one finds it does.
//! With `sslmode=require` in the string, every connection (the pool's and each consumer's
//! `LISTEN` connection) uses TLS (rustls) and verifies the server's certificate and host name
//! against the system's roots plus [`ClientOptions::ssl_root_cert`] (by default the file named
//! by `PGSSLROOTCERT`). That is stricter than libpq's `require`, which does not verify.
//! `prefer` (the default) and `disable` connect without TLS; `verify-ca` and `verify-full` are
//! not accepted, and client certificates are not supported.
//!
//! Connect as a role with the rights of what it does (the extension's `docs/sql-api.md`, "Roles
//! and grants"): producing needs `sqlstreams_producer` and a `produce` grant on the stream;
//! [`ConsumerGroup::register`] and consuming need `sqlstreams_consumer` and a `consume` grant on
//! the group; [`Stream::register`] creates the stream and is an admin's call, which an
//! application role skips. A refused call is [`Error::PermissionDenied`] (SQLSTATE `42501`)
//! and a refused certificate [`Error::Tls`]; neither is transient.
//!
//! A consumer writes an outcome again, on a new connection, after any error for which
//! [`Error::is_transient`] holds: a lost connection, a session the server ended
//! (`pg_terminate_backend`, a shutdown: `57P01` and the like), a server that became a standby
//! (`25006`), a serialization failure or deadlock, a lock timeout; and up to three times after a
//! cancel (`57014`: a fourth gives it up, and its message runs again after its lease, possibly
//! after later messages of its key). Outcomes are idempotent per lease token, so nothing is
//! recorded twice; a session the server ended is not given back to the pool.
//!
//! # Delivery guarantees
//!
//! Delivery is **at least once**. Each claim holds a lease; the consumer extends it while its
//! handlers run, starts a message only when the lease covers the handler timeout, and cancels a
//! handler at its deadline. If a consumer stops extending (it crashed, or lost its connection
//! for longer than the lease), the lease expires and another consumer may run the same
//! messages, possibly while an old handler that ignored cancellation still runs. So keep
//! handlers idempotent, pass [`Delivery::cancellation`] to blocking calls, and finish before
//! [`Delivery::deadline`]. A claim whose lease ran out here before a renewal was answered starts
//! no more of its messages: it gives them back (another consumer may have taken part of the
//! claim over meanwhile), and they come again.
//!
//! Within those limits, a group's policy holds across all its consumers: an `Ordered` key never
//! starts a message before every earlier message of the key succeeded or was dead-lettered, and
//! an `Exclusive` key runs one delivery at a time. Same-key messages of one claim run in one
//! task, in order, so a hot key stays serial whatever `message_concurrency` is.
//!
//! # Claims in flight
//!
//! A consumer never holds more rows, claimed and not finished, than `message_concurrency`:
//! each claim asks for the rows it has room for (up to `batch_size`, and only if there is room
//! for half of that). While a backlog lasts (a claim came back full), it keeps the server busy:
//! the next claim goes out before the rows of the last one run, on the connection that claim came
//! back on, and once they have run, the claim after it goes out too, queued behind it, so that
//! the server runs it as soon as the first is done instead of waiting a round trip for the
//! consumer. Each carries the acks made before it was sent (of one claim). With
//! `message_concurrency` at least twice `batch_size` and handlers that finish without waiting,
//! both are whole batches; with the defaults (64 and 100) a claim takes 64 rows and the next goes
//! out once they have run. Claims queued behind one another keep their connection while the
//! backlog lasts, so a pool of one connection (which the writer and the lease heartbeat need too)
//! queues none. Ordered and exclusive work goes ahead too: the lanes of its keys stay held until
//! its rows have outcomes, so a claim sent before they ran takes other lanes, never the next
//! messages of those keys. Where no other lane has work (a stream of one lane, as many consumers
//! as lanes) that claim comes back empty; then the consumer sends none ahead of such rows for a
//! while (one claim, then twice as many each time it finds nothing, up to 64). A claim not sent
//! ahead, or after one sent ahead found nothing, waits for the ordered and exclusive rows before
//! it to finish and for their acks to be written. A consumer that finds nothing else lands what
//! it had in flight and holds no connection while it waits.

//! The client's spans follow OpenTelemetry's messaging conventions: `produce <stream>` (a
//! producer span, operation type `send`), `claim <stream>` (a client span, `receive`) and
//! `process <stream>` (a consumer span, `process`), with `messaging.system = "sqlstreams"`,
//! `messaging.destination.name`, `messaging.consumer.group.name`, `messaging.message.id` and
//! `messaging.batch.message_count`. With the `opentelemetry` feature, a message carries the
//! trace context of its `produce` span (a W3C `traceparent` header), and its `process` span
//! continues that trace as its parent (the conventions allow a link or a parent; a parent shows
//! the handling under the request that produced it); install a global propagator
//! (`TraceContextPropagator`) and a `tracing-opentelemetry` layer.

#![deny(missing_docs)]

mod admin;
mod backoff;
mod client;
mod conninfo;
mod consumer;
mod error;
mod extension;
mod pool;
mod producer;
mod sql;
mod stream;
#[cfg(feature = "testing")]
pub mod testing;
mod tls;
mod trace_context;

pub use admin::{
    Admin, BlockedKey, DeadMessage, FenceHolder, GroupChanges, GroupInfo, GroupStatus, MaintainReport, OnDead,
    OpenLease, PeekedMessage, Privilege, SeekTo, StreamChanges, StreamInfo,
};
pub use client::{Client, ClientOptions};
pub use conninfo::config_from_env;
pub use consumer::{
    Consumer, ConsumerConfig, ConsumerGroup, Delivery, HandlerError, Metrics, RunningConsumer, Shutdown, StartAt, Tx,
};
pub use error::{Error, Result};
pub use extension::MIN_EXTENSION_VERSION;
pub use producer::{BatchOptions, ProduceOptions, Produced, Producer};
pub use stream::{Stream, StreamConfig};

/// A message's headers: a JSON object produced with it (a W3C `traceparent`, a tenant, a
/// schema version) and handed to its handlers in [`Delivery::headers`].
pub type Headers = serde_json::Map<String, serde_json::Value>;

/// When a keyed message must wait (see the extension's documentation).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Concurrency {
    /// Same-key messages may run concurrently and out of order.
    Parallel,
    /// One delivery per key at a time; a later message may overtake a retry.
    Exclusive,
    /// A message waits until every earlier same-key message succeeded or was dead-lettered.
    Ordered,
}

impl Concurrency {
    /// The policy's name in SQL.
    pub fn as_str(self) -> &'static str {
        match self {
            Concurrency::Parallel => "parallel",
            Concurrency::Exclusive => "exclusive",
            Concurrency::Ordered => "ordered",
        }
    }
}

impl std::str::FromStr for Concurrency {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "parallel" => Ok(Concurrency::Parallel),
            "exclusive" => Ok(Concurrency::Exclusive),
            "ordered" => Ok(Concurrency::Ordered),
            other => Err(Error::Config(format!("'{other}' is not a policy (parallel, exclusive, ordered)"))),
        }
    }
}
