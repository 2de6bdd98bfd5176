//! Counters a user can read while a consumer runs.

use std::sync::atomic::{AtomicU64, Ordering};

#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub claimed: AtomicU64,
    pub succeeded: AtomicU64,
    pub failed: AtomicU64,
    pub dead: AtomicU64,
    pub delayed: AtomicU64,
    pub deferred: AtomicU64,
    pub released: AtomicU64,
    pub lease_lost: AtomicU64,
    pub timed_out: AtomicU64,
    pub panicked: AtomicU64,
}

impl Counters {
    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> Metrics {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        Metrics {
            claimed: get(&self.claimed),
            succeeded: get(&self.succeeded),
            failed: get(&self.failed),
            dead: get(&self.dead),
            delayed: get(&self.delayed),
            deferred: get(&self.deferred),
            released: get(&self.released),
            lease_lost: get(&self.lease_lost),
            timed_out: get(&self.timed_out),
            panicked: get(&self.panicked),
        }
    }
}

/// A consumer's counters since it started.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Metrics {
    /// Deliveries handed to this consumer by claims.
    pub claimed: u64,
    /// Handlers that succeeded (acked).
    pub succeeded: u64,
    /// Failures with a retry scheduled.
    pub failed: u64,
    /// Messages dead-lettered (permanent, budget spent, or undecodable).
    pub dead: u64,
    /// Handlers that asked for a delay.
    pub delayed: u64,
    /// Chained deliveries not started because an earlier one of their key did not resolve
    /// (the server recorded them deferred).
    pub deferred: u64,
    /// Deliveries given back unstarted (at shutdown).
    pub released: u64,
    /// Deliveries whose lease was lost before their outcome was recorded.
    pub lease_lost: u64,
    /// Handlers stopped at their deadline.
    pub timed_out: u64,
    /// Handlers that panicked.
    pub panicked: u64,
}
