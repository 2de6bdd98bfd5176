//! Lanes: where messages go, and how competing claims divide them (src/lanes.rs).

use std::collections::{HashMap, HashSet};

use postgres::Client;
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
