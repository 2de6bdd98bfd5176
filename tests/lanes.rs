//! Lanes: where messages go, and how competing claims divide them (src/lanes.rs).

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use postgres::Client;
use sqlstreams_tests::postgres::fallible_iterator::FallibleIterator;
use sqlstreams_tests::*;

/// Keys, one per lane of a 16-lane stream, found through the stream's own lane function.
fn one_key_per_lane(c: &mut Client, s: &Stream) -> Vec<String> {
    let mut by_lane: HashMap<i32, String> = HashMap::new();
    for i in 0.. {
        let key = format!("account-{i}");
        by_lane.entry(s.lane(c, &key)).or_insert(key);
        if by_lane.len() == 16 {
            break;
        }
    }
    let mut keys: Vec<(i32, String)> = by_lane.into_iter().collect();
    keys.sort();
    keys.into_iter().map(|(_, k)| k).collect()
}

#[test]
fn every_message_of_a_key_is_in_one_lane_and_keyless_messages_spread() {
    let mut c = connect();
    let s = Stream::create(&mut c, "lane-placement");
    for i in 0..300 {
        let key = format!("k{}", i % 37);
        s.produce(&mut c, json!({}), Some(&key));
    }
    s.produce_many(&mut c, 640, None);
    let rows = c
        .query(
            &format!(
                "SELECT message_key, lane, sqlstreams.lane(message_key, id, 16) AS expected FROM {} ORDER BY id",
                s.table("message_log")
            ),
            &[],
        )
        .unwrap();
    let mut lanes_of_key: HashMap<String, HashSet<i32>> = HashMap::new();
    let mut keyless_lanes = HashSet::new();
    for r in &rows {
        let (key, lane, expected): (Option<String>, i32, i32) = (r.get(0), r.get(1), r.get(2));
        assert_eq!(lane, expected, "the stored lane is the lane function's");
        assert!((0..16).contains(&lane));
        match key {
            Some(k) => {
                lanes_of_key.entry(k).or_default().insert(lane);
            }
            None => {
                keyless_lanes.insert(lane);
            }
        }
    }
    assert!(lanes_of_key.values().all(|l| l.len() == 1), "every key in exactly one lane");
    let used: HashSet<i32> = lanes_of_key.values().flatten().copied().collect();
    assert!(used.len() >= 12, "37 keys spread over the lanes, not a few: {used:?}");
    assert!(keyless_lanes.len() >= 10, "640 keyless messages in blocks of 64 cover ten lanes: {keyless_lanes:?}");

    let single = Stream::create(&mut c, "one-lane");
    c.execute("SELECT sqlstreams.create_stream($1, lanes => 1)", &[&format!("{}-1", single.name)]).unwrap();
    let one = Stream { name: format!("{}-1", single.name), id: 0 };
    assert_eq!(one.lane(&mut c, "anything"), 0);
}

#[test]
fn one_claim_fills_its_batch_from_many_lanes() {
    let mut c = connect();
    let s = Stream::create(&mut c, "lane-fill");
    let g = s.group(&mut c, "g", Some("ordered"));
    let keys = one_key_per_lane(&mut c, &s);
    let ids: Vec<i64> = keys.iter().map(|k| s.produce(&mut c, json!({}), Some(k))).collect();
    let batch = g.claim(&mut c, 100);
    assert_eq!(self::ids(&batch), ids, "one consumer alone drains every lane, in one claim");
    let held: i64 = c
        .query_one(&format!("SELECT count(*) FROM {} WHERE held_by IS NOT NULL", s.table("lane")), &[])
        .unwrap()
        .get(0);
    assert_eq!(held, 16, "an ordered claim holds each lane it handed out a key from");
    g.ack_batch(&mut c, &batch);
    let held: i64 = c
        .query_one(&format!("SELECT count(*) FROM {} WHERE held_by IS NOT NULL", s.table("lane")), &[])
        .unwrap()
        .get(0);
    assert_eq!(held, 0, "resolving everything frees every lane");
}

#[test]
fn a_claim_leaves_the_other_consumers_their_share_of_the_lanes() {
    let mut c = connect();
    let mut b = connect();
    let s = Stream::create(&mut c, "lane-share");
    let g = s.group(&mut c, "g", Some("exclusive"));
    let keys = one_key_per_lane(&mut c, &s);
    for k in &keys {
        s.produce(&mut c, json!({}), Some(k));
    }
    // Consumer A holds one lane; B's claim may take half of the lanes (16 / 2 claims holding).
    let a = g.claim(&mut c, 1);
    assert_eq!(a.len(), 1);
    let lanes_of = |c: &mut Client, batch: &[Delivery]| -> HashSet<i32> {
        batch.iter().map(|d| s.lane(c, d.message_key.as_deref().unwrap())).collect()
    };
    let first = g.claim(&mut b, 100);
    assert_eq!(lanes_of(&mut c, &first).len(), 8, "B takes its share, not every free lane");
    // A third claim (two claims hold lanes now) gets a third of them, rounded up, of what is left.
    let mut third = connect();
    let rest = g.claim(&mut third, 100);
    assert_eq!(lanes_of(&mut c, &rest).len(), 6);
    let a_lanes = lanes_of(&mut c, &a);
    let (b_lanes, t_lanes) = (lanes_of(&mut c, &first), lanes_of(&mut c, &rest));
    assert!(a_lanes.is_disjoint(&b_lanes) && a_lanes.is_disjoint(&t_lanes) && b_lanes.is_disjoint(&t_lanes));
    // When the others are done, one consumer alone drains what is left.
    g.ack_batch(&mut b, &first);
    g.ack_batch(&mut third, &rest);
    g.ack_batch(&mut c, &a);
    assert_eq!(g.claim(&mut c, 100).len(), 1, "the last lane with work");
}

/// A message costs its producer one index entry: the log's only index is its key, (lane, id),
/// on the log and on every partition (a second index on the id alone cost each message about 70
/// bytes of WAL and a btree insert).
#[test]
fn the_log_has_one_index_its_key_of_lane_and_id() {
    let mut c = connect();
    let s = Stream::create(&mut c, "one-index");
    s.produce_many(&mut c, 10, Some("k"));
    for table in [s.table("message_log"), format!("{}_p0", s.table("message_log"))] {
        let indexes: Vec<String> = c
            .query(
                "SELECT regexp_replace(pg_get_indexdef(indexrelid), '^.* USING ', '') || CASE WHEN indisprimary THEN ' primary' ELSE '' END
                 FROM pg_index WHERE indrelid = $1::text::regclass",
                &[&table],
            )
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect();
        assert_eq!(indexes, ["btree (lane, id) primary"], "{table}");
    }
}

/// Log partitions (tables, not their indexes) this session holds a lock on.
fn partitions_locked(tx: &mut postgres::Transaction<'_>, s: &Stream) -> i64 {
    tx.query_one(
        "SELECT count(*) FROM pg_locks l JOIN pg_class c ON c.oid = l.relation
         WHERE l.pid = pg_backend_pid() AND c.relkind = 'r' AND c.relname LIKE $1",
        &[&format!("message_log\\_{}\\_p%", s.id)],
    )
    .unwrap()
    .get(0)
}

