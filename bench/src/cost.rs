//! W6 cost model: where a claim's server time and WAL go, statement by statement. One consumer
//! drains a backlog through SQL (claims of 100 carrying the previous claim's acks) with
//! `pg_stat_statements.track = all` in its session only, so the other workloads run without the
//! extension's per-statement cost. Each statement of the library carries its name in a comment
//! (src/statement.rs), which is how the rows are labelled.

use std::time::Duration;

use crate::systems;
use crate::workloads::{Bench, Keys};

/// One statement's share of a claim.
#[derive(Clone, Debug)]
pub struct Line {
    pub statement: String,
    pub calls_per_claim: f64,
    pub us_per_claim: f64,
    pub wal_bytes_per_claim: f64,
}

#[derive(Clone, Debug)]
pub struct Cost {
    pub label: String,
    pub claims: i64,
    /// `track_functions`' time per claim call (with the acks it carries).
    pub claim_us: f64,
    /// WAL of the whole drain per claim.
    pub wal_bytes_per_claim: f64,
    pub lines: Vec<Line>,
}

impl Cost {
    /// Server time of a claim spent outside the statements it runs (the call, SPI, building
    /// results, checks), in µs.
    pub fn outside_statements_us(&self) -> f64 {
        self.claim_us - self.lines.iter().map(|l| l.us_per_claim).sum::<f64>()
    }
}

/// A statement's label: the name in its leading comment, else its first words.
fn label(query: &str) -> String {
    if let Some(rest) = query.strip_prefix("/* sqlstreams ") {
        if let Some(end) = rest.find(" */") {
            return rest[..end].to_string();
        }
    }
    let words: Vec<&str> = query.split_whitespace().collect();
    let text = words.join(" ");
    text.chars().take(60).collect()
}

impl Bench {
    /// W6: the statements of a claim, for `keys`; `None` when pg_stat_statements is not loaded.
    pub async fn cost(&self, keys: Keys) -> Option<Cost> {
        let preload: String = self.db.query_one("SHOW shared_preload_libraries", &[]).await.ok()?.get(0);
        if !preload.contains("pg_stat_statements") {
            return None;
        }
        self.db.batch_execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements").await.ok()?;
        let messages = if self.quick { 10_000 } else { 50_000 };
        let stream = format!("bench.{}", self.run_name("cost"));
        self.db.execute("SELECT sqlstreams.create_stream($1)", &[&stream]).await.unwrap();
        self.db.execute("SELECT sqlstreams.create_group($1, 'g', $2)", &[&stream, &keys.policy()]).await.unwrap();
        for first in (0..messages).step_by(100) {
            let payloads: Vec<String> =
                (first..first + 100).map(|i| format!(r#"{{"i": {i}, "pad": "{}"}}"#, "x".repeat(110))).collect();
            let message_keys: Vec<Option<String>> = (0..100).map(|i| keys.key(0, (first + i) as u64)).collect();
            self.db
                .execute(
                    "SELECT count(*) FROM sqlstreams.produce_batch($1, $2::text[]::jsonb[], $3)",
                    &[&stream, &payloads, &message_keys],
                )
                .await
                .unwrap();
        }

        let pg = systems::connect(&self.url).await;
        pg.batch_execute("SET pg_stat_statements.track = 'all'").await.unwrap();
        let claim = pg
            .prepare("SELECT message_id, lease_token FROM sqlstreams.claim($1, 'g', 100, '60 seconds', $2, $3)")
            .await
            .unwrap();
        self.db.execute("SELECT pg_stat_reset()", &[]).await.unwrap();
        self.db.execute("SELECT pg_stat_statements_reset()", &[]).await.unwrap();
        let wal_start = self.wal_position().await;
        let mut acks: (Option<uuid::Uuid>, Option<Vec<i64>>) = (None, None);
        loop {
            let rows = pg.query(&claim, &[&stream, &acks.0, &acks.1]).await.unwrap();
            if rows.is_empty() {
                break;
            }
            acks = (Some(rows[0].get(1)), Some(rows.iter().map(|r| r.get(0)).collect()));
        }
        let wal = self.wal_since(&wal_start).await;
        drop(pg);
        tokio::time::sleep(Duration::from_millis(600)).await; // a closed backend flushes its statistics
        let (claims, claim_ms): (i64, f64) = {
            let row = self
                .db
                .query_one(
                    "SELECT coalesce(sum(calls), 0)::int8, coalesce(sum(total_time), 0)
                     FROM pg_stat_user_functions WHERE schemaname = 'sqlstreams' AND funcname = 'claim'",
                    &[],
                )
                .await
                .unwrap();
            (row.get(0), row.get(1))
        };
        let claims_f = claims.max(1) as f64;
        let rows = self
            .db
            .query(
                "SELECT query, calls, total_exec_time, wal_bytes::float8 FROM pg_stat_statements
                 WHERE NOT toplevel AND dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
                 ORDER BY total_exec_time DESC",
                &[],
            )
            .await
            .unwrap();
        let mut lines: Vec<Line> = Vec::new();
        let mut occasional = Line {
            statement: "everything run by fewer than 1 claim in 10 (partitions, retention, ...)".into(),
            calls_per_claim: 0.0,
            us_per_claim: 0.0,
            wal_bytes_per_claim: 0.0,
        };
        for row in rows {
            let calls: i64 = row.get(1);
            let line = Line {
                statement: label(row.get(0)),
                calls_per_claim: calls as f64 / claims_f,
                us_per_claim: row.get::<_, f64>(2) * 1000.0 / claims_f,
                wal_bytes_per_claim: row.get::<_, f64>(3) / claims_f,
            };
            if line.calls_per_claim < 0.1 {
                occasional.calls_per_claim += line.calls_per_claim;
                occasional.us_per_claim += line.us_per_claim;
                occasional.wal_bytes_per_claim += line.wal_bytes_per_claim;
            } else if let Some(same) = lines.iter_mut().find(|l| l.statement == line.statement) {
                // One statement over several partitions has a plan, and a row, per partition.
                same.calls_per_claim += line.calls_per_claim;
                same.us_per_claim += line.us_per_claim;
                same.wal_bytes_per_claim += line.wal_bytes_per_claim;
            } else {
                lines.push(line);
            }
        }
        lines.sort_by(|a, b| b.us_per_claim.total_cmp(&a.us_per_claim));
        lines.push(occasional);
        self.db.execute("SELECT sqlstreams.drop_stream($1)", &[&stream]).await.unwrap();
        Some(Cost {
            label: keys.label(),
            claims,
            claim_us: claim_ms * 1000.0 / claims_f,
            wal_bytes_per_claim: wal / claims_f,
            lines,
        })
    }
}
