//! The Rust client behind pgbouncer in transaction mode (scripts/rig, `run_pooler_test`, which
//! also runs tests/competing.rs and tests/torture.rs through it). There a `LISTEN` hears
//! nothing once its transaction ends, so a consumer's LISTEN connection goes where
//! `ClientOptions::listen_url` says: to Postgres itself.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
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
async fn eventually<F: std::future::Future<Output = bool>>(what: &str, done: impl FnMut() -> F) {
    let mut done = done;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !done().await {
        assert!(tokio::time::Instant::now() < deadline, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Claims of `stream`'s consumers recorded since the last call (`sqlstreams_claim_seconds`: a
/// snapshot takes the samples it returns).
fn claims(snapshotter: &Snapshotter, stream: &str) -> usize {
    snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .filter(|(key, ..)| {
            key.key().name() == "sqlstreams_claim_seconds"
                && key.key().labels().any(|l| l.key() == "stream" && l.value() == stream)
        })
        .map(|(.., value)| if let DebugValue::Histogram(samples) = value { samples.len() } else { 0 })
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs pgbouncer in transaction mode: scripts/rig runs it"]
async fn a_consumer_behind_a_transaction_pooler_is_woken_through_its_listen_url() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    recorder.install().expect("the only recorder of this test binary");
    let (pooler, direct) = urls();
    let marker = unique("listen");
    let options =
        ClientOptions { listen_url: Some(format!("{direct}?application_name={marker}")), ..Default::default() };
    let client = Client::connect_with(&pooler, options).unwrap();
    let admin = Client::connect(&direct).unwrap().pool().get().await.unwrap();
    admin.batch_execute(sqlstreams_tests::CREATE_EXTENSION).await.unwrap();

    let stream = client.stream::<Value>(unique("pooled"));
    stream.register().await.unwrap();
    // A poll interval far longer than the test: once idle, only a notification wakes it.
    let config = ConsumerConfig { poll_interval: Duration::from_secs(600), ..Default::default() };
    let handled: Arc<Mutex<Vec<i64>>> = Arc::default();
    let seen = handled.clone();
    let consumer = stream.consumer("g").register(config).await.unwrap().start(move |d: Delivery<Value>| {
        seen.lock().unwrap().push(d.id);
        std::future::ready(Ok(()))
    });
    // Its LISTEN done, on Postgres itself: the server is idle after it.
    eventually("the consumer's LISTEN connection open to Postgres itself", || async {
        let sql = "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND query LIKE 'LISTEN %' AND state = 'idle'";
        admin.query_one(sql, &[&marker]).await.unwrap().get::<_, i64>(0) == 1
    })
    .await;
    // Its first claim, and the one the listener asks for once LISTEN is done (whatever came
    // before it went unheard), both found nothing: it is idle until a notification comes.
    let mut made = 0;
    eventually("the consumer's first two claims", || {
        made += claims(&snapshotter, stream.name());
        std::future::ready(made >= 2)
    })
    .await;

    // Produced through the pooler, on whichever backend is free; its commit notifies the
    // consumer's own backend, which the pooler does not share.
    let producer = stream.producer();
    let first = producer.produce(&serde_json::json!({"n": 1}), Default::default()).await.unwrap().id().unwrap();
    eventually("the message handled, the consumer woken by its notification", || async {
        handled.lock().unwrap().len() == 1
    })
    .await;
    // And the pool goes on through the pooler: its ack with the next claim, another message.
    let second = producer.produce(&serde_json::json!({"n": 2}), Default::default()).await.unwrap().id().unwrap();
    eventually("the second message handled", || async { handled.lock().unwrap().len() == 2 }).await;
    eventually("both acked", || async {
        let row = admin.query_one("SELECT committed FROM sqlstreams.group_status($1, 'g')", &[&stream.name()]).await;
        row.unwrap().get::<_, i64>(0) >= second
    })
    .await;
    assert_eq!(*handled.lock().unwrap(), vec![first, second]);
    consumer.shutdown(Duration::from_secs(5)).await;
}
