//! Wake-ups: a dedicated connection LISTENs on the stream's channel. The extension NOTIFYs it
//! when a produce commits (once per transaction) and when a resolution wakes a waiting message,
//! so an idle consumer claims within milliseconds instead of at its next poll. Polling remains
//! the fallback while this connection is down.

use std::sync::Arc;

use futures_util::StreamExt;
use tokio::sync::Notify;
use tokio_postgres::tls::MakeTlsConnect;
use tokio_postgres::{AsyncMessage, NoTls, Socket};
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::backoff::Backoff;
use crate::tls::Tls;

/// How often a LISTEN connection that keeps failing is logged as a warning.
const WARN_EVERY: std::time::Duration = std::time::Duration::from_secs(60);

pub(crate) fn spawn(
    config: tokio_postgres::Config,
    tls: Tls,
    channel: String,
    wake: Arc<Notify>,
    stop: CancellationToken,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut backoff = Backoff::new();
        let mut warned: Option<tokio::time::Instant> = None;
        while !stop.is_cancelled() {
            let listened = match &tls {
                Tls::Off => listen(&config, NoTls, &channel, &wake, &stop).await,
                Tls::On(rustls) => listen(&config, rustls.clone(), &channel, &wake, &stop).await,
            };
            match listened {
                Ok(()) => return,
                Err(e) => {
                    // Consumers poll meanwhile: said once a minute at most, not at every retry.
                    if warned.is_none_or(|at| at.elapsed() >= WARN_EVERY) {
                        warn!(error = %e, "sqlstreams: the LISTEN connection failed; consumers poll until it is back");
                        warned = Some(tokio::time::Instant::now());
                    } else {
                        debug!(error = %e, "sqlstreams: listener reconnecting");
                    }
                    // Whatever happened while disconnected, look once.
                    wake.notify_one();
                    tokio::select! {
                        _ = tokio::time::sleep(backoff.next()) => {}
                        _ = stop.cancelled() => return,
                    }
                }
            }
        }
    })
}

/// Listens until stopped (`Ok`) or the connection fails (`Err`, and the caller reconnects).
async fn listen<T>(
    config: &tokio_postgres::Config,
    tls: T,
    channel: &str,
    wake: &Notify,
    stop: &CancellationToken,
) -> Result<(), String>
where
    T: MakeTlsConnect<Socket>,
    T::Stream: Send + 'static,
{
    let (client, mut connection) = config.connect(tls).await.map_err(|e| e.to_string())?;
    let mut messages = futures_util::stream::poll_fn(move |cx| connection.poll_message(cx));
    let statement = format!("LISTEN \"{channel}\"");
    let listen = client.batch_execute(&statement);
    tokio::pin!(listen);
    // The connection must be polled while LISTEN runs.
    loop {
        tokio::select! {
            done = &mut listen => { done.map_err(|e| e.to_string())?; break; }
            message = messages.next() => match message {
                Some(Ok(_)) => {}
                Some(Err(e)) => return Err(e.to_string()),
                None => return Err("connection closed".into()),
            },
        }
    }
    wake.notify_one();
    loop {
        tokio::select! {
            message = messages.next() => match message {
                Some(Ok(AsyncMessage::Notification(_))) => wake.notify_one(),
                Some(Ok(_)) => {}
                Some(Err(e)) => return Err(e.to_string()),
                None => return Err("connection closed".into()),
            },
            _ = stop.cancelled() => return Ok(()),
        }
    }
}
