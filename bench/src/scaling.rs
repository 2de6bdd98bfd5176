//! W7 scaling: one backlog drained by 1, 2, 4 and 8 competing consumers of one group, for each
//! policy (parallel, ordered, exclusive) over 1,000 interleaved keys, with no handler cost and
//! with 100 µs per message (a handler waiting on another service), plus one hot key.
//!
//! Each consumer is a thread with its own connection: claims of 100 that carry the previous
//! claim's acks, the handler run message by message in result order. Every run checks that
//! each message ran exactly once and, per key, that no two deliveries overlapped (ordered and
//! exclusive) and none started before its predecessor (ordered).

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use postgres::{Client, NoTls};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    Parallel,
    Ordered,
    Exclusive,
}

impl Policy {
    pub fn name(self) -> &'static str {
        match self {
            Policy::Parallel => "parallel",
            Policy::Ordered => "ordered",
            Policy::Exclusive => "exclusive",
        }
    }
}

pub const CONSUMERS: [usize; 4] = [1, 2, 4, 8];
pub const HANDLER_US: [u64; 2] = [0, 100];
const KEYS: usize = 1000;
const BATCH: i32 = 100;

/// One drain.
#[derive(Clone, Debug)]
pub struct Scaling {
    pub policy: Policy,
    pub keys: usize,
    pub handler_us: u64,
    pub consumers: usize,
    pub messages: usize,
    pub rate: f64,
    /// What the handlers' sleeps really took, per message (the OS rounds them up).
    pub handler_actual_us: f64,
    /// Server time in claim and ack_batch per message (`track_functions`).
    pub server_us_per_message: f64,
    pub claims: i64,
    pub empty_claims: usize,
    pub missing: usize,
    pub duplicates: usize,
    pub order_violations: usize,
    pub overlaps: usize,
}

/// One handler run, as its consumer saw it.
struct Run {
    id: i64,
    key: String,
    started: Instant,
    ended: Instant,
}

pub fn run_all(url: &str, quick: bool) -> Vec<Scaling> {
    let messages = if quick { 12_000 } else { 60_000 };
    let mut results = Vec::new();
    for handler_us in HANDLER_US {
        for policy in [Policy::Parallel, Policy::Ordered, Policy::Exclusive] {
            for consumers in CONSUMERS {
                results.push(report(drain(url, policy, KEYS, handler_us, consumers, messages)));
            }
        }
    }
    for handler_us in HANDLER_US {
        for consumers in [1, 4] {
            results.push(report(drain(url, Policy::Ordered, 1, handler_us, consumers, messages / 4)));
        }
    }
    results
}

/// Rounds of `side_by_side`: three pairs, so that the median pair leaves out one disturbed by
/// the machine.
pub const SIDE_BY_SIDE_ROUNDS: usize = 6;
/// The policies `side_by_side` drains, in the order of its result.
pub const SIDE_BY_SIDE: [Policy; 3] = [Policy::Parallel, Policy::Ordered, Policy::Exclusive];

/// One consumer without handler cost, each policy once per round, every other round in reverse
/// order, so that the ratios between policies (`stats::paired_ratio`) compare drains run side by
/// side. In `run_all` the same drains are minutes apart, and a one-consumer drain lasts a third of
/// a second: the machine's drift between them moved the ratio by more than a change does (0.76 to
/// 0.99 ordered / parallel over earlier runs). Returns each policy's rounds, in `SIDE_BY_SIDE`
/// order.
pub fn side_by_side(url: &str, quick: bool) -> Vec<Vec<Scaling>> {
    let messages = if quick { 12_000 } else { 60_000 };
    let mut rounds: Vec<Vec<Scaling>> = SIDE_BY_SIDE.iter().map(|_| Vec::new()).collect();
    for round in 0..SIDE_BY_SIDE_ROUNDS {
        let mut order: Vec<usize> = (0..SIDE_BY_SIDE.len()).collect();
        if round % 2 == 1 {
            order.reverse();
        }
        for i in order {
            rounds[i].push(report(drain(url, SIDE_BY_SIDE[i], KEYS, 0, 1, messages)));
        }
    }
    rounds
}

