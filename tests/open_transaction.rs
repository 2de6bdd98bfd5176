//! A consumer that leaves its transaction open after a claim (`BEGIN; claim(...)` and then
//! nothing) holds back nothing but the claim's own lanes (src/claim.rs): producers cross into
//! the next partition, other groups claim, seek and drop, other consumers of the same group
//! claim the other lanes. Every call of the others runs under a lock timeout, so a wait fails
//! the test rather than hang it.

use postgres::Client;
use sqlstreams_tests::*;

/// Keys of `n` different lanes of `s`.
fn keys_in_lanes(c: &mut Client, s: &Stream, n: usize) -> Vec<String> {
    let mut lanes = std::collections::HashSet::new();
    (0..).map(|i| format!("key-{i}")).filter(|k| lanes.insert(s.lane(c, k))).take(n).collect()
}

#[test]
fn an_open_transaction_after_a_claim_holds_back_only_its_own_lanes() {
    let mut setup = connect();
    let s = Stream::create_sized(&mut setup, "open-claim", 1000);
    let g1 = s.group(&mut setup, "g1", Some("ordered"));
    let g2 = s.group(&mut setup, "g2", None);
    s.group(&mut setup, "g3", None);
    let keys = keys_in_lanes(&mut setup, &s, 2);
    // 900 messages, the last 100 of them in a second lane: the head is past half the first
    // partition, so a claim would create the next one ahead.
    s.produce_many(&mut setup, 800, Some(&keys[0]));
    s.produce_many(&mut setup, 100, Some(&keys[1]));
    let next_partition = format!("{}_p1", s.table("message_log"));

    // A fresh session: its first claim would also run a retention step (every group's lock).
    let mut open = connect();
    open.batch_execute("BEGIN").unwrap();
    let held = g1.claim(&mut open, 10);
    assert_eq!(held.len(), 10);
    let held_key = held[0].message_key.clone();
    assert!(held.iter().all(|d| d.message_key == held_key), "one lane per ordered claim of ten");

    let mut others = connect();
    others.batch_execute("SET lock_timeout = '5s'").unwrap();
    // Producers cross into the next partition.
    s.produce_many(&mut others, 300, Some(&keys[1]));
    let created: bool = others.query_one("SELECT to_regclass($1) IS NOT NULL", &[&next_partition]).unwrap().get(0);
    assert!(created, "the producer made the partition it needed");
    // Another consumer of the same group gets the other lane.
    let other_lane = g1.claim(&mut others, 10);
    assert!(!other_lane.is_empty());
    assert!(other_lane.iter().all(|d| d.message_key != held_key), "the lane the open claim holds stays its own");
    // Other groups claim, seek and drop.
    assert_eq!(g2.claim(&mut others, 10).len(), 10);
    others.query_one("SELECT sqlstreams.seek($1, 'g2', to_id => 0)", &[&s.name]).unwrap();
    others.query_one("SELECT sqlstreams.drop_group($1, 'g3')", &[&s.name]).unwrap();
    others.query_one("SELECT * FROM sqlstreams.group_status($1, 'g2')", &[&s.name]).unwrap();

    open.batch_execute("COMMIT").unwrap();
    // The open transaction's claim stands: its messages are g1's to finish.
    assert!(g1.ack_batch(&mut open, &held).len() == 10);
}

/// The open claim keeps the group's cursor row locked (it stored the fence there), so no other
/// claim of the group can store one. While the stream's producers overlap, no observation is
/// mature the moment it is made: the other claims must go on from what they proved before, or
/// the group claims nothing new until the open transaction ends.
#[test]
fn an_open_claim_does_not_stop_the_fence_while_producers_overlap() {
    // A database of its own: a reset of every cache (other tests' DDL overflowing the queue of
    // invalidations) makes sessions forget what they proved, as it may.
    let (mut setup, url) = own_database("open_fence");
    let connect = || postgres::Client::connect(&url, postgres::NoTls).unwrap();
    let s = Stream::create(&mut setup, "open-fence");
    let g = s.group(&mut setup, "g", None);
    let keys = keys_in_lanes(&mut setup, &s, 2);
    s.produce(&mut setup, serde_json::json!({ "n": 0 }), Some(&keys[0]));

    let mut open = connect();
    open.batch_execute("BEGIN").unwrap();
    assert_eq!(g.claim(&mut open, 10).len(), 1, "the open claim proves the first message and takes it");
    let row_locked = setup
        .query_one(
            &format!("SELECT 1 FROM {} WHERE consumer_group_id = $1 FOR UPDATE NOWAIT", s.table("cursor")),
            &[&g.id],
        )
        .map(|_| ())
        .map_err(|e| sqlstate(&e));
    assert_eq!(row_locked, Err("55P03".to_string()), "the open claim stored the fence and holds the cursor row");

    // Producers of the other lane, each opened before the one before commits.
    let mut consumer = connect();
    let mut producers = [connect(), connect()];
    producers[0].batch_execute("BEGIN").unwrap();
    let mut open_id = s.produce(&mut producers[0], serde_json::json!({ "n": 1 }), Some(&keys[1]));
    assert!(g.claim(&mut consumer, 10).is_empty(), "its producer is open");
    for round in 1..=4 {
        let (committing, next) = if round % 2 == 1 { (0, 1) } else { (1, 0) };
        producers[next].batch_execute("BEGIN").unwrap();
        let next_id = s.produce(&mut producers[next], serde_json::json!({ "n": round + 1 }), Some(&keys[1]));
        producers[committing].batch_execute("COMMIT").unwrap();
        let claimed = g.claim(&mut consumer, 10);
        assert_eq!(ids(&claimed), vec![open_id], "round {round}: the message committed before the claim");
        assert_eq!(g.ack_batch(&mut consumer, &claimed).len(), 1);
        open_id = next_id;
    }
    // Round 4 left the first producer open.
    producers[0].batch_execute("COMMIT").unwrap();
    open.batch_execute("COMMIT").unwrap();
    assert_eq!(ids(&g.claim(&mut consumer, 10)), vec![open_id]);
}
