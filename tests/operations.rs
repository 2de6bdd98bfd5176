//! Operating a stream for years: retention, dead letters (redrive, skip, purge), hold on dead,
//! seek, pause, explicit settings, and what an operator can see.

use postgres::Client;
use serde_json::Value;
use sqlstreams_tests::*;

/// maintain()'s (partitions dropped, exception rows purged) for one stream.
fn maintain(c: &mut Client, s: &Stream) -> (i64, i64) {
    let row = c
        .query_one(
            "SELECT partitions_dropped, exception_rows_purged FROM sqlstreams.maintain() WHERE stream = $1",
            &[&s.name],
        )
        .unwrap();
    (row.get(0), row.get(1))
}

/// Drains group `g`, failing the messages of `dead` for good and acking every other one.
fn drain_failing(c: &mut Client, g: &Group, dead: &[i64]) {
    loop {
        let batch = g.claim(c, 100);
        if batch.is_empty() {
            break;
        }
        for d in &batch {
            if dead.contains(&d.message_id) {
                g.fail(c, d, "poison", true, None);
            } else {
                assert!(g.ack(c, d));
            }
        }
    }
}

#[test]
fn a_redriven_compacted_dead_letter_is_still_superseded_after_its_partition_goes() {
    let mut c = connect();
    let s = Stream::create_sized(&mut c, "compacted-dead", 1000);
    let g = s.group(&mut c, "g", None);
    let old = s.produce_with(&mut c, json!({"v": 1}), Some("k"), None, true).unwrap().unwrap();
    let first = g.claim(&mut c, 10);
    assert_eq!(ids(&first), vec![old]);
    g.fail(&mut c, &first[0], "poison", true, None);
    let newer = s.produce_with(&mut c, json!({"v": 2}), Some("k"), None, true).unwrap().unwrap();
    s.produce_many(&mut c, 2500, None);
    let acked = g.drain(&mut c);
    assert!(acked.contains(&newer));
    // Retention drops the old message's partition (whoever runs the step: another test's
    // maintain() may) and archives the dead letter; the key's head stays.
    let first_partition = format!("{}_p0", s.table("message_log").trim_start_matches("sqlstreams."));
    for _ in 0..100 {
        c.query("SELECT * FROM sqlstreams.maintain_stream($1)", &[&s.name]).unwrap();
        if !s.partitions(&mut c).contains(&first_partition) {
            break;
        }
    }
    assert!(!s.partitions(&mut c).contains(&first_partition), "{:?}", s.partitions(&mut c));
    // Redriven, the stale value must not run after the newer one: it is superseded.
    c.query_one("SELECT sqlstreams.redrive($1, 'g', ARRAY[$2::int8])", &[&s.name, &old]).unwrap();
    assert!(g.claim(&mut c, 10).is_empty(), "the stale compacted message ran again");
    assert_eq!(g.statuses(&mut c), vec![(old, "superseded".to_string())]);
}

#[test]
fn compaction_heads_stay_while_the_messages_they_supersede_are_kept() {
    let mut c = connect();
    let s = Stream::create_sized(&mut c, "compacted-replay", 1000);
    let g = s.group(&mut c, "g", None);
    let _old = s.produce_with(&mut c, json!({"v": 1}), Some("K"), None, true).unwrap().unwrap();
    let newer = s.produce_with(&mut c, json!({"v": 2}), Some("K"), None, true).unwrap().unwrap();
    assert_eq!(g.drain(&mut c), vec![newer]);
    // Every group is past both, but their partition is kept (it holds the head of the log).
    c.query("SELECT * FROM sqlstreams.maintain_stream($1)", &[&s.name]).unwrap();
    // A replay, and a group that starts at the beginning, meet the old value again: superseded.
    c.query_one("SELECT sqlstreams.seek($1, 'g', to_id => 0)", &[&s.name]).unwrap();
    assert_eq!(ids(&g.claim(&mut c, 100)), vec![newer]);
    let late: i64 =
        c.query_one("SELECT sqlstreams.create_group($1, 'late', start_at => 'beginning')", &[&s.name]).unwrap().get(0);
    let late = Group { stream: s.clone(), name: "late".into(), id: late };
    assert_eq!(ids(&late.claim(&mut c, 100)), vec![newer]);
}

#[test]
fn a_dead_letter_stays_listed_when_its_partition_goes_during_a_snapshot() {
    let mut c = connect();
    let s = Stream::create_sized(&mut c, "dead-snapshot", 1000);
    let g = s.group(&mut c, "g", None);
    s.produce_many(&mut c, 1500, None);
    loop {
        let batch = g.claim(&mut c, 100);
        if batch.is_empty() {
            break;
        }
        for d in &batch {
            if d.message_id == 7 {
                g.fail(&mut c, d, "poison", true, None);
            } else {
                assert!(g.ack(&mut c, d));
            }
        }
    }
    let mut reader = connect();
    let mut snapshot =
        reader.build_transaction().isolation_level(postgres::IsolationLevel::RepeatableRead).start().unwrap();
    snapshot.query_one("SELECT 1", &[]).unwrap();
    c.query("SELECT * FROM sqlstreams.maintain_stream($1)", &[&s.name]).unwrap();
    let dead: Vec<i64> = snapshot
        .query("SELECT message_id FROM sqlstreams.dead_messages($1, 'g')", &[&s.name])
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(dead, vec![7], "the dead letter is listed (its payload may be NULL for this snapshot)");
    snapshot.commit().unwrap();
}

#[test]
fn maintain_stream_maintains_one_stream() {
    let mut c = connect();
    let (one, other) = (Stream::create_sized(&mut c, "one", 1000), Stream::create_sized(&mut c, "other", 1000));
    for s in [&one, &other] {
        let g = s.group(&mut c, "g", None);
        s.produce_many(&mut c, 2500, None);
        g.drain(&mut c);
    }
    let rows = c.query("SELECT stream FROM sqlstreams.maintain_stream($1)", &[&one.name]).unwrap();
    let names: Vec<String> = rows.iter().map(|r| r.get(0)).collect();
    assert_eq!(names, vec![one.name.clone()], "one row, for the stream asked for");
    // (What the step dropped is not asserted here: another test's maintain() may be working on
    // this stream at the same moment. tests/competing.rs drives retention with maintain_stream.)
    let err = c.query("SELECT * FROM sqlstreams.maintain_stream($1)", &[&unique("missing")]).unwrap_err();
    assert_eq!(sqlstate(&err), "42704", "{}", describe(&err));
}

/// Scans of the stream's catalog row and of its cursor table by one `maintain_stream`.
fn maintain_scans(c: &mut Client, s: &Stream) -> (i64, i64) {
    let mut tx = c.transaction().unwrap();
    let (streams, cursors) = (scans(&mut tx, "sqlstreams.stream"), scans(&mut tx, &s.table("cursor")));
    tx.query("SELECT * FROM sqlstreams.maintain_stream($1)", &[&s.name]).unwrap();
    let after = (scans(&mut tx, "sqlstreams.stream") - streams, scans(&mut tx, &s.table("cursor")) - cursors);
    tx.rollback().unwrap();
    after
}

#[test]
fn maintain_does_each_streams_work_once() {
    // A database of its own: another test's maintain() of every stream would hold cursor rows
    // this one's skips, and scan less.
    let (mut c, _) = own_database("maintain_once");
    let (one, three) = (Stream::create(&mut c, "maintain-once-1"), Stream::create(&mut c, "maintain-once-3"));
    one.group(&mut c, "g0", None);
    for g in ["g0", "g1", "g2"] {
        three.group(&mut c, g, None);
    }
    for s in [&one, &three] {
        s.produce_many(&mut c, 10, None);
        // The first one creates partitions ahead, which reads the stream row more; the second
        // is what maintenance costs from then on.
        c.query("SELECT * FROM sqlstreams.maintain_stream($1)", &[&s.name]).unwrap();
    }
    let (looked_up, one_group) = maintain_scans(&mut c, &one);
    let (_, three_groups) = maintain_scans(&mut c, &three);
    // Per group, the cursor row is locked (one scan) and stored (the update reads it twice):
    // three scans. Storing every cursor a second time in the retention step made it six.
    let per_group = (three_groups - one_group) / 2;
    assert!(per_group <= 3, "each group's cursor is stored once: {per_group} scans per group");
    assert!(per_group > 0, "and it is stored");
    // The stream is looked up once (its row read by name); the list of its groups, its bounds and
    // its dead letters' retention read the row too. A second lookup (for partitions_through)
    // made it five.
    assert!(looked_up <= 4, "the stream is looked up once: {looked_up} scans of sqlstreams.stream");
}

#[test]
fn retention_drops_partitions_every_group_is_done_with_and_keeps_what_any_group_needs() {
    let mut c = connect();
    let s = Stream::create_sized(&mut c, "retention", 1000);
    let fast = s.group(&mut c, "fast", None);
    let slow = s.group(&mut c, "slow", None);
    s.produce_many(&mut c, 3500, None);
    assert_eq!(maintain(&mut c, &s), (0, 0), "no group has resolved anything yet");
    let before = s.partitions(&mut c);
    assert!(before.len() >= 4, "{before:?}");

    fast.drain(&mut c);
    assert_eq!(maintain(&mut c, &s), (0, 0), "slow still needs every message");
    assert_eq!(s.partitions(&mut c), before);

    // slow resolves everything, but two messages of the second and third partitions die.
    let payload_of = |c: &mut Client, id: i64| -> Value {
        let sql = format!("SELECT payload FROM {} WHERE id = $1", s.table("message_log"));
        c.query_one(&sql, &[&id]).unwrap().get(0)
    };
    let (poison, older) = (1500i64, 2500i64);
    let poison_payload = payload_of(&mut c, poison);
    drain_failing(&mut c, &slow, &[poison, older]);
    // Dead letters keep no partition: every group committed past the first three.
    assert_eq!(maintain(&mut c, &s), (3, 0));
    assert_eq!(s.partitions(&mut c), before[3..], "the partition holding the head stays");
    let archive = s.table("message_archive");
    let archived = |c: &mut Client| -> Vec<i64> {
        let sql = format!("SELECT id FROM {archive} ORDER BY id");
        c.query(&sql, &[]).unwrap().iter().map(|r| r.get(0)).collect()
    };
    assert_eq!(archived(&mut c), vec![poison, older], "only what exception rows refer to is kept");
    let dead: Vec<(i64, Value)> = c
        .query("SELECT message_id, payload FROM sqlstreams.dead_messages($1, 'slow')", &[&s.name])
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(dead.len(), 2, "dead messages stay readable while their rows live");
    assert_eq!(dead[0], (poison, poison_payload.clone()));

    // A redriven dead letter runs again with its payload, from the archive.
    c.query_one("SELECT sqlstreams.redrive($1, 'slow', ARRAY[$2::int8])", &[&s.name, &poison]).unwrap();
    let again: Vec<(i64, Value, uuid::Uuid)> = c
        .query("SELECT message_id, payload, lease_token FROM sqlstreams.claim($1, 'slow', 10)", &[&s.name])
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    assert_eq!(again.iter().map(|(id, p, _)| (*id, p.clone())).collect::<Vec<_>>(), vec![(poison, poison_payload)]);
    let token = again[0].2;
    c.query_one("SELECT sqlstreams.ack($1, 'slow', $2, $3)", &[&s.name, &token, &poison]).unwrap();
    assert_eq!(maintain(&mut c, &s), (0, 0));
    assert_eq!(archived(&mut c), vec![older], "an archived message no row refers to goes");

    // Once dead rows outlive the stream's dead_retention, they go, and their archived messages.
    c.query_one("SELECT sqlstreams.alter_stream($1, dead_retention => '1 microsecond')", &[&s.name]).unwrap();
    assert_eq!(maintain(&mut c, &s), (0, 1));
    assert_eq!(archived(&mut c), Vec::<i64>::new());
    // Everything still works above what was dropped.
    let next = s.produce(&mut c, json!({}), None);
    assert_eq!(ids(&fast.claim(&mut c, 10)), vec![next]);
}

