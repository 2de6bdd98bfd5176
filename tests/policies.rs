//! Per-key policies, scenario by scenario, with several connections as competing consumers.
//! "A handler ran" means a consumer started a row of a claim result (respecting run_after).

use postgres::Client;
use sqlstreams_tests::*;

/// The ordering guide's inspect query, exactly as the user wrote it.
const GUIDE_INSPECT: &str = "SELECT
    message_id,
    message_key,
    status,
    attempts,
    can_run_after
FROM sqlstreams.exception_queue_1
WHERE consumer_group_id = 7 AND message_key = 'acct-42'
ORDER BY message_id;";

/// A database of its own, so the ordering guide's ids come out as written: stream 1, group 7, 101-104.
fn guide_database() -> Client {
    own_database("guide").0
}

/// Sets the ordering guide's stage: returns the group; messages 1-100 are applied already.
fn apply_balance_stage(c: &mut Client, policy: &str) -> Group {
    let s = Stream::named(c, "ledger.adjustments");
    assert_eq!(s.id, 1);
    for n in 1..=6 {
        s.group(c, &format!("audit-{n}"), None);
    }
    let g = s.group(c, "apply-balance", Some(policy));
    assert_eq!(g.id, 7);
    s.produce_many(c, 100, Some("acct-1"));
    let earlier = g.claim(c, 100);
    assert_eq!(g.ack_batch(c, &earlier).len(), 100);
    g
}

fn produce_deltas(c: &mut Client, g: &Group) -> Vec<i64> {
    [-500, 200, 75, -20]
        .iter()
        .map(|d| g.stream.produce(c, json!({"account": "acct-42", "delta": d}), Some("acct-42")))
        .collect()
}

/// Runs the rows of one claim result the way a consumer must: a row starts only after its
/// run_after predecessor was acked or dead-lettered. `handler` returns the outcome to record.
/// Returns the ids whose handlers ran, in order.
fn run_result(
    c: &mut Client,
    g: &Group,
    batch: &[Delivery],
    mut handler: impl FnMut(&Delivery) -> Outcome,
) -> Vec<i64> {
    let mut released: Vec<i64> = Vec::new();
    let mut ran = Vec::new();
    for d in batch {
        if let Some(before) = d.run_after {
            if !released.contains(&before) {
                continue; // its predecessor failed or was delayed: the server deferred it
            }
        }
        ran.push(d.message_id);
        match handler(d) {
            Outcome::Ack => {
                if g.ack(c, d) {
                    released.push(d.message_id);
                }
            }
            Outcome::Fail => {
                if g.fail(c, d, "handler error", false, None).as_deref() == Some("dead") {
                    released.push(d.message_id);
                }
            }
            Outcome::Dead => {
                g.fail(c, d, "permanent handler error", true, None);
                released.push(d.message_id);
            }
            Outcome::Delay => {
                g.delay(c, d, "1 hour");
            }
        }
    }
    ran
}

#[derive(Clone, Copy, PartialEq, Debug)]
enum Outcome {
    Ack,
    Fail,
    Dead,
    Delay,
}

#[test]
fn guide_ordered_delivery_through_a_failure() {
    let mut c = guide_database();
    let g = apply_balance_stage(&mut c, "ordered");
    assert_eq!(produce_deltas(&mut c, &g), vec![101, 102, 103, 104]);

    let batch = g.claim(&mut c, 100);
    let ran = run_result(&mut c, &g, &batch, |d| if d.message_id == 101 { Outcome::Fail } else { Outcome::Ack });
    assert_eq!(ran, vec![101], "102-104 wait without running");

    let rows = c.query(GUIDE_INSPECT, &[]).unwrap();
    let seen: Vec<(i64, String, String, i32)> = rows.iter().map(|r| (r.get(0), r.get(1), r.get(2), r.get(3))).collect();
    assert_eq!(
        seen,
        vec![
            (101, "acct-42".into(), "ready".into(), 1),
            (102, "acct-42".into(), "deferred".into(), 0),
            (103, "acct-42".into(), "deferred".into(), 0),
            (104, "acct-42".into(), "deferred".into(), 0),
        ]
    );
    let retry_at: std::time::SystemTime = rows[0].get(4);
    assert!(retry_at > std::time::SystemTime::now(), "101 is ready until its retry is due");
    assert!(g.claim(&mut c, 100).is_empty(), "nothing runs before the retry is due");

    g.make_due(&mut c);
    let mut log = Vec::new();
    loop {
        let batch = g.claim(&mut c, 100);
        if batch.is_empty() {
            break;
        }
        log.extend(run_result(&mut c, &g, &batch, |_| Outcome::Ack));
    }
    assert_eq!(log, vec![101, 102, 103, 104], "the retry of 101 runs first, then 102, 103, 104");
    assert!(c.query(GUIDE_INSPECT, &[]).unwrap().is_empty(), "success deletes the rows");
}

#[test]
fn guide_dead_releases_and_delay_holds() {
    let mut c = guide_database();
    let g = apply_balance_stage(&mut c, "ordered");
    produce_deltas(&mut c, &g);

    // A delay keeps 101 unresolved: the later messages keep waiting.
    let batch = g.claim(&mut c, 100);
    assert_eq!(run_result(&mut c, &g, &batch, |_| Outcome::Delay), vec![101]);
    let statuses: Vec<(i64, String)> =
        c.query(GUIDE_INSPECT, &[]).unwrap().iter().map(|r| (r.get(0), r.get(2))).collect();
    assert_eq!(
        statuses,
        vec![(101, "ready".into()), (102, "deferred".into()), (103, "deferred".into()), (104, "deferred".into())]
    );
    assert!(g.claim(&mut c, 100).is_empty());

    // The delay is over and 101 fails permanently: dead releases 102, then 103 and 104.
    g.make_due(&mut c);
    let mut log = Vec::new();
    loop {
        let batch = g.claim(&mut c, 100);
        if batch.is_empty() {
            break;
        }
        log.extend(run_result(&mut c, &g, &batch, |d| if d.message_id == 101 { Outcome::Dead } else { Outcome::Ack }));
    }
    assert_eq!(log, vec![101, 102, 103, 104]);
    let statuses: Vec<(i64, String)> =
        c.query(GUIDE_INSPECT, &[]).unwrap().iter().map(|r| (r.get(0), r.get(2))).collect();
    assert_eq!(statuses, vec![(101, "dead".into())], "the dead row stays for triage");
}

#[test]
fn guide_exclusive_lets_102_overtake_the_retry_of_101() {
    let mut c = guide_database();
    let g = apply_balance_stage(&mut c, "exclusive");
    let (first, second) = (
        g.stream.produce(&mut c, json!({"delta": -500}), Some("acct-42")),
        g.stream.produce(&mut c, json!({"delta": 200}), Some("acct-42")),
    );
    let batch = g.claim(&mut c, 100);
    assert_eq!(ids(&batch), vec![first, second]);
    assert_eq!(batch[1].run_after, Some(first), "one key lease: same-key rows run one after another");
    assert_eq!(
        run_result(&mut c, &g, &batch, |d| if d.message_id == first { Outcome::Fail } else { Outcome::Ack }),
        vec![first]
    );
    let next = g.claim(&mut c, 100);
    assert_eq!(ids(&next), vec![second], "the failure released the key before 101's retry is due");
    assert!(g.ack(&mut c, &next[0]));
    g.make_due(&mut c);
    let retry = g.claim(&mut c, 100);
    assert_eq!((ids(&retry), retry[0].attempt), (vec![first], 1));
}

#[test]
fn ordered_key_waits_while_another_consumer_holds_its_lane() {
    let mut c = connect();
    let mut other = connect();
    let s = Stream::create(&mut c, "ordered-lanes");
    let g = s.group(&mut c, "g", Some("ordered"));
    assert_ne!(s.lane(&mut c, "k"), s.lane(&mut c, "other"));
    let first = s.produce(&mut c, json!({}), Some("k"));
    let a = g.claim(&mut c, 10);
    assert_eq!(ids(&a), vec![first]);
    let second = s.produce(&mut c, json!({}), Some("k"));
    let unrelated = s.produce(&mut c, json!({}), Some("other"));

    let b = g.claim(&mut other, 10);
    assert_eq!(ids(&b), vec![unrelated], "{second} waits while {first}'s claim holds their lane");
    assert!(g.statuses(&mut c).is_empty(), "a message of a held lane is not even looked at");
    assert!(g.claim(&mut other, 10).is_empty());

    // Hand-off: the ack frees the lane, so the very next claim gets the successor.
    assert!(g.ack(&mut c, &a[0]));
    let next = g.claim(&mut other, 10);
    assert_eq!(ids(&next), vec![second]);
}

