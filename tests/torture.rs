//! Randomized torture: producers holding transactions open (some rolled back), competing
//! consumers with random batch sizes and ~20% handler failures, an ordered and an exclusive
//! group over ~20 keys on the same stream. Afterwards it checks, from a log of what every
//! handler did:
//! - nothing lost or invented: every committed message reached exactly one final outcome
//!   (success or dead) per group, and no rolled-back message was ever delivered;
//! - per key, no two deliveries overlapped (both groups);
//! - ordered: no message started before every earlier same-key message had succeeded or died;
//! - every claim result chained its same-key rows.
//!
//! Events are logged on the safe side of each server call: a handler's end and its "resolving"
//! mark are logged before the outcome call, so a correct server can never look wrong, while an
//! overlap or an early start shows up as an inverted order. Set SQLSTREAMS_TORTURE_SEED to replay
//! a run's random decisions.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use sqlstreams_tests::*;

const PRODUCERS: usize = 4;
const TRANSACTIONS_PER_PRODUCER: usize = 150;
const CONSUMERS_PER_GROUP: usize = 3;
const KEYS: usize = 20;
const FAILURE_RATE: f64 = 0.2;
/// Shorter than the 60 s lease: a lost wake-up (a row left parked until some lease runs out)
/// fails the test instead of only slowing it down.
const DEADLINE: Duration = Duration::from_secs(40);

#[derive(Clone, Debug)]
enum Event {
    Start {
        group: &'static str,
        id: i64,
        key: String,
    },
    End {
        group: &'static str,
        id: i64,
    },
    /// Logged before an outcome call; `terminal` is set once the call says the message resolved.
    Resolving {
        group: &'static str,
        id: i64,
        terminal: bool,
    },
}

#[derive(Default)]
struct Log {
    events: Mutex<Vec<Event>>,
}

impl Log {
    fn push(&self, event: Event) -> usize {
        let mut events = self.events.lock().unwrap();
        events.push(event);
        events.len() - 1
    }

    fn mark_terminal(&self, at: usize) {
        if let Event::Resolving { terminal, .. } = &mut self.events.lock().unwrap()[at] {
            *terminal = true;
        }
    }
}