/// `maintain_stream`'s (partitions dropped, exception rows purged), for a test with a database of
/// its own: `maintain()` of other tests in the shared one would hold the stream's rows meanwhile.
fn maintain_own(c: &mut Client, s: &Stream) -> (i64, i64) {
    let row = c
        .query_one("SELECT partitions_dropped, exception_rows_purged FROM sqlstreams.maintain_stream($1)", &[&s.name])
        .unwrap();
    (row.get(0), row.get(1))
}

/// `group_status`'s (committed, lag, oldest_unresolved_at) of group `g`.
fn unresolved(c: &mut Client, s: &Stream) -> (i64, i64, Option<std::time::SystemTime>) {
    let row = c
        .query_one("SELECT committed, lag, oldest_unresolved_at FROM sqlstreams.group_status($1, 'g')", &[&s.name])
        .unwrap();
    (row.get(0), row.get(1), row.get(2))
}

/// Redrives dead message `id` of group `g`.
fn redrive(c: &mut impl postgres::GenericClient, s: &Stream, id: i64) {
    let redriven: Vec<i64> =
        c.query_one("SELECT sqlstreams.redrive($1, 'g', ARRAY[$2::int8])", &[&s.name, &id]).unwrap().get(0);
    assert_eq!(redriven, vec![id]);
}

/// A redriven dead letter is unresolved again: the group's `committed` moves back below it, and
/// `group_status` (its lag, `oldest_unresolved_at`) counts it until it resolves, whether retention
/// dropped its partition (when it was produced is then read from the archive) or not.
#[test]
fn a_redriven_dead_letter_holds_the_cursor_until_it_resolves() {
    let (mut c, _) = own_database("redrive_cursor");
    let s = Stream::create_sized(&mut c, "redrive-cursor", 1000);
    let g = s.group(&mut c, "g", None);
    let produced = s.produce_many(&mut c, 2500, None);
    let head = *produced.last().unwrap();
    // One dies in the first partition, which retention drops; one in the head's, which stays.
    let (gone, kept) = (produced[10], produced[2100]);
    drain_failing(&mut c, &g, &[gone, kept]);
    assert_eq!(maintain_own(&mut c, &s), (2, 0), "dead letters keep no partition");
    assert_eq!(g.stored_cursor(&mut c).1, head);
    assert_eq!(unresolved(&mut c, &s), (head, 0, None), "everything is resolved");
    let produced_at = |c: &mut Client, table: &str, id: i64| -> std::time::SystemTime {
        c.query_one(&format!("SELECT produced_at FROM {} WHERE id = $1", s.table(table)), &[&id]).unwrap().get(0)
    };

    redrive(&mut c, &s, kept);
    let at = produced_at(&mut c, "message_log", kept);
    assert_eq!(unresolved(&mut c, &s), (kept - 1, head - (kept - 1), Some(at)), "the redriven message is unresolved");
    assert_eq!(maintain_own(&mut c, &s), (0, 0));
    assert_eq!(g.stored_cursor(&mut c).1, kept - 1, "maintain() does not move the cursor past it");

    // Its partition gone, the message is in the archive: when it was produced is read there (made
    // distinct from every message still in the log, so that a read of the log's next one shows).
    let archive = s.table("message_archive");
    c.execute(&format!("UPDATE {archive} SET produced_at = produced_at - interval '1 hour' WHERE id = $1"), &[&gone])
        .unwrap();
    redrive(&mut c, &s, gone);
    let at = produced_at(&mut c, "message_archive", gone);
    assert_eq!(unresolved(&mut c, &s), (gone - 1, head - (gone - 1), Some(at)), "the archived message is unresolved");
    assert_eq!(maintain_own(&mut c, &s), (0, 0));
    assert_eq!(g.stored_cursor(&mut c).1, gone - 1);

    let mut again = vec![];
    for _ in 0..3 {
        for d in g.claim(&mut c, 10) {
            assert!(g.ack(&mut c, &d));
            again.push(d.message_id);
        }
    }
    again.sort_unstable();
    assert_eq!(again, vec![gone, kept], "both run again");
    assert_eq!(unresolved(&mut c, &s), (head, 0, None), "resolved: group_status shows it at once");
    maintain_own(&mut c, &s);
    assert_eq!(g.stored_cursor(&mut c).1, head, "and maintain() stores it");
}

/// A `maintain()` step while a redrive is in progress: its snapshot still sees the message dead,
/// which lets `committed` pass, so it must not store a cursor past it. The redrive holds the
/// cursor row (the step takes it only if free) even though `committed` is below the message yet.
#[test]
fn a_maintain_step_beside_a_redrive_does_not_move_the_cursor_past_it() {
    let (mut c, url) = own_database("redrive_race");
    let s = Stream::create(&mut c, "redrive-race");
    let g = s.group(&mut c, "g", None);
    let produced = s.produce_many(&mut c, 3, None);
    let dead = produced[1];
    for d in g.claim(&mut c, 10) {
        if d.message_id == dead {
            g.fail(&mut c, &d, "poison", true, None);
        } else {
            assert!(g.ack(&mut c, &d));
        }
    }
    assert!(g.stored_cursor(&mut c).1 < dead, "no step stored the cursor past the dead letter yet");
    let mut admin = postgres::Client::connect(&url, postgres::NoTls).unwrap();
    let mut redriving = admin.transaction().unwrap();
    redrive(&mut redriving, &s, dead);
    // The step runs to its end meanwhile (it waits for nothing the redrive holds).
    maintain_own(&mut c, &s);
    redriving.commit().unwrap();
    assert_eq!(unresolved(&mut c, &s).0, dead - 1, "the redriven message is unresolved");
    maintain_own(&mut c, &s);
    assert_eq!(g.stored_cursor(&mut c).1, dead - 1, "and the cursor waits for it");
}

#[test]
fn a_group_with_no_consumer_yet_keeps_everything() {
    let mut c = connect();
    let s = Stream::create_sized(&mut c, "retention-idle", 1000);
    s.produce_many(&mut c, 2500, None);
    assert_eq!(maintain(&mut c, &s), (0, 0), "a stream without groups keeps its messages for the first one");
    let g = s.group(&mut c, "late", None);
    assert_eq!(g.drain(&mut c).len(), 2500);
}

/// `claimed` (and with it `committed`, which retention drops below) stops at the first message
/// any lane has not handed out, when the lanes are in different partitions: a lane that moved
/// into a later partition does not carry the others past what they still have to hand out.
#[test]
fn committed_stops_at_the_first_message_a_lane_has_not_handed_out() {
    let mut c = connect();
    let s = Stream::create_sized(&mut c, "lanes-apart", 1000);
    s.produce_many(&mut c, 2500, None); // keyless: lanes take blocks of 64 ids in turn
    let g = s.group(&mut c, "g", None);
    let batch = g.claim(&mut c, 100); // lane 0 only: ids 1..=63, then 1024..=1060
    assert_eq!(batch.last().map(|d| d.message_id), Some(1060));
    g.ack_batch(&mut c, &batch);
    let status = "SELECT claimed, committed FROM sqlstreams.group_status($1, 'g')";
    let row = c.query_one(status, &[&s.name]).unwrap();
    assert_eq!((row.get::<_, i64>(0), row.get::<_, i64>(1)), (63, 63), "lane 1 has not handed out 64");
    assert_eq!(maintain(&mut c, &s), (0, 0), "retention keeps what lane 1 and the others still need");
    let row = c.query_one(status, &[&s.name]).unwrap();
    assert_eq!((row.get::<_, i64>(0), row.get::<_, i64>(1)), (63, 63), "stored as it is");
    assert_eq!(g.drain(&mut c).len(), 2400);
}

#[test]
fn hold_on_dead_stops_only_that_key_until_redrive_restores_its_order() {
    let mut c = connect();
    let s = Stream::create(&mut c, "hold");
    let g = s.group(&mut c, "g", Some("ordered"));
    c.query_one("SELECT sqlstreams.alter_group($1, 'g', on_dead => 'hold')", &[&s.name]).unwrap();
    let k: Vec<i64> = (0..3).map(|i| s.produce(&mut c, json!({ "k": i }), Some("k"))).collect();
    let j = s.produce(&mut c, json!({}), Some("j"));

    let first = g.claim(&mut c, 10);
    assert_eq!(ids(&first), vec![k[0], j], "one message per ordered key per claim when holding");
    assert_eq!(g.fail(&mut c, &first[0], "fatal", true, None).as_deref(), Some("dead"));
    assert!(g.ack(&mut c, &first[1]));
    let j2 = s.produce(&mut c, json!({}), Some("j"));
    assert_eq!(ids(&g.claim(&mut c, 10)), vec![j2], "k is held at its dead message; j goes on");
    assert!(g.claim(&mut c, 10).is_empty());
    let blocked: Vec<(String, i64, String)> = c
        .query("SELECT message_key, oldest_message_id, status FROM sqlstreams.blocked_keys($1, 'g')", &[&s.name])
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    assert!(blocked.contains(&("k".to_string(), k[0], "dead".to_string())), "{blocked:?}");

    // Redrive: the dead message runs again with a fresh budget, then the rest in order.
    let redriven: Vec<i64> = c.query_one("SELECT sqlstreams.redrive($1, 'g')", &[&s.name]).unwrap().get(0);
    assert_eq!(redriven, vec![k[0]]);
    let again = g.claim(&mut c, 10);
    assert_eq!((ids(&again), again[0].attempt), (vec![k[0]], 0));
    assert!(g.ack(&mut c, &again[0]));
    let mut rest = Vec::new();
    for _ in 0..3 {
        for d in g.claim(&mut c, 10) {
            assert!(g.ack(&mut c, &d));
            rest.push(d.message_id);
        }
    }
    assert_eq!(rest, k[1..]);
}

