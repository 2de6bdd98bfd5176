//! W11 idle poll: what polling costs the server when there is nothing to claim. 100 groups of
//! one caught-up stream, each polled from a connection of its own every 20 ms (5,000 polls a
//! second), against the same connections sending `SELECT 1` at the same rate: the cheapest
//! round trip a poller can make. Server CPU is the pollers' own backends', from
//! `/proc/<pid>/schedstat`: an idle poll writes nothing, so no other process works for it, and
//! the cluster's background processes (checkpoints, autovacuum) only add noise.

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
    /// Rounds run; the numbers are the median round's.
    pub rounds: usize,
}

/// The round with the median CPU per poll.
pub fn median(rounds: Vec<Polled>) -> Option<Polled> {
    let n = rounds.len();
    let mut median = crate::stats::median_by(rounds, |p| p.server_cpu_us)?;
    median.rounds = n;
    Some(median)
}

impl Bench {
    /// A stream with `GROUPS` caught-up groups, for `idle_poll`.
    pub async fn idle_poll_stream(&self) -> String {
        let stream = format!("bench.{}", self.run_name("poll"));
        self.db.execute("SELECT sqlstreams.create_stream($1)", &[&stream]).await.unwrap();
        for g in 0..GROUPS {
            self.db.execute("SELECT sqlstreams.create_group($1, $2)", &[&stream, &format!("g{g}")]).await.unwrap();
        }
        stream
    }

    /// W11: `GROUPS` pollers sending `poll` every 20 ms for a while.
    pub async fn idle_poll(&self, stream: &str, poll: Poll) -> Polled {
        let duration = Duration::from_secs(if self.quick { 3 } else { 10 });
        // Connections are made and their statements prepared (and run once) before the clock
        // starts: a backend's start is not what a poll costs.
        let barrier = Arc::new(Barrier::new(GROUPS + 1));
        let (pid_tx, mut pid_rx) = tokio::sync::mpsc::unbounded_channel::<u32>();
        let mut pollers = Vec::new();
        for g in 0..GROUPS {
            let (url, stream, barrier, pid_tx) =
                (self.url.clone(), stream.to_string(), barrier.clone(), pid_tx.clone());
            pollers.push(tokio::spawn(async move {
                let pg = systems::connect(&url).await;
                let pid: i32 = pg.query_one("SELECT pg_backend_pid()", &[]).await.unwrap().get(0);
                pid_tx.send(pid as u32).unwrap();
                let group = format!("g{g}");
                let statements = match poll {
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
                };
                let once = || async {
                    for s in &statements {
                        let rows = if s.params().is_empty() {
                            pg.query(s, &[]).await.unwrap()
                        } else {
                            pg.query(s, &[&stream, &group]).await.unwrap()
                        };
                        // SELECT 1, lane and next_due return a row; a claim returns none (nothing
                        // to claim).
                        assert!(s.columns().len() == 1 || rows.is_empty(), "an idle claim found work");
                    }
                };
                once().await;
                barrier.wait().await;
                let (started, mut polls) = (Instant::now(), 0u64);
                // Spread over the interval, so that the pollers do not all wake together.
                tokio::time::sleep(EVERY * g as u32 / GROUPS as u32).await;
                while started.elapsed() < duration {
                    once().await;
                    polls += 1;
                    tokio::time::sleep(EVERY).await;
                }
                barrier.wait().await;
                polls
            }));
        }
        barrier.wait().await;
        let mut pids = Vec::with_capacity(GROUPS);
        while pids.len() < GROUPS {
            pids.push(pid_rx.recv().await.expect("every poller sends its backend's pid"));
        }
        let ((cpu_start, read), started) = (cpu_us(&pids), Instant::now());
        assert_eq!(read, GROUPS, "W11 reads the pollers' backends in /proc: it needs PostgreSQL on this machine");
        barrier.wait().await;
        let (cpu, seconds) = (cpu_us(&pids).0 - cpu_start, started.elapsed());
        let mut polls = 0;
        for p in pollers {
            polls += p.await.unwrap();
        }
        Polled {
            poll,
            polls,
            seconds: seconds.as_secs_f64(),
            server_cpu_us: cpu as f64 / polls.max(1) as f64,
            rounds: 1,
        }
    }
}