fn seed() -> u64 {
    std::env::var("SQLSTREAMS_TORTURE_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(rand::random)
}

fn produce(s: &Stream, seed: u64, committed: Arc<Mutex<Vec<(i64, String)>>>, rolled_back: Arc<Mutex<Vec<i64>>>) {
    let mut c = connect();
    let mut rng = StdRng::seed_from_u64(seed);
    for _ in 0..TRANSACTIONS_PER_PRODUCER {
        let mut tx = c.transaction().unwrap();
        let mut mine = Vec::new();
        for _ in 0..rng.gen_range(1..=8) {
            let key = format!("key-{}", rng.gen_range(0..KEYS));
            let id = s.produce(&mut tx, json!({"key": key}), Some(&key));
            mine.push((id, key));
        }
        // Hold the transaction open a little, so others commit around it.
        if rng.gen_bool(0.3) {
            std::thread::sleep(Duration::from_millis(rng.gen_range(1..5)));
        }
        if rng.gen_bool(0.1) {
            tx.rollback().unwrap();
            rolled_back.lock().unwrap().extend(mine.iter().map(|(id, _)| *id));
        } else {
            tx.commit().unwrap();
            committed.lock().unwrap().extend(mine);
        }
    }
}

struct Consumer {
    group: Group,
    label: &'static str,
    log: Arc<Log>,
    done: Arc<AtomicBool>,
}

impl Consumer {
    fn run(&self, seed: u64) {
        let mut c = connect();
        let mut rng = StdRng::seed_from_u64(seed);
        while !self.done.load(Ordering::Relaxed) {
            let batch = self.group.try_claim(&mut c, rng.gen_range(1..=20), "60 seconds").unwrap();
            if batch.is_empty() {
                std::thread::sleep(Duration::from_millis(15)); // idle poll
                continue;
            }
            check_chains(&batch);
            let mut released: HashSet<i64> = HashSet::new();
            for d in &batch {
                if d.run_after.is_some_and(|p| !released.contains(&p)) {
                    continue; // its predecessor did not resolve: the server deferred it
                }
                let key = d.message_key.clone().expect("every message has a key");
                self.log.push(Event::Start { group: self.label, id: d.message_id, key });
                if rng.gen_bool(0.2) {
                    std::thread::sleep(Duration::from_micros(rng.gen_range(100..1500)));
                }
                self.log.push(Event::End { group: self.label, id: d.message_id });
                let at = self.log.push(Event::Resolving { group: self.label, id: d.message_id, terminal: false });
                let terminal = if rng.gen_bool(FAILURE_RATE) {
                    let status = self.group.fail(&mut c, d, "random failure", false, None);
                    assert!(status.is_some(), "lease of {} lost under a 60 s lease", d.message_id);
                    status.as_deref() == Some("dead")
                } else {
                    assert!(self.group.ack(&mut c, d), "lease of {} lost under a 60 s lease", d.message_id);
                    true
                };
                if terminal {
                    self.log.mark_terminal(at);
                    released.insert(d.message_id);
                }
            }
        }
    }
}

/// Same-key rows of one claim result form a chain: each names the previous one.
fn check_chains(batch: &[Delivery]) {
    let mut last: HashMap<&str, i64> = HashMap::new();
    for d in batch {
        let key = d.message_key.as_deref().unwrap();
        assert_eq!(d.run_after, last.get(key).copied(), "row {} of key {key} is not chained: {batch:?}", d.message_id);
        last.insert(key, d.message_id);
    }
}

#[test]
fn torture_ordered_and_exclusive_under_failures_and_open_transactions() {
    let seed = seed();
    eprintln!("torture seed: {seed} (set SQLSTREAMS_TORTURE_SEED={seed} to replay the random decisions)");
    let mut c = connect();
    let s = Stream::create(&mut c, "torture");
    let mut groups = Vec::new();
    for (label, policy) in [("ordered", "ordered"), ("exclusive", "exclusive")] {
        let id: i64 = c
            .query_one(
                "SELECT sqlstreams.create_group($1, $2, $3, max_retries => 3,
                        backoff_base => '5 milliseconds', backoff_cap => '20 milliseconds')",
                &[&s.name, &label, &policy],
            )
            .unwrap()
            .get(0);
        groups.push((label, Group { stream: s.clone(), name: label.to_string(), id }));
    }

    let committed = Arc::new(Mutex::new(Vec::new()));
    let rolled_back = Arc::new(Mutex::new(Vec::new()));
    let log = Arc::new(Log::default());
    let done = Arc::new(AtomicBool::new(false));
    let producers: Vec<_> = (0..PRODUCERS)
        .map(|i| {
            let (s, committed, rolled_back) = (s.clone(), committed.clone(), rolled_back.clone());
            std::thread::spawn(move || produce(&s, seed.wrapping_add(i as u64), committed, rolled_back))
        })
        .collect();
    let mut consumers = Vec::new();
    for (label, group) in &groups {
        for i in 0..CONSUMERS_PER_GROUP {
            let consumer = Consumer { group: group.clone(), label, log: log.clone(), done: done.clone() };
            let seed = seed.wrapping_add(1000 + consumers.len() as u64 + i as u64);
            consumers.push(std::thread::spawn(move || consumer.run(seed)));
        }
    }
    for p in producers {
        p.join().expect("producer");
    }

    // Wait (bounded) until both groups have resolved every committed message.
    let committed: Vec<(i64, String)> = committed.lock().unwrap().clone();
    let started = Instant::now();
    loop {
        let resolved = terminal_counts(&log);
        let complete =
            groups.iter().all(|(label, _)| committed.iter().all(|(id, _)| resolved.contains_key(&(*label, *id))));
        if complete {
            break;
        }
        assert!(started.elapsed() < DEADLINE, "not every committed message resolved within {DEADLINE:?} (seed {seed})");
        std::thread::sleep(Duration::from_millis(20));
    }
    done.store(true, Ordering::Relaxed);
    for consumer in consumers {
        consumer.join().expect("consumer");
    }

    let events = log.events.lock().unwrap().clone();
    let rolled_back: HashSet<i64> = rolled_back.lock().unwrap().iter().copied().collect();
    let keys: HashMap<i64, String> = committed.iter().cloned().collect();
    let resolved = terminal_counts(&log);
    for (label, group) in &groups {
        // Nothing lost, nothing invented, one final outcome each.
        for (id, _) in &committed {
            assert_eq!(resolved.get(&(*label, *id)), Some(&1), "{label}: message {id} resolved once (seed {seed})");
        }
        for e in &events {
            if let Event::Start { group: g, id, .. } = e {
                assert!(*g != *label || !rolled_back.contains(id), "{label}: rolled-back {id} was delivered");
            }
        }
        check_no_overlap(label, &events, seed);
        if *label == "ordered" {
            check_order(label, &events, &keys, seed);
        }
        let left: i64 = c
            .query_one(
                &format!(
                    "SELECT count(*) FROM {} WHERE consumer_group_id = $1 AND status IN ('ready', 'inflight', 'deferred')",
                    s.table("exception_queue")
                ),
                &[&group.id],
            )
            .unwrap()
            .get(0);
        assert_eq!(left, 0, "{label}: unresolved exception rows remain");
        group.assert_counts_exact(&mut c);
    }
    let deliveries = events.iter().filter(|e| matches!(e, Event::Start { .. })).count();
    eprintln!(
        "torture: {} committed, {} rolled back, {deliveries} deliveries over both groups",
        committed.len(),
        rolled_back.len()
    );
    assert!(committed.len() > 1500 && deliveries > 2 * committed.len(), "the run exercised retries");
}

