//! What a handler receives, and how it says what happened.

use std::fmt;
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::{Concurrency, Headers};

/// One delivery of one message to a handler.
///
/// At least once: a delivery can be repeated (after a failure, a timeout, or a consumer that
/// lost its lease). An expired lease can be taken over by another consumer while this handler
/// still runs, so watch [`Delivery::cancelled`] and finish before [`Delivery::deadline`], and
/// keep handlers idempotent.
#[derive(Debug)]
pub struct Delivery<T> {
    /// The decoded message.
    pub message: T,
    /// The message id (ids increase in produce order within a stream).
    pub id: i64,
    /// The message key, if it has one.
    pub key: Option<String>,
    /// Earlier deliveries of this message that did not succeed (0 on first delivery).
    pub attempt: u32,
    /// The policy the group applied.
    pub concurrency: Concurrency,
    /// When the message was produced: the start of the producer's transaction, by the
    /// database's clock.
    pub produced_at: std::time::SystemTime,
    /// The headers it was produced with (empty when none).
    pub headers: Headers,
    pub(crate) cancel: CancellationToken,
    pub(crate) deadline: Instant,
}

impl<T> Delivery<T> {
    /// Resolves when the handler should stop: its deadline passed or the consumer shuts down.
    pub async fn cancelled(&self) {
        self.cancel.cancelled().await
    }

    /// Whether the handler has been asked to stop.
    pub fn is_cancelled(&self) -> bool {
        self.cancel.is_cancelled()
    }

    /// A header's value as text, when it is a JSON string (a `traceparent`, for example).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(serde_json::Value::as_str)
    }

    /// A token to pass to blocking calls that take one.
    pub fn cancellation(&self) -> CancellationToken {
        self.cancel.clone()
    }

    /// When the handler is cancelled and its delivery counted as failed.
    pub fn deadline(&self) -> Instant {
        self.deadline
    }
}

/// What a failed handler asks for. Any error converts into a retryable failure, so `?` works in
/// handlers (see the `From` impl).
pub enum HandlerError {
    /// Retry with the group's backoff, or after `after`.
    Retry {
        /// Recorded as the message's `last_error`.
        error: String,
        /// Overrides the backoff for this one retry.
        after: Option<Duration>,
    },
    /// Do not retry: dead-letter the message.
    Permanent(String),
    /// Run again after this long; not counted as a failure.
    Delay(Duration),
}

impl HandlerError {
    /// A failure to retry with the group's backoff.
    pub fn retry(error: impl fmt::Display) -> Self {
        HandlerError::Retry { error: error.to_string(), after: None }
    }

    /// A failure to retry after `after` instead of the backoff.
    pub fn retry_after(error: impl fmt::Display, after: Duration) -> Self {
        HandlerError::Retry { error: error.to_string(), after: Some(after) }
    }

    /// A failure never to retry.
    pub fn permanent(error: impl fmt::Display) -> Self {
        HandlerError::Permanent(error.to_string())
    }

    /// Not a failure: run this message again after `after`.
    pub fn delay(after: Duration) -> Self {
        HandlerError::Delay(after)
    }
}

/// Anything that converts into `Box<dyn Error + Send + Sync>` (any error type, `anyhow::Error`,
/// a `String`) is a failure to retry, so `?` works in handlers. The recorded `last_error`
/// keeps the whole chain of causes ("outer: inner: root").
impl<E: Into<Box<dyn std::error::Error + Send + Sync>>> From<E> for HandlerError {
    fn from(error: E) -> Self {
        let error: Box<dyn std::error::Error + Send + Sync> = error.into();
        let mut text = error.to_string();
        let mut source = error.source();
        while let Some(cause) = source {
            let cause_text = cause.to_string();
            // anyhow's context already shows its cause in its own message only with {:#}.
            if !text.ends_with(&cause_text) {
                text.push_str(": ");
                text.push_str(&cause_text);
            }
            source = cause.source();
        }
        HandlerError::Retry { error: text, after: None }
    }
}

impl fmt::Display for HandlerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HandlerError::Retry { error, after: None } => write!(f, "{error}"),
            HandlerError::Retry { error, after: Some(d) } => write!(f, "{error} (retry after {d:?})"),
            HandlerError::Permanent(error) => write!(f, "{error} (permanent)"),
            HandlerError::Delay(d) => write!(f, "delay {d:?}"),
        }
    }
}

impl fmt::Debug for HandlerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}
