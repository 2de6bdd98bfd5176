//! An ack skips the statements that would find nothing: the release of lanes a token never held
//! and the delete of rows it never put in flight, when the ack runs on the connection whose
//! claim made the token (src/own_claims.rs), or when the group has no row in flight at all
//! (src/exception_queue/lifecycle.rs). An ack of every message its claim handed out there deletes
//! the claim's ranges with their stored outcomes in one statement (src/range.rs,
//! `resolve_covered`). What an ack must still do, it does, on any connection.

use postgres::fallible_iterator::FallibleIterator;
use postgres::{Client, Transaction};
use sqlstreams_tests::*;

/// Calls of the stream's exception count trigger this backend has not reported yet (the
/// transaction's, and perhaps earlier ones'): one per statement that inserted, updated or
/// deleted exception rows, even none.
fn count_trigger_calls(tx: &mut Transaction<'_>, s: &Stream) -> i64 {
    tx.query_one(
        "SELECT coalesce(pg_stat_get_xact_function_calls($1::text::regprocedure), 0)",
        &[&format!("sqlstreams.exception_count_{}()", s.id)],
    )
    .unwrap()
    .get(0)
}

fn held_by(c: &mut Client, s: &Stream, g: &Group) -> Vec<Option<uuid::Uuid>> {
    c.query(
        &format!("SELECT held_by FROM {} WHERE consumer_group_id = $1 AND held_by IS NOT NULL", s.table("lane")),
        &[&g.id],
    )
    .unwrap()
    .iter()
    .map(|r| r.get(0))
    .collect()
}

#[test]
fn an_ack_of_first_deliveries_touches_no_exception_row() {
    let mut c = connect();
    let s = Stream::create(&mut c, "own-first");
    let g = s.group(&mut c, "g", Some("ordered"));
    s.produce_many(&mut c, 5, Some("k"));
    let batch = g.claim(&mut c, 10);
    assert_eq!(batch.len(), 5);
    assert_eq!(held_by(&mut c, &s, &g), vec![Some(batch[0].lease_token)], "the claim holds the key's lane");
    assert_eq!(ack_measured(&mut c, &s, &g, &batch).trigger_calls, 0, "no statement on the exception queue");
    assert!(held_by(&mut c, &s, &g).is_empty(), "the ack freed the lane");
}

#[test]
fn an_ack_on_another_connection_frees_the_lane_and_deletes_the_rows_in_flight() {
    let mut c = connect();
    let mut other = connect();
    let s = Stream::create(&mut c, "own-other");
    let g = s.group(&mut c, "g", Some("ordered"));
    s.produce_many(&mut c, 3, Some("k"));
    // A retry, handed out again: an exception row in flight under the second claim's token.
    let first = g.claim(&mut c, 1);
    g.fail(&mut c, &first[0], "boom", false, Some("0 seconds"));
    g.make_due(&mut c);
    let second = g.claim(&mut c, 10);
    assert_eq!(
        second.iter().map(|d| d.message_id).collect::<Vec<_>>(),
        vec![first[0].message_id, first[0].message_id + 1, first[0].message_id + 2]
    );
    assert_eq!(held_by(&mut c, &s, &g), vec![Some(second[0].lease_token)]);
    // The other connection did not make the token: it looks, and finds the row and the lane.
    assert!(ack_measured(&mut other, &s, &g, &second).trigger_calls >= 1, "the row in flight is deleted");
    assert!(g.exception_rows(&mut c).is_empty(), "no exception row is left");
    assert!(held_by(&mut c, &s, &g).is_empty(), "the lane is free");
    g.assert_counts_exact(&mut c);
}