/// Consumed partitions that are kept (a group that has not read them yet, or retention not
/// caught up) cost a claim nothing: it opens the partitions it reads, not every partition of
/// the log, whose locks every claim would otherwise take.
#[test]
fn a_claim_opens_only_the_partitions_it_reads() {
    let mut c = connect();
    let s = Stream::create_sized(&mut c, "kept-partitions", 1000);
    let g = s.group(&mut c, "g", None);
    let _behind = s.group(&mut c, "behind", None); // keeps every partition from retention
    for _ in 0..30 {
        s.produce_many(&mut c, 1000, None);
        loop {
            let batch = g.claim(&mut c, 1000);
            if batch.is_empty() {
                break;
            }
            g.ack_batch(&mut c, &batch);
        }
    }
    let fresh = s.produce_many(&mut c, 100, None);
    let mut tx = c.transaction().unwrap();
    let partitions: i64 = tx
        .query_one(
            "SELECT count(*) FROM pg_inherits WHERE inhparent = $1::text::regclass",
            &[&format!("sqlstreams.message_log_{}", s.id)],
        )
        .unwrap()
        .get(0);
    assert!(partitions >= 31, "the stream keeps its consumed partitions ({partitions})");
    let claimed: Vec<i64> = tx
        .query("SELECT message_id FROM sqlstreams.claim($1, 'g', 100) ORDER BY message_id", &[&s.name])
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(claimed, fresh);
    let locked = partitions_locked(&mut tx, &s);
    assert!(locked <= 2, "a claim of 100 new messages locked {locked} of {partitions} partitions");
    tx.rollback().unwrap();
}

/// A lane with nothing new is moved up to the safe head by the claims that probe it once the
/// head is in a later partition, so no claim probes the partitions it skipped again; messages
/// that come later in that lane, and every message after a seek back, are still delivered.
#[test]
fn empty_lanes_move_up_with_the_head_and_lose_nothing() {
    let mut c = connect();
    let s = Stream::create_sized(&mut c, "empty-lanes", 1000);
    let g = s.group(&mut c, "g", Some("ordered"));
    let keys = one_key_per_lane(&mut c, &s);
    let drain = |c: &mut Client| {
        let mut delivered = Vec::new();
        loop {
            let batch = g.claim(c, 1000);
            if batch.is_empty() {
                return delivered;
            }
            g.ack_batch(c, &batch);
            delivered.extend(batch.iter().map(|d| d.message_id));
        }
    };
    let mut delivered = Vec::new();
    // Five partitions of one key: fifteen lanes have nothing.
    let mut produced = Vec::new();
    for _ in 0..5 {
        produced.extend(s.produce_many(&mut c, 1000, Some(&keys[0])));
        delivered.extend(drain(&mut c));
    }
    let behind: i64 =
        c.query_one(&format!("SELECT count(*) FROM {} WHERE claimed < 4000", s.table("lane")), &[]).unwrap().get(0);
    assert_eq!(behind, 0, "every lane is in the head's partition");
    // Now idle: a claim writes nothing.
    let mut tx = c.transaction().unwrap();
    assert!(tx.query("SELECT * FROM sqlstreams.claim($1, 'g', 10)", &[&s.name]).unwrap().is_empty());
    let xid: Option<String> = tx.query_one("SELECT pg_current_xact_id_if_assigned()::text", &[]).unwrap().get(0);
    assert_eq!(xid, None, "an idle claim takes no transaction id");
    tx.commit().unwrap();
    // Every other lane gets a message, in the next partition.
    for key in &keys[1..] {
        produced.push(s.produce(&mut c, json!({}), Some(key)));
    }
    delivered.extend(drain(&mut c));
    delivered.sort();
    assert_eq!(delivered, produced);
    // Back to the start: everything again, the lanes moved up included.
    c.execute("SELECT sqlstreams.seek($1, 'g', 0)", &[&s.name]).unwrap();
    let mut again = drain(&mut c);
    again.sort();
    assert_eq!(again, produced);
}

/// A second claim in a transaction reads a partition another transaction attached after the
/// first claim looked for it and found none: the safe head was past ids that produced nothing (an
/// idempotency key used again), in a partition no producer had needed yet. Claims of one
/// transaction hold the log's lock from the first, so the catalog's invalidations are not read
/// when the second takes it again: a stale "no such partition" would pass its messages over for
/// good (a lane found empty up to a safe head in a later partition is moved past them).
#[test]
fn a_second_claim_in_a_transaction_reads_a_partition_attached_since() {
    let mut c = connect();
    let mut producer = connect();
    let s = Stream::create_sized(&mut c, "attached-since", 1000);
    let g = s.group(&mut c, "g", Some("parallel"));
    let produce_once = "SELECT sqlstreams.produce($1, '{}', 'a', idempotency_key => 'once')";
    let first: i64 = producer.query_one(produce_once, &[&s.name]).unwrap().get(0);
    let mut produced = vec![first];
    for _ in 0..1500 {
        let id: Option<i64> = producer.query_one(produce_once, &[&s.name]).unwrap().get(0);
        assert_eq!(id, None, "a used idempotency key takes an id and produces nothing");
    }
    // The claim would create partitions ahead of the head; it leaves that to whoever holds the
    // stream's row.
    let mut creating = connect();
    let mut creating = creating.transaction().unwrap();
    creating.execute("SELECT 1 FROM sqlstreams.stream WHERE id = $1 FOR NO KEY UPDATE", &[&s.id]).unwrap();
    let mut consumer = connect(); // a session of its own: one that made the stream has it cached
    let mut tx = consumer.transaction().unwrap();
    let claim = "SELECT message_id, lease_token FROM sqlstreams.claim($1, 'g', 100)";
    let mut delivered: Vec<(i64, uuid::Uuid)> =
        tx.query(claim, &[&s.name]).unwrap().iter().map(|r| (r.get(0), r.get(1))).collect();
    assert_eq!(delivered.iter().map(|(id, _)| *id).collect::<Vec<_>>(), produced);
    creating.rollback().unwrap();
    // One message in partition 1 (created now), then, past ids that produce nothing, one in
    // partition 2 of another key.
    produced.push(producer.query_one("SELECT sqlstreams.produce($1, '{}', 'zz')", &[&s.name]).unwrap().get(0));
    for _ in 0..600 {
        producer.query_one(produce_once, &[&s.name]).unwrap();
    }
    produced.push(producer.query_one("SELECT sqlstreams.produce($1, '{}', 'a')", &[&s.name]).unwrap().get(0));
    assert_eq!(produced[1..], [1502, 2103]);
    delivered.extend(tx.query(claim, &[&s.name]).unwrap().iter().map(|r| (r.get::<_, i64>(0), r.get(1))));
    for (id, token) in &delivered {
        tx.execute("SELECT sqlstreams.ack($1, 'g', $2, $3)", &[&s.name, token, id]).unwrap();
    }
    tx.commit().unwrap();
    let mut ids: Vec<i64> = delivered.iter().map(|(id, _)| *id).collect();
    ids.extend(g.drain(&mut c));
    ids.sort();
    assert_eq!(ids, produced, "every message once, none passed over");
}

/// Claims probe lanes for messages as they reach them, a few at a time; a lane reached with other
/// work (a due retry) whose position is in an earlier partition than the safe head is probed too,
/// and every lane found empty there moves up. Nothing is passed over.
#[test]
fn lanes_probed_as_claims_reach_them_move_up_and_lose_nothing() {
    let mut c = connect();
    let s = Stream::create_sized(&mut c, "lazy-probe", 1000);
    let g = s.group(&mut c, "g", Some("parallel"));
    let keys = one_key_per_lane(&mut c, &s);
    // One message in each lane, all in partition 0; lane 5's waits for its retry.
    let mut produced: Vec<i64> = keys.iter().map(|k| s.produce(&mut c, json!({}), Some(k))).collect();
    let first = g.claim(&mut c, 100);
    assert_eq!(ids(&first), produced);
    for (lane, d) in first.iter().enumerate() {
        if lane == 5 {
            assert_eq!(g.fail(&mut c, d, "again", false, Some("0 seconds")).as_deref(), Some("ready"));
        } else {
            assert!(g.ack(&mut c, d));
        }
    }
    // Lane 6 fills partitions 0 to 2; lane 4 gets one message in partition 2.
    produced.extend(s.produce_many(&mut c, 2000, Some(&keys[6])));
    produced.push(s.produce(&mut c, json!({}), Some(&keys[4])));
    let one = g.claim(&mut c, 1);
    assert_eq!(ids(&one), vec![produced[produced.len() - 1]], "lanes 0 to 3 have nothing new; lane 4 does");
    let busy = s.lane(&mut c, &keys[6]);
    let positions: Vec<(i32, i64)> = c
        .query(&format!("SELECT lane, claimed FROM {} WHERE lane <> $1 ORDER BY lane", s.table("lane")), &[&busy])
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert!(
        positions.iter().all(|&(_, claimed)| claimed >= 2000),
        "every lane but lane 6 is in the safe head's partition, lane 5 (a due retry) included: {positions:?}"
    );
    g.ack_batch(&mut c, &one);
    let mut delivered = ids(&one);
    delivered.extend(g.drain(&mut c));
    delivered.sort();
    let mut expected = produced[16..].to_vec();
    expected.push(produced[5]); // the retry
    expected.sort();
    assert_eq!(delivered, expected);
}

