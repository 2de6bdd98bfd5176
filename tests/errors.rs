//! Every refused call of the contract: its SQLSTATE, a message naming the offending value with
//! a hint, and no side effect.

use postgres::Client;
use sqlstreams_tests::*;

/// Everything a refused call could have changed, for before/after comparison: this test's own
/// stream, its groups and tables, and streams named like the refused `create_stream` calls.
/// Nothing here counts objects of other tests, which run at the same time.
fn footprint(c: &mut Client, s: &Stream) -> Vec<String> {
    let sql = format!(
        "SELECT (SELECT s::text FROM sqlstreams.stream s WHERE s.id = $1),
                (SELECT string_agg(g::text, ';' ORDER BY g.id) FROM sqlstreams.consumer_group g WHERE g.stream_id = $1),
                (SELECT count(*)::text FROM sqlstreams.stream WHERE name = ANY($2) OR name LIKE 'xxxxxxxxxx%'),
                (SELECT count(*)::text FROM {log}),
                (SELECT last_value::text FROM {log}_seq),
                (SELECT string_agg(e::text, ';' ORDER BY e.message_id) FROM {eq} e),
                (SELECT string_agg(r::text, ';' ORDER BY r.first_id) FROM {ranges} r),
                (SELECT string_agg(d::text, ';' ORDER BY d.lease_token, d.message_id) FROM {done} d),
                (SELECT string_agg(k::text, ';' ORDER BY k.consumer_group_id, k.lane) FROM {lanes} k),
                (SELECT string_agg(u::text, ';' ORDER BY u.consumer_group_id) FROM {cursor} u)",
        log = s.table("message_log"),
        eq = s.table("exception_queue"),
        ranges = s.table("range_lease"),
        done = s.table("range_done"),
        lanes = s.table("lane"),
        cursor = s.table("cursor"),
    );
    let refused_names = vec!["".to_string(), "   ".to_string()];
    let row = c.query_one(&sql, &[&s.id, &refused_names]).unwrap();
    (0..10).map(|i| row.get::<_, Option<String>>(i).unwrap_or_default()).collect()
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
        ("SELECT sqlstreams.produce({s}, '{}', repeat('k', 1025))", "1025 bytes"),
        ("SELECT sqlstreams.produce({s}, '{}', repeat('é', 513))", "1026 bytes"),
        ("SELECT sqlstreams.produce({s}, '{}', idempotency_key => repeat('i', 1025))", "1025 bytes"),
        (
            "SELECT sqlstreams.produce_batch({s}, ARRAY['{}', '{}']::jsonb[], ARRAY['k', repeat('k', 2000)])",
            "2000 bytes",
        ),
        ("SELECT sqlstreams.produce_batch({s}, ARRAY['{}']::jsonb[], ARRAY[NULL], 'ordered')", "message_key"),
        ("SELECT sqlstreams.produce_batch({s}, ARRAY['{}']::jsonb[], ARRAY['k'], 'ordered', true)", "compaction"),
        ("SELECT sqlstreams.create_group({s}, {g}, 'fifo')", "'fifo'"),
        ("SELECT sqlstreams.create_group({s}, {g}, max_retries => -1)", "max_retries"),
        ("SELECT sqlstreams.create_group({s}, 'new-group', start_at => 'tail')", "'tail'"),
        (
            "SELECT sqlstreams.create_group({s}, {g}, backoff_base => '0 s')",
            "backoff_base must be positive, not 0 seconds",
        ),
        ("SELECT * FROM sqlstreams.claim({s}, {g}, 0)", "batch_size"),
        ("SELECT * FROM sqlstreams.claim({s}, {g}, -5)", "batch_size"),
        ("SELECT * FROM sqlstreams.claim({s}, {g}, 10, '0 seconds')", "lease must be positive, not 0 seconds"),
        ("SELECT * FROM sqlstreams.claim({s}, {g}, 10, '-1 second')", "lease must be positive, not -1 second"),
        ("SELECT * FROM sqlstreams.claim({s}, {g}, 10, '-1 day -0.25 seconds')", "not -86400.25 seconds"),
        ("SELECT sqlstreams.delay({s}, {g}, {t}, 1, '0 seconds')", "delay"),
        ("SELECT sqlstreams.delay({s}, {g}, {t}, 1, '-5 seconds')", "delay must be positive, not -5 seconds"),
        (
            "SELECT sqlstreams.fail({s}, {g}, {t}, 1, 'x', false, '-1 second')",
            "retry_after must not be negative, not -1 second",
        ),
        ("SELECT sqlstreams.fail({s}, {g}, {t}, 1, 'x', false, '-0.000001 seconds')", "not -0.000001 seconds"),
        ("SELECT sqlstreams.seek({s}, {g}, to_id => -3)", "to_id must not be negative, not -3"),
        ("SELECT sqlstreams.create_stream('')", "empty"),
        ("SELECT sqlstreams.create_stream('   ')", "empty"),
        ("SELECT sqlstreams.create_group({s}, '')", "empty"),
        ("SELECT sqlstreams.create_stream({s}, 50)", "partition_size"),
        ("SELECT * FROM sqlstreams.maintain_stream(NULL)", "stream"),
        ("SELECT sqlstreams.lane('k', 1, 0)", "not 0"),
        ("SELECT sqlstreams.lane('k', 1, -3)", "not -3"),
        ("SELECT sqlstreams.lane(NULL, 1, 1025)", "not 1025"),
        ("SELECT sqlstreams.create_stream({s}, idempotency_ttl => '9223372036854 seconds')", "idempotency_ttl"),
        (
            "SELECT sqlstreams.alter_stream({s}, idempotency_ttl => '101 years')",
            "idempotency_ttl 3141504000 seconds is longer",
        ),
        ("SELECT * FROM sqlstreams.claim({s}, {g}, 10, '90000 seconds')", "lease 90000 seconds is longer than"),
        (
            "SELECT sqlstreams.create_group({s}, {g}, backoff_base => '10 s', backoff_cap => '2.5 s')",
            "backoff_cap 2.5 seconds is shorter than backoff_base 10 seconds",
        ),
        ("SELECT sqlstreams.alter_stream({s}, dead_retention => '9223372036854 seconds')", "dead_retention"),
        ("SELECT sqlstreams.alter_stream({s}, max_bytes => -1)", "max_bytes"),
        ("SELECT sqlstreams.alter_stream({s}, max_age => '101 years')", "max_age"),
        ("SELECT sqlstreams.alter_stream({s}, max_age => '-1 day')", "max_age"),
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
    assert_eq!(
        err.as_db_error().unwrap().message(),
        "sqlstreams: claim needs a READ COMMITTED transaction, not REPEATABLE READ"
    );
    assert!(err.as_db_error().unwrap().hint().unwrap().contains("READ COMMITTED"));
    tx.rollback().unwrap();
    // In autocommit, the level a database or role setting gives, named with where it comes from.
    c.batch_execute("SET default_transaction_isolation = 'serializable'").unwrap();
    let err = c.query("SELECT * FROM sqlstreams.claim($1, $2)", &[&s.name, &g.name]).unwrap_err();
    let db = err.as_db_error().unwrap();
    assert_eq!(db.message(), "sqlstreams: claim needs a READ COMMITTED transaction, not SERIALIZABLE");
    assert!(
        db.hint().unwrap().contains("SET default_transaction_isolation = 'read committed' in the session"),
        "{:?}",
        db.hint()
    );
    let err = c.query("SELECT * FROM sqlstreams.maintain_stream($1)", &[&s.name]).unwrap_err();
    assert_eq!(
        err.as_db_error().unwrap().message(),
        "sqlstreams: maintain needs a READ COMMITTED transaction, not SERIALIZABLE"
    );
}