/// A message that goes dead because its lease ran out (not through `fail`) holds its key too:
/// the claim that dead-letters it must not hand out the key's next message beside it.
#[test]
fn hold_on_dead_holds_a_key_whose_message_died_on_expiry() {
    let mut c = connect();
    let s = Stream::create(&mut c, "hold-expiry");
    let g = s.group_with(&mut c, "g", Some("ordered"), 1);
    c.query_one("SELECT sqlstreams.alter_group($1, 'g', on_dead => 'hold')", &[&s.name]).unwrap();
    let a = s.produce(&mut c, json!({}), Some("k"));
    let b = s.produce(&mut c, json!({}), Some("k"));

    let first = g.claim(&mut c, 10);
    assert_eq!(ids(&first), vec![a], "one message per ordered key per claim when holding");
    assert_eq!(g.fail(&mut c, &first[0], "flaky", false, Some("0 seconds")).as_deref(), Some("ready"));
    g.make_due(&mut c);
    // Its last try, from the exception queue; then its lease runs out: that spends the budget.
    assert_eq!(ids(&g.claim(&mut c, 10)), vec![a]);
    g.expire_leases(&mut c);
    g.make_due(&mut c);
    assert!(g.claim(&mut c, 10).is_empty(), "k stops at its message that died on expiry");
    assert_eq!(g.statuses(&mut c).iter().find(|(id, _)| *id == a).map(|(_, st)| st.as_str()), Some("dead"));
    g.make_due(&mut c);
    assert!(g.claim(&mut c, 10).is_empty(), "and stays stopped");

    assert!(c.query_one("SELECT sqlstreams.skip($1, 'g', $2)", &[&s.name, &a]).unwrap().get::<_, bool>(0));
    assert_eq!(ids(&g.claim(&mut c, 10)), vec![b], "skip releases it");
}

#[test]
fn skip_releases_a_held_key_and_purge_removes_old_dead_messages() {
    let mut c = connect();
    let s = Stream::create(&mut c, "skip");
    let g = s.group(&mut c, "g", Some("ordered"));
    c.query_one("SELECT sqlstreams.alter_group($1, 'g', on_dead => 'hold')", &[&s.name]).unwrap();
    let a = s.produce(&mut c, json!({}), Some("k"));
    let b = s.produce(&mut c, json!({}), Some("k"));
    let d = g.claim(&mut c, 10).pop().unwrap();
    g.fail(&mut c, &d, "fatal", true, None);
    assert!(g.claim(&mut c, 10).is_empty());
    let skipped: bool = c.query_one("SELECT sqlstreams.skip($1, 'g', $2)", &[&s.name, &a]).unwrap().get(0);
    assert!(skipped);
    assert_eq!(ids(&g.claim(&mut c, 10)), vec![b]);
    assert!(!c.query_one("SELECT sqlstreams.skip($1, 'g', $2)", &[&s.name, &a]).unwrap().get::<_, bool>(0));

    // purge_dead: only what died long enough ago.
    let x = s.produce(&mut c, json!({}), None);
    let dx = g.claim(&mut c, 10).into_iter().find(|d| d.message_id == x).unwrap();
    g.fail(&mut c, &dx, "fatal", true, None);
    let kept: i64 = c.query_one("SELECT sqlstreams.purge_dead($1, 'g', '1 hour')", &[&s.name]).unwrap().get(0);
    assert_eq!(kept, 0);
    let purged: i64 = c.query_one("SELECT sqlstreams.purge_dead($1, 'g')", &[&s.name]).unwrap().get(0);
    assert_eq!(purged, 1);
    assert!(g.statuses(&mut c).iter().all(|(_, status)| status != "dead"));
}

#[test]
fn seek_replays_backwards_and_skips_forwards_and_forgets_open_leases() {
    let mut c = connect();
    let s = Stream::create(&mut c, "seek");
    let g = s.group(&mut c, "g", Some("ordered"));
    let ids_produced = s.produce_many(&mut c, 6, Some("k"));
    let open = g.claim(&mut c, 3);
    assert_eq!(ids(&open), ids_produced[..3]);
    let failed = g.claim(&mut c, 3);
    assert!(failed.is_empty(), "k's lane is held by the open claim");

    // Back to the beginning, with a claim still open: its lease is forgotten.
    let at: i64 = c.query_one("SELECT sqlstreams.seek($1, 'g', to_id => 0)", &[&s.name]).unwrap().get(0);
    assert_eq!(at, 0);
    assert!(!g.ack(&mut c, &open[0]), "an outcome under a lease from before the seek changes nothing");
    assert_eq!(g.cursor(&mut c), (0, 0));
    assert_eq!(g.drain(&mut c), ids_produced, "replayed from the beginning, in order");

    // Forward: skip to the head; only what comes after runs.
    s.produce_many(&mut c, 3, Some("k"));
    let head: i64 = c.query_one("SELECT head FROM sqlstreams.streams WHERE name = $1", &[&s.name]).unwrap().get(0);
    let at: i64 =
        c.query_one("SELECT sqlstreams.seek($1, 'g', to_id => $2)", &[&s.name, &(head + 100)]).unwrap().get(0);
    assert_eq!(at, head, "never past the head");
    assert!(g.claim(&mut c, 10).is_empty());
    let after = s.produce(&mut c, json!({}), Some("k"));
    assert_eq!(g.drain(&mut c), vec![after]);

    // By time: before everything is the beginning.
    let at: i64 = c
        .query_one("SELECT sqlstreams.seek($1, 'g', to_time => now() - interval '1 hour')", &[&s.name])
        .unwrap()
        .get(0);
    assert_eq!(at, 0);
    let err = c.query_one("SELECT sqlstreams.seek($1, 'g')", &[&s.name]).unwrap_err();
    assert_eq!(sqlstate(&err), "22023");
}

#[test]
fn a_paused_group_hands_out_nothing_but_its_outcomes_count() {
    let mut c = connect();
    let s = Stream::create(&mut c, "pause");
    let g = s.group(&mut c, "g", None);
    s.produce_many(&mut c, 2, None);
    let held = g.claim(&mut c, 1);
    assert!(c.query_one("SELECT sqlstreams.pause_group($1, 'g')", &[&s.name]).unwrap().get::<_, bool>(0));
    assert!(!c.query_one("SELECT sqlstreams.pause_group($1, 'g')", &[&s.name]).unwrap().get::<_, bool>(0));
    assert!(g.claim(&mut c, 10).is_empty());
    assert!(g.ack(&mut c, &held[0]), "outcomes of open leases still count");
    let paused: bool =
        c.query_one("SELECT paused FROM sqlstreams.consumer_groups WHERE id = $1", &[&g.id]).unwrap().get(0);
    assert!(paused);
    assert!(c.query_one("SELECT sqlstreams.resume_group($1, 'g')", &[&s.name]).unwrap().get::<_, bool>(0));
    assert_eq!(g.claim(&mut c, 10).len(), 1);
}

#[test]
fn alter_group_changes_only_what_it_is_told() {
    let mut c = connect();
    let s = Stream::create(&mut c, "alter");
    let g = s.group_with(&mut c, "g", Some("ordered"), 7);
    c.query_one("SELECT sqlstreams.alter_group($1, 'g', max_reclaims => 5)", &[&s.name]).unwrap();
    let row = c
        .query_one(
            "SELECT concurrency_override, max_retries, max_reclaims, on_dead FROM sqlstreams.consumer_groups WHERE id = $1",
            &[&g.id],
        )
        .unwrap();
    let got: (Option<String>, i32, i32, String) = (row.get(0), row.get(1), row.get(2), row.get(3));
    assert_eq!(got, (Some("ordered".into()), 7, 5, "release".into()));
    c.query_one("SELECT sqlstreams.alter_group($1, 'g', concurrency_override => 'none')", &[&s.name]).unwrap();
    let over: Option<String> = c
        .query_one("SELECT concurrency_override FROM sqlstreams.consumer_groups WHERE id = $1", &[&g.id])
        .unwrap()
        .get(0);
    assert_eq!(over, None);
    let err = c.query_one("SELECT sqlstreams.alter_group($1, 'g', on_dead => 'forget')", &[&s.name]).unwrap_err();
    assert_eq!(sqlstate(&err), "22023");
}

#[test]
fn operators_see_how_old_the_backlog_is_and_who_holds_the_fence() {
    let mut c = connect();
    let mut producer = connect();
    let s = Stream::create(&mut c, "visibility");
    let g = s.group(&mut c, "g", None);
    let none: Option<std::time::SystemTime> =
        c.query_one("SELECT oldest_unresolved_at FROM sqlstreams.group_status($1, 'g')", &[&s.name]).unwrap().get(0);
    assert_eq!(none, None);
    s.produce(&mut c, json!({}), None);
    let age: bool = c
        .query_one(
            "SELECT oldest_unresolved_age >= interval '0' FROM sqlstreams.consumer_groups WHERE id = $1",
            &[&g.id],
        )
        .unwrap()
        .get(0);
    assert!(age);

    let mut tx = producer.transaction().unwrap();
    s.produce(&mut tx, json!({}), None);
    let holders: Vec<i32> = c
        .query("SELECT pid FROM sqlstreams.fence_holders WHERE stream = $1", &[&s.name])
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(holders.len(), 1, "the open producer transaction holds the fence");
    tx.commit().unwrap();
    assert!(c.query("SELECT pid FROM sqlstreams.fence_holders WHERE stream = $1", &[&s.name]).unwrap().is_empty());

    // A prepared producer: no backend, named by its gid. (With a savepoint that took a
    // transaction id of its own, so the prepared transaction holds two transaction id locks.)
    let gid = unique("fence-holder");
    producer
        .batch_execute(&format!(
            "BEGIN; SET LOCAL sqlstreams.notify = off; SAVEPOINT one;
             SELECT sqlstreams.produce('{}', '{{}}'); RELEASE SAVEPOINT one;
             PREPARE TRANSACTION '{gid}'",
            s.name
        ))
        .unwrap();
    let holders = c.query(
        "SELECT pid, prepared_gid, prepared IS NOT NULL FROM sqlstreams.fence_holders WHERE stream = $1",
        &[&s.name],
    );
    producer.batch_execute(&format!("ROLLBACK PREPARED '{gid}'")).unwrap();
    let holders: Vec<(Option<i32>, Option<String>, bool)> =
        holders.unwrap().iter().map(|r| (r.get(0), r.get(1), r.get(2))).collect();
    assert_eq!(holders, vec![(None, Some(gid), true)], "the prepared producer, once");
    assert!(c.query("SELECT pid FROM sqlstreams.fence_holders WHERE stream = $1", &[&s.name]).unwrap().is_empty());
}