/// One claim on `c` in a transaction of its own: the ids it handed out, its lease token, and how
/// often it scanned the stream's open ranges (the table or an index of it).
fn claim_counting_range_scans(c: &mut Client, s: &Stream, g: &Group) -> (Vec<i64>, uuid::Uuid, i64) {
    let range = s.table("range_lease");
    let mut tx = c.transaction().unwrap();
    let before = scans(&mut tx, &range);
    let rows =
        tx.query("SELECT message_id, lease_token FROM sqlstreams.claim($1, $2, 10)", &[&s.name, &g.name]).unwrap();
    let after = scans(&mut tx, &range);
    tx.commit().unwrap();
    (rows.iter().map(|r| r.get(0)).collect(), rows[0].get(1), after - before)
}

/// The key gate looks for a key's messages pending in other claims' ranges only in the lanes the
/// claim took, where a key's messages are: another consumer's open range in another lane, there
/// beside every claim of a busy group, costs an ordered claim no look at the ranges.
#[test]
fn an_ordered_claim_beside_another_lanes_open_range_reads_the_ranges_as_if_alone() {
    let mut c = connect();
    let mut other = connect();
    let s = Stream::create(&mut c, "gate-lanes");
    let g = s.group(&mut c, "g", Some("ordered"));
    let keys = one_key_per_lane(&mut c, &s);
    let (a, b) = (keys[0].as_str(), keys[1].as_str());

    let first = s.produce_many(&mut c, 1, Some(b));
    let (got, token, alone) = claim_counting_range_scans(&mut c, &s, &g);
    assert_eq!(got, first);
    c.execute("SELECT sqlstreams.ack_batch($1, $2, $3, $4)", &[&s.name, &g.name, &token, &got]).unwrap();

    // Another consumer holds lane a, with its range open.
    let theirs = s.produce_many(&mut c, 1, Some(a));
    assert_eq!(ids(&g.claim(&mut other, 10)), theirs);
    let second = s.produce_many(&mut c, 1, Some(b));
    let (got, _, beside) = claim_counting_range_scans(&mut c, &s, &g);
    assert_eq!(got, second, "key b's next message runs: nothing of b is open elsewhere");
    assert_eq!(beside, alone, "the claim read the open ranges as often as when no other range was open");
}

/// `VACUUM`s the stream's tables of transient rows (ranges, outcomes, exception rows), which
/// then record what they hold now; returns their names.
fn vacuum_transient(c: &mut Client, s: &Stream) -> [String; 3] {
    let transient = [s.table("range_lease"), s.table("range_done"), s.table("exception_queue")];
    for table in &transient {
        c.batch_execute(&format!("VACUUM {table}")).unwrap();
    }
    transient
}

/// Scans of `relation` itself in the transaction so far: a table's sequential scans, or an
/// index's scans (`scans` counts a table's and its indexes' together).
fn own_scans(c: &mut impl postgres::GenericClient, relation: &str) -> i64 {
    c.query_one("SELECT pg_stat_get_xact_numscans($1::text::regclass)", &[&relation]).unwrap().get(0)
}

/// A claim reads its group's ranges and exception rows through their indexes even when its
/// backend planned it right after a `VACUUM` found those tables empty, which the planner then
/// trusts: a sequential scan would read every page the dead ranges of earlier claims fill, on
/// every claim, until Postgres planned it again (src/transient.rs). Only sequential scans are
/// counted: a bitmap scan counts as an index scan.
#[test]
fn claims_read_ranges_by_index_though_planned_after_a_vacuum_found_none() {
    let mut c = connect();
    let s = Stream::create(&mut c, "vacuumed-ranges");
    let g = s.group(&mut c, "g", Some("ordered"));
    let mut produced = Vec::new();
    for _ in 0..4 {
        for key in one_key_per_lane(&mut c, &s) {
            produced.extend(s.produce_many(&mut c, 2, Some(&key)));
        }
    }
    let transient = vacuum_transient(&mut c, &s);

    // A new backend: every plan of its claims is made from here on.
    let mut consumer = connect();
    let (mut token, mut acks): (Option<uuid::Uuid>, Option<Vec<i64>>) = (None, None);
    let mut delivered: Vec<i64> = Vec::new();
    let mut sequential = 0;
    for _ in 0..100 {
        if delivered.len() == produced.len() {
            break;
        }
        let mut tx = consumer.transaction().unwrap();
        let before: i64 = transient.iter().map(|t| own_scans(&mut tx, t)).sum();
        let rows = tx
            .query(
                "SELECT message_id, lease_token FROM sqlstreams.claim($1, $2, 10, '30 seconds', $3, $4)",
                &[&s.name, &g.name, &token, &acks],
            )
            .unwrap();
        sequential += transient.iter().map(|t| own_scans(&mut tx, t)).sum::<i64>() - before;
        tx.commit().unwrap();
        let ids: Vec<i64> = rows.iter().map(|r| r.get(0)).collect();
        token = rows.first().map(|r| r.get(1));
        delivered.extend(&ids);
        acks = Some(ids);
    }
    delivered.sort_unstable();
    produced.sort_unstable();
    assert_eq!(delivered, produced, "the claims delivered the backlog once");
    assert_eq!(sequential, 0, "claims scanned the ranges or exception rows sequentially");
}

/// An ack finds its claim's ranges through the token's index even when its backend planned it
/// right after a `VACUUM` found the ranges' table empty. Every index of that table leads with
/// the group, and on a table taken for a page the planner costs them all alike; through
/// another index the ack would read every range of the group deleted since the last vacuum
/// (src/transient.rs, `assume_a_size`).
#[test]
fn acks_find_their_ranges_by_token_though_planned_after_a_vacuum_found_none() {
    let mut c = connect();
    let s = Stream::create(&mut c, "vacuumed-tokens");
    let g = s.group(&mut c, "g", Some("ordered"));
    let mut produced = 0;
    for _ in 0..4 {
        for key in one_key_per_lane(&mut c, &s) {
            produced += s.produce_many(&mut c, 2, Some(&key)).len();
        }
    }
    let [ranges, ..] = vacuum_transient(&mut c, &s);
    let by_token = format!("{ranges}_token_idx");

    // A new backend: every plan of its claims and acks is made from here on.
    let mut consumer = connect();
    let (mut token, mut acks): (Option<uuid::Uuid>, Option<Vec<i64>>) = (None, None);
    let (mut delivered, mut carried, mut token_scans) = (0, 0, 0);
    while delivered < produced {
        let mut tx = consumer.transaction().unwrap();
        let before = own_scans(&mut tx, &by_token);
        let rows = tx
            .query(
                "SELECT message_id, lease_token FROM sqlstreams.claim($1, $2, 10, '30 seconds', $3, $4)",
                &[&s.name, &g.name, &token, &acks],
            )
            .unwrap();
        token_scans += own_scans(&mut tx, &by_token) - before;
        tx.commit().unwrap();
        assert!(!rows.is_empty(), "the backlog ran dry after {delivered} of {produced}");
        carried += usize::from(acks.is_some());
        delivered += rows.len();
        token = Some(rows[0].get(1));
        acks = Some(rows.iter().map(|r| r.get(0)).collect());
    }
    assert!(carried > 5, "{carried} claims carried acks");
    assert!(
        token_scans >= carried as i64,
        "{carried} claims carried acks; the token's index was scanned {token_scans} times"
    );
}

