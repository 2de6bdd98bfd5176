//! `max_inflight` (src/inflight_cap.rs): a group's cap on messages under unexpired leases, held
//! by claim across all its consumers.

use std::collections::HashSet;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};

use sqlstreams_tests::postgres::fallible_iterator::FallibleIterator;
use sqlstreams_tests::*;

fn cap(c: &mut postgres::Client, s: &Stream, group: &str, max: i32) {
    c.execute("SELECT sqlstreams.alter_group($1, $2, max_inflight => $3)", &[&s.name, &group, &max]).unwrap();
}

fn shown_cap(c: &mut postgres::Client, s: &Stream) -> Option<i32> {
    c.query_one("SELECT max_inflight FROM sqlstreams.consumer_groups WHERE stream = $1", &[&s.name]).unwrap().get(0)
}

#[test]
fn a_capped_group_hands_out_no_more_than_its_cap() {
    let mut c = connect();
    let s = Stream::create(&mut c, "cap");
    let g = s.group(&mut c, "g", None);
    s.produce_many(&mut c, 12, None);
    cap(&mut c, &s, "g", 3);
    assert_eq!(shown_cap(&mut c, &s), Some(3));

    let first = g.claim(&mut c, 10);
    assert_eq!(first.len(), 3, "the cap, not the batch");
    assert!(g.claim(&mut c, 10).is_empty(), "the cap is reached");
    g.ack(&mut c, &first[0]);
    let second = g.claim(&mut c, 10);
    assert_eq!(second.len(), 1, "an ack makes room for one");
    g.fail(&mut c, &first[1], "later", false, Some("1 hour"));
    assert_eq!(g.claim(&mut c, 10).len(), 1, "a retry waiting for its time is not in flight");

    // A claim carrying acks counts after them: the consumer's steady state keeps its batch.
    let carried: Vec<i64> = vec![first[2].message_id];
    let rows = c
        .query(
            "SELECT message_id FROM sqlstreams.claim($1, 'g', 10, '30 seconds', $2, $3)",
            &[&s.name, &first[2].lease_token, &carried],
        )
        .unwrap();
    assert_eq!(rows.len(), 1, "the carried ack made room for one");

    // Expired leases are not in flight: their messages are handed out again, within the cap.
    g.expire_leases(&mut c);
    let again = g.claim(&mut c, 10);
    assert_eq!(again.len(), 3, "{:?}", ids(&again));

    // Refused: a negative cap; nothing changed.
    let err = c.execute("SELECT sqlstreams.alter_group($1, 'g', max_inflight => -1)", &[&s.name]).unwrap_err();
    assert_eq!(sqlstate(&err), "22023", "{}", describe(&err));
    assert!(describe(&err).contains("max_inflight -1"), "{}", describe(&err));
    assert_eq!(shown_cap(&mut c, &s), Some(3));

    // 0 removes the cap; an alter that does not name it keeps it.
    c.execute("SELECT sqlstreams.alter_group($1, 'g', max_retries => 7)", &[&s.name]).unwrap();
    assert_eq!(shown_cap(&mut c, &s), Some(3));
    cap(&mut c, &s, "g", 0);
    assert_eq!(shown_cap(&mut c, &s), None);
    assert!(g.claim(&mut c, 100).len() > 3, "uncapped");
}

#[test]
fn in_a_capped_group_an_expired_lease_is_lost_and_a_claim_needs_its_own_transaction() {
    let mut c = connect();
    let s = Stream::create(&mut c, "cap-lost");
    let g = s.group(&mut c, "g", None);
    s.produce_many(&mut c, 4, None);
    let extend = |c: &mut postgres::Client, d: &Delivery| -> bool {
        c.query_one("SELECT sqlstreams.extend_lease($1, 'g', $2)", &[&s.name, &d.lease_token]).unwrap().get(0)
    };
    // Uncapped, an expired lease not taken over yet is renewed by its holder.
    let first = g.claim(&mut c, 1);
    g.expire_leases(&mut c);
    assert!(extend(&mut c, &first[0]), "uncapped: renewed");
    // Capped, its room may have gone to another claim: it is lost.
    cap(&mut c, &s, "g", 2);
    g.expire_leases(&mut c);
    assert!(!extend(&mut c, &first[0]), "capped: an expired lease is lost");
    let second = g.claim(&mut c, 1);
    assert!(extend(&mut c, &second[0]), "capped: a running lease is renewed");

    // A claim of a capped group in a transaction block is refused before anything changed (the
    // acks it carries are not recorded).
    let mut tx = c.transaction().unwrap();
    let err = tx
        .query(
            "SELECT * FROM sqlstreams.claim($1, 'g', 10, '30 seconds', $2, $3)",
            &[&s.name, &second[0].lease_token, &vec![second[0].message_id]],
        )
        .unwrap_err();
    assert_eq!(sqlstate(&err), "25000", "{}", describe(&err));
    assert!(describe(&err).contains("max_inflight"), "{}", describe(&err));
    tx.rollback().unwrap();
    assert!(g.ack(&mut c, &second[0]), "the refused claim recorded nothing");
}

