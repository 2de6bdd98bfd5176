//! Quiet groups (src/quiet.rs): on a cluster that preloads the library, an idle claim that
//! nothing could have changed answers from what its backend learned, reading no table. Every
//! test here makes a consumer quiet first (proven: its claim scans none of the stream's
//! tables), then changes what it may claim in one way, on another connection, and asserts that
//! its very next claim sees the change: a produce, an ack that frees an ordered key, a claim
//! rolled back, a prepared transaction committed, a seek; and for what the clock brings (a
//! retry's backoff, an expired lease), that no claim started at or after that time misses it.
//!
//! `scripts/rig test` restarts its cluster with `shared_preload_libraries = 'sqlstreams'` and
//! runs this file with `--ignored`: without preloading there are no quiet groups to test.

use std::time::{Duration, Instant};

use postgres::Client;
use sqlstreams_tests::*;

/// A connection to the preloaded cluster.
fn preloaded() -> Client {
    let mut c = connect();
    let preload: String = c.query_one("SHOW shared_preload_libraries", &[]).unwrap().get(0);
    assert!(
        preload.split(',').any(|l| l.trim() == "sqlstreams"),
        "these tests need a cluster that preloads sqlstreams (scripts/rig test runs them so), not {preload:?}"
    );
    c
}

/// Scans of the stream's tables a claim reads (not its log: a quiet claim reads nothing).
fn table_scans(c: &mut Client, s: &Stream) -> i64 {
    ["cursor", "lane", "exception_queue", "range_lease"].iter().map(|t| scans(c, &s.table(t))).sum()
}

/// A claim with lease `lease`, in a transaction of its own, and the scans it made.
fn claim_counting(c: &mut Client, g: &Group, batch: i32, lease: &str) -> (Vec<Delivery>, i64) {
    c.batch_execute("BEGIN").unwrap();
    let before = table_scans(c, &g.stream);
    let claimed = g.try_claim(c, batch, lease).expect("claim");
    let read = table_scans(c, &g.stream) - before;
    c.batch_execute("COMMIT").unwrap();
    (claimed, read)
}

/// Claims until a claim reads nothing, every one empty. The first may store the fence a
/// claim elsewhere left to prove; the next two find nothing, the second of them also asking
/// when anything falls due. (A role or catalog change anywhere in the cluster meanwhile makes
/// them start over: a few more tries.)
fn make_quiet(c: &mut Client, g: &Group) {
    for _ in 0..10 {
        let (claimed, read) = claim_counting(c, g, 10, "30 seconds");
        assert!(claimed.is_empty(), "nothing to claim: {:?}", ids(&claimed));
        if read == 0 {
            return;
        }
    }
    panic!("ten idle claims in a row read the stream's tables: the group never became quiet");
}

#[test]
#[ignore = "needs a cluster that preloads sqlstreams: scripts/rig test runs it so"]
fn an_idle_claim_reads_nothing_once_two_found_nothing_and_a_produce_elsewhere_is_claimed_next() {
    let mut c = preloaded();
    let mut producer = preloaded();
    let s = Stream::create(&mut c, "quiet");
    let g = s.group(&mut c, "g", None);
    s.produce_many(&mut c, 3, None);
    let first = g.claim(&mut c, 10);
    assert_eq!(first.len(), 3);
    g.ack_batch(&mut c, &first);
    make_quiet(&mut c, &g);

    // A produce that rolls back changes nothing, but the next claim looks again.
    producer.batch_execute("BEGIN").unwrap();
    s.produce(&mut producer, serde_json::json!({"n": "rolled back"}), None);
    producer.batch_execute("ROLLBACK").unwrap();
    let (claimed, read) = claim_counting(&mut c, &g, 10, "30 seconds");
    assert!(claimed.is_empty());
    assert!(read > 0, "a transaction that produced moved the stream's epoch");

    make_quiet(&mut c, &g);
    let id = s.produce(&mut producer, serde_json::json!({"n": 4}), None);
    assert_eq!(ids(&g.claim(&mut c, 10)), vec![id], "the claim right after a produce elsewhere gets it");
}

