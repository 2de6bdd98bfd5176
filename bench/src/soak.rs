//! W8 soak: a stream produced to and consumed continuously, on the default setup (no cron, no
//! maintain(), no preloaded library): retention runs from the consumer's own claims. Prints the
//! stream's size on disk at every sample; flat means retention keeps up.
//!
//! One producer sends 100 messages every 20 ms (5,000/s), one consumer claims 100 at a time
//! and acks with its next claim. The stream's partition_size is 100,000, so a 10-minute run
//! fills 30 partitions: disk stays flat only if consumed ones go.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::systems::{connect, Pg};

/// One sample.
#[derive(Clone, Debug)]
pub struct Sample {
    pub elapsed_s: f64,
    pub produced: u64,
    pub consumed: u64,
    pub partitions: i64,
    pub bytes: i64,
}

const STREAM_SIZE: &str = "SELECT count(*) FILTER (WHERE c.relispartition)::int8,
        coalesce(sum(pg_total_relation_size(c.oid)), 0)::int8
    FROM pg_class c
    WHERE c.relnamespace = 'sqlstreams'::regnamespace AND c.relkind IN ('r', 'p')
      AND c.relname ~ ('^(message_log|message_archive|exception_queue|exception_count|range_lease|lane|cursor|compaction_head|idempotency_key)_' || $1 || '(_p[0-9]+)?$')";

pub async fn run(url: &str, quick: bool) -> Vec<Sample> {
    let (minutes, every) = if quick { (1, Duration::from_secs(10)) } else { (10, Duration::from_secs(60)) };
    let db = connect(url).await;
    let stream = format!("bench.soak-{}", std::process::id());
    let id: i64 =
        db.query_one("SELECT sqlstreams.create_stream($1, partition_size => 100000)", &[&stream]).await.unwrap().get(0);
    db.execute("SELECT sqlstreams.create_group($1, 'consumer')", &[&stream]).await.unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let (produced, consumed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));

    let producer = {
        let (pg, stream, stop, produced) = (connect(url).await, stream.clone(), stop.clone(), produced.clone());
        tokio::spawn(async move {
            let payloads: Vec<String> =
                (0..100).map(|i| format!("{{\"n\": {i}, \"pad\": \"{}\"}}", "x".repeat(110))).collect();
            let mut next = Instant::now();
            while !stop.load(Ordering::Relaxed) {
                pg.execute(
                    "SELECT count(*) FROM sqlstreams.produce_batch($1, $2::text[]::jsonb[])",
                    &[&stream, &payloads],
                )
                .await
                .unwrap();
                produced.fetch_add(100, Ordering::Relaxed);
                next += Duration::from_millis(20);
                tokio::time::sleep_until(next.into()).await;
            }
        })
    };
    let consumer = {
        let (pg, stream, stop, consumed) = (connect(url).await, stream.clone(), stop.clone(), consumed.clone());
        tokio::spawn(async move { consume(&pg, &stream, &stop, &consumed).await })
    };

    let started = Instant::now();
    let mut samples = Vec::new();
    for _ in 0..=(minutes * 60 / every.as_secs()) {
        let row = db.query_one(STREAM_SIZE, &[&id.to_string()]).await.unwrap();
        let sample = Sample {
            elapsed_s: started.elapsed().as_secs_f64(),
            produced: produced.load(Ordering::Relaxed),
            consumed: consumed.load(Ordering::Relaxed),
            partitions: row.get(0),
            bytes: row.get(1),
        };
        println!(
            "W8 {:>5.0} s: produced {:>8}, consumed {:>8}, {:>2} partitions, {:>7.1} MB on disk",
            sample.elapsed_s,
            sample.produced,
            sample.consumed,
            sample.partitions,
            sample.bytes as f64 / 1e6
        );
        samples.push(sample);
        if started.elapsed() >= Duration::from_secs(minutes * 60) {
            break;
        }
        tokio::time::sleep(every).await;
    }
    stop.store(true, Ordering::Relaxed);
    let _ = producer.await;
    let _ = consumer.await;
    db.execute("SELECT sqlstreams.drop_stream($1)", &[&stream]).await.unwrap();
    samples
}

async fn consume(pg: &Pg, stream: &str, stop: &AtomicBool, consumed: &AtomicU64) {
    let claim = pg
        .prepare("SELECT message_id, lease_token FROM sqlstreams.claim($1, 'consumer', 100, '60 seconds', $2, $3)")
        .await
        .unwrap();
    let mut acks: (Option<uuid::Uuid>, Option<Vec<i64>>) = (None, None);
    while !stop.load(Ordering::Relaxed) {
        let rows = pg.query(&claim, &[&stream, &acks.0, &acks.1]).await.unwrap();
        acks = (None, None);
        if rows.is_empty() {
            tokio::time::sleep(Duration::from_millis(5)).await;
            continue;
        }
        consumed.fetch_add(rows.len() as u64, Ordering::Relaxed);
        acks = (Some(rows[0].get(1)), Some(rows.iter().map(|r| r.get(0)).collect()));
    }
}
