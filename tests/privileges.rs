//! Least privilege (src/access.rs): the README's app-role setup works without a superuser,
//! everything outside a role's grants is refused with 42501, nothing a stranger creates or
//! locks reaches a stream, and no error carries Rust internals.

use postgres::Client;
use sqlstreams_tests::*;

/// The README's setup: an admin role and an app role, a stream, its grants. Returns (stream,
/// admin role, app role).
fn setup(c: &mut Client) -> (String, String, String) {
    let admin = role(c, "streams_admin", "IN ROLE sqlstreams_admin");
    let app = role(c, "billing_app", "IN ROLE sqlstreams_producer, sqlstreams_consumer");
    let stream = unique("billing.events");
    let mut a = connect_as(&admin);
    a.query_one("SELECT sqlstreams.create_stream($1, partition_size => 1000)", &[&stream]).unwrap();
    a.query_one("SELECT sqlstreams.grant_stream($1, $2, 'produce')", &[&stream, &app]).unwrap();
    a.query_one("SELECT sqlstreams.grant_stream($1, $2, 'consume', 'invoicer')", &[&stream, &app]).unwrap();
    (stream, admin, app)
}

/// Asserts a 42501; returns the error's message and hint.
fn refused(result: Result<impl std::fmt::Debug, postgres::Error>, what: &str) -> String {
    let err = result.expect_err(what);
    assert_eq!(sqlstate(&err), "42501", "{what}: {}", describe(&err));
    let hint = err.as_db_error().and_then(|e| e.hint()).unwrap_or_default();
    format!("{} | {hint}", describe(&err))
}

#[test]
fn the_readme_app_role_works_end_to_end_without_a_superuser() {
    let mut c = connect();
    let (stream, _admin, app) = setup(&mut c);
    let mut app = connect_as(&app);
    app.query_one("SELECT sqlstreams.create_group($1, 'invoicer', 'ordered')", &[&stream]).unwrap();
    // 1,500 messages cross into a partition nobody created yet: produce creates it, as the owner.
    let payloads: Vec<serde_json::Value> = (0..1500).map(|i| json!({ "invoice": i })).collect();
    let keys: Vec<String> = (0..1500).map(|i| format!("customer-{}", i % 7)).collect();
    let ids = app.query("SELECT sqlstreams.produce_batch($1, $2, $3)", &[&stream, &payloads, &keys]).unwrap();
    assert_eq!(ids.len(), 1500);
    let mut handled = 0;
    loop {
        let batch =
            app.query("SELECT message_id, lease_token FROM sqlstreams.claim($1, 'invoicer', 500)", &[&stream]).unwrap();
        if batch.is_empty() {
            break;
        }
        let token: uuid::Uuid = batch[0].get(1);
        let ids: Vec<i64> = batch.iter().map(|r| r.get(0)).collect();
        let acked: Vec<i64> = app
            .query_one("SELECT sqlstreams.ack_batch($1, 'invoicer', $2, $3)", &[&stream, &token, &ids])
            .unwrap()
            .get(0);
        assert_eq!(acked, ids);
        handled += ids.len();
    }
    assert_eq!(handled, 1500);
    let status =
        app.query_one("SELECT committed, lag FROM sqlstreams.group_status($1, 'invoicer')", &[&stream]).unwrap();
    assert_eq!(status.get::<_, i64>(1), 0);
    // The views show the app its stream and group, and nothing else.
    let streams: Vec<String> =
        app.query("SELECT name FROM sqlstreams.streams", &[]).unwrap().iter().map(|r| r.get(0)).collect();
    assert_eq!(streams, vec![stream.clone()]);
    let groups: Vec<String> =
        app.query("SELECT name FROM sqlstreams.consumer_groups", &[]).unwrap().iter().map(|r| r.get(0)).collect();
    assert_eq!(groups, vec!["invoicer".to_string()]);
}

