//! Every refused call of the contract: its SQLSTATE, a message naming the offending value with
//! a hint, and no side effect.

use postgres::Client;
use sqlstreams_tests::*;

/// Everything a refused call could have changed, for before/after comparison.
fn footprint(c: &mut Client, s: &Stream) -> Vec<i64> {
    let sql = format!(
        "SELECT (SELECT count(*) FROM sqlstreams.stream),
                (SELECT count(*) FROM sqlstreams.consumer_group),
                (SELECT count(*) FROM {log}),
                (SELECT last_value FROM {log}_seq),
                (SELECT count(*) FROM {eq}),
                (SELECT count(*) FROM {ranges}),
                (SELECT coalesce(sum(claimed), 0)::int8 FROM {cursor})",
        log = s.table("message_log"),
        eq = s.table("exception_queue"),
        ranges = s.table("range_lease"),
        cursor = s.table("cursor"),
    );
    let row = c.query_one(&sql, &[]).unwrap();
    (0..7).map(|i| row.get(i)).collect()
}

/// Runs `sql` ({s}: the stream, {g}: the group, {t}: a live lease token), expecting `state`;
/// checks the message names `mentions` and carries a hint, and that nothing changed.
fn refused(c: &mut Client, s: &Stream, g: &Group, token: uuid::Uuid, sql: &str, state: &str, mentions: &str) {
    let sql = &sql
        .replace("{s}", &format!("'{}'", s.name))
        .replace("{g}", &format!("'{}'", g.name))
        .replace("{t}", &format!("'{token}'"));
    let before = footprint(c, s);
    let err = c.query(sql.as_str(), &[]).expect_err(sql);
    assert_eq!(sqlstate(&err), state, "{sql}: {err}");
    let db = err.as_db_error().expect("a database error");
    assert!(db.message().contains(mentions), "{sql}: message {:?} should mention {mentions:?}", db.message());
    assert!(db.hint().is_some_and(|h| !h.is_empty()), "{sql}: a refusal says what to do instead");
    assert_eq!(footprint(c, s), before, "{sql}: a refused call changes nothing");
}

#[test]
fn contract_errors_have_their_sqlstates_and_change_nothing() {
    let mut c = connect();
    let s = Stream::create(&mut c, "errors");
    let g = s.group(&mut c, "g", None);
    s.produce(&mut c, json!({}), Some("k"));
    let token = g.claim(&mut c, 1)[0].lease_token;
    let long = "x".repeat(201);

    let unknown_object = [
        ("SELECT sqlstreams.produce('no-such-stream', '{}')", "no-such-stream"),
        ("SELECT * FROM sqlstreams.claim('no-such-stream', {g})", "no-such-stream"),
        ("SELECT * FROM sqlstreams.claim({s}, 'no-such-group')", "no-such-group"),
        ("SELECT sqlstreams.ack({s}, 'no-such-group', {t}, 1)", "no-such-group"),
        ("SELECT sqlstreams.ack_batch({s}, 'no-such-group', {t}, ARRAY[1::bigint])", "no-such-group"),
        ("SELECT sqlstreams.fail({s}, 'no-such-group', {t}, 1, 'x')", "no-such-group"),
        ("SELECT sqlstreams.delay({s}, 'no-such-group', {t}, 1, '1 s')", "no-such-group"),
        ("SELECT sqlstreams.ack('no-such-stream', {g}, {t}, 1)", "no-such-stream"),
        ("SELECT sqlstreams.create_group('no-such-stream', {g})", "no-such-stream"),
        ("SELECT sqlstreams.drop_group('no-such-stream', {g})", "no-such-stream"),
        ("SELECT * FROM sqlstreams.group_status({s}, 'no-such-group')", "no-such-group"),
    ];
    for (sql, mentions) in unknown_object {
        refused(&mut c, &s, &g, token, sql, "42704", mentions);
    }

    let long_stream = format!("SELECT sqlstreams.create_stream('{long}')");
    let long_group = format!("SELECT sqlstreams.create_group({{s}}, '{long}')");
    let invalid = [
        ("SELECT sqlstreams.produce({s}, '{}', 'k', 'fifo')", "'fifo'"),
        ("SELECT sqlstreams.produce({s}, '{}', 'k', 'ordered', true)", "compaction"),
        ("SELECT sqlstreams.produce({s}, '{}', NULL, 'ordered')", "message_key"),
        ("SELECT sqlstreams.produce({s}, '{}', NULL, 'exclusive')", "message_key"),
        ("SELECT sqlstreams.produce({s}, '{}', NULL, NULL, true)", "message_key"),
        ("SELECT sqlstreams.produce({s}, NULL)", "payload"),
        ("SELECT sqlstreams.produce_batch({s}, ARRAY['{}']::jsonb[], ARRAY[NULL], 'ordered')", "message_key"),
        ("SELECT sqlstreams.produce_batch({s}, ARRAY['{}']::jsonb[], ARRAY['k'], 'ordered', true)", "compaction"),
        ("SELECT sqlstreams.create_group({s}, {g}, 'fifo')", "'fifo'"),
        ("SELECT sqlstreams.create_group({s}, {g}, max_retries => -1)", "max_retries"),
        ("SELECT sqlstreams.create_group({s}, 'new-group', start_at => 'tail')", "'tail'"),
        ("SELECT sqlstreams.create_group({s}, {g}, backoff_base => '0 s')", "backoff_base"),
        ("SELECT * FROM sqlstreams.claim({s}, {g}, 0)", "batch_size"),
        ("SELECT * FROM sqlstreams.claim({s}, {g}, -5)", "batch_size"),
        ("SELECT * FROM sqlstreams.claim({s}, {g}, 10, '0 seconds')", "lease"),
        ("SELECT * FROM sqlstreams.claim({s}, {g}, 10, '-1 second')", "lease"),
        ("SELECT sqlstreams.delay({s}, {g}, {t}, 1, '0 seconds')", "delay"),
        ("SELECT sqlstreams.delay({s}, {g}, {t}, 1, '-5 seconds')", "delay"),
        ("SELECT sqlstreams.fail({s}, {g}, {t}, 1, 'x', false, '-1 second')", "retry_after"),
        ("SELECT sqlstreams.create_stream('')", "empty"),
        ("SELECT sqlstreams.create_stream('   ')", "empty"),
        ("SELECT sqlstreams.create_group({s}, '')", "empty"),
        ("SELECT sqlstreams.create_stream({s}, 50)", "partition_size"),
        (long_stream.as_str(), "201 characters"),
        (long_group.as_str(), "201 characters"),
    ];
    for (sql, mentions) in invalid {
        refused(&mut c, &s, &g, token, sql, "22023", mentions);
    }
}

#[test]
fn claim_refuses_old_snapshots() {
    let mut c = connect();
    let s = Stream::create(&mut c, "isolation");
    let g = s.group(&mut c, "g", None);
    let mut tx = c.build_transaction().isolation_level(postgres::IsolationLevel::RepeatableRead).start().unwrap();
    let err = tx.query("SELECT * FROM sqlstreams.claim($1, $2)", &[&s.name, &g.name]).unwrap_err();
    assert_eq!(sqlstate(&err), "25000");
    assert!(err.as_db_error().unwrap().hint().unwrap().contains("READ COMMITTED"));
}