#[test]
fn hand_off_is_immediate_after_a_retry_succeeds() {
    let mut c = connect();
    let s = Stream::create(&mut c, "hand-off");
    let g = s.group(&mut c, "g", Some("ordered"));
    let p = s.produce_many(&mut c, 3, Some("k"));
    let batch = g.claim(&mut c, 10);
    g.fail(&mut c, &batch[0], "x", false, Some("0 seconds"));
    let retry = g.claim(&mut c, 1);
    assert_eq!(ids(&retry), vec![p[0]], "batch 1: the retry alone");
    assert!(g.ack(&mut c, &retry[0]));
    // No maintenance call, no poll interval: the next claim has the successors.
    assert_eq!(ids(&g.claim(&mut c, 10)), p[1..]);
}

#[test]
fn another_key_stuck_in_retry_does_not_stall_an_ordered_key() {
    let mut c = connect();
    let s = Stream::create(&mut c, "per-key");
    let g = s.group(&mut c, "g", Some("ordered"));
    let stuck = s.produce(&mut c, json!({}), Some("stuck"));
    let d = g.claim(&mut c, 10).pop().unwrap();
    g.fail(&mut c, &d, "x", false, Some("1 hour"));
    let d = g.claim(&mut c, 10);
    assert!(d.is_empty());

    // The group's committed cursor is held below `stuck` for an hour...
    let mut free = vec![];
    for _ in 0..3 {
        let id = s.produce(&mut c, json!({}), Some("free"));
        let batch = g.claim(&mut c, 10);
        assert_eq!(ids(&batch), vec![id], "...but key 'free' has no unresolved predecessor and runs at once");
        assert!(g.ack(&mut c, &batch[0]));
        free.push(id);
    }
    // Even when `free`'s earlier message is pending in another range, only `free` is checked.
    let mut other = connect();
    let a = s.produce(&mut c, json!({}), Some("free"));
    let held = g.claim(&mut c, 10);
    let b = s.produce(&mut c, json!({}), Some("free"));
    assert!(g.claim(&mut other, 10).is_empty(), "{b} waits for {a}");
    assert!(g.ack(&mut c, &held[0]));
    assert_eq!(ids(&g.claim(&mut other, 10)), vec![b]);
    assert_eq!(g.cursor(&mut c).1, stuck - 1, "committed is still held by the stuck key");
}

#[test]
fn an_expired_range_mid_chain_is_redelivered_before_any_later_message_runs() {
    let mut c = connect();
    let mut b = connect();
    let mut late = connect();
    let s = Stream::create(&mut c, "mid-chain");
    let g = s.group(&mut c, "g", Some("ordered"));
    let p = s.produce_many(&mut c, 3, Some("k"));

    // Consumer A runs the first row of its chain, then dies.
    let a = g.claim(&mut c, 10);
    assert_eq!(ids(&a), p);
    assert!(g.ack(&mut c, &a[0]));
    let later = s.produce(&mut c, json!({}), Some("k"));
    // While A's lease is live, a later message of the key waits.
    assert!(g.claim(&mut late, 10).is_empty());
    g.expire_leases(&mut c);

    // B gets A's unresolved rows again, as a chain, and the later message at the chain's end.
    let redelivered = g.claim(&mut b, 10);
    assert_eq!(ids(&redelivered), vec![p[1], p[2], later]);
    assert_eq!((redelivered[0].attempt, redelivered[2].attempt), (1, 0));
    let chain: Vec<Option<i64>> = redelivered.iter().map(|d| d.run_after).collect();
    assert_eq!(chain, vec![None, Some(p[1]), Some(p[2])]);
    assert!(g.claim(&mut late, 10).is_empty(), "B holds the key's lane");
    assert!(!g.ack(&mut c, &a[1]), "A's stale outcome changes nothing");
    g.ack_batch(&mut b, &redelivered);
    assert!(g.claim(&mut late, 10).is_empty());
    assert_eq!(g.cursor(&mut c), (later, later));
}

#[test]
fn exclusive_admits_one_delivery_per_key_across_consumers() {
    let mut c = connect();
    let mut other = connect();
    let s = Stream::create(&mut c, "exclusive");
    let g = s.group(&mut c, "g", Some("exclusive"));
    let first = s.produce(&mut c, json!({}), Some("k"));
    let a = g.claim(&mut c, 10);
    let second = s.produce(&mut c, json!({}), Some("k"));
    let free = s.produce(&mut c, json!({}), Some("other"));
    assert_eq!(ids(&g.claim(&mut other, 10)), vec![free], "{second} waits for the key lease");
    assert!(g.claim(&mut other, 10).is_empty());
    assert!(g.ack(&mut c, &a[0]));
    assert_eq!(ids(&g.claim(&mut other, 10)), vec![second], "the ack released the key");
    assert!(first < second);
}

#[test]
fn an_expired_key_lease_can_be_taken_over() {
    let mut c = connect();
    let mut other = connect();
    let s = Stream::create(&mut c, "exclusive-expiry");
    let g = s.group(&mut c, "g", Some("exclusive"));
    s.produce(&mut c, json!({}), Some("k"));
    let a = g.claim(&mut c, 10);
    s.produce(&mut c, json!({}), Some("k"));
    assert!(g.claim(&mut other, 10).is_empty());
    g.expire_leases(&mut c);
    g.make_due(&mut c);
    let taken = g.claim(&mut other, 10);
    assert_eq!(taken.len(), 2, "the dead consumer's message and the waiting one, chained");
    assert_eq!(taken[1].run_after, Some(taken[0].message_id));
    assert!(!g.ack(&mut c, &a[0]));
}

#[test]
fn parallel_same_key_messages_run_concurrently() {
    let mut c = connect();
    let mut other = connect();
    let s = Stream::create(&mut c, "parallel");
    let g = s.group(&mut c, "g", None);
    let first = s.produce(&mut c, json!({}), Some("k"));
    let a = g.claim(&mut c, 10);
    let second = s.produce(&mut c, json!({}), Some("k"));
    let b = g.claim(&mut other, 10);
    assert_eq!((ids(&a), ids(&b)), (vec![first], vec![second]), "a key alone does not request ordering");
    assert!(b[0].run_after.is_none());
    assert_eq!(b[0].concurrency, "parallel");
}

#[test]
fn the_group_override_covers_every_producer() {
    let mut c = connect();
    let s = Stream::create(&mut c, "override");
    let own = s.group(&mut c, "own-requests", None);
    let ordered = s.group(&mut c, "ordered", Some("ordered"));
    let p = [
        s.produce_with(&mut c, json!({}), Some("k"), Some("exclusive"), false).unwrap().unwrap(),
        s.produce_with(&mut c, json!({}), Some("k"), None, false).unwrap().unwrap(),
        s.produce_with(&mut c, json!({}), None, Some("parallel"), false).unwrap().unwrap(),
    ];
    let mine = own.claim(&mut c, 10);
    let policies: Vec<&str> = mine.iter().map(|d| d.concurrency.as_str()).collect();
    assert_eq!(policies, vec!["exclusive", "parallel", "parallel"], "each message's own request");
    let theirs = ordered.claim(&mut c, 10);
    let policies: Vec<&str> = theirs.iter().map(|d| d.concurrency.as_str()).collect();
    assert_eq!(policies, vec!["ordered", "ordered", "parallel"], "the override, but keyless stays parallel");
    assert_eq!(theirs[1].run_after, Some(p[0]));
}

/// Whether anything could block a key is read from the queue's index of unresolved rows
/// (src/key_gate/any_blocker.rs). An index a DBA rebuilt under that name with a narrower
/// predicate, or dropped, would hide a waiting retry: the claim asks through a statement instead,
/// and the key still waits.
#[test]
fn a_retry_holds_its_key_whatever_became_of_the_queues_index_of_unresolved_rows() {
    let mut c = connect();
    for shape in ["as installed", "narrower", "dropped", "wider"] {
        let s = Stream::create(&mut c, "unresolved-index");
        let g = s.group(&mut c, "g", Some("ordered"));
        let (queue, index) = (s.table("exception_queue"), format!("{}_unresolved_idx", s.table("exception_queue")));
        let rebuilt = |predicate: &str| {
            format!(
                "DROP INDEX {index}; CREATE INDEX {} ON {queue} (consumer_group_id, message_id) WHERE {predicate};",
                index.trim_start_matches("sqlstreams.")
            )
        };
        match shape {
            "narrower" => c.batch_execute(&rebuilt("status IN ('inflight', 'deferred')")).unwrap(),
            "dropped" => c.batch_execute(&format!("DROP INDEX {index}")).unwrap(),
            "wider" => c.batch_execute(&rebuilt("status IN ('dead', 'deferred', 'inflight', 'ready')")).unwrap(),
            _ => {}
        }
        let first = s.produce(&mut c, json!({}), Some("k"));
        let d = g.claim(&mut c, 10);
        assert_eq!(ids(&d), vec![first], "{shape}");
        assert_eq!(g.fail(&mut c, &d[0], "x", false, Some("1 hour")).as_deref(), Some("ready"), "{shape}");
        let second = s.produce(&mut c, json!({}), Some("k"));
        assert!(g.claim(&mut c, 10).is_empty(), "{shape}: {second} waits for the retry of {first}");
        g.make_due(&mut c);
        let chain = g.claim(&mut c, 10);
        assert_eq!(ids(&chain), vec![first, second], "{shape}: the retry, then its key's next");
        assert_eq!(chain[1].run_after, Some(first), "{shape}");
    }
}

