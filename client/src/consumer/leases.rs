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
    /// A renewal was answered only after the lease had run out here. `extend_lease` renews what
    /// no other consumer took over meanwhile, which may be less than the claim (a claim that
    /// takes a lane takes all of its expired work over, also what it does not hand out), so no
    /// row of the claim
    /// starts here any more (docs/sql-api.md, "The consumer loop", step 4). An answer that came
    /// before proves the renewal ran before the server's expiry, which is later than the one
    /// here: both count from times read before the request was sent.
    lapsed: bool,
}

impl Held {
    /// Records a renewal sent at `asked_at` and answered with true at `answered_at`; returns
    /// whether the claim's rows may still start.
    fn renewed(&mut self, asked_at: Instant, answered_at: Instant, lease: Duration) -> bool {
        self.lapsed |= self.expires <= answered_at;
        self.expires = asked_at + lease;
        !self.lapsed
    }

    /// Whether the claim's rows may start with `needed` of lease left from now.
    fn covers(&self, needed: Duration) -> bool {
        !self.lost && !self.lapsed && self.expires.saturating_duration_since(Instant::now()) >= needed
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
    /// when the lease is lost, lapsed, or could not be extended to cover `needed`: the row must
    /// not start.
    pub async fn covers(&self, token: Uuid, needed: Duration) -> bool {
        match self.held.lock().unwrap().get(&token) {
            Some(h) if h.lost || h.lapsed => return false,
            Some(h) if h.covers(needed) => return true,
            Some(_) => {}
            None => return false,
        }
        self.extend(token).await;
        self.held.lock().unwrap().get(&token).is_some_and(|h| h.covers(needed))
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

    /// Asks the server to extend the lease of `token`, and records the answer (`Held`).
    async fn extend(&self, token: Uuid) {
        let mut asked_at = Instant::now();
        let result = match self.pool.conn().await {
            Ok(conn) => match conn.prepare_cached(sql::EXTEND_LEASE).await {
                Err(e) => Err(e.into()),
                Ok(extend) => {
                    asked_at = Instant::now();
                    conn.query_one(&extend, &[&self.stream, &self.group, &token, &self.lease.as_secs_f64()])
                        .await
                        .map(|r| r.get::<_, bool>(0))
                        .map_err(crate::Error::from)
                }
            },
            Err(e) => Err(e),
        };
        let answered_at = Instant::now();
        let mut held = self.held.lock().unwrap();
        let Some(h) = held.get_mut(&token) else { return };
        match result {
            Ok(true) => {
                let went_on = !h.lapsed;
                if !h.renewed(asked_at, answered_at, self.lease) && went_on && h.unfinished > 0 {
                    warn!(%token, "sqlstreams: lease ran out before it was extended; no more of its rows start here");
                }
            }
            Ok(false) => {
                warn!(%token, "sqlstreams: lease lost; its unstarted rows will not run here");
                h.lost = true;
            }
            // Unknown (a lost connection): keep the old expiry and let the next beat try again.
            Err(_) => {}
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
        let secs = Duration::from_secs;
        let mut held = Held { unfinished: 3, expires: now + secs(5), lost: false, lapsed: false };
        assert!(held.renewed(now, now + secs(1), LEASE), "answered in time");
        assert_eq!(held.expires, now + LEASE, "counted from the asking");
        assert!(held.covers(secs(10)));
        // Asked before the lease ran out here, answered after: the server may have renewed
        // after its own expiry, once another claim took part of the claim over.
        assert!(!held.renewed(now + LEASE - secs(1), now + LEASE + secs(1), LEASE), "answered too late");
        assert!(held.lapsed);
        assert!(!held.covers(secs(1)), "no row starts");
        let later = now + LEASE + secs(2);
        assert!(!held.renewed(later, later, LEASE), "and for good");
        assert_eq!(held.expires, later + LEASE, "still kept alive for the rows running");
    }

    #[test]
    fn a_lease_that_cannot_cover_the_handler_starts_no_row() {
        let secs = Duration::from_secs;
        let held = Held { unfinished: 1, expires: Instant::now() + secs(1), lost: false, lapsed: false };
        assert!(!held.covers(secs(10)), "a second left for a ten-second handler");
        assert!(held.covers(Duration::ZERO));
    }
}
