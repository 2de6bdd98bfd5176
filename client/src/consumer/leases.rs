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
    /// `extend_lease` answered that the token holds nothing any more.
    lost: bool,
    /// The lease ran out here before a renewal reached the server. `extend_lease` renews what no
    /// other consumer took over meanwhile, which may be less than the claim (a claim that takes
    /// part of an expired range over takes the rest over too), so no row of the claim starts
    /// here any more (docs/sql-api.md, "Writing a consumer", step 4).
    lapsed: bool,
}

impl Held {
    /// Records a renewal asked at `asked_at` that the server answered with true; returns whether
    /// the claim's rows may still start.
    fn renewed(&mut self, asked_at: Instant, lease: Duration) -> bool {
        self.lapsed |= self.expires <= asked_at;
        self.expires = asked_at + lease;
        !self.lapsed
    }
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
        let held = Held { unfinished: rows, expires: claimed_at + self.lease, lost: false, lapsed: false };
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
            Some(h) if h.lost || h.lapsed => return false,
            Some(h) => h.expires,
            None => return false,
        };
        if expires.saturating_duration_since(Instant::now()) >= needed {
            return true;
        }
        self.extend(token).await && needed <= self.lease
    }

    /// Whether the lease of `token` ran out here before a renewal reached the server (`Held`).
    pub fn lapsed(&self, token: Uuid) -> bool {
        self.held.lock().unwrap().get(&token).is_some_and(|h| h.lapsed)
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
                let went_on = !h.lapsed;
                let may_start = h.renewed(asked_at, self.lease);
                if went_on && !may_start {
                    warn!(%token, "sqlstreams: lease ran out before it was extended; its unstarted rows are given back");
                }
                may_start
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

#[cfg(test)]
mod tests {
    use super::*;

    const LEASE: Duration = Duration::from_secs(30);

    #[test]
    fn a_lease_renewed_after_it_ran_out_here_starts_no_more_rows() {
        let now = Instant::now();
        let mut held = Held { unfinished: 3, expires: now + Duration::from_secs(5), lost: false, lapsed: false };
        assert!(held.renewed(now, LEASE), "renewed in time");
        assert_eq!(held.expires, now + LEASE);
        let late = now + LEASE + Duration::from_secs(1);
        assert!(!held.renewed(late, LEASE), "renewed after it ran out");
        assert!(held.lapsed);
        assert!(!held.renewed(late + Duration::from_secs(1), LEASE), "and for good");
        assert_eq!(held.expires, late + Duration::from_secs(1) + LEASE, "still kept alive for rows running");
    }
}