/// How many final outcomes each (group, message) got.
fn terminal_counts(log: &Log) -> HashMap<(&'static str, i64), usize> {
    let mut counts = HashMap::new();
    for e in log.events.lock().unwrap().iter() {
        if let Event::Resolving { group, id, terminal: true } = e {
            *counts.entry((*group, *id)).or_default() += 1;
        }
    }
    counts
}

/// Per key, every delivery's [start, end] interval is disjoint from every other's.
fn check_no_overlap(label: &str, events: &[Event], seed: u64) {
    let mut running: HashMap<&str, (i64, usize)> = HashMap::new(); // key -> (id, start index)
    let mut key_of: HashMap<i64, &str> = HashMap::new();
    for (at, e) in events.iter().enumerate() {
        match e {
            Event::Start { group, id, key } if *group == label => {
                if let Some((other, since)) = running.get(key.as_str()) {
                    panic!("{label}: {id} started at event {at} while {other} (same key {key}) ran since {since} (seed {seed})");
                }
                running.insert(key, (*id, at));
                key_of.insert(*id, key);
            }
            Event::End { group, id } if *group == label => {
                let key = key_of[id];
                assert_eq!(running.remove(key).map(|(i, _)| i), Some(*id));
            }
            _ => {}
        }
    }
}

/// A message starts only after every earlier committed message of its key reached a final
/// outcome.
fn check_order(label: &str, events: &[Event], keys: &HashMap<i64, String>, seed: u64) {
    let mut by_key: HashMap<&str, Vec<i64>> = HashMap::new();
    for (id, key) in keys {
        by_key.entry(key.as_str()).or_default().push(*id);
    }
    let mut resolved_at: BTreeMap<i64, usize> = BTreeMap::new();
    for (at, e) in events.iter().enumerate() {
        if let Event::Resolving { group, id, terminal: true } = e {
            if *group == label {
                resolved_at.insert(*id, at);
            }
        }
    }
    for (at, e) in events.iter().enumerate() {
        if let Event::Start { group, id, key } = e {
            if *group != label {
                continue;
            }
            for earlier in by_key[key.as_str()].iter().filter(|e| *e < id) {
                match resolved_at.get(earlier) {
                    Some(r) if *r < at => {}
                    other => panic!(
                        "{label}: {id} started at event {at} before earlier {earlier} of key {key} resolved ({other:?}) (seed {seed})"
                    ),
                }
            }
        }
    }
}