#[test]
fn an_ack_on_the_claims_connection_deletes_the_rows_it_put_in_flight() {
    let mut c = connect();
    let s = Stream::create(&mut c, "own-retry");
    let g = s.group(&mut c, "g", Some("ordered"));
    s.produce_many(&mut c, 2, Some("k"));
    let first = g.claim(&mut c, 1);
    g.fail(&mut c, &first[0], "boom", false, Some("0 seconds"));
    g.make_due(&mut c);
    let second = g.claim(&mut c, 10);
    assert_eq!(second.len(), 2);
    assert!(ack_measured(&mut c, &s, &g, &second).trigger_calls >= 1, "the row in flight is deleted");
    assert!(g.exception_rows(&mut c).is_empty());
    assert!(held_by(&mut c, &s, &g).is_empty(), "the lane is free");
    g.assert_counts_exact(&mut c);
}

/// What an ack made on its connection's backend.
#[derive(Debug, PartialEq)]
struct Made {
    /// Calls of the exception count trigger: statements that changed the queue, or could have.
    trigger_calls: i64,
    lane_scans: i64,
    queue_scans: i64,
    /// Scans of the outcomes stored under open ranges' tokens (`range_done`).
    done_scans: i64,
    /// Scans of the range leases.
    range_scans: i64,
    /// Wake locks (src/locks.rs, `WAKE_CLASS`: a key's is its lane's) the ack's transaction holds.
    wake_locks: i64,
}

/// Acks `ds` on `c` in a transaction that counts what the ack does.
fn ack_measured(c: &mut Client, s: &Stream, g: &Group, ds: &[Delivery]) -> Made {
    let (lane, queue, done, range) =
        (s.table("lane"), s.table("exception_queue"), s.table("range_done"), s.table("range_lease"));
    let mut tx = c.transaction().unwrap();
    tx.batch_execute("SET LOCAL track_functions = 'all'").unwrap();
    let measure = |tx: &mut Transaction<'_>| {
        Made {
            trigger_calls: count_trigger_calls(tx, s),
            lane_scans: scans(tx, &lane),
            queue_scans: scans(tx, &queue),
            done_scans: scans(tx, &done),
            range_scans: scans(tx, &range),
            wake_locks: tx
                .query_one(
                    // Wake locks: advisory locks of class 'SL' (src/locks.rs, WAKE_CLASS).
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objsubid = x'534C'::int
                   AND pid = pg_backend_pid()",
                    &[],
                )
                .unwrap()
                .get(0),
        }
    };
    let before = measure(&mut tx);
    let ids: Vec<i64> = ds.iter().map(|d| d.message_id).collect();
    let acked: Vec<i64> = tx
        .query_one("SELECT sqlstreams.ack_batch($1, $2, $3, $4)", &[&s.name, &g.name, &ds[0].lease_token, &ids])
        .unwrap()
        .get(0);
    assert_eq!(acked, ids, "every message is acked");
    let after = measure(&mut tx);
    tx.commit().unwrap();
    Made {
        trigger_calls: after.trigger_calls - before.trigger_calls,
        lane_scans: after.lane_scans - before.lane_scans,
        queue_scans: after.queue_scans - before.queue_scans,
        done_scans: after.done_scans - before.done_scans,
        range_scans: after.range_scans - before.range_scans,
        wake_locks: after.wake_locks - before.wake_locks,
    }
}

#[test]
fn an_ack_on_the_claims_connection_skips_what_its_claim_did_not_do() {
    let mut c = connect();
    let mut other = connect();
    let s = Stream::create(&mut c, "own-skip");
    // The group may hold lanes (no override), but messages without a key hold none.
    let g = s.group(&mut c, "g", None);
    s.produce_many(&mut c, 6, None);
    let mine = g.claim(&mut c, 3);
    let theirs = g.claim(&mut c, 3);
    assert_eq!((mine.len(), theirs.len()), (3, 3));
    let mine = ack_measured(&mut c, &s, &g, &mine);
    assert_eq!(
        (mine.lane_scans, mine.queue_scans),
        (0, 0),
        "the claim's connection knows it held no lane and put no row in flight"
    );
    let theirs = ack_measured(&mut other, &s, &g, &theirs);
    assert!(theirs.lane_scans > 0, "another connection looks for the lanes the token holds");
    assert!(theirs.queue_scans > 0, "and for its rows in flight");
    assert_eq!(g.drain(&mut c), Vec::<i64>::new(), "everything was acked");
}

