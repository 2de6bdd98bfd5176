//! What a message carries besides its payload: headers and `produced_at`, handed out by
//! `claim_with_metadata`; and delayed delivery (`deliver_after`).

use postgres::Client;
use serde_json::Value;
use sqlstreams_tests::*;

/// (message_id, attempt, produced_at as text, headers) of one `claim_with_metadata`.
fn claim_meta(c: &mut Client, g: &Group) -> Vec<(i64, i32, String, Option<Value>)> {
    c.query(
        "SELECT message_id, attempt, produced_at::text, headers
         FROM sqlstreams.claim_with_metadata($1, $2, 100)",
        &[&g.stream.name, &g.name],
    )
    .expect("claim_with_metadata")
    .iter()
    .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
    .collect()
}

fn produced_at(c: &mut Client, s: &Stream, id: i64) -> String {
    let sql = format!("SELECT produced_at::text FROM {} WHERE id = $1", s.table("message_log"));
    c.query_one(&sql, &[&id]).unwrap().get(0)
}

#[test]
fn headers_and_produced_at_travel_with_the_message_through_every_delivery() {
    let mut c = connect();
    let s = Stream::create(&mut c, "headers");
    let g = s.group(&mut c, "g", None);
    let trace = json!({"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "tenant": 7});
    let one: i64 = c
        .query_one("SELECT sqlstreams.produce($1, '{\"n\": 1}', 'k', headers => $2)", &[&s.name, &trace])
        .unwrap()
        .get(0);
    let plain = s.produce(&mut c, json!({"n": 2}), Some("other"));
    let batch: Vec<i64> = c
        .query(
            "SELECT sqlstreams.produce_batch($1, ARRAY['{\"n\": 3}', '{\"n\": 4}']::jsonb[],
                                             headers => ARRAY['{\"h\": \"x\"}', NULL]::jsonb[])",
            &[&s.name],
        )
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();

    let first = claim_meta(&mut c, &g);
    let expected: Vec<(i64, Option<Value>)> =
        vec![(one, Some(trace.clone())), (plain, None), (batch[0], Some(json!({"h": "x"}))), (batch[1], None)];
    assert_eq!(first.iter().map(|(id, _, _, h)| (*id, h.clone())).collect::<Vec<_>>(), expected);
    for (id, _, at, _) in &first {
        assert_eq!(*at, produced_at(&mut c, &s, *id), "produced_at of {id} is the log's");
    }

    // A retry comes from the exception queue: it still carries its headers and produced_at.
    let token: uuid::Uuid = c
        .query_one("SELECT lease_token FROM sqlstreams.open_leases($1, $2) LIMIT 1", &[&s.name, &g.name])
        .unwrap()
        .get(0);
    let failed: Option<String> = c
        .query_one(
            "SELECT sqlstreams.fail($1, $2, $3, $4, 'boom', retry_after => '0 seconds')",
            &[&s.name, &g.name, &token, &one],
        )
        .unwrap()
        .get(0);
    assert_eq!(failed.as_deref(), Some("ready"));
    let again = claim_meta(&mut c, &g);
    assert_eq!(again.len(), 1);
    assert_eq!((again[0].0, again[0].1), (one, 1));
    assert_eq!(again[0].3, Some(trace));
    assert_eq!(again[0].2, produced_at(&mut c, &s, one));
}

#[test]
fn claim_keeps_the_contract_columns() {
    let mut c = connect();
    let s = Stream::create(&mut c, "contract");
    let g = s.group(&mut c, "g", None);
    c.query_one("SELECT sqlstreams.produce($1, '{}', headers => '{\"a\": 1}')", &[&s.name]).unwrap();
    let rows = c.query("SELECT * FROM sqlstreams.claim($1, $2)", &[&s.name, &g.name]).unwrap();
    let columns: Vec<&str> = rows[0].columns().iter().map(|c| c.name()).collect();
    assert_eq!(
        columns,
        ["message_id", "message_key", "concurrency", "attempt", "payload", "lease_token", "run_after"],
        "claim's columns are the contract's; headers come only from claim_with_metadata"
    );
}

#[test]
fn bad_headers_and_negative_deliver_after_are_refused_and_write_nothing() {
    let mut c = connect();
    let s = Stream::create(&mut c, "refusals");
    let head = |c: &mut Client| -> i64 {
        c.query_one("SELECT head FROM sqlstreams.streams WHERE name = $1", &[&s.name]).unwrap().get(0)
    };
    let before = head(&mut c);
    let cases = [
        ("SELECT sqlstreams.produce($1, '{}', headers => '[1, 2]')", "headers must be a JSON object, not array"),
        ("SELECT sqlstreams.produce($1, '{}', headers => '\"x\"')", "headers must be a JSON object, not string"),
        ("SELECT sqlstreams.produce($1, '{}', deliver_after => '-1 minute')", "is negative"),
        (
            "SELECT sqlstreams.produce_batch($1, ARRAY['{}', '{}']::jsonb[], headers => ARRAY['{}']::jsonb[])",
            "headers has 1 elements but payloads has 2",
        ),
        (
            "SELECT sqlstreams.produce_batch($1, ARRAY['{}', '{}']::jsonb[], headers => ARRAY[NULL, '3']::jsonb[])",
            "headers 2 of the batch is not a JSON object",
        ),
        ("SELECT sqlstreams.produce_batch($1, ARRAY['{}']::jsonb[], deliver_after => '-1 day')", "is negative"),
        ("SELECT sqlstreams.produce($1, '{}', deliver_after => '11 years')", "is longer than 10 years"),
        ("SELECT sqlstreams.produce($1, '{}', deliver_after => '10 years 50 days')", "is longer than 10 years"),
        ("SELECT sqlstreams.produce($1, '{}', deliver_after => '3601 days')", "is longer than 10 years"),
        (
            "SELECT sqlstreams.produce($1, '{}', 'k', compaction => true, deliver_after => '1 minute')",
            "a compacted message cannot be delayed",
        ),
        (
            "SELECT sqlstreams.produce_batch($1, ARRAY['{}']::jsonb[], ARRAY['k'], compaction => true,
                                             deliver_after => '1 minute')",
            "a compacted message cannot be delayed",
        ),
        (
            "SELECT sqlstreams.produce_batch($1, ARRAY['{}', '{}']::jsonb[], headers => ARRAY[['{}'], ['{}']]::jsonb[])",
            "headers must be a one-dimensional array",
        ),
    ];
    for (sql, message) in cases {
        let err = c.query(sql, &[&s.name]).expect_err(sql);
        assert_eq!(sqlstate(&err), "22023", "{sql}: {}", describe(&err));
        let db = err.as_db_error().unwrap();
        assert!(db.message().contains(message), "{sql}: {}", db.message());
        assert!(db.hint().is_some(), "{sql} has a hint");
    }
    assert_eq!(head(&mut c), before, "no refused call took an id");
}