#[test]
fn maintain_passes_over_a_stream_being_dropped() {
    let mut c = connect();
    let mut dropper = connect();
    let s = Stream::create(&mut c, "dropping");
    s.group(&mut c, "g", None);
    s.produce_many(&mut c, 3, None);
    let mut tx = dropper.transaction().unwrap();
    assert!(tx.query_one("SELECT sqlstreams.drop_stream($1)", &[&s.name]).unwrap().get::<_, bool>(0));
    // The drop has not committed: maintain() neither waits for it nor trips over its tables.
    let listed: Vec<String> =
        c.query("SELECT stream FROM sqlstreams.maintain()", &[]).unwrap().iter().map(|r| r.get(0)).collect();
    assert!(!listed.contains(&s.name));
    tx.commit().unwrap();
}

/// A stream whose maintenance fails (a DBA's trigger refuses the update that clears its expired
/// lane holds; another's tables are at another version) is left out of `maintain()`'s rows, with
/// a warning that names it and carries its error's SQLSTATE and hint; what its step did before the
/// error is rolled back (its expired idempotency key, which the step purges first, is still there),
/// and the streams after it are maintained all the same, as the worker maintains them. Before, the
/// error ended the call: while one stream could not be maintained, a cron job maintained none.
/// What fails every stream alike is refused as before: a library the installed SQL does not
/// match, a read-only transaction, a cancel. In a database of its own: another test's
/// `maintain()` would meet the broken streams.
#[test]
fn maintain_leaves_out_a_stream_it_cannot_maintain_and_maintains_the_rest() {
    let (_, url) = own_database("maintain_broken");
    let (mut c, warnings) = listening_to(&url);
    let expiring = "SELECT sqlstreams.create_stream($1, 1000, idempotency_ttl => '1 microsecond')";
    // Streams are maintained in id order: the broken ones first.
    let audited = Stream::create_sized(&mut c, "audited", 1000);
    let old = Stream::create_sized(&mut c, "old", 1000);
    let healthy = Stream::create_sized(&mut c, "healthy", 1000);
    for s in [&audited, &old, &healthy] {
        c.query_one(expiring, &[&s.name]).unwrap();
        c.query_one("SELECT sqlstreams.produce($1, '{}', idempotency_key => 'order-1')", &[&s.name]).unwrap();
        s.group(&mut c, "g", None);
    }
    let lanes = audited.table("lane");
    c.batch_execute(&format!(
        "UPDATE {lanes} SET held_by = gen_random_uuid(), held_until = now() - interval '1 hour' WHERE lane = 0"
    ))
    .unwrap();
    refuse_on(&mut c, &lanes, "UPDATE", "lane updates are audited");
    let refused = c.query("SELECT * FROM sqlstreams.maintain_stream($1)", &[&audited.name]).unwrap_err();
    assert_eq!(sqlstate(&refused), "P0001", "the audited stream's own maintenance fails: {refused:?}");
    let version: String =
        c.query_one("SELECT schema_version FROM sqlstreams.stream WHERE id = $1", &[&old.id]).unwrap().get(0);
    c.execute("UPDATE sqlstreams.stream SET schema_version = '0.0.1' WHERE id = $1", &[&old.id]).unwrap();
    warnings.lock().unwrap().clear();

    let rows = maintained(&mut c);
    assert_eq!(rows, vec![(healthy.name.clone(), 1)], "the healthy stream maintained, the broken ones left out");
    let warned = warnings.lock().unwrap().clone();
    let about = |s: &Stream| format!("sqlstreams: stream \"{}\" is not maintained: ", s.name);
    assert!(
        warned.iter().any(|w| w.starts_with(&about(&audited)) && w.contains("lane updates are audited [P0001]")),
        "a warning names the stream, its error and SQLSTATE: {warned:?}"
    );
    assert!(
        warned
            .iter()
            .any(|w| w.starts_with(&about(&old)) && w.contains("[55000] HINT: Run ALTER EXTENSION sqlstreams UPDATE")),
        "and the error's hint: {warned:?}"
    );
    assert_eq!(warned.len(), 2, "one warning a stream: {warned:?}");
    let keys = |c: &mut Client, s: &Stream| -> i64 {
        c.query_one(&format!("SELECT count(*) FROM {}", s.table("idempotency_key")), &[]).unwrap().get(0)
    };
    assert_eq!(keys(&mut c, &audited), 1, "the audited stream's purge rolled back with its step");
    assert_eq!(keys(&mut c, &healthy), 0);
    let held: i64 =
        c.query_one(&format!("SELECT count(*) FROM {lanes} WHERE held_by IS NOT NULL"), &[]).unwrap().get(0);
    assert_eq!(held, 1, "the audited stream's expired hold still there");
    c.execute("UPDATE sqlstreams.stream SET schema_version = $2 WHERE id = $1", &[&old.id, &version]).unwrap();

    // What fails every stream alike ends the call, as before. A library the installed SQL does
    // not match: newer (a new library before ALTER EXTENSION UPDATE), or older (in a session that
    // loaded its library before the update, and matched then, as this one did)...
    let hint = |e: &postgres::Error| e.as_db_error().and_then(|e| e.hint()).unwrap_or_default().to_string();
    for (version, says) in [("0.0.1", "Run ALTER EXTENSION sqlstreams UPDATE"), ("99.0.0", "reconnect")] {
        let mut upgrading = c.transaction().unwrap();
        upgrading
            .execute("UPDATE pg_catalog.pg_extension SET extversion = $1 WHERE extname = 'sqlstreams'", &[&version])
            .unwrap();
        let refused = upgrading.query("SELECT * FROM sqlstreams.maintain()", &[]).unwrap_err();
        assert_eq!(sqlstate(&refused), "55000", "{refused:?}");
        assert!(hint(&refused).contains(says), "{version}: {refused:?}");
        upgrading.rollback().unwrap();
    }
    // ... a read-only transaction...
    let mut read_only = c.build_transaction().read_only(true).start().unwrap();
    let refused = read_only.query("SELECT * FROM sqlstreams.maintain()", &[]).unwrap_err();
    assert_eq!(sqlstate(&refused), "25006", "{refused:?}");
    assert!(hint(&refused).contains("read-write transaction"), "{refused:?}");
    read_only.rollback().unwrap();
    // ... and a cancel (a statement timeout while a DBA's lock holds the healthy stream's cursors).
    let mut dba = postgres::Client::connect(&url, postgres::NoTls).unwrap();
    let mut locked = dba.transaction().unwrap();
    locked.batch_execute(&format!("LOCK TABLE {} IN ACCESS EXCLUSIVE MODE", healthy.table("cursor"))).unwrap();
    c.batch_execute("SET statement_timeout = '300ms'").unwrap();
    let cancelled = c.query("SELECT * FROM sqlstreams.maintain()", &[]).unwrap_err();
    assert_eq!(sqlstate(&cancelled), "57014", "the timeout ends maintain(): {cancelled:?}");
    locked.rollback().unwrap();
}