#[test]
fn an_ack_of_a_whole_claim_on_its_connection_deletes_its_range_in_one_statement() {
    let mut c = connect();
    let mut other = connect();
    let s = Stream::create(&mut c, "own-whole");
    let g = s.group(&mut c, "g", None);
    s.produce_many(&mut c, 6, None);
    let mine = g.claim(&mut c, 3);
    let theirs = g.claim(&mut c, 3);
    assert_eq!((mine.len(), theirs.len()), (3, 3));
    assert_eq!(
        ack_measured(&mut c, &s, &g, &mine).done_scans,
        1,
        "the claim's connection deletes the range and its stored outcomes in one statement"
    );
    assert_eq!(
        ack_measured(&mut other, &s, &g, &theirs).done_scans,
        2,
        "another connection reads the range's stored outcomes, then deletes them with the range"
    );
    assert_eq!(g.drain(&mut c), Vec::<i64>::new(), "everything was acked");
}

#[test]
fn an_ack_of_a_whole_ordered_claim_ends_its_lane_holds_with_its_ranges() {
    let mut c = connect();
    let mut other = connect();
    let s = Stream::create(&mut c, "own-whole-lanes");
    let g = s.group(&mut c, "g", Some("ordered"));
    for i in 0..24 {
        s.produce(&mut c, serde_json::json!({ "i": i }), Some(&format!("k{}", i % 8)));
    }
    let channel: String =
        c.query_one("SELECT channel FROM sqlstreams.streams WHERE name = $1", &[&s.name]).unwrap().get(0);
    let mut listener = connect();
    listener.batch_execute(&format!("LISTEN \"{channel}\"")).unwrap();
    // What has arrived by the end of a round trip (a committed NOTIFY was signalled before it).
    let arrived = |listener: &mut Client| {
        listener.batch_execute("SELECT 1").unwrap();
        listener.notifications().iter().count().unwrap()
    };
    for on_claims_connection in [true, false] {
        let name = if on_claims_connection { "the claim's connection" } else { "another connection" };
        let claimed = g.claim(&mut c, 12);
        assert_eq!(claimed.len(), 12, "{name}");
        let held = held_by(&mut c, &s, &g);
        assert!(held.len() > 1, "{name}: the claim holds the lanes of its keys: {held:?}");
        assert!(held.iter().all(|t| *t == Some(claimed[0].lease_token)), "{name}");
        arrived(&mut listener);
        let made = ack_measured(if on_claims_connection { &mut c } else { &mut other }, &s, &g, &claimed);
        if on_claims_connection {
            assert_eq!(made.range_scans, 1, "{name}: one statement deletes the ranges and ends the holds");
            assert_eq!(made.wake_locks, 0, "{name}: the lanes' locked rows keep claims off the keys");
        } else {
            assert!(made.range_scans >= 2, "{name}: the ranges are read, then the lanes released: {made:?}");
            let keys: Vec<String> = claimed.iter().filter_map(|d| d.message_key.clone()).collect();
            let lanes: i64 = c
                .query_one(
                    "SELECT count(DISTINCT sqlstreams.lane(k, 0, s.lanes)) FROM unnest($1::text[]) k, sqlstreams.streams s
                     WHERE s.name = $2",
                    &[&keys, &s.name],
                )
                .unwrap()
                .get(0);
            assert_eq!(made.wake_locks, lanes, "{name}: each lane of a key resolved is locked before wake-ups");
        }
        assert!(held_by(&mut c, &s, &g).is_empty(), "{name}: the ack freed every lane");
        assert!(arrived(&mut listener) >= 1, "{name}: the freed lanes woke the stream's consumers");
    }
    assert_eq!(g.drain(&mut c), Vec::<i64>::new(), "everything was acked");
}