/// Outcomes recorded on another connection than the claim's, which looks up what the claim's
/// own backend remembers (src/own_claims.rs), also find the token's ranges through its index
/// when that connection planned them right after a `VACUUM` found the ranges' table empty.
#[test]
fn outcomes_on_another_connection_find_their_ranges_by_token_though_planned_after_a_vacuum_found_none() {
    let mut c = connect();
    let s = Stream::create(&mut c, "vacuumed-outcomes");
    let g = s.group(&mut c, "g", Some("ordered"));
    for key in one_key_per_lane(&mut c, &s) {
        s.produce_many(&mut c, 2, Some(&key));
    }
    let [ranges, ..] = vacuum_transient(&mut c, &s);
    let by_token = format!("{ranges}_token_idx");
    let claimed = g.claim(&mut c, 32);
    assert!(claimed.len() > 2, "claimed {}", claimed.len());

    // A new backend: the outcomes' plans are made from here on.
    let mut other = connect();
    let mut token_scans = |outcome: &dyn Fn(&mut Client)| {
        other.batch_execute("BEGIN").unwrap();
        let before = own_scans(&mut other, &by_token);
        outcome(&mut other);
        let scans = own_scans(&mut other, &by_token) - before;
        other.batch_execute("COMMIT").unwrap();
        scans
    };
    let last = claimed.len() - 1;
    let acked = token_scans(&|c| assert!(g.ack(c, &claimed[0])));
    let batch = token_scans(&|c| assert_eq!(g.ack_batch(c, &claimed[1..last]).len(), last - 1));
    let failed = token_scans(&|c| assert_eq!(g.fail(c, &claimed[last], "boom", false, None).as_deref(), Some("ready")));
    assert!(
        failed >= 1 && acked >= 1 && batch >= 1,
        "the token's index was scanned {acked} times by an ack, {batch} by an ack_batch, {failed} by a fail"
    );
}

/// A claim hands out a lane's due retries past the oldest one when another transaction holds
/// that one locked (a late outcome under an expired lease, say), as `SKIP LOCKED` promises.
#[test]
fn a_claim_takes_the_next_due_retry_when_the_oldest_is_locked() {
    let mut c = connect();
    let s = Stream::create(&mut c, "locked-retry");
    let g = s.group(&mut c, "g", None);
    let produced = s.produce_many(&mut c, 3, Some("one-lane"));
    for d in g.claim(&mut c, 3) {
        assert_eq!(g.fail(&mut c, &d, "boom", false, Some("0 seconds")).as_deref(), Some("ready"));
    }

    let mut locker = connect();
    let mut held = locker.transaction().unwrap();
    let table = s.table("exception_queue");
    held.execute(&format!("SELECT 1 FROM {table} WHERE message_id = $1 FOR UPDATE"), &[&produced[0]]).unwrap();
    let got = ids(&g.claim(&mut c, 1));
    assert_eq!(got, vec![produced[1]], "the next due retry, past the locked one");
    held.rollback().unwrap();
}

/// `group_status` finds where a group has handed out everything by probing each lane behind the
/// head for a message after its position. A lane with nothing there stays behind (an idle claim
/// writes nothing), so a monitor polling `group_status` probed it on every call: now a backend
/// probes it once, and again only once the head moves past what it learned.
#[test]
fn group_status_probes_a_lane_left_behind_the_head_once_per_backend() {
    let mut c = connect();
    let s = Stream::create(&mut c, "status-probes");
    let g = s.group(&mut c, "g", None);
    let keys = one_key_per_lane(&mut c, &s);
    s.produce_many(&mut c, 3, Some(&keys[0]));
    assert_eq!(g.drain(&mut c).len(), 3);
    let behind: i64 =
        c.query_one(&format!("SELECT count(*) FROM {} WHERE claimed < 3", s.table("lane")), &[]).unwrap().get(0);
    assert_eq!(behind, 15, "the lanes without messages stay where they were");

    // A backend of its own: its counts hold nothing of the above.
    let mut monitor = connect();
    let status = "SELECT claimed, head, lag FROM sqlstreams.group_status($1, 'g')";
    let poll = |monitor: &mut Client| {
        let mut tx = monitor.transaction().unwrap();
        let row = tx.query_one(status, &[&s.name]).unwrap();
        let progress: (i64, i64, i64) = (row.get(0), row.get(1), row.get(2));
        let pages = index_pages_read(&mut tx, &format!("{}_p0", s.table("message_log")));
        // A backend's counts include what it has not reported yet: reported when it goes idle.
        tx.execute("SELECT pg_stat_force_next_flush()", &[]).unwrap();
        tx.commit().unwrap();
        (progress, pages)
    };
    let (progress, first_pages) = poll(&mut monitor);
    assert_eq!(progress, (3, 3, 0));
    assert!(first_pages >= 15, "the first call probes the 15 lanes behind the head ({first_pages} pages)");
    let (progress, pages) = poll(&mut monitor);
    assert_eq!(progress, (3, 3, 0));
    assert_eq!(pages, 0, "the second call knows those lanes have nothing up to the head");

    // A message in one of those lanes, claimed: the group's safe head moves past what the
    // monitor learned, so it looks again.
    s.produce(&mut c, json!({}), Some(&keys[5]));
    let claimed = g.claim(&mut c, 100);
    assert_eq!(claimed.len(), 1);
    let (progress, pages) = poll(&mut monitor);
    assert_eq!(progress, (4, 4, 1), "claimed, not acked");
    assert!(pages > 0, "the lanes behind are probed up to the new safe head");
    g.ack_batch(&mut c, &claimed);
    let (progress, _) = poll(&mut monitor);
    assert_eq!(progress, (4, 4, 0));
}

/// A claim that reads a batch from a lane with more after it reads the next message's id too,
/// so the claim that takes the lane next knows it has work without probing it: once every lane
/// has been read, a claim of a backlog scans the log's key once for each lane it reads, and no
/// more (before, a lane was probed again before each read, four lanes to a probe).
#[test]
fn a_claim_that_reads_a_full_batch_from_a_lane_tells_the_next_one_it_has_more() {
    let mut c = connect();
    let s = Stream::create(&mut c, "reads-next");
    let g = s.group(&mut c, "g", Some("parallel"));
    // Keyless messages go to the lanes in blocks of 64 ids: about 64 messages in each of the 16.
    let produced = s.produce_many(&mut c, 1024, None);
    let log = s.table("message_log");
    let key: String = c
        .query_one(
            "SELECT indexrelid::regclass::text FROM pg_index WHERE indrelid = $1::text::regclass AND indisprimary",
            &[&format!("{log}_p0")],
        )
        .unwrap()
        .get(0);
    let lanes: HashMap<i64, i32> =
        c.query(&format!("SELECT id, lane FROM {log}"), &[]).unwrap().iter().map(|r| (r.get(0), r.get(1))).collect();
    assert_eq!(lanes.len(), produced.len());
    // A backend of its own: what it learns of the lanes is its own.
    let mut claimer = connect();
    let mut delivered: Vec<i64> = Vec::new();
    let mut read: HashSet<i32> = HashSet::new();
    let mut checked = 0;
    for _ in 0..48 {
        let mut tx = claimer.transaction().unwrap();
        let before = own_scans(&mut tx, &key);
        let rows =
            tx.query("SELECT message_id, lease_token FROM sqlstreams.claim($1, $2, 10)", &[&s.name, &g.name]).unwrap();
        let scans = own_scans(&mut tx, &key) - before;
        tx.commit().unwrap();
        let ids: Vec<i64> = rows.iter().map(|r| r.get(0)).collect();
        assert_eq!(ids.len(), 10, "the backlog fills every batch");
        let lanes_read: HashSet<i32> = ids.iter().map(|id| lanes[id]).collect();
        if read.len() == 16 {
            assert_eq!(scans, lanes_read.len() as i64, "one scan per lane read, no probe (ids {ids:?})");
            checked += 1;
        }
        read.extend(&lanes_read);
        claimer
            .execute(
                "SELECT sqlstreams.ack_batch($1, $2, $3, $4)",
                &[&s.name, &g.name, &rows[0].get::<_, uuid::Uuid>(1), &ids],
            )
            .unwrap();
        delivered.extend(ids);
    }
    assert!(checked >= 30, "most claims came after every lane was read ({checked})");
    // Nothing twice, and in each lane its first messages, none passed over.
    let unique: HashSet<i64> = delivered.iter().copied().collect();
    assert_eq!(unique.len(), delivered.len());
    for lane in 0..16 {
        let all: Vec<i64> = produced.iter().copied().filter(|id| lanes[id] == lane).collect();
        let mut got: Vec<i64> = delivered.iter().copied().filter(|id| lanes[id] == lane).collect();
        got.sort();
        assert_eq!(got, all[..got.len()], "lane {lane}");
    }
}

