//! W11 idle poll: what polling costs the server when there is nothing to claim. 100 groups of
//! one caught-up stream, each polled from a connection of its own every 20 ms (5,000 polls a
//! second), against the same connections sending `SELECT 1` at the same rate: the cheapest
//! round trip a poller can make. Server CPU is the pollers' own backends', from
//! `/proc/<pid>/schedstat`: an idle poll writes nothing, so no other process works for it, and
//! the cluster's background processes (checkpoints, autovacuum) only add noise.
//!
//! The pollers send each kind of poll in turn, for a short window each, every other round in
//! reverse order, and a kind's ratio to `SELECT 1` pairs the two within each round
//! (`stats::paired_ratio`): on this shared machine the CPU a poll takes drifts by a third from
//! one minute to the next (the backends wake from a sleep with cold caches, whatever else runs
//! here), and a ratio of two runs a minute apart moved with it.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::Barrier;

use crate::systems;
use crate::workloads::{cpu_us, Bench};

pub const GROUPS: usize = 100;
const EVERY: Duration = Duration::from_millis(20);

/// What one poll sends.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Poll {
    /// `SELECT 1`: the round trip alone.
    SelectOne,
    /// `sqlstreams.lane('k', 1, 16)`: a call into the extension that reads no table, the least any
    /// call of it costs.
    Lane,
    /// An empty claim, as a consumer through SQL polls.
    Claim,
    /// An empty claim and `next_due`, as the Rust client's first idle poll after work or a
    /// notification (later ones are a claim alone).
    ClaimNextDue,
}

impl Poll {
    pub const ALL: [Poll; 4] = [Poll::SelectOne, Poll::Lane, Poll::Claim, Poll::ClaimNextDue];

    pub fn label(self) -> &'static str {
        match self {
            Poll::SelectOne => "SELECT 1",
            Poll::Lane => "sqlstreams.lane()",
            Poll::Claim => "claim",
            Poll::ClaimNextDue => "claim + next_due (client, first)",
        }
    }
}

#[derive(Clone, Debug)]
pub struct Polled {
    pub poll: Poll,
    pub polls: u64,
    pub seconds: f64,
    /// The pollers' backends' CPU per poll, µs.
    pub server_cpu_us: f64,
    /// This kind's CPU per poll over `SELECT 1`'s, paired by round (`summarize`).
    pub per_select_one: f64,
    /// Rounds run; the other numbers are the median round's.
    pub rounds: usize,
}

/// Each kind's round with the median CPU per poll, with its CPU over `SELECT 1`'s paired by
/// round (`stats::paired_ratio`); `runs` as `Bench::idle_polls` returns them.
pub fn summarize(runs: Vec<Vec<Polled>>) -> Vec<Polled> {
    let one = Poll::ALL.iter().position(|p| *p == Poll::SelectOne).expect("SELECT 1 is measured");
    let ratios: Vec<f64> =
        runs.iter().map(|kind| crate::stats::paired_ratio(kind, &runs[one], |p| p.server_cpu_us)).collect();
    runs.into_iter()
        .zip(ratios)
        .filter_map(|(rounds, ratio)| {
            let n = rounds.len();
            let mut median = crate::stats::median_by(rounds, |p| p.server_cpu_us)?;
            (median.rounds, median.per_select_one) = (n, ratio);
            Some(median)
        })
        .collect()
}

impl Bench {
    /// A stream with `GROUPS` caught-up groups, for `idle_polls`.
    pub async fn idle_poll_stream(&self) -> String {
        let stream = format!("bench.{}", self.run_name("poll"));
        self.db.execute("SELECT sqlstreams.create_stream($1)", &[&stream]).await.unwrap();
        for g in 0..GROUPS {
            self.db.execute("SELECT sqlstreams.create_group($1, $2)", &[&stream, &format!("g{g}")]).await.unwrap();
        }
        stream
    }