#[test]
fn a_missing_name_is_refused_with_an_example_of_its_kind() {
    let mut c = connect();
    let s = Stream::create(&mut c, "example");
    for (sql, example) in [
        ("SELECT sqlstreams.create_stream('')", "'ledger.adjustments'"),
        ("SELECT sqlstreams.create_group($1, ' ')", "'apply-balance'"),
        ("SELECT sqlstreams.create_group($1, NULL)", "'apply-balance'"),
    ] {
        let params: &[&(dyn postgres::types::ToSql + Sync)] = if sql.contains("$1") { &[&s.name] } else { &[] };
        let err = c.query(sql, params).unwrap_err();
        let hint = err.as_db_error().unwrap().hint().unwrap().to_string();
        assert!(hint.contains(example), "{sql}: {hint}");
    }
}

#[test]
fn drop_stream_under_repeatable_read_leaves_no_group_behind() {
    let mut c = connect();
    let s = Stream::create(&mut c, "drop-rr");
    let mut other = connect();
    c.batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT 1").unwrap();
    // A group created after the snapshot: the drop does not see it.
    other.query_one("SELECT sqlstreams.create_group($1, 'late')", &[&s.name]).unwrap();
    let err = c.query_one("SELECT sqlstreams.drop_stream($1)", &[&s.name]).expect_err("a serialization failure");
    assert_eq!(sqlstate(&err), "40001", "{err}");
    c.batch_execute("ROLLBACK").unwrap();
    assert!(c.query_one("SELECT sqlstreams.drop_stream($1)", &[&s.name]).unwrap().get::<_, bool>(0));
    let orphans: i64 = c
        .query_one(
            "SELECT count(*) FROM sqlstreams.consumer_group g
             WHERE NOT EXISTS (SELECT 1 FROM sqlstreams.stream s WHERE s.id = g.stream_id)",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(orphans, 0);
}

/// A stream's error whose text is not ASCII, in a database whose encoding is not UTF8 (EUC_JP):
/// the warning that leaves the stream out of `maintain()` shows its ASCII, with `?` for the rest,
/// and the other streams are maintained. Before, the message as pgrx decodes it (UTF-8) was sent
/// as if it were EUC_JP, which the server refused (22021): that error ended the call, and the
/// other streams' steps were rolled back with it.
#[test]
fn maintain_warns_of_an_error_that_is_not_ascii_in_a_database_that_is_not_utf8() {
    let (_, url) = own_database_in("encoding_db", "EUC_JP");
    let (mut c, warnings) = listening_to(&url);
    let expiring = "SELECT sqlstreams.create_stream($1, 1000, idempotency_ttl => '1 microsecond')";
    let refused = Stream::create_sized(&mut c, "refused", 1000);
    let healthy = Stream::create_sized(&mut c, "healthy", 1000);
    for s in [&refused, &healthy] {
        c.query_one(expiring, &[&s.name]).unwrap();
        c.query_one("SELECT sqlstreams.produce($1, '{}', idempotency_key => 'order-1')", &[&s.name]).unwrap();
    }
    refuse_on(&mut c, &refused.table("idempotency_key"), "DELETE", "refused: 拒否されました");
    assert_eq!(maintained(&mut c), vec![(healthy.name.clone(), 1)]);
    let warned = warnings.lock().unwrap().clone();
    let about = format!("sqlstreams: stream \"{}\" is not maintained: refused: ?", refused.name);
    assert!(warned.iter().any(|w| w.starts_with(&about) && w.is_ascii()), "{warned:?}");
}

/// A stream whose name this database cannot read (a UTF8 database's, restored into a LATIN1 one)
/// is left out of `maintain()`, with a warning that shows the name, and the other streams are
/// maintained all the same, as the worker maintains them. Before, the name's error ended the call.
#[test]
fn maintain_leaves_out_a_stream_whose_name_it_cannot_read() {
    let (_, url) = own_database_in("restored_db", "LATIN1");
    let (mut c, warnings) = listening_to(&url);
    for name in ["named", "healthy"] {
        c.query_one("SELECT sqlstreams.create_stream($1, idempotency_ttl => '1 microsecond')", &[&name]).unwrap();
        c.query_one("SELECT sqlstreams.produce($1, '{}', idempotency_key => 'order-1')", &[&name]).unwrap();
    }
    // What a restore of a UTF8 database's dump writes here: LATIN1 bytes (0xE9 is é).
    c.batch_execute(r"UPDATE sqlstreams.stream SET name = E'named\xe9' WHERE name = 'named'").unwrap();
    let rows = maintained(&mut c);
    assert_eq!(rows, vec![("healthy".to_string(), 1)]);
    let warned = warnings.lock().unwrap().clone();
    assert!(
        warned.iter().any(|w| w.contains("a stream is not maintained") && w.contains(r"E'named\xe9'")),
        "a warning shows the name: {warned:?}"
    );
}

/// Texts the extension never wrote: a UTF8 database's keys, error messages and names restored
/// into a LATIN1 one. A call that reads one refuses with 22021 naming it, where pgrx's panic
/// raised XX000 ("datums converted to &str should be valid UTF-8", at pgrx's from.rs).
#[test]
fn a_stored_text_that_cannot_be_read_as_utf8_is_refused_naming_it() {
    let (mut c, _) = own_database_in("restored_db", "LATIN1");
    c.batch_execute(
        "SELECT sqlstreams.create_stream('s'); SELECT sqlstreams.create_group('s', 'g');
         SELECT sqlstreams.produce('s', '{}', 'k1'); SELECT sqlstreams.produce('s', '{}', 'k2')",
    )
    .unwrap();
    let row = c.query_one("SELECT message_id, lease_token FROM sqlstreams.claim('s', 'g', 1)", &[]).unwrap();
    let (id, token): (i64, uuid::Uuid) = (row.get(0), row.get(1));
    c.execute("SELECT sqlstreams.fail('s', 'g', $1, $2, 'bad', permanent => true)", &[&token, &id]).unwrap();
    let stream: i64 = c.query_one("SELECT id FROM sqlstreams.stream WHERE name = 's'", &[]).unwrap().get(0);
    // What a restore of a UTF8 database's dump writes here: LATIN1 bytes (0xE9 is é, 0xFC ü).
    c.batch_execute(&format!(
        r"UPDATE sqlstreams.message_log_{stream} SET message_key = E'k\xe9' WHERE id <> {id};
          UPDATE sqlstreams.exception_queue_{stream} SET last_error = E'Konto ung\xfcltig'"
    ))
    .unwrap();
    for (call, shown) in [
        ("SELECT * FROM sqlstreams.claim('s', 'g', 10)", r"E'k\xe9'"),
        ("SELECT * FROM sqlstreams.peek('s', 0, 10)", r"E'k\xe9'"),
        ("SELECT * FROM sqlstreams.dead_messages('s', 'g')", r"E'Konto ung\xfcltig'"),
    ] {
        let err = c.batch_execute(call).unwrap_err();
        assert_eq!(sqlstate(&err), "22021", "{call}: {err:?}");
        let db = err.as_db_error().unwrap();
        let expected =
            format!("a text stored in this database, {shown}, is not ASCII, and the database's encoding is LATIN1");
        assert!(db.message().contains(&expected), "{call}: {}", db.message());
        assert!(db.hint().is_some_and(|h| h.contains("ENCODING 'UTF8'")), "{call}: {err:?}");
        assert_eq!(db.routine(), Some("sqlstreams"), "{call}: the extension's own report, not a panic's: {err:?}");
    }
    // A range's keys (a text[]), read back by the claim that hands the range out again once its
    // lease ran out: one that is not ASCII among others, inline, and compressed past 2 kB.
    for (group, keys) in [("r", 2), ("big", 300)] {
        c.batch_execute(&format!(
            "SELECT sqlstreams.create_group('s', '{group}', 'ordered', start_at => 'head');
             SELECT sqlstreams.produce_batch('s', array_fill('{{}}'::jsonb, ARRAY[{keys}]),
                                            ARRAY(SELECT 'key-' || i FROM generate_series(1, {keys}) i))"
        ))
        .unwrap();
        let rows = c.query("SELECT lease_token FROM sqlstreams.claim('s', $1, 1000)", &[&group]).unwrap();
        assert_eq!(rows.len(), keys, "{group}");
        let token: uuid::Uuid = rows[0].get(0);
        c.batch_execute(&format!(
            r"UPDATE sqlstreams.range_lease_{stream} SET pending_keys[2] = E'k\xe9',
                  lease_expires_at = now() - interval '1 hour'
              WHERE lease_token = '{token}';
              UPDATE sqlstreams.lane_{stream} SET held_until = now() - interval '1 hour' WHERE held_by = '{token}'"
        ))
        .unwrap();
        let err = c.execute("SELECT * FROM sqlstreams.claim('s', $1, 1000)", &[&group]).unwrap_err();
        assert_eq!(sqlstate(&err), "22021", "{group}: {err:?}");
        assert!(err.as_db_error().unwrap().message().contains(r"E'k\xe9'"), "{group}: {err:?}");
        c.batch_execute(&format!("UPDATE sqlstreams.range_lease_{stream} SET pending_keys[2] = 'key-2'")).unwrap();
    }
    // A group's name, in a stream a role may not see: the view shows that role its own groups,
    // and never the other's name in an error. A superuser, who sees it, is refused naming it.
    let role = role(&mut c, "viewer", "IN ROLE sqlstreams_consumer");
    c.batch_execute(&format!(
        r"SELECT sqlstreams.create_stream('t'); SELECT sqlstreams.create_group('t', 'h');
          UPDATE sqlstreams.consumer_group SET name = E'h\xe9' WHERE name = 'h';
          SELECT sqlstreams.grant_stream('s', '{role}', 'consume')"
    ))
    .unwrap();
    c.batch_execute(&format!("SET ROLE \"{role}\"")).unwrap();
    let seen: Vec<String> = c
        .query("SELECT stream || '/' || name FROM sqlstreams.consumer_groups ORDER BY 1", &[])
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(seen, vec!["s/big", "s/g", "s/r"], "its own stream's groups, and no error");
    c.batch_execute("RESET ROLE").unwrap();
    let err = c.batch_execute("SELECT * FROM sqlstreams.consumer_groups").unwrap_err();
    assert!(err.as_db_error().unwrap().message().contains(r"E'h\xe9' is not ASCII"), "{err:?}");
    c.batch_execute(r"UPDATE sqlstreams.consumer_group SET name = 'h' WHERE name = E'h\xe9'").unwrap();
    c.batch_execute(&format!("SELECT sqlstreams.drop_stream('t'); DROP OWNED BY \"{role}\"; DROP ROLE \"{role}\""))
        .unwrap();
    // (A stream's name, which maintain() reads for every stream, leaves that stream out of it:
    // maintain_leaves_out_a_stream_whose_name_it_cannot_read.)
    // Rewritten in ASCII, the texts read again.
    c.batch_execute(&format!(
        r"UPDATE sqlstreams.message_log_{stream} SET message_key = 'k3' WHERE message_key = E'k\xe9';
          UPDATE sqlstreams.exception_queue_{stream} SET last_error = 'bad'"
    ))
    .unwrap();
    let keys: Vec<String> = c
        .query("SELECT message_key FROM sqlstreams.claim('s', 'g', 1000)", &[])
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(keys.len(), 303, "k3, and the other groups' 302 messages");
    assert!(keys.iter().any(|k| k == "k3"), "{keys:?}");
    c.batch_execute("SELECT sqlstreams.maintain(); SELECT * FROM sqlstreams.dead_messages('s', 'g')").unwrap();
}

/// In an SQL_ASCII database, a key that is not valid UTF-8 cannot be read as UTF-8: produce
/// refuses it, in a batch too, rather than store a message that every later claim of its lane
/// would fail on. ASCII keys, and keys that are valid UTF-8, work there as anywhere.
#[test]
fn a_key_that_is_not_utf8_is_refused_in_an_sql_ascii_database() {
    let (mut c, _) = own_database_in("encoding_db", "SQL_ASCII");
    c.batch_execute(
        "SELECT sqlstreams.create_stream('s');
         SELECT sqlstreams.create_group('s', 'g', 'ordered');",
    )
    .unwrap();
    // The key's bytes are spelled in SQL: x then 0xE9 (é in LATIN1), which is not UTF-8.
    let batch = "SELECT sqlstreams.produce_batch('s', ARRAY['{}', '{}']::jsonb[], ARRAY['plain', E'x\\xe9'])";
    let err = c.batch_execute(batch).unwrap_err();
    assert_eq!(sqlstate(&err), "22023", "{err:?}");
    let message = err.as_db_error().unwrap().message().to_string();
    assert!(message.contains(r"message_key E'x\xe9' is not valid UTF-8"), "{message}");
    assert!(err.as_db_error().unwrap().hint().is_some_and(|h| h.contains("ASCII or UTF-8")), "{err:?}");
    let idempotency =
        "SELECT sqlstreams.produce_batch('s', ARRAY['{}']::jsonb[], ARRAY['k'], idempotency_keys => ARRAY[E'i\\xe9'])";
    assert_eq!(sqlstate(&c.batch_execute(idempotency).unwrap_err()), "22023");
    // One message at a time, refused the same way (not with an internal error of the conversion).
    for (one, what) in [
        (r"SELECT sqlstreams.produce('s', '{}', E'x\xe9')", r"message_key E'x\xe9'"),
        (r"SELECT sqlstreams.produce('s', '{}', 'k', idempotency_key => E'i\xe9')", r"idempotency_key E'i\xe9'"),
        // 40 characters shown, a valid é among them (two bytes), then where the bad byte is.
        (
            &format!(r"SELECT sqlstreams.produce('s', '{{}}', E'{}\xc3\xa9\xe9')", "a".repeat(39)),
            &format!("message_key '{}\u{e9}'... (byte 42 is \\xe9) is not valid UTF-8", "a".repeat(39)),
        ),
    ] {
        let err = c.batch_execute(one).unwrap_err();
        assert_eq!(sqlstate(&err), "22023", "{err:?}");
        let message = err.as_db_error().unwrap().message().to_string();
        assert!(message.contains(what), "{message}");
    }
    let id: i64 = c.query_one("SELECT id FROM sqlstreams.streams WHERE name = 's'", &[]).unwrap().get(0);
    let produced: i64 = c.query_one(&format!("SELECT count(*) FROM sqlstreams.message_log_{id}"), &[]).unwrap().get(0);
    assert_eq!(produced, 0, "nothing of the refused batches is stored");
    c.execute(
        "SELECT sqlstreams.produce_batch('s', ARRAY['{}', '{}', '{}']::jsonb[], ARRAY['plain', 'other', $1])",
        &[&"k\u{e4}se"],
    )
    .unwrap();
    let keys: Vec<String> = c
        .query("SELECT message_key FROM sqlstreams.claim('s', 'g', 10) ORDER BY message_id", &[])
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(keys, ["plain", "other", "k\u{e4}se"]);
}

/// In a LATIN1 database, a name or another word that is not ASCII cannot be read as UTF-8: every
/// call refuses it with 22023 naming the argument (not with pgrx's internal error), and changes
/// nothing. A failure's error message is kept, its bytes beyond ASCII escaped. A role's name may
/// be anything: such a role is refused by name, and granted. In an SQL_ASCII database, a name
/// that is valid UTF-8 works, as it did, and one that is not is refused.
#[test]
fn a_text_argument_that_cannot_be_read_as_utf8_is_refused_naming_it() {
    let (mut c, _) = own_database_in("encoding_db", "LATIN1");
    c.batch_execute("SELECT sqlstreams.create_stream('s'); SELECT sqlstreams.create_group('s', 'g')").unwrap();
    // The bytes are spelled in SQL: 0xE9 is é in LATIN1, and not UTF-8.
    for (call, argument) in [
        (r"SELECT sqlstreams.create_stream(E'caf\xe9')", r"argument 1 E'caf\xe9' is not ASCII"),
        (r"SELECT sqlstreams.create_group('s', E'gr\xfcn')", r"argument 2 E'gr\xfcn'"),
        (r"SELECT * FROM sqlstreams.claim('s', E'g\xe9', 10)", r"argument 2 E'g\xe9'"),
        (r"SELECT sqlstreams.produce('s', '{}', 'k', concurrency => E'ordered\xe9')", "argument 4"),
        (r"SELECT * FROM sqlstreams.group_status(E'\xe9', 'g')", "argument 1"),
        (r"SELECT sqlstreams.produce('s', '{}', E'k\xe9')", r"message_key E'k\xe9'"),
        (&format!("SELECT sqlstreams.create_stream(E'{}')", r"\xe9".repeat(50)), r"\xe9'... is not ASCII"),
        // What cannot be read lies past the 40 characters shown: the message says where it is.
        (
            &format!(r"SELECT sqlstreams.create_stream(E'{}\xe9')", "a".repeat(50)),
            &format!(r"argument 1 '{}'... (byte 51 is \xe9) is not ASCII", "a".repeat(40)),
        ),
    ] {
        let err = c.batch_execute(call).unwrap_err();
        assert_eq!(sqlstate(&err), "22023", "{call}: {err:?}");
        let db = err.as_db_error().unwrap();
        assert!(db.message().contains(argument) && db.message().contains("LATIN1"), "{call}: {}", db.message());
        assert!(db.hint().is_some_and(|h| h.contains("UTF8")), "{call}: {err:?}");
    }
    let counts: (i64, i64, i64) = c
        .query_one(
            "SELECT (SELECT count(*) FROM sqlstreams.stream), (SELECT count(*) FROM sqlstreams.consumer_group),
                    (SELECT head FROM sqlstreams.streams)",
            &[],
        )
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .unwrap();
    assert_eq!(counts, (1, 1, 0), "the refused calls created and produced nothing");

    c.batch_execute("SELECT sqlstreams.produce('s', '{}', 'k')").unwrap();
    let row = c.query_one("SELECT message_id, lease_token FROM sqlstreams.claim('s', 'g', 10)", &[]).unwrap();
    let (id, token): (i64, uuid::Uuid) = (row.get(0), row.get(1));
    let fail = r"SELECT sqlstreams.fail('s', 'g', $1, $2, E'Konto ung\xfcltig \\ ok', permanent => true)";
    let status: String = c.query_one(fail, &[&token, &id]).unwrap().get(0);
    assert_eq!(status, "dead");
    let error: String = c.query_one("SELECT last_error FROM sqlstreams.dead_messages('s', 'g')", &[]).unwrap().get(0);
    assert_eq!(error, r"Konto ung\xfcltig \\ ok");

    // A role named in UTF-8 by this client, stored in LATIN1 by the server.
    let role = unique("j\u{fc}rgen");
    c.batch_execute(&format!("CREATE ROLE \"{role}\" IN ROLE sqlstreams_producer")).unwrap();
    let escaped = role.replace('\u{fc}', r"\xfc");
    c.batch_execute(&format!("SET ROLE \"{role}\"")).unwrap();
    let err = c.batch_execute("SELECT sqlstreams.produce('s', '{}')").unwrap_err();
    assert_eq!(sqlstate(&err), "42501", "{err:?}");
    let db = err.as_db_error().unwrap();
    assert!(db.message().contains(&format!("role \"{escaped}\" may not")), "{err:?}");
    // The hint's call spells the role's bytes, to be copied as it is.
    assert!(db.hint().is_some_and(|h| h.contains(&format!("E'{escaped}'"))), "{err:?}");
    c.batch_execute(&format!(
        "RESET ROLE; GRANT EXECUTE ON FUNCTION sqlstreams.drop_stream(text) TO \"{role}\"; SET ROLE \"{role}\""
    ))
    .unwrap();
    let admin = c.batch_execute("SELECT sqlstreams.drop_stream('s')").unwrap_err();
    assert_eq!(sqlstate(&admin), "42501", "{admin:?}");
    assert!(admin.as_db_error().unwrap().message().contains(&escaped), "{admin:?}");
    c.batch_execute("RESET ROLE").unwrap();
    let granted: bool = c.query_one("SELECT sqlstreams.grant_stream('s', $1, 'produce')", &[&role]).unwrap().get(0);
    assert!(granted);
    c.batch_execute(&format!("SET ROLE \"{role}\"; SELECT sqlstreams.produce('s', '{{}}'); RESET ROLE")).unwrap();
    let unknown = c.batch_execute(r"SELECT sqlstreams.grant_stream('s', E'nobody\xe9', 'produce')").unwrap_err();
    assert_eq!(sqlstate(&unknown), "42704", "{unknown:?}");
    assert!(unknown.as_db_error().unwrap().message().contains(r"nobody\xe9"), "{unknown:?}");

    // Roles are every database's: in a UTF8 one, no text can spell this name's LATIN1 bytes, so the
    // refusal names it escaped, and its hint says what to do instead of a call that cannot run.
    let oid: u32 = c.query_one("SELECT oid FROM pg_catalog.pg_roles WHERE rolname = $1", &[&role]).unwrap().get(0);
    let (mut utf8, _) = own_database_in("encoding_db", "UTF8");
    utf8.batch_execute(&format!(
        "SELECT sqlstreams.create_stream('s');
         DO $$ BEGIN EXECUTE 'SET ROLE ' || quote_ident((SELECT rolname FROM pg_catalog.pg_roles WHERE oid = {oid})); END $$"
    ))
    .unwrap();
    let err = utf8.batch_execute("SELECT sqlstreams.produce('s', '{}')").unwrap_err();
    assert_eq!(sqlstate(&err), "42501", "{err:?}");
    let db = err.as_db_error().unwrap();
    assert!(db.message().contains(&format!("role \"{escaped}\" may not")), "{err:?}");
    assert!(db.hint().is_some_and(|h| h.contains("cannot spell") && !h.contains(&escaped)), "{err:?}");
    utf8.batch_execute("RESET ROLE").unwrap();
    // Cast to text, that name is a text of this UTF8 database that is not UTF-8: refused, not
    // taken unchecked.
    let name =
        format!("SELECT sqlstreams.create_stream((SELECT rolname::text FROM pg_catalog.pg_roles WHERE oid = {oid}))");
    let err = utf8.batch_execute(&name).unwrap_err();
    assert_eq!(sqlstate(&err), "22023", "{err:?}");
    assert!(err.as_db_error().unwrap().message().contains("is not valid UTF-8"), "{err:?}");
    // A failure's error message is kept up to 1 MB, "..." included.
    utf8.batch_execute("SELECT sqlstreams.create_group('s', 'g'); SELECT sqlstreams.produce('s', '{}')").unwrap();
    let row = utf8.query_one("SELECT message_id, lease_token FROM sqlstreams.claim('s', 'g', 10)", &[]).unwrap();
    let (id, token): (i64, uuid::Uuid) = (row.get(0), row.get(1));
    let huge = "SELECT sqlstreams.fail('s', 'g', $1, $2, repeat('\u{e9}', 600000), permanent => true)";
    utf8.execute(huge, &[&token, &id]).unwrap();
    let (bytes, end): (i32, String) = utf8
        .query_one("SELECT octet_length(last_error), right(last_error, 4) FROM sqlstreams.dead_messages('s', 'g')", &[])
        .map(|r| (r.get(0), r.get(1)))
        .unwrap();
    assert_eq!((bytes, end.as_str()), ((1 << 20) - 1, "\u{e9}..."), "cut at a character, within 1 MB");
    drop(utf8);
    c.batch_execute(&format!("DROP OWNED BY \"{role}\"; DROP ROLE \"{role}\"")).unwrap();

    let (mut c, _) = own_database_in("encoding_db", "SQL_ASCII");
    let stream = "caf\u{e9}";
    c.execute("SELECT sqlstreams.create_stream($1)", &[&stream]).unwrap();
    let names: Vec<String> =
        c.query("SELECT name FROM sqlstreams.streams", &[]).unwrap().iter().map(|r| r.get(0)).collect();
    assert_eq!(names, [stream]);
    let err = c.batch_execute(r"SELECT sqlstreams.create_stream(E'\xff')").unwrap_err();
    assert_eq!(sqlstate(&err), "22023", "{err:?}");
    assert!(err.as_db_error().unwrap().message().contains(r"'\xff' is not valid UTF-8"), "{err:?}");
}

/// The internal function the queue's count triggers call refuses what no trigger passes (a
/// status no row can hold, in any encoding; arrays of different lengths; a NULL) with an error
/// that names it, never pgrx's panic with its source's path, and counts nothing. Only a superuser
/// can call it (tests/privileges.rs).
#[test]
fn the_count_triggers_function_refuses_what_no_trigger_passes() {
    let (mut c, _) = own_database_in("counts_db", "LATIN1");
    c.batch_execute("SELECT sqlstreams.create_stream('s'); SELECT sqlstreams.create_group('s', 'g')").unwrap();
    let (stream, group): (i64, i64) = c
        .query_one("SELECT stream_id, id FROM sqlstreams.consumer_groups WHERE stream = 's'", &[])
        .map(|r| (r.get(0), r.get(1)))
        .unwrap();
    let call = |statuses: &str, deltas: &str| {
        format!("SELECT sqlstreams.exception_counts_changed({stream}, ARRAY[{group}, {group}]::int8[], {statuses}, {deltas})")
    };
    for (sql, named) in [
        (call(r"ARRAY['dead', E'dead\xe9']", "ARRAY[1, 1]::int8[]"), r"unknown exception-queue status E'dead\xe9'"),
        (call("ARRAY['dead', 'gone']", "ARRAY[1, 1]::int8[]"), "unknown exception-queue status 'gone'"),
        (call("ARRAY['dead']", "ARRAY[1, 1]::int8[]"), "differ in length"),
        (call("ARRAY['dead', NULL]", "ARRAY[1, 1]::int8[]"), "hold a NULL"),
        (call("ARRAY['dead', 'ready']", "ARRAY[1, NULL]::int8[]"), "hold a NULL"),
    ] {
        let err = c.batch_execute(&sql).unwrap_err();
        let db = err.as_db_error().unwrap_or_else(|| panic!("{sql}: {err:?}"));
        assert_eq!(db.code().code(), "XX000", "{sql}: {err:?}");
        assert!(db.message().contains(named), "{sql}: {}", db.message());
        let texts = [Some(db.message()), db.detail(), db.hint(), db.where_()];
        for text in texts.into_iter().flatten() {
            assert!(!text.contains(".rs") && !text.contains("UTF-8"), "{sql}: internals: {text}");
        }
    }
    let dead: i64 = c.query_one("SELECT dead FROM sqlstreams.group_status('s', 'g')", &[]).unwrap().get(0);
    assert_eq!(dead, 0, "nothing was counted");
}