/// A batch that takes the last of its lane's messages up to the safe head moves the lane there,
/// past the other lanes' ids: its read looked one message further and found none. What the lane
/// gets later is still handed out.
#[test]
fn a_batch_that_takes_a_lanes_last_messages_moves_the_lane_to_the_safe_head() {
    let mut c = connect();
    let s = Stream::create(&mut c, "lane-ends");
    let g = s.group(&mut c, "g", Some("parallel"));
    let keys = one_key_per_lane(&mut c, &s);
    let first = s.produce_many(&mut c, 10, Some(&keys[0]));
    let others: Vec<i64> = keys[1..].iter().map(|k| s.produce(&mut c, json!({}), Some(k))).collect();
    let head = *others.last().unwrap();
    let claimed = g.claim(&mut c, 10);
    assert_eq!(ids(&claimed), first, "lane 0 first: its ten messages fill the batch");
    let position: i64 =
        c.query_one(&format!("SELECT claimed FROM {} WHERE lane = 0", s.table("lane")), &[]).unwrap().get(0);
    assert!(position >= head, "lane 0 is at {position}, not at the safe head ({head} or later)");
    g.ack_batch(&mut c, &claimed);
    let later = s.produce_many(&mut c, 3, Some(&keys[0]));
    let mut rest = g.drain(&mut c);
    rest.sort();
    let mut expected = others;
    expected.extend(later);
    assert_eq!(rest, expected, "the other lanes' messages and lane 0's later ones, each once");
}

/// A lane with nothing up to the safe head but many messages past it (committed behind an open
/// producer the fence waits for) costs a claim's probe a page or two, not a read through those
/// messages: the probe's scan stops at the safe head (on PostgreSQL 15 to 17 a row comparison as
/// the bound stopped it at the lane's end only).
#[test]
fn a_claims_probe_stops_at_the_safe_head() {
    let mut c = connect();
    let mut open = connect();
    let s = Stream::create(&mut c, "probe-stops");
    let g = s.group(&mut c, "g", None);
    let keys = one_key_per_lane(&mut c, &s);
    let first = s.produce(&mut c, json!({}), Some(&keys[0]));
    let claimed = g.claim(&mut c, 10);
    assert_eq!(ids(&claimed), vec![first], "the safe head is at the first message");
    g.ack_batch(&mut c, &claimed);
    // The fence waits for this producer; 20,000 messages of another lane commit after it.
    let mut tx = open.transaction().unwrap();
    s.produce(&mut tx, json!({}), Some(&keys[0]));
    c.query_one(
        "SELECT count(*) FROM sqlstreams.produce_batch($1, array(SELECT '{}'::jsonb FROM generate_series(1, 20000)),
                                                       array(SELECT $2::text FROM generate_series(1, 20000)))",
        &[&s.name, &keys[1]],
    )
    .unwrap();
    // A backend of its own: its counts hold nothing of the producing above.
    let mut claimer = connect();
    let mut claim = claimer.transaction().unwrap();
    let claimed = claim.query("SELECT * FROM sqlstreams.claim($1, 'g', 10)", &[&s.name]).unwrap();
    assert!(claimed.is_empty(), "nothing up to the safe head is left");
    let pages = index_pages_read(&mut claim, &format!("{}_p0", s.table("message_log")));
    claim.rollback().unwrap();
    tx.rollback().unwrap();
    // Fifteen lanes probed, a descent of about two pages each (31 here); through the 20,000
    // messages it was 107.
    assert!(pages <= 50, "the probes read {pages} index pages");
}

/// The kept plans of this session whose SQL is the library statement `name`: SPI keeps each
/// statement's plan in a memory context named after its SQL, which starts with its label.
fn kept_plans(c: &mut Client, name: &str) -> i64 {
    c.query_one(
        "SELECT count(*) FROM pg_backend_memory_contexts
         WHERE name = 'CachedPlanSource' AND starts_with(ident, '/* sqlstreams ' || $1 || ' */')",
        &[&name],
    )
    .unwrap()
    .get(0)
}

/// Every row of every claim of group `g` of `stream` in batches of 7, each claim carrying the
/// previous one's acks, as text: what a consumer sees of each message.
fn claim_everything(c: &mut Client, stream: &str) -> Vec<String> {
    let claim = "SELECT message_id, coalesce(message_key, '-'), concurrency, attempt, payload::text,
                        lease_token, coalesce(run_after, 0), produced_at::text, coalesce(headers::text, '-')
                 FROM sqlstreams.claim_with_metadata($1, 'g', 7, '1 minute', $2, $3)";
    let (mut seen, mut acks) = (vec![], None::<(uuid::Uuid, Vec<i64>)>);
    loop {
        let (token, ids) = acks.take().unzip();
        let rows = c.query(claim, &[&stream, &token, &ids]).unwrap();
        if rows.is_empty() {
            return seen;
        }
        for r in &rows {
            let (id, key, concurrency, attempt): (i64, String, String, i32) = (r.get(0), r.get(1), r.get(2), r.get(3));
            let (payload, run_after, at, headers): (String, i64, String, String) =
                (r.get(4), r.get(6), r.get(7), r.get(8));
            seen.push(format!("{id} {key} {concurrency} {attempt} {payload} {run_after} {at} {headers}"));
        }
        acks = Some((rows[0].get(5), rows.iter().map(|r| r.get(0)).collect()));
    }
}