#[test]
fn everything_outside_a_roles_grants_is_refused() {
    let mut c = connect();
    let (stream, admin, app_role) = setup(&mut c);
    let mut admin = connect_as(&admin);
    let other = unique("other.stream");
    admin.query_one("SELECT sqlstreams.create_stream($1)", &[&other]).unwrap();
    admin.query_one("SELECT sqlstreams.create_group($1, 'audit')", &[&stream]).unwrap();
    admin.query_one("SELECT sqlstreams.create_group($1, 'g')", &[&other]).unwrap();
    let mut app = connect_as(&app_role);

    let msg = refused(app.query_one("SELECT sqlstreams.produce($1, '{}')", &[&other]), "produce to another stream");
    assert!(msg.contains(&format!("may not produce to stream \"{other}\"")), "{msg}");
    assert!(msg.contains("grant_stream("), "the hint says how to get it: {msg}");
    refused(app.query("SELECT * FROM sqlstreams.claim($1, 'g')", &[&other]), "claim on another stream");
    refused(app.query("SELECT * FROM sqlstreams.claim($1, 'audit')", &[&stream]), "claim as an ungranted group");
    refused(app.query("SELECT * FROM sqlstreams.group_status($1, 'audit')", &[&stream]), "inspect an ungranted group");
    refused(app.query_one("SELECT sqlstreams.create_group($1, 'audit2')", &[&stream]), "declare an ungranted group");
    refused(
        app.query_one("SELECT sqlstreams.extend_lease($1, 'audit', gen_random_uuid())", &[&stream]),
        "extend a lease of an ungranted group",
    );
    refused(app.query_one("SELECT sqlstreams.create_stream($1)", &[&unique("mine")]), "create a stream");
    refused(app.query_one("SELECT sqlstreams.drop_stream($1)", &[&stream]), "drop a stream");
    refused(app.query_one("SELECT sqlstreams.drop_group($1, 'invoicer')", &[&stream]), "drop a group");
    refused(app.query("SELECT * FROM sqlstreams.maintain()", &[]), "run maintain");
    refused(app.query("SELECT * FROM sqlstreams.maintain_stream($1)", &[&stream]), "run maintain on one stream");
    refused(
        app.query_one("SELECT sqlstreams.grant_stream($1, $2, 'consume')", &[&stream, &app_role]),
        "grant itself more",
    );
    refused(
        app.query_one("SELECT sqlstreams.break_lease($1, 'invoicer', gen_random_uuid())", &[&stream]),
        "break a lease",
    );
    let id: i64 = c.query_one("SELECT id FROM sqlstreams.streams WHERE name = $1", &[&stream]).unwrap().get(0);
    for sql in [
        format!("INSERT INTO sqlstreams.message_log_{id} (id, payload, lane) VALUES (1, '{{}}', 0)"),
        format!("UPDATE sqlstreams.cursor_{id} SET claimed = claimed + 1"),
        format!("DELETE FROM sqlstreams.exception_queue_{id}"),
        "UPDATE sqlstreams.stream SET lanes = 1".to_string(),
        "INSERT INTO sqlstreams.stream_grant VALUES (1, '10', 'produce', NULL)".to_string(),
        format!("SELECT * FROM sqlstreams.lane_{id} FOR UPDATE"),
    ] {
        refused(app.batch_execute(&sql), &sql);
    }
    // A producer-only role cannot consume, even with a consume grant.
    let producer = role(&mut c, "producer_only", "IN ROLE sqlstreams_producer");
    admin.query_one("SELECT sqlstreams.grant_stream($1, $2, 'consume')", &[&stream, &producer]).unwrap();
    let mut producer = connect_as(&producer);
    refused(producer.query_one("SELECT sqlstreams.produce($1, '{}')", &[&stream]), "produce without a grant");
    refused(producer.query("SELECT * FROM sqlstreams.claim($1, 'invoicer')", &[&stream]), "claim without the role");
    // Revoking takes the right back.
    admin.query_one("SELECT sqlstreams.revoke_stream($1, $2, 'produce')", &[&stream, &app_role]).unwrap();
    refused(app.query_one("SELECT sqlstreams.produce($1, '{}')", &[&stream]), "produce after the revoke");
}

