//! `Client`: a connection pool and the entry point to typed streams.

use std::path::PathBuf;

use deadpool_postgres::Pool as DeadPool;
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::error::Result;
use crate::pool::Pool;
use crate::stream::Stream;

/// How a [`Client`] connects.
#[derive(Clone, Debug)]
pub struct ClientOptions {
    /// Connections in the pool (default 16). Every consumer uses one while it claims or writes
    /// outcomes, and the LISTEN connection of each runs outside the pool.
    pub pool_size: usize,
    /// How long a call waits for a free connection before it fails (default 30 s): with more
    /// busy consumers than connections, someone logs it instead of everyone waiting silently.
    pub pool_wait_timeout: std::time::Duration,
    /// A PEM file of certificate authorities to trust besides the system's, for servers whose
    /// certificate they sign (a self-signed one, say). Default: `PGSSLROOTCERT`, as libpq.
    /// Used only when the connection string asks for TLS (`sslmode=require`).
    pub ssl_root_cert: Option<PathBuf>,
    /// Where each consumer's LISTEN connection goes, as a libpq-style connection string, when
    /// it cannot go where the pool's do: behind a pooler in transaction mode (pgbouncer's),
    /// `LISTEN` hears nothing, and consumers find their work only at their next poll. Give the
    /// database's own server here (or a session-mode pool), e.g.
    /// `postgres://db.internal:5432`: the user, password, database and application name it
    /// leaves out are the pool's, whatever gave them (the URL, or libpq's environment with
    /// [`Client::connect_env`]). Nothing else is taken from the environment for it (`PGPORT`
    /// names the pooler's port, as a rule), and its TLS is its own: its `sslmode`, and
    /// `ssl_root_cert`, which must then vouch for that server too. Default: the pool's
    /// connection. A LISTEN connection that fails is logged as a warning (once a minute at most)
    /// and made again; meanwhile consumers poll.
    pub listen_url: Option<String>,
}

impl Default for ClientOptions {
    fn default() -> Self {
        ClientOptions {
            pool_size: 16,
            pool_wait_timeout: std::time::Duration::from_secs(30),
            ssl_root_cert: std::env::var_os("PGSSLROOTCERT").map(PathBuf::from),
            listen_url: None,
        }
    }
}

/// A handle to a database with the sqlstreams extension. Cheap to clone.
#[derive(Clone)]
pub struct Client {
    pool: Pool,
}

impl Client {
    /// Connects with a pool of up to 16 connections. `url` is a libpq-style connection string,
    /// e.g. `postgres://user@localhost:5432/app` (`sslmode=require` for TLS, see
    /// [`ClientOptions`]). Connections are made lazily.
    pub fn connect(url: &str) -> Result<Client> {
        Client::connect_with(url, ClientOptions::default())
    }

    /// Like [`Client::connect`] with a pool of `size` connections.
    pub fn with_pool_size(url: &str, size: usize) -> Result<Client> {
        Client::connect_with(url, ClientOptions { pool_size: size, ..ClientOptions::default() })
    }

    /// Like [`Client::connect`] with explicit options.
    pub fn connect_with(url: &str, options: ClientOptions) -> Result<Client> {
        Client::from_config(crate::pool::parse(url, "connection string")?, &options)
    }

    /// Like [`Client::connect_with`], completing `url` (or, with `None`, making the whole
    /// connection) from libpq's environment as `psql` does: `PGHOST`, `PGPORT`, `PGUSER`,
    /// `PGDATABASE`, `PGPASSWORD`, the password file (`PGPASSFILE` or `~/.pgpass`), `PGSSLMODE`,
    /// `PGAPPNAME`, `PGOPTIONS`, `PGCONNECT_TIMEOUT`, `PGTARGETSESSIONATTRS`. What `url` sets wins.
    pub fn connect_env(url: Option<&str>, options: ClientOptions) -> Result<Client> {
        Client::from_config(crate::conninfo::config_from_env(url)?, &options)
    }

    fn from_config(config: tokio_postgres::Config, options: &ClientOptions) -> Result<Client> {
        let listen = match options.listen_url.as_deref() {
            Some(url) => Some(crate::pool::listen_config(crate::pool::parse(url, "listen_url")?, &config)),
            None => None,
        };
        let root_cert = options.ssl_root_cert.as_deref();
        Ok(Client { pool: Pool::from_config(config, listen, options.pool_size, options.pool_wait_timeout, root_cert)? })
    }

    /// A typed handle to the stream called `name`. Nothing is checked until it is used; call
    /// [`Stream::register`] to create it.
    pub fn stream<T>(&self, name: impl Into<String>) -> Stream<T>
    where
        T: Serialize + DeserializeOwned + Send + Sync + 'static,
    {
        Stream::new(self.pool.clone(), name.into())
    }

    /// Checks now that the database has the extension at
    /// [`MIN_EXTENSION_VERSION`](crate::MIN_EXTENSION_VERSION) or later, as the client's own
    /// calls do at their first connection: [`Error::Extension`](crate::Error::Extension)
    /// otherwise.
    pub async fn check_extension(&self) -> Result<()> {
        self.pool.conn().await.map(drop)
    }

    /// Typed calls for every operation and inspection function of the extension (the rights
    /// they need are the SQL functions': most are an admin's).
    pub fn admin(&self) -> crate::Admin {
        crate::Admin::new(self.pool.clone())
    }

    /// The underlying pool, for your own queries (and transactions to produce in). Its
    /// connections are not checked for the extension's version until a client call (or
    /// [`Client::check_extension`]) has checked one.
    pub fn pool(&self) -> &DeadPool {
        self.pool.deadpool()
    }
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client").field("pool", &self.pool.deadpool().status()).finish()
    }
}