fn report(s: Scaling) -> Scaling {
    println!(
        "W7 {:<9} {:>4} keys {:>3} µs handler {} consumers, {} messages: {:>8.0} msg/s, server {:>5.1} µs/msg, {} claims ({} empty), \
         missing {} duplicates {} order violations {} overlaps {}",
        s.policy.name(),
        s.keys,
        s.handler_us,
        s.consumers,
        s.messages,
        s.rate,
        s.server_us_per_message,
        s.claims,
        s.empty_claims,
        s.missing,
        s.duplicates,
        s.order_violations,
        s.overlaps
    );
    s
}

fn connect(url: &str) -> Client {
    Client::connect(url, NoTls).expect("connect")
}

/// Produces `messages` in transactions of 100 from two producers, keys interleaved; returns
/// the ids.
fn backlog(url: &str, stream: &str, keys: usize, messages: usize) -> HashSet<i64> {
    let producers: Vec<_> = (0..2)
        .map(|p| {
            let (url, stream) = (url.to_string(), stream.to_string());
            std::thread::spawn(move || {
                let mut c = connect(&url);
                let mut ids = Vec::new();
                for first in (p * 100..messages).step_by(200) {
                    let n = 100.min(messages - first);
                    let keys: Vec<String> = (first..first + n).map(|i| format!("key-{}", i % keys)).collect();
                    let payloads: Vec<serde_json::Value> =
                        keys.iter().map(|k| serde_json::json!({ "key": k, "pad": "x".repeat(110) })).collect();
                    let rows = c
                        .query("SELECT sqlstreams.produce_batch($1, $2, $3)", &[&stream, &payloads, &keys])
                        .expect("produce_batch");
                    ids.extend(rows.iter().map(|r| r.get::<_, i64>(0)));
                }
                ids
            })
        })
        .collect();
    producers.into_iter().flat_map(|h| h.join().expect("producer")).collect()
}

fn drain(url: &str, policy: Policy, keys: usize, handler_us: u64, consumers: usize, messages: usize) -> Scaling {
    let mut db = connect(url);
    let stream = format!("bench.scaling-{}-{}-{handler_us}-{consumers}-{}", policy.name(), keys, std::process::id());
    db.execute("SELECT sqlstreams.create_stream($1)", &[&stream]).unwrap();
    db.execute("SELECT sqlstreams.create_group($1, 'consumer', $2)", &[&stream, &policy.name()]).unwrap();
    let produced = backlog(url, &stream, keys, messages);
    db.execute("SELECT pg_stat_reset()", &[]).unwrap();

    let start = Arc::new(Barrier::new(consumers + 1));
    let done = Arc::new(AtomicBool::new(false));
    let handled = Arc::new(AtomicUsize::new(0));
    let threads: Vec<_> = (0..consumers)
        .map(|_| {
            let (url, stream, start, done, handled) =
                (url.to_string(), stream.clone(), start.clone(), done.clone(), handled.clone());
            std::thread::spawn(move || consume(&url, &stream, handler_us, &start, &done, &handled, messages))
        })
        .collect();
    start.wait();
    let began = Instant::now();
    let mut runs: Vec<Run> = Vec::new();
    let mut empty_claims = 0;
    for t in threads {
        let (r, empty) = t.join().expect("consumer");
        runs.extend(r);
        empty_claims += empty;
    }
    let last = runs.iter().map(|r| r.ended).max().unwrap_or(began);
    let elapsed = last.duration_since(began).as_secs_f64();
    std::thread::sleep(Duration::from_millis(600)); // closed backends flush their statistics
    let (claims, server_ms): (i64, f64) = {
        let row = db
            .query_one(
                "SELECT coalesce(sum(calls) FILTER (WHERE funcname = 'claim'), 0)::int8, coalesce(sum(total_time), 0)
                 FROM pg_stat_user_functions WHERE schemaname = 'sqlstreams' AND funcname IN ('claim', 'ack_batch')",
                &[],
            )
            .unwrap();
        (row.get(0), row.get(1))
    };
    db.execute("SELECT sqlstreams.drop_stream($1)", &[&stream]).unwrap();

    let unique: HashSet<i64> = runs.iter().map(|r| r.id).collect();
    let expected = produced;
    let (order_violations, overlaps) = check_keys(&mut runs, policy);
    let handler_actual_us = if handler_us == 0 {
        0.0
    } else {
        runs.iter().map(|r| r.ended.duration_since(r.started).as_secs_f64()).sum::<f64>() * 1e6
            / runs.len().max(1) as f64
    };
    Scaling {
        policy,
        keys,
        handler_us,
        consumers,
        messages: expected.len(),
        rate: unique.len() as f64 / elapsed.max(1e-9),
        handler_actual_us,
        server_us_per_message: server_ms * 1000.0 / expected.len().max(1) as f64,
        claims,
        empty_claims,
        missing: expected.difference(&unique).count(),
        duplicates: runs.len() - unique.len(),
        order_violations,
        overlaps,
    }
}

