//! A consumer call commits without waiting for the WAL flush only when its transaction wrote
//! nothing else: business rows and produced messages written in the same statement as a
//! consumer call survive a crash. Its own test binary: it crashes the throwaway Postgres.

use std::time::{Duration, Instant};

use sqlstreams_tests::*;

fn crash_and_restart() {
    let pg_ctl = std::env::var("SQLSTREAMS_PG_CTL")
        .expect("SQLSTREAMS_PG_CTL is not set: run the tests through `scripts/rig test`, which can crash its Postgres");
    // An immediate stop is a crash: shared memory, with any WAL not yet written, is discarded.
    let status = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!("{pg_ctl} restart -m immediate -w >/dev/null"))
        .status()
        .expect("run pg_ctl");
    assert!(status.success(), "pg_ctl restart failed");
}

fn reconnect() -> postgres::Client {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match postgres::Client::connect(&database_url(), postgres::NoTls) {
            Ok(c) => return c,
            Err(e) if Instant::now() < deadline => {
                eprintln!("waiting for Postgres after the crash: {e}");
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(e) => panic!("Postgres did not come back: {e}"),
        }
    }
}

#[test]
fn writes_beside_a_consumer_call_keep_the_callers_durability() {
    let mut c = connect();
    // The throwaway cluster runs with synchronous_commit off; this caller asks for durability.
    c.batch_execute(
        "SET synchronous_commit = on;
         CREATE TABLE IF NOT EXISTS durability_biz (id text PRIMARY KEY)",
    )
    .unwrap();
    let s = Stream::create(&mut c, "durability");
    let g = s.group(&mut c, "g", None);
    let out = Stream::create(&mut c, "durability-out");
    s.produce_many(&mut c, 20, None);

    let mut rows = Vec::new();
    for _ in 0..10 {
        let d = g.claim(&mut c, 1).pop().expect("a message");
        let row = unique("biz");
        // An ack and a business row in one autocommit statement.
        c.execute(
            "WITH a AS (SELECT sqlstreams.ack_batch($1, $2, $3, ARRAY[$4::int8]) AS acked)
             INSERT INTO durability_biz SELECT $5 FROM a WHERE cardinality(a.acked) = 1",
            &[&s.name, &g.name, &d.lease_token, &d.message_id, &row],
        )
        .unwrap();
        rows.push(row);
    }
    crash_and_restart();
    let mut c = reconnect();
    let kept: i64 = c.query_one("SELECT count(*) FROM durability_biz WHERE id = ANY($1)", &[&rows]).unwrap().get(0);
    assert_eq!(kept, 10, "business rows written beside an ack survived the crash");

    c.batch_execute("SET synchronous_commit = on").unwrap();
    let mut produced = Vec::new();
    for _ in 0..10 {
        // A claim and a produce in one autocommit statement.
        let id: i64 = c
            .query_one(
                "SELECT sqlstreams.produce($1, jsonb_build_object('from', message_id)) FROM sqlstreams.claim($2, $3, 1)",
                &[&out.name, &s.name, &g.name],
            )
            .unwrap()
            .get(0);
        produced.push(id);
    }
    crash_and_restart();
    let mut c = reconnect();
    let kept: i64 = c
        .query_one(&format!("SELECT count(*) FROM {} WHERE id = ANY($1)", out.table("message_log")), &[&produced])
        .unwrap()
        .get(0);
    assert_eq!(kept, 10, "messages produced beside a claim survived the crash");
}