/// A claim reads a lane's next messages from the partition's key without a statement
/// (src/message/scan.rs); a partition a DBA changed (row security here) is read by the statement.
/// Both hand out the same rows: ordered keys, keyless and compacted messages, headers, messages
/// held back by `deliver_after`, across a partition boundary.
#[test]
fn a_claim_reads_a_lanes_messages_from_its_key_as_the_statement_reads_them() {
    let mut c = connect();
    let (direct, changed) =
        (Stream::create_sized(&mut c, "scan-key", 1000), Stream::create_sized(&mut c, "scan-sql", 1000));
    direct.group(&mut c, "g", None);
    changed.group(&mut c, "g", None);
    let mut tx = c.transaction().unwrap();
    for s in [&direct, &changed] {
        tx.execute(&format!("SELECT setval('{}_seq', 940)", s.table("message_log")), &[]).unwrap();
        let payloads: Vec<serde_json::Value> = (0..90).map(|i| json!({ "i": i, "pad": "é".repeat(i % 40) })).collect();
        let keys: Vec<String> = (0..90).map(|i| format!("key-{}", i % 13)).collect();
        let headers: Vec<Option<serde_json::Value>> =
            (0..90).map(|i| (i % 2 == 0).then(|| json!({ "h": i }))).collect();
        tx.execute(
            "SELECT sqlstreams.produce_batch($1, $2, $3, 'ordered', headers => $4)",
            &[&s.name, &payloads, &keys, &headers],
        )
        .unwrap();
        tx.execute("SELECT sqlstreams.produce($1, '{\"late\": 1}', 'key-1', deliver_after => '1 hour')", &[&s.name])
            .unwrap();
        tx.execute("SELECT sqlstreams.produce($1, '{\"c\": 1}', 'solo', compaction => true)", &[&s.name]).unwrap();
        s.produce_many(&mut tx, 20, None);
        // Stored out of line (TOAST: it does not compress), read while the scan is on its row.
        tx.execute(
            "SELECT sqlstreams.produce($1, (SELECT jsonb_agg(md5(g::text)) FROM generate_series(1, 4000) g), 'key-3')",
            &[&s.name],
        )
        .unwrap();
    }
    for part in [0, 1] {
        tx.batch_execute(&format!("ALTER TABLE {}_p{part} ENABLE ROW LEVEL SECURITY", changed.table("message_log")))
            .unwrap();
    }
    tx.commit().unwrap();
    for s in [&direct, &changed] {
        let toast = format!(
            "SELECT pg_relation_size(reltoastrelid) FROM pg_class WHERE oid = '{}_p1'::regclass",
            s.table("message_log")
        );
        let toasted: i64 = c.query_one(&toast, &[]).unwrap().get(0);
        assert!(toasted > 0, "a payload is stored out of line");
    }

    // Sessions of their own, whose plans are this test's.
    let (mut a, mut b) = (connect(), connect());
    let from_key = claim_everything(&mut a, &direct.name);
    let from_statement = claim_everything(&mut b, &changed.name);
    assert_eq!(from_key.len(), 112, "every message but the one held back, once");
    assert_eq!(from_key, from_statement, "the key's rows are the statement's");
    assert_eq!(kept_plans(&mut a, "message_after"), 0, "no statement read the lanes of the plain partitions");
    assert!(kept_plans(&mut b, "message_after") > 0, "the statement read the partitions with row security");
}

/// A claim's first question, whether anything is due or expired and else which lanes are free,
/// is read from three indexes that order a group's rows by a time (src/lanes/free.rs). Any one
/// of them that a DBA rebuilt under its name, narrower (hiding rows), wider, in the other order,
/// over another column, or dropped, must hide no retry made due, no delivery whose lease ran out
/// and no range whose lease ran out: the claim asks through the statement instead (each case on
/// a session of its own, which keeps the statement's plan once it ran it), and still hands each
/// of them out again.
#[test]
fn due_and_expired_work_is_found_whatever_became_of_the_indexes_ordering_it_by_time() {
    // (index, table, time column, another column of the table, predicate as installed, a
    // narrower one, a wider one)
    let indexes = [
        (
            "exception_queue_{}_due_any_idx",
            "exception_queue",
            "can_run_after",
            "lease_expires_at",
            "status IN ('ready', 'deferred')",
            "status = 'deferred'",
            Some("status IN ('dead', 'deferred', 'ready')"),
        ),
        (
            "exception_queue_{}_expiry_any_idx",
            "exception_queue",
            "lease_expires_at",
            "can_run_after",
            "status = 'inflight'",
            "status = 'inflight' AND attempts > 5",
            Some("status IN ('inflight', 'dead')"),
        ),
        ("range_lease_{}_expiry_idx", "range_lease", "lease_expires_at", "first_id", "true", "reclaims > 0", None),
    ];
    // (index, shape, whether the claim asks by statement)
    let mut cases = vec![(None, "as installed", false)];
    for index in &indexes {
        cases.extend([
            (Some(index), "narrower", true),
            (Some(index), "descending", true),
            (Some(index), "over another column", true),
            (Some(index), "dropped", true),
        ]);
        if index.6.is_some() {
            cases.push((Some(index), "wider", false));
        }
    }
    for (index, shape, by_statement) in cases {
        let mut c = connect();
        let s = Stream::create(&mut c, "time-indexes");
        let g = s.group(&mut c, "g", Some("ordered"));
        let case = format!("{} {shape}", index.map_or("", |i| i.0));
        if let Some((name, table, time, other, installed, narrower, wider)) = index {
            let (name, table) = (name.replace("{}", &s.id.to_string()), s.table(table));
            let rebuilt = |column: &str, order: &str, predicate: &str| {
                format!("DROP INDEX sqlstreams.{name}; CREATE INDEX {name} ON {table} (consumer_group_id, {column} {order}) WHERE {predicate};")
            };
            c.batch_execute(&match shape {
                "narrower" => rebuilt(time, "", narrower),
                "wider" => rebuilt(time, "", wider.unwrap()),
                "descending" => rebuilt(time, "DESC", installed),
                "over another column" => rebuilt(other, "", installed),
                _ => format!("DROP INDEX sqlstreams.{name}"),
            })
            .unwrap();
        }
        let first = s.produce(&mut c, json!({}), Some("k"));
        let d = g.claim(&mut c, 10);
        assert_eq!(ids(&d), vec![first], "{case}");
        assert_eq!(g.fail(&mut c, &d[0], "x", false, Some("1 hour")).as_deref(), Some("ready"), "{case}");
        assert!(g.claim(&mut c, 10).is_empty(), "{case}: the retry waits for its time");
        g.make_due(&mut c);
        let retried = g.claim(&mut c, 10);
        assert_eq!(ids(&retried), vec![first], "{case}: the retry, due");
        g.expire_leases(&mut c);
        let again = g.claim(&mut c, 10);
        assert_eq!(ids(&again), vec![first], "{case}: the retry, its lease expired");
        assert!(g.ack(&mut c, &again[0]), "{case}");
        let second = s.produce(&mut c, json!({}), Some("k"));
        assert_eq!(ids(&g.claim(&mut c, 10)), vec![second], "{case}");
        g.expire_leases(&mut c);
        assert_eq!(ids(&g.claim(&mut c, 10)), vec![second], "{case}: the range, its lease expired");
        assert!(g.claim(&mut c, 10).is_empty(), "{case}");
        assert_eq!(kept_plans(&mut c, "lanes_free") > 0, by_statement, "{case}: asked by statement");
    }
}

/// A backend remembers the relations and indexes a claim reads directly, by their oids, until an
/// invalidation (src/statement/probe.rs). An index another session rebuilt under its name since
/// this session's last claim is found again: as installed, read directly as before (the
/// remembered oid, dropped, is looked up again by name); narrower, asked through the statement.
/// Either way the range whose lease ran out is handed out again.
#[test]
fn a_session_finds_an_index_rebuilt_under_its_name_since_its_last_claim() {
    for (shape, predicate, by_statement) in [("as installed", "", false), ("narrower", " WHERE reclaims > 0", true)] {
        let mut c = connect();
        let s = Stream::create(&mut c, "rebuilt-index");
        let g = s.group(&mut c, "g", Some("ordered"));
        let first = s.produce(&mut c, json!({}), Some("k"));
        // A session of its own, which keeps the statement's plan once it ran it.
        let mut a = connect();
        assert_eq!(ids(&g.claim(&mut a, 10)), vec![first], "{shape}");
        assert_eq!(kept_plans(&mut a, "lanes_free"), 0, "{shape}: read from the indexes");
        let name = format!("range_lease_{}_expiry_idx", s.id);
        c.batch_execute(&format!(
            "DROP INDEX sqlstreams.{name};
             CREATE INDEX {name} ON {} (consumer_group_id, lease_expires_at){predicate};",
            s.table("range_lease")
        ))
        .unwrap();
        g.expire_leases(&mut c);
        assert_eq!(ids(&g.claim(&mut a, 10)), vec![first], "{shape}: the range, its lease expired");
        assert_eq!(kept_plans(&mut a, "lanes_free") > 0, by_statement, "{shape}: asked by statement");
    }
}