#[test]
fn ordered_waits_for_an_earlier_parallel_message_of_its_key() {
    let mut c = connect();
    let s = Stream::create(&mut c, "mixed");
    let g = s.group(&mut c, "g", None);
    let par = s.produce_with(&mut c, json!({}), Some("k"), Some("parallel"), false).unwrap().unwrap();
    let ord = s.produce_with(&mut c, json!({}), Some("k"), Some("ordered"), false).unwrap().unwrap();
    let batch = g.claim(&mut c, 10);
    assert_eq!(ids(&batch), vec![par], "{ord} must not overtake {par}");
    assert!(g.ack(&mut c, &batch[0]));
    assert_eq!(ids(&g.claim(&mut c, 10)), vec![ord]);
}

/// An exclusive message never runs beside a delivery of its key, a parallel one of the same
/// claim result included (docs/semantics.md, "Mixing policies on one key").
#[test]
fn exclusive_waits_for_a_parallel_message_of_its_key_in_the_same_result() {
    let mut c = connect();
    let s = Stream::create(&mut c, "mixed-exclusive");
    let g = s.group(&mut c, "g", None);
    let par = s.produce_with(&mut c, json!({}), Some("k"), Some("parallel"), false).unwrap().unwrap();
    let exc = s.produce_with(&mut c, json!({}), Some("k"), Some("exclusive"), false).unwrap().unwrap();
    let batch = g.claim(&mut c, 10);
    assert_eq!(ids(&batch), vec![par], "{exc} must not run beside {par}");
    assert!(g.ack(&mut c, &batch[0]));
    assert_eq!(ids(&g.claim(&mut c, 10)), vec![exc], "woken by the ack");
}

#[test]
fn compaction_supersedes_deferred_updates() {
    let mut c = connect();
    let s = Stream::create(&mut c, "compaction");
    let g = s.group(&mut c, "g", Some("exclusive"));
    let parallel = s.group(&mut c, "parallel", None);
    let produce = |c: &mut Client, v: i32| s.produce_with(c, json!({"v": v}), Some("k"), None, true).unwrap().unwrap();
    let first = produce(&mut c, 1);
    let running = g.claim(&mut c, 10);
    let second = produce(&mut c, 2);
    let third = produce(&mut c, 3);
    assert!(g.claim(&mut c, 10).is_empty());
    assert!(g.ack(&mut c, &running[0]));
    let latest = g.claim(&mut c, 10);
    assert_eq!(ids(&latest), vec![third]);
    assert_eq!(latest[0].payload, json!({"v": 3}));
    assert_eq!(g.statuses(&mut c), vec![(second, "superseded".into())], "{third} is a first delivery: no row");
    // A group claiming all three at once runs only the head.
    assert_eq!(ids(&parallel.claim(&mut c, 10)), vec![third]);
    assert!(first < second);
}

#[test]
fn compaction_ignores_non_compacted_messages_and_ordered_groups() {
    let mut c = connect();
    let s = Stream::create(&mut c, "compaction-mixed");
    let ordered = s.group(&mut c, "ordered", Some("ordered"));
    let exclusive = s.group(&mut c, "exclusive", Some("exclusive"));
    let compacted = s.produce_with(&mut c, json!({}), Some("k"), None, true).unwrap().unwrap();
    let plain = s.produce_with(&mut c, json!({}), Some("k"), None, false).unwrap().unwrap();
    let head = s.produce_with(&mut c, json!({}), Some("k"), None, true).unwrap().unwrap();
    // An ordered group must run every message, compacted or not.
    assert_eq!(ids(&ordered.claim(&mut c, 10)), vec![compacted, plain, head]);
    // Others skip only compacted messages that are no longer the head.
    assert_eq!(ids(&exclusive.claim(&mut c, 10)), vec![plain, head]);
}

#[test]
fn maintain_clears_the_lane_hold_of_a_consumer_that_never_came_back() {
    let mut c = connect();
    let s = Stream::create(&mut c, "lane-hold-clear");
    let g = s.group(&mut c, "g", Some("exclusive"));
    s.produce(&mut c, json!({}), Some("k"));
    let crashed = g.claim(&mut c, 10);
    assert_eq!(crashed.len(), 1);
    let leases = |c: &mut Client| -> Vec<String> {
        c.query("SELECT kind FROM sqlstreams.open_leases($1, $2) ORDER BY kind", &[&s.name, &g.name])
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect()
    };
    assert_eq!(leases(&mut c), vec!["lane", "range"]);
    g.expire_leases(&mut c);
    let cleared: i64 = c
        .query_one("SELECT lane_holds_cleared FROM sqlstreams.maintain() WHERE stream = $1", &[&s.name])
        .unwrap()
        .get(0);
    assert_eq!(cleared, 1);
    assert_eq!(leases(&mut c), vec!["range"], "the expired range waits for its reclaim; the lane hold is gone");
    let again = g.claim(&mut c, 10);
    assert_eq!((ids(&again), again[0].attempt), (ids(&crashed), 1), "the lane is free for the reclaim");
    assert!(g.ack(&mut c, &again[0]));
    assert!(leases(&mut c).is_empty(), "the last ack frees the lane");
}

#[test]
fn the_longest_key_survives_every_failure_path() {
    let mut c = connect();
    let key = "k".repeat(1024);
    for policy in ["exclusive", "ordered"] {
        let s = Stream::create(&mut c, "long-key");
        let g = s.group_with(&mut c, policy, Some(policy), 1);
        let first = s.produce(&mut c, json!({}), Some(&key));
        let second = s.produce(&mut c, json!({}), Some(&key));
        let batch = g.claim(&mut c, 1);
        assert_eq!(ids(&batch), vec![first]);
        // Another consumer finds the key busy: the second message is deferred (indexed by key).
        assert!(g.claim(&mut c, 10).is_empty());
        assert_eq!(g.fail(&mut c, &batch[0], "boom", false, Some("0 seconds")).as_deref(), Some("ready"));
        g.make_due(&mut c);
        let retry = g.claim(&mut c, 10);
        assert!(retry.iter().any(|d| d.message_id == first), "{policy}: {retry:?}");
        g.expire_leases(&mut c);
        let rest = g.drain(&mut c);
        assert!(rest.contains(&second), "{policy}: {rest:?}");
        assert!(g.statuses(&mut c).iter().all(|(id, s)| *id == first && s == "dead"), "{policy}");
        assert!(s.produce_with(&mut c, json!({}), Some(&format!("{key}x")), None, false).is_err());
    }
}

#[test]
fn a_quarantined_ordered_message_holds_its_key_in_the_claim_that_quarantines_it() {
    let mut c = connect();
    let s = Stream::create(&mut c, "quarantine-ordered");
    let g = s.group(&mut c, "g", Some("ordered")); // max_reclaims = 2
    let first = s.produce_many(&mut c, 2, Some("k"));
    for _ in 0..3 {
        assert_eq!(ids(&g.claim(&mut c, 10)), first);
        g.expire_leases(&mut c);
    }
    let later = s.produce(&mut c, json!({}), Some("k"));
    // This claim quarantines 1 and 2 and takes 3 fresh: 3 must wait behind them.
    assert!(g.claim(&mut c, 10).is_empty(), "3 must not overtake its quarantined predecessors");
    let mut ran = vec![];
    for _ in 0..5 {
        for d in g.claim(&mut c, 10) {
            ran.push(d.message_id);
            assert!(g.ack(&mut c, &d));
        }
    }
    assert_eq!(ran, vec![first[0], first[1], later], "in key order, each quarantined message alone");
}

#[test]
fn a_delay_that_spends_the_budget_still_lets_the_chain_go_on() {
    let mut c = connect();
    let s = Stream::create(&mut c, "delay-budget-chain");
    let id: i64 =
        c.query_one("SELECT sqlstreams.create_group($1, 'g', 'ordered', max_delays => 0)", &[&s.name]).unwrap().get(0);
    let g = Group { stream: s.clone(), name: "g".into(), id };
    let p = s.produce_many(&mut c, 2, Some("k"));
    let batch = g.claim(&mut c, 10);
    assert_eq!(batch[1].run_after, Some(p[0]));
    // delay() returns only true: the caller stops its chain, so the server must not leave the
    // successor in the range (it would wait for the lease to run out).
    assert!(g.delay(&mut c, &batch[0], "1 minute"));
    assert_eq!(g.statuses(&mut c), vec![(p[0], "dead".to_string()), (p[1], "deferred".to_string())]);
    let next = g.claim(&mut c, 10);
    assert_eq!((ids(&next), next[0].run_after), (vec![p[1]], None), "the dead predecessor released it at once");
}

