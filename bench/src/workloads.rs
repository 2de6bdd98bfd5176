//! The workloads (see issue "Benchmarks side by side"): W1 throughput, W2 keyed throughput,
//! W3 quiet latency, W4 ordered hand-off, W5 idle cost; W6 (claim cost) is read from W1's
//! function statistics. Every run checks that each produced message was consumed exactly once
//! (and, for ordered runs, in order per key).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::processes::{self, Role};
use crate::stats::{now_us, quantile};
use crate::systems::{self, Consumed, ConsumerOpts, Event, Pg, Producer, System, Target};

pub struct Bench {
    pub url: String,
    pub db: Pg,
    pub quick: bool,
    runs: AtomicUsize,
}

/// Keys and policy of a throughput run.
#[derive(Clone, Copy, Debug)]
pub enum Keys {
    None,
    /// Keys, and no policy: the group's default, `parallel` (no override).
    Parallel(usize),
    Ordered(usize),
    Exclusive(usize),
}

impl Keys {
    pub fn label(self) -> String {
        match self {
            Keys::None => "no keys".into(),
            Keys::Parallel(n) => format!("parallel, {n} keys"),
            Keys::Ordered(1) => "ordered, 1 hot key".into(),
            Keys::Ordered(n) => format!("ordered, {n} keys"),
            Keys::Exclusive(n) => format!("exclusive, {n} keys"),
        }
    }

    pub fn policy(self) -> Option<&'static str> {
        match self {
            Keys::None | Keys::Parallel(_) => None,
            Keys::Ordered(_) => Some("ordered"),
            Keys::Exclusive(_) => Some("exclusive"),
        }
    }

    pub fn key(self, producer: u32, seq: u64) -> Option<String> {
        let n = match self {
            Keys::None => return None,
            Keys::Parallel(n) | Keys::Ordered(n) | Keys::Exclusive(n) => n as u64,
        };
        Some(format!("key-{}", (seq * 2 + producer as u64) % n))
    }
}

/// How long `produce` goes on.
#[derive(Clone, Copy, Debug)]
pub enum Until {
    /// Until this much time has passed since the instant.
    Elapsed(Instant, Duration),
    /// Until this many messages, half from each producer, are sent.
    Count(usize),
}

#[derive(Clone, Debug, Default)]
pub struct Throughput {
    pub system: Option<System>,
    pub label: String,
    pub produced: usize,
    pub produce_rate: f64,
    pub consume_rate: f64,
    pub e2e_p50_ms: f64,
    pub e2e_p99_ms: f64,
    pub missing: usize,
    pub duplicates: usize,
    pub order_violations: usize,
    pub wal_bytes_per_message: f64,
    /// CPU of every process of the cluster over the run (producers, consumer, ticker, WAL
    /// writer, ...), per message produced.
    pub server_cpu_us_per_message: f64,
    /// The same, by kind of process (`processes::KINDS`, in its order).
    pub server_cpu_by_process: Vec<f64>,
    /// Function statistics during the run: (function, calls, total milliseconds).
    pub functions: Vec<(String, i64, f64)>,
}

/// The round with the median consumed/s, with every round's missing, duplicate and out-of-order
/// messages added up.
pub fn median_round(rounds: Vec<Throughput>) -> Option<Throughput> {
    let sum = |f: fn(&Throughput) -> usize, rounds: &[Throughput]| rounds.iter().map(f).sum::<usize>();
    let (missing, duplicates, order_violations) =
        (sum(|t| t.missing, &rounds), sum(|t| t.duplicates, &rounds), sum(|t| t.order_violations, &rounds));
    let mut median = crate::stats::median_by(rounds, |t| t.consume_rate)?;
    (median.missing, median.duplicates, median.order_violations) = (missing, duplicates, order_violations);
    Some(median)
}

#[derive(Clone, Debug, Default)]
pub struct Latency {
    pub system: Option<System>,
    pub label: String,
    pub samples: usize,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub missing: usize,
}

#[derive(Clone, Debug, Default)]
pub struct Idle {
    pub system: Option<System>,
    pub consumers: usize,
    pub seconds: f64,
    pub statements_per_second: f64,
    pub xids: i64,
}

