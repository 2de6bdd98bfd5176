//! Producing messages: one at a time, in batches (the fast path), or inside your own
//! transaction (the outbox pattern: the message exists exactly when your write commits).

use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio_postgres::GenericClient;
use tracing::Instrument;

use crate::error::Result;
use crate::sql;
use crate::stream::Stream;
use crate::trace_context::send_span;
use crate::{Concurrency, Headers};

/// Options of one produced message. All default to "none".
#[derive(Clone, Debug, Default)]
pub struct ProduceOptions {
    /// The key per-key policies order by (an account, an order, a user).
    pub message_key: Option<String>,
    /// The message's own policy request; a group's `concurrency_override` wins over it.
    /// Exclusive and ordered need a `message_key`.
    pub concurrency: Option<Concurrency>,
    /// The message carries its key's latest state: a newer compacted message of the same key
    /// supersedes it. Needs a `message_key`; refused together with `Ordered`.
    pub compaction: bool,
    /// A repeat of this key within the stream's idempotency TTL produces nothing.
    pub idempotency_key: Option<String>,
    /// Handed to handlers with the message ([`crate::Delivery::headers`]). With the
    /// `opentelemetry` feature the current span's trace context is added (`traceparent`),
    /// unless these headers carry one already.
    pub headers: Option<Headers>,
    /// Not delivered before this long after the producing transaction started.
    pub deliver_after: Option<Duration>,
}

/// Options shared by every message of a batch.
#[derive(Clone, Debug, Default)]
pub struct BatchOptions {
    /// Every message's policy request (see [`ProduceOptions::concurrency`]).
    pub concurrency: Option<Concurrency>,
    /// Every message carries its key's latest state (see [`ProduceOptions::compaction`]).
    pub compaction: bool,
    /// Headers of every message of the batch (see [`ProduceOptions::headers`]).
    pub headers: Option<Headers>,
    /// Every message waits this long (see [`ProduceOptions::deliver_after`]).
    pub deliver_after: Option<Duration>,
}

impl BatchOptions {
    fn headers(&self) -> Option<serde_json::Value> {
        crate::trace_context::outgoing(self.headers.as_ref())
    }

    fn deliver_after(&self) -> Option<f64> {
        self.deliver_after.map(|d| d.as_secs_f64())
    }
}

/// The outcome of a produce.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Produced {
    /// The message was appended with this id.
    Message(i64),
    /// The idempotency key was already used: nothing was produced.
    Duplicate,
}

impl Produced {
    /// The new message's id, if one was produced.
    pub fn id(self) -> Option<i64> {
        match self {
            Produced::Message(id) => Some(id),
            Produced::Duplicate => None,
        }
    }
}

/// Produces `T` messages on one stream.
#[derive(Clone, Debug)]
pub struct Producer<T> {
    stream: Stream<T>,
}

