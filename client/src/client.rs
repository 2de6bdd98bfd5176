//! `Client`: a connection pool and the entry point to typed streams.

use deadpool_postgres::Pool as DeadPool;
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::error::Result;
use crate::pool::Pool;
use crate::stream::Stream;

/// A handle to a database with the sqlstreams extension. Cheap to clone.
#[derive(Clone)]
pub struct Client {
    pool: Pool,
}

impl Client {
    /// Connects with a pool of up to 16 connections. `url` is a libpq-style connection string,
    /// e.g. `postgres://user@localhost:5432/app`. Connections are made lazily.
    pub fn connect(url: &str) -> Result<Client> {
        Client::with_pool_size(url, 16)
    }

    /// Like [`Client::connect`] with a pool of `size` connections.
    pub fn with_pool_size(url: &str, size: usize) -> Result<Client> {
        Ok(Client { pool: Pool::new(url, size)? })
    }

    /// A typed handle to the stream called `name`. Nothing is checked until it is used; call
    /// [`Stream::register`] to create it.
    pub fn stream<T>(&self, name: impl Into<String>) -> Stream<T>
    where
        T: Serialize + DeserializeOwned + Send + Sync + 'static,
    {
        Stream::new(self.pool.clone(), name.into())
    }

    /// The underlying pool, for your own queries (and transactions to produce in).
    pub fn pool(&self) -> &DeadPool {
        self.pool.deadpool()
    }
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client").field("pool", &self.pool.deadpool().status()).finish()
    }
}