/// The exception counts are written from what the queue's triggers pass to an internal
/// function; no role may call it to bend `group_status`, admins included.
#[test]
fn no_role_may_forge_exception_counts() {
    let mut c = connect();
    let (stream, admin, app) = setup(&mut c);
    let id: i64 = c.query_one("SELECT id FROM sqlstreams.stream WHERE name = $1", &[&stream]).unwrap().get(0);
    for who in [&admin, &app] {
        let mut r = connect_as(who);
        refused(
            r.query_one(
                "SELECT sqlstreams.exception_counts_changed($1, ARRAY[1::int8], ARRAY['dead'], ARRAY[1000::int8])",
                &[&id],
            ),
            "forging exception counts",
        );
    }
}

#[test]
fn a_search_path_trojan_never_runs() {
    let mut c = connect();
    let mallory = role(&mut c, "mallory", "");
    let schema = format!("trojan_{}", &mallory[mallory.len() - 10..]);
    c.batch_execute(&format!("CREATE SCHEMA {schema} AUTHORIZATION {mallory}")).unwrap();
    let mut m = connect_as(&mallory);
    // Look-alikes of what the extension's SQL calls, each escalating its author if it ever ran.
    let escalate = format!("INSERT INTO {schema}.ran VALUES (current_user); ALTER ROLE {mallory} SUPERUSER;");
    m.batch_execute(&format!(
        "CREATE TABLE {schema}.ran (who text);
         GRANT INSERT ON {schema}.ran TO PUBLIC;
         CREATE FUNCTION {schema}.nextval(regclass) RETURNS bigint LANGUAGE plpgsql AS $$ BEGIN {escalate} RETURN 1; END $$;
         CREATE FUNCTION {schema}.hashtext(text) RETURNS integer LANGUAGE plpgsql AS $$ BEGIN {escalate} RETURN 1; END $$;
         CREATE FUNCTION {schema}.now() RETURNS timestamptz LANGUAGE plpgsql AS $$ BEGIN {escalate} RETURN pg_catalog.now(); END $$;
         CREATE FUNCTION {schema}.cardinality(anyarray) RETURNS integer LANGUAGE plpgsql AS $$ BEGIN {escalate} RETURN 1; END $$;
         CREATE FUNCTION {schema}.unnest(anyarray) RETURNS SETOF anyelement LANGUAGE plpgsql AS $$ BEGIN {escalate} END $$;
         CREATE FUNCTION {schema}.eq(text, text) RETURNS boolean LANGUAGE plpgsql AS $$ BEGIN {escalate} RETURN $1 OPERATOR(pg_catalog.=) $2; END $$;
         CREATE OPERATOR {schema}.= (LEFTARG = text, RIGHTARG = text, FUNCTION = {schema}.eq);
         GRANT USAGE ON SCHEMA {schema} TO PUBLIC;"
    ))
    .unwrap();
    // A superuser whose search_path puts the trojans first calls everything.
    c.batch_execute(&format!("SET search_path = {schema}, public, pg_catalog")).unwrap();
    let s = Stream::create(&mut c, "trojan");
    let g = s.group(&mut c, "g", Some("exclusive"));
    // A parallel group holds no lane: each of its claims finds what was produced since.
    s.group(&mut c, "w", Some("parallel"));
    s.produce_with(&mut c, json!({}), Some("k"), None, true).unwrap();
    s.produce_many(&mut c, 3, Some("k"));
    let batch = g.claim(&mut c, 10);
    g.fail(&mut c, &batch[0], "x", false, Some("0 seconds"));
    g.claim(&mut c, 10);
    // claim and claim_with_metadata pin the path themselves (src/search_path.rs): from a session
    // that has not looked the group up yet, so that their first statement plans anew.
    for claim in ["claim", "claim_with_metadata"] {
        let sql = format!("SELECT * FROM sqlstreams.{claim}($1, 'g', 10)");
        s.produce_many(&mut c, 2, Some(claim));
        let mut fresh = connect();
        fresh.batch_execute(&format!("SET search_path = {schema}, public, pg_catalog")).unwrap();
        let rows = fresh.query(&sql, &[&s.name]).unwrap();
        assert!(!rows.is_empty(), "{claim} hands out work under the trojans' path");
        // And from a session whose plans were made under a clean path: they are checked again
        // under the path in effect when they run.
        let warm_sql = format!("SELECT * FROM sqlstreams.{claim}($1, 'w', 1000)");
        let mut warm = connect();
        assert!(!warm.query(&warm_sql, &[&s.name]).unwrap().is_empty(), "{claim} plans its statements");
        warm.batch_execute(&format!("SET search_path = {schema}, public, pg_catalog")).unwrap();
        s.produce_many(&mut c, 2, None);
        let rows = warm.query(&warm_sql, &[&s.name]).unwrap();
        assert!(!rows.is_empty(), "{claim} runs its plans under the trojans' path");
    }
    c.query("SELECT * FROM sqlstreams.maintain()", &[]).unwrap();
    c.query("SELECT * FROM sqlstreams.group_status($1, 'g')", &[&s.name]).unwrap();
    c.query("SELECT * FROM sqlstreams.consumer_groups", &[]).unwrap();
    c.batch_execute("RESET search_path").unwrap();
    let ran: i64 = c.query_one(&format!("SELECT count(*) FROM {schema}.ran"), &[]).unwrap().get(0);
    assert_eq!(ran, 0, "a trojan ran inside the extension");
    let superuser: bool = c.query_one("SELECT rolsuper FROM pg_roles WHERE rolname = $1", &[&mallory]).unwrap().get(0);
    assert!(!superuser);
}

