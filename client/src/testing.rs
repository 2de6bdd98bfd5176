//! Testing your handlers against a real database (feature `testing`).
//!
//! [`Consumer::work_until_idle`] runs a handler the way a running consumer does (the same
//! claims, chains, outcomes, leases and transactions) until a claim finds nothing left to
//! run, and reports what happened to every delivery. It waits for no clock: a retry whose
//! backoff has not passed, or a delayed message, is left for later and shows as
//! [`Outcome::Retrying`] or [`Outcome::Delayed`]. (A handler that keeps asking for delays
//! shorter than a claim round trip keeps it running, since delays are unbounded unless the
//! group sets `max_delays`: give such tests one.) A claim that fails ends it with
//! the error.
//!
//! ```no_run
//! # async fn example() -> sqlstreams_client::Result<()> {
//! use sqlstreams_client::testing::Outcome;
//! use sqlstreams_client::{Client, ConsumerConfig, HandlerError};
//!
//! let client = Client::connect("postgres://localhost/app_test")?;
//! let orders = client.stream::<serde_json::Value>("orders");
//! orders.register().await?;
//! orders.producer().produce(&serde_json::json!({"total": -1}), Default::default()).await?;
//! let consumer = orders.consumer("billing").register(ConsumerConfig::default()).await?;
//! let worked = consumer
//!     .work_until_idle(|d| async move {
//!         if d.message["total"].as_i64() < Some(0) {
//!             return Err(HandlerError::permanent("negative total"));
//!         }
//!         Ok(())
//!     })
//!     .await?;
//! assert_eq!(worked[0].outcome, Outcome::Dead { error: "negative total".into() });
//! # Ok(())
//! # }
//! ```

use std::future::Future;

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::consumer::{Event, InTransaction, Noted, Plain};
use crate::error::Result;
use crate::{Consumer, Delivery, HandlerError, Tx};

/// What happened to one delivery.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The handler succeeded and its ack was sent (for a transactional handler, committed with
    /// its writes).
    Succeeded,
    /// The handler failed; a retry is scheduled.
    Retrying {
        /// The handler's error, as recorded.
        error: String,
    },
    /// Dead-lettered: a permanent failure, a spent retry budget, or a payload that does not
    /// decode.
    Dead {
        /// The handler's error (or why the payload did not decode).
        error: String,
    },
    /// The handler asked for a delay.
    Delayed,
    /// Not started: an earlier delivery of its key in the same claim did not succeed.
    Deferred,
    /// The lease ran out before the outcome was recorded.
    LeaseLost,
}

/// One delivery and its outcome, in the order the outcomes were recorded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Worked {
    /// The message id.
    pub id: i64,
    /// The message key.
    pub key: Option<String>,
    /// Earlier deliveries of this message that did not succeed.
    pub attempt: u32,
    /// What happened.
    pub outcome: Outcome,
}

fn worked(noted: Vec<Noted>) -> Vec<Worked> {
    noted
        .into_iter()
        .map(|n| {
            let error = n.error.unwrap_or_default();
            let outcome = match n.event {
                Event::Succeeded => Outcome::Succeeded,
                Event::Dead => Outcome::Dead { error },
                Event::Delayed => Outcome::Delayed,
                Event::Deferred => Outcome::Deferred,
                Event::Failed => Outcome::Retrying { error },
                _ => Outcome::LeaseLost,
            };
            Worked { id: n.id, key: n.key, attempt: n.attempt, outcome }
        })
        .collect()
}

impl<T> Consumer<T>
where
    T: Serialize + DeserializeOwned + Send + Sync + 'static,
{
    /// Runs `handler` as [`Consumer::start`] would, until a claim finds nothing left to run
    /// and every outcome is recorded; returns what happened to each delivery.
    pub async fn work_until_idle<H, F>(self, handler: H) -> Result<Vec<Worked>>
    where
        H: Fn(Delivery<T>) -> F + Send + Sync + 'static,
        F: Future<Output = std::result::Result<(), HandlerError>> + Send + 'static,
    {
        Ok(worked(self.work_until_idle_with(Plain(handler)).await?))
    }

    /// [`Consumer::work_until_idle`] for a transactional handler
    /// ([`Consumer::start_in_transaction`]).
    pub async fn work_until_idle_in_transaction<H, F>(self, handler: H) -> Result<Vec<Worked>>
    where
        H: Fn(Delivery<T>, Tx) -> F + Send + Sync + 'static,
        F: Future<Output = std::result::Result<(), HandlerError>> + Send + 'static,
    {
        Ok(worked(self.work_until_idle_with(InTransaction(handler)).await?))
    }
}
