//! What a backend remembers between calls, and that it follows every change: the groups and
//! streams it looked up and the rights it checked (src/catalog.rs), and the lanes it found empty
//! (src/lanes/empty.rs). Each test keeps one consumer or producer connection open across another
//! session's changes, so its second call runs on what its first one remembered.

use postgres::Client;
use sqlstreams_tests::*;

fn pause(c: &mut Client, g: &Group, on: bool) {
    let function = if on { "pause_group" } else { "resume_group" };
    c.execute(&format!("SELECT sqlstreams.{function}($1, $2)"), &[&g.stream.name, &g.name]).unwrap();
}

#[test]
fn a_consumer_sees_another_sessions_changes_of_its_group_at_its_next_call() {
    let mut admin = connect();
    let mut consumer = connect();
    let s = Stream::create(&mut admin, "remember-settings");
    let g = s.group(&mut admin, "g", None);
    s.produce_many(&mut admin, 3, None);
    assert_eq!(g.claim(&mut consumer, 1).len(), 1, "the consumer looked its group up");

    pause(&mut admin, &g, true);
    assert!(g.claim(&mut consumer, 10).is_empty(), "a pause another session committed holds the next claim");
    pause(&mut admin, &g, false);
    let d = g.claim(&mut consumer, 1);
    assert_eq!(d.len(), 1, "and a resume frees it");

    // max_retries 0: the first failure is the last.
    admin.execute("SELECT sqlstreams.alter_group($1, 'g', max_retries => 0)", &[&s.name]).unwrap();
    assert_eq!(g.fail(&mut consumer, &d[0], "boom", false, None).as_deref(), Some("dead"));

    // The same, under session_replication_role = replica, by hand: the catalog's trigger fires
    // always.
    admin
        .batch_execute(&format!(
            "SET session_replication_role = replica;
             UPDATE sqlstreams.consumer_group SET paused = true WHERE id = {};
             RESET session_replication_role;",
            g.id
        ))
        .unwrap();
    assert!(g.claim(&mut consumer, 10).is_empty(), "a pause written by hand as a replica holds the next claim");
}

#[test]
fn a_change_in_the_consumers_own_transaction_counts_and_is_forgotten_with_its_rollback() {
    let mut c = connect();
    let s = Stream::create(&mut c, "remember-own");
    let g = s.group(&mut c, "g", None);
    s.produce_many(&mut c, 2, None);
    assert_eq!(g.claim(&mut c, 1).len(), 1);

    c.batch_execute("BEGIN").unwrap();
    pause(&mut c, &g, true);
    assert!(g.claim(&mut c, 10).is_empty(), "its own pause holds its own claim");
    c.batch_execute("ROLLBACK").unwrap();
    assert_eq!(g.claim(&mut c, 10).len(), 1, "the pause went with the rollback");

    s.produce_many(&mut c, 1, None);
    c.batch_execute("BEGIN; SAVEPOINT a").unwrap();
    pause(&mut c, &g, true);
    c.batch_execute("ROLLBACK TO a").unwrap();
    assert_eq!(g.claim(&mut c, 10).len(), 1, "a pause rolled back to a savepoint holds nothing");
    c.batch_execute("COMMIT").unwrap();
}

#[test]
fn a_group_or_stream_made_again_under_its_name_is_the_new_one() {
    let mut admin = connect();
    let mut consumer = connect();
    let s = Stream::create(&mut admin, "remember-again");
    let g = s.group(&mut admin, "g", None);
    s.produce_many(&mut admin, 2, None);
    let first = g.claim(&mut consumer, 1);
    assert_eq!(ids(&first), vec![1]);

    admin.execute("SELECT sqlstreams.drop_group($1, 'g')", &[&s.name]).unwrap();
    let again = s.group(&mut admin, "g", None);
    assert_ne!(again.id, g.id);
    assert_eq!(ids(&again.claim(&mut consumer, 10)), vec![1, 2], "the new group starts at the beginning");

    admin.execute("SELECT sqlstreams.drop_stream($1)", &[&s.name]).unwrap();
    let renewed = Stream::named(&mut admin, &s.name);
    assert_ne!(renewed.id, s.id);
    let group = renewed.group(&mut admin, "g", None);
    let produced = renewed.produce_many(&mut admin, 1, Some("k"));
    let claimed = group.claim(&mut consumer, 10);
    assert_eq!(ids(&claimed), produced, "the consumer claims from the new stream");
}