#[test]
fn a_delayed_message_waits_for_its_time_and_holds_only_its_ordered_key() {
    let mut c = connect();
    let s = Stream::create(&mut c, "delayed");
    let ordered = s.group(&mut c, "ordered", Some("ordered"));
    let parallel = s.group(&mut c, "parallel", Some("parallel"));
    let later: i64 = c
        .query_one("SELECT sqlstreams.produce($1, '{\"n\": 1}', 'k', deliver_after => '1 hour')", &[&s.name])
        .unwrap()
        .get(0);
    let behind = s.produce(&mut c, json!({"n": 2}), Some("k"));
    let other = s.produce(&mut c, json!({"n": 3}), Some("j"));

    let sql =
        format!("SELECT deliver_at - produced_at = interval '1 hour' FROM {} WHERE id = $1", s.table("message_log"));
    assert!(c.query_one(&sql, &[&later]).unwrap().get::<_, bool>(0), "deliver_after counts from produced_at");

    // Ordered: k's later message waits behind the delayed one; j is not held.
    assert_eq!(ids(&ordered.claim(&mut c, 100)), vec![other]);
    let rows = ordered.exception_rows(&mut c);
    assert_eq!(
        rows.iter().map(|r| (r.message_id, r.status.as_str(), r.attempts)).collect::<Vec<_>>(),
        vec![(later, "ready", 0), (behind, "deferred", 0)]
    );
    assert!(ordered.claim(&mut c, 100).is_empty(), "nothing is due before the hour");
    // Parallel: only the delayed message waits.
    assert_eq!(ids(&parallel.claim(&mut c, 100)), vec![behind, other]);
    assert!(parallel.claim(&mut c, 100).is_empty());

    // Its time comes: a first delivery (attempt 0), then k's next message, in order.
    ordered.make_due(&mut c);
    parallel.make_due(&mut c);
    let due = ordered.claim(&mut c, 100);
    assert_eq!(
        due.iter().map(|d| (d.message_id, d.attempt, d.run_after)).collect::<Vec<_>>(),
        vec![(later, 0, None), (behind, 0, Some(later))]
    );
    let due = parallel.claim(&mut c, 100);
    assert_eq!((ids(&due), due[0].attempt), (vec![later], 0));
}