impl<T> Producer<T>
where
    T: Serialize + DeserializeOwned + Send + Sync + 'static,
{
    pub(crate) fn new(stream: Stream<T>) -> Self {
        Producer { stream }
    }

    /// Produces one message in its own transaction.
    pub async fn produce(&self, message: &T, options: ProduceOptions) -> Result<Produced> {
        async {
            let conn = self.stream.pool.conn().await?;
            let statement = conn.prepare_cached(sql::PRODUCE).await?;
            let args = ProduceArgs::new(&self.stream.name, message, &options)?;
            let row = conn.query_one(&statement, &args.params()).await?;
            Ok(produced(&row))
        }
        .instrument(send_span(&self.stream.name, None))
        .await
    }

    /// Produces one message through `client`: a connection or, for the outbox pattern, your
    /// open transaction. The message becomes visible to consumers when that transaction commits
    /// and vanishes if it rolls back. With a transaction from the client's pool
    /// (`deadpool_postgres::Transaction`), pass `&*transaction`.
    pub async fn produce_in<C: GenericClient>(
        &self,
        client: &C,
        message: &T,
        options: ProduceOptions,
    ) -> Result<Produced> {
        async {
            let args = ProduceArgs::new(&self.stream.name, message, &options)?;
            let row = client.query_one(sql::PRODUCE, &args.params()).await?;
            Ok(produced(&row))
        }
        .instrument(send_span(&self.stream.name, None))
        .await
    }

    /// Produces many messages in one statement; ids follow the input order.
    pub async fn produce_batch<'a, I>(&self, messages: I, options: BatchOptions) -> Result<Vec<i64>>
    where
        I: IntoIterator<Item = (&'a T, Option<&'a str>)>,
    {
        let (payloads, keys) = encode(messages)?;
        if payloads.is_empty() {
            return Ok(vec![]);
        }
        let span = send_span(&self.stream.name, Some(payloads.len()));
        async {
            let conn = self.stream.pool.conn().await?;
            let statement = conn.prepare_cached(sql::PRODUCE_BATCH).await?;
            let concurrency = options.concurrency.map(Concurrency::as_str);
            let (headers, deliver_after) = (options.headers(), options.deliver_after());
            let row = conn
                .query_one(
                    &statement,
                    &[&self.stream.name, &payloads, &keys, &concurrency, &options.compaction, &headers, &deliver_after],
                )
                .await?;
            Ok(row.get(0))
        }
        .instrument(span)
        .await
    }

    /// Like [`Producer::produce_batch`], through your connection or transaction.
    pub async fn produce_batch_in<'a, C, I>(&self, client: &C, messages: I, options: BatchOptions) -> Result<Vec<i64>>
    where
        C: GenericClient,
        I: IntoIterator<Item = (&'a T, Option<&'a str>)>,
    {
        let (payloads, keys) = encode(messages)?;
        if payloads.is_empty() {
            return Ok(vec![]);
        }
        let span = send_span(&self.stream.name, Some(payloads.len()));
        async {
            let row = client
                .query_one(
                    sql::PRODUCE_BATCH,
                    &[
                        &self.stream.name,
                        &payloads,
                        &keys,
                        &options.concurrency.map(Concurrency::as_str),
                        &options.compaction,
                        &options.headers(),
                        &options.deliver_after(),
                    ],
                )
                .await?;
            Ok(row.get(0))
        }
        .instrument(span)
        .await
    }
}

/// The arguments of `sqlstreams.produce`, in order.
struct ProduceArgs<'a> {
    stream: &'a str,
    payload: String,
    key: Option<&'a str>,
    concurrency: Option<&'static str>,
    compaction: bool,
    idempotency_key: Option<&'a str>,
    headers: Option<serde_json::Value>,
    deliver_after: Option<f64>,
}

impl<'a> ProduceArgs<'a> {
    fn new<T: Serialize>(stream: &'a str, message: &T, options: &'a ProduceOptions) -> Result<Self> {
        Ok(ProduceArgs {
            stream,
            payload: serde_json::to_string(message)?,
            key: options.message_key.as_deref(),
            concurrency: options.concurrency.map(Concurrency::as_str),
            compaction: options.compaction,
            idempotency_key: options.idempotency_key.as_deref(),
            headers: crate::trace_context::outgoing(options.headers.as_ref()),
            deliver_after: options.deliver_after.map(|d| d.as_secs_f64()),
        })
    }

    fn params(&self) -> [&(dyn tokio_postgres::types::ToSql + Sync); 8] {
        [
            &self.stream,
            &self.payload,
            &self.key,
            &self.concurrency,
            &self.compaction,
            &self.idempotency_key,
            &self.headers,
            &self.deliver_after,
        ]
    }
}

fn produced(row: &tokio_postgres::Row) -> Produced {
    match row.get::<_, Option<i64>>(0) {
        Some(id) => {
            tracing::Span::current().record("messaging.message.id", id.to_string());
            Produced::Message(id)
        }
        None => Produced::Duplicate,
    }
}

type Encoded<'a> = (Vec<String>, Vec<Option<&'a str>>);

fn encode<'a, T: Serialize + 'a>(messages: impl IntoIterator<Item = (&'a T, Option<&'a str>)>) -> Result<Encoded<'a>> {
    let mut payloads = Vec::new();
    let mut keys = Vec::new();
    for (message, key) in messages {
        payloads.push(serde_json::to_string(message)?);
        keys.push(key);
    }
    Ok((payloads, keys))
}
