//! The Rust client behind pgbouncer in transaction mode (scripts/rig, `run_pooler_test`, which
//! also runs tests/competing.rs and tests/torture.rs through it). There a `LISTEN` hears
//! nothing once its transaction ends, so a consumer's LISTEN connection goes where
//! `ClientOptions::listen_url` says: to Postgres itself.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::Value;
use sqlstreams_client::{Client, ClientOptions, ConsumerConfig, Delivery};
use sqlstreams_tests::unique;

/// The pgbouncer in transaction mode, and Postgres itself behind it (the same database).
fn urls() -> (String, String) {
    let var =
        |name: &str| std::env::var(name).unwrap_or_else(|_| panic!("{name} is not set: scripts/rig runs this test"));
    (var("SQLSTREAMS_POOLER_URL"), var("SQLSTREAMS_POOLER_DIRECT_URL"))
}

/// Waits for `done`, at most 30 s.
async fn eventually<F: std::future::Future<Output = bool>>(what: &str, done: impl Fn() -> F) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !done().await {
        assert!(tokio::time::Instant::now() < deadline, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs pgbouncer in transaction mode: scripts/rig runs it"]
async fn a_consumer_behind_a_transaction_pooler_is_woken_through_its_listen_url() {
    let (pooler, direct) = urls();
    let marker = unique("listen");
    let options =
        ClientOptions { listen_url: Some(format!("{direct}?application_name={marker}")), ..Default::default() };
    let client = Client::connect_with(&pooler, options).unwrap();
    let admin = Client::connect(&direct).unwrap().pool().get().await.unwrap();
    admin.batch_execute(sqlstreams_tests::CREATE_EXTENSION).await.unwrap();

    let stream = client.stream::<Value>(unique("pooled"));
    stream.register().await.unwrap();
    let producer = stream.producer();
    let first = producer.produce(&serde_json::json!({"n": 1}), Default::default()).await.unwrap().id().unwrap();
    // A poll interval far longer than the test: once idle, only a notification wakes it.
    let config = ConsumerConfig { poll_interval: Duration::from_secs(600), ..Default::default() };
    let handled: Arc<Mutex<Vec<i64>>> = Arc::default();
    let seen = handled.clone();
    let consumer = stream.consumer("g").register(config).await.unwrap().start(move |d: Delivery<Value>| {
        seen.lock().unwrap().push(d.id);
        std::future::ready(Ok(()))
    });
    eventually("the first message handled", || async { handled.lock().unwrap().len() == 1 }).await;
    // Its ack goes with the next claim, which finds nothing: the consumer is idle after it.
    eventually("the first message acked", || async {
        let row = admin.query_one("SELECT committed FROM sqlstreams.group_status($1, 'g')", &[&stream.name()]).await;
        row.unwrap().get::<_, i64>(0) >= first
    })
    .await;
    eventually("the consumer's LISTEN connection open to Postgres itself", || async {
        let sql = "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND query LIKE 'LISTEN %'";
        admin.query_one(sql, &[&marker]).await.unwrap().get::<_, i64>(0) == 1
    })
    .await;

    // Produced through the pooler, on whichever backend is free; its commit notifies the
    // consumer's own backend, which the pooler does not share.
    let second = producer.produce(&serde_json::json!({"n": 2}), Default::default()).await.unwrap().id().unwrap();
    eventually("the second message handled, woken by its notification", || async {
        handled.lock().unwrap().len() == 2
    })
    .await;
    assert_eq!(*handled.lock().unwrap(), vec![first, second]);
    consumer.shutdown(Duration::from_secs(5)).await;
}