/// claim and claim_with_metadata apply the extension's search_path and plan_cache_mode only
/// while they run SQL (src/search_path.rs); the caller's come back, whether the claim found
/// work, found none, or failed after its first statement.
#[test]
fn a_claim_leaves_the_callers_settings_as_they_were() {
    let mut c = connect();
    let s = Stream::create(&mut c, "settings");
    s.group(&mut c, "g", Some("parallel"));
    s.produce_many(&mut c, 3, None);
    let mut fresh = connect();
    let settings = |c: &mut Client| -> (String, String) {
        let row =
            c.query_one("SELECT current_setting('search_path'), current_setting('plan_cache_mode')", &[]).unwrap();
        (row.get(0), row.get(1))
    };
    fresh.batch_execute("SET search_path = public, pg_catalog; SET plan_cache_mode = force_custom_plan").unwrap();
    let callers = settings(&mut fresh);
    assert_eq!(callers, ("public, pg_catalog".to_string(), "force_custom_plan".to_string()));
    for claim in ["claim", "claim_with_metadata"] {
        // In one transaction: a claim that hands out work, then one that finds none.
        fresh.batch_execute("BEGIN").unwrap();
        let sql = format!("SELECT count(*) FROM sqlstreams.{claim}($1, 'g', 10)");
        let handed: i64 = fresh.query_one(&sql, &[&s.name]).unwrap().get(0);
        assert!(handed > 0, "{claim} finds the work produced for it");
        assert_eq!(settings(&mut fresh), callers, "after {claim} handed out work");
        // (It runs statements still: this transaction changed the stream.)
        fresh.query_one(&sql, &[&s.name]).unwrap();
        assert_eq!(settings(&mut fresh), callers, "after a {claim} that found nothing");
        // A claim that fails after its first statement (the group lookup), in a savepoint.
        fresh.batch_execute("SAVEPOINT before").unwrap();
        let err = fresh.query(&format!("SELECT * FROM sqlstreams.{claim}($1, 'nobody')"), &[&s.name]).unwrap_err();
        assert_eq!(sqlstate(&err), "42704", "{}", describe(&err));
        fresh.batch_execute("ROLLBACK TO SAVEPOINT before").unwrap();
        assert_eq!(settings(&mut fresh), callers, "after {claim} failed");
        fresh.batch_execute("COMMIT").unwrap();
        assert_eq!(settings(&mut fresh), callers, "after the commit");
        s.produce_many(&mut c, 1, None);
    }
    // Caught inside PL/pgSQL, and a claim run from a function with settings of its own, which
    // are its again after the claim.
    fresh
        .batch_execute(&format!(
            "DO $$ BEGIN PERFORM sqlstreams.claim('{0}', 'nobody'); EXCEPTION WHEN undefined_object THEN NULL; END $$;
             CREATE FUNCTION pg_temp.claim_from_function(OUT handed bigint, OUT path text, OUT plans text)
                 LANGUAGE plpgsql SET search_path = pg_temp, public SET plan_cache_mode = auto AS $f$
                 BEGIN
                     handed := (SELECT count(*) FROM sqlstreams.claim('{0}', 'g', 10));
                     path := current_setting('search_path');
                     plans := current_setting('plan_cache_mode');
                 END $f$;",
            s.name
        ))
        .unwrap();
    assert_eq!(settings(&mut fresh), callers, "after a claim caught in PL/pgSQL");
    let row = fresh.query_one("SELECT * FROM pg_temp.claim_from_function()", &[]).unwrap();
    assert_eq!(row.get::<_, i64>(0), 1, "the function's claim hands out the last message");
    assert_eq!((row.get::<_, String>(1), row.get::<_, String>(2)), ("pg_temp, public".into(), "auto".into()));
    assert_eq!(settings(&mut fresh), callers, "after a function's claim");
    // A claim that fails with a Postgres error after its first statement: its fence read waits
    // for the cursor's lock past lock_timeout (55P03). The abort of the savepoint, or of the
    // statement's transaction, restores the settings.
    let mut locker = connect();
    locker.batch_execute(&format!("BEGIN; LOCK TABLE sqlstreams.cursor_{} IN ACCESS EXCLUSIVE MODE", s.id)).unwrap();
    fresh.batch_execute("SET lock_timeout = '200ms'").unwrap();
    let callers = settings(&mut fresh);
    for block in [true, false] {
        if block {
            fresh.batch_execute("BEGIN; SAVEPOINT before").unwrap();
        }
        let err = fresh.query("SELECT * FROM sqlstreams.claim($1, 'g', 10)", &[&s.name]).unwrap_err();
        assert_eq!(sqlstate(&err), "55P03", "{}", describe(&err));
        if block {
            fresh.batch_execute("ROLLBACK TO SAVEPOINT before").unwrap();
            assert_eq!(settings(&mut fresh), callers, "after a lock timeout in a savepoint");
            fresh.batch_execute("COMMIT").unwrap();
        }
        assert_eq!(settings(&mut fresh), callers, "after a lock timeout");
    }
    locker.batch_execute("ROLLBACK").unwrap();
}