    /// W11: `GROUPS` pollers, each sending a poll every 20 ms; every kind of poll in turn for a
    /// window, `rounds` times. Returns each kind's rounds, in `Poll::ALL`'s order.
    pub async fn idle_polls(&self, stream: &str, rounds: usize) -> Vec<Vec<Polled>> {
        let window = Duration::from_secs(if self.quick { 1 } else { 2 });
        // Connections are made and their statements prepared (and run once) before the clock
        // starts: a backend's start is not what a poll costs.
        let barrier = Arc::new(Barrier::new(GROUPS + 1));
        let (kind, stop) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicBool::new(false)));
        let sent: Arc<[AtomicU64; Poll::ALL.len()]> = Arc::new(Default::default());
        // The kind each poller picked up last (`usize::MAX`: none yet).
        let seen: Arc<Vec<AtomicUsize>> = Arc::new((0..GROUPS).map(|_| AtomicUsize::new(usize::MAX)).collect());
        let (pid_tx, mut pid_rx) = tokio::sync::mpsc::unbounded_channel::<u32>();
        let mut pollers = Vec::new();
        for g in 0..GROUPS {
            let (url, stream, barrier, pid_tx) =
                (self.url.clone(), stream.to_string(), barrier.clone(), pid_tx.clone());
            let (kind, stop, sent, seen) = (kind.clone(), stop.clone(), sent.clone(), seen.clone());
            pollers.push(tokio::spawn(async move {
                let pg = systems::connect(&url).await;
                let pid: i32 = pg.query_one("SELECT pg_backend_pid()", &[]).await.unwrap().get(0);
                pid_tx.send(pid as u32).unwrap();
                let group = format!("g{g}");
                let mut statements = Vec::new();
                for poll in Poll::ALL {
                    statements.push(prepare(&pg, poll).await);
                }
                let once = |poll: usize| {
                    let (pg, statements, stream, group) = (&pg, &statements, &stream, &group);
                    async move {
                        for s in &statements[poll] {
                            let rows = if s.params().is_empty() {
                                pg.query(s, &[]).await.unwrap()
                            } else {
                                pg.query(s, &[stream, group]).await.unwrap()
                            };
                            // SELECT 1, lane and next_due return a row; a claim returns none
                            // (nothing to claim).
                            assert!(s.columns().len() == 1 || rows.is_empty(), "an idle claim found work");
                        }
                    }
                };
                for poll in 0..Poll::ALL.len() {
                    once(poll).await;
                }
                barrier.wait().await;
                // Spread over the interval, so that the pollers do not all wake together.
                tokio::time::sleep(EVERY * g as u32 / GROUPS as u32).await;
                while !stop.load(Ordering::Relaxed) {
                    let poll = kind.load(Ordering::Relaxed);
                    seen[g].store(poll, Ordering::Relaxed);
                    once(poll).await;
                    sent[poll].fetch_add(1, Ordering::Relaxed);
                    tokio::time::sleep(EVERY).await;
                }
            }));
        }
        barrier.wait().await;
        let mut pids = Vec::with_capacity(GROUPS);
        while pids.len() < GROUPS {
            pids.push(pid_rx.recv().await.expect("every poller sends its backend's pid"));
        }
        // A window of every kind first, not counted: in the first full run the first window's
        // SELECT 1 took under half the CPU of any later one.
        for i in 0..Poll::ALL.len() {
            kind.store(i, Ordering::Relaxed);
            tokio::time::sleep(window / 4).await;
        }
        let mut runs: Vec<Vec<Polled>> = vec![vec![]; Poll::ALL.len()];
        for round in 1..=rounds {
            // Every other round in reverse order: a drift over a round weighs on both ends of
            // a ratio alike (`stats::paired_ratio`).
            let mut order: Vec<usize> = (0..Poll::ALL.len()).collect();
            if round % 2 == 0 {
                order.reverse();
            }
            for i in order {
                kind.store(i, Ordering::Relaxed);
                // The window opens once every poller has picked the new kind up: no poll of the
                // one before is still running.
                while seen.iter().any(|s| s.load(Ordering::Relaxed) != i) {
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
                let (polls_start, (cpu_start, read), started) =
                    (sent[i].load(Ordering::Relaxed), cpu_us(&pids), Instant::now());
                assert_eq!(
                    read, GROUPS,
                    "W11 reads the pollers' backends in /proc: it needs PostgreSQL on this machine"
                );
                tokio::time::sleep(window).await;
                let polls = sent[i].load(Ordering::Relaxed) - polls_start;
                let (cpu, seconds) = (cpu_us(&pids).0 - cpu_start, started.elapsed());
                let polled = Polled {
                    poll: Poll::ALL[i],
                    polls,
                    seconds: seconds.as_secs_f64(),
                    server_cpu_us: cpu as f64 / polls.max(1) as f64,
                    per_select_one: f64::NAN,
                    rounds: 1,
                };
                println!(
                    "W11 round {round} {:<32} {:>6} polls in {:.1} s, server CPU {:>6.1} µs per poll",
                    polled.poll.label(),
                    polled.polls,
                    polled.seconds,
                    polled.server_cpu_us
                );
                runs[i].push(polled);
            }
        }
        stop.store(true, Ordering::Relaxed);
        for p in pollers {
            p.await.unwrap();
        }
        runs
    }
}

/// What a poller sends for `poll`, prepared.
async fn prepare(pg: &tokio_postgres::Client, poll: Poll) -> Vec<tokio_postgres::Statement> {
    match poll {
        Poll::SelectOne => vec![pg.prepare("SELECT 1").await.unwrap()],
        Poll::Lane => vec![pg.prepare("SELECT sqlstreams.lane('k', 1, 16)").await.unwrap()],
        Poll::Claim => vec![pg.prepare("SELECT * FROM sqlstreams.claim($1, $2, 100)").await.unwrap()],
        Poll::ClaimNextDue => vec![
            // The client's two statements (client/src/sql.rs), with a batch of 100.
            pg.prepare(
                "SELECT message_id, message_key, concurrency, attempt, payload::text, lease_token, run_after,
                 produced_at, headers
                 FROM sqlstreams.claim_with_metadata($1, $2, 100, interval '30 seconds', NULL, NULL)",
            )
            .await
            .unwrap(),
            pg.prepare("SELECT extract(epoch FROM sqlstreams.next_due($1, $2) - clock_timestamp())::float8")
                .await
                .unwrap(),
        ],
    }
}