#[test]
fn a_delayed_message_whose_time_has_come_is_delivered_in_its_range() {
    let mut c = connect();
    let s = Stream::create(&mut c, "due");
    let g = s.group(&mut c, "g", Some("ordered"));
    // deliver_after counts from the producing transaction's start: a transaction that outlives
    // it commits a message that is due at once.
    c.batch_execute(&format!(
        "BEGIN;
         SELECT sqlstreams.produce('{0}', '{{\"n\": 1}}', 'k', deliver_after => '10 milliseconds');
         SELECT pg_sleep(0.05);
         SELECT sqlstreams.produce('{0}', '{{\"n\": 2}}', 'k');
         COMMIT;",
        s.name
    ))
    .unwrap();
    let got = g.claim(&mut c, 100);
    assert_eq!(got.iter().map(|d| (d.message_id, d.run_after)).collect::<Vec<_>>(), vec![(1, None), (2, Some(1))]);
    assert!(g.exception_rows(&mut c).is_empty(), "nothing went through the queue");
}

#[test]
fn a_delayed_message_produced_inside_an_outbox_transaction_vanishes_with_a_rollback() {
    let mut c = connect();
    let s = Stream::create(&mut c, "outbox");
    let g = s.group(&mut c, "g", None);
    let mut tx = c.transaction().unwrap();
    tx.query_one("SELECT sqlstreams.produce($1, '{}', 'k', deliver_after => '1 second')", &[&s.name]).unwrap();
    tx.rollback().unwrap();
    let kept = s.produce(&mut c, json!({}), Some("k"));
    assert_eq!(ids(&g.claim(&mut c, 100)), vec![kept]);
    assert!(g.exception_rows(&mut c).is_empty());
}

#[test]
fn messages_held_back_do_not_take_the_room_of_due_ones() {
    let mut c = connect();
    let name = unique("held-back");
    let id: i64 = c.query_one("SELECT sqlstreams.create_stream($1, lanes => 1)", &[&name]).unwrap().get(0);
    let s = Stream { name, id };
    let g = s.group(&mut c, "g", Some("parallel"));
    c.query_one(
        "SELECT count(*) FROM sqlstreams.produce_batch($1, array_fill('{}'::jsonb, ARRAY[250]), deliver_after => '1 hour')",
        &[&s.name],
    )
    .unwrap();
    let due = s.produce(&mut c, json!({"due": true}), None);
    assert_eq!(ids(&g.claim(&mut c, 100)), vec![due], "the first claim reads past 250 held-back messages");
    let held = g.statuses(&mut c);
    assert_eq!(held.len(), 250);
    assert!(held.iter().all(|(_, status)| status == "ready"));
}
