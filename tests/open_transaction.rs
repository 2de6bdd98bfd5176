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