/// The exception counts keep a row per group, status and writing backend, not per change, so
/// `group_status` reads a few rows however busy the queue was; and a writer whose row a fold
/// holds adds a row instead of waiting for it. In a database of its own: another test's
/// `maintain()` folds the rows of every stream of its database, and once folded them here too.
#[test]
fn exception_counts_keep_a_row_per_writer_not_per_change() {
    let (mut a, url) = own_database("count_rows");
    let mut b = Client::connect(&url, postgres::NoTls).unwrap();
    let s = Stream::create(&mut a, "count-rows");
    let g = s.group_with(&mut a, "g", Some("parallel"), 1000);
    s.produce_many(&mut a, 300, None);
    let batch = g.claim(&mut a, 300);
    assert_eq!(batch.len(), 300);
    let table = s.table("exception_count");
    let rows = |c: &mut Client| -> Vec<(String, Option<i32>, i64)> {
        c.query(&format!("SELECT status, writer, delta FROM {table} ORDER BY 1, 2 NULLS FIRST"), &[])
            .unwrap()
            .iter()
            .map(|r| (r.get(0), r.get(1), r.get(2)))
            .collect()
    };

    // 100 failures in one transaction, each its own statement, one in a subtransaction that
    // rolls back and one in a subtransaction that commits: nothing is written to the counts
    // until the commit, then one row.
    let mut tx = a.transaction().unwrap();
    let fail = |tx: &mut postgres::Transaction<'_>, d: &Delivery| -> Option<String> {
        tx.query_one(
            "SELECT sqlstreams.fail($1, 'g', $2, $3, 'x', retry_after => '1 hour')",
            &[&s.name, &d.lease_token, &d.message_id],
        )
        .unwrap()
        .get(0)
    };
    for d in &batch[..98] {
        assert_eq!(fail(&mut tx, d).as_deref(), Some("ready"));
    }
    let mut undone = tx.transaction().unwrap();
    assert_eq!(fail(&mut undone, &batch[98]).as_deref(), Some("ready"));
    undone.rollback().unwrap();
    let mut kept = tx.transaction().unwrap();
    assert_eq!(fail(&mut kept, &batch[98]).as_deref(), Some("ready"));
    kept.commit().unwrap();
    assert_eq!(fail(&mut tx, &batch[99]).as_deref(), Some("ready"));
    let written: i64 = tx
        .query_one(
            "SELECT n_tup_ins + n_tup_upd FROM pg_stat_xact_user_tables WHERE relid = $1::text::regclass",
            &[&table],
        )
        .unwrap()
        .get(0);
    assert_eq!(written, 0, "the counts are written at commit");
    let seen = tx
        .query_one(
            &format!(
                "SELECT (SELECT ready FROM sqlstreams.group_status($1, 'g')),
                        (SELECT count(*) FROM {} WHERE status = 'ready')",
                s.table("exception_queue")
            ),
            &[&s.name],
        )
        .unwrap();
    let (reported, counted): (i64, i64) = (seen.get(0), seen.get(1));
    assert_eq!((reported, counted), (100, 100), "group_status counts what its own transaction changed");
    // Not from a parallel worker, which would not have the leader's unwritten changes.
    let parallel = debug_parallel_setting(&mut tx);
    tx.batch_execute(&format!("SET LOCAL {parallel} = on")).unwrap();
    let reported: i64 = tx.query_one("SELECT ready FROM sqlstreams.group_status($1, 'g')", &[&s.name]).unwrap().get(0);
    assert_eq!(reported, 100, "group_status under {parallel}");
    tx.commit().unwrap();
    let pid_a: i32 = a.query_one("SELECT pg_backend_pid()", &[]).unwrap().get(0);
    assert_eq!(rows(&mut a), vec![("ready".to_string(), Some(pid_a), 100)]);
    assert_eq!(g.assert_counts_exact(&mut a), [100, 0, 0, 0, 0]);

    // Two backends, 100 failures each, one transaction per failure, interleaved: a row each.
    for pair in batch[100..].chunks(2) {
        g.fail(&mut a, &pair[0], "x", false, Some("1 hour"));
        g.fail(&mut b, &pair[1], "x", false, Some("1 hour"));
    }
    let pids: Vec<i32> =
        [&mut a, &mut b].into_iter().map(|c| c.query_one("SELECT pg_backend_pid()", &[]).unwrap().get(0)).collect();
    let mut expected = vec![("ready".to_string(), Some(pids[0]), 200), ("ready".to_string(), Some(pids[1]), 100)];
    expected.sort();
    assert_eq!(rows(&mut a), expected);
    assert_eq!(g.assert_counts_exact(&mut a), [300, 0, 0, 0, 0]);

    // A prepared transaction holds a's row until it is committed; a's next transaction adds a
    // row of its own instead of waiting.
    let gid = unique("counts");
    let more = s.produce_many(&mut a, 1, None);
    a.batch_execute("BEGIN; SET LOCAL sqlstreams.notify = off").unwrap();
    let got = g.claim(&mut a, 10);
    assert_eq!(ids(&got), more, "the failed are due in an hour");
    assert_eq!(g.fail(&mut a, &got[0], "x", false, Some("1 hour")).as_deref(), Some("ready"));
    a.batch_execute(&format!("PREPARE TRANSACTION '{gid}'")).unwrap();
    a.batch_execute("SET lock_timeout = '20s'").unwrap();
    // (The prepared claim holds its message's lane: 64 more reach the next block of ids' lane.)
    s.produce_many(&mut a, 64, None);
    let got = g.claim(&mut a, 1);
    assert_eq!(g.fail(&mut a, &got[0], "x", false, Some("1 hour")).as_deref(), Some("ready"));
    a.batch_execute("RESET lock_timeout").unwrap();
    a.batch_execute(&format!("COMMIT PREPARED '{gid}'")).unwrap();
    assert_eq!(g.assert_counts_exact(&mut a), [302, 0, 0, 0, 0]);
    let mut expected = vec![
        ("ready".to_string(), Some(pids[0]), 201),
        ("ready".to_string(), Some(pids[0]), 1),
        ("ready".to_string(), Some(pids[1]), 100),
    ];
    expected.sort();
    let mut found = rows(&mut a);
    found.sort();
    assert_eq!(found, expected);

    // A fold holds every row (not committed yet): a backend that changes the queue now does not
    // wait for it; it adds a row. (The lock timeout turns a wait into an error, not a hang.)
    let mut fold = b.transaction().unwrap();
    fold.query("SELECT * FROM sqlstreams.maintain()", &[]).unwrap();
    a.batch_execute("SET lock_timeout = '20s'").unwrap();
    let got = g.claim(&mut a, 1);
    assert_eq!(g.fail(&mut a, &got[0], "x", false, Some("1 hour")).as_deref(), Some("ready"));
    fold.commit().unwrap();
    a.batch_execute("RESET lock_timeout").unwrap();
    assert_eq!(g.assert_counts_exact(&mut a), [303, 0, 0, 0, 0]);
    assert_eq!(
        rows(&mut a),
        vec![("ready".to_string(), None, 302), ("ready".to_string(), Some(pids[0]), 1)],
        "the fold wrote one row; the change made meanwhile has a row of its own"
    );
}

/// maintain() refuses REPEATABLE READ and SERIALIZABLE, with what to do instead: the rows it
/// takes change all the time, and one changed after its snapshot would fail to serialize.
#[test]
fn maintain_needs_read_committed() {
    let mut c = connect();
    let s = Stream::create(&mut c, "maintain-rr");
    for level in [postgres::IsolationLevel::RepeatableRead, postgres::IsolationLevel::Serializable] {
        let mut tx = c.build_transaction().isolation_level(level).start().unwrap();
        let err = tx.query("SELECT * FROM sqlstreams.maintain()", &[]).unwrap_err();
        assert_eq!(sqlstate(&err), "25000", "{}", describe(&err));
        let hint = err.as_db_error().and_then(|e| e.hint()).unwrap_or_default().to_string();
        assert!(hint.contains("READ COMMITTED"), "{hint}");
        tx.rollback().unwrap();
        let mut tx = c.build_transaction().isolation_level(level).start().unwrap();
        let err = tx.query("SELECT * FROM sqlstreams.maintain_stream($1)", &[&s.name]).unwrap_err();
        assert_eq!(sqlstate(&err), "25000", "{}", describe(&err));
        tx.rollback().unwrap();
    }
    assert_eq!(c.query("SELECT * FROM sqlstreams.maintain_stream($1)", &[&s.name]).unwrap().len(), 1);
}

#[test]
fn group_status_counts_stay_exact_through_every_transition() {
    let mut c = connect();
    let s = Stream::create(&mut c, "counts");
    let g = s.group_with(&mut c, "g", Some("ordered"), 1);
    let chain = s.produce_many(&mut c, 5, Some("k"));
    let batch = g.claim(&mut c, 100);
    assert_eq!(ids(&batch), chain);
    assert_eq!(g.assert_counts_exact(&mut c), [0; 5], "a claimed range has no rows");

    // The head fails: it is ready, the rest of its chain deferred.
    assert_eq!(g.fail(&mut c, &batch[0], "boom", false, Some("0 seconds")).as_deref(), Some("ready"));
    assert_eq!(g.assert_counts_exact(&mut c), [1, 0, 4, 0, 0]);
    // Handed out again: inflight; its budget spent on the next failure: dead, and the rest of
    // its chain may run.
    g.make_due(&mut c);
    let again = g.claim(&mut c, 100);
    assert_eq!(ids(&again), chain);
    assert_eq!(g.assert_counts_exact(&mut c), [0, 5, 0, 0, 0]);
    assert_eq!(g.fail(&mut c, &again[0], "boom", false, None).as_deref(), Some("dead"));
    g.assert_counts_exact(&mut c);
    for d in &again[1..] {
        assert!(g.ack(&mut c, d));
    }
    assert!(g.drain(&mut c).is_empty());
    assert_eq!(g.assert_counts_exact(&mut c), [0, 0, 0, 1, 0]);

    // Redrive, dead again, purge.
    c.query_one("SELECT sqlstreams.redrive($1, 'g')", &[&s.name]).unwrap();
    assert_eq!(g.assert_counts_exact(&mut c), [1, 0, 0, 0, 0]);
    let d = g.claim(&mut c, 100);
    g.fail(&mut c, &d[0], "still", true, None);
    assert_eq!(g.assert_counts_exact(&mut c), [0, 0, 0, 1, 0]);
    c.query_one("SELECT sqlstreams.purge_dead($1, 'g')", &[&s.name]).unwrap();
    assert_eq!(g.assert_counts_exact(&mut c), [0; 5]);

    // Compaction on a parallel group: an older state is superseded.
    let p = s.group(&mut c, "p", Some("parallel"));
    p.drain(&mut c);
    let _older = s.produce_with(&mut c, json!({"v": 1}), Some("acct"), None, true).unwrap();
    let _newer = s.produce_with(&mut c, json!({"v": 2}), Some("acct"), None, true).unwrap();
    p.drain(&mut c);
    assert_eq!(p.assert_counts_exact(&mut c), [0, 0, 0, 0, 1]);
    g.drain(&mut c);
    g.assert_counts_exact(&mut c);

    // A seek forgets the group's rows; retention folds the deltas and the counts stay exact.
    let failing = s.produce_many(&mut c, 3, None);
    let got = g.claim(&mut c, 100);
    assert_eq!(ids(&got), failing);
    for d in &got {
        g.fail(&mut c, d, "later", false, Some("1 hour"));
    }
    g.assert_counts_exact(&mut c);
    let deltas = |c: &mut Client| -> i64 {
        c.query_one(&format!("SELECT count(*) FROM {}", s.table("exception_count")), &[]).unwrap().get(0)
    };
    assert!(deltas(&mut c) > 0);
    c.query("SELECT * FROM sqlstreams.maintain()", &[]).unwrap();
    let folded = after_folds(&mut c, &s, |tx| {
        tx.query_one(
            &format!(
                "SELECT count(*), count(*) FILTER (WHERE writer IS NULL AND delta <> 0) FROM {}",
                s.table("exception_count")
            ),
            &[],
        )
        .unwrap()
    });
    let (rows, folded): (i64, i64) = (folded.get(0), folded.get(1));
    assert_eq!(rows, folded, "maintain() folds every group's counts into one row per status");
    g.assert_counts_exact(&mut c);
    p.assert_counts_exact(&mut c);
    c.query_one("SELECT sqlstreams.seek($1, 'g', to_id => 0)", &[&s.name]).unwrap();
    assert_eq!(g.assert_counts_exact(&mut c), [0; 5]);

    // A dropped group's counts go with the next fold; one created under its name starts at zero.
    g.claim(&mut c, 100).iter().for_each(|d| {
        g.fail(&mut c, d, "x", true, None);
    });
    c.query_one("SELECT sqlstreams.drop_group($1, 'g')", &[&s.name]).unwrap();
    c.query("SELECT * FROM sqlstreams.maintain()", &[]).unwrap();
    let left: i64 = after_folds(&mut c, &s, |tx| {
        tx.query_one(
            &format!("SELECT count(*) FROM {} WHERE consumer_group_id = $1", s.table("exception_count")),
            &[&g.id],
        )
        .unwrap()
        .get(0)
    });
    assert_eq!(left, 0);
    let reborn = s.group(&mut c, "g", Some("ordered"));
    assert_eq!(reborn.assert_counts_exact(&mut c), [0; 5]);
}