#[test]
fn a_producer_writes_to_the_stream_its_name_names_now() {
    let mut admin = connect();
    let mut producer = connect();
    let s = Stream::create(&mut admin, "remember-producer");
    let g = s.group(&mut admin, "g", None);
    let first = s.produce(&mut producer, json!({}), None);
    assert_eq!(ids(&g.claim(&mut admin, 10)), vec![first], "the producer looked its stream up");

    admin.execute("SELECT sqlstreams.drop_stream($1)", &[&s.name]).unwrap();
    let refused = producer.query("SELECT sqlstreams.produce($1, '{}'::jsonb)", &[&s.name]).unwrap_err();
    assert_eq!(sqlstate(&refused), "42704", "a stream another session dropped: {}", describe(&refused));
    let renewed = Stream::named(&mut admin, &s.name);
    let group = renewed.group(&mut admin, "g", None);
    let produced = renewed.produce_many(&mut producer, 2, None);
    assert_eq!(ids(&group.claim(&mut admin, 10)), produced, "made again under its name, the new one");
}

#[test]
fn a_producer_writes_into_partitions_another_session_added() {
    let mut admin = connect();
    let (mut a, mut b) = (connect(), connect());
    let s = Stream::create_sized(&mut admin, "remember-partitions", 1000);
    let g = s.group(&mut admin, "g", None);
    // `a` looks the stream up while it has its first partitions; `b` adds partitions past them;
    // `a` writes there next, in a transaction of its own and in one that also added some.
    let mut produced = s.produce_many(&mut a, 300, None);
    produced.extend(s.produce_many(&mut b, 4500, None));
    produced.extend(s.produce_many(&mut a, 2500, None));
    a.batch_execute("BEGIN").unwrap();
    produced.extend(s.produce_many(&mut a, 3000, None));
    produced.extend(s.produce_many(&mut a, 1, None));
    a.batch_execute("COMMIT").unwrap();
    let mut claimed = g.drain(&mut admin);
    // Lanes hand out blocks of ids, not one order over all of them.
    claimed.sort_unstable();
    assert_eq!(claimed, produced, "every message, once");
}

#[test]
fn a_producer_forgets_partitions_its_rolled_back_work_added() {
    let mut admin = connect();
    let mut a = connect();
    let s = Stream::create_sized(&mut admin, "remember-rollback", 1000);
    let g = s.group(&mut admin, "g", None);
    // Ids past the first partition add partitions in `a`'s transaction; its next produce looks
    // the stream up with them; the rollback takes them away, and what `a` remembered with them.
    for undo in ["ROLLBACK", "ROLLBACK TO a"] {
        a.batch_execute("BEGIN; SAVEPOINT a").unwrap();
        s.produce_many(&mut a, 1500, None);
        s.produce_many(&mut a, 1, None);
        a.batch_execute(undo).unwrap();
        if undo != "ROLLBACK" {
            a.batch_execute("COMMIT").unwrap();
        }
    }
    // The ids rolled back are gone; the next ones are past them, in partitions made again.
    let produced = s.produce_many(&mut a, 2, None);
    assert!(produced[0] > 3000, "{produced:?}");
    assert_eq!(ids(&g.claim(&mut admin, 10)), produced);
}