/// A claim that waits for the lock of a table it reads directly (src/statement/probe.rs) while
/// another transaction swaps the table for another under its name reads the one the name names
/// once the lock is granted, as its statements do: here a copy of the lanes at their positions,
/// while the table renamed away says every lane is claimed through the head (read, it would hand
/// nothing out). A session of its own, which remembers nothing yet, so the claim looks the name
/// up before it waits.
#[test]
fn a_claim_that_waits_while_a_table_is_swapped_under_its_name_reads_the_new_one() {
    let mut c = connect();
    let s = Stream::create(&mut c, "swapped-table");
    let g = s.group(&mut c, "g", Some("ordered"));
    let produced: Vec<i64> = (0..8).flat_map(|i| s.produce_many(&mut c, 1, Some(&format!("k{i}")))).collect();
    let lanes = s.table("lane");
    let old = format!("{}_old", lanes.rsplit('.').next().unwrap());
    let mut swap = connect();
    let mut tx = swap.transaction().unwrap();
    tx.batch_execute(&format!("LOCK TABLE {lanes} IN ACCESS EXCLUSIVE MODE")).unwrap();
    let mut a = connect();
    let pid: i32 = a.query_one("SELECT pg_backend_pid()", &[]).unwrap().get(0);
    let (stream, group) = (s.name.clone(), g.name.clone());
    let claimer = std::thread::spawn(move || {
        a.query("SELECT message_id FROM sqlstreams.claim($1, $2, 100, '30 seconds')", &[&stream, &group])
            .map(|rows| rows.iter().map(|r| r.get::<_, i64>(0)).collect::<Vec<_>>())
    });
    wait_until_waiting_for_the_lock_of(&mut c, pid, &lanes);
    tx.batch_execute(&format!(
        "ALTER TABLE {lanes} RENAME TO {old};
         CREATE TABLE {lanes} (LIKE sqlstreams.{old} INCLUDING ALL);
         INSERT INTO {lanes} SELECT * FROM sqlstreams.{old};
         UPDATE sqlstreams.{old} SET claimed = {head};",
        head = produced.last().unwrap()
    ))
    .unwrap();
    tx.commit().unwrap();
    let handed_out = claimer.join().unwrap().expect("the claim reads the new table");
    assert!(!handed_out.is_empty(), "the lanes' positions in the table the name names");
    assert!(handed_out.iter().all(|id| produced.contains(id)), "{handed_out:?}");
    c.batch_execute(&format!("DROP TABLE sqlstreams.{old}")).unwrap();
}