/// Reads `s`'s exception counts once every fold of them has committed. Other tests' `maintain()`
/// folds every stream's counts too: a fold skips the rows another fold holds, so right after this
/// test's `maintain()` returns, another's may still be in flight with them. `SHARE` waits for
/// every transaction writing the table.
fn after_folds<T>(c: &mut Client, s: &Stream, read: impl FnOnce(&mut postgres::Transaction<'_>) -> T) -> T {
    let mut tx = c.transaction().unwrap();
    tx.execute(&format!("LOCK TABLE {} IN SHARE MODE", s.table("exception_count")), &[]).unwrap();
    let read = read(&mut tx);
    tx.commit().unwrap();
    read
}

/// `peek` reads on from one partition into the next, and stops at its limit.
#[test]
fn peek_reads_across_partitions() {
    let mut c = connect();
    let s = Stream::create_sized(&mut c, "peek", 1000);
    let produced = s.produce_many(&mut c, 2500, None);
    let peek = |c: &mut Client, after: i64, limit: i32| -> Vec<i64> {
        c.query("SELECT message_id FROM sqlstreams.peek($1, $2, $3)", &[&s.name, &after, &limit])
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect()
    };
    assert_eq!(peek(&mut c, 900, 300), produced[900..1200]);
    assert_eq!(peek(&mut c, 0, 2500), produced);
    assert_eq!(peek(&mut c, 2400, 1000), produced[2400..]);
    assert!(peek(&mut c, 2500, 10).is_empty());
}

/// A partition whose creator rolled back leaves a gap in the log that `peek` passes, in a
/// parallel plan too: a partition the cache does not know is looked for in `pg_class` with the
/// newest snapshot (src/partition.rs), which a parallel worker cannot take, so there the
/// cache's answer stands (it raised "cannot update SecondarySnapshot during a parallel
/// operation").
#[test]
fn peek_passes_a_partition_whose_creator_rolled_back_in_a_parallel_plan_too() {
    let mut c = connect();
    let s = Stream::create_sized(&mut c, "peek-gap", 1000);
    let produced = s.produce_many(&mut c, 1000, None);
    // Ids 1001 to 4000, in partitions 1 to 3, made in the same transaction. (The next producer
    // would make them again: partitions are added from the last one up.)
    let mut tx = c.transaction().unwrap();
    s.produce_many(&mut tx, 3000, None);
    tx.rollback().unwrap();
    let missing: i64 = c
        .query_one(
            "SELECT count(*) FROM generate_series(1, 3) p WHERE to_regclass(format('%s_p%s', $1::text, p)) IS NULL",
            &[&s.table("message_log")],
        )
        .unwrap()
        .get(0);
    assert_eq!(missing, 3, "the partitions went with their creator");
    let setting = debug_parallel_setting(&mut c);
    for parallel in ["off", "on"] {
        c.batch_execute(&format!("SET {setting} = {parallel}")).unwrap();
        let peeked: Vec<i64> = c
            .query("SELECT message_id FROM sqlstreams.peek($1, 0, 5000)", &[&s.name])
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect();
        assert_eq!(peeked, produced, "{setting} = {parallel}");
    }
    c.batch_execute(&format!("RESET {setting}")).unwrap();
}

/// Seconds from now until `next_due` (None: NULL).
fn due_in(c: &mut Client, g: &Group) -> Option<f64> {
    c.query_one("SELECT extract(epoch FROM sqlstreams.next_due($1, $2) - now())::float8", &[&g.stream.name, &g.name])
        .unwrap()
        .get(0)
}

#[test]
fn next_due_is_when_the_earliest_waiting_work_comes_due() {
    let mut c = connect();
    let s = Stream::create(&mut c, "due");
    let g = s.group(&mut c, "g", Some("ordered"));
    assert_eq!(due_in(&mut c, &g), None, "nothing waits: NULL");
    s.produce_many(&mut c, 3, Some("a"));
    assert_eq!(due_in(&mut c, &g), None, "new messages are NOTIFYed, not timed");

    // A claim under a 10-minute lease: due when the lease (and the lane's hold) runs out.
    let batch = g.try_claim(&mut c, 10, "10 minutes").unwrap();
    assert_eq!(batch.len(), 3);
    let due = due_in(&mut c, &g).expect("a lease runs out");
    assert!((590.0..=600.5).contains(&due), "the lease: {due}");

    // The first fails with a retry in 5 minutes; its successors wait behind it; the rest acked
    // would leave only the retry, but they are parked behind it (ordered), due no later.
    g.fail(&mut c, &batch[0], "later", false, Some("5 minutes"));
    let due = due_in(&mut c, &g).expect("a retry waits");
    assert!((299.0..=300.5).contains(&due), "the retry comes first: {due}");

    // A message delayed by a minute comes due before both.
    let later = g.try_claim(&mut c, 10, "10 minutes").unwrap();
    assert!(later.is_empty(), "key a waits for its retry");
    let lane_a = s.lane(&mut c, "a");
    let b = (0..).map(|i| format!("b{i}")).find(|k| s.lane(&mut c, k) != lane_a).unwrap();
    let other = s.produce(&mut c, json!({}), Some(&b));
    let d = g.try_claim(&mut c, 10, "10 minutes").unwrap();
    assert_eq!(ids(&d), vec![other]);
    g.delay(&mut c, &d[0], "1 minute");
    let due = due_in(&mut c, &g).expect("a delay waits");
    assert!((59.0..=60.5).contains(&due), "the delay comes first: {due}");

    // A paused group has nothing due until it is resumed (which notifies).
    c.query_one("SELECT sqlstreams.pause_group($1, 'g')", &[&s.name]).unwrap();
    assert_eq!(due_in(&mut c, &g), None);
    c.query_one("SELECT sqlstreams.resume_group($1, 'g')", &[&s.name]).unwrap();
    assert!(due_in(&mut c, &g).is_some());

    // Past due is due now: the claim hands it out.
    g.make_due(&mut c);
    assert!(due_in(&mut c, &g).unwrap() <= 0.0);
}

/// An ordered group's stream with one message on each of two keys that share a lane.
fn two_keys_in_one_lane(c: &mut Client, prefix: &str) -> (Stream, Group, i64, i64) {
    let s = Stream::create(c, prefix);
    let g = s.group(c, "g", Some("ordered"));
    let lane_a = s.lane(c, "a");
    let b = (0..).map(|i| format!("b{i}")).find(|k| s.lane(c, k) == lane_a).unwrap();
    let a1 = s.produce(c, json!({}), Some("a"));
    let b1 = s.produce(c, json!({}), Some(&b));
    (s, g, a1, b1)
}

/// A retry due in a lane another delivery holds is due when the hold ends, not now: a claim
/// could not hand it out before (after a crash, the others would claim nothing until their poll
/// interval instead of sleeping until they can take the lane over).
#[test]
fn next_due_counts_a_retry_in_a_held_lane_from_the_end_of_the_hold() {
    let mut c = connect();
    let (s, g, a1, b1) = two_keys_in_one_lane(&mut c, "due-held");
    let batch = g.try_claim(&mut c, 10, "10 minutes").unwrap();
    assert_eq!(ids(&batch), vec![a1, b1], "one lane, both keys");
    // a1's retry is due at once, in the lane b1's delivery holds for ten minutes.
    assert_eq!(g.fail(&mut c, &batch[0], "again", false, Some("0 seconds")).as_deref(), Some("ready"));
    assert!(g.try_claim(&mut c, 10, "10 minutes").unwrap().is_empty(), "the lane is held");
    let due = due_in(&mut c, &g).expect("the hold ends");
    assert!((590.0..=600.5).contains(&due), "due when the hold ends: {due}");

    // The hold runs out (the consumer crashed): due now, and the next claim takes the lane over.
    g.expire_leases(&mut c);
    assert!(due_in(&mut c, &g).unwrap() <= 0.0);
    let again = g.try_claim(&mut c, 10, "10 minutes").unwrap();
    assert_eq!(ids(&again), vec![a1, b1]);

    // A group that holds no lanes (its override is parallel now) may take the retry at once.
    assert_eq!(g.fail(&mut c, &again[0], "again", false, Some("0 seconds")).as_deref(), Some("ready"));
    assert!(due_in(&mut c, &g).unwrap() > 590.0, "held again");
    c.query_one("SELECT sqlstreams.alter_group($1, 'g', concurrency_override => 'parallel')", &[&s.name]).unwrap();
    assert!(due_in(&mut c, &g).unwrap() <= 0.0, "a parallel group does not wait for holds");
    assert_eq!(ids(&g.claim(&mut c, 10)), vec![a1]);
}

/// The same for a retry's delivery whose lease ran out in a lane a later claim holds.
#[test]
fn next_due_counts_an_expired_lease_in_a_held_lane_from_the_end_of_the_hold() {
    let mut c = connect();
    let (_, g, a1, b1) = two_keys_in_one_lane(&mut c, "due-held-expired");
    // Both become retries, delivered again (inflight rows of the queue), and their lease runs out.
    for d in g.claim(&mut c, 10) {
        assert_eq!(g.fail(&mut c, &d, "again", false, Some("0 seconds")).as_deref(), Some("ready"));
    }
    assert_eq!(ids(&g.try_claim(&mut c, 10, "10 minutes").unwrap()), vec![a1, b1]);
    g.expire_leases(&mut c);
    // A claim of one takes a1 and holds the lane for ten minutes; b1's lease has run out.
    assert_eq!(ids(&g.try_claim(&mut c, 1, "10 minutes").unwrap()), vec![a1]);
    assert!(g.try_claim(&mut c, 10, "10 minutes").unwrap().is_empty(), "the lane is held");
    let due = due_in(&mut c, &g).expect("the hold ends");
    assert!((590.0..=600.5).contains(&due), "due when the hold ends: {due}");
}

/// The same for a range: the rest of an expired range that a claim split, in the lane that claim
/// holds, is due when the hold ends, not now (a consumer following the documented loop would
/// claim again at once, for nothing, until then).
#[test]
fn next_due_counts_an_expired_range_in_a_held_lane_from_the_end_of_the_hold() {
    let mut c = connect();
    let (_, g, a1, _) = two_keys_in_one_lane(&mut c, "due-held-range");
    assert_eq!(g.claim(&mut c, 10).len(), 2, "a consumer that dies");
    g.expire_leases(&mut c);
    assert_eq!(ids(&g.try_claim(&mut c, 1, "10 minutes").unwrap()), vec![a1], "the rest is split off");
    assert!(g.try_claim(&mut c, 10, "10 minutes").unwrap().is_empty(), "the lane is held");
    let due = due_in(&mut c, &g).expect("the hold ends");
    assert!((590.0..=600.5).contains(&due), "due when the hold ends: {due}");
}

#[test]
fn next_due_needs_the_right_to_inspect_the_group() {
    let mut c = connect();
    let s = Stream::create(&mut c, "due-rights");
    let g = s.group(&mut c, "g", None);
    let stranger = role(&mut c, "due_stranger", "IN ROLE sqlstreams_consumer");
    let mut other = connect_as(&stranger);
    let err = other.query_one("SELECT sqlstreams.next_due($1, 'g')", &[&s.name]).expect_err("no grant");
    assert_eq!(sqlstate(&err), "42501", "{err}");
    let err = c.query_one("SELECT sqlstreams.next_due($1, 'no-such-group')", &[&s.name]).expect_err("no group");
    assert_eq!(sqlstate(&err), "42704");
    assert_eq!(due_in(&mut c, &g), None);
}

#[test]
fn next_due_passes_over_rows_parked_for_good_behind_a_held_dead_row() {
    let mut c = connect();
    let s = Stream::create(&mut c, "due-hold");
    let g = s.group(&mut c, "g", Some("ordered"));
    c.query_one("SELECT sqlstreams.alter_group($1, 'g', on_dead => 'hold')", &[&s.name]).unwrap();
    s.produce_many(&mut c, 3, Some("k"));
    let first = g.claim(&mut c, 10);
    assert_eq!(ids(&first), vec![1], "one message per ordered key while on_dead holds");
    g.fail(&mut c, &first[0], "poison", true, None);
    assert!(g.claim(&mut c, 10).is_empty(), "the key stops at its dead message");
    // The rows behind it wait for a redrive, skip or purge (which notify), not for a time.
    assert_eq!(due_in(&mut c, &g), None);
}

/// The log is keyed by lane and id, with no index on the id alone: `peek` merges the lanes of
/// each window of ids, so it returns every message after a position in id order, over keys in
/// every lane and past gaps wider than its window that rolled-back producers left.
#[test]
fn peek_merges_every_lane_in_id_order_across_gaps() {
    let mut c = connect();
    let s = Stream::create(&mut c, "peek-lanes");
    let mut produced = Vec::new();
    for round in 0..4 {
        for k in 0..40 {
            produced.push(s.produce(&mut c, json!({ "k": k }), Some(&format!("key-{k}"))));
        }
        produced.extend(s.produce_many(&mut c, 30, None));
        let mut tx = c.transaction().unwrap();
        s.produce_many(&mut tx, 400 * (round + 1), None);
        tx.rollback().unwrap();
    }
    let lanes: i64 =
        c.query_one(&format!("SELECT count(DISTINCT lane) FROM {}", s.table("message_log")), &[]).unwrap().get(0);
    assert!(lanes > 8, "the keys are in {lanes} lanes");
    for after in [0, produced[3], produced[69], produced[200]] {
        for limit in [1, 7, 100, 10_000] {
            let peeked: Vec<i64> = c
                .query("SELECT message_id FROM sqlstreams.peek($1, $2, $3)", &[&s.name, &after, &limit])
                .unwrap()
                .iter()
                .map(|r| r.get(0))
                .collect();
            let expected: Vec<i64> = produced.iter().copied().filter(|&id| id > after).take(limit as usize).collect();
            assert_eq!(peeked, expected, "after {after}, at most {limit}");
        }
    }
}

/// `group_status.oldest_unresolved_at` is when the first message after the group's committed
/// position was produced, wherever that message is: at the start of an open range, of an
/// exception row, of a lane's unclaimed messages, or past a rolled-back producer's gap with
/// keyed messages in other lanes (the log is keyed by lane and id: each is found another way).
#[test]
fn oldest_unresolved_at_is_the_first_unresolved_messages_wherever_it_is() {
    let mut c = connect();
    let s = Stream::create(&mut c, "oldest");
    let g = s.group(&mut c, "g", Some("ordered"));
    let check = |c: &mut Client, case: &str| {
        let row = c
            .query_one("SELECT committed, oldest_unresolved_at FROM sqlstreams.group_status($1, 'g')", &[&s.name])
            .unwrap();
        let (committed, at): (i64, Option<std::time::SystemTime>) = (row.get(0), row.get(1));
        let expected: Option<std::time::SystemTime> = c
            .query_opt(
                &format!("SELECT produced_at FROM {} WHERE id > $1 ORDER BY id LIMIT 1", s.table("message_log")),
                &[&committed],
            )
            .unwrap()
            .map(|r| r.get(0));
        assert_eq!(at, expected, "{case} (committed {committed})");
        at
    };
    // One transaction each, so every message has a time of its own.
    let produce = |c: &mut Client, n: usize| {
        for k in 0..n {
            s.produce(c, json!({}), Some(&format!("key-{k}")));
        }
    };
    produce(&mut c, 12);
    assert!(check(&mut c, "nothing claimed yet").is_some());
    let first = g.claim(&mut c, 3);
    assert!(!first.is_empty());
    check(&mut c, "an open range");
    g.fail(&mut c, &first[0], "later", false, Some("1 hour"));
    g.ack_batch(&mut c, &first[1..]);
    check(&mut c, "an exception row");
    loop {
        let batch = g.claim(&mut c, 100);
        if batch.is_empty() {
            break;
        }
        g.ack_batch(&mut c, &batch);
    }
    check(&mut c, "a retry waiting, the rest acked");
    let mut tx = c.transaction().unwrap();
    s.produce_many(&mut tx, 50, None);
    tx.rollback().unwrap();
    produce(&mut c, 6);
    check(&mut c, "new keyed messages past a gap");
    g.claim(&mut c, 1);
    check(&mut c, "the lanes' first unclaimed messages");
}

/// `peek` reads about as many rows and index entries as it returns, past a gap too: each window
/// of ids is twice as wide as the rows still wanted, and one that ends in a gap goes on from the
/// next message. (A window widened by the gap's sparseness once read every lane's share of a
/// dense stretch: about 16,000 rows for these 1,000.)
#[test]
fn peek_reads_about_the_rows_it_returns_after_a_gap() {
    let mut c = connect();
    let s = Stream::create(&mut c, "peek-cost");
    s.produce(&mut c, json!({}), Some("a"));
    let mut tx = c.transaction().unwrap();
    s.produce_many(&mut tx, 998, None);
    tx.rollback().unwrap();
    c.query_one(
        "SELECT count(*) FROM sqlstreams.produce_batch($1, array(SELECT '{}'::jsonb FROM generate_series(1, 100000)),
                                                       array(SELECT 'k' || g FROM generate_series(1, 100000) g))",
        &[&s.name],
    )
    .unwrap();
    // A backend of its own: its counts hold nothing of the producing above (a backend's counts
    // include what it has not reported yet).
    let mut reader = connect();
    let mut tx = reader.transaction().unwrap();
    let peeked: i64 = tx.query_one("SELECT count(*) FROM sqlstreams.peek($1, 0, 1000)", &[&s.name]).unwrap().get(0);
    assert_eq!(peeked, 1000);
    let fetched: i64 = tx
        .query_one(
            "SELECT coalesce(sum(idx_tup_fetch), 0)::int8 FROM pg_stat_xact_user_tables WHERE relid = $1::text::regclass",
            &[&format!("{}_p0", s.table("message_log"))],
        )
        .unwrap()
        .get(0);
    assert!(fetched <= 2_100, "a peek of 1,000 fetched {fetched} rows");
    // Each lane's scan stops at the window's end: with a row comparison as the bound, a scan on
    // PostgreSQL 15 to 17 read on through the lane's later entries (about 500 index pages here,
    // 74 now).
    let pages = index_pages_read(&mut tx, &format!("{}_p0", s.table("message_log")));
    assert!(pages <= 200, "a peek of 1,000 read {pages} index pages");
    tx.rollback().unwrap();
}

