//! `Stream<T>`: a typed stream, and where producers and consumer groups come from.

use std::marker::PhantomData;
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::consumer::ConsumerGroup;
use crate::error::{Error, Result};
use crate::pool::Pool;
use crate::producer::Producer;
use crate::sql;

/// Settings of a stream, used when it is created.
#[derive(Clone, Debug)]
pub struct StreamConfig {
    /// Message ids per partition of the stream's log (default 1,000,000).
    pub partition_size: i64,
    /// How long an idempotency key suppresses a repeated produce (default one day).
    pub idempotency_ttl: Duration,
}

impl Default for StreamConfig {
    fn default() -> Self {
        StreamConfig { partition_size: 1_000_000, idempotency_ttl: Duration::from_secs(86_400) }
    }
}

/// A stream whose messages are `T`, serialized as JSON.
pub struct Stream<T> {
    pub(crate) pool: Pool,
    pub(crate) name: String,
    _messages: PhantomData<fn() -> T>,
}

impl<T> Clone for Stream<T> {
    fn clone(&self) -> Self {
        Stream { pool: self.pool.clone(), name: self.name.clone(), _messages: PhantomData }
    }
}

impl<T> std::fmt::Debug for Stream<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stream").field("name", &self.name).finish()
    }
}

impl<T> Stream<T>
where
    T: Serialize + DeserializeOwned + Send + Sync + 'static,
{
    pub(crate) fn new(pool: Pool, name: String) -> Self {
        Stream { pool, name, _messages: PhantomData }
    }

    /// The stream's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Creates the stream if it does not exist (idempotent); returns its id.
    pub async fn register(&self) -> Result<i64> {
        self.register_with(StreamConfig::default()).await
    }

    /// Creates the stream with `config` if it does not exist; returns its id.
    pub async fn register_with(&self, config: StreamConfig) -> Result<i64> {
        let conn = self.pool.conn().await?;
        let row = conn
            .query_one(sql::CREATE_STREAM, &[&self.name, &config.partition_size, &config.idempotency_ttl.as_secs_f64()])
            .await?;
        Ok(row.get(0))
    }

    /// The stream's id (its tables are named by it), or `UnknownObject`.
    pub async fn id(&self) -> Result<i64> {
        self.column(sql::STREAM_ID).await
    }

    /// The channel its consumers LISTEN on, as the extension names it.
    pub(crate) async fn channel(&self) -> Result<String> {
        self.column(sql::STREAM_CHANNEL).await
    }

    async fn column<C: for<'a> tokio_postgres::types::FromSql<'a>>(&self, query: &str) -> Result<C> {
        let conn = self.pool.conn().await?;
        match conn.query_opt(query, &[&self.name]).await? {
            Some(row) => Ok(row.get(0)),
            None => Err(Error::UnknownObject {
                message: format!("stream \"{}\" does not exist", self.name),
                hint: Some("Register it first with Stream::register.".into()),
            }),
        }
    }

    /// A producer of `T` messages on this stream.
    pub fn producer(&self) -> Producer<T> {
        Producer::new(self.clone())
    }

    /// The consumer group `name` of this stream; [`ConsumerGroup::register`] creates it.
    pub fn consumer(&self, name: impl Into<String>) -> ConsumerGroup<T> {
        ConsumerGroup::new(self.clone(), name.into())
    }
}