impl Bench {
    pub async fn new(url: &str, quick: bool) -> Bench {
        Bench { url: url.to_string(), db: systems::connect(url).await, quick, runs: AtomicUsize::new(0) }
    }

    pub fn run_name(&self, what: &str) -> String {
        format!("{what}-{}-{}", std::process::id(), self.runs.fetch_add(1, Ordering::Relaxed))
    }

    fn seconds(&self, full: u64, quick: u64) -> Duration {
        Duration::from_secs(if self.quick { quick } else { full })
    }

    /// Two producers sending 100-message transactions of `keys`' events to `target` until
    /// `until`; returns what they sent, as (producer, sequence number).
    pub async fn produce(
        &self,
        client: &sqlstreams_client::Client,
        target: &Target,
        keys: Keys,
        until: Until,
    ) -> HashSet<(u32, u64)> {
        let mut producers = Vec::new();
        for p in 0..2u32 {
            let (url, client, target) =
                (processes::role_url(&self.url, Role::Producer), client.clone(), target.clone());
            producers.push(tokio::spawn(async move {
                let producer = Producer::new(&url, &client, &target).await;
                let mut seq = 0u64;
                loop {
                    let n = match until {
                        Until::Elapsed(started, duration) if started.elapsed() < duration => 100,
                        Until::Count(count) if (seq as usize) < count / 2 => 100.min(count / 2 - seq as usize),
                        _ => break,
                    };
                    let events: Vec<Event> = (0..n)
                        .map(|_| {
                            seq += 1;
                            Event::new(p, seq, keys.key(p, seq))
                        })
                        .collect();
                    producer.send(&events).await;
                }
                seq
            }));
        }
        let mut sent = HashSet::new();
        for (p, handle) in producers.into_iter().enumerate() {
            let last = handle.await.unwrap();
            sent.extend((1..=last).map(|seq| (p as u32, seq)));
        }
        sent
    }

    /// CPU time of the cluster's processes, in microseconds: the postmaster whose data
    /// directory is `data_dir` and its children (see `cpu_us`).
    pub fn cluster_cpu_us(&self, data_dir: &str) -> u64 {
        let (postmaster, pids) = processes::cluster_pids(data_dir);
        cpu_us(&pids).0 + reaped_children_cpu_us(postmaster)
    }

