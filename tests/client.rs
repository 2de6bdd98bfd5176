//! The Rust client end to end, against the throwaway cluster: typed streams, producers
//! (including inside the caller's transaction), and consumers running handlers.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use sqlstreams_client::{
    BatchOptions, Client, ClientOptions, Concurrency, ConsumerConfig, Delivery, HandlerError, ProduceOptions, Produced,
    RunningConsumer,
};
use sqlstreams_tests::{database_url, test_ca, unique};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct Adjustment {
    account: String,
    delta: i64,
}

fn adjustment(account: &str, delta: i64) -> Adjustment {
    Adjustment { account: account.into(), delta }
}

fn keyed(key: &str) -> ProduceOptions {
    ProduceOptions { message_key: Some(key.into()), ..Default::default() }
}

/// A client, with the extension installed.
fn client() -> Client {
    let client = Client::connect(&database_url()).unwrap();
    let setup = client.clone();
    // The synchronous test helpers cannot run inside a runtime; do it the async way.
    std::thread::spawn(move || {
        tokio::runtime::Runtime::new().unwrap().block_on(async {
            setup.pool().get().await.unwrap().batch_execute(sqlstreams_tests::CREATE_EXTENSION).await.unwrap()
        })
    })
    .join()
    .unwrap();
    client
}

/// Quick retries, short leases: tests finish fast.
fn config(policy: Option<Concurrency>) -> ConsumerConfig {
    ConsumerConfig {
        concurrency_override: policy,
        backoff_base: Duration::from_millis(50),
        backoff_cap: Duration::from_millis(200),
        handler_timeout: Duration::from_secs(5),
        lease: Duration::from_secs(10),
        poll_interval: Duration::from_millis(200),
        ..Default::default()
    }
}

/// `config`, with retries that fall due only after an hour: a test that works until idle sees
/// each failure once, however long its claims take.
fn slow_retries(policy: Option<Concurrency>) -> ConsumerConfig {
    ConsumerConfig { backoff_base: Duration::from_secs(3600), backoff_cap: Duration::from_secs(3600), ..config(policy) }
}

/// What handlers did, in order: (message id, attempt).
type Calls = Arc<Mutex<Vec<(i64, u32)>>>;

/// A handler that records each call and succeeds.
fn record_calls(
    calls: &Calls,
) -> impl Fn(Delivery<Adjustment>) -> std::future::Ready<Result<(), HandlerError>> + Send + Sync + 'static {
    let calls = calls.clone();
    move |d| {
        calls.lock().unwrap().push((d.id, d.attempt));
        std::future::ready(Ok(()))
    }
}

/// A handler that succeeds, and at its first call (the first claim's first row) holds the claim
/// loop, synchronously, before its future, until the test sends on `go`; `started` says it is
/// holding. It blocks in place: the runtime's other tasks (the connections') go on meanwhile.
#[allow(clippy::type_complexity)]
fn holding_the_first_call() -> (
    impl Fn(Delivery<Adjustment>) -> std::future::Ready<Result<(), HandlerError>> + Send + Sync + 'static,
    std::sync::mpsc::Receiver<()>,
    std::sync::mpsc::Sender<()>,
) {
    let (started_tx, started_rx) = std::sync::mpsc::channel::<()>();
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let gate = Mutex::new((started_tx, go_rx));
    let first = std::sync::atomic::AtomicBool::new(true);
    let handler = move |_: Delivery<Adjustment>| {
        if first.swap(false, std::sync::atomic::Ordering::Relaxed) {
            tokio::task::block_in_place(|| {
                let gate = gate.lock().unwrap();
                gate.0.send(()).unwrap();
                gate.1.recv_timeout(Duration::from_secs(20)).unwrap();
            });
        }
        std::future::ready(Ok(()))
    };
    (handler, started_rx, go_tx)
}