/// Many rows deferred behind one blocked ordered key (the size at which the predecessor check
/// used to read every one of them on every claim): nothing of the key runs while it is blocked,
/// other keys flow past it, and once the blocker succeeds every deferred message runs exactly
/// once, in order, a bounded batch of wake-ups at a time.
#[test]
fn a_key_blocked_behind_thousands_of_deferred_rows_keeps_its_order() {
    const BEHIND: usize = 12_000;
    let mut c = connect();
    let s = Stream::create(&mut c, "blocked-many");
    let g = s.group(&mut c, "g", Some("ordered"));
    let head = s.produce(&mut c, json!({"n": "head"}), Some("blocked"));
    let first = g.claim(&mut c, 10);
    assert_eq!(ids(&first), vec![head]);
    assert_eq!(g.fail(&mut c, &first[0], "boom", false, Some("1 hour")).as_deref(), Some("ready"));

    let behind = s.produce_many(&mut c, BEHIND, Some("blocked"));
    let mut free = s.produce_many(&mut c, 30, Some("free"));
    free.extend(s.produce_many(&mut c, 30, None));
    let mut flowed = Vec::new();
    for _ in 0..BEHIND / 1000 + 5 {
        let batch = g.claim(&mut c, 1000);
        assert!(batch.iter().all(|d| d.message_key.as_deref() != Some("blocked")), "the blocked key ran");
        flowed.extend(ids(&batch));
        g.ack_batch(&mut c, &batch);
        let deferred: i64 =
            c.query_one("SELECT deferred FROM sqlstreams.group_status($1, 'g')", &[&s.name]).unwrap().get(0);
        if deferred == BEHIND as i64 && flowed.len() >= free.len() {
            break;
        }
    }
    flowed.sort_unstable();
    assert_eq!(flowed, free, "other keys flow past the blocked one");
    let deferred: i64 =
        c.query_one("SELECT deferred FROM sqlstreams.group_status($1, 'g')", &[&s.name]).unwrap().get(0);
    assert_eq!(deferred, BEHIND as i64, "every later message of the key waits");
    let blocked: (i64, i64) = {
        let r = c
            .query_one("SELECT oldest_message_id, waiting_behind FROM sqlstreams.blocked_keys($1, 'g')", &[&s.name])
            .unwrap();
        (r.get(0), r.get(1))
    };
    assert_eq!(blocked, (head, BEHIND as i64));

    // Its retry comes due (only the head: the rest stays parked behind it) and succeeds.
    c.execute(
        &format!(
            "UPDATE {} SET can_run_after = now() - interval '1 second' WHERE message_id = $1",
            s.table("exception_queue")
        ),
        &[&head],
    )
    .unwrap();
    let retry = g.claim(&mut c, 1000);
    assert_eq!(ids(&retry), vec![head], "the blocker runs alone");
    assert_eq!(retry[0].attempt, first[0].attempt + 1);
    assert!(g.ack(&mut c, &retry[0]));

    let mut ran = Vec::new();
    for _ in 0..BEHIND {
        let batch = g.claim(&mut c, 1000);
        if batch.is_empty() {
            break;
        }
        // One chain per result: each row runs after the one before it.
        for pair in batch.windows(2) {
            assert_eq!(pair[1].run_after, Some(pair[0].message_id), "a result of one key is one chain");
        }
        ran.extend(ids(&batch));
        assert_eq!(g.ack_batch(&mut c, &batch).len(), batch.len());
    }
    assert_eq!(ran, behind, "every deferred message ran once, in order");
    let status = c
        .query_one("SELECT ready + inflight + deferred, lag FROM sqlstreams.group_status($1, 'g')", &[&s.name])
        .unwrap();
    assert_eq!((status.get::<_, i64>(0), status.get::<_, i64>(1)), (0, 0));
}

/// A wake-up reads each parked row of its key once at most, and each row it wakes a few times,
/// also while the planner believes the queue nearly empty (last analyzed while it was). Before, it
/// then read every parked row of the group again for each one it read: with 3,000 parked behind a
/// key's head, 9 million index entries when the head failed again, 2.5 million when it succeeded.
#[test]
fn a_wake_up_reads_each_parked_row_once_at_most() {
    let (stale, analyzed) = (wake_costs(false), wake_costs(true));
    let behind = WAKE_BEHIND as i64;
    assert!(analyzed.0 <= behind + 100, "a failing head read {} index entries, {behind} rows parked", analyzed.0);
    assert!(analyzed.1 < 5 * WAKE_PER_KEY, "waking {WAKE_PER_KEY} rows read {} index entries", analyzed.1);
    assert!(stale.0 < 4 * behind, "stale statistics: a failing head read {} index entries", stale.0);
    assert!(stale.1 < 8 * behind, "stale statistics: waking {WAKE_PER_KEY} rows read {} index entries", stale.1);
}

const WAKE_BEHIND: usize = 3_000;
const WAKE_PER_KEY: i64 = 1_000;

/// Index entries of the queue read by a failure and then the success of a key's head with
/// `WAKE_BEHIND` rows parked behind it, the queue analyzed before they were parked or after.
fn wake_costs(analyze_parked: bool) -> (i64, i64) {
    let mut c = connect();
    let s = Stream::create(&mut c, "wake-cost");
    let g = s.group(&mut c, "g", Some("ordered"));
    let queue = s.table("exception_queue");
    let head = s.produce(&mut c, json!({"n": "head"}), Some("hot"));
    let first = g.claim(&mut c, 10);
    assert_eq!(g.fail(&mut c, &first[0], "boom", false, Some("1 hour")).as_deref(), Some("ready"));
    c.batch_execute(&format!("ANALYZE {queue}; ALTER TABLE {queue} SET (autovacuum_enabled = false)")).unwrap();
    let behind = s.produce_many(&mut c, WAKE_BEHIND, Some("hot"));
    let parked = |c: &mut Client| -> i64 {
        c.query_one(&format!("SELECT count(*) FROM {queue} WHERE parked"), &[]).unwrap().get(0)
    };
    // (Until the last is parked: a claim that found nothing twice would answer the next from
    // memory, which the test's own UPDATE below does not reach.)
    for _ in 0..WAKE_BEHIND / 1000 + 2 {
        if parked(&mut c) == WAKE_BEHIND as i64 {
            break;
        }
        assert!(g.claim(&mut c, 1000).is_empty(), "the key is blocked");
    }
    assert_eq!(parked(&mut c), WAKE_BEHIND as i64, "every later message of the key is parked");
    if analyze_parked {
        c.batch_execute(&format!("ANALYZE {queue}")).unwrap();
    }

    // Runs `outcome` on the head's next delivery; returns the queue's index entries it read.
    let on_the_head = |c: &mut Client, outcome: &str| -> i64 {
        let due = format!("UPDATE {queue} SET can_run_after = now() - interval '1 second' WHERE message_id = $1");
        c.execute(&due, &[&head]).unwrap();
        let retry = g.claim(c, 1000);
        assert_eq!(ids(&retry), vec![head], "the blocker runs alone");
        let sql = outcome.replace("$s", &format!("'{}'", s.name)).replace("$t", &format!("'{}'", retry[0].lease_token));
        let mut tx = c.transaction().unwrap();
        let before = index_entries_read(&mut tx, &queue);
        tx.batch_execute(&format!("SELECT sqlstreams.{}", sql.replace("$id", &head.to_string()))).unwrap();
        let read = index_entries_read(&mut tx, &queue) - before;
        tx.commit().unwrap();
        read
    };
    let failing = on_the_head(&mut c, "fail($s, 'g', $t, $id, 'again', retry_after => '1 hour')");
    assert_eq!(parked(&mut c), WAKE_BEHIND as i64, "nothing woke");
    let succeeding = on_the_head(&mut c, "ack($s, 'g', $t, $id)");
    assert_eq!(parked(&mut c), WAKE_BEHIND as i64 - WAKE_PER_KEY, "one batch of wake-ups");

    let mut ran = Vec::new();
    for _ in 0..WAKE_BEHIND {
        let batch = g.claim(&mut c, 1000);
        if batch.is_empty() {
            break;
        }
        ran.extend(ids(&batch));
        assert_eq!(g.ack_batch(&mut c, &batch).len(), batch.len());
    }
    assert_eq!(ran, behind, "every parked message ran once, in order");
    (failing, succeeding)
}