/// A key's wake lock is its lane's (src/locks.rs, `WAKE_CLASS`): an ack of keyed work in a group
/// that may park rows takes one lock per lane of the keys it resolved before its wake-up, not one
/// per key (40 keys, 2 lanes).
#[test]
fn an_ack_of_many_keys_locks_each_of_their_lanes_once() {
    let mut c = connect();
    let name = unique("own-wake-lanes");
    let id = c.query_one("SELECT sqlstreams.create_stream($1, lanes => 2)", &[&name]).unwrap().get(0);
    let s = Stream { name, id };
    let g = s.group(&mut c, "g", None);
    for i in 0..40 {
        s.produce(&mut c, serde_json::json!({ "i": i }), Some(&format!("k{i}")));
    }
    let claimed = g.claim(&mut c, 40);
    assert_eq!(claimed.len(), 40);
    let mut lanes: Vec<i32> =
        claimed.iter().map(|d| s.lane(&mut c, d.message_key.as_deref().expect("a key"))).collect();
    lanes.sort_unstable();
    lanes.dedup();
    assert_eq!(lanes, vec![0, 1], "40 keys fill both lanes");
    let made = ack_measured(&mut c, &s, &g, &claimed);
    assert_eq!(made.wake_locks, lanes.len() as i64, "one wake lock per lane of the 40 keys: {lanes:?}");
    assert_eq!(g.drain(&mut c), Vec::<i64>::new(), "everything was acked");
}

/// A row the claim itself parked: an ordered message of key k waits behind a parallel one of k
/// that the same claim handed out, and the claim holds the lane for an ordered message of
/// another key there. The whole ack finds the lane still held by its token, yet must wake the
/// row: the claim parked a row, so its whole ack does not take the statement that skips the
/// group's parked rows (src/lanes/holds.rs, `END_HOLDS_WITH_RANGES_NOTHING_WAITED`), and the
/// statement returns the keys because the group has a parked row (`END_HOLDS_WITH_RANGES`).
/// Without that, the row would wait out its park time.
#[test]
fn a_whole_ack_wakes_the_row_its_own_claim_parked() {
    let mut c = connect();
    let s = Stream::create(&mut c, "own-parked-self");
    let g = s.group(&mut c, "g", None);
    let lane = s.lane(&mut c, "k");
    let j = (0..).map(|i| format!("j{i}")).find(|j| s.lane(&mut c, j) == lane).expect("a key in k's lane");
    let mut produce = |key: &str, concurrency: &str| {
        s.produce_with(&mut c, serde_json::json!({ "key": key }), Some(key), Some(concurrency), false)
            .expect("produce")
            .expect("an id")
    };
    let parallel_k = produce("k", "parallel");
    let ordered_k = produce("k", "ordered");
    let ordered_j = produce(&j, "ordered");
    let claimed = g.claim(&mut c, 10);
    assert_eq!(ids(&claimed), vec![parallel_k, ordered_j], "k's ordered message waits behind its parallel one");
    let parked: i64 =
        c.query_one(&format!("SELECT count(*) FROM {} WHERE parked", s.table("exception_queue")), &[]).unwrap().get(0);
    assert_eq!(parked, 1, "the claim parked it");
    assert_eq!(held_by(&mut c, &s, &g), vec![Some(claimed[0].lease_token)], "the claim holds the lane");
    let made = ack_measured(&mut c, &s, &g, &claimed);
    assert_eq!(made.range_scans, 1, "the whole ack, in one statement");
    assert_eq!(ids(&g.claim(&mut c, 10)), vec![ordered_k], "the ack woke the row its own claim parked");
}

