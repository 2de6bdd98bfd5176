//! What a consumer counts: counters a user can read while it runs ([`Metrics`]), and the same
//! events through the `metrics` facade, for whatever recorder the application installed
//! (Prometheus, OpenTelemetry, ...):
//! - `sqlstreams_deliveries_total{stream, group, outcome}`: claimed, succeeded, failed, dead,
//!   delayed, deferred, released, lease_lost, timed_out, panicked;
//! - `sqlstreams_handler_seconds{stream, group}`: each handler run;
//! - `sqlstreams_claim_seconds{stream, group}`: each claim's round trip;
//! - `sqlstreams_lag_messages{stream, group}`: messages produced and not yet resolved by the
//!   group (`group_status.lag`), read every `lag_interval`;
//! - `sqlstreams_oldest_unresolved_seconds{stream, group}`: the age of the oldest of them (0
//!   when there is none), read with it.
//!
//! The facade's handles are made once, when the consumer registers: install the recorder
//! before that (as the `metrics` crate asks of every library), and no delivery pays for
//! building its labels again.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// An event a consumer counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Event {
    Claimed,
    Succeeded,
    Failed,
    Dead,
    Delayed,
    Deferred,
    Released,
    LeaseLost,
    TimedOut,
    Panicked,
}

impl Event {
    fn label(self) -> &'static str {
        match self {
            Event::Claimed => "claimed",
            Event::Succeeded => "succeeded",
            Event::Failed => "failed",
            Event::Dead => "dead",
            Event::Delayed => "delayed",
            Event::Deferred => "deferred",
            Event::Released => "released",
            Event::LeaseLost => "lease_lost",
            Event::TimedOut => "timed_out",
            Event::Panicked => "panicked",
        }
    }
}

/// The facade's handles, one per event and timing.
struct Handles {
    deliveries: [metrics::Counter; EVENTS.len()],
    handler: metrics::Histogram,
    claim: metrics::Histogram,
    lag: metrics::Gauge,
    oldest: metrics::Gauge,
}

const EVENTS: [Event; 10] = [
    Event::Claimed,
    Event::Succeeded,
    Event::Failed,
    Event::Dead,
    Event::Delayed,
    Event::Deferred,
    Event::Released,
    Event::LeaseLost,
    Event::TimedOut,
    Event::Panicked,
];

impl std::fmt::Debug for Handles {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Handles")
    }
}

#[derive(Debug)]
pub(crate) struct Counters {
    handles: Handles,
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
    pub fn new(stream: &str, group: &str) -> Counters {
        let labels = [("stream", stream.to_string()), ("group", group.to_string())];
        let handles = Handles {
            deliveries: EVENTS.map(|event| {
                let mut labels = labels.to_vec();
                labels.push(("outcome", event.label().to_string()));
                metrics::counter!("sqlstreams_deliveries_total", &labels)
            }),
            handler: metrics::histogram!("sqlstreams_handler_seconds", &labels),
            claim: metrics::histogram!("sqlstreams_claim_seconds", &labels),
            lag: metrics::gauge!("sqlstreams_lag_messages", &labels),
            oldest: metrics::gauge!("sqlstreams_oldest_unresolved_seconds", &labels),
        };
        Counters {
            handles,
            claimed: AtomicU64::default(),
            succeeded: AtomicU64::default(),
            failed: AtomicU64::default(),
            dead: AtomicU64::default(),
            delayed: AtomicU64::default(),
            deferred: AtomicU64::default(),
            released: AtomicU64::default(),
            lease_lost: AtomicU64::default(),
            timed_out: AtomicU64::default(),
            panicked: AtomicU64::default(),
        }
    }

    pub fn add(&self, event: Event, n: u64) {
        let counter = match event {
            Event::Claimed => &self.claimed,
            Event::Succeeded => &self.succeeded,
            Event::Failed => &self.failed,
            Event::Dead => &self.dead,
            Event::Delayed => &self.delayed,
            Event::Deferred => &self.deferred,
            Event::Released => &self.released,
            Event::LeaseLost => &self.lease_lost,
            Event::TimedOut => &self.timed_out,
            Event::Panicked => &self.panicked,
        };
        counter.fetch_add(n, Ordering::Relaxed);
        self.handles.deliveries[event as usize].increment(n);
    }

    /// A handler ran for `took`.
    pub fn handler_ran(&self, took: Duration) {
        self.handles.handler.record(took.as_secs_f64());
    }

    /// A claim's round trip took `took`.
    pub fn claimed_in(&self, took: Duration) {
        self.handles.claim.record(took.as_secs_f64());
    }

    /// The group's lag as `group_status` read it.
    pub fn lag(&self, messages: i64, oldest_seconds: f64) {
        self.handles.lag.set(messages as f64);
        self.handles.oldest.set(oldest_seconds);
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
    /// Deliveries given back unstarted (at shutdown, or once their claim's lease ran out here
    /// before a renewal was answered).
    pub released: u64,
    /// Deliveries whose lease was lost before their outcome was recorded.
    pub lease_lost: u64,
    /// Handlers stopped at their deadline.
    pub timed_out: u64,
    /// Handlers that panicked.
    pub panicked: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_event_indexes_its_own_handle() {
        for (i, event) in EVENTS.iter().enumerate() {
            assert_eq!(*event as usize, i, "{event:?}");
        }
    }
}