/// Rows parked for good behind a held dead message, before the group's override became
/// parallel, are woken when the key is released: a group that parks nothing now still wakes what
/// it parked before (it skipped the wake-up, and they stayed parked with nothing due).
#[test]
fn rows_parked_before_the_override_became_parallel_are_still_woken() {
    let mut c = connect();
    let s = Stream::create(&mut c, "parked-then-parallel");
    let g = s.group(&mut c, "g", Some("ordered"));
    c.query_one("SELECT sqlstreams.alter_group($1, 'g', on_dead => 'hold')", &[&s.name]).unwrap();
    let produced = s.produce_many(&mut c, 4, Some("k"));
    let first = g.claim(&mut c, 10);
    assert_eq!(ids(&first), vec![produced[0]]);
    assert_eq!(g.fail(&mut c, &first[0], "poison", true, None).as_deref(), Some("dead"));
    assert!(g.claim(&mut c, 10).is_empty(), "the key stops at its dead message");
    c.query_one("SELECT sqlstreams.alter_group($1, 'g', concurrency_override => 'parallel')", &[&s.name]).unwrap();
    c.query_one("SELECT sqlstreams.alter_group($1, 'g', on_dead => 'release')", &[&s.name]).unwrap();
    assert_eq!(ids(&g.claim(&mut c, 10)), produced[1..].to_vec(), "released, and run");
}

/// Exclusive rows parked behind their key's delivery are woken by its outcome, also after the
/// group's override became ordered (the rows keep their own policy): here the delivery fails
/// with a retry in an hour, and they run at once, not at their timer (the delivery's lease).
#[test]
fn exclusive_rows_parked_before_the_override_became_ordered_wake_at_the_outcome() {
    let mut c = connect();
    let s = Stream::create(&mut c, "exclusive-then-ordered");
    let g = s.group(&mut c, "g", None);
    let head = s.produce_with(&mut c, json!({}), Some("k"), Some("parallel"), false).unwrap().unwrap();
    let first = g.try_claim(&mut c, 1, "10 minutes").unwrap();
    assert_eq!(ids(&first), vec![head]);
    let exclusive: Vec<i64> = (0..3)
        .map(|_| s.produce_with(&mut c, json!({}), Some("k"), Some("exclusive"), false).unwrap().unwrap())
        .collect();
    assert!(g.claim(&mut c, 10).is_empty(), "they wait for the key");
    let parked: i64 =
        c.query_one(&format!("SELECT count(*) FROM {} WHERE parked", s.table("exception_queue")), &[]).unwrap().get(0);
    assert_eq!(parked, 3);
    c.query_one("SELECT sqlstreams.alter_group($1, 'g', concurrency_override => 'ordered')", &[&s.name]).unwrap();
    assert_eq!(g.fail(&mut c, &first[0], "later", false, Some("1 hour")).as_deref(), Some("ready"));
    assert_eq!(ids(&g.claim(&mut c, 10)), exclusive, "woken by the outcome");
}

/// An expired delivery that no claim took over still holds its exclusive key: `extend_lease` may
/// renew it. A claim that takes its lane over (reclaiming an older expired range there, and
/// passing the delivery's range by while an outcome records on it) and reads a new message of the
/// key defers it, and the renewed delivery's ack lets it go.
#[test]
fn an_expired_delivery_not_taken_over_still_holds_its_exclusive_key() {
    let mut c = connect();
    let s = Stream::create(&mut c, "exclusive-renewed");
    let g = s.group(&mut c, "g", Some("exclusive"));
    let lane = s.lane(&mut c, "j");
    let k = (0..).map(|i| format!("k{i}")).find(|k| s.lane(&mut c, k) == lane).unwrap();
    let m1 = s.produce(&mut c, json!({}), Some("j"));
    assert_eq!(ids(&g.claim(&mut c, 10)), vec![m1], "a consumer that dies");
    g.expire_leases(&mut c);
    let m2 = s.produce(&mut c, json!({}), Some(&k));
    let a = g.claim(&mut c, 10);
    assert_eq!(ids(&a), vec![m1, m2], "A takes the lane over: {m1} again, and {m2}");
    g.expire_leases(&mut c);
    let m3 = s.produce(&mut c, json!({}), Some(&k));
    // An outcome of A's holds the row of its range of m2 (a claim passes a locked range by).
    let mut outcome = connect();
    let mut recording = outcome.transaction().unwrap();
    recording
        .execute(&format!("SELECT 1 FROM {} WHERE first_id = $1 FOR UPDATE", s.table("range_lease")), &[&m2])
        .unwrap();
    let b = g.claim(&mut c, 10);
    recording.rollback().unwrap();
    assert_eq!(
        ids(&b),
        vec![m1],
        "B takes {m1} over (A's older range); {m3} waits: A's expired range of {m2} was not taken over"
    );
    assert!(c
        .query_one("SELECT sqlstreams.extend_lease($1, 'g', $2)", &[&s.name, &a[0].lease_token])
        .unwrap()
        .get::<_, bool>(0));
    let live: i64 = c
        .query_one(
            &format!(
                "SELECT count(*) FROM {} WHERE lease_expires_at > now() AND $1 = ANY(pending_keys)",
                s.table("range_lease")
            ),
            &[&k],
        )
        .unwrap()
        .get(0);
    assert_eq!(live, 1, "one live delivery of {k}");
    assert!(g.ack(&mut c, &a[1]), "A's renewed delivery of {m2}");
    assert!(g.ack(&mut c, &b[0]));
    g.make_due(&mut c);
    assert_eq!(ids(&g.claim(&mut c, 10)), vec![m3], "{m3} once {m2} resolved");
}

/// A consumer that claimed a big batch dies; consumers with smaller batches take its expired
/// ranges over part by part, each splitting one. The rest of a split range is taken over too,
/// by no one: an exclusive key of the part taken does not wait for it. So a claim hands out work
/// every time while work is left (rather than deferring its messages one by one behind the
/// rest), no key is ever in two live deliveries, and nothing is lost.
#[test]
fn smaller_batches_take_over_expired_exclusive_ranges_without_waiting_for_their_rest() {
    let mut c = connect();
    let s = Stream::create(&mut c, "exclusive-takeover");
    let g = s.group(&mut c, "g", Some("exclusive"));
    let produced: std::collections::BTreeSet<i64> =
        (0..60).map(|i| s.produce(&mut c, json!({}), Some(&format!("k{}", i % 7)))).collect();
    assert_eq!(g.claim(&mut c, 100).len(), 60, "the consumer that dies");
    g.expire_leases(&mut c);
    let mut acked = std::collections::BTreeSet::new();
    for round in 0.. {
        assert!(round < 60, "the takeover ends");
        // Two consumers, the second claiming while the first's deliveries run.
        let first = g.claim(&mut c, 3);
        if acked.len() < produced.len() {
            assert!(!first.is_empty(), "round {round}: work is left, and no live delivery holds a key");
        }
        let second = g.claim(&mut c, 3);
        let twice = keys_in_two_live_deliveries(&mut c, &s);
        assert!(twice.is_empty(), "round {round}: {twice:?} in two live deliveries");
        for d in first.iter().chain(&second) {
            assert!(g.ack(&mut c, d), "round {round}: {}", d.message_id);
            assert!(acked.insert(d.message_id), "round {round}: {} delivered twice", d.message_id);
        }
        if first.is_empty() && second.is_empty() {
            break;
        }
    }
    assert_eq!(acked, produced, "every message, once");
}

/// Keys of `s` in more than one live delivery (a range or a row whose lease has not run out).
fn keys_in_two_live_deliveries(c: &mut Client, s: &Stream) -> Vec<String> {
    c.query(
        &format!(
            "SELECT key FROM (SELECT DISTINCT r.lease_token, k.key FROM {r} r, unnest(r.pending_keys) k(key)
                              WHERE r.lease_expires_at > now()
                              UNION SELECT lease_token, message_key FROM {e}
                              WHERE status = 'inflight' AND lease_expires_at > now()) live
             GROUP BY key HAVING count(*) > 1",
            r = s.table("range_lease"),
            e = s.table("exception_queue")
        ),
        &[],
    )
    .unwrap()
    .iter()
    .map(|r| r.get(0))
    .collect()
}

