//! The ordering guide's apply-balance program: ordered delivery through a failure.
//!
//! Group `apply-balance` applies balance adjustments from `ledger.adjustments` in order per
//! account. On a fresh database the stage matches the ordering guide exactly: the stream is stream 1,
//! six other groups already exist so `apply-balance` is group 7, and earlier traffic took ids
//! 1-100, so acct-42's four deltas are messages 101-104. Message 101's first run fails; 102-104
//! wait without running; the retry of 101 runs first, then 102, 103 and 104.
//!
//! Run it with `scripts/rig demo`, or `DATABASE_URL=... cargo run -p sqlstreams-client --example apply_balance`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use sqlstreams_client::{BatchOptions, Client, Concurrency, ConsumerConfig, HandlerError, ProduceOptions};

#[derive(Clone, Debug, Serialize, Deserialize)]
struct BalanceAdjusted {
    account: String,
    delta: i64,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("DATABASE_URL").unwrap_or_else(|_| "postgres://postgres@localhost/postgres".into());
    let client = Client::connect(&url)?;
    client.pool().get().await?.batch_execute("CREATE EXTENSION IF NOT EXISTS sqlstreams").await?;

    let adjustments = client.stream::<BalanceAdjusted>("ledger.adjustments");
    let stream_id = adjustments.register().await?;
    for other in ["audit", "notify-owner", "fraud-check", "reporting", "search-index", "archive"] {
        adjustments.consumer(other).register(ConsumerConfig::default()).await?;
    }
    let ledger = adjustments.consumer("apply-balance");
    let consumer = ledger
        .register(ConsumerConfig {
            concurrency_override: Some(Concurrency::Ordered),
            backoff_base: Duration::from_secs(2),
            handler_timeout: Duration::from_secs(5),
            lease: Duration::from_secs(15),
            ..Default::default()
        })
        .await?;
    let db = client.pool().get().await?;
    let group_id: i64 = db
        .query_one(
            "SELECT id FROM sqlstreams.consumer_groups WHERE stream = $1 AND name = $2",
            &[&"ledger.adjustments", &"apply-balance"],
        )
        .await?
        .get(0);
    println!("stream ledger.adjustments is stream {stream_id}; group apply-balance is group {group_id}");

    // Earlier traffic on other accounts (ids 1-100 on a fresh database).
    let producer = adjustments.producer();
    let earlier: Vec<BalanceAdjusted> =
        (1..=100).map(|n| BalanceAdjusted { account: format!("acct-{}", 1000 + n), delta: n }).collect();
    producer.produce_batch(earlier.iter().map(|m| (m, Some(m.account.as_str()))), BatchOptions::default()).await?;

    // The four deltas of acct-42.
    let mut ids = Vec::new();
    for delta in [-500, 200, 75, -20] {
        let message = BalanceAdjusted { account: "acct-42".into(), delta };
        let options = ProduceOptions { message_key: Some("acct-42".into()), ..Default::default() };
        let id = producer.produce(&message, options).await?.id().expect("no idempotency key");
        println!("produced message {id}: acct-42 {delta:+}");
        ids.push(id);
    }
    let first = ids[0];

    let balances: Arc<Mutex<HashMap<String, i64>>> = Arc::new(Mutex::new(HashMap::from([("acct-42".into(), 1000)])));
    let log: Arc<Mutex<Vec<String>>> = Arc::new(Mutex::new(Vec::new()));
    let running = {
        let (balances, log) = (balances.clone(), log.clone());
        consumer.start(move |delivery| {
            let (balances, log) = (balances.clone(), log.clone());
            async move {
                let m = &delivery.message;
                if m.account != "acct-42" {
                    *balances.lock().unwrap().entry(m.account.clone()).or_default() += m.delta;
                    return Ok(());
                }
                let attempt =
                    if delivery.attempt == 0 { String::new() } else { format!(" (retry {})", delivery.attempt) };
                if delivery.id == first && delivery.attempt == 0 {
                    println!(
                        "handler: message {}{attempt}: acct-42 {:+} -> fails: ledger temporarily unavailable",
                        delivery.id, m.delta
                    );
                    log.lock().unwrap().push(format!("{} failed", delivery.id));
                    return Err(HandlerError::retry("ledger temporarily unavailable"));
                }
                let mut balances = balances.lock().unwrap();
                let balance = balances.entry(m.account.clone()).or_default();
                *balance += m.delta;
                println!("handler: message {}{attempt}: acct-42 {:+} -> balance {balance}", delivery.id, m.delta);
                log.lock().unwrap().push(format!("{}{attempt}", delivery.id));
                Ok(())
            }
        })
    };

    // While 101 waits for its retry, show the ordering guide's inspect query.
    let inspect = format!(
        "SELECT\n    message_id,\n    message_key,\n    status,\n    attempts,\n    can_run_after\nFROM sqlstreams.exception_queue_{stream_id}\nWHERE consumer_group_id = {group_id} AND message_key = 'acct-42'\nORDER BY message_id;"
    );
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let rows = db.query(inspect.as_str(), &[]).await?;
        if rows.len() == 4 {
            println!("\nwhile {first} waits for its retry:\n{inspect}\n");
            println!(" message_id | message_key |  status  | attempts | can_run_after");
            for r in &rows {
                let at: std::time::SystemTime = r.get(4);
                let wait = at.duration_since(std::time::SystemTime::now()).unwrap_or_default();
                println!(
                    " {:>10} | {:<11} | {:<8} | {:>8} | in {:.1} s",
                    r.get::<_, i64>(0),
                    r.get::<_, String>(1),
                    r.get::<_, String>(2),
                    r.get::<_, i32>(3),
                    wait.as_secs_f64()
                );
            }
            println!();
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "the failure never showed in the exception queue");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // Wait until every delta of acct-42 is applied, then stop.
    while log.lock().unwrap().len() < 5 {
        assert!(tokio::time::Instant::now() < deadline, "not every delta was applied in time");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let shutdown = running.shutdown(Duration::from_secs(10)).await;
    println!("handler order for acct-42: {}", log.lock().unwrap().join(", "));
    println!("final balance of acct-42: {}", balances.lock().unwrap()["acct-42"]);
    let left = db.query(inspect.as_str(), &[]).await?.len();
    println!("exception rows left for acct-42: {left}; consumer metrics: {:?}", shutdown.metrics);
    Ok(())
}