#[test]
fn a_role_without_grants_cannot_hold_a_stream_back() {
    let mut c = connect();
    let stranger = role(&mut c, "stranger", "");
    let s = Stream::create(&mut c, "stranger");
    let g = s.group(&mut c, "g", Some("exclusive"));
    let mut x = connect_as(&stranger);
    // Every advisory lock SQL can take on the numbers a stream or key could hash to, an xid held
    // open, and every row of the extension it could try to lock.
    x.batch_execute("BEGIN").unwrap();
    for (a, b) in [(0i64, s.id), (s.id, 0), (0x5350, s.id), (0x534C, s.id), (0x5354, s.id)] {
        x.query("SELECT pg_advisory_xact_lock($1::int8), pg_advisory_xact_lock_shared($2::int8)", &[&a, &b]).unwrap();
        x.query("SELECT pg_advisory_xact_lock($1::int4, $2::int4)", &[&(a as i32), &(b as i32)]).unwrap();
    }
    x.query("SELECT txid_current()", &[]).unwrap();
    x.batch_execute("SAVEPOINT s").unwrap();
    refused(x.query("SELECT * FROM sqlstreams.stream FOR UPDATE", &[]), "lock the catalog");
    x.batch_execute("ROLLBACK TO s").unwrap();
    // Meanwhile the stream works: an outbox producer, a claim, a wake-up of a parked key.
    let mut tx = c.transaction().unwrap();
    let first = s.produce(&mut tx, json!({}), Some("k"));
    tx.commit().unwrap();
    let second = s.produce(&mut c, json!({}), Some("k"));
    let batch = g.claim(&mut c, 10);
    assert_eq!(ids(&batch), vec![first, second], "the stranger's open transaction holds nothing back");
    assert!(g.ack(&mut c, &batch[0]) && g.ack(&mut c, &batch[1]));
    x.batch_execute("COMMIT").unwrap();
}