#[test]
fn a_revoked_grant_or_membership_refuses_the_next_call() {
    let mut admin = connect();
    let s = Stream::create(&mut admin, "remember-grant");
    let g = s.group(&mut admin, "g", None);
    s.produce_many(&mut admin, 4, None);
    let team = role(&mut admin, "remember_team", "");
    let worker = role(&mut admin, "remember_worker", &format!("IN ROLE sqlstreams_consumer, {team}"));
    admin.execute("SELECT sqlstreams.grant_stream($1, $2, 'consume', 'g')", &[&s.name, &team]).unwrap();
    let mut consumer = connect_as(&worker);
    assert_eq!(g.claim(&mut consumer, 1).len(), 1, "the team's grant lets its member claim");

    admin.batch_execute(&format!("REVOKE {team} FROM {worker}")).unwrap();
    let refused = g.try_claim(&mut consumer, 1, "30 seconds").unwrap_err();
    assert_eq!(sqlstate(&refused), "42501", "{}", describe(&refused));

    admin.batch_execute(&format!("GRANT {team} TO {worker}")).unwrap();
    assert_eq!(g.claim(&mut consumer, 1).len(), 1, "membership again, the grant again");

    admin.execute("SELECT sqlstreams.revoke_stream($1, $2, 'consume', 'g')", &[&s.name, &team]).unwrap();
    let refused = g.try_claim(&mut consumer, 1, "30 seconds").unwrap_err();
    assert_eq!(sqlstate(&refused), "42501", "{}", describe(&refused));
}

/// Keys of a 16-lane stream, one in each of `n` different lanes.
fn keys_in_lanes(c: &mut Client, s: &Stream, n: usize) -> Vec<String> {
    let mut lanes = std::collections::HashSet::new();
    let mut keys = vec![];
    for i in 0.. {
        let key = format!("key-{i}");
        if lanes.insert(s.lane(c, &key)) {
            keys.push(key);
        }
        if keys.len() == n {
            return keys;
        }
    }
    unreachable!()
}

#[test]
fn lanes_found_empty_still_hand_out_what_comes_later_and_again_after_a_seek() {
    let mut admin = connect();
    let mut consumer = connect();
    let s = Stream::create(&mut admin, "remember-empty");
    let g = s.group(&mut admin, "g", Some("ordered"));
    let keys = keys_in_lanes(&mut admin, &s, 16);
    let mut produced = s.produce_many(&mut admin, 5, Some(&keys[0]));
    let first = g.claim(&mut consumer, 10);
    g.ack_batch(&mut consumer, &first);
    // Fifteen lanes sit at 0, below the head, with nothing after them: idle claims find so.
    for _ in 0..3 {
        assert!(g.claim(&mut consumer, 10).is_empty());
    }
    for key in &keys {
        produced.push(s.produce(&mut admin, json!({}), Some(key)));
    }
    let mut claimed = g.drain(&mut consumer);
    claimed.sort();
    assert_eq!(claimed, produced[5..].to_vec(), "every lane found empty hands out its new message");

    admin.execute("SELECT sqlstreams.seek($1, 'g', to_id => 0)", &[&s.name]).unwrap();
    let mut again = g.drain(&mut consumer);
    again.sort();
    assert_eq!(again, produced, "after a seek every message comes again");
}

