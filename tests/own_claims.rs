//! An ack skips the statements that would find nothing: the release of lanes a token never held
//! and the delete of rows it never put in flight, when the ack runs on the connection whose
//! claim made the token (src/own_claims.rs), or when the group has no row in flight at all
//! (src/exception_queue/lifecycle.rs). What an ack must still do, it does, on any connection.

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

/// Acks `ds` in a transaction of `c` that counts function calls; returns the count trigger's
/// calls.
fn ack_counting(c: &mut Client, s: &Stream, g: &Group, ds: &[Delivery]) -> i64 {
    let mut tx = c.transaction().unwrap();
    tx.batch_execute("SET LOCAL track_functions = 'all'").unwrap();
    let before = count_trigger_calls(&mut tx, s);
    let ids: Vec<i64> = ds.iter().map(|d| d.message_id).collect();
    let acked: Vec<i64> = tx
        .query_one("SELECT sqlstreams.ack_batch($1, $2, $3, $4)", &[&s.name, &g.name, &ds[0].lease_token, &ids])
        .unwrap()
        .get(0);
    assert_eq!(acked, ids, "every message is acked");
    let calls = count_trigger_calls(&mut tx, s) - before;
    tx.commit().unwrap();
    calls
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
    assert_eq!(ack_counting(&mut c, &s, &g, &batch), 0, "no statement on the exception queue");
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
    assert!(ack_counting(&mut other, &s, &g, &second) >= 1, "the row in flight is deleted");
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
    assert!(ack_counting(&mut c, &s, &g, &second) >= 1, "the row in flight is deleted");
    assert!(g.exception_rows(&mut c).is_empty());
    assert!(held_by(&mut c, &s, &g).is_empty(), "the lane is free");
    g.assert_counts_exact(&mut c);
}

/// Scans of `table` and its indexes this backend has not reported yet.
fn scans(tx: &mut Transaction<'_>, table: &str) -> i64 {
    tx.query_one(
        "SELECT sum(pg_stat_get_xact_numscans(r))::int8
         FROM (SELECT $1::text::regclass AS r UNION ALL SELECT indexrelid FROM pg_index WHERE indrelid = $1::text::regclass) i",
        &[&table],
    )
    .unwrap()
    .get(0)
}

/// Acks `ds` on `c`; returns the scans of the stream's lane table and exception queue the ack
/// made.
fn ack_scans(c: &mut Client, s: &Stream, g: &Group, ds: &[Delivery]) -> (i64, i64) {
    let (lane, queue) = (s.table("lane"), s.table("exception_queue"));
    let mut tx = c.transaction().unwrap();
    let before = (scans(&mut tx, &lane), scans(&mut tx, &queue));
    let ids: Vec<i64> = ds.iter().map(|d| d.message_id).collect();
    let acked: Vec<i64> = tx
        .query_one("SELECT sqlstreams.ack_batch($1, $2, $3, $4)", &[&s.name, &g.name, &ds[0].lease_token, &ids])
        .unwrap()
        .get(0);
    assert_eq!(acked, ids, "every message is acked");
    let after = (scans(&mut tx, &lane), scans(&mut tx, &queue));
    tx.commit().unwrap();
    (after.0 - before.0, after.1 - before.1)
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
    assert_eq!(
        ack_scans(&mut c, &s, &g, &mine),
        (0, 0),
        "the claim's connection knows it held no lane and put no row in flight"
    );
    let (lane_scans, queue_scans) = ack_scans(&mut other, &s, &g, &theirs);
    assert!(lane_scans > 0, "another connection looks for the lanes the token holds");
    assert!(queue_scans > 0, "and for its rows in flight");
    assert_eq!(g.drain(&mut c), Vec::<i64>::new(), "everything was acked");
}