/// A group whose override became `parallel` parks nothing, but still wakes what it parked
/// before: a whole ack on the claim's connection reads its keys while the group has a parked row
/// whatever the override (src/exception_queue/lifecycle.rs, `whole_ack_keys`). Before, it read
/// none, and the row waited out its park time, an hour here (found by an adversary's harness).
#[test]
fn a_whole_ack_wakes_a_row_parked_before_the_override_became_parallel() {
    let mut c = connect();
    let mut other = connect();
    let s = Stream::create(&mut c, "own-parked-then-parallel");
    let g = s.group(&mut c, "g", None);
    let mut produce = |key: &str, concurrency: &str| {
        s.produce_with(&mut c, serde_json::json!({}), Some(key), Some(concurrency), false)
            .expect("produce")
            .expect("an id")
    };
    let parallel_k = produce("k", "parallel");
    let ordered_k = produce("k", "ordered");
    let claimed = g.try_claim(&mut c, 1, "1 hour").unwrap();
    assert_eq!(ids(&claimed), vec![parallel_k]);
    assert_eq!(ids(&g.try_claim(&mut other, 10, "1 hour").unwrap()), Vec::<i64>::new(), "k's ordered message waits");
    let parked: i64 =
        c.query_one(&format!("SELECT count(*) FROM {} WHERE parked", s.table("exception_queue")), &[]).unwrap().get(0);
    assert_eq!(parked, 1, "behind the parallel one, until its lease runs out");
    c.execute("SELECT sqlstreams.alter_group($1, $2, concurrency_override => 'parallel')", &[&s.name, &g.name])
        .unwrap();
    assert_eq!(g.ack_batch(&mut c, &claimed), vec![parallel_k], "the whole claim, on its connection");
    assert_eq!(ids(&g.try_claim(&mut other, 10, "1 hour").unwrap()), vec![ordered_k], "the ack woke the row");
}

#[test]
fn a_whole_claim_acked_after_one_of_its_messages_records_only_the_rest() {
    let mut c = connect();
    let s = Stream::create(&mut c, "own-again");
    let g = s.group(&mut c, "g", Some("ordered"));
    s.produce_many(&mut c, 4, Some("k"));
    let batch = g.claim(&mut c, 10);
    assert_eq!(batch.len(), 4);
    assert!(g.ack(&mut c, &batch[1]), "one message acked alone: an outcome stored under the token");
    let count = |c: &mut Client, family: &str| -> i64 {
        c.query_one(&format!("SELECT count(*) FROM {} WHERE consumer_group_id = $1", s.table(family)), &[&g.id])
            .unwrap()
            .get(0)
    };
    assert_eq!((count(&mut c, "range_lease"), count(&mut c, "range_done")), (1, 1));
    let mut rest = ids(&batch);
    rest.remove(1);
    assert_eq!(g.ack_batch(&mut c, &batch), rest, "the message acked before is not recorded twice");
    assert_eq!((count(&mut c, "range_lease"), count(&mut c, "range_done")), (0, 0), "range and outcome gone");
    assert!(held_by(&mut c, &s, &g).is_empty(), "the lane is free");
    assert_eq!(g.drain(&mut c), Vec::<i64>::new(), "nothing comes back");
}

#[test]
fn a_claim_carrying_a_whole_claims_acks_deletes_its_range_in_one_statement() {
    let mut c = connect();
    let s = Stream::create(&mut c, "own-carried");
    let g = s.group(&mut c, "g", None);
    s.produce_many(&mut c, 6, None);
    let first = g.claim(&mut c, 3);
    assert_eq!(first.len(), 3);
    let done = s.table("range_done");
    let mut tx = c.transaction().unwrap();
    let before = scans(&mut tx, &done);
    let rows = tx
        .query(
            "SELECT message_id, lease_token FROM sqlstreams.claim($1, $2, 3, '30 seconds', $3, $4)",
            &[&s.name, &g.name, &first[0].lease_token, &ids(&first)],
        )
        .unwrap();
    assert_eq!(scans(&mut tx, &done) - before, 1, "the carried acks delete the range in one statement");
    tx.commit().unwrap();
    let next: Vec<i64> = rows.iter().map(|r| r.get(0)).collect();
    assert_eq!(next.len(), 3, "and the claim hands out the next three");
    let token: uuid::Uuid = rows[0].get(1);
    let acked: Vec<i64> =
        c.query_one("SELECT sqlstreams.ack_batch($1, $2, $3, $4)", &[&s.name, &g.name, &token, &next]).unwrap().get(0);
    assert_eq!(acked, next);
    assert_eq!(g.drain(&mut c), Vec::<i64>::new(), "the first three were acked with the claim");
}

