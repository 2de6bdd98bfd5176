//! Postgres restarts under a running consumer: it reconnects and nothing is lost.
//! Its own test binary, so no other test is running while the server goes down.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sqlstreams_client::{Client, ConsumerConfig, Delivery, ProduceOptions};
use sqlstreams_tests::{database_url, unique};

fn restart_postgres() {
    let pg_ctl = std::env::var("SQLSTREAMS_PG_CTL").expect(
        "SQLSTREAMS_PG_CTL is not set: run the tests through `scripts/rig test`, which can restart its Postgres",
    );
    let status = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!("{pg_ctl} restart -m fast -w >/dev/null"))
        .status()
        .expect("run pg_ctl");
    assert!(status.success(), "pg_ctl restart failed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_consumer_survives_a_postgres_restart() {
    let client = Client::connect(&database_url()).unwrap();
    client.pool().get().await.unwrap().batch_execute(sqlstreams_tests::CREATE_EXTENSION).await.unwrap();
    let stream = client.stream::<i64>(unique("restart"));
    stream.register().await.unwrap();
    let consumer = stream
        .consumer("g")
        .register(ConsumerConfig {
            backoff_base: Duration::from_millis(50),
            poll_interval: Duration::from_millis(200),
            handler_timeout: Duration::from_secs(5),
            lease: Duration::from_secs(10),
            ..Default::default()
        })
        .await
        .unwrap();
    let producer = stream.producer();
    let handled: Arc<Mutex<HashSet<i64>>> = Arc::default();
    let running = {
        let handled = handled.clone();
        consumer.start(move |d: Delivery<i64>| {
            let handled = handled.clone();
            async move {
                tokio::time::sleep(Duration::from_millis(5)).await;
                handled.lock().unwrap().insert(d.message);
                Ok(())
            }
        })
    };

    // Produce steadily through the restart; a produce that fails because the server is down
    // is retried (the transaction did not commit, so nothing was produced).
    let mut produced = HashSet::new();
    let mut restarted = false;
    for n in 0..200i64 {
        if n == 100 {
            restart_postgres();
            restarted = true;
        }
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            match producer.produce(&n, ProduceOptions::default()).await {
                Ok(_) => break,
                Err(e) if e.is_transient() && tokio::time::Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => panic!("produce {n}: {e}"),
            }
        }
        produced.insert(n);
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    assert!(restarted);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while handled.lock().unwrap().len() < produced.len() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "handled {} of {}",
            handled.lock().unwrap().len(),
            produced.len()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let report = running.shutdown(Duration::from_secs(10)).await;
    assert_eq!(*handled.lock().unwrap(), produced, "every message was handled after the restart");
    assert!(report.metrics.succeeded >= 200);
}