/// A restore loads a stream's tables one after another, each table's rows before its primary
/// key: maintenance run in between, while the open ranges are not loaded yet, would store the
/// group's cursor past them for good, and retention would drop their messages. It leaves the
/// stream alone, with a warning, until every table that says what a group still needs has its
/// key; then it goes on, and the range's messages are still needed.
#[test]
fn maintenance_waits_for_a_restore_to_load_what_groups_still_need() {
    let (mut c, warnings) = connect_listening();
    let s = Stream::create(&mut c, "restore-midway");
    let g = s.group(&mut c, "g", None);
    let produced = s.produce_many(&mut c, 3, None);
    let held = g.claim(&mut c, 10);
    assert_eq!(ids(&held), produced);
    let maintain = |c: &mut Client| {
        c.query("SELECT * FROM sqlstreams.maintain_stream($1)", &[&s.name]).unwrap();
    };
    maintain(&mut c);
    let before = g.stored_cursor(&mut c).1;
    assert!(before < produced[0], "the open range holds the cursor: {before}");

    // Halfway through the restore: the ranges' table is there, its rows and key not yet.
    let ranges = s.table("range_lease");
    c.batch_execute(&format!(
        "CREATE TEMP TABLE loading AS SELECT * FROM {ranges};
         DELETE FROM {ranges};
         ALTER TABLE {ranges} DROP CONSTRAINT range_lease_{}_pkey",
        s.id
    ))
    .unwrap();
    // A consumer's first claim in a session that hands something out runs a retention step; it
    // leaves the stream alone too.
    let later = s.produce(&mut c, json!({}), None);
    assert_eq!(ids(&g.claim(&mut connect(), 10)), vec![later]);
    assert_eq!(g.stored_cursor(&mut c).1, before, "a claim's step stored nothing past the range being loaded");
    warnings.lock().unwrap().clear();
    maintain(&mut c);
    assert_eq!(g.stored_cursor(&mut c).1, before, "not stored past the range being loaded");
    let said = warnings.lock().unwrap().clone();
    assert!(
        said.iter().any(|w| w.contains(&format!("range_lease_{} has no primary key yet", s.id))),
        "the warning names the table: {said:?}"
    );

    // The restore goes on: the rows, then the key. Maintenance goes on too.
    c.batch_execute(&format!(
        "INSERT INTO {ranges} SELECT * FROM loading;
         ALTER TABLE {ranges} ADD PRIMARY KEY (consumer_group_id, first_id)"
    ))
    .unwrap();
    maintain(&mut c);
    assert_eq!(g.stored_cursor(&mut c).1, before, "the range still holds the cursor");
    assert_eq!(g.ack_batch(&mut c, &held), produced);
    maintain(&mut c);
    assert_eq!(g.stored_cursor(&mut c).1, produced[2], "resolved: stored, up to the later message's range");
}