/// A consumer dies holding six deliveries of exception rows of one exclusive key (given back
/// and claimed again, chained in its result). Claims of two take them over two at a time: each
/// takes the rest over too, under a token no consumer holds, so the two it took run at once
/// (left under the dead consumer's token, the rest would hold the key, and each claim would
/// defer the rows it took behind them). The dead consumer can neither renew nor resolve them.
#[test]
fn smaller_batches_take_over_expired_deliveries_of_an_exclusive_key_without_waiting_for_the_rest() {
    let mut c = connect();
    let s = Stream::create(&mut c, "exclusive-rows-takeover");
    let g = s.group(&mut c, "g", Some("exclusive"));
    let produced: Vec<i64> = (0..6).map(|_| s.produce(&mut c, json!({}), Some("k"))).collect();
    let first = g.claim(&mut c, 100);
    let given: Vec<i64> = c
        .query_one("SELECT sqlstreams.release($1, 'g', $2, $3)", &[&s.name, &first[0].lease_token, &produced])
        .unwrap()
        .get(0);
    assert_eq!(given, produced, "rows now");
    let dead = g.claim(&mut c, 100);
    assert_eq!(ids(&dead), produced, "the consumer that dies, with six rows in flight");
    g.expire_leases(&mut c);
    let mut acked = Vec::new();
    for round in 0..3 {
        let taken = g.claim(&mut c, 2);
        assert_eq!(ids(&taken), produced[2 * round..2 * round + 2], "round {round}: two, at once");
        assert_eq!(taken[1].run_after, Some(taken[0].message_id), "round {round}: chained");
        let twice = keys_in_two_live_deliveries(&mut c, &s);
        assert!(twice.is_empty(), "round {round}: {twice:?} in two live deliveries");
        if round == 0 {
            let renewed: bool = c
                .query_one("SELECT sqlstreams.extend_lease($1, 'g', $2)", &[&s.name, &dead[0].lease_token])
                .unwrap()
                .get(0);
            assert!(!renewed, "the dead consumer holds nothing any more");
            assert!(!g.ack(&mut c, &dead[5]), "nor resolves what it held");
            let left: Vec<uuid::Uuid> = c
                .query(
                    "SELECT DISTINCT lease_token FROM sqlstreams.open_leases($1, 'g') WHERE kind = 'exception'
                       AND lease_expires_at <= now()",
                    &[&s.name],
                )
                .unwrap()
                .iter()
                .map(|r| r.get(0))
                .collect();
            assert_eq!(left.len(), 1, "the four left, under one token");
            assert_eq!(left[0].get_version_num(), 8, "no claim hands such a token out");
            let (name, m) = (&s.name, &produced[5]);
            let one = |c: &mut Client, sql: &str| c.query_one(sql, &[name, &left[0], m]).unwrap();
            assert!(!one(&mut c, "SELECT sqlstreams.extend_lease($1, 'g', $2) AND $3::int8 > 0").get::<_, bool>(0));
            assert!(!one(&mut c, "SELECT sqlstreams.ack($1, 'g', $2, $3)").get::<_, bool>(0));
            assert!(!one(&mut c, "SELECT sqlstreams.delay($1, 'g', $2, $3, '1 minute')").get::<_, bool>(0));
            assert_eq!(one(&mut c, "SELECT sqlstreams.fail($1, 'g', $2, $3, 'no')").get::<_, Option<String>>(0), None);
            let released = "SELECT cardinality(sqlstreams.release($1::text, 'g', $2::uuid, ARRAY[$3::int8]))";
            assert_eq!(one(&mut c, released).get::<_, i32>(0), 0);
            assert!(!one(&mut c, "SELECT sqlstreams.break_lease($1, 'g', $2) AND $3::int8 > 0").get::<_, bool>(0));
            let carried = "SELECT count(*) FROM sqlstreams.claim($1, 'g', 10, ack_lease_token => $2,
                                                             ack_message_ids => ARRAY[$3::int8])";
            assert_eq!(one(&mut c, carried).get::<_, i64>(0), 0, "the lane is held; the carried ack recorded nothing");
            let still: i64 = c
                .query_one(
                    &format!(
                        "SELECT count(*) FROM {} WHERE status = 'inflight' AND lease_token = $1 AND lease_expires_at <= now()",
                        s.table("exception_queue")
                    ),
                    &[&left[0]],
                )
                .unwrap()
                .get(0);
            assert_eq!(still, 4, "they wait, expired, for the next claim");
        }
        for d in &taken {
            assert!(g.ack(&mut c, d));
            acked.push(d.message_id);
        }
    }
    assert_eq!(acked, produced, "every message once");
    assert!(g.claim(&mut c, 2).is_empty());
}

/// Claims of one, two at a time, until every message of `produced` (one exclusive key) is
/// acked: the first of each two must hand a message out, and no key may be in two live
/// deliveries.
fn claims_of_one_each_hand_out_work(c: &mut Client, g: &Group, produced: &[i64]) {
    let mut acked = Vec::new();
    for round in 0..produced.len() {
        let taken = g.claim(c, 1);
        assert_eq!(taken.len(), 1, "round {round}, after {acked:?}: work is left and no live delivery holds k");
        let beside = g.claim(c, 1);
        let twice = keys_in_two_live_deliveries(c, &g.stream);
        assert!(twice.is_empty(), "round {round}: {twice:?} in two live deliveries");
        for d in taken.iter().chain(&beside) {
            assert!(g.ack(c, d));
            acked.push(d.message_id);
        }
    }
    assert!(g.claim(c, 1).is_empty());
    acked.sort_unstable();
    assert_eq!(acked, produced, "every message once");
}

/// Retries of an exclusive key (1 to 3) fall due while a consumer that died holds a later range
/// of the key (4 to 8). Claims of one take the lane's oldest work, a retry, and take the lane's
/// expired range over too: the batch has no room for it, so it is left, expired, under a token
/// no consumer holds, and holds the key no more. Each claim hands a message out (before, the
/// retries were deferred behind the range, which the claims never reached: the second adversary
/// saw 1,000 retries and 5,000 empty claims a second without end).
#[test]
fn retries_before_a_dead_consumers_range_run_when_its_lane_is_taken() {
    let mut c = connect();
    let s = Stream::create(&mut c, "exclusive-retries-before-range");
    let g = s.group(&mut c, "g", Some("exclusive"));
    let mut produced: Vec<i64> = (0..3).map(|_| s.produce(&mut c, json!({}), Some("k"))).collect();
    for d in g.claim(&mut c, 10).iter().rev() {
        assert_eq!(g.fail(&mut c, d, "later", false, Some("1 hour")).as_deref(), Some("ready"));
    }
    produced.extend((0..5).map(|_| s.produce(&mut c, json!({}), Some("k"))));
    let dead = g.claim(&mut c, 10);
    assert_eq!(ids(&dead), produced[3..], "the consumer that dies; the retries wait");
    assert!(g.ack(&mut c, &dead[1]), "before it dies");
    let acked_before = produced.remove(4);
    g.expire_leases(&mut c);
    g.make_due(&mut c);
    let ranges =
        "SELECT first_id, lease_token, lease_expires_at FROM sqlstreams.open_leases($1, 'g') WHERE kind = 'range'";
    let expired: std::time::SystemTime = c.query_one(ranges, &[&s.name]).unwrap().get(2);
    let first = g.claim(&mut c, 1);
    assert_eq!(ids(&first), produced[..1], "the lane's oldest work");
    let left: Vec<(i64, uuid::Uuid, std::time::SystemTime)> =
        c.query(ranges, &[&s.name]).unwrap().iter().map(|r| (r.get(0), r.get(1), r.get(2))).collect();
    assert_eq!(left.len(), 1);
    assert_eq!((left[0].0, left[0].1.get_version_num()), (produced[3], 8), "the range, taken over and left");
    assert_eq!(left[0].2, expired, "expired since its consumer's lease ran out, as a split's rest");
    assert!(!g.ack(&mut c, &dead[0]), "the dead consumer's outcome: the lease was lost");
    let done: i64 = c
        .query_one(
            &format!("SELECT count(*) FROM {} WHERE lease_token = $1", s.table("range_done")),
            &[&dead[0].lease_token],
        )
        .unwrap()
        .get(0);
    assert_eq!(done, 0, "its recorded outcome ({acked_before}) went with the range it left");
    assert!(g.ack(&mut c, &first[0]));
    claims_of_one_each_hand_out_work(&mut c, &g, &produced[1..]);
}

/// The same with a dead consumer's expired deliveries of exception rows: retries 5 and 6 of an
/// exclusive key fell due first and went to a consumer that died; 1 to 4 fall due after. Claims
/// of one take 1 first, and take the lane's expired deliveries over with it.
#[test]
fn retries_before_a_dead_consumers_rows_run_when_its_lane_is_taken() {
    let mut c = connect();
    let s = Stream::create(&mut c, "exclusive-retries-before-rows");
    let g = s.group(&mut c, "g", Some("exclusive"));
    let produced: Vec<i64> = (0..6).map(|_| s.produce(&mut c, json!({}), Some("k"))).collect();
    for d in g.claim(&mut c, 10).iter().rev() {
        assert_eq!(g.fail(&mut c, d, "later", false, Some("1 hour")).as_deref(), Some("ready"));
    }
    c.execute(
        &format!("UPDATE {} SET can_run_after = now() WHERE message_id = ANY($1)", s.table("exception_queue")),
        &[&produced[4..].to_vec()],
    )
    .unwrap();
    assert_eq!(ids(&g.claim(&mut c, 10)), produced[4..], "the consumer that dies, with the retries due first");
    g.expire_leases(&mut c);
    g.make_due(&mut c);
    claims_of_one_each_hand_out_work(&mut c, &g, &produced);
}