/// Waits until backend `pid` waits for the lock of relation `table` (a state, not a time: a
/// minute at the most).
fn wait_until_waiting_for_the_lock_of(c: &mut Client, pid: i32, table: &str) {
    for _ in 0..6000 {
        let waits: bool = c
            .query_one(
                "SELECT EXISTS (SELECT FROM pg_locks WHERE pid = $1 AND NOT granted
                                AND locktype = 'relation' AND relation = $2::text::regclass)",
                &[&pid, &table],
            )
            .unwrap()
            .get(0);
        if waits {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("backend {pid} never waited for the lock of {table}");
}

/// A session that remembers the relations a claim reads directly still reads, after the
/// extension's schema swapped names with another one (`ALTER SCHEMA ... RENAME`, which sends no
/// relcache invalidation), what its statements read: the relations the name `sqlstreams` names
/// now. Here a schema of views over the real tables, whose ranges hide every row; the warm
/// session's claim answers as a new session's does, in the same state. (Without the schema's
/// invalidation, the debug build's check that the direct reads and their statements agree is what
/// fails.)
#[test]
fn a_session_reads_what_the_schema_name_names_after_schemas_swapped_names() {
    let (mut c, url) = own_database("schema-swap");
    let s = Stream::create(&mut c, "swap");
    let g = s.group(&mut c, "g", Some("ordered"));
    for i in 0..6 {
        s.produce_many(&mut c, 1, Some(&format!("k{}", i % 3)));
    }
    c.batch_execute("CREATE SCHEMA fake").unwrap();
    let relations: Vec<(String, bool)> = c
        .query(
            "SELECT relname::text, relkind = 'S' FROM pg_class
             WHERE relnamespace = 'sqlstreams'::regnamespace AND relkind IN ('r', 'p', 'v', 'S')",
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    let hidden = format!("range_lease_{}", s.id);
    for (name, sequence) in relations {
        if sequence {
            c.batch_execute(&format!(
                "CREATE SEQUENCE fake.\"{name}\";
                 SELECT setval('fake.\"{name}\"', last_value, is_called) FROM sqlstreams.\"{name}\";"
            ))
            .unwrap();
        } else {
            let filter = if name == hidden { " WHERE false" } else { "" };
            c.batch_execute(&format!("CREATE VIEW fake.\"{name}\" AS SELECT * FROM sqlstreams.\"{name}\"{filter}"))
                .unwrap();
        }
    }
    // After the views (new relations send invalidations), so that it remembers the real tables.
    let mut a = postgres::Client::connect(&url, postgres::NoTls).unwrap();
    assert_eq!(g.claim(&mut a, 3).len(), 3, "the session remembers the relations it read");
    g.expire_leases(&mut c);
    c.batch_execute(
        "BEGIN; ALTER SCHEMA sqlstreams RENAME TO sqlstreams_real; ALTER SCHEMA fake RENAME TO sqlstreams; COMMIT;",
    )
    .unwrap();
    let claim = "SELECT message_id FROM sqlstreams_real.claim($1, $2, 10, '30 seconds')";
    let answer = |c: &mut Client| -> Result<Vec<i64>, postgres::Error> {
        let mut tx = c.transaction()?;
        let rows = tx.query(claim, &[&s.name, &g.name])?;
        tx.rollback()?;
        Ok(rows.iter().map(|r| r.get(0)).collect())
    };
    let warm = answer(&mut a).expect("the warm session's claim");
    let mut fresh = postgres::Client::connect(&url, postgres::NoTls).unwrap();
    assert_eq!(warm, answer(&mut fresh).expect("a new session's claim"), "as a new session answers");
}

/// A claim of two on `c` carrying the acks of every message of `acked` (one claim's), and the
/// lane of its first message.
fn claim_of_two_carrying(c: &mut Client, g: &Group, acked: &[Delivery]) -> (i32, Vec<Delivery>) {
    let token = acked.first().map(|d| d.lease_token);
    let ids: Option<Vec<i64>> = token.map(|_| acked.iter().map(|d| d.message_id).collect());
    let rows = c
        .query(
            "SELECT message_id, message_key, lease_token FROM sqlstreams.claim($1, $2, 2, '30 seconds', $3, $4)",
            &[&g.stream.name, &g.name, &token, &ids],
        )
        .unwrap();
    let batch: Vec<Delivery> = rows
        .iter()
        .map(|r| Delivery {
            message_id: r.get(0),
            message_key: r.get(1),
            concurrency: String::new(),
            attempt: 1,
            payload: json!(null),
            lease_token: r.get(2),
            run_after: None,
        })
        .collect();
    let lane = batch.first().map_or(-1, |d| g.stream.lane(c, d.message_key.as_deref().unwrap()));
    (lane, batch)
}

/// A consumer that carries its acks into its next claim stays with the lane it holds for up to
/// four claims in a row (src/lanes/stay.rs), then takes the lane furthest behind; a claim that
/// stays notifies nobody, the one that leaves notifies the stream's channel once. Before, every
/// claim of a lone consumer left its lane (the lane just read is the one least behind) and
/// notified every listening connection. In an ordered group and in an exclusive one; a lane
/// whose last messages a claim took is left at once, with its notification.
#[test]
fn a_consumer_carrying_its_acks_stays_with_its_lane_four_claims_and_notifies_only_when_it_leaves() {
    for (policy, messages_of_lane_2) in [("ordered", 10), ("exclusive", 4)] {
        let mut c = connect();
        let s = Stream::create(&mut c, &format!("lane-stay-{policy}"));
        let g = s.group(&mut c, "g", Some(policy));
        let keys = one_key_per_lane(&mut c, &s);
        // Ten messages of each key, interleaved (lane 2's key fewer): every other lane has more
        // than four claims of two.
        let mut produced: HashMap<String, Vec<i64>> = HashMap::new();
        for round in 0..10 {
            for (lane, k) in keys.iter().enumerate() {
                if lane != 2 || round < messages_of_lane_2 {
                    produced.entry(k.clone()).or_default().push(s.produce(&mut c, json!({}), Some(k)));
                }
            }
        }
        let channel: String =
            c.query_one("SELECT channel FROM sqlstreams.streams WHERE name = $1", &[&s.name]).unwrap().get(0);
        let mut listener = connect();
        listener.batch_execute(&format!("LISTEN \"{channel}\"")).unwrap();
        // Claims of two carrying the previous claim's acks, on a connection of their own; each
        // claim's notifications are counted up to a marker the connection sends after it
        // (notifications arrive in the order their transactions committed).
        let mut consumer = connect();
        let mut carried: Vec<Delivery> = vec![];
        let mut delivered: HashMap<String, Vec<i64>> = HashMap::new();
        let mut claims: Vec<(i32, usize)> = vec![];
        for n in 0..14 {
            let (lane, batch) = claim_of_two_carrying(&mut consumer, &g, &carried);
            assert_eq!(batch.len(), 2, "{policy} claim {n}: the backlog fills every batch");
            let key = batch[0].message_key.clone().unwrap();
            assert!(
                batch.iter().all(|d| d.message_key.as_ref() == Some(&key)),
                "{policy} claim {n}: one lane, one key"
            );
            delivered.entry(key).or_default().extend(batch.iter().map(|d| d.message_id));
            carried = batch;
            let marker = format!("marker {n}");
            consumer.execute("SELECT pg_notify($1, $2)", &[&channel, &marker]).unwrap();
            let mut notified = 0;
            let mut notifications = listener.notifications();
            let mut arriving = notifications.timeout_iter(Duration::from_secs(30));
            loop {
                let note = arriving.next().unwrap().expect("the marker arrives");
                if note.payload() == marker {
                    break;
                }
                notified += 1;
            }
            claims.push((lane, notified));
        }
        // Lanes 0 to 15 stood at the same position, so the first claim takes lane 0; then the
        // lane furthest behind is each time the next one. Lane 2 has four messages: its second
        // claim takes its last, and the next claim leaves it (an ordered lane 2 holds ten).
        let lanes: Vec<i32> = claims.iter().map(|&(lane, _)| lane).collect();
        let notified: Vec<usize> = claims.iter().map(|&(_, n)| n).collect();
        if messages_of_lane_2 == 10 {
            assert_eq!(lanes, [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3], "{policy}: four claims in a row on a lane");
            assert_eq!(notified, [0, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 1, 0], "{policy}: one for each lane left");
        } else {
            assert_eq!(lanes, [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 3, 3, 3, 3], "{policy}: a lane left when it has nothing");
            assert_eq!(notified, [0, 0, 0, 0, 1, 0, 0, 0, 1, 0, 1, 0, 0, 0], "{policy}: one for each lane left");
        }
        for (key, ids) in &delivered {
            assert_eq!(ids[..], produced[key][..ids.len()], "{policy} key {key}: its first messages, in order");
        }
    }
}

/// The run is counted along the acked tokens this backend made (src/lanes/stay.rs): acks of a
/// claim made on another connection (a pooler in transaction mode) start no stay, and the claim
/// takes the lane furthest behind; a consumer pipelining its claims (each carries the acks of
/// the one before the last) stays with each of its two lanes.
#[test]
fn a_stay_follows_the_tokens_this_backend_made() {
    let mut c = connect();
    let s = Stream::create(&mut c, "lane-stay-chain");
    let g = s.group(&mut c, "g", Some("ordered"));
    let keys = one_key_per_lane(&mut c, &s);
    for _ in 0..10 {
        for k in &keys {
            s.produce(&mut c, json!({}), Some(k));
        }
    }
    // Made on one connection, acked with a claim on another: no stay.
    let (mut elsewhere, mut here) = (connect(), connect());
    let (lane, first) = claim_of_two_carrying(&mut elsewhere, &g, &[]);
    assert_eq!(lane, 0);
    let (lane, second) = claim_of_two_carrying(&mut here, &g, &first);
    assert_eq!(lane, 1, "the lane furthest behind, not lane 0 that the acks released");
    // Pipelined on one connection: claim n + 1 carries the acks of claim n - 1. Lane 1 is
    // still held, lanes 2 to 15 are behind lane 0.
    let (lane, third) = claim_of_two_carrying(&mut here, &g, &[]);
    assert_eq!(lane, 2);
    let mut lanes = vec![];
    let (mut before_last, mut last) = (second, third);
    for _ in 0..8 {
        let (lane, next) = claim_of_two_carrying(&mut here, &g, &before_last);
        lanes.push(lane);
        (before_last, last) = (last, next);
    }
    assert_eq!(lanes, [1, 2, 1, 2, 1, 2, 3, 4], "each chain stays with its lane for four claims, then both leave");
}

/// A claim that takes a released lane back but holds it no more (in a group without an
/// override it hands out only parallel messages from it) leaves the lane free at commit, and
/// notifies the stream's channel for it: another consumer may take it.
#[test]
fn a_lane_taken_back_for_parallel_work_only_is_notified() {
    let mut c = connect();
    let s = Stream::create(&mut c, "lane-stay-parallel");
    let g = s.group(&mut c, "g", None);
    s.produce_with(&mut c, json!({}), Some("k"), Some("ordered"), false).unwrap();
    for _ in 0..2 {
        s.produce_with(&mut c, json!({}), Some("k"), Some("parallel"), false).unwrap();
    }
    let channel: String =
        c.query_one("SELECT channel FROM sqlstreams.streams WHERE name = $1", &[&s.name]).unwrap().get(0);
    let mut listener = connect();
    listener.batch_execute(&format!("LISTEN \"{channel}\"")).unwrap();
    let mut consumer = connect();
    let held = |c: &mut Client| -> i64 {
        c.query_one(&format!("SELECT count(*) FROM {} WHERE held_by IS NOT NULL", s.table("lane")), &[]).unwrap().get(0)
    };
    let rows =
        consumer.query("SELECT message_id, lease_token FROM sqlstreams.claim($1, $2, 1)", &[&s.name, &g.name]).unwrap();
    assert_eq!(rows.len(), 1);
    assert_eq!(held(&mut c), 1, "the ordered message holds its lane");
    let (token, ids): (uuid::Uuid, Vec<i64>) = (rows[0].get(1), vec![rows[0].get(0)]);
    let rows = consumer
        .query(
            "SELECT message_id FROM sqlstreams.claim($1, $2, 10, '30 seconds', $3, $4)",
            &[&s.name, &g.name, &token, &ids],
        )
        .unwrap();
    assert_eq!(rows.len(), 2, "the key's two parallel messages, from the lane taken back");
    assert_eq!(held(&mut c), 0, "parallel work holds no lane");
    consumer.execute("SELECT pg_notify($1, 'marker')", &[&channel]).unwrap();
    let mut notifications = listener.notifications();
    let mut arriving = notifications.timeout_iter(Duration::from_secs(30));
    let mut notified = 0;
    while arriving.next().unwrap().expect("the marker arrives").payload() != "marker" {
        notified += 1;
    }
    assert_eq!(notified, 1, "one notification for the lane freed and not held again");
}
