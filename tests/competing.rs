//! Competing consumers on one ordered (or exclusive) group, fed by outbox producers.
//!
//! Producers write a business row and then produce in the same transaction (so they hold a
//! transaction id before they register as producers), with interleaved keys; some roll back.
//! Eight consumers claim the same group at once with random batch sizes and random failures;
//! half of them carry their acks in their next claim, as the Rust client does, and a monitor
//! reads the group's status throughout. Consumers also crash: now and then a claim takes a
//! batch under a short lease and its consumer disappears without running any of it, holding
//! its lanes until the lease runs out. Afterwards, from a log of what every handler did:
//! - every committed message reached exactly one final outcome, no rolled-back message ran;
//! - every delivery is explained: a message started once more than it failed;
//! - per key, no two deliveries overlapped and (ordered) none started before every earlier
//!   message of its key had resolved;
//! - no call failed (no deadlock, no status error), and the group drained soon after the
//!   producers stopped, leaving no unresolved row, open lease or uncommitted cursor.
//!
//! Events are logged on the safe side of each server call, as in tests/torture.rs. Set
//! SQLSTREAMS_TORTURE_SEED to replay a run's random decisions.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use postgres::Client;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use sqlstreams_tests::*;

const PRODUCERS: usize = 4;
const TRANSACTIONS_PER_PRODUCER: usize = 200;
const CONSUMERS: usize = 8;
const KEYS: usize = 200;
const FAILURE_RATE: f64 = 0.15;
/// Claims whose consumer crashes before running anything (each under `CRASH_LEASE`).
const CRASHES: usize = 3;
const CRASH_LEASE: &str = "1 second";
/// Shorter than the 60 s lease: a message that waits for a lease to run out fails the test.
const DRAIN_DEADLINE: Duration = Duration::from_secs(40);

