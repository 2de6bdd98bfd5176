//! The leases a consumer holds: one per claim, kept alive by a heartbeat while any of its rows
//! is unfinished, and checked before a handler starts on a task. (Rows run inline right after
//! their claim start only before `claimed_at + lease - handler_timeout`, which the lease
//! covers without a check.)

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;
use tracing::warn;
use uuid::Uuid;

use crate::pool::Pool;
use crate::sql;

struct Held {
    /// Rows of the claim not finished yet.
    unfinished: usize,
    /// When the lease runs out, as far as this consumer knows.
    expires: Instant,
    lost: bool,
}

pub(crate) struct LeaseBook {
    pool: Pool,
    stream: String,
    group: String,
    lease: Duration,
    held: Mutex<HashMap<Uuid, Held>>,
}

impl LeaseBook {
    pub fn new(pool: Pool, stream: String, group: String, lease: Duration) -> Self {
        LeaseBook { pool, stream, group, lease, held: Mutex::new(HashMap::new()) }
    }

    /// Starts tracking a claim of `rows` rows taken at `claimed_at`.
    pub fn track(&self, token: Uuid, rows: usize, claimed_at: Instant) {
        let held = Held { unfinished: rows, expires: claimed_at + self.lease, lost: false };
        self.held.lock().unwrap().insert(token, held);
    }

    /// One row of the claim finished (or will not run here).
    pub fn finished(&self, token: Uuid, rows: usize) {
        let mut held = self.held.lock().unwrap();
        if let Some(h) = held.get_mut(&token) {
            h.unfinished = h.unfinished.saturating_sub(rows);
            if h.unfinished == 0 {
                held.remove(&token);
            }
        }
    }

    /// True when the lease covers `needed` from now, extending it first if it does not. False
    /// when the lease is lost: the row must not start.
    pub async fn covers(&self, token: Uuid, needed: Duration) -> bool {
        let expires = match self.held.lock().unwrap().get(&token) {
            Some(h) if h.lost => return false,
            Some(h) => h.expires,
            None => return false,
        };
        if expires.saturating_duration_since(Instant::now()) >= needed {
            return true;
        }
        self.extend(token).await && needed <= self.lease
    }

    /// Extends every lease with unfinished rows; run it every third of the lease.
    pub async fn heartbeat(&self) {
        let tokens: Vec<Uuid> = self.held.lock().unwrap().iter().filter(|(_, h)| !h.lost).map(|(t, _)| *t).collect();
        for token in tokens {
            self.extend(token).await;
        }
    }

    async fn extend(&self, token: Uuid) -> bool {
        let asked_at = Instant::now();
        let result = match self.pool.conn().await {
            Ok(conn) => match conn.prepare_cached(sql::EXTEND_LEASE).await {
                Err(e) => Err(e.into()),
                Ok(extend) => conn
                    .query_one(&extend, &[&self.stream, &self.group, &token, &self.lease.as_secs_f64()])
                    .await
                    .map(|r| r.get::<_, bool>(0))
                    .map_err(crate::Error::from),
            },
            Err(e) => Err(e),
        };
        let mut held = self.held.lock().unwrap();
        let Some(h) = held.get_mut(&token) else { return false };
        match result {
            Ok(true) => {
                h.expires = asked_at + self.lease;
                true
            }
            Ok(false) => {
                warn!(%token, "sqlstreams: lease lost; its unstarted rows will not run here");
                h.lost = true;
                false
            }
            // Unknown (a lost connection): keep the old expiry and let the next beat try again.
            Err(_) => h.expires.saturating_duration_since(Instant::now()) > Duration::ZERO,
        }
    }
}
