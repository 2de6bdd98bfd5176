//! W10 drain: a consumer's capacity. W1's consumed/s is capped by each system's producers once
//! its consumer keeps up, so it cannot rank consumers that keep up; here a backlog is produced
//! first (2 producers, 100-message transactions), then one consumer drains it in batches of 100
//! with nothing else running. The floor's bare id cursor is what a consumer with no guarantee
//! costs; PgQ drains in its tick batches (its ticker runs throughout, as it must).
//!
//! Server CPU is read from `/proc` for every process of the cluster (the postmaster's children),
//! so it counts what the consumer's calls cost wherever it is spent: in SQL, in the call around
//! it, in WAL writing.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use crate::systems::{self, ConsumerOpts, System};
use crate::workloads::{Bench, Keys, Until};

#[derive(Clone, Debug, Default)]
pub struct Drain {
    pub system: Option<System>,
    pub label: String,
    pub messages: usize,
    pub seconds: f64,
    pub rate: f64,
    pub server_cpu_us_per_message: f64,
    /// This process's CPU: the consumer (the client library, or the SQL loop), and what the
    /// bench does with every message it hands over (the same for every system).
    pub consumer_cpu_us_per_message: f64,
    pub wal_bytes_per_message: f64,
    /// sqlstreams: claims and their server time (`track_functions`), µs per claim.
    pub claims: i64,
    pub claim_us: f64,
    pub missing: usize,
    pub duplicates: usize,
    /// Rounds run; the numbers are the median round's.
    pub rounds: usize,
}

/// The cases, in the order the report shows them.
pub const CASES: [(System, Keys); 8] = [
    (System::Floor, Keys::None),
    (System::Pgq, Keys::None),
    (System::Sql, Keys::None),
    (System::Client, Keys::None),
    (System::Sql, Keys::Parallel(1024)),
    (System::Sql, Keys::Ordered(1024)),
    (System::Sql, Keys::Exclusive(1024)),
    (System::Client, Keys::Ordered(1024)),
];

/// The round with the median rate, with every round's missing and duplicate messages added up.
pub fn median(rounds: Vec<Drain>) -> Option<Drain> {
    let (missing, duplicates) = rounds.iter().fold((0, 0), |(m, d), r| (m + r.missing, d + r.duplicates));
    let n = rounds.len();
    let mut median = crate::stats::median_by(rounds, |d| d.rate)?;
    median.rounds = n;
    median.missing = missing;
    median.duplicates = duplicates;
    Some(median)
}

impl Bench {
    /// W10: one consumer drains a backlog of `messages`.
    pub async fn drain(&self, system: System, keys: Keys) -> Drain {
        let messages = if self.quick { 20_000 } else { 200_000 };
        let target = systems::setup(&self.db, system, &self.run_name("drain"), keys.policy()).await;
        let client = sqlstreams_client::Client::connect(&self.url).unwrap();
        let data_dir: String = self.db.query_one("SHOW data_directory", &[]).await.unwrap().get(0);
        let stop_ticker = CancellationToken::new();
        let ticker = (system == System::Pgq).then(|| systems::spawn_ticker(self.url.clone(), stop_ticker.clone()));

        // The backlog: 2 producers, 100 messages a transaction, keys interleaved as in W2.
        let expected = self.produce(&client, &target, keys, Until::Count(messages)).await;
        // Every tick PgQ needs for the backlog is made before the clock starts.
        if system == System::Pgq {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        self.db.execute("CHECKPOINT", &[]).await.unwrap();
        self.db.execute("SELECT pg_stat_reset()", &[]).await.unwrap();

        let sink = systems::Sink::default();
        let opts = ConsumerOpts { batch: 100, idle_poll: Duration::from_millis(10), policy: keys.policy() };
        let wal_start = self.wal_position().await;
        let cpu_start = self.cluster_cpu_us(&data_dir);
        let own_cpu_start = crate::workloads::own_cpu_us();
        let started = Instant::now();
        let consumer = systems::start_consumer(&self.url, &client, &target, opts, sink.clone()).await;
        let mut seen = Vec::with_capacity(expected.len());
        let deadline = Instant::now() + Duration::from_secs(300);
        let mut unique = HashSet::new();
        while unique.len() < expected.len() && Instant::now() < deadline {
            for c in sink.next().await {
                unique.insert((c.producer, c.seq));
                seen.push(c);
            }
        }
        let elapsed = started.elapsed();
        let cpu = self.cluster_cpu_us(&data_dir).saturating_sub(cpu_start);
        let own_cpu = crate::workloads::own_cpu_us().saturating_sub(own_cpu_start);
        let wal = self.wal_since(&wal_start).await;
        consumer.stop().await;
        stop_ticker.cancel();
        if let Some(t) = ticker {
            let _stopped = t.await;
        }
        drop(client);
        for c in sink.take() {
            unique.insert((c.producer, c.seq));
            seen.push(c);
        }
        tokio::time::sleep(Duration::from_millis(500)).await; // closed backends flush statistics
        let (claims, claim_ms): (i64, f64) = {
            let row = self
                .db
                .query_one(
                    "SELECT coalesce(sum(calls), 0)::int8, coalesce(sum(total_time), 0)
                     FROM pg_stat_user_functions WHERE schemaname = 'sqlstreams' AND funcname IN ('claim', 'claim_with_metadata')",
                    &[],
                )
                .await
                .unwrap();
            (row.get(0), row.get(1))
        };
        systems::teardown(&self.db, &target).await;
        let n = expected.len().max(1) as f64;
        Drain {
            system: Some(system),
            label: keys.label(),
            messages: expected.len(),
            seconds: elapsed.as_secs_f64(),
            rate: unique.len() as f64 / elapsed.as_secs_f64(),
            server_cpu_us_per_message: cpu as f64 / n,
            consumer_cpu_us_per_message: own_cpu as f64 / n,
            wal_bytes_per_message: wal / n,
            claims,
            claim_us: if claims > 0 { claim_ms * 1000.0 / claims as f64 } else { f64::NAN },
            missing: expected.difference(&unique).count(),
            duplicates: seen.len() - unique.len(),
            rounds: 1,
        }
    }
}