#[test]
fn an_ack_under_repeatable_read_reads_the_stored_outcomes_apart() {
    let mut c = connect();
    let s = Stream::create(&mut c, "own-rr");
    let g = s.group(&mut c, "g", None);
    s.produce_many(&mut c, 3, None);
    let batch = g.claim(&mut c, 3);
    let done = s.table("range_done");
    let mut tx = c.build_transaction().isolation_level(postgres::IsolationLevel::RepeatableRead).start().unwrap();
    let before = scans(&mut tx, &done);
    let acked: Vec<i64> = tx
        .query_one(
            "SELECT sqlstreams.ack_batch($1, $2, $3, $4)",
            &[&s.name, &g.name, &batch[0].lease_token, &ids(&batch)],
        )
        .unwrap()
        .get(0);
    assert_eq!(acked, ids(&batch));
    assert_eq!(
        scans(&mut tx, &done) - before,
        2,
        "its snapshot may be older than an outcome stored under the token: the general path"
    );
    tx.commit().unwrap();
    assert_eq!(g.drain(&mut c), Vec::<i64>::new());
}

/// A whole ack after an outcome of its own token: the claim found nothing in its way, then one of
/// its messages failed (its key's next message, chained behind it, parked until the retry), and
/// a message of another key of the same range is still pending. The statement that ends the
/// holds deletes the failure's `range_done` rows, so it returns the keys (src/lanes/holds.rs,
/// `END_HOLDS_WITH_RANGES_NOTHING_WAITED`); the rest is acked, the lane is freed, and the failed
/// message and its successor come next, in order.
#[test]
fn a_whole_ack_after_a_failure_of_its_own_claim_frees_the_lanes_and_keeps_the_order() {
    let mut c = connect();
    let s = Stream::create(&mut c, "own-whole-after-fail");
    let g = s.group(&mut c, "g", Some("ordered"));
    let lane = s.lane(&mut c, "k");
    let mate = (0..).map(|i| format!("j{i}")).find(|j| s.lane(&mut c, j) == lane).expect("a key in k's lane");
    let first = s.produce(&mut c, serde_json::json!({}), Some("k"));
    let next = s.produce(&mut c, serde_json::json!({}), Some("k"));
    let other = s.produce(&mut c, serde_json::json!({}), Some(&mate));
    let claimed = g.claim(&mut c, 10);
    assert_eq!(ids(&claimed), vec![first, next, other]);
    assert_eq!(g.fail(&mut c, &claimed[0], "x", false, Some("1 hour")).as_deref(), Some("ready"));
    let done: i64 = c
        .query_one(&format!("SELECT count(*) FROM {} WHERE consumer_group_id = $1", s.table("range_done")), &[&g.id])
        .unwrap()
        .get(0);
    assert_eq!(done, 2, "the failure and the rest of its chain, in the range still open for {other}");
    let carried = c
        .query(
            "SELECT message_id FROM sqlstreams.claim($1, 'g', 10, '30 seconds', $2, $3)",
            &[&s.name, &claimed[0].lease_token, &ids(&claimed)],
        )
        .unwrap();
    assert!(carried.is_empty(), "k waits for its retry");
    assert!(held_by(&mut c, &s, &g).is_empty(), "the ack freed every lane");
    let statuses = g.statuses(&mut c);
    assert_eq!(statuses, vec![(first, "ready".into()), (next, "deferred".into())], "{other} acked");
    g.make_due(&mut c);
    let chain = g.claim(&mut c, 10);
    assert_eq!(ids(&chain), vec![first, next]);
    assert_eq!(chain[1].run_after, Some(first));
}