/// One consumer: claims carrying the previous acks until every message was handled.
fn consume(
    url: &str,
    stream: &str,
    handler_us: u64,
    start: &Barrier,
    done: &AtomicBool,
    handled: &AtomicUsize,
    messages: usize,
) -> (Vec<Run>, usize) {
    let mut c = connect(url);
    let claim = c
        .prepare(
            "SELECT message_id, message_key, lease_token
             FROM sqlstreams.claim($1, 'consumer', $2, '60 seconds', $3, $4)",
        )
        .unwrap();
    let mut runs = Vec::new();
    let mut empty = 0;
    let mut acks: (Option<uuid::Uuid>, Option<Vec<i64>>) = (None, None);
    start.wait();
    while !done.load(Ordering::Relaxed) {
        let rows = c.query(&claim, &[&stream, &BATCH, &acks.0, &acks.1]).expect("claim");
        acks = (None, None);
        if rows.is_empty() {
            empty += 1;
            if empty % 2000 == 0 {
                // Seconds without work while messages remain: show what holds the lanes.
                let id: i64 =
                    c.query_one("SELECT id FROM sqlstreams.streams WHERE name = $1", &[&stream]).unwrap().get(0);
                let lanes: Vec<String> = c
                    .query(
                        &format!(
                            "SELECT format('lane %s claimed %s held_by %s until %s (now %s)', lane, claimed, held_by, held_until, now())
                             FROM sqlstreams.lane_{id} WHERE held_by IS NOT NULL OR claimed < (SELECT max(id) FROM sqlstreams.message_log_{id})"
                        ),
                        &[],
                    )
                    .unwrap()
                    .iter()
                    .map(|r| r.get(0))
                    .collect();
                let ranges: Vec<String> = c
                    .query(
                        &format!("SELECT format('range %s..%s lane %s token %s expires %s pending %s', first_id, last_id, lane, lease_token, lease_expires_at, cardinality(pending)) FROM sqlstreams.range_lease_{id}"),
                        &[],
                    )
                    .unwrap()
                    .iter()
                    .map(|r| r.get(0))
                    .collect();
                eprintln!("W7 stalled ({empty} empty claims): {lanes:#?} {ranges:#?}");
            }
            std::thread::sleep(Duration::from_millis(2));
            continue;
        }
        let mut ids = Vec::with_capacity(rows.len());
        for row in &rows {
            let started = Instant::now();
            if handler_us > 0 {
                std::thread::sleep(Duration::from_micros(handler_us));
            }
            let id: i64 = row.get(0);
            let key = row.get::<_, Option<String>>(1).unwrap_or_default();
            runs.push(Run { id, key, started, ended: Instant::now() });
            ids.push(id);
        }
        acks = (Some(rows[0].get(2)), Some(ids));
        if handled.fetch_add(rows.len(), Ordering::Relaxed) + rows.len() >= messages {
            done.store(true, Ordering::Relaxed);
        }
    }
    if let (Some(token), Some(ids)) = acks {
        c.query_one("SELECT sqlstreams.ack_batch($1, 'consumer', $2, $3)", &[&stream, &token, &ids])
            .expect("ack_batch");
    }
    (runs, empty)
}

/// Per key, in start order: an overlap is a run that starts before the previous one ended; an
/// order violation (ordered) a run whose id is lower than the previous one's.
fn check_keys(runs: &mut [Run], policy: Policy) -> (usize, usize) {
    if policy == Policy::Parallel {
        return (0, 0);
    }
    runs.sort_by(|a, b| a.key.cmp(&b.key).then(a.started.cmp(&b.started)));
    let (mut order, mut overlaps) = (0, 0);
    for pair in runs.windows(2) {
        let (a, b) = (&pair[0], &pair[1]);
        if a.key != b.key {
            continue;
        }
        if b.started < a.ended {
            overlaps += 1;
        }
        if policy == Policy::Ordered && b.id < a.id {
            order += 1;
        }
    }
    (order, overlaps)
}