/// The same for what else a restore loads apart: a partition of the log whose rows are not
/// there yet (the group would look as if it had read past them), and the catalog's row of a
/// group whose cursor is there (without it, maintenance would fold the group's exception counts
/// away and purge its archived dead letters).
#[test]
fn maintenance_waits_for_a_restore_to_load_the_log_and_the_catalog() {
    let (mut c, warnings) = connect_listening();
    let s = Stream::create(&mut c, "restore-midway-log");
    let g = s.group(&mut c, "g", None);
    let d = {
        s.produce(&mut c, json!({}), None);
        g.claim(&mut c, 1).pop().unwrap()
    };
    assert_eq!(g.fail(&mut c, &d, "broken", true, None).as_deref(), Some("dead"));
    let waiting = s.produce_many(&mut c, 3, None);
    let maintain = |c: &mut Client| {
        c.query("SELECT * FROM sqlstreams.maintain_stream($1)", &[&s.name]).unwrap();
    };
    let dead = |c: &mut Client| -> i64 {
        c.query_one("SELECT dead FROM sqlstreams.group_status($1, 'g')", &[&s.name]).unwrap().get(0)
    };
    maintain(&mut c);
    let before = g.stored_cursor(&mut c).1;
    assert!(before < waiting[0], "{before}");

    // The log's rows not loaded yet, nor its keys.
    let log = s.table("message_log");
    c.batch_execute(&format!(
        "CREATE TEMP TABLE loading_log AS SELECT * FROM {log};
         DELETE FROM {log};
         ALTER TABLE {log} DROP CONSTRAINT message_log_{}_pkey",
        s.id
    ))
    .unwrap();
    warnings.lock().unwrap().clear();
    maintain(&mut c);
    assert_eq!(g.stored_cursor(&mut c).1, before, "not stored past messages being loaded");
    let said = warnings.lock().unwrap().clone();
    assert!(
        said.iter().any(|w| w.contains(&format!("message_log_{}_p", s.id)) && w.contains("no primary key yet")),
        "{said:?}"
    );
    c.batch_execute(&format!(
        "INSERT INTO {log} SELECT * FROM loading_log;
         ALTER TABLE {log} ADD PRIMARY KEY (lane, id)"
    ))
    .unwrap();

    // The group's catalog row not loaded yet.
    c.batch_execute(&format!(
        "CREATE TEMP TABLE loading_group AS SELECT * FROM sqlstreams.consumer_group WHERE id = {id};
         DELETE FROM sqlstreams.consumer_group WHERE id = {id}",
        id = g.id
    ))
    .unwrap();
    warnings.lock().unwrap().clear();
    maintain(&mut c);
    let said = warnings.lock().unwrap().clone();
    assert!(said.iter().any(|w| w.contains("sqlstreams.consumer_group has no row yet")), "{said:?}");
    c.batch_execute("INSERT INTO sqlstreams.consumer_group OVERRIDING SYSTEM VALUE SELECT * FROM loading_group")
        .unwrap();
    maintain(&mut c);
    assert_eq!(dead(&mut c), 1, "the group's dead letter is still counted");
    assert_eq!(ids(&g.claim(&mut c, 10)), waiting, "and its messages are all there");
}

/// Every table of the extension, a stream's family included, can be updated and deleted from under
/// a `FOR ALL TABLES` publication (change data capture, a migration by logical replication):
/// Postgres refuses both on a table that publishes them and has no replica identity, and a table
/// without a key (the exception counts, the grants) has none unless it is `FULL`. Checked for each
/// table by name, so a table added later without either fails here, and by doing what writes them:
/// a claim's retention step folds the counts, `fail` writes them at commit, `revoke_stream` and
/// `drop_stream` delete grants.
#[test]
fn a_publication_for_all_tables_refuses_none_of_the_extensions_writes() {
    let (mut c, _url) = own_database("publication");
    // wal_level need not be logical: the refusal comes with the publication, whatever it is.
    c.batch_execute("SET client_min_messages = error; CREATE PUBLICATION everything FOR ALL TABLES").unwrap();
    let s = Stream::create(&mut c, "published");
    let g = s.group(&mut c, "g", Some("ordered"));
    let keyless: Vec<String> = c
        .query(
            "SELECT c.relname::text FROM pg_class c
             WHERE c.relnamespace = 'sqlstreams'::regnamespace AND c.relkind = 'r'
               AND NOT (c.relreplident = 'f'
                        OR (c.relreplident = 'd' AND EXISTS (SELECT FROM pg_index i WHERE i.indrelid = c.oid AND i.indisprimary))
                        OR (c.relreplident = 'i' AND EXISTS (SELECT FROM pg_index i WHERE i.indrelid = c.oid AND i.indisreplident)))
             ORDER BY 1",
            &[],
        )
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect();
    assert_eq!(keyless, Vec::<String>::new(), "tables a FOR ALL TABLES publication refuses to update");

    let reader = role(&mut c, "publication_reader", "");
    c.execute("SELECT sqlstreams.grant_stream($1, $2, 'consume', 'g')", &[&s.name, &reader]).unwrap();
    let first = s.produce(&mut c, serde_json::json!({"n": 1}), Some("k"));
    let second = s.produce(&mut c, serde_json::json!({"n": 2}), Some("k"));
    let batch = g.claim(&mut c, 10);
    assert_eq!(batch.iter().map(|d| d.message_id).collect::<Vec<_>>(), vec![first, second]);
    assert_eq!(g.fail(&mut c, &batch[0], "boom", false, Some("0 seconds")).as_deref(), Some("ready"));
    // The retry, and the key's next message chained behind it.
    let retried = g.claim(&mut c, 10);
    assert_eq!(retried.iter().map(|d| d.message_id).collect::<Vec<_>>(), vec![first, second]);
    assert!(g.ack(&mut c, &retried[0]));
    assert!(g.ack(&mut c, &retried[1]));
    assert!(g.claim(&mut c, 10).is_empty());
    let status: (i64, i64) = {
        let row = c
            .query_one("SELECT ready + inflight + deferred, dead FROM sqlstreams.group_status($1, 'g')", &[&s.name])
            .unwrap();
        (row.get(0), row.get(1))
    };
    assert_eq!(status, (0, 0), "the counts after the retry resolved");
    c.execute("SELECT sqlstreams.maintain_stream($1)", &[&s.name]).unwrap();
    c.execute("SELECT sqlstreams.revoke_stream($1, $2, 'consume', 'g')", &[&s.name, &reader]).unwrap();
    c.execute("SELECT sqlstreams.drop_stream($1)", &[&s.name]).unwrap();
    c.batch_execute(&format!("DROP ROLE {reader}")).unwrap();
}

/// `create_group` is a declaration: what it is not given goes back to its default. A declaration
/// that changes an existing group says so in a notice naming each change (a consumer declaring
/// the group with fewer arguments than the others would otherwise make an ordered group parallel
/// without a word); one that changes nothing, or creates the group, says nothing.
#[test]
fn a_declaration_that_changes_a_group_says_what_it_changed() {
    let (mut c, notices) = connect_listening();
    let s = Stream::create(&mut c, "redeclared");
    notices.lock().unwrap().clear();
    let declare = "SELECT sqlstreams.create_group($1, 'g', 'ordered', max_retries => 5, backoff_base => '2 seconds')";
    c.query_one(declare, &[&s.name]).unwrap();
    // The same settings again fire no trigger of the catalog's (each invalidates what every backend
    // remembers), counted by the transaction's function statistics.
    let mut tx = c.transaction().unwrap();
    tx.batch_execute("SET LOCAL track_functions = 'all'").unwrap();
    tx.query_one(declare, &[&s.name]).unwrap();
    let fired: i64 = tx
        .query_one(
            "SELECT coalesce(pg_stat_get_xact_function_calls('sqlstreams.catalog_changed()'::regprocedure), 0)",
            &[],
        )
        .unwrap()
        .get(0);
    tx.commit().unwrap();
    assert_eq!(fired, 0, "the same settings again change nothing of the catalog");
    assert_eq!(*notices.lock().unwrap(), Vec::<String>::new(), "a new group, and the same settings again");

    // Whatever the session's interval style: the changes are written as the arguments can be.
    c.batch_execute("SET IntervalStyle = 'iso_8601'").unwrap();
    c.query_one("SELECT sqlstreams.create_group($1, 'g')", &[&s.name]).unwrap();
    assert_eq!(
        std::mem::take(&mut *notices.lock().unwrap()),
        vec![format!(
            "sqlstreams: consumer group \"g\" of stream \"{}\" declared again, with other settings: \
             concurrency_override 'ordered' to NULL, max_retries 5 to 3, backoff_base 2 seconds to 1 second [00000] \
             HINT: create_group sets every setting it is not given to its default; alter_group changes only the \
             settings it is given.",
            s.name
        )]
    );
    let now: Option<String> = c
        .query_one("SELECT concurrency_override FROM sqlstreams.consumer_groups WHERE stream = $1", &[&s.name])
        .unwrap()
        .get(0);
    assert_eq!(now, None, "the declaration changed what it said");
}

/// Two consumers declaring a new group at once with other settings: the second waits for the
/// first's insert to commit, then finds its row and says what it changes.
#[test]
fn a_declaration_beside_the_one_that_creates_the_group_says_what_it_changed() {
    let mut c = connect();
    let s = Stream::create(&mut c, "declared-twice");
    let mut first = connect();
    let mut tx = first.transaction().unwrap();
    tx.query_one("SELECT sqlstreams.create_group($1, 'g', 'exclusive')", &[&s.name]).unwrap();
    let (mut second, notices) = connect_listening();
    notices.lock().unwrap().clear();
    let pid: i32 = second.query_one("SELECT pg_backend_pid()", &[]).unwrap().get(0);
    let name = s.name.clone();
    let declaring = std::thread::spawn(move || {
        second.query_one("SELECT sqlstreams.create_group($1, 'g')", &[&name]).unwrap();
    });
    // The second declaration waits for the first transaction: proven in pg_locks, not by a pause.
    let waiting = "SELECT EXISTS (SELECT FROM pg_locks WHERE pid = $1 AND NOT granted)";
    while !c.query_one(waiting, &[&pid]).unwrap().get::<_, bool>(0) {
        assert!(!declaring.is_finished(), "the second declaration did not wait for the first");
        std::thread::yield_now();
    }
    tx.commit().unwrap();
    declaring.join().unwrap();
    let said = notices.lock().unwrap().clone();
    assert_eq!(said.len(), 1, "{said:?}");
    assert!(said[0].contains("concurrency_override 'exclusive' to NULL"), "{said:?}");
}
