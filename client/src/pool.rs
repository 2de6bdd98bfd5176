//! The connection pool every part of the client draws from, and how to open a connection
//! outside it (a consumer's LISTEN connection).

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use deadpool_postgres::{Manager, ManagerConfig, RecyclingMethod};
use tokio_postgres::NoTls;

use crate::error::{Error, Result};
use crate::tls::Tls;

/// A pool of connections to one database. Cheap to clone.
#[derive(Clone)]
pub(crate) struct Pool {
    inner: Arc<Inner>,
}

struct Inner {
    pool: deadpool_postgres::Pool,
    /// For consumers' LISTEN connections, outside the pool (`ClientOptions::listen_url`), and
    /// how they negotiate TLS: the pool's unless given.
    listen: (tokio_postgres::Config, Tls),
    /// Set once a connection found an extension version this client works with.
    extension_fits: AtomicBool,
}

/// A libpq-style connection string's settings (`what` names it in an error).
pub(crate) fn parse(url: &str, what: &str) -> Result<tokio_postgres::Config> {
    url.parse().map_err(|e| Error::Config(format!("{what}: {e}")))
}

/// `listen` (`ClientOptions::listen_url`) with the user, password, database and application
/// name it leaves out taken from the pool's `config`: the same session, on another server.
pub(crate) fn listen_config(
    mut listen: tokio_postgres::Config,
    config: &tokio_postgres::Config,
) -> tokio_postgres::Config {
    if let (None, Some(user)) = (listen.get_user(), config.get_user()) {
        listen.user(user);
    }
    if let (None, Some(password)) = (listen.get_password(), config.get_password()) {
        listen.password(password);
    }
    if let (None, Some(dbname)) = (listen.get_dbname(), config.get_dbname()) {
        listen.dbname(dbname);
    }
    if let (None, Some(name)) = (listen.get_application_name(), config.get_application_name()) {
        listen.application_name(name);
    }
    listen
}

impl Pool {
    /// A pool of `size` connections made with `config`; consumers LISTEN on a connection made
    /// with `listen`, or with `config` without it.
    pub fn from_config(
        config: tokio_postgres::Config,
        listen: Option<tokio_postgres::Config>,
        size: usize,
        wait: std::time::Duration,
        root_cert: Option<&Path>,
    ) -> Result<Pool> {
        let tls = Tls::for_config(&config, root_cert)?;
        let listen = match listen {
            Some(listen) => {
                let tls = Tls::for_config(&listen, root_cert)?;
                (listen, tls)
            }
            None => (config.clone(), tls.clone()),
        };
        let recycling = ManagerConfig { recycling_method: RecyclingMethod::Fast };
        let manager = match &tls {
            Tls::Off => Manager::from_config(config.clone(), NoTls, recycling),
            Tls::On(rustls) => Manager::from_config(config.clone(), rustls.clone(), recycling),
        };
        let pool = deadpool_postgres::Pool::builder(manager)
            .max_size(size)
            // A caller waiting longer than this for a connection gets an error (and a consumer
            // logs it and tries again) instead of waiting silently for ever.
            .wait_timeout(Some(wait))
            // The connection used last goes out first: a consumer's claims keep landing on the
            // same backend, whose caches (plans, catalog, CPU caches) are warm for them. First
            // in, first out would rotate every claim through every pooled backend.
            .queue_mode(deadpool_postgres::QueueMode::Lifo)
            .runtime(deadpool_postgres::Runtime::Tokio1)
            .build()
            .map_err(|e| Error::Config(e.to_string()))?;
        Ok(Pool { inner: Arc::new(Inner { pool, listen, extension_fits: AtomicBool::new(false) }) })
    }

    /// A pooled connection. The first one a pool hands out checks the extension's version
    /// (until one passes: a refused version is checked again, so an `ALTER EXTENSION ...
    /// UPDATE` is seen without a restart).
    pub async fn conn(&self) -> Result<deadpool_postgres::Object> {
        let conn = self.inner.pool.get().await?;
        if !self.inner.extension_fits.load(Ordering::Relaxed) {
            crate::extension::check(&conn).await?;
            self.inner.extension_fits.store(true, Ordering::Relaxed);
        }
        Ok(conn)
    }

    /// Gives `conn` back, or drops it out of the pool when `error` ended its session: the pool
    /// checks what it hands out only for a closed socket, which a session the server has just
    /// ended (57P01) may not show yet, and the next caller would meet the same end.
    pub fn give_back(conn: deadpool_postgres::Object, error: &Error) {
        if error.ends_session() {
            drop(deadpool_postgres::Object::take(conn));
        }
    }

    /// The deadpool pool itself.
    pub fn deadpool(&self) -> &deadpool_postgres::Pool {
        &self.inner.pool
    }

    /// Settings for a consumer's LISTEN connection, and how it negotiates TLS.
    pub fn listen(&self) -> &(tokio_postgres::Config, Tls) {
        &self.inner.listen
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_listen_url_takes_what_it_leaves_out_from_the_pools_connection() {
        let pool = parse("postgres://app:secret@bouncer:6432/orders?application_name=billing", "pool").unwrap();
        let listen = listen_config(parse("postgres://db.internal:5432", "listen_url").unwrap(), &pool);
        assert_eq!(listen.get_hosts(), &[tokio_postgres::config::Host::Tcp("db.internal".into())]);
        assert_eq!(listen.get_ports(), &[5432]);
        assert_eq!(listen.get_user(), Some("app"));
        assert_eq!(listen.get_password(), Some(&b"secret"[..]));
        assert_eq!(listen.get_dbname(), Some("orders"));
        assert_eq!(listen.get_application_name(), Some("billing"));
        // What it gives is its own.
        let own = parse("postgres://listener@db.internal/other?application_name=wake", "listen_url").unwrap();
        let listen = listen_config(own, &pool);
        assert_eq!((listen.get_user(), listen.get_dbname()), (Some("listener"), Some("other")));
        assert_eq!(listen.get_application_name(), Some("wake"));
    }

    #[test]
    fn a_listen_url_that_does_not_parse_is_named() {
        let err = parse("postgres://db:notaport", "listen_url").unwrap_err();
        assert!(err.to_string().contains("listen_url"), "{err}");
    }
}
