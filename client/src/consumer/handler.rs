//! The two kinds of handler a consumer runs: plain ones, whose success the consumer acks, and
//! transactional ones, which run inside a transaction that the ack commits with.

use std::future::Future;
use std::ops::Deref;
use std::pin::Pin;
use std::sync::Arc;

use super::delivery::{Delivery, HandlerError};

pub(crate) type HandlerFuture = Pin<Box<dyn Future<Output = Result<(), HandlerError>> + Send>>;

/// What the consumer loop calls.
pub(crate) trait Handle<T>: Send + Sync + 'static {
    /// Whether each call gets an open transaction whose commit records the ack.
    const TRANSACTIONAL: bool;

    fn call(&self, delivery: Delivery<T>, tx: Option<Tx>) -> HandlerFuture;
}

/// A plain handler: `Fn(Delivery<T>) -> impl Future<Output = Result<(), HandlerError>>`.
pub(crate) struct Plain<H>(pub H);

impl<T, H, F> Handle<T> for Plain<H>
where
    T: Send + 'static,
    H: Fn(Delivery<T>) -> F + Send + Sync + 'static,
    F: Future<Output = Result<(), HandlerError>> + Send + 'static,
{
    const TRANSACTIONAL: bool = false;

    fn call(&self, delivery: Delivery<T>, _tx: Option<Tx>) -> HandlerFuture {
        Box::pin((self.0)(delivery))
    }
}

/// A transactional handler: `Fn(Delivery<T>, Tx) -> impl Future<...>`.
pub(crate) struct InTransaction<H>(pub H);

impl<T, H, F> Handle<T> for InTransaction<H>
where
    T: Send + 'static,
    H: Fn(Delivery<T>, Tx) -> F + Send + Sync + 'static,
    F: Future<Output = Result<(), HandlerError>> + Send + 'static,
{
    const TRANSACTIONAL: bool = true;

    fn call(&self, delivery: Delivery<T>, tx: Option<Tx>) -> HandlerFuture {
        Box::pin((self.0)(delivery, tx.expect("a transactional handler is always given a transaction")))
    }
}

/// The open transaction a transactional handler writes in. It derefs to a
/// `tokio_postgres::Client` whose statements run inside that transaction: the consumer commits
/// it together with the message's ack when the handler succeeds, and rolls it back otherwise
/// (also when the ack finds the lease lost: another consumer runs the message again). Do not
/// commit or roll back yourself.
#[derive(Clone)]
pub struct Tx {
    pub(crate) conn: Arc<deadpool_postgres::Object>,
}

impl Deref for Tx {
    type Target = tokio_postgres::Client;

    fn deref(&self) -> &Self::Target {
        &self.conn
    }
}

impl std::fmt::Debug for Tx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Tx")
    }
}
