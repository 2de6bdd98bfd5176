//! The maintenance worker (src/worker.rs), on a cluster that preloads the library. `scripts/rig
//! test` restarts its cluster with `shared_preload_libraries = 'sqlstreams'`,
//! `sqlstreams.worker_database = 'worker_sqlstreams'` and `sqlstreams.maintain_interval = 1s`,
//! then runs this file with `--ignored`: without preloading there is no worker to test.

use std::time::{Duration, Instant};

use postgres::{Client, NoTls};
use sqlstreams_tests::*;

fn connect_worker_database() -> Client {
    let url = std::env::var("SQLSTREAMS_WORKER_DATABASE_URL")
        .expect("SQLSTREAMS_WORKER_DATABASE_URL is not set: scripts/rig test runs this test on a preloaded cluster");
    let mut client = Client::connect(&url, NoTls).expect("connect to the worker's database");
    client.batch_execute(CREATE_EXTENSION).expect("create the extension");
    client
}

/// Waits (bounded: the worker runs every second) until `query` returns true.
fn eventually(c: &mut Client, what: &str, query: &str, params: &[&(dyn postgres::types::ToSql + Sync)]) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !c.query_one(query, params).unwrap().get::<_, bool>(0) {
        assert!(Instant::now() < deadline, "the worker did not get to it within a minute: {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
#[ignore = "needs a cluster that preloads sqlstreams: scripts/rig test runs it"]
fn the_worker_maintains_the_database_without_anyone_calling_maintain() {
    let mut c = connect_worker_database();
    eventually(
        &mut c,
        "the worker runs in this database",
        "SELECT count(*) = 1 FROM pg_stat_activity
         WHERE backend_type = 'sqlstreams maintenance' AND datname = current_database()",
        &[],
    );

    // Only maintain() purges expired idempotency keys: nothing else here calls it.
    let s = Stream::create_sized(&mut c, "worker", 1000);
    c.query_one("SELECT sqlstreams.create_stream($1, 1000, idempotency_ttl => '1 microsecond')", &[&s.name]).unwrap();
    c.query_one("SELECT sqlstreams.produce($1, '{}', idempotency_key => 'order-1')", &[&s.name]).unwrap();
    let keys = format!("SELECT count(*) = 0 FROM {}", s.table("idempotency_key"));
    eventually(&mut c, "expired idempotency keys purged", &keys, &[]);

    // Retention: consumed partitions go without maintain() and without further claims.
    let g = s.group(&mut c, "g", None);
    s.produce_many(&mut c, 3500, None);
    assert_eq!(g.drain(&mut c).len(), 3501, "the batch and the message produced with a key");
    let first_partition = format!("{}_p0", s.table("message_log"));
    eventually(&mut c, "the consumed partitions dropped", "SELECT to_regclass($1) IS NULL", &[&first_partition]);
}