#[test]
fn a_stream_whose_id_comes_again_after_the_extension_is_made_again_is_read_afresh() {
    // A database of its own: the extension is dropped and created again there, so a new
    // stream gets the id of the old one.
    let (mut admin, url) = own_database("remember");
    let mut consumer = Client::connect(&url, postgres::NoTls).unwrap();
    let s = Stream::named(&mut admin, "ledger");
    let g = s.group(&mut admin, "g", Some("ordered"));
    let keys = keys_in_lanes(&mut admin, &s, 16);
    s.produce_many(&mut admin, 50, Some(&keys[0]));
    let first = g.claim(&mut consumer, 100);
    assert_eq!(first.len(), 50);
    g.ack_batch(&mut consumer, &first);
    assert!(g.claim(&mut consumer, 100).is_empty(), "the consumer found fifteen lanes empty up to 50");

    // The drop guard refuses this while the stream exists: a superuser who turns it off drops
    // the catalog under the stream, which is what this test is about.
    admin
        .batch_execute(
            "ALTER EVENT TRIGGER sqlstreams_refuse_drop DISABLE; DROP SCHEMA sqlstreams CASCADE; CREATE EXTENSION sqlstreams",
        )
        .unwrap();
    let renewed = Stream::named(&mut admin, "ledger");
    assert_eq!(renewed.id, s.id, "the id comes again");
    let group = renewed.group(&mut admin, "g", Some("ordered"));
    let produced: Vec<i64> = keys[1..].iter().map(|k| renewed.produce(&mut admin, json!({}), Some(k))).collect();
    let claimed = group.claim(&mut consumer, 100);
    let mut got = ids(&claimed);
    got.sort();
    assert_eq!(got, produced, "lanes the old stream had empty up to 50 hand out the new one's messages");
}

#[test]
fn a_group_inspected_as_a_monitor_is_not_one_the_monitor_may_claim_from() {
    let mut admin = connect();
    let s = Stream::create(&mut admin, "remember-monitor");
    s.group(&mut admin, "g", None);
    s.produce_many(&mut admin, 1, None);
    let watcher = role(&mut admin, "remember_watcher", "IN ROLE sqlstreams_consumer, pg_monitor");
    let mut c = connect_as(&watcher);
    // Inspection and claim in one statement, many times over: other tests' role changes
    // (which make every backend forget what it checked) cannot fall between them every time.
    for _ in 0..20 {
        let refused = c
            .query(
                "SELECT (SELECT count(*) FROM sqlstreams.group_status($1, 'g')),
                        (SELECT count(*) FROM sqlstreams.claim($1, 'g', 1))",
                &[&s.name],
            )
            .unwrap_err();
        assert_eq!(sqlstate(&refused), "42501", "{}", describe(&refused));
    }
}

#[test]
fn a_role_that_stops_inheriting_its_grant_is_refused_at_its_next_call() {
    let mut admin = connect();
    let s = Stream::create(&mut admin, "remember-inherit");
    let g = s.group(&mut admin, "g", None);
    s.produce_many(&mut admin, 2, None);
    let team = role(&mut admin, "remember_team", "");
    let worker = role(&mut admin, "remember_worker", &format!("IN ROLE {team}"));
    // Its own right to call claim, so only the stream grant's inheritance changes. (Not ON ALL
    // FUNCTIONS IN SCHEMA: another test's drop_stream may drop a stream's trigger function
    // meanwhile, and the GRANT fails with "tuple concurrently deleted".)
    admin
        .batch_execute(&format!(
            "GRANT USAGE ON SCHEMA sqlstreams TO {worker}; GRANT EXECUTE ON FUNCTION sqlstreams.claim TO {worker}"
        ))
        .unwrap();
    admin.execute("SELECT sqlstreams.grant_stream($1, $2, 'consume', 'g')", &[&s.name, &team]).unwrap();
    let mut c = connect_as(&worker);
    assert_eq!(g.claim(&mut c, 1).len(), 1, "the team's grant is inherited");
    // From PostgreSQL 16 on, each membership says whether it is inherited, and a role's
    // NOINHERIT only sets the default for memberships granted later.
    let stop_inheriting = if server_version(&mut admin) >= 160000 {
        format!("GRANT {team} TO {worker} WITH INHERIT FALSE")
    } else {
        format!("ALTER ROLE {worker} NOINHERIT")
    };
    admin.batch_execute(&stop_inheriting).unwrap();
    let refused = g.try_claim(&mut c, 1, "30 seconds").unwrap_err();
    assert_eq!(sqlstate(&refused), "42501", "{}", describe(&refused));
}