#[derive(Clone, Debug)]
enum Event {
    Start {
        id: i64,
        key: String,
    },
    End {
        id: i64,
    },
    /// Logged before the outcome call (or the claim that carries it); `terminal` is set once
    /// the call has recorded a final outcome.
    Resolving {
        id: i64,
        failed: bool,
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

    fn terminal_ids(&self) -> HashMap<i64, usize> {
        let mut counts = HashMap::new();
        for e in self.events.lock().unwrap().iter() {
            if let Event::Resolving { id, terminal: true, .. } = e {
                *counts.entry(*id).or_default() += 1;
            }
        }
        counts
    }
}

fn seed() -> u64 {
    std::env::var("SQLSTREAMS_TORTURE_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(rand::random)
}

struct Produced {
    committed: Mutex<Vec<(i64, String)>>,
    rolled_back: Mutex<Vec<i64>>,
}

/// The producers' business table, one per run.
fn business_table(s: &Stream) -> String {
    format!("public.competing_orders_{}", s.id)
}

fn produce(s: &Stream, seed: u64, produced: &Produced) {
    let mut c = connect();
    let mut rng = StdRng::seed_from_u64(seed);
    for _ in 0..TRANSACTIONS_PER_PRODUCER {
        let mut tx = c.transaction().unwrap();
        // The business write comes first: the transaction has an id before it produces.
        tx.execute(&format!("INSERT INTO {} (note) VALUES ('order placed')", business_table(s)), &[]).unwrap();
        if rng.gen_bool(0.3) {
            std::thread::sleep(Duration::from_millis(rng.gen_range(1..4)));
        }
        let mut mine = Vec::new();
        for _ in 0..rng.gen_range(1..=5) {
            let key = format!("account-{}", rng.gen_range(0..KEYS));
            mine.push((s.produce(&mut tx, json!({ "key": key }), Some(&key)), key));
        }
        if rng.gen_bool(0.1) {
            tx.rollback().unwrap();
            produced.rolled_back.lock().unwrap().extend(mine.iter().map(|(id, _)| *id));
        } else {
            tx.commit().unwrap();
            produced.committed.lock().unwrap().extend(mine);
        }
    }
}

struct Consumer {
    group: Group,
    /// Acks travel with the next claim instead of their own call.
    carries_acks: bool,
    log: Arc<Log>,
    done: Arc<AtomicBool>,
    claims: Arc<AtomicUsize>,
}

/// Acks not recorded yet: (token, id).
type Pending = Vec<(uuid::Uuid, i64)>;

impl Consumer {
    /// Logs the pending acks as resolving, right before the call that records them.
    fn resolving(&self, pending: &mut Pending) -> Vec<usize> {
        pending
            .drain(..)
            .map(|(_, id)| self.log.push(Event::Resolving { id, failed: false, terminal: false }))
            .collect()
    }

    fn claim(&self, c: &mut Client, batch: i32, pending: &mut Pending) -> Vec<Delivery> {
        self.claims.fetch_add(1, Ordering::Relaxed);
        let g = &self.group;
        if pending.iter().any(|p| p.0 != pending[0].0) {
            self.flush(c, pending);
        }
        let carried = pending.first().map(|p| p.0);
        let ids: Vec<i64> = pending.iter().map(|p| p.1).collect();
        let marks = self.resolving(pending);
        let rows = match carried {
            Some(token) => c.query(
                "SELECT message_id, message_key, concurrency, attempt, payload, lease_token, run_after
                     FROM sqlstreams.claim($1, $2, $3, '60 seconds', $4, $5)",
                &[&g.stream.name, &g.name, &batch, &token, &ids],
            ),
            None => c.query(
                "SELECT message_id, message_key, concurrency, attempt, payload, lease_token, run_after
                     FROM sqlstreams.claim($1, $2, $3, '60 seconds')",
                &[&g.stream.name, &g.name, &batch],
            ),
        }
        .unwrap_or_else(|e| panic!("claim failed: {}", describe(&e)));
        for at in marks {
            self.log.mark_terminal(at);
        }
        rows.iter()
            .map(|r| Delivery {
                message_id: r.get(0),
                message_key: r.get(1),
                concurrency: r.get(2),
                attempt: r.get(3),
                payload: r.get(4),
                lease_token: r.get(5),
                run_after: r.get(6),
            })
            .collect()
    }

    /// Records buffered acks now, one `ack_batch` per token.
    fn flush(&self, c: &mut Client, pending: &mut Pending) {
        let mut tokens: Vec<uuid::Uuid> = pending.iter().map(|p| p.0).collect();
        tokens.dedup();
        let all = pending.clone();
        let marks = self.resolving(pending);
        for token in tokens {
            let ids: Vec<i64> = all.iter().filter(|p| p.0 == token).map(|p| p.1).collect();
            let recorded: Vec<i64> = c
                .query_one(
                    "SELECT sqlstreams.ack_batch($1, $2, $3, $4)",
                    &[&self.group.stream.name, &self.group.name, &token, &ids],
                )
                .unwrap_or_else(|e| panic!("ack_batch failed: {}", describe(&e)))
                .get(0);
            assert_eq!(recorded.len(), ids.len(), "acks lost their lease under a 60 s lease");
        }
        for at in marks {
            self.log.mark_terminal(at);
        }
    }

    fn run(&self, seed: u64) {
        let mut c = connect();
        let mut rng = StdRng::seed_from_u64(seed);
        let mut pending: Pending = Vec::new();
        while !self.done.load(Ordering::Relaxed) {
            let batch = self.claim(&mut c, rng.gen_range(1..=25), &mut pending);
            if batch.is_empty() {
                std::thread::sleep(Duration::from_millis(5));
                continue;
            }
            let mut succeeded: HashSet<i64> = HashSet::new();
            for d in &batch {
                if d.run_after.is_some_and(|p| !succeeded.contains(&p)) {
                    continue; // its predecessor did not resolve: the server deferred it
                }
                if d.run_after.is_some() && !pending.is_empty() {
                    self.flush(&mut c, &mut pending); // a successor starts only after the ack is recorded
                }
                let key = d.message_key.clone().expect("every message has a key");
                self.log.push(Event::Start { id: d.message_id, key });
                if rng.gen_bool(0.1) {
                    std::thread::sleep(Duration::from_micros(rng.gen_range(50..800)));
                }
                self.log.push(Event::End { id: d.message_id });
                let g = &self.group;
                if rng.gen_bool(FAILURE_RATE) {
                    let at = self.log.push(Event::Resolving { id: d.message_id, failed: true, terminal: false });
                    let status: Option<String> = c
                        .query_one(
                            "SELECT sqlstreams.fail($1, $2, $3, $4, 'random failure')",
                            &[&g.stream.name, &g.name, &d.lease_token, &d.message_id],
                        )
                        .unwrap_or_else(|e| panic!("fail failed: {}", describe(&e)))
                        .get(0);
                    match status.as_deref() {
                        Some("dead") => {
                            self.log.mark_terminal(at);
                            succeeded.insert(d.message_id); // a dead predecessor releases the chain
                        }
                        Some("ready") => {}
                        other => panic!("fail of {} under a 60 s lease returned {other:?}", d.message_id),
                    }
                } else if self.carries_acks {
                    pending.push((d.lease_token, d.message_id));
                    succeeded.insert(d.message_id);
                } else {
                    let at = self.log.push(Event::Resolving { id: d.message_id, failed: false, terminal: false });
                    assert!(g.ack(&mut c, d), "ack of {} lost its lease under a 60 s lease", d.message_id);
                    self.log.mark_terminal(at);
                    succeeded.insert(d.message_id);
                }
            }
        }
        self.flush(&mut c, &mut pending);
    }
}

#[test]
fn competing_consumers_and_outbox_producers_on_an_ordered_group() {
    competing("ordered");
}

#[test]
fn competing_consumers_and_outbox_producers_on_an_exclusive_group() {
    competing("exclusive");
}

/// Claims a batch under a short lease and drops it, as a consumer that crashes right after its
/// claim committed; records the ids it took down in `taken_down`. Returns how many.
fn crash(group: &Group, seed: u64, done: &AtomicBool, taken_down: &Mutex<HashSet<i64>>) -> usize {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut c = connect();
    std::thread::sleep(Duration::from_millis(rng.gen_range(50..1500)));
    while !done.load(Ordering::Relaxed) {
        let taken: Vec<i64> = c
            .query(
                &format!("SELECT message_id FROM sqlstreams.claim($1, $2, 25, '{CRASH_LEASE}')"),
                &[&group.stream.name, &group.name],
            )
            .unwrap_or_else(|e| panic!("claim failed: {}", describe(&e)))
            .iter()
            .map(|r| r.get(0))
            .collect();
        if !taken.is_empty() {
            let n = taken.len();
            taken_down.lock().unwrap().extend(taken);
            return n;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    0
}

fn competing(concurrency: &str) {
    let seed = seed();
    eprintln!("competing seed: {seed} (set SQLSTREAMS_TORTURE_SEED={seed} to replay the random decisions)");
    let started = Instant::now();
    let mut c = connect();
    // Small partitions, and retention running all along (below): partitions are dropped while
    // claims, outcomes and crashes go on, with dead letters archived on the way.
    let s = Stream::create_sized(&mut c, &format!("competing-{concurrency}"), 1000);
    c.batch_execute(&format!("CREATE TABLE {} (id bigserial PRIMARY KEY, note text)", business_table(&s))).unwrap();
    let group_id: i64 = c
        .query_one(
            "SELECT sqlstreams.create_group($1, $2, $2, max_retries => 3,
                    backoff_base => '5 milliseconds', backoff_cap => '20 milliseconds')",
            &[&s.name, &concurrency],
        )
        .unwrap()
        .get(0);
    let group = Group { stream: s.clone(), name: concurrency.into(), id: group_id };

    let produced = Arc::new(Produced { committed: Mutex::default(), rolled_back: Mutex::default() });
    let log = Arc::new(Log::default());
    let done = Arc::new(AtomicBool::new(false));
    let claims = Arc::new(AtomicUsize::new(0));
    let producers: Vec<_> = (0..PRODUCERS)
        .map(|i| {
            let (s, produced) = (s.clone(), produced.clone());
            std::thread::spawn(move || produce(&s, seed.wrapping_add(i as u64), &produced))
        })
        .collect();
    let consumers: Vec<_> = (0..CONSUMERS)
        .map(|i| {
            let consumer = Consumer {
                group: group.clone(),
                carries_acks: i % 2 == 0,
                log: log.clone(),
                done: done.clone(),
                claims: claims.clone(),
            };
            let seed = seed.wrapping_add(1000 + i as u64);
            std::thread::spawn(move || consumer.run(seed))
        })
        .collect();
    let taken_down: Arc<Mutex<HashSet<i64>>> = Arc::default();
    let crashes: Vec<_> = (0..CRASHES)
        .map(|i| {
            let (group, done, taken_down) = (group.clone(), done.clone(), taken_down.clone());
            let seed = seed.wrapping_add(2000 + i as u64);
            std::thread::spawn(move || crash(&group, seed, &done, &taken_down))
        })
        .collect();
    let monitor = {
        let (group, done) = (group.clone(), done.clone());
        std::thread::spawn(move || {
            let mut c = connect();
            let mut readings = 0;
            while !done.load(Ordering::Relaxed) {
                for sql in [
                    "SELECT claimed, committed FROM sqlstreams.group_status($1, $2)",
                    "SELECT claimed, committed FROM sqlstreams.consumer_groups WHERE stream = $1 AND name = $2",
                ] {
                    let row = c
                        .query_one(sql, &[&group.stream.name, &group.name])
                        .unwrap_or_else(|e| panic!("status failed under competing claims: {}", describe(&e)));
                    assert!(row.get::<_, i64>(1) <= row.get::<_, i64>(0));
                    readings += 1;
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            readings
        })
    };
    let retention = {
        let (s, done) = (s.clone(), done.clone());
        std::thread::spawn(move || {
            let mut c = connect();
            let mut dropped = 0i64;
            while !done.load(Ordering::Relaxed) {
                let row = c
                    .query_opt("SELECT partitions_dropped FROM sqlstreams.maintain_stream($1)", &[&s.name])
                    .unwrap_or_else(|e| panic!("maintain failed under competing claims: {}", describe(&e)));
                dropped += row.map_or(0, |r| r.get::<_, i64>(0));
                std::thread::sleep(Duration::from_millis(20));
            }
            dropped
        })
    };
    for p in producers {
        p.join().expect("producer");
    }
    let producers_done = Instant::now();

    let committed: Vec<(i64, String)> = produced.committed.lock().unwrap().clone();
    // A message a crashed claim took down at its last attempt goes dead when its lease runs
    // out, with no handler's outcome: the server's final word, read from its row.
    let mut dead_on_expiry: HashSet<i64> = HashSet::new();
    loop {
        let resolved = log.terminal_ids();
        let open: Vec<i64> = committed
            .iter()
            .map(|(id, _)| *id)
            .filter(|id| !resolved.contains_key(id) && !dead_on_expiry.contains(id))
            .collect();
        if open.is_empty() {
            break;
        }
        let crashed_open: Vec<i64> =
            open.iter().copied().filter(|id| taken_down.lock().unwrap().contains(id)).collect();
        if !crashed_open.is_empty() {
            for row in c
                .query(
                    &format!(
                        "SELECT message_id FROM {} WHERE message_id = ANY($1) AND status = 'dead'",
                        s.table("exception_queue")
                    ),
                    &[&crashed_open],
                )
                .unwrap()
            {
                dead_on_expiry.insert(row.get(0));
            }
        }
        if producers_done.elapsed() >= DRAIN_DEADLINE {
            let stuck: Vec<i64> =
                committed.iter().filter(|(id, _)| !resolved.contains_key(id)).map(|(id, _)| *id).collect();
            panic!(
                "{} of {} committed messages unresolved {DRAIN_DEADLINE:?} after the producers stopped (seed {seed}): {}",
                stuck.len(),
                committed.len(),
                where_stuck(&mut c, &s, &stuck)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let drained_in = producers_done.elapsed();
    done.store(true, Ordering::Relaxed);
    for consumer in consumers {
        consumer.join().expect("a consumer call failed (see the panic above)");
    }
    let readings = monitor.join().expect("a status call failed (see the panic above)");
    let mut dropped = retention.join().expect("a maintain() call failed (see the panic above)");
    let crashed: usize = crashes.into_iter().map(|c| c.join().expect("a crashing claim failed")).sum();

    let events = log.events.lock().unwrap().clone();
    let rolled_back: HashSet<i64> = produced.rolled_back.lock().unwrap().iter().copied().collect();
    let keys: HashMap<i64, String> = committed.iter().cloned().collect();
    let resolved = log.terminal_ids();
    for (id, _) in &committed {
        let expected = if dead_on_expiry.contains(id) { None } else { Some(&1) };
        assert_eq!(resolved.get(id), expected, "message {id} resolved exactly once (seed {seed})");
    }
    let mut starts: HashMap<i64, usize> = HashMap::new();
    let mut failures: HashMap<i64, usize> = HashMap::new();
    for e in &events {
        match e {
            Event::Start { id, .. } => {
                assert!(!rolled_back.contains(id), "rolled-back {id} was delivered (seed {seed})");
                assert!(keys.contains_key(id), "{id} was delivered but never committed (seed {seed})");
                *starts.entry(*id).or_default() += 1;
            }
            Event::Resolving { id, failed: true, terminal: false } => *failures.entry(*id).or_default() += 1,
            _ => {}
        }
    }
    for (id, n) in &starts {
        // A message that went dead on expiry lost its last run to the crash.
        let last_run = usize::from(!dead_on_expiry.contains(id));
        let explained = failures.get(id).copied().unwrap_or(0) + last_run;
        assert_eq!(*n, explained, "message {id} ran {n} times, but only {explained} runs are explained (seed {seed})");
    }
    check_no_overlap(&events, seed);
    if concurrency == "ordered" {
        check_order(&events, &keys, &dead_on_expiry, seed);
    }

    let row = c
        .query_one(
            "SELECT committed, head, open_ranges, ready + inflight + deferred, dead FROM sqlstreams.group_status($1, $2)",
            &[&s.name, &group.name],
        )
        .unwrap();
    let (committed_cursor, head, open_ranges, unresolved, dead): (i64, i64, i64, i64, i64) =
        (row.get(0), row.get(1), row.get(2), row.get(3), row.get(4));
    assert_eq!((open_ranges, unresolved), (0, 0), "nothing left open after the drain");
    group.assert_counts_exact(&mut c);
    assert_eq!(committed_cursor, head, "committed reaches the head");
    // Once everything is resolved, retention keeps only the partition of the head; every dead
    // letter stays readable with its payload, most from the archive.
    dropped += c
        .query_opt("SELECT partitions_dropped FROM sqlstreams.maintain_stream($1)", &[&s.name])
        .unwrap()
        .map_or(0, |r| r.get::<_, i64>(0));
    let dead_readable: i64 = c
        .query_one(
            "SELECT count(*) FROM sqlstreams.dead_messages($1, $2) WHERE payload IS NOT NULL",
            &[&s.name, &group.name],
        )
        .unwrap()
        .get(0);
    assert_eq!(dead_readable, dead, "every dead letter keeps its payload (seed {seed})");
    assert!(dropped > 0, "retention dropped partitions during the run");
    let deliveries: usize = starts.values().sum();
    eprintln!(
        "competing {concurrency}: {} committed and {} rolled-back messages over {KEYS} keys, {CONSUMERS} consumers \
         ({} carrying acks), {} claims, {deliveries} deliveries, {} failures, {dead} dead, {crashed} messages taken \
         down by {CRASHES} crashed claims ({} dead on expiry), {readings} status readings, {dropped} partitions dropped; \
         drained {drained_in:?} after the producers stopped, {:?} in all; violations: 0",
        committed.len(),
        rolled_back.len(),
        CONSUMERS / 2,
        claims.load(Ordering::Relaxed),
        failures.values().sum::<usize>(),
        dead_on_expiry.len(),
        started.elapsed(),
    );
    assert!(committed.len() > 1000 && failures.values().sum::<usize>() > 100, "the run exercised retries");
    c.batch_execute(&format!("DROP TABLE {}", business_table(&s))).unwrap();
}

/// Where the unresolved messages are: their exception rows, the ranges holding them and the
/// lanes' holds, for the failure message.
fn where_stuck(c: &mut Client, s: &Stream, stuck: &[i64]) -> String {
    let mut out = format!("stuck {stuck:?}");
    for sql in [
        format!(
            "SELECT format('row %s %s key=%s status=%s parked=%s due=%s lease=%s attempts=%s lane=%s', message_id, \
             concurrency, message_key, status, parked, can_run_after, lease_expires_at, attempts, lane) \
             FROM {} WHERE message_id = ANY($1) ORDER BY message_id",
            s.table("exception_queue")
        ),
        format!(
            "SELECT format('range %s..%s lane=%s expires=%s pending=%s', first_id, last_id, lane, lease_expires_at, pending) \
             FROM {} WHERE pending && $1",
            s.table("range_lease")
        ),
        format!(
            "SELECT format('message %s key=%s lane=%s', id, message_key, lane) FROM {} WHERE id = ANY($1)",
            s.table("message_log")
        ),
        format!(
            "SELECT format('lane %s claimed=%s held_by=%s until=%s (now %s)', lane, claimed, held_by, held_until, now()) \
             FROM {} WHERE lane IN (SELECT lane FROM {} WHERE id = ANY($1))",
            s.table("lane"),
            s.table("message_log")
        ),
    ] {
        for row in c.query(&sql, &[&stuck]).unwrap_or_default() {
            out.push_str("\n  ");
            out.push_str(row.get::<_, &str>(0));
        }
    }
    out
}

/// Per key, every delivery's [start, end] interval is disjoint from every other's.
fn check_no_overlap(events: &[Event], seed: u64) {
    let mut running: HashMap<&str, (i64, usize)> = HashMap::new();
    let mut key_of: HashMap<i64, &str> = HashMap::new();
    for (at, e) in events.iter().enumerate() {
        match e {
            Event::Start { id, key } => {
                if let Some((other, since)) = running.get(key.as_str()) {
                    panic!("{id} started at event {at} while {other} (same key {key}) ran since {since} (seed {seed})");
                }
                running.insert(key, (*id, at));
                key_of.insert(*id, key);
            }
            Event::End { id } => {
                assert_eq!(running.remove(key_of[id]).map(|(i, _)| i), Some(*id));
            }
            Event::Resolving { .. } => {}
        }
    }
}

/// A message starts only after every earlier committed message of its key reached a final
/// outcome (one that went dead on expiry has no logged moment: it is left out).
fn check_order(events: &[Event], keys: &HashMap<i64, String>, dead_on_expiry: &HashSet<i64>, seed: u64) {
    let mut by_key: HashMap<&str, Vec<i64>> = HashMap::new();
    for (id, key) in keys {
        by_key.entry(key.as_str()).or_default().push(*id);
    }
    let mut resolved_at: HashMap<i64, usize> = HashMap::new();
    for (at, e) in events.iter().enumerate() {
        if let Event::Resolving { id, terminal: true, .. } = e {
            resolved_at.insert(*id, at);
        }
    }
    for (at, e) in events.iter().enumerate() {
        if let Event::Start { id, key } = e {
            for earlier in by_key[key.as_str()].iter().filter(|e| *e < id && !dead_on_expiry.contains(e)) {
                match resolved_at.get(earlier) {
                    Some(r) if *r < at => {}
                    other => panic!(
                        "{id} started at event {at} before earlier {earlier} of key {key} resolved ({other:?}) (seed {seed})"
                    ),
                }
            }
        }
    }
}