    /// Turns autovacuum off and waits (up to a minute) for its running workers to finish:
    /// their transactions (it analyzes after the heavy runs) are not what an idle workload
    /// costs. `ALTER SYSTEM` cannot run in a multi-statement transaction: one at a time.
    pub async fn pause_autovacuum(&self) {
        self.db.execute("ALTER SYSTEM SET autovacuum = off", &[]).await.unwrap();
        self.db.execute("SELECT pg_reload_conf()", &[]).await.unwrap();
        let quiet = Instant::now() + Duration::from_secs(60);
        while Instant::now() < quiet {
            let workers: i64 = self
                .db
                .query_one("SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'autovacuum worker'", &[])
                .await
                .unwrap()
                .get(0);
            if workers == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    pub async fn resume_autovacuum(&self) {
        self.db.execute("ALTER SYSTEM RESET autovacuum", &[]).await.unwrap();
        self.db.execute("SELECT pg_reload_conf()", &[]).await.unwrap();
    }

    /// The cluster's WAL position now, for `wal_since`.
    pub async fn wal_position(&self) -> String {
        self.db.query_one("SELECT pg_current_wal_lsn()::text", &[]).await.unwrap().get(0)
    }

    /// Bytes of WAL written since `position` (from `wal_position`).
    pub async fn wal_since(&self, position: &str) -> f64 {
        self.db
            .query_one("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), $1::text::pg_lsn)::float8", &[&position])
            .await
            .unwrap()
            .get(0)
    }

    async fn function_stats(&self) -> Vec<(String, i64, f64)> {
        self.db
            .query(
                "SELECT schemaname || '.' || funcname, sum(calls)::int8, sum(total_time)
                 FROM pg_stat_user_functions WHERE schemaname IN ('sqlstreams', 'pgq')
                 GROUP BY 1 ORDER BY 1",
                &[],
            )
            .await
            .unwrap()
            .iter()
            .map(|r| (r.get(0), r.get(1), r.get(2)))
            .collect()
    }

    /// W1 / W2: 2 producers in 100-message transactions for a while, 1 consumer in batches of
    /// 100 draining everything.
    pub async fn throughput(&self, system: System, keys: Keys) -> Throughput {
        let target = systems::setup(&self.db, system, &self.run_name("throughput"), keys.policy()).await;
        // A client of its own: its connections close at the end and flush their statistics. Its
        // producers and consumer share it, as before the CPU was broken down by process: with a
        // client each, its consumer claims sooner and smaller batches (docs/benchmarks/cost-model.md).
        let client = sqlstreams_client::Client::connect(&processes::role_url(&self.url, Role::Client)).unwrap();
        let consumer_url = processes::role_url(&self.url, Role::Consumer);
        self.db.execute("SELECT pg_stat_reset()", &[]).await.unwrap();
        let data_dir: String = self.db.query_one("SHOW data_directory", &[]).await.unwrap().get(0);
        let wal_start = self.wal_position().await;
        let cpu_start = self.cluster_cpu_us(&data_dir);
        // W1 only: W2 does not report it.
        let sampler = matches!(keys, Keys::None).then(|| processes::Sampler::start(&self.url, &data_dir));
        let stop_ticker = CancellationToken::new();
        let ticker = (system == System::Pgq)
            .then(|| systems::spawn_ticker(processes::role_url(&self.url, Role::Ticker), stop_ticker.clone()));
        let sink = systems::Sink::default();
        let opts = ConsumerOpts { batch: 100, idle_poll: Duration::from_millis(10), policy: keys.policy() };
        let consumer = systems::start_consumer(&consumer_url, &client, &target, opts, sink.clone()).await;

        let duration = self.seconds(10, 3);
        let started = Instant::now();
        let expected = self.produce(&client, &target, keys, Until::Elapsed(started, duration)).await;
        let produce_elapsed = started.elapsed();

        let mut seen: Vec<Consumed> = Vec::with_capacity(expected.len());
        let deadline = Instant::now() + Duration::from_secs(180);
        let mut last_needed = started.elapsed();
        while seen.len() < expected.len() && Instant::now() < deadline {
            let got = sink.next().await;
            if !got.is_empty() {
                seen.extend(got);
                last_needed = started.elapsed();
            }
        }
        let cpu = self.cluster_cpu_us(&data_dir).saturating_sub(cpu_start);
        let cpu_by_process = match sampler {
            Some(sampler) => sampler.stop(cpu).await,
            None => Default::default(),
        };
        consumer.stop().await;
        stop_ticker.cancel();
        if let Some(t) = ticker {
            let _stopped = t.await;
        }
        drop(client);
        seen.extend(sink.take());
        tokio::time::sleep(Duration::from_millis(500)).await; // closed backends flush statistics
        let wal = self.wal_since(&wal_start).await;

        let unique: HashSet<(u32, u64)> = seen.iter().map(|c| (c.producer, c.seq)).collect();
        let mut latencies: Vec<f64> = seen.iter().map(|c| (c.handled_us - c.produced_us) as f64 / 1000.0).collect();
        let throughput = Throughput {
            system: Some(system),
            label: keys.label(),
            produced: expected.len(),
            produce_rate: expected.len() as f64 / produce_elapsed.as_secs_f64(),
            consume_rate: unique.len() as f64 / last_needed.as_secs_f64(),
            e2e_p50_ms: quantile(&mut latencies, 0.5),
            e2e_p99_ms: quantile(&mut latencies, 0.99),
            missing: expected.difference(&unique).count(),
            duplicates: seen.len() - unique.len(),
            order_violations: if matches!(keys, Keys::Ordered(_)) { order_violations(&seen) } else { 0 },
            wal_bytes_per_message: wal / expected.len().max(1) as f64,
            server_cpu_us_per_message: cpu as f64 / expected.len().max(1) as f64,
            server_cpu_by_process: processes::KINDS
                .iter()
                .map(|kind| cpu_by_process.get(kind).copied().unwrap_or(0) as f64 / expected.len().max(1) as f64)
                .collect(),
            functions: self.function_stats().await,
        };
        systems::teardown(&self.db, &target).await;
        throughput
    }

    /// W3: one message every 5 ms (200/s) in its own transaction, for a while; the time from
    /// the produce call to the handler.
    pub async fn quiet(&self, system: System) -> Latency {
        let target = systems::setup(&self.db, system, &self.run_name("quiet"), None).await;
        let client = sqlstreams_client::Client::connect(&self.url).unwrap();
        let stop_ticker = CancellationToken::new();
        let ticker = (system == System::Pgq).then(|| systems::spawn_ticker(self.url.clone(), stop_ticker.clone()));
        // sqlstreams waits for NOTIFY (polling only as a fallback); the others must poll.
        let idle_poll = match system {
            System::Client | System::Sql => Duration::from_secs(1),
            System::Pgq => Duration::from_millis(10),
            System::Floor => Duration::from_millis(5),
        };
        let sink = systems::Sink::default();
        let consumer = systems::start_consumer(
            &self.url,
            &client,
            &target,
            ConsumerOpts { batch: 100, idle_poll, policy: None },
            sink.clone(),
        )
        .await;
        tokio::time::sleep(Duration::from_millis(500)).await; // idle, listening
        let producer = Producer::new(&self.url, &client, &target).await;
        let duration = self.seconds(20, 5);
        let started = Instant::now();
        let mut sent = 0u64;
        let mut next = Instant::now();
        while started.elapsed() < duration {
            sent += 1;
            producer.send(&[Event::new(0, sent, None)]).await;
            next += Duration::from_millis(5);
            tokio::time::sleep_until(next.into()).await;
        }
        let mut seen = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(30);
        while seen.len() < sent as usize && Instant::now() < deadline {
            seen.extend(sink.next().await);
        }
        consumer.stop().await;
        stop_ticker.cancel();
        if let Some(t) = ticker {
            let _stopped = t.await;
        }
        systems::teardown(&self.db, &target).await;
        let unique: HashSet<u64> = seen.iter().map(|c| c.seq).collect();
        let mut latencies: Vec<f64> = seen.iter().map(|c| (c.handled_us - c.produced_us) as f64 / 1000.0).collect();
        Latency {
            system: Some(system),
            label: "200 msg/s, one per transaction".into(),
            samples: seen.len(),
            p50_ms: quantile(&mut latencies, 0.5),
            p99_ms: quantile(&mut latencies, 0.99),
            missing: sent as usize - unique.len(),
        }
    }

    /// W4 through the client: per key, the head fails once and is retried at once; the time
    /// from the head's successful return to its successor's handler start.
    pub async fn hand_off_client(&self) -> Latency {
        let target = systems::setup(&self.db, System::Client, &self.run_name("handoff"), Some("ordered")).await;
        let client = sqlstreams_client::Client::connect(&self.url).unwrap();
        let stream = client.stream::<Event>(target.stream.clone());
        let config = sqlstreams_client::ConsumerConfig {
            concurrency_override: Some(sqlstreams_client::Concurrency::Ordered),
            poll_interval: Duration::from_secs(1),
            ..Default::default()
        };
        let consumer = stream.consumer(target.group.clone()).register(config).await.unwrap();
        let head_done: Arc<Mutex<HashMap<String, i64>>> = Arc::default();
        let (tx, mut rx) = mpsc::unbounded_channel::<(String, i64)>();
        let running = {
            let head_done = head_done.clone();
            consumer.start(move |d: sqlstreams_client::Delivery<Event>| {
                let (head_done, tx) = (head_done.clone(), tx.clone());
                async move {
                    let key = d.key.clone().unwrap();
                    if d.message.seq == 1 {
                        if d.attempt == 0 {
                            return Err(sqlstreams_client::HandlerError::retry_after("fails once", Duration::ZERO));
                        }
                        head_done.lock().unwrap().insert(key, now_us());
                    } else {
                        let _sent = tx.send((key, now_us()));
                    }
                    Ok(())
                }
            })
        };
        let keys = if self.quick { 50 } else { 200 };
        let producer = stream.producer();
        let mut samples = Vec::new();
        for k in 0..keys {
            let key = format!("key-{k}");
            let events = [Event::new(0, 1, Some(key.clone())), Event::new(0, 2, Some(key.clone()))];
            producer.produce_batch(events.iter().map(|e| (e, Some(key.as_str()))), Default::default()).await.unwrap();
            let (got, started) = tokio::time::timeout(Duration::from_secs(30), rx.recv()).await.unwrap().unwrap();
            assert_eq!(got, key);
            let done = head_done.lock().unwrap()[&key];
            samples.push((started - done) as f64 / 1000.0);
        }
        running.shutdown(Duration::from_secs(10)).await;
        systems::teardown(&self.db, &target).await;
        latency("through the client (same claim, chained)", System::Client, samples)
    }

    /// W4 through raw SQL calls with batch 1, so the successor needs a claim of its own: the
    /// time from the head's ack returning to the claim that returns the successor.
    pub async fn hand_off_sql(&self) -> Latency {
        let target = systems::setup(&self.db, System::Sql, &self.run_name("handoff-sql"), Some("ordered")).await;
        let pg = systems::connect(&self.url).await;
        let (s, g) = (&target.stream, &target.group);
        let claim = "SELECT message_id, lease_token, attempt FROM sqlstreams.claim($1, $2, 1)";
        let keys = if self.quick { 50 } else { 200 };
        let mut samples = Vec::new();
        for k in 0..keys {
            let key = format!("key-{k}");
            let payloads = vec![
                serde_json::to_string(&Event::new(0, 1, None)).unwrap(),
                serde_json::to_string(&Event::new(0, 2, None)).unwrap(),
            ];
            let ids: Vec<i64> = pg
                .query(
                    "SELECT sqlstreams.produce_batch($1, $2::text[]::jsonb[], $3)",
                    &[s, &payloads, &vec![key.as_str(); 2]],
                )
                .await
                .unwrap()
                .iter()
                .map(|r| r.get(0))
                .collect();
            let head = pg.query_one(claim, &[s, g]).await.unwrap();
            let token: uuid::Uuid = head.get(1);
            pg.execute("SELECT sqlstreams.fail($1, $2, $3, $4, 'fails once', false, '0')", &[s, g, &token, &ids[0]])
                .await
                .unwrap();
            let retry = pg.query_one(claim, &[s, g]).await.unwrap();
            assert_eq!((retry.get::<_, i64>(0), retry.get::<_, i32>(2)), (ids[0], 1));
            let token: uuid::Uuid = retry.get(1);
            pg.execute("SELECT sqlstreams.ack($1, $2, $3, $4)", &[s, g, &token, &ids[0]]).await.unwrap();
            let resolved = now_us();
            let next = pg.query_one(claim, &[s, g]).await.unwrap();
            let started = now_us();
            assert_eq!(next.get::<_, i64>(0), ids[1], "the successor is claimable by the very next claim");
            let token: uuid::Uuid = next.get(1);
            pg.execute("SELECT sqlstreams.ack($1, $2, $3, $4)", &[s, g, &token, &ids[1]]).await.unwrap();
            samples.push((started - resolved) as f64 / 1000.0);
        }
        systems::teardown(&self.db, &target).await;
        latency("through SQL (ack, then the next claim)", System::Sql, samples)
    }

    /// W5: idle, caught-up consumers polling once a second (plus, for PgQ, its ticker).
    pub async fn idle(&self, system: System) -> Idle {
        let consumers = 10;
        let target = systems::setup(&self.db, system, &self.run_name("idle"), None).await;
        let client = sqlstreams_client::Client::connect(&self.url).unwrap();
        let stop_ticker = CancellationToken::new();
        let ticker = (system == System::Pgq).then(|| systems::spawn_ticker(self.url.clone(), stop_ticker.clone()));
        let mut running = Vec::new();
        for i in 0..consumers {
            let sink = systems::Sink::default();
            let opts = ConsumerOpts { batch: 100, idle_poll: Duration::from_secs(1), policy: None };
            // PgQ batches belong to one consumer name: ten consumers are ten registrations.
            let target = match system {
                System::Pgq => systems::pgq_consumer(&self.db, &target, &format!("consumer-{i}")).await,
                _ => target.clone(),
            };
            running.push(systems::start_consumer(&self.url, &client, &target, opts, sink).await);
        }
        tokio::time::sleep(Duration::from_secs(2)).await; // settle: connections made, caught up
        self.pause_autovacuum().await;
        let counters = "SELECT (xact_commit + xact_rollback)::int8, pg_current_xact_id()::text::int8
                        FROM pg_stat_database WHERE datname = current_database()";
        let before = self.db.query_one(counters, &[]).await.unwrap();
        let duration = self.seconds(20, 5);
        tokio::time::sleep(duration).await;
        let after = self.db.query_one(counters, &[]).await.unwrap();
        self.resume_autovacuum().await;
        for r in running {
            r.stop().await;
        }
        stop_ticker.cancel();
        if let Some(t) = ticker {
            let _stopped = t.await;
        }
        systems::teardown(&self.db, &target).await;
        // Minus the measuring statement itself (one transaction and one xid per reading).
        let statements = after.get::<_, i64>(0) - before.get::<_, i64>(0) - 1;
        let xids = after.get::<_, i64>(1) - before.get::<_, i64>(1) - 1;
        Idle {
            system: Some(system),
            consumers,
            seconds: duration.as_secs_f64(),
            statements_per_second: statements as f64 / duration.as_secs_f64(),
            xids,
        }
    }
}

fn latency(label: &str, system: System, mut samples: Vec<f64>) -> Latency {
    Latency {
        system: Some(system),
        label: label.into(),
        samples: samples.len(),
        p50_ms: quantile(&mut samples, 0.5),
        p99_ms: quantile(&mut samples, 0.99),
        missing: 0,
    }
}

/// Per key, consumption must follow message id order.
fn order_violations(seen: &[Consumed]) -> usize {
    let mut last: HashMap<&str, i64> = HashMap::new();
    let mut violations = 0;
    for c in seen {
        let key = c.key.as_deref().unwrap_or("");
        if let Some(previous) = last.insert(key, c.id) {
            if previous >= c.id {
                violations += 1;
            }
        }
    }
    violations
}

/// Time on a CPU of the processes `pids`, in microseconds, and how many of them could be read
/// (a process that ended is not). From `/proc/<pid>/schedstat` (nanoseconds), not
/// `/proc/<pid>/stat`'s ticks: a backend that runs a few microseconds per wake-up is charged by
/// tick sampling only when a tick lands in it, which miscounts pollers that wake in step with
/// the timer.
/// CPU of the children `pid` has reaped (`cutime` + `cstime` of /proc/<pid>/stat, in clock
/// ticks of 10 ms on Linux): the backends that ended during a run, such as producers that
/// disconnected, are no longer in /proc but their CPU counts.
fn reaped_children_cpu_us(pid: u32) -> u64 {
    const TICK_US: u64 = 10_000; // sysconf(_SC_CLK_TCK) is 100 on Linux
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command: state is field 3, cutime and cstime are fields 16 and 17.
    let fields: Vec<&str> =
        stat.rsplit_once(')').map(|(_, rest)| rest.split_whitespace().collect()).unwrap_or_default();
    let field = |n: usize| fields.get(n - 3).and_then(|f| f.parse::<u64>().ok()).unwrap_or(0);
    (field(16) + field(17)) * TICK_US
}

/// CPU time of this process (every thread alive now), in µs: the consumer's side of a run.
pub fn own_cpu_us() -> u64 {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else { return 0 };
    let tids: Vec<u32> = tasks.flatten().filter_map(|t| t.file_name().to_string_lossy().parse::<u32>().ok()).collect();
    tids.iter()
        .filter_map(|tid| std::fs::read_to_string(format!("/proc/self/task/{tid}/schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next().and_then(|f| f.parse::<u64>().ok()))
        .sum::<u64>()
        / 1000
}

pub fn cpu_us(pids: &[u32]) -> (u64, usize) {
    let read: Vec<u64> = pids.iter().filter_map(|&pid| processes::cpu_us(pid)).collect();
    (read.iter().sum::<u64>(), read.len())
}