/// A consumer that claimed a big batch dies while later messages of its key wait for their
/// `deliver_after`; by the time its lease has run out they are due. Claims of one take the
/// lane's oldest work first: the dead consumer's range, part by part, before the due rows after
/// it. Each claim hands out a message (taking a due row first would defer it behind the range,
/// claim after claim), in id order for ordered, and nothing is lost.
fn smaller_batches_take_a_lanes_oldest_work_first(concurrency: &str) {
    let mut c = connect();
    let s = Stream::create(&mut c, &format!("{concurrency}-oldest-first"));
    let g = s.group(&mut c, "g", Some(concurrency));
    let mut produced: Vec<i64> = (0..8).map(|_| s.produce(&mut c, json!({}), Some("k"))).collect();
    for _ in 0..4 {
        let later: i64 = c
            .query_one("SELECT sqlstreams.produce($1, '{}', 'k', deliver_after => '1 hour')", &[&s.name])
            .unwrap()
            .get(0);
        produced.push(later);
    }
    assert_eq!(ids(&g.claim(&mut c, 100)), produced[..8], "the consumer that dies; the rest wait for their hour");
    g.expire_leases(&mut c);
    g.make_due(&mut c);
    let mut acked = Vec::new();
    for round in 0..produced.len() {
        let taken = g.claim(&mut c, 1);
        assert_eq!(taken.len(), 1, "round {round}, after {acked:?}: the lane's oldest work");
        assert!(g.ack(&mut c, &taken[0]));
        acked.push(taken[0].message_id);
    }
    assert!(g.claim(&mut c, 1).is_empty());
    if concurrency == "ordered" {
        assert_eq!(acked, produced, "in order");
    }
    acked.sort_unstable();
    assert_eq!(acked, produced, "every message once");
}

#[test]
fn smaller_batches_take_an_ordered_lanes_oldest_work_first() {
    smaller_batches_take_a_lanes_oldest_work_first("ordered");
}

#[test]
fn smaller_batches_take_an_exclusive_lanes_oldest_work_first() {
    smaller_batches_take_a_lanes_oldest_work_first("exclusive");
}

/// Work a claim takes over and leaves for the next claim keeps its keys as a claim writes them:
/// with lz4 where the server has it, whatever the caller's `default_toast_compression`. A range
/// of 100 keys (one lane) of a consumer that died is left whole (a claim of one takes an older
/// retry first), then split (the next claim takes one message of it).
#[test]
fn work_left_for_the_next_claim_keeps_its_keys_compressed_as_a_claim_writes_them() {
    let mut c = connect();
    let name = unique("left-lz4");
    let id: i64 = c.query_one("SELECT sqlstreams.create_stream($1, lanes => 1)", &[&name]).unwrap().get(0);
    let s = Stream { name, id };
    let g = s.group(&mut c, "g", Some("exclusive"));
    let retry = s.produce(&mut c, json!({}), Some("first"));
    let failed = g.claim(&mut c, 1);
    assert_eq!(g.fail(&mut c, &failed[0], "later", false, Some("1 hour")).as_deref(), Some("ready"));
    let keys: Vec<String> = (0..100).map(|i| format!("account-{i:05}")).collect();
    for key in &keys {
        s.produce(&mut c, json!({}), Some(key));
    }
    assert_eq!(g.claim(&mut c, 100).len(), 100, "the consumer that dies");
    g.expire_leases(&mut c);
    g.make_due(&mut c);
    let lz4: bool = c
        .query_one("SELECT 'lz4' = ANY (enumvals) FROM pg_settings WHERE name = 'default_toast_compression'", &[])
        .unwrap()
        .get(0);
    let method = if lz4 { "lz4" } else { "pglz" };
    c.batch_execute("SET default_toast_compression = pglz").unwrap();
    let stored = |c: &mut Client| -> Vec<(i64, Option<String>)> {
        let sql =
            format!("SELECT first_id, pg_column_compression(pending_keys) FROM {} ORDER BY 1", s.table("range_lease"));
        c.query(&sql, &[]).unwrap().iter().map(|r| (r.get(0), r.get(1))).collect()
    };
    let first = g.claim(&mut c, 1);
    assert_eq!(ids(&first), vec![retry], "the lane's oldest work");
    let left = stored(&mut c);
    assert_eq!(left.len(), 1);
    assert_eq!(left[0].1.as_deref(), Some(method), "the range left whole (lz4 on this server: {lz4})");
    assert!(g.ack(&mut c, &first[0]));
    let part = g.claim(&mut c, 1);
    assert_eq!(part.len(), 1);
    let split = stored(&mut c);
    assert_eq!(split.len(), 2, "{split:?}");
    assert_eq!(split[1].1.as_deref(), Some(method), "the rest of the range split (lz4 on this server: {lz4})");
    c.batch_execute("RESET default_toast_compression").unwrap();
}