#[test]
fn in_a_capped_group_an_ack_wakes_idle_consumers() {
    use std::time::Duration;
    let mut c = connect();
    let s = Stream::create(&mut c, "cap-wake");
    let g = s.group(&mut c, "g", None);
    s.produce_many(&mut c, 6, None);
    let channel: String =
        c.query_one("SELECT channel FROM sqlstreams.streams WHERE name = $1", &[&s.name]).unwrap().get(0);
    let mut listener = connect();
    listener.batch_execute(&format!("LISTEN \"{channel}\"")).unwrap();
    // What has arrived by the end of a round trip (a committed NOTIFY was signalled before it).
    let arrived = |listener: &mut postgres::Client| {
        listener.batch_execute("SELECT 1").unwrap();
        listener.notifications().iter().count().unwrap()
    };
    // One ack of a range that keeps its lane sends nothing in an uncapped group...
    let claimed = g.claim(&mut c, 3);
    arrived(&mut listener);
    g.ack(&mut c, &claimed[0]);
    assert_eq!(arrived(&mut listener), 0, "uncapped: nothing to wake for");
    // ...and wakes the stream's consumers in a capped one, where it made room.
    cap(&mut c, &s, "g", 3);
    arrived(&mut listener);
    g.ack(&mut c, &claimed[1]);
    let woken = listener.notifications().timeout_iter(Duration::from_secs(30)).next().unwrap();
    assert!(woken.is_some(), "capped: the ack made room");
}

/// Six consumers of a group capped at four: what they hold at once (counted by the consumers,
/// which is never more than the server counts) never exceeds four, and every message is handled.
#[test]
fn competing_consumers_never_hold_more_than_the_cap() {
    const CAP: i64 = 4;
    let mut c = connect();
    let s = Stream::create(&mut c, "cap-competing");
    let g = s.group(&mut c, "g", Some("ordered"));
    let keys: Vec<String> = (0..8).map(|k| format!("k{k}")).collect();
    let mut produced = HashSet::new();
    for i in 0..240 {
        produced.insert(s.produce(&mut c, json!({"i": i}), Some(&keys[i % keys.len()])));
    }
    cap(&mut c, &s, "g", CAP as i32);

    let holding = Arc::new(AtomicI64::new(0));
    let most = Arc::new(AtomicI64::new(0));
    let handled = Arc::new(Mutex::new(Vec::new()));
    let consumers: Vec<_> = (0..6)
        .map(|_| {
            let (g, holding, most, handled) = (g.clone(), holding.clone(), most.clone(), handled.clone());
            std::thread::spawn(move || {
                let mut c = connect();
                let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
                while handled.lock().unwrap().len() < 240 {
                    assert!(std::time::Instant::now() < deadline, "stuck: {:?}", handled.lock().unwrap().len());
                    let claimed = g.claim(&mut c, 3);
                    if claimed.is_empty() {
                        std::thread::yield_now();
                        continue;
                    }
                    let now = holding.fetch_add(claimed.len() as i64, Ordering::SeqCst) + claimed.len() as i64;
                    most.fetch_max(now, Ordering::SeqCst);
                    for d in &claimed {
                        // A row that waits behind another of this claim runs after it, as the
                        // client runs a chain; the cap counts both.
                        handled.lock().unwrap().push(d.message_id);
                        holding.fetch_sub(1, Ordering::SeqCst);
                        assert!(g.ack(&mut c, d), "ack {}", d.message_id);
                    }
                }
            })
        })
        .collect();
    for consumer in consumers {
        consumer.join().unwrap();
    }
    let handled = handled.lock().unwrap();
    assert_eq!(handled.iter().copied().collect::<HashSet<_>>(), produced, "every message handled");
    assert_eq!(handled.len(), 240, "each once");
    let most = most.load(Ordering::SeqCst);
    assert!(most <= CAP, "the consumers held {most} messages at once, over the cap of {CAP}");
}
