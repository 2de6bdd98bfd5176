//! `Client`: a connection pool and the entry point to typed streams.

use std::sync::Arc;

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio_postgres::NoTls;

use crate::error::{Error, Result};
use crate::stream::Stream;

/// A handle to a database with the sqlstreams extension. Cheap to clone.
#[derive(Clone)]
pub struct Client {
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) pool: Pool,
    /// For connections outside the pool (a consumer's LISTEN connection).
    pub(crate) config: tokio_postgres::Config,
}

impl Client {
    /// Connects with a pool of up to 16 connections. `url` is a libpq-style connection string,
    /// e.g. `postgres://user@localhost:5432/app`. Connections are made lazily.
    pub fn connect(url: &str) -> Result<Client> {
        Client::with_pool_size(url, 16)
    }

    /// Like [`Client::connect`] with a pool of `size` connections.
    pub fn with_pool_size(url: &str, size: usize) -> Result<Client> {
        let config: tokio_postgres::Config =
            url.parse().map_err(|e| Error::Config(format!("connection string: {e}")))?;
        let manager =
            Manager::from_config(config.clone(), NoTls, ManagerConfig { recycling_method: RecyclingMethod::Fast });
        let pool = Pool::builder(manager).max_size(size).build().map_err(|e| Error::Config(e.to_string()))?;
        Ok(Client { inner: Arc::new(Inner { pool, config }) })
    }

    /// A typed handle to the stream called `name`. Nothing is checked until it is used; call
    /// [`Stream::register`] to create it.
    pub fn stream<T>(&self, name: impl Into<String>) -> Stream<T>
    where
        T: Serialize + DeserializeOwned + Send + Sync + 'static,
    {
        Stream::new(self.clone(), name.into())
    }

    /// The underlying pool, for your own queries (and transactions to produce in).
    pub fn pool(&self) -> &Pool {
        &self.inner.pool
    }

    pub(crate) async fn conn(&self) -> Result<deadpool_postgres::Object> {
        Ok(self.inner.pool.get().await?)
    }
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client").field("pool", &self.inner.pool.status()).finish()
    }
}