/// A takeover by a smaller batch leaves two expired ranges in the lane when its consumer dies
/// too (the part it took, and the rest no one holds): ten messages of one ordered key, in ranges
/// of four and six. A claim of `batch` takes them over, oldest first, while it has room: it
/// hands them out in order, and leaves the rest of the second under a token no consumer holds.
fn claim_two_expired_ranges(prefix: &str, batch: i32) {
    let mut c = connect();
    let s = Stream::create(&mut c, prefix);
    let g = s.group(&mut c, "g", Some("ordered"));
    let produced: Vec<i64> = (0..10).map(|_| s.produce(&mut c, json!({}), Some("k"))).collect();
    assert_eq!(ids(&g.claim(&mut c, 100)), produced, "the consumer that dies first");
    g.expire_leases(&mut c);
    assert_eq!(ids(&g.claim(&mut c, 4)), produced[..4], "the one that takes four over, and dies");
    g.expire_leases(&mut c);
    let ranges: i64 = c
        .query_one(&format!("SELECT count(*) FROM {} WHERE lease_expires_at <= now()", s.table("range_lease")), &[])
        .unwrap()
        .get(0);
    assert_eq!(ranges, 2, "the part taken over and the rest");
    let taken = g.claim(&mut c, batch);
    let handed = produced.len().min(batch as usize);
    assert_eq!(ids(&taken), produced[..handed], "the two ranges, oldest first");
    for (d, before) in taken[1..].iter().zip(&taken) {
        assert_eq!(d.run_after, Some(before.message_id), "chained in order");
    }
    let rests: Vec<(i64, uuid::Uuid)> = c
        .query(
            &format!("SELECT first_id, lease_token FROM {} WHERE lease_expires_at <= now()", s.table("range_lease")),
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    match produced.get(handed) {
        Some(&first) => {
            assert_eq!(rests.len(), 1, "{rests:?}");
            assert_eq!((rests[0].0, rests[0].1.get_version_num()), (first, 8), "the rest, no one's");
        }
        None => assert!(rests.is_empty(), "{rests:?}"),
    }
}

#[test]
fn a_claim_takes_over_every_expired_range_of_its_lane_it_has_room_for() {
    claim_two_expired_ranges("ordered-two-expired", 100);
}

#[test]
fn a_claim_splits_the_second_expired_range_of_its_lane_it_has_room_for_a_part_of() {
    claim_two_expired_ranges("ordered-two-expired-split", 6);
}

/// A consumer dies holding an exclusive key's expired range and a later delivery of the key
/// from the exception queue. Claims of one take the range over part by part, and take the
/// token's row over with it (left under the dead consumer's token, it would hold the key and
/// defer the part): each claim hands out a message, and nothing is lost.
#[test]
fn taking_over_a_range_takes_over_its_tokens_rows_in_the_lane() {
    let mut c = connect();
    let s = Stream::create(&mut c, "exclusive-range-and-row");
    let g = s.group(&mut c, "g", Some("exclusive"));
    let produced: Vec<i64> = (0..6).map(|_| s.produce(&mut c, json!({}), Some("k"))).collect();
    let first = g.claim(&mut c, 100);
    assert_eq!(ids(&first), produced);
    let last = produced[5];
    let given: Vec<i64> = c
        .query_one("SELECT sqlstreams.release($1, 'g', $2, ARRAY[$3::int8])", &[&s.name, &first[0].lease_token, &last])
        .unwrap()
        .get(0);
    assert_eq!(given, vec![last], "the last message waits as a row");
    g.expire_leases(&mut c);
    let dead = g.claim(&mut c, 100);
    assert_eq!(ids(&dead), produced, "the consumer that dies: the range again, and the row");
    g.expire_leases(&mut c);
    claims_of_one_each_hand_out_work(&mut c, &g, &produced);
}

/// Messages 1 and 2 of key `k` in a range of a consumer that dies, and 3 of `k`, produced to
/// wait an hour; the leases run out. A claim of one takes 1, splitting 2 off the expired range,
/// and 3 is made due. Returns the group, the dead consumer's deliveries, the claim's, and the
/// three ids.
fn split_beside_a_due_row(
    c: &mut Client,
    prefix: &str,
    concurrency: &str,
) -> (Group, Vec<Delivery>, Vec<Delivery>, [i64; 3]) {
    let s = Stream::create(c, prefix);
    let g = s.group(c, "g", Some(concurrency));
    let m1 = s.produce(c, json!({}), Some("k"));
    let m2 = s.produce(c, json!({}), Some("k"));
    let m3: i64 =
        c.query_one("SELECT sqlstreams.produce($1, '{}', 'k', deliver_after => '1 hour')", &[&s.name]).unwrap().get(0);
    let dead = g.claim(c, 100);
    assert_eq!(ids(&dead), vec![m1, m2], "the consumer that dies; {m3} waits for its hour");
    g.expire_leases(c);
    let taken = g.claim(c, 1);
    assert_eq!(ids(&taken), vec![m1], "the lane's oldest work");
    g.make_due(c);
    (g, dead, taken, [m1, m2, m3])
}

/// Claims of `g` while another transaction holds the row of the range that starts at `first_id`:
/// a claim passes a locked range by. (An outcome locks its token's ranges, but no outcome acts
/// on a rest's token: here the lock stands in for any transaction that holds the row, to show
/// what the gate decides on its own.)
fn claim_beside_a_locked_range(c: &mut Client, g: &Group, first_id: i64, batch: i32) -> Vec<Delivery> {
    let mut outcome = connect();
    let mut recording = outcome.transaction().unwrap();
    recording
        .execute(
            &format!("SELECT 1 FROM {} WHERE first_id = $1 FOR UPDATE", g.stream.table("range_lease")),
            &[&first_id],
        )
        .unwrap();
    let taken = g.claim(c, batch);
    recording.rollback().unwrap();
    taken
}

/// The rest a claim splits off an expired range is taken over, by no one: the consumer whose
/// lease ran out can neither renew it nor record its outcomes, so an exclusive message of its
/// key runs beside it, and its own message of the key waits for that one when it is handed out
/// again.
#[test]
fn the_rest_of_a_split_range_is_no_ones_and_holds_no_exclusive_key() {
    let mut c = connect();
    let (g, dead, taken, [m1, m2, m3]) = split_beside_a_due_row(&mut c, "exclusive-split-rest", "exclusive");
    let renewed: bool = c
        .query_one("SELECT sqlstreams.extend_lease($1, 'g', $2)", &[&g.stream.name, &dead[0].lease_token])
        .unwrap()
        .get(0);
    assert!(!renewed, "the dead consumer holds nothing any more");
    assert!(!g.ack(&mut c, &dead[1]), "its outcome of {m2}: the lease was lost");
    let live: i64 = c
        .query_one(
            &format!(
                "SELECT count(*) FROM {} WHERE lease_expires_at > now() AND $1 = ANY(pending)",
                g.stream.table("range_lease")
            ),
            &[&m2],
        )
        .unwrap()
        .get(0);
    assert_eq!(live, 0, "{m2} is in no live delivery");
    assert!(g.ack(&mut c, &taken[0]), "{m1}");
    let beside = claim_beside_a_locked_range(&mut c, &g, m2, 10);
    assert_eq!(ids(&beside), vec![m3], "{m3} runs beside the rest of {m2}, which holds no key");
    assert!(g.ack(&mut c, &beside[0]));
    assert_eq!(ids(&g.claim(&mut c, 10)), vec![m2], "{m2} once the key is free");
}

/// An ordered message waits for its predecessor in the rest of a range the claim split (that
/// rest holds no exclusive key, but its messages are still unresolved): a claim that passes the
/// rest by (another transaction holds its row) does not hand out the due message after it.
#[test]
fn a_due_ordered_message_does_not_overtake_its_predecessor_in_a_split_rest() {
    let mut c = connect();
    let (g, _dead, taken, [m1, m2, m3]) = split_beside_a_due_row(&mut c, "ordered-split-rest", "ordered");
    assert!(g.ack(&mut c, &taken[0]), "{m1}");
    let beside = claim_beside_a_locked_range(&mut c, &g, m2, 10);
    assert!(beside.is_empty(), "{m3} waits for {m2}, in the rest: {:?}", ids(&beside));
    g.make_due(&mut c);
    let next = g.claim(&mut c, 10);
    assert_eq!(ids(&next), vec![m2, m3], "{m2} again, and {m3} after it");
    assert_eq!(next[1].run_after, Some(m2), "{m3} starts once {m2} is resolved");
}

/// The rest of a split range is no one's for every claim, not only the one that split it: when
/// the consumer that took the first part over dies too, the next claims take that part over
/// piece by piece, each handing out work while an older rest waits in the lane.
#[test]
fn a_rest_split_by_an_earlier_claim_holds_no_exclusive_key_either() {
    let mut c = connect();
    let s = Stream::create(&mut c, "exclusive-second-death");
    let g = s.group(&mut c, "g", Some("exclusive"));
    let produced: Vec<i64> = (0..10).map(|_| s.produce(&mut c, json!({}), Some("k"))).collect();
    assert_eq!(ids(&g.claim(&mut c, 100)), produced, "the consumer that dies first");
    g.expire_leases(&mut c);
    assert_eq!(ids(&g.claim(&mut c, 5)), produced[..5], "the one that takes the first five over, and dies");
    g.expire_leases(&mut c);
    let mut acked = Vec::new();
    while acked.len() < produced.len() {
        let taken = g.claim(&mut c, 2);
        assert!(!taken.is_empty(), "after {acked:?}: work is left and no live delivery holds k");
        for d in &taken {
            assert!(g.ack(&mut c, d));
            acked.push(d.message_id);
        }
    }
    assert_eq!(acked, produced, "every message once, in order (one lane, one key)");
}

/// A rest's token is listed by `open_leases`, but no call can act with it: whoever names it is
/// answered as for a lease lost, and the rest waits, expired, for the next claim of its lane.
#[test]
fn no_call_acts_with_the_token_of_a_rest() {
    let mut c = connect();
    let (g, _dead, taken, [m1, m2, m3]) = split_beside_a_due_row(&mut c, "exclusive-rest-token", "exclusive");
    assert_eq!(ids(&taken), vec![m1]);
    let rest: uuid::Uuid = c
        .query_one(
            "SELECT lease_token FROM sqlstreams.open_leases($1, 'g') WHERE kind = 'range' AND first_id = $2",
            &[&g.stream.name, &m2],
        )
        .unwrap()
        .get(0);
    assert_eq!(rest.get_version_num(), 8, "no claim hands such a token out");
    let (name, m) = (&g.stream.name, &m2);
    let one = |c: &mut Client, sql: &str| c.query_one(sql, &[name, &rest, m]).unwrap();
    assert!(!one(&mut c, "SELECT sqlstreams.extend_lease($1, 'g', $2) AND $3::int8 > 0").get::<_, bool>(0));
    assert!(!one(&mut c, "SELECT sqlstreams.ack($1, 'g', $2, $3)").get::<_, bool>(0));
    assert!(!one(&mut c, "SELECT sqlstreams.delay($1, 'g', $2, $3, '1 minute')").get::<_, bool>(0));
    assert_eq!(one(&mut c, "SELECT sqlstreams.fail($1, 'g', $2, $3, 'no')").get::<_, Option<String>>(0), None);
    assert_eq!(
        one(&mut c, "SELECT cardinality(sqlstreams.release($1::text, 'g', $2::uuid, ARRAY[$3::int8]))")
            .get::<_, i32>(0),
        0
    );
    assert!(!one(&mut c, "SELECT sqlstreams.break_lease($1, 'g', $2) AND $3::int8 > 0").get::<_, bool>(0));
    let carried = c
        .query(
            "SELECT 1 FROM sqlstreams.claim($1, 'g', 10, ack_lease_token => $2, ack_message_ids => ARRAY[$3::int8])",
            &[name, &rest, m],
        )
        .unwrap();
    assert!(carried.is_empty(), "the lane is held, and the carried ack recorded nothing");
    let expired: bool = c
        .query_one(
            &format!("SELECT lease_expires_at <= now() FROM {} WHERE first_id = $1", g.stream.table("range_lease")),
            &[&m2],
        )
        .unwrap()
        .get(0);
    assert!(expired, "the rest still waits for the next claim");
    for d in &taken {
        assert!(g.ack(&mut c, d));
    }
    g.make_due(&mut c);
    assert_eq!(ids(&g.claim(&mut c, 10)), vec![m2, m3], "{m2} is handed out, unresolved, and {m3} after it");
}