#[test]
fn no_error_carries_rust_internals() {
    // The rig runs the server with RUST_BACKTRACE=full.
    let mut c = connect();
    let mut other = connect();
    let s = Stream::create(&mut c, "internals");
    let g = s.group(&mut c, "g", None);
    s.produce(&mut c, json!({}), None);
    let d = g.claim(&mut c, 1).pop().unwrap();
    // An outcome holds the token's lock; a second one gives up waiting inside the extension.
    let mut tx = c.transaction().unwrap();
    tx.query_one("SELECT sqlstreams.extend_lease($1, $2, $3)", &[&s.name, &g.name, &d.lease_token]).unwrap();
    other.batch_execute("SET lock_timeout = '100ms'").unwrap();
    let err = other
        .query_one("SELECT sqlstreams.ack($1, $2, $3, $4)", &[&s.name, &g.name, &d.lease_token, &d.message_id])
        .unwrap_err();
    tx.rollback().unwrap();
    let db = err.as_db_error().expect("a server error");
    assert_eq!(db.code().code(), "55P03");
    let texts = [Some(db.message()), db.detail(), db.hint(), db.where_()];
    for text in texts.into_iter().flatten() {
        assert!(!text.contains("backtrace") && !text.contains(".rs:") && !text.contains("/root/"), "internals: {text}");
    }
    // And errors of the extension's own: message and hint, quoted names, nothing else.
    let err = c.query_one("SELECT sqlstreams.produce($1, '{}')", &[&"it's \"odd\""]).unwrap_err();
    let db = err.as_db_error().unwrap();
    assert_eq!(db.message(), "sqlstreams: stream \"it's \"\"odd\"\"\" does not exist");
    assert!(db.hint().unwrap().contains("create_stream('it''s \"odd\"')"), "{:?}", db.hint());
    assert_eq!(db.detail(), None);
    // Its location names the library's file, as Postgres's name a C file, and no directory.
    assert_eq!(db.routine(), Some("sqlstreams"));
    assert!(db.file().is_some_and(|file| file.ends_with(".rs") && !file.contains('/')), "{:?}", db.file());
}

#[test]
fn leases_have_a_maximum_and_an_admin_can_break_one() {
    let mut c = connect();
    let s = Stream::create(&mut c, "lease-limits");
    let g = s.group(&mut c, "g", Some("ordered"));
    let err = c.query("SELECT * FROM sqlstreams.claim($1, 'g', 10, '1000 years')", &[&s.name]).unwrap_err();
    assert_eq!(sqlstate(&err), "22023", "{}", describe(&err));
    assert!(describe(&err).contains("sqlstreams.max_lease"));
    s.produce(&mut c, json!({}), Some("k"));
    let held = c.query("SELECT lease_token FROM sqlstreams.claim($1, 'g', 10, '1 day')", &[&s.name]).unwrap();
    let token: uuid::Uuid = held[0].get(0);
    let err = c.query_one("SELECT sqlstreams.extend_lease($1, 'g', $2, '2 days')", &[&s.name, &token]).unwrap_err();
    assert_eq!(sqlstate(&err), "22023");
    c.batch_execute("SET sqlstreams.max_lease = '3d'").unwrap();
    assert!(c
        .query_one("SELECT sqlstreams.extend_lease($1, 'g', $2, '2 days')", &[&s.name, &token])
        .unwrap()
        .get::<_, bool>(0));
    c.batch_execute("RESET sqlstreams.max_lease").unwrap();
    // A consumer that will never come back holds its key for two days: an admin breaks it.
    let admin = role(&mut c, "lease_admin", "IN ROLE sqlstreams_admin");
    let mut admin = connect_as(&admin);
    assert!(g.claim(&mut c, 10).is_empty());
    let broke: bool = admin.query_one("SELECT sqlstreams.break_lease($1, 'g', $2)", &[&s.name, &token]).unwrap().get(0);
    assert!(broke);
    let taken = g.claim(&mut c, 10);
    assert_eq!((taken.len(), taken[0].attempt), (1, 1), "the next claim takes the work over");
    assert!(!admin
        .query_one("SELECT sqlstreams.break_lease($1, 'g', $2)", &[&s.name, &token])
        .unwrap()
        .get::<_, bool>(0));
}

