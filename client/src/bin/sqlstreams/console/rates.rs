//! Rates over time: the console reads every group's position now and then, keeps the last
//! samples in memory, and draws what the group resolved and what was produced per second as a
//! small chart. Nothing is stored in the database; a restarted console starts a new chart.

use std::collections::{HashMap, VecDeque};
use std::time::Instant;

use maud::{html, Markup};

use super::view::Status;

/// Samples kept per group.
const KEEP: usize = 60;

#[derive(Clone, Copy)]
struct Sample {
    at: Instant,
    committed: i64,
    head: i64,
}

/// The samples of every group, by stream and group name.
#[derive(Default)]
pub struct Rates {
    samples: HashMap<(String, String), VecDeque<Sample>>,
}

impl Rates {
    /// Records one reading of every group; groups no longer shown are forgotten.
    pub fn record(&mut self, statuses: &[Status], at: Instant) {
        self.samples.retain(|(stream, group), _| statuses.iter().any(|s| &s.stream == stream && &s.group == group));
        for s in statuses {
            let samples = self.samples.entry((s.stream.clone(), s.group.clone())).or_default();
            if samples.len() == KEEP {
                samples.pop_front();
            }
            samples.push_back(Sample { at, committed: s.committed, head: s.head });
        }
    }

    /// Messages resolved (`committed` moving) and produced (`head` moving) per second between
    /// consecutive samples, oldest first. A seek back, or a redrive of an old dead letter, moves `committed` back: that counts as 0.
    pub fn per_second(&self, stream: &str, group: &str) -> (Vec<f64>, Vec<f64>) {
        let Some(samples) = self.samples.get(&(stream.to_string(), group.to_string())) else {
            return (vec![], vec![]);
        };
        let pairs = samples.iter().zip(samples.iter().skip(1));
        pairs
            .filter_map(|(a, b)| {
                let secs = b.at.duration_since(a.at).as_secs_f64();
                (secs > 0.0).then(|| {
                    let rate = |from: i64, to: i64| (to - from).max(0) as f64 / secs;
                    (rate(a.committed, b.committed), rate(a.head, b.head))
                })
            })
            .unzip()
    }
}

/// A chart of two series (resolved, produced) as an SVG of `W` by `H`, scaled to the highest
/// value of either; nothing to draw before two samples.
pub fn chart(resolved: &[f64], produced: &[f64]) -> Markup {
    const W: f64 = 180.0;
    const H: f64 = 32.0;
    let top = resolved.iter().chain(produced).copied().fold(0.0_f64, f64::max).max(1.0);
    let points = |values: &[f64]| -> String {
        let step = W / (KEEP - 2) as f64;
        let start = W - step * (values.len().saturating_sub(1)) as f64;
        values
            .iter()
            .enumerate()
            .map(|(i, v)| format!("{:.1},{:.1}", start + step * i as f64, H - 1.0 - (H - 2.0) * v / top))
            .collect::<Vec<_>>()
            .join(" ")
    };
    let now = resolved.last().copied();
    html! {
        svg.chart width=(W) height=(H) viewBox=(format!("0 0 {W} {H}")) role="img"
            aria-label="messages resolved and produced per second" {
            title { "resolved (solid) and produced (dashed) per second; highest " (format!("{top:.0}")) "/s" }
            @if produced.len() > 1 {
                polyline points=(points(produced)) fill="none" stroke="#999" stroke-width="1" stroke-dasharray="3 2" {}
            }
            @if resolved.len() > 1 {
                polyline points=(points(resolved)) fill="none" stroke="#2a6" stroke-width="1.5" {}
            }
        }
        span.rate { @match now { Some(r) => { (format!("{r:.0}")) "/s" } None => { "…" } } }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn status(committed: i64, head: i64) -> Status {
        Status {
            stream: "s".into(),
            group: "g".into(),
            paused: false,
            on_dead: "release".into(),
            concurrency_override: None,
            claimed: committed,
            committed,
            head,
            lag: head - committed,
            open_ranges: 0,
            ready: 0,
            inflight: 0,
            deferred: 0,
            dead: 0,
            oldest_age: None,
        }
    }

    #[test]
    fn rates_are_what_moved_per_second() {
        let mut rates = Rates::default();
        let t0 = Instant::now();
        rates.record(&[status(0, 100)], t0);
        rates.record(&[status(50, 200)], t0 + Duration::from_secs(2));
        rates.record(&[status(20, 200)], t0 + Duration::from_secs(3)); // a seek back
        assert_eq!(rates.per_second("s", "g"), (vec![25.0, 0.0], vec![50.0, 0.0]));
        rates.record(&[], t0 + Duration::from_secs(4));
        assert_eq!(rates.per_second("s", "g"), (vec![], vec![]), "a dropped group is forgotten");
    }

    #[test]
    fn only_the_last_samples_are_kept() {
        let mut rates = Rates::default();
        let t0 = Instant::now();
        for i in 0..(KEEP as u64 + 10) {
            rates.record(&[status(i as i64, i as i64)], t0 + Duration::from_secs(i));
        }
        assert_eq!(rates.per_second("s", "g").0.len(), KEEP - 1);
    }
}