#[test]
fn what_a_repeatable_read_outcome_read_is_not_remembered_for_later_calls() {
    let mut admin = connect();
    let mut c = connect();
    let s = Stream::create(&mut admin, "remember-snapshot");
    let g = s.group_with(&mut admin, "g", None, 1000);
    s.produce_many(&mut admin, 2, None);
    let ds = g.claim(&mut c, 2);
    c.batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT 1").unwrap();
    admin.execute("SELECT sqlstreams.alter_group($1, 'g', max_retries => 0)", &[&s.name]).unwrap();
    assert_eq!(g.fail(&mut c, &ds[0], "boom", false, None).as_deref(), Some("ready"), "its snapshot's settings");
    c.batch_execute("COMMIT").unwrap();
    assert_eq!(g.fail(&mut c, &ds[1], "boom", false, None).as_deref(), Some("dead"), "the settings committed since");
}

/// Index scans of the stream's first log partition in this transaction so far.
fn log_scans(c: &mut Client, s: &Stream) -> i64 {
    c.query_one(
        "SELECT coalesce(idx_scan, 0) FROM pg_stat_xact_user_tables WHERE relid = $1::text::regclass",
        &[&format!("{}_p0", s.table("message_log"))],
    )
    .unwrap()
    .get(0)
}

#[test]
fn an_idle_claim_does_not_probe_lanes_it_found_empty_before() {
    let mut admin = connect();
    let mut c = connect();
    let s = Stream::create(&mut admin, "remember-probe");
    let g = s.group(&mut admin, "g", Some("ordered"));
    s.produce_many(&mut admin, 5, Some("one-key"));
    let first = g.claim(&mut c, 10);
    g.ack_batch(&mut c, &first);
    assert!(g.claim(&mut c, 10).is_empty(), "this idle claim probes the fifteen empty lanes");

    c.batch_execute("BEGIN").unwrap();
    let before = log_scans(&mut c, &s);
    assert!(g.claim(&mut c, 10).is_empty());
    assert_eq!(log_scans(&mut c, &s), before, "the next one reads nothing of the log");
    c.batch_execute("COMMIT").unwrap();

    let next = s.produce(&mut admin, json!({}), Some("another-key"));
    assert_eq!(ids(&g.claim(&mut c, 10)), vec![next], "a message past what was probed is found");
}

#[test]
fn a_lane_found_empty_in_a_transaction_that_rolls_back_is_probed_again() {
    let mut admin = connect();
    let mut c = connect();
    let s = Stream::create_sized(&mut admin, "remember-rollback", 1000);
    let g = s.group(&mut admin, "g", None);
    // Partition 0 exactly: the safe head ends up at its last id, so the key's lane at 0 is not
    // behind the head's partition, and what is known of it is used.
    let produced = s.produce_many(&mut admin, 1000, Some("a-key"));
    assert_eq!(g.drain(&mut c).len(), 1000);

    // In one transaction: retention drops partition 0, a seek goes back, and a claim finds the
    // key's lane empty. Then all of it rolls back.
    c.batch_execute("BEGIN").unwrap();
    c.query("SELECT * FROM sqlstreams.maintain()", &[]).unwrap();
    let p0: Option<String> =
        c.query_one("SELECT to_regclass($1)::text", &[&format!("{}_p0", s.table("message_log"))]).unwrap().get(0);
    assert!(p0.is_none(), "retention dropped partition 0 in this transaction");
    c.execute("SELECT sqlstreams.seek($1, 'g', to_id => 0)", &[&s.name]).unwrap();
    assert!(g.claim(&mut c, 100).is_empty(), "nothing is left in this transaction");
    c.batch_execute("ROLLBACK").unwrap();

    admin.execute("SELECT sqlstreams.seek($1, 'g', to_id => 0)", &[&s.name]).unwrap();
    let mut again = g.drain(&mut c);
    again.sort();
    assert_eq!(again, produced, "partition 0 came back with the rollback, and its messages with it");
}