#[test]
fn a_prepared_transaction_produces_with_notify_off() {
    let mut c = connect();
    let s = Stream::create(&mut c, "two-phase");
    let g = s.group(&mut c, "g", None);
    let gid = unique("gid");
    c.batch_execute("BEGIN").unwrap();
    s.produce(&mut c, json!({"n": 1}), None);
    let err = c.batch_execute(&format!("PREPARE TRANSACTION '{gid}'")).unwrap_err();
    assert_eq!(sqlstate(&err), "25000", "{}", describe(&err));
    let hint = err.as_db_error().and_then(|e| e.hint()).unwrap_or_default().to_string();
    assert!(hint.contains("SET LOCAL sqlstreams.notify = off"), "{hint}");
    c.batch_execute("ROLLBACK").unwrap();

    c.batch_execute("BEGIN; SET LOCAL sqlstreams.notify = off").unwrap();
    let id = s.produce(&mut c, json!({"n": 2}), None);
    c.batch_execute(&format!("PREPARE TRANSACTION '{gid}'")).unwrap();
    assert!(g.claim(&mut c, 10).is_empty(), "a prepared producer holds the fence like any running one");
    c.batch_execute(&format!("COMMIT PREPARED '{gid}'")).unwrap();
    assert_eq!(ids(&g.claim(&mut c, 10)), vec![id]);
}

#[test]
fn a_producer_sees_its_stream_and_no_group() {
    let mut c = connect();
    let (stream, admin, _app) = setup(&mut c);
    let producer = role(&mut c, "orders_app", "IN ROLE sqlstreams_producer");
    let mut a = connect_as(&admin);
    a.query_one("SELECT sqlstreams.grant_stream($1, $2, 'produce')", &[&stream, &producer]).unwrap();
    a.query_one("SELECT sqlstreams.create_group($1, 'invoicer')", &[&stream]).unwrap();
    a.query_one("SELECT sqlstreams.create_group($1, 'auditor')", &[&stream]).unwrap();
    let mut p = connect_as(&producer);
    p.query_one("SELECT sqlstreams.produce($1, '{}')", &[&stream]).unwrap();
    let streams: Vec<String> =
        p.query("SELECT name FROM sqlstreams.streams", &[]).unwrap().iter().map(|r| r.get(0)).collect();
    assert_eq!(streams, vec![stream.clone()]);
    // The view asks group_status of each group it shows: a producer is shown none, not refused.
    let groups = p.query("SELECT name, lag FROM sqlstreams.consumer_groups", &[]).unwrap();
    assert!(groups.is_empty(), "a producer sees no group");
    let groups = p.query("SELECT name FROM sqlstreams.consumer_groups WHERE stream = $1", &[&stream]).unwrap();
    assert!(groups.is_empty(), "a producer sees no group");
    // Asked directly, group_status refuses it.
    refused(p.query("SELECT * FROM sqlstreams.group_status($1, 'invoicer')", &[&stream]), "a producer's group_status");
    // It may see how far the stream goes, but not read back what others produced to it.
    let head: i64 = p
        .query_one("SELECT sqlstreams.stream_head(id) FROM sqlstreams.streams WHERE name = $1", &[&stream])
        .unwrap()
        .get(0);
    assert!(head >= 1);
    let peek = refused(p.query("SELECT * FROM sqlstreams.peek($1)", &[&stream]), "a producer's peek");
    assert!(peek.contains("may not read stream") && peek.contains("'consume'"), "{peek}");
    // A consume grant on any one group of the stream reads its messages.
    a.query_one("SELECT sqlstreams.grant_stream($1, $2, 'consume', 'auditor')", &[&stream, &producer]).unwrap();
    assert_eq!(p.query("SELECT * FROM sqlstreams.peek($1)", &[&stream]).unwrap().len(), 1);
}