/// Waits (bounded) until `done` holds.
async fn eventually(what: &str, done: impl Fn() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !done() {
        assert!(tokio::time::Instant::now() < deadline, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// `eventually` for a condition that has to ask the database.
async fn eventually_async<F: std::future::Future<Output = bool>>(what: &str, done: impl Fn() -> F) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !done().await {
        assert!(tokio::time::Instant::now() < deadline, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn exception_statuses(client: &Client, stream: &str, group: &str) -> Vec<(i64, String)> {
    let conn = client.pool().get().await.unwrap();
    let id: i64 = conn.query_one("SELECT id FROM sqlstreams.streams WHERE name = $1", &[&stream]).await.unwrap().get(0);
    let sql = format!(
        "SELECT e.message_id, e.status FROM sqlstreams.exception_queue_{id} e
         JOIN sqlstreams.consumer_groups g ON g.id = e.consumer_group_id WHERE g.name = $1 ORDER BY 1"
    );
    conn.query(&sql, &[&group]).await.unwrap().iter().map(|r| (r.get(0), r.get(1))).collect()
}

/// How many lanes of the group a claim holds now.
async fn held_lanes(client: &Client, stream: &str, group: &str) -> i64 {
    let conn = client.pool().get().await.unwrap();
    conn.query_one("SELECT count(*) FROM sqlstreams.open_leases($1, $2) WHERE kind = 'lane'", &[&stream, &group])
        .await
        .unwrap()
        .get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ordered_delivery_through_a_failure() {
    let client = client();
    let adjustments = client.stream::<Adjustment>(unique("ledger.adjustments"));
    adjustments.register().await.unwrap();
    let consumer = adjustments.consumer("apply-balance").register(config(Some(Concurrency::Ordered))).await.unwrap();
    let producer = adjustments.producer();
    let mut ids = Vec::new();
    for delta in [-500, 200, 75, -20] {
        ids.push(producer.produce(&adjustment("acct-42", delta), keyed("acct-42")).await.unwrap().id().unwrap());
    }
    let calls: Calls = Arc::default();
    let running = {
        let (calls, first) = (calls.clone(), ids[0]);
        consumer.start(move |d: Delivery<Adjustment>| {
            let calls = calls.clone();
            async move {
                calls.lock().unwrap().push((d.id, d.attempt));
                if d.id == first && d.attempt == 0 {
                    return Err(HandlerError::retry("insufficient funds"));
                }
                Ok(())
            }
        })
    };
    eventually("all four applied", || calls.lock().unwrap().len() == 5).await;
    let report = running.shutdown(Duration::from_secs(5)).await;
    let expected = vec![(ids[0], 0), (ids[0], 1), (ids[1], 0), (ids[2], 0), (ids[3], 0)];
    assert_eq!(*calls.lock().unwrap(), expected, "101, its retry, then 102, 103, 104");
    assert!(report.drained);
    assert_eq!((report.metrics.succeeded, report.metrics.failed, report.metrics.deferred), (4, 1, 3));
    assert!(exception_statuses(&client, adjustments.name(), "apply-balance").await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn exclusive_keys_never_overlap_across_consumers() {
    let client = client();
    let stream = client.stream::<Adjustment>(unique("exclusive"));
    stream.register().await.unwrap();
    let group = stream.consumer("g");
    let messages: Vec<Adjustment> = (0..60).map(|i| adjustment(&format!("k{}", i % 3), i)).collect();
    stream
        .producer()
        .produce_batch(messages.iter().map(|m| (m, Some(m.account.as_str()))), BatchOptions::default())
        .await
        .unwrap();
    let running_keys: Arc<Mutex<HashSet<String>>> = Arc::default();
    let overlaps = Arc::new(Mutex::new(0));
    let done: Calls = Arc::default();
    let mut consumers: Vec<RunningConsumer> = Vec::new();
    for _ in 0..2 {
        let consumer =
            group.register(ConsumerConfig { batch_size: 10, ..config(Some(Concurrency::Exclusive)) }).await.unwrap();
        let (running_keys, overlaps, done) = (running_keys.clone(), overlaps.clone(), done.clone());
        consumers.push(consumer.start(move |d: Delivery<Adjustment>| {
            let (running_keys, overlaps, done) = (running_keys.clone(), overlaps.clone(), done.clone());
            async move {
                let key = d.key.clone().unwrap();
                if !running_keys.lock().unwrap().insert(key.clone()) {
                    *overlaps.lock().unwrap() += 1;
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
                running_keys.lock().unwrap().remove(&key);
                done.lock().unwrap().push((d.id, d.attempt));
                if d.id % 7 == 0 && d.attempt == 0 {
                    return Err(HandlerError::retry("every seventh fails once"));
                }
                Ok(())
            }
        }));
    }
    eventually("every message succeeded", || done.lock().unwrap().len() >= 60 + 60 / 7).await;
    for c in consumers {
        c.shutdown(Duration::from_secs(5)).await;
    }
    assert_eq!(*overlaps.lock().unwrap(), 0, "one delivery per key at a time");
    let succeeded: HashSet<i64> = done.lock().unwrap().iter().map(|(id, _)| *id).collect();
    assert_eq!(succeeded.len(), 60);
}

/// Consumers that send claims while their ordered rows still run (a full claim sends the next one
/// ahead of its rows) keep every key's order: three of them over 64 keys, in claims of 50, with
/// handlers that wait and one message in eleven failing once. Per key, no delivery starts while
/// another runs, and none before every earlier message of the key succeeded.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ordered_keys_keep_their_order_while_claims_go_ahead() {
    let client = client();
    let stream = client.stream::<Adjustment>(unique("ahead-ordered"));
    stream.register().await.unwrap();
    let group = stream.consumer("g");
    let messages: Vec<Adjustment> = (0..1200).map(|i| adjustment(&format!("k{}", i % 64), i)).collect();
    let ids = stream
        .producer()
        .produce_batch(messages.iter().map(|m| (m, Some(m.account.as_str()))), BatchOptions::default())
        .await
        .unwrap();
    // Per key: its ids in order, and how many of them have succeeded.
    let mut order: HashMap<String, Vec<i64>> = HashMap::new();
    for (m, id) in messages.iter().zip(&ids) {
        order.entry(m.account.clone()).or_default().push(*id);
    }
    let progress: Arc<Mutex<HashMap<String, (usize, bool)>>> = Arc::default();
    let violations: Arc<Mutex<Vec<String>>> = Arc::default();
    let order = Arc::new(order);
    let settings = ConsumerConfig { batch_size: 50, message_concurrency: 200, ..config(Some(Concurrency::Ordered)) };
    let mut consumers: Vec<RunningConsumer> = Vec::new();
    for _ in 0..3 {
        let (progress, violations, order) = (progress.clone(), violations.clone(), order.clone());
        consumers.push(group.register(settings.clone()).await.unwrap().start(move |d: Delivery<Adjustment>| {
            let (progress, violations, order) = (progress.clone(), violations.clone(), order.clone());
            async move {
                let key = d.key.clone().unwrap();
                let expected = {
                    let mut progress = progress.lock().unwrap();
                    let (done, running) = progress.entry(key.clone()).or_default();
                    if *running {
                        violations.lock().unwrap().push(format!("{key}: {} started while another ran", d.id));
                    }
                    *running = true;
                    order[&key].get(*done).copied()
                };
                if expected != Some(d.id) {
                    violations.lock().unwrap().push(format!("{key}: {} started, {expected:?} was next", d.id));
                }
                tokio::time::sleep(Duration::from_micros(200)).await;
                let fail = d.id % 11 == 0 && d.attempt == 0;
                let mut progress = progress.lock().unwrap();
                let (done, running) = progress.get_mut(&key).unwrap();
                *running = false;
                if fail {
                    return Err(HandlerError::retry("one in eleven fails once"));
                }
                *done += 1;
                Ok(())
            }
        }));
    }
    let finished = || progress.lock().unwrap().values().map(|(done, _)| done).sum::<usize>() == 1200;
    eventually("every message succeeded", finished).await;
    for c in consumers {
        c.shutdown(Duration::from_secs(5)).await;
    }
    assert_eq!(*violations.lock().unwrap(), Vec::<String>::new());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn compaction_delivers_only_the_latest_state() {
    let client = client();
    let stream = client.stream::<Adjustment>(unique("state"));
    stream.register().await.unwrap();
    let consumer = stream.consumer("cache").register(config(Some(Concurrency::Exclusive))).await.unwrap();
    let producer = stream.producer();
    let compacted = || ProduceOptions { message_key: Some("acct-42".into()), compaction: true, ..Default::default() };
    let first = producer.produce(&adjustment("acct-42", 1000), compacted()).await.unwrap().id().unwrap();
    let release = Arc::new(tokio::sync::Notify::new());
    let calls: Calls = Arc::default();
    let running = {
        let (release, calls) = (release.clone(), calls.clone());
        consumer.start(move |d: Delivery<Adjustment>| {
            let (release, calls) = (release.clone(), calls.clone());
            async move {
                calls.lock().unwrap().push((d.id, d.attempt));
                if d.id == first {
                    release.notified().await; // 101 runs while 102 and 103 arrive
                }
                Ok(())
            }
        })
    };
    eventually("the first state runs", || calls.lock().unwrap().len() == 1).await;
    producer.produce(&adjustment("acct-42", 500), compacted()).await.unwrap();
    let latest = producer.produce(&adjustment("acct-42", 700), compacted()).await.unwrap().id().unwrap();
    // The consumer claims them while the first runs: both wait (deferred or superseded).
    eventually("the later states recorded", || {
        futures_lite_block(exception_statuses(&client, stream.name(), "cache")).len() == 2
    })
    .await;
    release.notify_one();
    eventually("the latest state runs", || calls.lock().unwrap().len() == 2).await;
    running.shutdown(Duration::from_secs(5)).await;
    assert_eq!(*calls.lock().unwrap(), vec![(first, 0), (latest, 0)], "the middle state was superseded");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn outbox_produce_follows_the_callers_transaction() {
    let client = client();
    let stream = client.stream::<Adjustment>(unique("outbox"));
    stream.register().await.unwrap();
    let consumer = stream.consumer("g").register(config(None)).await.unwrap();
    let producer = stream.producer();
    let mut conn = client.pool().get().await.unwrap();
    let tx = conn.transaction().await.unwrap();
    let rolled_back = producer.produce_in(&*tx, &adjustment("a", 1), keyed("a")).await.unwrap().id().unwrap();
    tx.rollback().await.unwrap();
    let tx = conn.transaction().await.unwrap();
    let committed = producer.produce_in(&*tx, &adjustment("a", 2), keyed("a")).await.unwrap().id().unwrap();
    let again = ProduceOptions { idempotency_key: Some("order-7".into()), ..keyed("a") };
    assert!(producer.produce_in(&*tx, &adjustment("a", 3), again.clone()).await.unwrap().id().is_some());
    assert_eq!(producer.produce_in(&*tx, &adjustment("a", 3), again).await.unwrap(), Produced::Duplicate);
    tx.commit().await.unwrap();
    let calls: Calls = Arc::default();
    let running = consumer.start(record_calls(&calls));
    eventually("the committed messages", || calls.lock().unwrap().len() == 2).await;
    running.shutdown(Duration::from_secs(5)).await;
    // Same key but no policy: parallel, so they may run in either order.
    let mut ids: Vec<i64> = calls.lock().unwrap().iter().map(|(id, _)| *id).collect();
    ids.sort_unstable();
    assert_eq!(ids, vec![committed, committed + 1]);
    assert!(!ids.contains(&rolled_back));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_undecodable_payload_is_dead_with_a_clear_error() {
    let client = client();
    let stream = client.stream::<Adjustment>(unique("decode"));
    stream.register().await.unwrap();
    let consumer = stream.consumer("g").register(config(None)).await.unwrap();
    let conn = client.pool().get().await.unwrap();
    conn.execute("SELECT sqlstreams.produce($1, '{\"unexpected\": true}')", &[&stream.name()]).await.unwrap();
    let good = stream.producer().produce(&adjustment("a", 1), ProduceOptions::default()).await.unwrap().id().unwrap();
    let calls: Calls = Arc::default();
    let running = consumer.start(record_calls(&calls));
    eventually("the good message", || calls.lock().unwrap().len() == 1).await;
    eventually("the bad one dead", || running.metrics().dead == 1).await;
    running.shutdown(Duration::from_secs(5)).await;
    assert_eq!(*calls.lock().unwrap(), vec![(good, 0)], "the handler never sees what does not decode");
    let row =
        conn.query_one("SELECT last_error FROM sqlstreams.dead_messages($1, 'g')", &[&stream.name()]).await.unwrap();
    let error: String = row.get(0);
    assert!(error.contains("does not decode as") && error.contains("Adjustment"), "{error}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_handler_is_cancelled_at_its_deadline_and_retried() {
    let client = client();
    let stream = client.stream::<Adjustment>(unique("timeout"));
    stream.register().await.unwrap();
    let consumer = stream
        .consumer("g")
        .register(ConsumerConfig { handler_timeout: Duration::from_millis(200), ..config(None) })
        .await
        .unwrap();
    let id = stream.producer().produce(&adjustment("a", 1), ProduceOptions::default()).await.unwrap().id().unwrap();
    let calls: Calls = Arc::default();
    let saw_cancel = Arc::new(tokio::sync::Notify::new());
    let running = {
        let (calls, saw_cancel) = (calls.clone(), saw_cancel.clone());
        consumer.start(move |d: Delivery<Adjustment>| {
            let (calls, saw_cancel) = (calls.clone(), saw_cancel.clone());
            async move {
                calls.lock().unwrap().push((d.id, d.attempt));
                if d.attempt == 0 {
                    let token = d.cancellation();
                    tokio::spawn(async move {
                        token.cancelled().await;
                        saw_cancel.notify_one();
                    });
                    tokio::time::sleep(Duration::from_secs(60)).await; // ignores its deadline
                }
                Ok(())
            }
        })
    };
    tokio::time::timeout(Duration::from_secs(10), saw_cancel.notified()).await.expect("the handler was told to stop");
    eventually("the retry", || calls.lock().unwrap().len() == 2).await;
    let report = running.shutdown(Duration::from_secs(5)).await;
    assert_eq!(*calls.lock().unwrap(), vec![(id, 0), (id, 1)]);
    assert_eq!((report.metrics.timed_out, report.metrics.succeeded), (1, 1));
}

/// A renewal answered only after the lease ran out here (an outcome held the claim's range row,
/// so the heartbeat's `extend_lease` waited, while the lease ran out on the server) may have
/// renewed less than the claim: the claim's rows that have not started do not start under it
/// any more. They are given back (released) and run from a claim of their own. Here the first of
/// two chained rows of one key holds the claim loop until the renewal came back.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_renewal_answered_after_the_lease_ran_out_starts_no_more_of_its_rows() {
    let client = client();
    let stream = client.stream::<Adjustment>(unique("lapse"));
    stream.register().await.unwrap();
    let config = ConsumerConfig {
        handler_timeout: Duration::from_secs(1),
        lease: Duration::from_secs(2),
        ..config(Some(Concurrency::Exclusive))
    };
    let consumer = stream.consumer("g").register(config).await.unwrap();
    let producer = stream.producer();
    let m1 = producer.produce(&adjustment("a", 1), keyed("k")).await.unwrap().id().unwrap();
    let m2 = producer.produce(&adjustment("a", 2), keyed("k")).await.unwrap().id().unwrap();
    let calls: Calls = Arc::default();
    let (started_tx, started_rx) = std::sync::mpsc::channel::<()>();
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let gate = Mutex::new((started_tx, go_rx));
    let handler = {
        let calls = calls.clone();
        move |d: Delivery<Adjustment>| {
            let first = {
                let mut calls = calls.lock().unwrap();
                calls.push((d.id, d.attempt));
                calls.len() == 1
            };
            if first {
                // Before the handler's future, so before its deadline starts.
                tokio::task::block_in_place(|| {
                    let gate = gate.lock().unwrap();
                    gate.0.send(()).unwrap();
                    gate.1.recv_timeout(Duration::from_secs(30)).unwrap();
                });
            }
            std::future::ready(Ok(()))
        }
    };
    let running = consumer.start(handler);
    tokio::task::block_in_place(|| started_rx.recv_timeout(Duration::from_secs(30)).unwrap());
    let name = stream.name().to_string();
    let holder = client.pool().get().await.unwrap();
    let id: i64 = holder.query_one("SELECT id FROM sqlstreams.streams WHERE name = $1", &[&name]).await.unwrap().get(0);
    holder.batch_execute(&format!("BEGIN; SELECT 1 FROM sqlstreams.range_lease_{id} FOR UPDATE")).await.unwrap();
    let watcher = client.pool().get().await.unwrap();
    eventually_async("the claim's lease ran out on the server", || async {
        let sql =
            "SELECT count(*) FROM sqlstreams.open_leases($1, 'g') WHERE kind = 'range' AND lease_expires_at <= now()";
        watcher.query_one(sql, &[&name]).await.unwrap().get::<_, i64>(0) == 1
    })
    .await;
    holder.batch_execute("COMMIT").await.unwrap();
    go_tx.send(()).unwrap();
    eventually("both messages handled", || calls.lock().unwrap().len() == 2).await;
    let report = running.shutdown(Duration::from_secs(5)).await;
    assert_eq!(*calls.lock().unwrap(), vec![(m1, 0), (m2, 0)]);
    let m = &report.metrics;
    assert_eq!((m.succeeded, m.released, m.lease_lost), (2, 1, 0), "{m2} given back, then run from a claim of its own");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_panicking_handler_is_a_retryable_failure() {
    let client = client();
    let stream = client.stream::<Adjustment>(unique("panic"));
    stream.register().await.unwrap();
    let consumer = stream.consumer("g").register(config(None)).await.unwrap();
    let id = stream.producer().produce(&adjustment("a", 1), ProduceOptions::default()).await.unwrap().id().unwrap();
    let calls: Calls = Arc::default();
    let running = {
        let calls = calls.clone();
        consumer.start(move |d: Delivery<Adjustment>| {
            let calls = calls.clone();
            async move {
                calls.lock().unwrap().push((d.id, d.attempt));
                if d.attempt == 0 {
                    panic!("boom on the first attempt");
                }
                Ok(())
            }
        })
    };
    eventually("the retry", || calls.lock().unwrap().len() == 2).await;
    let report = running.shutdown(Duration::from_secs(5)).await;
    assert_eq!(*calls.lock().unwrap(), vec![(id, 0), (id, 1)]);
    assert_eq!((report.metrics.panicked, report.metrics.failed, report.metrics.succeeded), (1, 1, 1));
}

/// A handler that panics before it even returns its future (in the closure's synchronous part)
/// fails like any panicking handler; the other deliveries of its claim are not disturbed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_panicking_before_its_future_is_a_retryable_failure() {
    use sqlstreams_client::testing::Outcome;
    let client = client();
    let stream = client.stream::<Adjustment>(unique("panic-sync"));
    stream.register().await.unwrap();
    let producer = stream.producer();
    let mut ids = Vec::new();
    for delta in [1, -1, 2, 3] {
        ids.push(producer.produce(&adjustment("a", delta), ProduceOptions::default()).await.unwrap().id().unwrap());
    }
    // The failed message's retry never falls due while the consumer works: it shows once.
    let consumer = stream.consumer("g").register(slow_retries(None)).await.unwrap();
    let worked = consumer
        .work_until_idle(|d: Delivery<Adjustment>| {
            assert!(d.message.delta >= 0, "a negative delta");
            async { Ok(()) }
        })
        .await
        .unwrap();
    let mut outcomes: Vec<(i64, Outcome)> = worked.into_iter().map(|w| (w.id, w.outcome)).collect();
    outcomes.sort_by_key(|(id, _)| *id);
    let retrying = Outcome::Retrying { error: "the handler panicked: a negative delta".into() };
    assert_eq!(
        outcomes,
        vec![
            (ids[0], Outcome::Succeeded),
            (ids[1], retrying),
            (ids[2], Outcome::Succeeded),
            (ids[3], Outcome::Succeeded)
        ]
    );
}

/// A message type whose hand-written `Deserialize` panics on a negative delta.
#[derive(Debug, Serialize)]
struct Fragile(i64);

impl<'de> Deserialize<'de> for Fragile {
    fn deserialize<D: serde::Deserializer<'de>>(decoder: D) -> Result<Self, D::Error> {
        let adjustment = Adjustment::deserialize(decoder)?;
        assert!(adjustment.delta >= 0, "cannot decode a negative delta");
        Ok(Fragile(adjustment.delta))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_payload_whose_decoding_panics_is_a_retryable_failure() {
    use sqlstreams_client::testing::Outcome;
    let client = client();
    let name = unique("panic-decode");
    let stream = client.stream::<Adjustment>(name.clone());
    stream.register().await.unwrap();
    let producer = stream.producer();
    let mut ids = Vec::new();
    for delta in [1, -1, 2] {
        ids.push(producer.produce(&adjustment("a", delta), ProduceOptions::default()).await.unwrap().id().unwrap());
    }
    let consumer = client.stream::<Fragile>(name).consumer("g").register(slow_retries(None)).await.unwrap();
    let worked = consumer.work_until_idle(|_d: Delivery<Fragile>| async { Ok(()) }).await.unwrap();
    let mut outcomes: Vec<(i64, Outcome)> = worked.into_iter().map(|w| (w.id, w.outcome)).collect();
    outcomes.sort_by_key(|(id, _)| *id);
    let error = format!("decoding the payload of message {} panicked: cannot decode a negative delta", ids[1]);
    assert_eq!(
        outcomes,
        vec![(ids[0], Outcome::Succeeded), (ids[1], Outcome::Retrying { error }), (ids[2], Outcome::Succeeded)]
    );
}

/// The pool hands out the connection given back last: a consumer's claims keep landing on one
/// warm backend instead of rotating through every pooled one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pool_hands_out_the_connection_given_back_last() {
    let client = client();
    let backend = "SELECT pg_backend_pid()";
    let (first, second) = (client.pool().get().await.unwrap(), client.pool().get().await.unwrap());
    let first_pid: i32 = first.query_one(backend, &[]).await.unwrap().get(0);
    let second_pid: i32 = second.query_one(backend, &[]).await.unwrap().get(0);
    assert_ne!(first_pid, second_pid);
    drop(first);
    drop(second);
    let again = client.pool().get().await.unwrap();
    let again_pid: i32 = again.query_one(backend, &[]).await.unwrap().get(0);
    assert_eq!(again_pid, second_pid, "the connection given back last comes out first");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn graceful_shutdown_finishes_in_flight_handlers() {
    let client = client();
    let stream = client.stream::<Adjustment>(unique("drain"));
    stream.register().await.unwrap();
    let consumer = stream.consumer("g").register(config(None)).await.unwrap();
    let batch: Vec<Adjustment> = (0..5).map(|i| adjustment("a", i)).collect();
    stream.producer().produce_batch(batch.iter().map(|m| (m, None)), BatchOptions::default()).await.unwrap();
    let started: Calls = Arc::default();
    let running = {
        let started = started.clone();
        consumer.start(move |d: Delivery<Adjustment>| {
            let started = started.clone();
            async move {
                started.lock().unwrap().push((d.id, d.attempt));
                tokio::time::sleep(Duration::from_millis(300)).await;
                Ok(())
            }
        })
    };
    eventually("all five running", || started.lock().unwrap().len() == 5).await;
    let report = running.shutdown(Duration::from_secs(10)).await;
    assert!(report.drained);
    assert_eq!(report.metrics.succeeded, 5, "in-flight handlers finished and were acked");
    let conn = client.pool().get().await.unwrap();
    let row =
        conn.query_one("SELECT committed, lag FROM sqlstreams.group_status($1, 'g')", &[&stream.name()]).await.unwrap();
    assert_eq!(row.get::<_, i64>(1), 0, "nothing left behind");
}

/// A handler that waits is not run to its end before the consumer goes on: the next claim goes
/// out, and a message produced later is handled while the first one waits for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_handler_does_not_hold_back_the_next_claim() {
    let client = client();
    let stream = client.stream::<Adjustment>(unique("waits"));
    stream.register().await.unwrap();
    let consumer = stream.consumer("g").register(config(None)).await.unwrap();
    stream.producer().produce(&adjustment("a", 1), ProduceOptions::default()).await.unwrap();
    let (second_ran, order) = (Arc::new(tokio::sync::Notify::new()), Arc::new(Mutex::new(Vec::new())));
    let running = {
        let (second_ran, order) = (second_ran.clone(), order.clone());
        consumer.start(move |d: Delivery<Adjustment>| {
            let (second_ran, order) = (second_ran.clone(), order.clone());
            async move {
                order.lock().unwrap().push(format!("start {}", d.message.delta));
                if d.message.delta == 1 {
                    tokio::time::timeout(Duration::from_secs(20), second_ran.notified())
                        .await
                        .map_err(|_| HandlerError::permanent("the second message never ran"))?;
                } else {
                    second_ran.notify_one();
                }
                order.lock().unwrap().push(format!("end {}", d.message.delta));
                Ok(())
            }
        })
    };
    eventually("the first handler waiting", || order.lock().unwrap().len() == 1).await;
    stream.producer().produce(&adjustment("a", 2), ProduceOptions::default()).await.unwrap();
    eventually("both handled", || running.metrics().succeeded == 2).await;
    running.shutdown(Duration::from_secs(5)).await;
    assert_eq!(*order.lock().unwrap(), ["start 1", "start 2", "end 2", "end 1"]);
}

/// A full claim sends the next claim before its rows run. A consumer told to stop meanwhile
/// gives that claim's rows back at once: another consumer gets them without waiting for their
/// lease (a minute here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_sent_ahead_is_given_back_when_the_consumer_stops() {
    sent_ahead_and_given_back(None).await;
}

/// The same for ordered work: the lanes of the first claim's keys stay held while its rows run,
/// so the claim sent ahead of them takes the other lanes' messages.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_sent_ahead_of_ordered_work_is_given_back_when_the_consumer_stops() {
    sent_ahead_and_given_back(Some(Concurrency::Ordered)).await;
}

/// 300 messages (of 300 keys over the stream's 16 lanes, when `policy` is set) claimed 100 at a
/// time; the consumer is stopped while the first claim's first row runs.
async fn sent_ahead_and_given_back(policy: Option<Concurrency>) {
    let client = client();
    let stream = client.stream::<Adjustment>(unique("ahead"));
    stream.register().await.unwrap();
    let group = stream.consumer("g");
    let settings = ConsumerConfig {
        message_concurrency: 200,
        batch_size: 100,
        lease: Duration::from_secs(60),
        handler_timeout: Duration::from_secs(10),
        ..config(policy)
    };
    let batch: Vec<(Adjustment, String)> = (0..300).map(|i| (adjustment("a", i), format!("k{i}"))).collect();
    let keys = batch.iter().map(|(m, key)| (m, policy.map(|_| key.as_str())));
    stream.producer().produce_batch(keys, BatchOptions::default()).await.unwrap();
    // The first handler holds the claim loop until the test has told the consumer to stop: by
    // then the next claim has gone out.
    let (handler, started_rx, go_tx) = holding_the_first_call();
    let running = group.register(settings.clone()).await.unwrap().start(handler);
    started_rx.recv_timeout(Duration::from_secs(20)).unwrap();
    let mut shutdown = Box::pin(running.shutdown(Duration::from_secs(10)));
    let pending = std::future::poll_fn(|cx| std::task::Poll::Ready(shutdown.as_mut().poll(cx).is_pending())).await;
    assert!(pending, "told to stop, still running the first claim");
    go_tx.send(()).unwrap();
    let report = shutdown.await;
    assert!(report.drained);
    assert_eq!(
        (report.metrics.succeeded, report.metrics.released),
        (100, 100),
        "the first claim ran; the one sent ahead was given back"
    );

    let calls: Calls = Arc::default();
    let next = group.register(settings).await.unwrap().start(record_calls(&calls));
    eventually("the other 200, long before the lease ends", || calls.lock().unwrap().len() == 200).await;
    next.shutdown(Duration::from_secs(5)).await;
    assert!(calls.lock().unwrap().iter().all(|(_, attempt)| *attempt == 0), "a release spends no attempt");
}

/// Once a full claim's rows of parallel work have run, and the claim sent ahead of them is still
/// with the server, the claim after it goes out too, queued behind it: the server does not wait a
/// round trip for the consumer between the two. Here the server is held (the log locked) while it
/// has the second claim after the first's rows: stopped then, the consumer runs the rows of the
/// claim it is waiting for and gives back those of the one queued behind it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_claim_after_next_is_queued_once_a_full_claims_rows_have_run() {
    let client = client();
    let name = unique("queued");
    let stream = client.stream::<Adjustment>(name.clone());
    stream.register().await.unwrap();
    let group = stream.consumer("g");
    // Permits to spare: every claim asks for a whole batch, however many rows still run.
    let settings = ConsumerConfig {
        message_concurrency: 500,
        batch_size: 100,
        lease: Duration::from_secs(60),
        handler_timeout: Duration::from_secs(10),
        ..config(None)
    };
    let batch: Vec<Adjustment> = (0..400).map(|i| adjustment("a", i)).collect();
    stream.producer().produce_batch(batch.iter().map(|m| (m, None)), BatchOptions::default()).await.unwrap();
    // The first handler holds the claim loop until the test has locked the log; the claim sent
    // ahead of the first claim's rows has gone out before them.
    let (handler, started_rx, go_tx) = holding_the_first_call();
    let running = group.register(settings.clone()).await.unwrap().start(handler);
    started_rx.recv_timeout(Duration::from_secs(20)).unwrap();
    let claims = || async {
        let conn = client.pool().get().await.unwrap();
        let sql = "SELECT count(DISTINCT lease_token) FROM sqlstreams.open_leases($1, 'g')";
        conn.query_one(sql, &[&name]).await.unwrap().get::<_, i64>(0)
    };
    eventually_async("the claim sent ahead, committed", || async { claims().await == 2 }).await;
    // Every claim from now on waits for the log.
    let locker = client.pool().get().await.unwrap();
    let id: i64 = locker.query_one("SELECT id FROM sqlstreams.streams WHERE name = $1", &[&name]).await.unwrap().get(0);
    locker
        .batch_execute(&format!("BEGIN; LOCK TABLE sqlstreams.message_log_{id} IN ACCESS EXCLUSIVE MODE"))
        .await
        .unwrap();
    go_tx.send(()).unwrap();
    // The third claim, sent once the first's rows have run, waits for the log; the second's
    // rows run, and then the fourth claim is queued behind the third (before the rows are counted).
    eventually("the first two claims' rows", || running.metrics().succeeded == 200).await;
    let mut shutdown = Box::pin(running.shutdown(Duration::from_secs(20)));
    let pending = std::future::poll_fn(|cx| std::task::Poll::Ready(shutdown.as_mut().poll(cx).is_pending())).await;
    assert!(pending, "told to stop, still waiting for the third claim");
    locker.batch_execute("COMMIT").await.unwrap();
    let report = shutdown.await;
    assert!(report.drained);
    // The third claim's rows ran (or were given back too, when the stop reached the loop before
    // it waited for that claim); the fourth, queued behind it, was given back.
    let (succeeded, released) = (report.metrics.succeeded, report.metrics.released);
    assert!(
        succeeded + released == 400 && released >= 100,
        "every row ran or was given back, the fourth claim's among them: {succeeded} ran, {released} given back"
    );

    let calls: Calls = Arc::default();
    let next = group.register(settings).await.unwrap().start(record_calls(&calls));
    let rest = released as usize;
    eventually("the rows given back, long before the lease ends", || calls.lock().unwrap().len() == rest).await;
    next.shutdown(Duration::from_secs(5)).await;
    assert!(calls.lock().unwrap().iter().all(|(_, attempt)| *attempt == 0), "a release spends no attempt");
}

/// A claim that finds nothing while the one queued behind it is in flight: the consumer lands
/// that one before it waits, so a message produced meanwhile wakes it (here a poll would take a
/// minute).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_lands_the_claim_queued_behind_before_it_waits() {
    let client = client();
    let stream = client.stream::<Adjustment>(unique("landed"));
    stream.register().await.unwrap();
    let settings = ConsumerConfig {
        message_concurrency: 500,
        batch_size: 100,
        poll_interval: Duration::from_secs(60),
        lease: Duration::from_secs(60),
        handler_timeout: Duration::from_secs(10),
        ..config(None)
    };
    // One full claim: the claim sent ahead of its rows and the one queued behind it find nothing.
    let batch: Vec<Adjustment> = (0..100).map(|i| adjustment("a", i)).collect();
    stream.producer().produce_batch(batch.iter().map(|m| (m, None)), BatchOptions::default()).await.unwrap();
    let calls: Calls = Arc::default();
    let running = stream.consumer("g").register(settings).await.unwrap().start(record_calls(&calls));
    eventually("the first hundred", || calls.lock().unwrap().len() == 100).await;
    stream.producer().produce(&adjustment("a", 100), ProduceOptions::default()).await.unwrap();
    eventually("the one produced after them, woken by its notification", || calls.lock().unwrap().len() == 101).await;
    running.shutdown(Duration::from_secs(5)).await;
}

/// A claim sent ahead of ordered rows finds nothing when their lane is the only one with work:
/// the consumer then waits for those rows and claims again with their acks, rather than for a
/// notification (the client's sessions send none here) or a poll (a minute). Four claims of 100
/// from one lane: the first and the third send one ahead (the second sends none after a miss).
/// Two, as a consumer that went idle after the first would be woken anyway: by its listener,
/// which wakes it once when it starts listening.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_sent_ahead_of_ordered_rows_that_finds_nothing_waits_for_them() {
    let url = database_url();
    let quiet = format!("{url}{}options=-c%20sqlstreams.notify%3Doff", if url.contains('?') { '&' } else { '?' });
    let client = Client::connect(&quiet).unwrap();
    client.pool().get().await.unwrap().batch_execute(sqlstreams_tests::CREATE_EXTENSION).await.unwrap();
    let stream = client.stream::<Adjustment>(unique("one-lane"));
    let create = "SELECT sqlstreams.create_stream($1, lanes => 1)";
    client.pool().get().await.unwrap().execute(create, &[&stream.name()]).await.unwrap();
    let batch: Vec<(Adjustment, String)> = (0..400).map(|i| (adjustment("a", i), format!("k{i}"))).collect();
    let keys = batch.iter().map(|(m, key)| (m, Some(key.as_str())));
    stream.producer().produce_batch(keys, BatchOptions::default()).await.unwrap();
    let settings = ConsumerConfig {
        message_concurrency: 200,
        batch_size: 100,
        poll_interval: Duration::from_secs(60),
        lease: Duration::from_secs(60),
        handler_timeout: Duration::from_secs(10),
        ..config(Some(Concurrency::Ordered))
    };
    let calls: Calls = Arc::default();
    let running = {
        let calls = calls.clone();
        // Each handler waits: a claim's rows are still running when the claim sent ahead of
        // them comes back.
        stream.consumer("g").register(settings).await.unwrap().start(move |d: Delivery<Adjustment>| {
            let calls = calls.clone();
            async move {
                tokio::time::sleep(Duration::from_millis(20)).await;
                calls.lock().unwrap().push((d.id, d.attempt));
                Ok(())
            }
        })
    };
    eventually("all 400, long before a poll", || calls.lock().unwrap().len() == 400).await;
    running.shutdown(Duration::from_secs(5)).await;
}

/// On a pool of one connection, a consumer draining a backlog queues no claim behind another,
/// and one told to stop gives back what it had in flight: the writer gets the connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_on_a_pool_of_one_stops_while_draining() {
    let setup = client();
    let one = Client::with_pool_size(&database_url(), 1).unwrap();
    let name = unique("one");
    let stream = one.stream::<Adjustment>(name.clone());
    setup.stream::<Adjustment>(name).register().await.unwrap();
    let batch: Vec<Adjustment> = (0..2000).map(|i| adjustment("a", i)).collect();
    stream.producer().produce_batch(batch.iter().map(|m| (m, None)), BatchOptions::default()).await.unwrap();
    let settings = ConsumerConfig { message_concurrency: 500, batch_size: 100, ..config(None) };
    let calls: Calls = Arc::default();
    let running = stream.consumer("g").register(settings.clone()).await.unwrap().start(record_calls(&calls));
    eventually("some of the backlog", || calls.lock().unwrap().len() >= 300).await;
    let report = tokio::time::timeout(Duration::from_secs(20), running.shutdown(Duration::from_secs(5)))
        .await
        .expect("a consumer on a pool of one connection stops");
    assert!(report.drained);
    let handled = report.metrics.succeeded as usize;
    assert_eq!(handled, calls.lock().unwrap().len());
    assert_eq!(report.metrics.claimed, report.metrics.succeeded + report.metrics.released);

    let rest: Calls = Arc::default();
    let next = stream.consumer("g").register(settings).await.unwrap().start(record_calls(&rest));
    eventually("the rest, long before the lease ends", || rest.lock().unwrap().len() == 2000 - handled).await;
    next.shutdown(Duration::from_secs(5)).await;
}

/// An outcome whose session the server ends (`pg_terminate_backend`, a fast shutdown: 57P01) is
/// written again on a new connection, not dropped. Here an ordered key's two acks wait for a
/// lock held by the test, which terminates every session waiting for it until one was writing
/// them; once the lock goes they land, long before the lease (a minute) would run the key again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outcomes_whose_session_is_terminated_are_written_again() {
    outcomes_interrupted_are_written_again("pg_terminate_backend").await;
}

/// The same with the statement cancelled (`pg_cancel_backend`: 57014), which is sent again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outcomes_cancelled_are_written_again() {
    outcomes_interrupted_are_written_again("pg_cancel_backend").await;
}

async fn outcomes_interrupted_are_written_again(interrupt: &str) {
    let client = client();
    let name = unique("terminated");
    let stream = client.stream::<Adjustment>(name.clone());
    stream.register().await.unwrap();
    let batch: Vec<Adjustment> = (0..2).map(|i| adjustment("k", i)).collect();
    let ids =
        stream.producer().produce_batch(batch.iter().map(|m| (m, Some("k"))), BatchOptions::default()).await.unwrap();
    let settings = ConsumerConfig {
        lease: Duration::from_secs(60),
        poll_interval: Duration::from_secs(60),
        ..config(Some(Concurrency::Ordered))
    };
    let calls: Calls = Arc::default();
    let (holding, started_rx, go_tx) = holding_the_first_call();
    let running = {
        let calls = calls.clone();
        stream.consumer("g").register(settings).await.unwrap().start(move |d: Delivery<Adjustment>| {
            calls.lock().unwrap().push((d.id, d.attempt));
            holding(d)
        })
    };
    started_rx.recv_timeout(Duration::from_secs(20)).unwrap();
    // Every outcome from now on waits for the range table. (The test's sessions are its own: a
    // pool shared with the consumer could hand it one of those it terminates.)
    let admin = self::client();
    let locker = admin.pool().get().await.unwrap();
    let id: i64 = locker.query_one("SELECT id FROM sqlstreams.streams WHERE name = $1", &[&name]).await.unwrap().get(0);
    locker
        .batch_execute(&format!("BEGIN; LOCK TABLE sqlstreams.range_lease_{id} IN ACCESS EXCLUSIVE MODE"))
        .await
        .unwrap();
    let locker_pid: i32 = locker.query_one("SELECT pg_backend_pid()", &[]).await.unwrap().get(0);
    go_tx.send(()).unwrap();
    let killer = admin.pool().get().await.unwrap();
    let waiting = "SELECT pid, query FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))";
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        assert!(tokio::time::Instant::now() < deadline, "timed out waiting for the acks to wait for the lock");
        let mut wrote_acks = false;
        for row in killer.query(waiting, &[&locker_pid]).await.unwrap() {
            killer.execute(&format!("SELECT {interrupt}($1)"), &[&row.get::<_, i32>(0)]).await.unwrap();
            wrote_acks |= row.get::<_, &str>(1).contains("ack_batch");
        }
        if wrote_acks {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    locker.batch_execute("COMMIT").await.unwrap();
    let settled = || async {
        let conn = admin.pool().get().await.unwrap();
        let sql = "SELECT lag = 0 AND NOT EXISTS (SELECT FROM sqlstreams.open_leases($1, 'g'))
                   FROM sqlstreams.group_status($1, 'g')";
        conn.query_one(sql, &[&name]).await.unwrap().get::<_, bool>(0)
    };
    eventually_async("both acks, long before the lease ends", settled).await;
    running.shutdown(Duration::from_secs(5)).await;
    assert_eq!(*calls.lock().unwrap(), vec![(ids[0], 0), (ids[1], 0)], "each ran once, in order");
}

/// A consumer stopped past its grace stops even when the database cannot take its outcomes:
/// they have two more seconds, and are then given up (their messages run again after their
/// lease). Here its ack waits for a row the test keeps locked until the consumer has stopped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_past_its_grace_does_not_wait_for_outcomes_the_database_cannot_take() {
    let client = client();
    let name = unique("untaken");
    let stream = client.stream::<Adjustment>(name.clone());
    stream.register().await.unwrap();
    stream.producer().produce(&adjustment("a", 1), ProduceOptions::default()).await.unwrap();
    let settings =
        ConsumerConfig { lease: Duration::from_secs(60), poll_interval: Duration::from_secs(60), ..config(None) };
    let (handler, started_rx, go_tx) = holding_the_first_call();
    let running = stream.consumer("g").register(settings).await.unwrap().start(handler);
    started_rx.recv_timeout(Duration::from_secs(20)).unwrap();
    // The claim's range row, locked: its ack waits; the consumer's empty claims do not.
    let admin = self::client();
    let locker = admin.pool().get().await.unwrap();
    let id: i64 = locker.query_one("SELECT id FROM sqlstreams.streams WHERE name = $1", &[&name]).await.unwrap().get(0);
    locker.batch_execute(&format!("BEGIN; SELECT FROM sqlstreams.range_lease_{id} FOR UPDATE")).await.unwrap();
    let locker_pid: i32 = locker.query_one("SELECT pg_backend_pid()", &[]).await.unwrap().get(0);
    go_tx.send(()).unwrap();
    let waiting = || async {
        let conn = admin.pool().get().await.unwrap();
        let sql = "SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))";
        conn.query_one(sql, &[&locker_pid]).await.unwrap().get::<_, i64>(0) > 0
    };
    eventually_async("the ack, waiting for the locked row", waiting).await;
    let report = tokio::time::timeout(Duration::from_secs(20), running.shutdown(Duration::from_millis(100)))
        .await
        .expect("the consumer stops while its ack still waits");
    assert!(!report.drained);
    locker.batch_execute("ROLLBACK").await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn shutdown_past_its_grace_cancels_and_gives_back_the_rest() {
    let client = client();
    let stream = client.stream::<Adjustment>(unique("cancel"));
    stream.register().await.unwrap();
    let group = stream.consumer("g");
    let consumer = group.register(config(Some(Concurrency::Ordered))).await.unwrap();
    let batch: Vec<Adjustment> = (0..3).map(|i| adjustment("k", i)).collect();
    let ids =
        stream.producer().produce_batch(batch.iter().map(|m| (m, Some("k"))), BatchOptions::default()).await.unwrap();
    let started: Calls = Arc::default();
    let running = {
        let started = started.clone();
        consumer.start(move |d: Delivery<Adjustment>| {
            let started = started.clone();
            async move {
                started.lock().unwrap().push((d.id, d.attempt));
                d.cancelled().await; // finishes only when told to stop
                Ok(())
            }
        })
    };
    eventually("the first of the chain running", || started.lock().unwrap().len() == 1).await;
    let report = running.shutdown(Duration::from_millis(100)).await;
    assert!(!report.drained);
    assert_eq!((report.metrics.succeeded, report.metrics.released), (1, 2), "the rest of the chain is given back");

    // Nothing is lost: another consumer gets the rest, in order, with no attempt spent.
    let calls: Calls = Arc::default();
    let next = group.register(config(Some(Concurrency::Ordered))).await.unwrap().start(record_calls(&calls));
    eventually("the rest", || calls.lock().unwrap().len() == 2).await;
    next.shutdown(Duration::from_secs(5)).await;
    assert_eq!(*calls.lock().unwrap(), vec![(ids[1], 0), (ids[2], 0)]);
}

#[test]
fn a_crashed_consumers_messages_are_redelivered_after_its_lease() {
    let client = client();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let stream = client.stream::<Adjustment>(unique("crash"));
    let group = stream.consumer("g");
    let short =
        ConsumerConfig { lease: Duration::from_secs(2), handler_timeout: Duration::from_secs(1), ..config(None) };
    let ids = runtime.block_on(async {
        stream.register().await.unwrap();
        let batch: Vec<Adjustment> = (0..3).map(|i| adjustment("a", i)).collect();
        stream.producer().produce_batch(batch.iter().map(|m| (m, None)), BatchOptions::default()).await.unwrap()
    });

    // Consumer A claims the batch and dies with its handlers running (its whole runtime goes,
    // and its client with it: a crashed process shares no connection with the survivor).
    let started = Arc::new(Mutex::new(0));
    let crashing = tokio::runtime::Runtime::new().unwrap();
    let crashing_client = Client::connect(&database_url()).unwrap();
    let crashing_group = crashing_client.stream::<Adjustment>(stream.name().to_string()).consumer("g");
    crashing.block_on(async {
        let consumer = crashing_group.register(short.clone()).await.unwrap();
        let counter = started.clone();
        let _running = consumer.start(move |_d: Delivery<Adjustment>| {
            let started = counter.clone();
            async move {
                *started.lock().unwrap() += 1;
                std::future::pending::<()>().await;
                Ok(())
            }
        });
        eventually("A runs all three", || *started.lock().unwrap() == 3).await;
    });
    crashing.shutdown_background();

    // Consumer B gets them once A's lease has expired, as second attempts.
    let calls: Calls = Arc::default();
    runtime.block_on(async {
        let calls2 = calls.clone();
        let b = group.register(short).await.unwrap().start(move |d: Delivery<Adjustment>| {
            let calls = calls2.clone();
            async move {
                calls.lock().unwrap().push((d.id, d.attempt));
                Ok(())
            }
        });
        eventually("B redelivers", || calls.lock().unwrap().len() == 3).await;
        b.shutdown(Duration::from_secs(5)).await;
    });
    let mut got = calls.lock().unwrap().clone();
    got.sort();
    assert_eq!(got, ids.iter().map(|id| (*id, 1)).collect::<Vec<_>>());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn message_concurrency_bounds_handlers_and_a_hot_key_stays_serial() {
    let client = client();
    let stream = client.stream::<Adjustment>(unique("bounded"));
    stream.register().await.unwrap();
    let consumer = stream
        .consumer("g")
        .register(ConsumerConfig { message_concurrency: 3, ..config(Some(Concurrency::Ordered)) })
        .await
        .unwrap();
    let mut messages: Vec<(Adjustment, Option<String>)> = (0..24).map(|i| (adjustment("free", i), None)).collect();
    messages.extend((0..12).map(|i| (adjustment("hot", i), Some("hot".to_string()))));
    stream
        .producer()
        .produce_batch(messages.iter().map(|(m, k)| (m, k.as_deref())), BatchOptions::default())
        .await
        .unwrap();
    let in_flight = Arc::new(Mutex::new((0usize, 0usize, 0usize, 0usize))); // (now, max, hot now, hot max)
    let hot_order: Arc<Mutex<Vec<i64>>> = Arc::default();
    let running = {
        let (in_flight, hot_order) = (in_flight.clone(), hot_order.clone());
        consumer.start(move |d: Delivery<Adjustment>| {
            let (in_flight, hot_order) = (in_flight.clone(), hot_order.clone());
            async move {
                let hot = d.key.as_deref() == Some("hot");
                {
                    let mut f = in_flight.lock().unwrap();
                    f.0 += 1;
                    f.1 = f.1.max(f.0);
                    if hot {
                        f.2 += 1;
                        f.3 = f.3.max(f.2);
                        hot_order.lock().unwrap().push(d.message.delta);
                    }
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
                let mut f = in_flight.lock().unwrap();
                f.0 -= 1;
                if hot {
                    f.2 -= 1;
                }
                Ok(())
            }
        })
    };
    eventually("everything ran", || running.metrics().succeeded == 36).await;
    running.shutdown(Duration::from_secs(5)).await;
    let f = *in_flight.lock().unwrap();
    assert!(f.1 <= 3, "at most 3 handlers at once, saw {}", f.1);
    assert_eq!(f.3, 1, "the hot key never ran twice at once");
    assert_eq!(*hot_order.lock().unwrap(), (0..12).collect::<Vec<_>>());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn notifications_wake_an_idle_consumer_without_polling() {
    let client = client();
    let stream = client.stream::<Adjustment>(unique("wake"));
    stream.register().await.unwrap();
    // A poll interval far longer than the test: only a notification can wake it.
    let slow_poll = ConsumerConfig { poll_interval: Duration::from_secs(600), ..config(Some(Concurrency::Ordered)) };
    let group = stream.consumer("g");
    let calls: Calls = Arc::default();
    let gate = Arc::new(tokio::sync::Notify::new());
    let start = |gate: Arc<tokio::sync::Notify>, calls: Calls, wait_first: bool| {
        move |d: Delivery<Adjustment>| {
            let (gate, calls) = (gate.clone(), calls.clone());
            async move {
                if wait_first && d.message.delta == 1 {
                    gate.notified().await;
                }
                calls.lock().unwrap().push((d.id, d.attempt));
                Ok(())
            }
        }
    };
    let a = group.register(slow_poll.clone()).await.unwrap().start(start(gate.clone(), calls.clone(), true));
    tokio::time::sleep(Duration::from_millis(300)).await; // A is idle now
    let producer = stream.producer();
    let first = producer.produce(&adjustment("k", 1), keyed("k")).await.unwrap().id().unwrap();
    eventually("A woken by the produce", || a.metrics().claimed == 1).await;

    // B is woken by the successor's produce while A still runs the first: the key's lane is
    // A's, so B gets nothing and goes idle again. When A's ack frees the lane, the notification
    // wakes whoever is idle (with a 10-minute poll interval, only it can).
    let b = group.register(slow_poll).await.unwrap().start(start(gate.clone(), calls.clone(), false));
    let second = producer.produce(&adjustment("k", 2), keyed("k")).await.unwrap().id().unwrap();
    eventually("the key's lane held by A", || futures_lite_block(held_lanes(&client, stream.name(), "g")) == 1).await;
    assert!(calls.lock().unwrap().is_empty(), "nothing ran beside the first");
    gate.notify_one();
    eventually("both ran, in order", || calls.lock().unwrap().len() == 2).await;
    assert_eq!(*calls.lock().unwrap(), vec![(first, 0), (second, 0)]);
    a.shutdown(Duration::from_secs(5)).await;
    b.shutdown(Duration::from_secs(5)).await;
}

/// Calls of `sqlstreams.<function>` counted so far by sessions that track them.
async fn function_calls(client: &Client, function: &str) -> i64 {
    let conn = client.pool().get().await.unwrap();
    conn.query_one(
        "SELECT coalesce(sum(calls), 0)::int8 FROM pg_stat_user_functions WHERE schemaname = 'sqlstreams' AND funcname = $1",
        &[&function],
    )
    .await
    .unwrap()
    .get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_idle_consumer_asks_next_due_only_after_something_changed() {
    // Function statistics are the database's: a database of its own, whose only sessions
    // tracking function calls are this consumer's.
    let url = tokio::task::spawn_blocking(|| sqlstreams_tests::own_database("idle_due").1).await.unwrap();
    let tracked = Client::connect(&format!("{url}?options=-c%20track_functions%3Dall")).unwrap();
    let client = Client::connect(&url).unwrap();
    let stream = tracked.stream::<Adjustment>(unique("idle-due"));
    stream.register().await.unwrap();
    let fast_poll = ConsumerConfig { poll_interval: Duration::from_millis(20), ..config(None) };
    let consumer = stream.consumer("g").register(fast_poll).await.unwrap();
    let before = (function_calls(&client, "claim_with_metadata").await, function_calls(&client, "next_due").await);
    let running = consumer.start(|_: Delivery<Adjustment>| async { Ok(()) });
    // Statistics reach the view when a session flushes them (at most once a second while busy).
    eventually_async("30 idle claims counted", || async {
        function_calls(&client, "claim_with_metadata").await - before.0 >= 30
    })
    .await;
    let asked = function_calls(&client, "next_due").await - before.1;
    assert!(asked <= 2, "nothing changed between the idle claims, yet next_due was asked {asked} times");
    // A produce notifies: the consumer claims it, and asks again when it is idle again.
    stream.producer().produce(&adjustment("k", 1), keyed("k")).await.unwrap();
    eventually("the message ran", || running.metrics().succeeded == 1).await;
    eventually_async("next_due asked again", || async { function_calls(&client, "next_due").await - before.1 > asked })
        .await;
    running.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_idle_consumer_wakes_when_its_retry_falls_due_without_polling() {
    let client = client();
    let stream = client.stream::<Adjustment>(unique("due"));
    stream.register().await.unwrap();
    // Nothing notifies when a retry falls due, and the poll interval is far longer than the
    // test: only sleeping until sqlstreams.next_due brings the retry.
    let slow_poll = ConsumerConfig { poll_interval: Duration::from_secs(600), ..config(Some(Concurrency::Ordered)) };
    let consumer = stream.consumer("g").register(slow_poll).await.unwrap();
    let id = stream.producer().produce(&adjustment("k", 1), keyed("k")).await.unwrap().id().unwrap();
    let calls: Calls = Arc::default();
    let running = {
        let calls = calls.clone();
        consumer.start(move |d: Delivery<Adjustment>| {
            let calls = calls.clone();
            async move {
                calls.lock().unwrap().push((d.id, d.attempt));
                if d.attempt == 0 {
                    return Err(HandlerError::retry("not yet"));
                }
                Ok(())
            }
        })
    };
    eventually("the retry ran", || calls.lock().unwrap().len() == 2).await;
    running.shutdown(Duration::from_secs(5)).await;
    assert_eq!(*calls.lock().unwrap(), vec![(id, 0), (id, 1)]);
}

/// Runs a future to completion from a synchronous closure (used inside `eventually`).
fn futures_lite_block<F: std::future::Future>(future: F) -> F::Output {
    tokio::task::block_in_place(|| tokio::runtime::Handle::current().block_on(future))
}

/// The client over TLS when the URL asks for it (`sslmode=require`), verifying the server
/// against the rig's throwaway CA: its pool and its LISTEN connection both.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_client_connects_over_tls_when_the_url_asks() {
    let _installed = client();
    let Some(ca) = test_ca() else { return };
    let url = format!("{}?sslmode=require", database_url());
    let options = ClientOptions { ssl_root_cert: Some(ca.into()), ..Default::default() };
    let tls = Client::connect_with(&url, options).unwrap();
    let stream = tls.stream::<Adjustment>(unique("tls"));
    stream.register().await.unwrap();
    let consumer = stream.consumer("g").register(config(None)).await.unwrap();
    let calls: Calls = Arc::default();
    let running = consumer.start(record_calls(&calls));
    stream.producer().produce(&adjustment("acct-1", 1), ProduceOptions::default()).await.unwrap();
    eventually("delivered over TLS", || calls.lock().unwrap().len() == 1).await;
    let conn = tls.pool().get().await.unwrap();
    let row = conn
        .query_one(
            "SELECT (SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()),
                    (SELECT count(*) FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid)
                     WHERE a.query LIKE 'LISTEN %' AND s.ssl)",
            &[],
        )
        .await
        .unwrap();
    assert!(row.get::<_, bool>(0), "a pooled connection is encrypted");
    assert!(row.get::<_, i64>(1) >= 1, "the LISTEN connection is encrypted");
    drop(conn);
    running.shutdown(Duration::from_secs(5)).await;

    // Without the CA the server's certificate is not trusted, and nothing connects.
    let options = ClientOptions { pool_size: 1, ssl_root_cert: None, ..Default::default() };
    let untrusted = Client::connect_with(&url, options).unwrap();
    let err = untrusted.pool().get().await.expect_err("an unverified server");
    assert!(format!("{err:?}").to_lowercase().contains("certificate"), "{err:?}");
}

/// Registering a group that exists with other settings is refused, naming them, unless the
/// configuration says to replace them: a consumer started with defaults never silently turns
/// an ordered group parallel.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn register_refuses_other_settings_unless_told_to_replace_them() {
    let client = client();
    let stream = client.stream::<Adjustment>(unique("settings"));
    stream.register().await.unwrap();
    let group = stream.consumer("apply-balance");
    group.register(config(Some(Concurrency::Ordered))).await.unwrap();
    group.register(config(Some(Concurrency::Ordered))).await.expect("the same settings register again");
    let err = group.register(config(None)).await.err().expect("a parallel consumer of an ordered group");
    match &err {
        sqlstreams_client::Error::SettingsMismatch { differences, .. } => {
            assert_eq!(differences, &vec!["concurrency_override: Some(\"ordered\") → None".to_string()]);
        }
        other => panic!("expected SettingsMismatch, got {other:?}"),
    }
    let conn = client.pool().get().await.unwrap();
    let policy =
        "SELECT concurrency_override FROM sqlstreams.consumer_groups WHERE stream = $1 AND name = 'apply-balance'";
    let stored: Option<String> = conn.query_one(policy, &[&stream.name()]).await.unwrap().get(0);
    assert_eq!(stored.as_deref(), Some("ordered"), "nothing changed");
    group.register(ConsumerConfig { update_settings: true, ..config(None) }).await.unwrap();
    let stored: Option<String> = conn.query_one(policy, &[&stream.name()]).await.unwrap().get(0);
    assert_eq!(stored, None);
}

/// A transactional handler's writes commit with its ack, and roll back with its failure.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_transactional_handler_commits_its_writes_with_the_ack() {
    let client = client();
    let stream = client.stream::<Adjustment>(unique("tx"));
    stream.register().await.unwrap();
    let table = format!("public.applied_{}", stream.name().replace(['.', '-'], "_"));
    let conn = client.pool().get().await.unwrap();
    conn.batch_execute(&format!("CREATE TABLE {table} (id bigint, attempt int)")).await.unwrap();
    let producer = stream.producer();
    let ok = producer.produce(&adjustment("acct-1", 1), keyed("acct-1")).await.unwrap().id().unwrap();
    let flaky = producer.produce(&adjustment("acct-2", -1), keyed("acct-2")).await.unwrap().id().unwrap();
    let consumer = stream.consumer("g").register(config(None)).await.unwrap();
    let insert = format!("INSERT INTO {table} VALUES ($1, $2)");
    let running = consumer.start_in_transaction(move |d: Delivery<Adjustment>, tx: sqlstreams_client::Tx| {
        let insert = insert.clone();
        async move {
            tx.execute(&insert, &[&d.id, &(d.attempt as i32)]).await?;
            if d.message.delta < 0 && d.attempt == 0 {
                return Err(HandlerError::retry_after("declined the first time", Duration::ZERO));
            }
            Ok(())
        }
    });
    let done = Arc::new(Mutex::new(false));
    let query = format!("SELECT id, attempt FROM {table} ORDER BY id, attempt");
    for _ in 0..300 {
        let rows = conn.query(&query, &[]).await.unwrap();
        if rows.len() >= 2 {
            *done.lock().unwrap() = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let report = running.shutdown(Duration::from_secs(5)).await;
    assert!(*done.lock().unwrap(), "both messages applied");
    let rows: Vec<(i64, i32)> = conn.query(&query, &[]).await.unwrap().iter().map(|r| (r.get(0), r.get(1))).collect();
    assert_eq!(rows, vec![(ok, 0), (flaky, 1)], "the failed attempt's write rolled back with it");
    assert_eq!((report.metrics.succeeded, report.metrics.failed), (2, 1));
    assert!(exception_statuses(&client, stream.name(), "g").await.is_empty(), "both acked in their transactions");
}

/// A consumer whose group is dropped stops with the error instead of retrying for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_whose_group_is_dropped_stops_with_the_error() {
    let client = client();
    let stream = client.stream::<Adjustment>(unique("dropped"));
    stream.register().await.unwrap();
    let consumer = stream.consumer("g").register(config(None)).await.unwrap();
    let calls: Calls = Arc::default();
    let running = consumer.start(record_calls(&calls));
    let conn = client.pool().get().await.unwrap();
    conn.query_one("SELECT sqlstreams.drop_group($1, 'g')", &[&stream.name()]).await.unwrap();
    stream.producer().produce(&adjustment("a", 1), ProduceOptions::default()).await.unwrap();
    let ended = tokio::time::timeout(Duration::from_secs(30), running.join()).await.expect("the consumer stops");
    let error = ended.error.expect("with the reason");
    assert!(error.is_unknown_object(), "{error:?}");
}

/// 32 consumers on one client of 16 connections all make progress: none holds a connection
/// while it waits.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn thirty_two_consumers_share_one_client() {
    let client = client();
    let stream = client.stream::<Adjustment>(unique("many"));
    stream.register().await.unwrap();
    let calls: Calls = Arc::default();
    let mut running = Vec::new();
    for i in 0..32 {
        let consumer = stream.consumer(format!("g{i}")).register(config(None)).await.unwrap();
        running.push(consumer.start(record_calls(&calls)));
    }
    for i in 0..5 {
        stream.producer().produce(&adjustment("a", i), ProduceOptions::default()).await.unwrap();
    }
    eventually("every group got every message", || calls.lock().unwrap().len() == 32 * 5).await;
    for r in running {
        assert_eq!(r.shutdown(Duration::from_secs(5)).await.metrics.succeeded, 5);
    }
}

/// The test binary's one metrics recorder.
fn snapshotter() -> &'static metrics_util::debugging::Snapshotter {
    use metrics_util::debugging::{DebuggingRecorder, Snapshotter};
    static SNAPSHOTTER: std::sync::OnceLock<Snapshotter> = std::sync::OnceLock::new();
    SNAPSHOTTER.get_or_init(|| {
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        recorder.install().expect("the only recorder of this test binary");
        snapshotter
    })
}

/// A gauge's value for `stream`, if it was set.
fn gauge(name: &str, stream: &str) -> Option<f64> {
    snapshotter().snapshot().into_vec().into_iter().find_map(|(key, _, _, value)| {
        let mine = key.key().name() == name && key.key().labels().any(|l| l.key() == "stream" && l.value() == stream);
        match value {
            metrics_util::debugging::DebugValue::Gauge(v) if mine => Some(v.into_inner()),
            _ => None,
        }
    })
}

/// Deliveries, outcomes and timings reach the `metrics` facade, labelled by stream and group.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumers_report_through_the_metrics_facade() {
    use metrics_util::debugging::DebugValue;
    let snapshotter = snapshotter();
    let client = client();
    let stream = client.stream::<Adjustment>(unique("metrics"));
    stream.register().await.unwrap();
    let consumer = stream.consumer("g").register(config(None)).await.unwrap();
    let calls: Calls = Arc::default();
    let running = consumer.start(record_calls(&calls));
    for i in 0..3 {
        stream.producer().produce(&adjustment("a", i), ProduceOptions::default()).await.unwrap();
    }
    eventually("three handled", || calls.lock().unwrap().len() == 3).await;
    running.shutdown(Duration::from_secs(5)).await;
    let mut succeeded = 0;
    let mut handler_samples = 0;
    for (key, _, _, value) in snapshotter.snapshot().into_vec() {
        let labels: Vec<(String, String)> =
            key.key().labels().map(|l| (l.key().to_string(), l.value().to_string())).collect();
        if !labels.contains(&("stream".into(), stream.name().to_string())) {
            continue;
        }
        match (key.key().name(), value) {
            ("sqlstreams_deliveries_total", DebugValue::Counter(n))
                if labels.contains(&("outcome".into(), "succeeded".into())) =>
            {
                succeeded += n
            }
            ("sqlstreams_handler_seconds", DebugValue::Histogram(samples)) => handler_samples += samples.len(),
            _ => {}
        }
    }
    assert_eq!((succeeded, handler_samples), (3, 3));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn headers_produced_at_and_deliver_after_reach_the_handler() {
    let client = client();
    let stream = client.stream::<Adjustment>(unique("headers"));
    stream.register().await.unwrap();
    let consumer = stream.consumer("g").register(config(None)).await.unwrap();
    let producer = stream.producer();
    let mut trace = sqlstreams_client::Headers::new();
    trace.insert("traceparent".into(), "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into());
    let traced = ProduceOptions { headers: Some(trace.clone()), ..keyed("a") };
    let one = producer.produce(&adjustment("a", 1), traced).await.unwrap().id().unwrap();
    let plain = producer.produce(&adjustment("b", 2), keyed("b")).await.unwrap().id().unwrap();
    let mut tenant = sqlstreams_client::Headers::new();
    tenant.insert("tenant".into(), 7.into());
    let batch_options = BatchOptions { headers: Some(tenant.clone()), ..Default::default() };
    let (c, d) = (adjustment("c", 3), adjustment("d", 4));
    let batch = producer.produce_batch([(&c, Some("c")), (&d, Some("d"))], batch_options).await.unwrap();
    let wait = Duration::from_millis(300);
    let delayed_options = ProduceOptions { deliver_after: Some(wait), ..keyed("e") };
    let delayed = producer.produce(&adjustment("e", 5), delayed_options).await.unwrap().id().unwrap();

    type Seen = Arc<Mutex<Vec<(i64, sqlstreams_client::Headers, std::time::SystemTime, std::time::SystemTime)>>>;
    let seen: Seen = Arc::default();
    let running = {
        let seen = seen.clone();
        consumer.start(move |d: Delivery<Adjustment>| {
            seen.lock().unwrap().push((d.id, d.headers.clone(), d.produced_at, std::time::SystemTime::now()));
            std::future::ready(Ok::<(), HandlerError>(()))
        })
    };
    eventually("all five", || seen.lock().unwrap().len() == 5).await;
    running.shutdown(Duration::from_secs(5)).await;
    let seen = seen.lock().unwrap();
    let by_id = |id: i64| seen.iter().find(|s| s.0 == id).unwrap().clone();
    assert_eq!(by_id(one).1, trace);
    assert!(by_id(plain).1.is_empty());
    assert_eq!((by_id(batch[0]).1, by_id(batch[1]).1), (tenant.clone(), tenant));
    let (_, _, produced_at, ran_at) = by_id(delayed);
    assert!(ran_at >= produced_at + wait, "delivered {:?} after it was produced", ran_at.duration_since(produced_at));
    let age = std::time::SystemTime::now().duration_since(by_id(plain).2).unwrap();
    assert!(age < Duration::from_secs(60), "produced_at is the producer's time, {age:?} ago");
}

/// The lag gauges follow the group: three messages waiting, then none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_lag_gauges_follow_the_group() {
    let _recorder = snapshotter();
    let client = client();
    let stream = client.stream::<Adjustment>(unique("lag"));
    stream.register().await.unwrap();
    let lag_config = ConsumerConfig { lag_interval: Some(Duration::from_millis(20)), ..config(None) };
    let consumer = stream.consumer("g").register(lag_config).await.unwrap();
    for i in 0..3 {
        stream.producer().produce(&adjustment("a", i), ProduceOptions::default()).await.unwrap();
    }
    let release = Arc::new(tokio::sync::Semaphore::new(0));
    let running = {
        let release = release.clone();
        consumer.start(move |_d: Delivery<Adjustment>| {
            let release = release.clone();
            async move {
                release.acquire().await.unwrap().forget(); // held until the test saw the lag
                Ok(())
            }
        })
    };
    let name = stream.name().to_string();
    eventually("lag 3", || gauge("sqlstreams_lag_messages", &name) == Some(3.0)).await;
    assert!(gauge("sqlstreams_oldest_unresolved_seconds", &name).is_some_and(|age| age >= 0.0));
    release.add_permits(3);
    eventually("lag 0", || gauge("sqlstreams_lag_messages", &name) == Some(0.0)).await;
    assert_eq!(gauge("sqlstreams_oldest_unresolved_seconds", &name), Some(0.0));
    running.shutdown(Duration::from_secs(5)).await;
}

/// The `testing` feature: a handler run until nothing is left, every outcome reported, no
/// waiting for backoffs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn work_until_idle_reports_every_delivery_and_waits_for_no_clock() {
    use sqlstreams_client::testing::{Outcome, Worked};
    let client = client();
    let stream = client.stream::<Adjustment>(unique("testing"));
    stream.register().await.unwrap();
    let producer = stream.producer();
    let mut ids = Vec::new();
    for (account, delta) in [("a", 1), ("a", -1), ("a", 2), ("b", 5), ("c", 0)] {
        ids.push(producer.produce(&adjustment(account, delta), keyed(account)).await.unwrap().id().unwrap());
    }
    let consumer = stream.consumer("g").register(slow_retries(Some(Concurrency::Ordered))).await.unwrap();
    let worked = consumer
        .work_until_idle(|d: Delivery<Adjustment>| async move {
            match d.message.delta {
                -1 => Err(HandlerError::permanent("negative")),
                0 => Err(HandlerError::retry("try later")),
                _ => Ok(()),
            }
        })
        .await
        .unwrap();
    let mut by_id: Vec<(i64, Outcome)> = worked.iter().map(|w| (w.id, w.outcome.clone())).collect();
    by_id.sort_by_key(|(id, _)| *id);
    assert_eq!(
        by_id,
        vec![
            (ids[0], Outcome::Succeeded),
            (ids[1], Outcome::Dead { error: "negative".into() }),
            (ids[2], Outcome::Succeeded),
            (ids[3], Outcome::Succeeded),
            (ids[4], Outcome::Retrying { error: "try later".into() }),
        ],
        "{worked:?}"
    );
    assert!(worked.iter().all(|w: &Worked| w.attempt == 0));
    // What it recorded is what the group's state says.
    let statuses = exception_statuses(&client, stream.name(), "g").await;
    assert_eq!(statuses, vec![(ids[1], "dead".to_string()), (ids[4], "ready".to_string())]);

    // Transactional: the handler's writes commit with the ack.
    let conn = client.pool().get().await.unwrap();
    let table = format!("applied_{}", &uuid_suffix());
    conn.batch_execute(&format!("CREATE TABLE {table} (id bigint)")).await.unwrap();
    let next = producer.produce(&adjustment("d", 1), keyed("d")).await.unwrap().id().unwrap();
    let other = stream.consumer("tx").register(config(None)).await.unwrap();
    let insert = format!("INSERT INTO {table} VALUES ($1)");
    let worked = other
        .work_until_idle_in_transaction(move |d: Delivery<Adjustment>, tx| {
            let insert = insert.clone();
            async move {
                tx.execute(&insert, &[&d.id]).await?;
                Ok(())
            }
        })
        .await
        .unwrap();
    assert_eq!(worked.len(), 6);
    assert!(worked.iter().all(|w| w.outcome == Outcome::Succeeded));
    let applied: i64 = conn.query_one(&format!("SELECT count(*) FROM {table}"), &[]).await.unwrap().get(0);
    assert_eq!(applied, 6, "including {next}");
}

fn uuid_suffix() -> String {
    unique("x").replace('-', "_")
}

/// The client checks the extension's version at its first connection: in a database without
/// the extension, or with an older one, every call fails with `Error::Extension`, which says
/// what to run, and nothing is sent; once the extension fits, the same client works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_client_refuses_a_database_without_a_fitting_extension() {
    let db = unique("client_version").replace('-', "_");
    let url = format!("{}/{db}", database_url().rsplit_once('/').unwrap().0);
    let run = |url: String, sql: String| {
        std::thread::spawn(move || {
            let mut c = sqlstreams_tests::postgres::Client::connect(&url, sqlstreams_tests::postgres::NoTls).unwrap();
            c.batch_execute(&sql).unwrap();
        })
        .join()
        .unwrap()
    };
    run(database_url(), format!("CREATE DATABASE {db}"));
    let client = Client::connect(&url).unwrap();
    let stream = client.stream::<Adjustment>("version.check");

    let err = stream.register().await.expect_err("a database without the extension");
    assert!(matches!(&err, sqlstreams_client::Error::Extension { installed: None, .. }), "{err:?}");
    assert!(err.to_string().contains("CREATE EXTENSION sqlstreams"), "{err}");

    // The catalog row says 0.1.0 (a database not updated after a new library was installed).
    run(url.clone(), "CREATE EXTENSION sqlstreams".into());
    run(url.clone(), "UPDATE pg_catalog.pg_extension SET extversion = '0.1.0' WHERE extname = 'sqlstreams'".into());
    let err = stream.register().await.expect_err("an extension older than the client needs");
    assert!(
        matches!(&err, sqlstreams_client::Error::Extension { installed: Some(v), required } if v == "0.1.0" && *required == sqlstreams_client::MIN_EXTENSION_VERSION),
        "{err:?}"
    );
    assert!(err.to_string().contains("ALTER EXTENSION sqlstreams UPDATE"), "{err}");

    run(
        url.clone(),
        "UPDATE pg_catalog.pg_extension SET extversion = (SELECT default_version FROM pg_catalog.pg_available_extensions
         WHERE name = 'sqlstreams') WHERE extname = 'sqlstreams'"
            .into(),
    );
    stream.register().await.expect("the same client, once the extension fits");
    stream.producer().produce(&adjustment("acct-1", 1), ProduceOptions::default()).await.unwrap();
    drop(stream);
    drop(client);
    run(database_url(), format!("DROP DATABASE {db} WITH (FORCE)"));
}