#[test]
#[ignore = "needs a cluster that preloads sqlstreams: scripts/rig test runs it so"]
fn a_lease_broken_in_a_prepared_transaction_is_claimed_once_it_is_committed_elsewhere() {
    let mut a = preloaded();
    let mut b = preloaded();
    let mut third = preloaded();
    let s = Stream::create(&mut a, "quiet-prepared");
    let g = s.group(&mut a, "g", None);
    let id = s.produce(&mut a, serde_json::json!({}), None);
    let held = g.claim(&mut a, 10);
    assert_eq!(ids(&held), vec![id]);
    make_quiet(&mut b, &g);
    let gid = unique("quiet");
    // Prepared, a transaction sends no notification (consumers find its changes when they poll).
    a.batch_execute("BEGIN; SET LOCAL sqlstreams.notify = off").unwrap();
    let broken: bool =
        a.query_one("SELECT sqlstreams.break_lease($1, 'g', $2)", &[&s.name, &held[0].lease_token]).unwrap().get(0);
    assert!(broken);
    a.batch_execute(&format!("PREPARE TRANSACTION '{gid}'")).unwrap();
    assert!(g.claim(&mut b, 10).is_empty(), "prepared, not committed");
    make_quiet(&mut b, &g);
    // Committed by a third session: the transaction's own backend never sees it end.
    third.batch_execute(&format!("COMMIT PREPARED '{gid}'")).unwrap();
    assert_eq!(ids(&g.claim(&mut b, 10)), vec![id], "the broken lease's message, at once");
}

#[test]
#[ignore = "needs a cluster that preloads sqlstreams: scripts/rig test runs it so"]
fn a_groups_row_changed_by_hand_makes_the_next_claim_look_again() {
    let mut a = preloaded();
    let mut b = preloaded();
    let s = Stream::create(&mut a, "quiet-by-hand");
    let g = s.group(&mut a, "g", None);
    make_quiet(&mut b, &g);
    // What docs/semantics.md promises of the catalog's rows ("What a backend remembers").
    a.execute("UPDATE sqlstreams.consumer_group SET paused = paused WHERE id = $1", &[&g.id]).unwrap();
    let (claimed, read) = claim_counting(&mut b, &g, 10, "30 seconds");
    assert!(claimed.is_empty());
    assert!(read > 0, "the catalog changed: the claim looked again");
}

#[test]
#[ignore = "needs a cluster that preloads sqlstreams: scripts/rig test runs it so"]
fn a_utility_statement_that_fails_is_an_error_and_the_server_goes_on() {
    // The library's utility hook sees every utility statement of the cluster, in databases
    // without the extension too: an error in one is the statement's, never a crash.
    let mut c = preloaded();
    let pid: i32 = c.query_one("SELECT pg_backend_pid()", &[]).unwrap().get(0);
    for failing in [
        "DROP TABLE sqlstreams_no_such_table",
        "ROLLBACK PREPARED 'sqlstreams-no-such-transaction'",
        "COMMIT PREPARED 'sqlstreams-no-such-transaction'",
        "DO $$BEGIN RAISE EXCEPTION 'inside a utility statement'; END$$",
    ] {
        let err = c.batch_execute(failing).expect_err(failing);
        assert!(err.as_db_error().is_some(), "{failing}: an error from the server, not a lost connection: {err}");
    }
    // Passed on as Postgres raised it: with its context and its position.
    let err = c.batch_execute("DO $$BEGIN RAISE EXCEPTION 'inside a utility statement'; END$$").unwrap_err();
    let context = err.as_db_error().and_then(|db| db.where_()).unwrap_or_default();
    assert!(context.contains("PL/pgSQL"), "the error's context: {context:?}");
    let err = c.batch_execute("CREATE TABLE sqlstreams_quiet_t (a sqlstreams_no_such_type)").unwrap_err();
    assert!(err.as_db_error().and_then(|db| db.position()).is_some(), "the error's position: {err:?}");
    // Caught where it was raised, it is no error at all.
    c.batch_execute("DO $$BEGIN CREATE ROLE postgres; EXCEPTION WHEN duplicate_object THEN NULL; END$$")
        .expect("an error a PL/pgSQL block catches");
    let still: i32 = c.query_one("SELECT pg_backend_pid()", &[]).unwrap().get(0);
    assert_eq!(still, pid, "the same backend: no crash, no restart");
}

#[test]
#[ignore = "needs a cluster that preloads sqlstreams: scripts/rig test runs it so"]
fn a_claim_after_a_produce_in_its_own_transaction_or_carrying_acks_is_never_answered_from_memory() {
    let mut c = preloaded();
    let s = Stream::create(&mut c, "quiet-own");
    let g = s.group(&mut c, "g", None);
    s.produce(&mut c, serde_json::json!({}), None);
    let held = g.claim(&mut c, 10);
    make_quiet(&mut c, &g);

    // Its own transaction produced first: that change is in no epoch yet.
    c.batch_execute("BEGIN").unwrap();
    s.produce(&mut c, serde_json::json!({}), None);
    let before = table_scans(&mut c, &s);
    assert!(g.claim(&mut c, 10).is_empty(), "its own producer holds the fence");
    assert!(table_scans(&mut c, &s) > before, "the claim read");
    c.batch_execute("ROLLBACK").unwrap();

    // The acks it carries are recorded.
    make_quiet(&mut c, &g);
    let carried = vec![held[0].message_id];
    c.query(
        "SELECT * FROM sqlstreams.claim($1, 'g', 10, '30 seconds', $2, $3)",
        &[&s.name, &held[0].lease_token, &carried],
    )
    .unwrap();
    let left: i64 = c
        .query_one(&format!("SELECT count(*) FROM {} WHERE consumer_group_id = $1", s.table("range_lease")), &[&g.id])
        .unwrap()
        .get(0);
    assert_eq!(left, 0, "the carried ack released the range");
}

#[test]
#[ignore = "needs a cluster that preloads sqlstreams: scripts/rig test runs it so"]
fn a_seek_back_elsewhere_is_claimed_next() {
    let mut a = preloaded();
    let mut b = preloaded();
    let s = Stream::create(&mut a, "quiet-seek");
    let g = s.group(&mut a, "g", None);
    let produced = s.produce_many(&mut a, 2, None);
    let claimed = g.claim(&mut b, 10);
    g.ack_batch(&mut b, &claimed);
    make_quiet(&mut b, &g);
    a.execute("SELECT sqlstreams.seek($1, 'g', 0)", &[&s.name]).unwrap();
    assert_eq!(ids(&g.claim(&mut b, 10)), produced, "sought back: everything again");
}

#[test]
#[ignore = "needs a cluster that preloads sqlstreams: scripts/rig test runs it so"]
fn a_quiet_claim_still_checks_the_callers_rights() {
    let mut c = preloaded();
    let s = Stream::create(&mut c, "quiet-rights");
    let g = s.group(&mut c, "g", None);
    // The role first: creating it is a catalog change, which would end the quiet.
    let stranger = role(&mut c, "quiet_stranger", "");
    make_quiet(&mut c, &g);
    c.batch_execute(&format!("SET ROLE {stranger}")).unwrap();
    let err = g.try_claim(&mut c, 10, "30 seconds").unwrap_err();
    assert_eq!(sqlstate(&err), "42501", "{}", describe(&err));
    c.batch_execute("RESET ROLE").unwrap();
}

/// Polls `g` on `c` until a claim returns something, asserting that none that started at or
/// after `due` (the database's clock) came back empty; returns what it got. Also asserts that
/// some claim before `due` was quiet, so the clock, not a change, released it.
fn claim_when_due(c: &mut Client, g: &Group, due: std::time::SystemTime) -> Vec<Delivery> {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut quiet_before = false;
    loop {
        let started: std::time::SystemTime = c.query_one("SELECT clock_timestamp()", &[]).unwrap().get(0);
        let (claimed, read) = claim_counting(c, g, 10, "30 seconds");
        if !claimed.is_empty() {
            assert!(quiet_before, "no claim was quiet while waiting for the time");
            return claimed;
        }
        assert!(started < due, "a claim started at {started:?}, after the work fell due at {due:?}, found nothing");
        quiet_before |= read == 0;
        assert!(Instant::now() < deadline, "nothing was claimed within 30 s");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
#[ignore = "needs a cluster that preloads sqlstreams: scripts/rig test runs it so"]
fn a_retry_is_claimed_by_the_first_claim_after_its_time() {
    let mut c = preloaded();
    let s = Stream::create(&mut c, "quiet-retry");
    let g = s.group(&mut c, "g", None);
    let id = s.produce(&mut c, serde_json::json!({}), None);
    let claimed = g.claim(&mut c, 10);
    g.fail(&mut c, &claimed[0], "later", false, Some("2 seconds"));
    let due: std::time::SystemTime = c
        .query_one(
            &format!("SELECT can_run_after FROM {} WHERE consumer_group_id = $1", s.table("exception_queue")),
            &[&g.id],
        )
        .unwrap()
        .get(0);
    assert_eq!(ids(&claim_when_due(&mut c, &g, due)), vec![id]);
}

#[test]
#[ignore = "needs a cluster that preloads sqlstreams: scripts/rig test runs it so"]
fn an_expired_lease_is_claimed_again_by_the_first_claim_after_it_expires() {
    let mut a = preloaded();
    let mut b = preloaded();
    let s = Stream::create(&mut a, "quiet-lease");
    let g = s.group(&mut a, "g", Some("ordered"));
    let id = s.produce(&mut a, serde_json::json!({}), Some("k"));
    let held = g.try_claim(&mut a, 10, "2 seconds").unwrap();
    assert_eq!(ids(&held), vec![id]);
    let due: std::time::SystemTime = a
        .query_one(
            &format!("SELECT max(lease_expires_at) FROM {} WHERE consumer_group_id = $1", s.table("range_lease")),
            &[&g.id],
        )
        .unwrap()
        .get(0);
    assert_eq!(ids(&claim_when_due(&mut b, &g, due)), vec![id]);
}
