//! The foundation: produce, range claims, outcomes, the exception queue, leases and cursors.

use postgres::{Client, IsolationLevel};
use sqlstreams_tests::*;

#[test]
fn produce_claim_ack_round_trip() {
    let mut c = connect();
    let s = Stream::create(&mut c, "round-trip");
    let g = s.group(&mut c, "workers", None);
    let a = s.produce(&mut c, json!({"hello": "world"}), None);
    let b = s.produce(&mut c, json!([1, 2, 3]), Some("k"));
    assert_eq!(b, a + 1, "ids increase in call order");

    let batch = g.claim(&mut c, 10);
    assert_eq!(ids(&batch), vec![a, b]);
    assert_eq!(batch[0].payload, json!({"hello": "world"}));
    assert_eq!(batch[1].payload, json!([1, 2, 3]));
    assert_eq!(batch[1].message_key.as_deref(), Some("k"));
    assert!(batch.iter().all(|d| d.attempt == 0 && d.run_after.is_none() && d.concurrency == "parallel"));
    assert_eq!(batch[0].lease_token, batch[1].lease_token, "one lease per claim");

    assert!(g.ack(&mut c, &batch[0]));
    assert!(!g.ack(&mut c, &batch[0]), "a second ack of the same delivery changes nothing");
    assert!(g.ack(&mut c, &batch[1]));
    assert!(g.exception_rows(&mut c).is_empty(), "a first delivery that succeeds writes no exception row");
    assert!(g.claim(&mut c, 10).is_empty());
    assert_eq!(g.cursor(&mut c), (b, b), "everything is handed out and resolved");
}

/// A claim returns every key byte for byte, whatever its length and characters, and the same
/// values through claim_with_metadata and through SQL that works on them (src/srf.rs writes
/// keys up to 126 bytes itself, longer ones as pgrx does).
#[test]
fn a_claim_returns_every_key_as_produced() {
    let mut c = connect();
    let s = Stream::create(&mut c, "key-bytes");
    let groups = [s.group(&mut c, "plain", None), s.group(&mut c, "meta", None), s.group(&mut c, "sql", None)];
    let mut keys: Vec<String> = ["k", "kéy-日本-🙂"].iter().map(|k| k.to_string()).collect();
    keys.extend([24, 25, 125, 126, 127, 128, 1024].iter().map(|n| "k".repeat(*n)));
    keys.push("日".repeat(42)); // 126 bytes in 42 characters
    keys.push("é".repeat(64)); // 128 bytes
    let mut ids: Vec<i64> = keys.iter().map(|k| s.produce(&mut c, json!({}), Some(k))).collect();
    // A key the log stores compressed: a payload that does not compress (hex digits without a
    // repeat, from a fixed generator) makes the row too wide for its page, and the key is what
    // compresses.
    let mut x: u64 = 1;
    let noise: String = (0..1280)
        .map(|_| {
            x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
            char::from_digit((x >> 60) as u32, 16).unwrap()
        })
        .collect();
    keys.push("c".repeat(1024));
    ids.push(s.produce(&mut c, json!({ "noise": noise }), keys.last().map(String::as_str)));
    let compressed =
        format!("SELECT pg_column_compression(message_key) FROM sqlstreams.message_log_{} WHERE id = $1", s.id);
    let compression: Option<String> = c.query_one(&compressed, &[ids.last().unwrap()]).unwrap().get(0);
    assert!(compression.is_some(), "the last key is stored compressed");
    ids.push(s.produce(&mut c, json!({}), None));
    keys.push(String::new()); // no key: NULL
    let expected: Vec<(i64, Option<String>)> =
        ids.iter().zip(&keys).map(|(id, k)| (*id, Some(k.clone()).filter(|k| !k.is_empty()))).collect();
    let claims = [
        ("plain", "SELECT message_id, message_key, concurrency, lease_token FROM sqlstreams.claim($1, $2, 100)"),
        (
            "meta",
            "SELECT message_id, message_key, concurrency, lease_token FROM sqlstreams.claim_with_metadata($1, $2, 100)",
        ),
        (
            "sql",
            "SELECT message_id, message_key || '', upper(concurrency), lease_token::text::uuid
             FROM sqlstreams.claim($1, $2, 100) ORDER BY length(message_key), message_id",
        ),
    ];
    // Each group claims every message, then again once its leases ran out: the second claim
    // hands the expired ranges out again, reading their messages by id.
    for again in [false, true] {
        for (group, sql) in claims {
            let g = groups.iter().find(|g| g.name == group).unwrap();
            if again {
                g.expire_leases(&mut c);
            }
            let rows = c.query(sql, &[&s.name, &group]).unwrap();
            let token: uuid::Uuid = rows[0].get(3);
            let mut returned: Vec<(i64, Option<String>)> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
            returned.sort();
            assert_eq!(returned, expected, "{group} (again: {again}): every key as produced");
            for row in &rows {
                let concurrency: String = row.get(2);
                assert_eq!(concurrency.to_lowercase(), "parallel", "{group}");
                assert_eq!(row.get::<_, uuid::Uuid>(3), token, "{group}: one lease token for the claim");
            }
            // The claim's ranges keep each pending message's key, which outcomes read back.
            let stored = c
                .query(
                    &format!(
                        "SELECT u.id, u.key FROM sqlstreams.range_lease_{} r, unnest(r.pending, r.pending_keys) AS u(id, key)
                         WHERE r.consumer_group_id = $1 AND r.lease_token = $2 ORDER BY u.id",
                        s.id
                    ),
                    &[&g.id, &token],
                )
                .unwrap();
            let stored: Vec<(i64, Option<String>)> = stored.iter().map(|r| (r.get(0), r.get(1))).collect();
            assert_eq!(stored, expected, "{group} (again: {again}): the ranges' keys");
            let reclaims =
                format!("SELECT DISTINCT reclaims FROM sqlstreams.range_lease_{} WHERE lease_token = $1", s.id);
            let reclaims: Vec<i32> = c.query(&reclaims, &[&token]).unwrap().iter().map(|r| r.get(0)).collect();
            assert_eq!(reclaims, vec![i32::from(again)], "{group} (again: {again}): ranges handed out again");
        }
    }
}

/// A range's row lists its messages and their keys: a claim of 100 keys passes the 2 kB at which
/// Postgres compresses a row, and a claim compresses it with lz4 where the server was built with
/// it (pglz took a keyed claim about 4 % of its time), pglz where it was not. The table keeps
/// the default, so that its definition restores on any server, and the caller's setting is
/// left as it was.
#[test]
fn a_range_of_many_keys_is_compressed_with_lz4_where_the_server_has_it() {
    let mut c = connect();
    let name = unique("ranges-lz4");
    let id: i64 = c.query_one("SELECT sqlstreams.create_stream($1, lanes => 1)", &[&name]).unwrap().get(0);
    c.execute("SELECT sqlstreams.create_group($1, 'g', 'ordered')", &[&name]).unwrap();
    let keys: Vec<String> = (0..100).map(|i| format!("account-{i:05}")).collect();
    let payloads: Vec<serde_json::Value> = (0..100).map(|i| json!({ "n": i })).collect();
    c.execute("SELECT sqlstreams.produce_batch($1, $2, $3)", &[&name, &payloads, &keys]).unwrap();
    let lz4: bool = c
        .query_one("SELECT 'lz4' = ANY (enumvals) FROM pg_settings WHERE name = 'default_toast_compression'", &[])
        .unwrap()
        .get(0);
    for setting in ["pglz", "pglz", "lz4"] {
        let setting = if lz4 { setting } else { "pglz" };
        c.batch_execute(&format!("SET default_toast_compression = {setting}")).unwrap();
        // In one transaction with the claim, whose setting would last to its end if the claim
        // left it behind; and beside the claim in its statement.
        let mut t = c.transaction().unwrap();
        let rows = t
            .query(
                "SELECT message_key, current_setting('default_toast_compression') FROM sqlstreams.claim($1, 'g', 100)",
                &[&name],
            )
            .unwrap();
        let claimed: Vec<String> = rows.iter().map(|r| r.get(0)).collect();
        assert_eq!(claimed, keys, "every message, in order");
        assert!(rows.iter().all(|r| r.get::<_, String>(1) == setting), "the caller's setting, beside the claim");
        let after: String = t.query_one("SHOW default_toast_compression", &[]).unwrap().get(0);
        assert_eq!(after, setting, "the caller's setting, after the claim");
        t.commit().unwrap();
        let stored: Option<String> = c
            .query_one(&format!("SELECT pg_column_compression(pending_keys) FROM sqlstreams.range_lease_{id}"), &[])
            .unwrap()
            .get(0);
        let method = if lz4 { "lz4" } else { "pglz" };
        assert_eq!(stored.as_deref(), Some(method), "the keys (lz4 on this server: {lz4})");
        // The next claim hands the range out again: its lease (and its lane's hold) ran out.
        c.batch_execute(&format!(
            "UPDATE sqlstreams.range_lease_{id} SET lease_expires_at = now() - interval '1 hour';
             UPDATE sqlstreams.lane_{id} SET held_until = now() - interval '1 hour' WHERE held_by IS NOT NULL"
        ))
        .unwrap();
    }
    c.batch_execute("RESET default_toast_compression").unwrap();
    let declared: Vec<String> = c
        .query(
            "SELECT attcompression::text FROM pg_attribute
             WHERE attrelid = $1::text::regclass AND attname IN ('pending', 'pending_keys') ORDER BY attname",
            &[&format!("sqlstreams.range_lease_{id}")],
        )
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(declared, vec![""; 2], "the table's columns keep the default");
    c.execute("SELECT sqlstreams.drop_stream($1)", &[&name]).unwrap();
}

#[test]
fn two_groups_read_the_same_messages_independently() {
    let mut c = connect();
    let s = Stream::create(&mut c, "fan-out");
    let audit = s.group(&mut c, "audit", None);
    let billing = s.group(&mut c, "billing", None);
    let produced = s.produce_many(&mut c, 5, None);

    let first = audit.claim(&mut c, 3);
    assert_eq!(ids(&first), produced[..3]);
    // billing is not held back by audit's open range or its failure.
    assert_eq!(audit.fail(&mut c, &first[0], "audit is down", false, None).as_deref(), Some("ready"));
    assert_eq!(billing.drain(&mut c), produced);
    assert!(billing.exception_rows(&mut c).is_empty());
    assert_eq!(audit.statuses(&mut c), vec![(produced[0], "ready".to_string())]);
    let rest = audit.claim(&mut c, 10);
    assert_eq!(ids(&rest), produced[3..], "audit continues after its own range");
}

#[test]
fn batch_produce_keeps_payload_order_and_validates() {
    let mut c = connect();
    let s = Stream::create(&mut c, "batch");
    let g = s.group(&mut c, "g", None);
    let ids_ = s.produce_many(&mut c, 250, Some("k"));
    assert_eq!(ids_, (ids_[0]..ids_[0] + 250).collect::<Vec<_>>());
    let mut seen = Vec::new();
    loop {
        let batch = g.claim(&mut c, 100);
        if batch.is_empty() {
            break;
        }
        for d in &batch {
            seen.push(d.payload["n"].as_i64().unwrap());
        }
        g.ack_batch(&mut c, &batch);
    }
    assert_eq!(seen, (0..250).collect::<Vec<_>>(), "every payload once, in order");

    let empty: Vec<serde_json::Value> = vec![];
    assert!(c.query("SELECT sqlstreams.produce_batch($1, $2)", &[&s.name, &empty]).unwrap().is_empty());
    let err = c.query("SELECT sqlstreams.produce_batch($1, ARRAY['{}', NULL]::jsonb[])", &[&s.name]).unwrap_err();
    assert_eq!(sqlstate(&err), "22023");
    let err =
        c.query("SELECT sqlstreams.produce_batch($1, ARRAY['{}']::jsonb[], ARRAY['a', 'b'])", &[&s.name]).unwrap_err();
    assert_eq!(sqlstate(&err), "22023");
}

#[test]
fn ack_batch_records_only_what_the_token_holds() {
    let mut c = connect();
    let s = Stream::create(&mut c, "ack-batch");
    let g = s.group(&mut c, "g", None);
    s.produce_many(&mut c, 4, None);
    let batch = g.claim(&mut c, 4);
    // NULL elements name no message: they are ignored.
    let with_null: Vec<Option<i64>> = vec![Some(batch[0].message_id), None, Some(batch[1].message_id)];
    let recorded: Vec<i64> = c
        .query_one(
            "SELECT sqlstreams.ack_batch($1, $2, $3, $4)",
            &[&s.name, &g.name, &batch[0].lease_token, &with_null],
        )
        .unwrap()
        .get(0);
    assert_eq!(recorded, ids(&batch[..2]));
    let again = g.ack_batch(&mut c, &batch);
    assert_eq!(again, ids(&batch[2..]), "already acked ids are left out");
}

#[test]
fn reclaim_after_lease_expiry_and_stale_token_outcomes() {
    let mut c = connect();
    let s = Stream::create(&mut c, "reclaim");
    let g = s.group(&mut c, "g", None);
    let produced = s.produce_many(&mut c, 3, None);

    let old = g.claim(&mut c, 10);
    assert!(g.ack(&mut c, &old[0]));
    g.expire_leases(&mut c);

    let again = g.claim(&mut c, 10);
    assert_eq!(ids(&again), produced[1..], "only unresolved messages come back");
    assert!(again.iter().all(|d| d.attempt == 1), "a reclaimed delivery counts the expired one");
    assert_ne!(again[0].lease_token, old[0].lease_token);

    // The old consumer wakes up: every outcome under its token changes nothing.
    assert!(!g.ack(&mut c, &old[1]));
    assert_eq!(g.fail(&mut c, &old[2], "late", false, None), None);
    assert!(!g.delay(&mut c, &old[2], "1 second"));
    assert!(g.exception_rows(&mut c).is_empty());

    assert!(g.ack(&mut c, &again[0]));
    assert!(g.ack(&mut c, &again[1]));
    assert!(g.claim(&mut c, 10).is_empty());
}

/// The range's row as it is stored (its physical place and its writer): outcomes must not
/// write it again.
fn range_rows(c: &mut Client, g: &Group) -> Vec<String> {
    let sql = format!(
        "SELECT format('%s %s %s', ctid, xmin, pending) FROM {} WHERE consumer_group_id = $1 ORDER BY first_id",
        g.stream.table("range_lease")
    );
    c.query(&sql, &[&g.id]).unwrap().iter().map(|r| r.get(0)).collect()
}

fn range_done_rows(c: &mut Client, g: &Group) -> i64 {
    let sql = format!("SELECT count(*) FROM {} WHERE consumer_group_id = $1", g.stream.table("range_done"));
    c.query_one(&sql, &[&g.id]).unwrap().get(0)
}

/// Outcomes leave their range's row as the claim wrote it (one row version per lease however
/// many outcomes, so readers of the range table have no dead version per outcome to step over
/// until vacuum), and what they resolved still counts: a second outcome for a message changes
/// nothing, `open_leases` counts what is pending, a reclaim hands out only the rest, and the
/// range goes with its outcomes once every message has one.
#[test]
fn outcomes_leave_their_range_row_alone_and_still_count() {
    let mut c = connect();
    let s = Stream::create(&mut c, "range-outcomes");
    let g = s.group(&mut c, "g", None);
    let produced = s.produce_many(&mut c, 10, None);
    let ds = g.claim(&mut c, 10);
    assert_eq!(ids(&ds), produced);
    let before = range_rows(&mut c, &g);
    assert_eq!(before.len(), 1, "keyless messages close together are one lane's range: {before:?}");

    for d in &ds[..4] {
        assert!(g.ack(&mut c, d));
    }
    assert_eq!(g.fail(&mut c, &ds[4], "boom", false, Some("1 hour")).as_deref(), Some("ready"));
    assert!(!g.ack(&mut c, &ds[0]), "a second outcome for an acked message changes nothing");
    assert!(!g.ack(&mut c, &ds[4]), "nor one for a message that failed");
    assert_eq!(range_rows(&mut c, &g), before, "outcomes wrote the range's row again");
    assert_eq!(range_done_rows(&mut c, &g), 5);
    let pending: i32 = c
        .query_one("SELECT pending FROM sqlstreams.open_leases($1, $2) WHERE kind = 'range'", &[&s.name, &g.name])
        .unwrap()
        .get(0);
    assert_eq!(pending, 5);

    g.expire_leases(&mut c);
    let again = g.claim(&mut c, 10);
    assert_eq!(ids(&again), produced[5..], "a reclaim hands out only what has no outcome");
    assert_eq!(range_done_rows(&mut c, &g), 0, "the range was leased again with only those");
    assert!(!g.ack(&mut c, &ds[5]), "the expired token's outcomes change nothing");
    assert_eq!(g.ack_batch(&mut c, &again[..2]), ids(&again[..2]));
    assert!(g.ack(&mut c, &again[2]));
    assert_eq!(range_done_rows(&mut c, &g), 3);
    assert_eq!(g.ack_batch(&mut c, &again[3..]), ids(&again[3..]));
    assert!(range_rows(&mut c, &g).is_empty(), "the range goes once every message has an outcome");
    assert_eq!(range_done_rows(&mut c, &g), 0, "and its outcomes with it");
    assert_eq!(g.cursor(&mut c).1, produced[3], "committed stops below the failed message");
}

/// An outcome reads its range's outcomes as they are once it holds the range, whatever its
/// transaction's snapshot: under REPEATABLE READ, a second outcome for a message that another
/// session resolved after the snapshot was taken changes nothing (no duplicate, no error), and
/// the last outcome still deletes the range.
#[test]
fn an_outcome_under_repeatable_read_sees_outcomes_committed_after_its_snapshot() {
    let mut c = connect();
    let mut other = connect();
    let s = Stream::create(&mut c, "range-outcomes-rr");
    let g = s.group(&mut c, "g", None);
    s.produce_many(&mut c, 3, None);
    let ds = g.claim(&mut c, 10);
    assert_eq!(ds.len(), 3);

    let mut rr = c.build_transaction().isolation_level(IsolationLevel::RepeatableRead).start().unwrap();
    rr.query_one("SELECT 1", &[]).unwrap(); // the snapshot
    assert!(g.ack(&mut other, &ds[0]));
    assert!(g.ack(&mut other, &ds[1]));
    let ack = "SELECT sqlstreams.ack($1, $2, $3, $4)";
    let acked: bool = rr.query_one(ack, &[&s.name, &g.name, &ds[0].lease_token, &ds[0].message_id]).unwrap().get(0);
    assert!(!acked, "acked by the other session since the snapshot");
    let acked: bool = rr.query_one(ack, &[&s.name, &g.name, &ds[2].lease_token, &ds[2].message_id]).unwrap().get(0);
    assert!(acked);
    rr.commit().unwrap();
    assert!(range_rows(&mut c, &g).is_empty(), "the last outcome deleted the range");
    assert!(g.claim(&mut c, 10).is_empty());
    // Its snapshot did not see the other session's outcome rows when it deleted the range's:
    // they count for nothing (their token leases nothing), and maintenance deletes them.
    c.execute("SELECT count(*) FROM sqlstreams.maintain_stream($1)", &[&s.name]).unwrap();
    assert_eq!(range_done_rows(&mut c, &g), 0);
}

#[test]
fn a_range_that_keeps_expiring_is_quarantined() {
    let mut c = connect();
    let s = Stream::create(&mut c, "quarantine");
    let g = s.group(&mut c, "g", None); // max_reclaims = 2
    let produced = s.produce_many(&mut c, 3, None);

    let mut attempts = vec![];
    for _ in 0..3 {
        let batch = g.claim(&mut c, 10);
        assert_eq!(ids(&batch), produced);
        attempts.push(batch[0].attempt);
        g.expire_leases(&mut c);
    }
    assert_eq!(attempts, vec![0, 1, 2]);
    // Expired a third time: the next claim quarantines instead of handing it out again,
    // and the group moves on to new messages.
    let later = s.produce(&mut c, json!({"later": true}), None);
    let batch = g.claim(&mut c, 10);
    assert_eq!(ids(&batch), vec![later]);
    assert!(g.ack(&mut c, &batch[0]));
    let rows = g.exception_rows(&mut c);
    assert_eq!(rows.iter().map(|r| r.message_id).collect::<Vec<_>>(), produced);
    for row in &rows {
        assert_eq!((row.status.as_str(), row.attempts), ("ready", 0), "quarantine itself counts no failure");
        assert!(row.last_error.as_deref().unwrap().contains("quarantined"), "{:?}", row.last_error);
    }
    // Each quarantined message is delivered alone, at once.
    for id in &produced {
        let alone = g.claim(&mut c, 10);
        assert_eq!(ids(&alone), vec![*id], "one quarantined message per claim");
        assert_eq!(alone[0].attempt, 0);
        assert!(g.ack(&mut c, &alone[0]));
    }
    assert!(g.exception_rows(&mut c).is_empty());
    assert!(g.claim(&mut c, 10).is_empty());
}

/// A group of `concurrency` whose ranges are quarantined after `max_reclaims` reclaims.
fn quarantining_group(c: &mut Client, s: &Stream, concurrency: &str, max_reclaims: i32) -> Group {
    let id: i64 = c
        .query_one(
            "SELECT sqlstreams.create_group($1, 'g', $2, max_reclaims => $3)",
            &[&s.name, &concurrency, &max_reclaims],
        )
        .unwrap()
        .get(0);
    Group { stream: s.clone(), name: "g".into(), id }
}

/// Makes exception row `id` wait an hour, as a claim that parked it, or a retry, would.
fn hold_back(c: &mut Client, s: &Stream, id: i64) {
    let queue = s.table("exception_queue");
    c.execute(&format!("UPDATE {queue} SET can_run_after = now() + interval '1 hour' WHERE message_id = $1"), &[&id])
        .unwrap();
}

/// A quarantined row is handed out alone, ahead of its lane's other work; when its key is held
/// by a delivery that is itself waiting to be handed out again in that lane (here an exclusive
/// key's later message, in a range whose lease ran out), the row waits, parked, and what holds
/// it goes out: a claim that handed out nothing but the quarantined row, again and again, would
/// hold the lane back for good (claims a second apart, each finding the row due again).
#[test]
fn a_quarantined_row_held_by_its_lanes_own_due_work_does_not_stall_the_lane() {
    let mut c = connect();
    let s = Stream::create(&mut c, "quarantine-held");
    let g = quarantining_group(&mut c, &s, "exclusive", 0);
    let first = s.produce(&mut c, json!({}), Some("k"));
    assert_eq!(ids(&g.claim(&mut c, 10)), vec![first]);
    g.expire_leases(&mut c);
    let other = s.produce(&mut c, json!({}), Some("other"));
    let quarantining = g.claim(&mut c, 10);
    assert_eq!(ids(&quarantining), vec![other], "the claim quarantined {first}");
    assert!(g.ack(&mut c, &quarantining[0]));
    assert!(g.exception_rows(&mut c).iter().any(|r| r.message_id == first && r.status == "ready"));
    // While the quarantined row waits (as after a claim that parked it), the key's next message
    // goes out, and its lease runs out too.
    hold_back(&mut c, &s, first);
    let second = s.produce(&mut c, json!({}), Some("k"));
    assert_eq!(ids(&g.claim(&mut c, 10)), vec![second], "exclusive: it may overtake a waiting row");
    g.expire_leases(&mut c);
    // Each claim finds the quarantined row due.
    let mut delivered = vec![];
    for _ in 0..4 {
        g.make_due(&mut c);
        let batch = g.claim(&mut c, 10);
        assert!(!ids(&batch).contains(&first) || batch.len() == 1, "{first} alone: {:?}", ids(&batch));
        for d in batch {
            assert!(g.ack(&mut c, &d));
            delivered.push(d.message_id);
        }
    }
    delivered.sort_unstable();
    assert_eq!(delivered, vec![first, second], "both went out, the quarantined one alone");
}

/// A quarantined row that waits for its key is parked, and the claim that parks it hands out
/// what holds the key: the expired range of the key's next message (exclusive: it may overtake
/// a waiting row), handed out again. Its ack wakes the quarantined row, which the next claim hands
/// out alone.
#[test]
fn a_claim_parks_a_quarantined_row_and_hands_out_what_holds_its_key() {
    let mut c = connect();
    let s = Stream::create(&mut c, "quarantine-parked");
    let g = quarantining_group(&mut c, &s, "exclusive", 1);
    let first = s.produce(&mut c, json!({}), Some("k"));
    for _ in 0..2 {
        assert_eq!(ids(&g.claim(&mut c, 10)), vec![first]);
        g.expire_leases(&mut c);
    }
    assert!(g.claim(&mut c, 10).is_empty(), "the claim quarantined {first}");
    hold_back(&mut c, &s, first);
    let second = s.produce(&mut c, json!({}), Some("k"));
    assert_eq!(ids(&g.claim(&mut c, 10)), vec![second]);
    g.expire_leases(&mut c);
    g.make_due(&mut c);
    let again = g.claim(&mut c, 10);
    assert_eq!(ids(&again), vec![second], "{second}'s range again; {first} parked behind it");
    let parked: bool = c
        .query_one(&format!("SELECT parked FROM {} WHERE message_id = $1", s.table("exception_queue")), &[&first])
        .unwrap()
        .get(0);
    assert!(parked, "{first} is parked");
    assert!(g.ack(&mut c, &again[0]));
    assert_eq!(ids(&g.claim(&mut c, 10)), vec![first], "woken by the ack, alone");
}

/// A quarantined row that waits for its key is parked, and leaves its lane's next quarantined row
/// its turn: an innocent range-mate goes out while the poison message waits for its retry.
#[test]
fn a_quarantined_row_that_waits_for_its_key_leaves_the_next_one_its_turn() {
    let mut c = connect();
    let s = Stream::create(&mut c, "quarantine-turn");
    let g = quarantining_group(&mut c, &s, "ordered", 0);
    let lane = s.lane(&mut c, "k");
    let mate = (0..).map(|i| format!("j{i}")).find(|j| s.lane(&mut c, j) == lane).unwrap();
    let poison = s.produce(&mut c, json!({}), Some("k"));
    let behind = s.produce(&mut c, json!({}), Some("k"));
    let innocent = s.produce(&mut c, json!({}), Some(&mate));
    assert_eq!(ids(&g.claim(&mut c, 10)), vec![poison, behind, innocent], "one range");
    g.expire_leases(&mut c);
    assert!(g.claim(&mut c, 10).is_empty(), "the claim quarantined the range");
    let alone = g.claim(&mut c, 10);
    assert_eq!(ids(&alone), vec![poison], "alone");
    assert_eq!(g.fail(&mut c, &alone[0], "x", false, Some("1 hour")).as_deref(), Some("ready"));
    // {behind} waits for {poison}'s retry, parked; {innocent} needs no one.
    let mut delivered = vec![];
    for _ in 0..3 {
        let batch = g.claim(&mut c, 10);
        assert!(batch.len() <= 1, "quarantined rows go out alone: {:?}", ids(&batch));
        delivered.extend(ids(&batch));
    }
    assert_eq!(delivered, vec![innocent]);
}

#[test]
fn quarantine_never_dead_letters_innocent_range_mates() {
    let mut c = connect();
    let s = Stream::create(&mut c, "quarantine-poison");
    // No retries: any failure counted against a message is final.
    let g = s.group_with(&mut c, "g", None, 0);
    let produced = s.produce_many(&mut c, 3, None);
    let poison = produced[1];
    for _ in 0..3 {
        assert_eq!(ids(&g.claim(&mut c, 10)), produced);
        g.expire_leases(&mut c); // the poison message crashes the consumer every time
    }
    assert!(g.claim(&mut c, 10).is_empty(), "this claim quarantines the range");
    assert_eq!(g.statuses(&mut c).iter().filter(|(_, s)| s == "ready").count(), 3);

    let mut ran = vec![];
    for _ in 0..6 {
        let batch = g.claim(&mut c, 10);
        assert!(batch.len() <= 1, "quarantined messages are delivered alone: {batch:?}");
        for d in &batch {
            ran.push(d.message_id);
            if d.message_id == poison {
                g.expire_leases(&mut c); // crashes again, now alone: its own fault
            } else {
                assert!(g.ack(&mut c, d));
            }
        }
    }
    assert_eq!(ran, produced, "each message ran once on its own");
    let rows = g.exception_rows(&mut c);
    assert_eq!(rows.len(), 1, "the innocent messages succeeded: {rows:?}");
    assert_eq!((rows[0].message_id, rows[0].status.as_str(), rows[0].attempts), (poison, "dead", 1));
}

#[test]
fn retry_budget_ends_in_dead_with_exponential_backoff() {
    let mut c = connect();
    let s = Stream::create(&mut c, "budget");
    let g = s.group_with(&mut c, "g", None, 3);
    let id = s.produce(&mut c, json!({}), None);

    let mut waits = vec![];
    let mut statuses = vec![];
    for expected_attempt in 0..4 {
        let batch = g.claim(&mut c, 10);
        assert_eq!(ids(&batch), vec![id]);
        assert_eq!(batch[0].attempt, expected_attempt);
        statuses.push(g.fail(&mut c, &batch[0], &format!("boom {expected_attempt}"), false, None).unwrap());
        let row = g.exception_rows(&mut c).pop().unwrap();
        waits.push(row.wait_secs);
        assert_eq!(row.attempts, expected_attempt + 1);
        assert!(g.claim(&mut c, 10).is_empty(), "a retry waits for its backoff");
        g.make_due(&mut c);
    }
    assert_eq!(statuses, vec!["ready", "ready", "ready", "dead"], "max_retries = 3: four runs in all");
    assert_eq!(&waits[..3], &[1.0, 2.0, 4.0], "backoff doubles from its 1 s base");
    let dead = g.exception_rows(&mut c).pop().unwrap();
    assert_eq!(dead.last_error.as_deref(), Some("boom 3"));
    assert!(g.claim(&mut c, 10).is_empty(), "dead messages never run again");
    let (n,): (i64,) = {
        let r = c.query_one("SELECT count(*) FROM sqlstreams.dead_messages($1, $2)", &[&s.name, &g.name]).unwrap();
        (r.get(0),)
    };
    assert_eq!(n, 1, "dead rows stay visible for triage");
}

#[test]
fn backoff_is_capped_and_retry_after_overrides_it() {
    let mut c = connect();
    let s = Stream::create(&mut c, "cap");
    let g = s.group(&mut c, "g", None);
    c.execute(
        "SELECT sqlstreams.create_group($1, $2, max_retries => 10, backoff_base => '1 second', backoff_cap => '3 seconds')",
        &[&s.name, &g.name],
    )
    .unwrap();
    s.produce(&mut c, json!({}), None);
    let mut waits = vec![];
    for _ in 0..4 {
        let d = g.claim(&mut c, 1).pop().unwrap();
        g.fail(&mut c, &d, "x", false, None);
        waits.push(g.exception_rows(&mut c)[0].wait_secs);
        g.make_due(&mut c);
    }
    assert_eq!(waits, vec![1.0, 2.0, 3.0, 3.0]);
    let d = g.claim(&mut c, 1).pop().unwrap();
    assert_eq!(g.fail(&mut c, &d, "x", false, Some("0 seconds")).as_deref(), Some("ready"));
    let d = g.claim(&mut c, 1).pop().expect("retry_after => 0 is due at once");
    assert_eq!(d.attempt, 5);
}

#[test]
fn permanent_failure_is_dead_at_once() {
    let mut c = connect();
    let s = Stream::create(&mut c, "permanent");
    let g = s.group(&mut c, "g", None);
    s.produce(&mut c, json!({}), None);
    let d = g.claim(&mut c, 1).pop().unwrap();
    assert_eq!(g.fail(&mut c, &d, "malformed", true, None).as_deref(), Some("dead"));
    let row = g.exception_rows(&mut c).pop().unwrap();
    assert_eq!((row.status.as_str(), row.attempts), ("dead", 1));
    g.make_due(&mut c);
    assert!(g.claim(&mut c, 1).is_empty());
}

#[test]
fn delay_counts_delays_not_attempts() {
    let mut c = connect();
    let s = Stream::create(&mut c, "delay");
    let g = s.group(&mut c, "g", None);
    s.produce(&mut c, json!({}), None);
    let d = g.claim(&mut c, 1).pop().unwrap();
    assert!(g.delay(&mut c, &d, "10 seconds"));
    let row = g.exception_rows(&mut c).pop().unwrap();
    assert_eq!((row.status.as_str(), row.attempts, row.delays, row.wait_secs), ("ready", 0, 1, 10.0));
    assert!(g.claim(&mut c, 1).is_empty(), "a delayed message waits");
    g.make_due(&mut c);
    let d = g.claim(&mut c, 1).pop().unwrap();
    assert_eq!(d.attempt, 0, "a delay is not a failed attempt");
    assert!(g.delay(&mut c, &d, "1 second"));
    g.make_due(&mut c);
    let d = g.claim(&mut c, 1).pop().unwrap();
    assert!(g.ack(&mut c, &d));
    assert!(g.exception_rows(&mut c).is_empty(), "success deletes the row");
}

#[test]
fn a_delay_budget_dead_letters() {
    let mut c = connect();
    let s = Stream::create(&mut c, "delay-budget");
    let g = s.group(&mut c, "g", None);
    c.execute("SELECT sqlstreams.create_group($1, $2, max_delays => 1)", &[&s.name, &g.name]).unwrap();
    s.produce(&mut c, json!({}), None);
    let d = g.claim(&mut c, 1).pop().unwrap();
    assert!(g.delay(&mut c, &d, "1 second"));
    g.make_due(&mut c);
    let d = g.claim(&mut c, 1).pop().unwrap();
    assert!(g.delay(&mut c, &d, "1 second"));
    let row = g.exception_rows(&mut c).pop().unwrap();
    assert_eq!((row.status.as_str(), row.delays), ("dead", 2));
    assert!(row.last_error.unwrap().contains("max_delays"));
}

#[test]
fn claim_returns_due_retries_and_fresh_messages_together() {
    let mut c = connect();
    let s = Stream::create(&mut c, "mixed");
    let g = s.group(&mut c, "g", None);
    let first = s.produce(&mut c, json!({}), None);
    let d = g.claim(&mut c, 10).pop().unwrap();
    g.fail(&mut c, &d, "x", false, Some("0 seconds"));
    let second = s.produce(&mut c, json!({}), None);
    let batch = g.claim(&mut c, 10);
    assert_eq!(ids(&batch), vec![first, second]);
    assert_eq!((batch[0].attempt, batch[1].attempt), (1, 0));
    assert_eq!(batch[0].lease_token, batch[1].lease_token);
    assert_eq!(g.ack_batch(&mut c, &batch), vec![first, second]);
}

#[test]
fn expired_exception_deliveries_count_as_attempts() {
    let mut c = connect();
    let s = Stream::create(&mut c, "expired-row");
    let g = s.group_with(&mut c, "g", None, 1);
    s.produce(&mut c, json!({}), None);
    let d = g.claim(&mut c, 1).pop().unwrap();
    g.fail(&mut c, &d, "x", false, Some("0 seconds"));
    let retry = g.claim(&mut c, 1).pop().unwrap();
    assert_eq!(retry.attempt, 1);
    g.expire_leases(&mut c);
    // The expired retry spends the budget (max_retries = 1): dead, not handed out again.
    assert!(g.claim(&mut c, 1).is_empty());
    let row = g.exception_rows(&mut c).pop().unwrap();
    assert_eq!((row.status.as_str(), row.attempts), ("dead", 2));
    assert!(!g.ack(&mut c, &retry), "the expired delivery's outcome is refused");
}

/// An ordered group of stream `prefix` (`max_retries`) whose `n` messages of key `k` wait as
/// exception rows (the first was delayed, which counts no attempt), all due: the next claim
/// hands them out as one chain. Returns the group and the ids.
fn chain_of_rows(c: &mut Client, prefix: &str, n: usize, max_retries: i32) -> (Group, Vec<i64>) {
    let s = Stream::create(c, prefix);
    let g = s.group_with(c, "g", Some("ordered"), max_retries);
    let produced: Vec<i64> = (0..n).map(|_| s.produce(c, json!({}), Some("k"))).collect();
    let first = g.claim(c, 10);
    assert_eq!(ids(&first), produced);
    assert!(g.delay(c, &first[0], "1 second"), "the rest waits as rows");
    g.make_due(c);
    (g, produced)
}

/// An ordered key's messages wait as exception rows (the first was delayed), and consumers die
/// holding them, chained (`run_after`), again and again. A consumer starts a chained row only
/// once the row before it resolved, so only the first of each expired chain may have run: it
/// alone counts the expiry as an attempt. The rows behind it keep their budget, and run once
/// the chain's head is dead or done.
#[test]
fn an_expired_chain_counts_an_attempt_for_its_first_row_only() {
    let mut c = connect();
    let (g, produced) = chain_of_rows(&mut c, "expired-chain", 4, 2);
    for death in 1..=3 {
        let chain = g.claim(&mut c, 10);
        assert_eq!(ids(&chain), produced, "death {death}: the whole chain");
        assert!(chain[1..].iter().zip(&chain).all(|(d, before)| d.run_after == Some(before.message_id)));
        g.expire_leases(&mut c);
    }
    // Three expiries of the head with max_retries = 2: the head is dead, nothing else counted.
    let rest = g.claim(&mut c, 10);
    assert_eq!(ids(&rest), produced[1..], "the rows behind the head run");
    assert!(rest.iter().all(|d| d.attempt == 0), "{:?}", rest.iter().map(|d| d.attempt).collect::<Vec<_>>());
    let head = g.exception_rows(&mut c).into_iter().find(|r| r.message_id == produced[0]).unwrap();
    assert_eq!((head.status.as_str(), head.attempts), ("dead", 3));
    assert_eq!(g.ack_batch(&mut c, &rest), produced[1..]);
}

/// An expired chain whose head goes dead at the expiry, taken over by a claim with room for one:
/// the claim reads on, and hands out the row behind the head with its budget. Before, the rows
/// past the room were neither read nor left to no one, and the next claim met the first of them
/// as the head of its chain, charged it, and with `max_retries = 0` it went dead without having
/// run.
#[test]
fn a_chain_whose_head_goes_dead_hands_out_the_row_behind_it_with_its_budget() {
    let mut c = connect();
    let (g, produced) = chain_of_rows(&mut c, "expired-chain-dead-head", 3, 0);
    assert_eq!(ids(&g.claim(&mut c, 10)), produced, "the consumer that dies holding the chain");
    g.expire_leases(&mut c);
    let next = g.claim(&mut c, 1);
    assert_eq!(ids(&next), produced[1..2], "the head went dead; the row behind it runs");
    assert_eq!(next[0].attempt, 0, "the row behind the head never ran");
    let head = g.exception_rows(&mut c).into_iter().find(|r| r.message_id == produced[0]).unwrap();
    assert_eq!((head.status.as_str(), head.attempts), ("dead", 1));
    assert!(g.ack(&mut c, &next[0]));
    let last = g.claim(&mut c, 10);
    assert_eq!(
        (ids(&last), last[0].attempt),
        (produced[2..].to_vec(), 0),
        "the rest, left to no one, keeps its budget"
    );
    assert!(g.ack(&mut c, &last[0]));
}

/// The same chain taken over by a claim with room for its head only: the rest is left, expired,
/// under a token no consumer holds, and the claims that hand it out later count nothing for it.
#[test]
fn the_rest_of_an_expired_chain_left_for_the_next_claim_keeps_its_budget() {
    let mut c = connect();
    let (g, produced) = chain_of_rows(&mut c, "expired-chain-split", 4, 2);
    assert_eq!(ids(&g.claim(&mut c, 10)), produced, "the consumer that dies holding the chain");
    g.expire_leases(&mut c);
    let head = g.claim(&mut c, 1);
    assert_eq!((ids(&head), head[0].attempt), (produced[..1].to_vec(), 1), "the head counts the expiry");
    assert!(g.ack(&mut c, &head[0]));
    let rest = g.claim(&mut c, 10);
    assert_eq!(ids(&rest), produced[1..]);
    assert!(rest.iter().all(|d| d.attempt == 0), "{:?}", rest.iter().map(|d| d.attempt).collect::<Vec<_>>());
    assert_eq!(g.ack_batch(&mut c, &rest), produced[1..]);
}

/// A key's chain headed by a range's message, handed out again after its lease ran out, with an
/// exception row behind it (a message produced with `deliver_after`, due by then): when that
/// delivery expires too, the row behind the head never started, and keeps its budget. Before,
/// only expired exception rows marked their chains: the row was charged the expiry, and with
/// `max_retries = 0` went dead without having run.
#[test]
fn a_chain_headed_by_a_range_message_charges_the_row_behind_it_nothing() {
    let mut c = connect();
    for policy in ["ordered", "exclusive"] {
        let s = Stream::create(&mut c, &format!("range-headed-chain-{policy}"));
        let g = s.group_with(&mut c, "g", Some(policy), 0);
        let head = s.produce(&mut c, json!({}), Some("k"));
        let behind: i64 = c
            .query_one("SELECT sqlstreams.produce($1, '{}', 'k', deliver_after => '1 hour')", &[&s.name])
            .unwrap()
            .get(0);
        assert_eq!(ids(&g.claim(&mut c, 10)), [head], "{policy}: the delayed message waits as a row");
        g.expire_leases(&mut c);
        g.make_due(&mut c);
        for handout in 1..=2 {
            let chain = g.claim(&mut c, 10);
            assert_eq!(ids(&chain), [head, behind], "{policy}, handout {handout}: the range's message, then the row");
            assert_eq!(chain[1].run_after, Some(head), "{policy}: chained");
            assert_eq!(chain[1].attempt, 0, "{policy}, handout {handout}: the row behind the head never ran");
            g.expire_leases(&mut c);
        }
        let rows = g.exception_rows(&mut c);
        assert!(rows.iter().all(|r| r.status != "dead" && r.attempts == 0), "{policy}: {rows:?}");
        // The head's range goes to quarantine (max_reclaims) and its message runs alone; the
        // row runs with its budget, after the head (ordered) or beside it (exclusive).
        let mut acked = vec![];
        for _ in 0..4 {
            for d in g.claim(&mut c, 10) {
                assert!(d.message_id != behind || d.attempt == 0, "{policy}: {d:?}");
                assert!(g.ack(&mut c, &d));
                acked.push(d.message_id);
            }
        }
        if policy == "exclusive" {
            acked.sort_unstable();
        }
        assert_eq!(acked, [head, behind], "{policy}: each ran once more, and is done");
    }
}

/// The other side of the chain above: a row that heads its key's chain in a delivery counts its
/// expiry, though a range taken over before it holds a later message of its key (here the rest
/// of the range the consumer gave the row back from, which an earlier message of another key in
/// the lane begins). Which message is behind which is decided by id, not by the order the claim
/// met them in.
#[test]
fn a_row_heading_its_chain_is_charged_though_a_range_holds_a_later_message_of_its_key() {
    let mut c = connect();
    for policy in ["ordered", "exclusive"] {
        let s = Stream::create_with_lanes(&mut c, &format!("row-headed-chain-{policy}"), 1);
        let g = s.group_with(&mut c, "g", Some(policy), 0);
        let [other, head, behind] = [Some("j"), Some("k"), Some("k")].map(|key| s.produce(&mut c, json!({}), key));
        let first = g.claim(&mut c, 10);
        assert_eq!(ids(&first), [other, head, behind], "{policy}");
        assert_eq!(g.release(&mut c, first[0].lease_token, &[head]), [head], "{policy}");
        g.expire_leases(&mut c);
        let chain = g.claim(&mut c, 10);
        assert_eq!(ids(&chain), [other, head, behind], "{policy}: the range's messages and the row");
        assert_eq!((chain[1].run_after, chain[2].run_after), (None, Some(head)), "{policy}: the row heads its chain");
        g.expire_leases(&mut c);
        let after = g.claim(&mut c, 10);
        assert!(!ids(&after).contains(&head), "{policy}: {:?}", ids(&after));
        let row = g.exception_rows(&mut c).into_iter().find(|r| r.message_id == head).unwrap();
        assert_eq!((row.status.as_str(), row.attempts), ("dead", 1), "{policy}: the head's expiry counted");
    }
}

#[test]
fn committed_follows_resolution_and_never_moves_backward() {
    let mut c = connect();
    let s = Stream::create(&mut c, "committed");
    let g = s.group(&mut c, "g", None);
    let p = s.produce_many(&mut c, 6, None);
    let first = g.claim(&mut c, 3);
    let second = g.claim(&mut c, 3);
    assert_eq!(g.cursor(&mut c).0, p[5]);

    // The later range resolves first: committed cannot pass the open earlier range.
    g.ack_batch(&mut c, &second);
    g.claim(&mut c, 10);
    assert_eq!(g.cursor(&mut c).1, p[0] - 1);

    // A failure holds committed just below the failed id.
    g.ack(&mut c, &first[0]);
    g.fail(&mut c, &first[1], "x", false, None);
    g.ack(&mut c, &first[2]);
    g.claim(&mut c, 10);
    assert_eq!(g.cursor(&mut c).1, p[1] - 1);

    let mut history = vec![g.cursor(&mut c).1];
    g.make_due(&mut c);
    let retry = g.claim(&mut c, 10);
    history.push(g.cursor(&mut c).1);
    g.ack(&mut c, &retry[0]);
    g.claim(&mut c, 10);
    history.push(g.cursor(&mut c).1);
    assert_eq!(*history.last().unwrap(), p[5]);
    assert!(history.windows(2).all(|w| w[0] <= w[1]), "committed never moves backward: {history:?}");

    let status = c
        .query_one("SELECT claimed, committed, lag FROM sqlstreams.group_status($1, $2)", &[&s.name, &g.name])
        .unwrap();
    assert_eq!((status.get::<_, i64>(0), status.get::<_, i64>(1), status.get::<_, i64>(2)), (p[5], p[5], 0));
}

#[test]
fn maintain_stores_committed_for_an_idle_group() {
    let mut c = connect();
    let s = Stream::create(&mut c, "maintain");
    let g = s.group(&mut c, "g", None);
    let p = s.produce_many(&mut c, 2, None);
    let batch = g.claim(&mut c, 10);
    g.ack_batch(&mut c, &batch);
    assert_eq!(g.stored_cursor(&mut c).1, 0, "nothing has stored committed yet");
    assert_eq!(g.cursor(&mut c), (p[1], p[1]), "group_status computes it live");
    let rows =
        c.query("SELECT stream, cursors_advanced FROM sqlstreams.maintain() WHERE stream = $1", &[&s.name]).unwrap();
    assert_eq!(rows[0].get::<_, i64>(1), 1);
    assert_eq!(g.stored_cursor(&mut c), (p[1], p[1]));
    let rows = c.query("SELECT cursors_advanced FROM sqlstreams.maintain() WHERE stream = $1", &[&s.name]).unwrap();
    assert_eq!(rows[0].get::<_, i64>(0), 0, "maintain is idempotent");
}

#[test]
fn an_idle_claim_writes_nothing() {
    let mut c = connect();
    let s = Stream::create(&mut c, "idle");
    let g = s.group(&mut c, "g", None);
    s.produce_many(&mut c, 3, None);
    let batch = g.claim(&mut c, 10);
    g.ack_batch(&mut c, &batch);
    g.claim(&mut c, 10); // stores committed once

    let mut tx = c.transaction().unwrap();
    let rows = tx.query("SELECT * FROM sqlstreams.claim($1, $2)", &[&s.name, &g.name]).unwrap();
    assert!(rows.is_empty());
    let xid: Option<String> = tx.query_one("SELECT pg_current_xact_id_if_assigned()::text", &[]).unwrap().get(0);
    assert_eq!(xid, None, "an idle claim takes no transaction id");
    tx.commit().unwrap();
}

#[test]
fn start_at_head_skips_earlier_messages() {
    let mut c = connect();
    let s = Stream::create(&mut c, "start-at");
    s.produce_many(&mut c, 3, None);
    let id: i64 =
        c.query_one("SELECT sqlstreams.create_group($1, 'late', start_at => 'head')", &[&s.name]).unwrap().get(0);
    let late = Group { stream: s.clone(), name: "late".into(), id };
    let new = s.produce(&mut c, json!({}), None);
    assert_eq!(ids(&late.claim(&mut c, 10)), vec![new]);
    let early = s.group(&mut c, "early", None);
    assert_eq!(early.claim(&mut c, 10).len(), 4, "start_at => 'beginning' sees every message");
}

#[test]
fn declaring_again_is_idempotent() {
    let mut c = connect();
    let s = Stream::create(&mut c, "declare");
    let again: i64 = c.query_one("SELECT sqlstreams.create_stream($1)", &[&s.name]).unwrap().get(0);
    assert_eq!(again, s.id);
    let g = s.group(&mut c, "g", None);
    s.produce(&mut c, json!({}), None);
    g.claim(&mut c, 10);
    let g2 = s.group(&mut c, "g", Some("ordered"));
    assert_eq!(g2.id, g.id, "declaring a group again returns its id");
    let row = c
        .query_one("SELECT concurrency_override, claimed FROM sqlstreams.consumer_groups WHERE id = $1", &[&g.id])
        .unwrap();
    assert_eq!(row.get::<_, Option<String>>(0).as_deref(), Some("ordered"), "settings are updated");
    assert_eq!(row.get::<_, i64>(1), 1, "the cursor is not placed again");
}

#[test]
fn drop_group_and_drop_stream_remove_everything() {
    let mut c = connect();
    let s = Stream::create(&mut c, "drop");
    let g = s.group(&mut c, "g", None);
    s.produce(&mut c, json!({}), None);
    let d = g.claim(&mut c, 1).pop().unwrap();
    g.fail(&mut c, &d, "x", false, None);
    assert!(c.query_one("SELECT sqlstreams.drop_group($1, 'g')", &[&s.name]).unwrap().get::<_, bool>(0));
    assert!(!c.query_one("SELECT sqlstreams.drop_group($1, 'g')", &[&s.name]).unwrap().get::<_, bool>(0));
    assert!(g.exception_rows(&mut c).is_empty());
    assert!(c.query_one("SELECT sqlstreams.drop_stream($1)", &[&s.name]).unwrap().get::<_, bool>(0));
    assert!(!c.query_one("SELECT sqlstreams.drop_stream($1)", &[&s.name]).unwrap().get::<_, bool>(0));
    let left: i64 = c
        .query_one(
            "SELECT count(*) FROM pg_class WHERE relnamespace = 'sqlstreams'::regnamespace AND relname ~ ('_' || $1::text || '(_|$)')",
            &[&s.id.to_string()],
        )
        .unwrap()
        .get(0);
    assert_eq!(left, 0, "the stream's table family is gone");
}

#[test]
fn partitions_are_created_ahead_of_the_head() {
    let mut c = connect();
    let s = Stream::create_sized(&mut c, "partitions", 1000);
    let g = s.group(&mut c, "g", None);
    let mut produced = s.produce_many(&mut c, 2500, None);
    for i in 0..30 {
        produced.push(s.produce(&mut c, json!({"i": i}), None));
    }
    produced.extend(s.produce_many(&mut c, 3500, None));
    let partitions: i64 = c
        .query_one("SELECT count(*) FROM pg_inherits WHERE inhparent = $1::text::regclass", &[&s.table("message_log")])
        .unwrap()
        .get(0);
    assert!(partitions >= 7, "6030 ids in partitions of 1000 need at least 7 partitions, found {partitions}");
    let mut drained = g.drain(&mut c);
    drained.sort_unstable();
    assert_eq!(drained, produced, "claims read across partitions, every message once");
}

#[test]
fn idempotency_keys_suppress_repeats_within_their_ttl() {
    let mut c = connect();
    let s = Stream::create(&mut c, "idempotent");
    let g = s.group(&mut c, "g", None);
    let produce = |c: &mut postgres::Client, key: &str| -> Option<i64> {
        c.query_one("SELECT sqlstreams.produce($1, '{}', idempotency_key => $2)", &[&s.name, &key]).unwrap().get(0)
    };
    let first = produce(&mut c, "order-1").expect("first produce");
    assert_eq!(produce(&mut c, "order-1"), None, "a repeat produces nothing");
    assert!(produce(&mut c, "order-2").is_some());
    assert_eq!(g.drain(&mut c).len(), 2);

    // Once the key has expired it may be used again.
    c.execute(&format!("UPDATE {} SET expires_at = now() - interval '1 second'", s.table("idempotency_key")), &[])
        .unwrap();
    assert!(produce(&mut c, "order-1").unwrap() > first);

    // A repeat inside a transaction that rolls back leaves the key usable.
    let mut tx = c.transaction().unwrap();
    let in_tx: Option<i64> =
        tx.query_one("SELECT sqlstreams.produce($1, '{}', idempotency_key => 'order-3')", &[&s.name]).unwrap().get(0);
    assert!(in_tx.is_some());
    tx.rollback().unwrap();
    assert!(produce(&mut c, "order-3").is_some());
}

#[test]
fn views_list_streams_and_groups() {
    let mut c = connect();
    let s = Stream::create(&mut c, "views");
    let g = s.group(&mut c, "g", Some("exclusive"));
    s.produce_many(&mut c, 4, Some("k"));
    let row = c.query_one("SELECT id, name, head FROM sqlstreams.streams WHERE name = $1", &[&s.name]).unwrap();
    assert_eq!((row.get::<_, i64>(0), row.get::<_, i64>(2)), (s.id, 4));
    let row = c
        .query_one(
            "SELECT id, stream_id, name, concurrency_override, lag FROM sqlstreams.consumer_groups WHERE id = $1",
            &[&g.id],
        )
        .unwrap();
    assert_eq!(row.get::<_, i64>(1), s.id);
    assert_eq!(row.get::<_, String>(2), "g");
    assert_eq!(row.get::<_, Option<String>>(3).as_deref(), Some("exclusive"));
    assert_eq!(row.get::<_, i64>(4), 4);
    let batch = g.claim(&mut c, 10);
    let leases = c.query("SELECT kind, lane FROM sqlstreams.open_leases($1, $2)", &[&s.name, &g.name]).unwrap();
    let kinds: Vec<(String, Option<i32>)> = leases.iter().map(|r| (r.get(0), r.get(1))).collect();
    let lane: i32 = c.query_one("SELECT sqlstreams.lane('k', 1, 16)", &[]).unwrap().get(0);
    assert_eq!(kinds, vec![("lane".into(), Some(lane)), ("range".into(), Some(lane))], "the key's lane holds it");
    assert_eq!(batch.len(), 4);
}

#[test]
fn extend_lease_keeps_a_claim_from_being_taken_over() {
    let mut c = connect();
    let mut other = connect();
    let s = Stream::create(&mut c, "extend");
    let g = s.group(&mut c, "g", Some("exclusive"));
    s.produce_many(&mut c, 2, Some("k"));
    let mine = g.claim(&mut c, 10);
    g.expire_leases(&mut c);
    let extend = |c: &mut postgres::Client, token: uuid::Uuid| -> bool {
        c.query_one("SELECT sqlstreams.extend_lease($1, $2, $3, '1 minute')", &[&s.name, &g.name, &token])
            .unwrap()
            .get(0)
    };
    assert!(extend(&mut c, mine[0].lease_token), "an expired lease that nobody took over is still mine");
    assert!(g.claim(&mut other, 10).is_empty(), "the extended range and lane are not taken over");
    let expires: Vec<bool> = c
        .query(
            "SELECT lease_expires_at > now() + interval '50 seconds' FROM sqlstreams.open_leases($1, $2)",
            &[&s.name, &g.name],
        )
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(expires, vec![true, true], "the lane and the range");
    g.ack_batch(&mut c, &mine);
    assert!(!extend(&mut c, mine[0].lease_token), "nothing is held once everything is resolved");
}

#[test]
fn release_gives_deliveries_back_without_spending_an_attempt() {
    let mut c = connect();
    let s = Stream::create(&mut c, "release");
    let g = s.group(&mut c, "g", Some("ordered"));
    let p = s.produce_many(&mut c, 3, Some("k"));
    let batch = g.claim(&mut c, 10);
    assert!(g.ack(&mut c, &batch[0]));
    let released = g.release(&mut c, batch[0].lease_token, &p[1..]);
    assert_eq!(released, p[1..]);
    let again = g.claim(&mut c, 10);
    assert_eq!(ids(&again), p[1..], "due at once, still chained");
    assert_eq!((again[0].attempt, again[1].run_after), (0, Some(p[1])));
    assert!(!g.ack(&mut c, &batch[1]), "the old token no longer holds them");
}

/// A chained row whose predecessor failed is deferred by the server (docs/sql-api.md, `release`):
/// not the token's any more, so releasing it gives nothing back and changes nothing; it runs
/// after its predecessor's retry.
#[test]
fn release_of_rows_the_server_deferred_returns_nothing_and_changes_nothing() {
    let mut c = connect();
    let s = Stream::create(&mut c, "release-deferred");
    let g = s.group(&mut c, "g", Some("ordered"));
    let p = s.produce_many(&mut c, 3, Some("k"));
    let batch = g.claim(&mut c, 10);
    assert_eq!(ids(&batch), p, "one claim, one token: a chain of three");
    assert_eq!(g.fail(&mut c, &batch[0], "x", false, Some("1 hour")).as_deref(), Some("ready"));
    let before = g.exception_rows(&mut c);
    let released = g.release(&mut c, batch[0].lease_token, &p[1..]);
    assert!(released.is_empty(), "deferred, not the token's: {released:?}");
    assert_eq!(g.exception_rows(&mut c), before, "nothing changed");
    assert!(g.claim(&mut c, 10).is_empty(), "both wait behind the retry");
    g.make_due(&mut c);
    assert_eq!(ids(&g.claim(&mut c, 10)), p, "the retry, then the rows behind it");
}

#[test]
fn a_claim_can_carry_the_previous_claims_acks() {
    let mut c = connect();
    let s = Stream::create(&mut c, "ack-and-claim");
    let g = s.group(&mut c, "g", Some("ordered"));
    let first = s.produce_many(&mut c, 2, Some("k"));
    let batch = g.claim(&mut c, 10);
    let second = s.produce_many(&mut c, 2, Some("k"));
    let ids: Vec<i64> = batch.iter().map(|d| d.message_id).collect();
    // One call: ack the first claim, then claim. The successors are not parked behind the
    // acked messages: the acks are recorded before the claim decides.
    let rows = c
        .query(
            "SELECT message_id, run_after FROM sqlstreams.claim($1, $2, 10, '30 seconds', $3, $4)",
            &[&s.name, &g.name, &batch[0].lease_token, &ids],
        )
        .unwrap();
    let got: Vec<(i64, Option<i64>)> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
    assert_eq!(got, vec![(second[0], None), (second[1], Some(second[0]))]);
    assert!(g.exception_rows(&mut c).is_empty());
    assert!(!g.ack(&mut c, &batch[0]), "already acked by the claim");
    assert_eq!(first, ids);
    let err = c
        .query(
            "SELECT * FROM sqlstreams.claim($1, $2, 10, '30 seconds', $3)",
            &[&s.name, &g.name, &batch[0].lease_token],
        )
        .unwrap_err();
    assert_eq!(sqlstate(&err), "22023", "a token without ids is refused");
}

#[test]
fn outcomes_inside_a_transaction_block_keep_the_callers_durability() {
    let mut c = connect();
    let s = Stream::create(&mut c, "durability");
    let g = s.group(&mut c, "g", None);
    s.produce(&mut c, json!({}), None);
    let d = g.claim(&mut c, 1).pop().unwrap();
    let mut tx = c.transaction().unwrap();
    // The caller's own setting (the test cluster itself runs with it off).
    tx.batch_execute("SET LOCAL synchronous_commit = on").unwrap();
    tx.execute("SELECT sqlstreams.ack($1, $2, $3, $4)", &[&s.name, &g.name, &d.lease_token, &d.message_id]).unwrap();
    let setting: String = tx.query_one("SHOW synchronous_commit", &[]).unwrap().get(0);
    assert_eq!(setting, "on", "business writes in the same transaction stay durable");
    tx.commit().unwrap();
}

#[test]
fn status_is_one_consistent_reading_while_consumers_claim() {
    let mut c = connect();
    let s = Stream::create(&mut c, "status-under-load");
    let g = s.group(&mut c, "g", Some("ordered"));
    let keys: Vec<String> = (0..3000).map(|i| format!("k{}", i % 50)).collect();
    let payloads: Vec<serde_json::Value> = (0..3000).map(|i| json!({ "n": i })).collect();
    c.execute("SELECT sqlstreams.produce_batch($1, $2, $3)", &[&s.name, &payloads, &keys]).unwrap();
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let consumers: Vec<_> = (0..3)
        .map(|_| {
            let (g, done) = (g.clone(), done.clone());
            std::thread::spawn(move || {
                let mut c = connect();
                while !done.load(std::sync::atomic::Ordering::Relaxed) {
                    let batch = g.claim(&mut c, 5);
                    g.ack_batch(&mut c, &batch);
                }
            })
        })
        .collect();
    // Every reading is taken while claims move the cursor; each must succeed and be coherent.
    for _ in 0..1500 {
        for sql in [
            "SELECT claimed, committed, head, lag FROM sqlstreams.group_status($1, $2)",
            "SELECT claimed, committed, head, lag FROM sqlstreams.consumer_groups WHERE stream = $1 AND name = $2",
        ] {
            let row = c
                .query_one(sql, &[&s.name, &g.name])
                .unwrap_or_else(|e| panic!("status while claims move the cursor: {}", describe(&e)));
            let (claimed, committed, head, lag): (i64, i64, i64, i64) =
                (row.get(0), row.get(1), row.get(2), row.get(3));
            assert!(
                committed <= claimed && claimed <= head && lag == head - committed,
                "{claimed} {committed} {head} {lag}"
            );
        }
    }
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    for t in consumers {
        t.join().unwrap();
    }
}

#[test]
fn a_reclaimed_range_is_handed_out_no_larger_than_the_batch() {
    let mut c = connect();
    let s = Stream::create(&mut c, "reclaim-batch");
    let g = s.group(&mut c, "g", None);
    let produced = s.produce_many(&mut c, 10, None);
    assert_eq!(g.claim(&mut c, 10).len(), 10);
    g.expire_leases(&mut c);
    let mut again = Vec::new();
    loop {
        let batch = g.claim(&mut c, 3);
        if batch.is_empty() {
            break;
        }
        assert!(batch.len() <= 3, "a claim of 3 handed out {}", batch.len());
        assert!(batch.iter().all(|d| d.attempt == 1));
        again.extend(g.ack_batch(&mut c, &batch));
    }
    assert_eq!(again, produced, "every message once more, in order, three at a time");
}

/// A later exclusive message of a key waits while a parallel one of the key runs, in the same
/// claim result too; the parallel one's failure resolves its delivery, and its retry, waiting
/// for its time, holds nothing back.
#[test]
fn a_failed_parallel_message_does_not_hold_back_a_later_message_of_its_key() {
    let mut c = connect();
    let mut other = connect();
    let s = Stream::create(&mut c, "parallel-setback");
    let g = s.group(&mut c, "g", None);
    let par = s.produce_with(&mut c, json!({}), Some("k"), Some("parallel"), false).unwrap().unwrap();
    let excl = s.produce_with(&mut c, json!({}), Some("k"), Some("exclusive"), false).unwrap().unwrap();
    let batch = g.claim(&mut c, 10);
    assert_eq!(ids(&batch), vec![par], "{excl} waits while {par} runs");
    assert_eq!(g.fail(&mut c, &batch[0], "x", false, Some("1 hour")).as_deref(), Some("ready"));
    let next = g.claim(&mut other, 10);
    assert_eq!(ids(&next), vec![excl], "woken by the failure: {par}'s retry does not hold {excl} back");
    assert!(g.ack(&mut other, &next[0]));
}

#[test]
fn a_producer_writes_into_a_partition_another_transaction_attached_meanwhile() {
    let mut c = connect();
    let mut other = connect();
    let s = Stream::create_sized(&mut c, "partition-meanwhile", 1000);
    let mut tx = c.transaction().unwrap();
    let first = s.produce(&mut tx, json!({}), None);
    // Another producer fills the first partition and attaches the next one, and commits.
    s.produce_many(&mut other, 1500, None);
    let later = s.produce(&mut tx, json!({}), None);
    tx.commit().unwrap();
    assert!(later > 1500 && first < later);
}

/// A transaction that attaches a partition is committed (its stream row, which says the
/// partition is there, is visible) a moment before it sends its invalidations. A producer of an
/// id in that partition in between must wait for them, not fail with "no partition of relation
/// found for row" (23514). Set up with a debugger that stops the creator right there.
#[cfg(target_arch = "x86_64")] // the breakpoint's condition reads an x86-64 register
#[test]
fn a_producer_waits_for_a_partition_attached_by_a_transaction_still_ending() {
    use sqlstreams_tests::debugger::{backend_pid, join, waits_for_a_relation, Debugger};

    // A database of its own: another test's maintain() would attach the partition ahead.
    let (mut c, url) = own_database("partition_ending");
    let connect = || postgres::Client::connect(&url, postgres::NoTls).unwrap();
    let s = Stream::create_sized(&mut c, "partition-ending", 1000);
    let g = s.group(&mut c, "g", None);
    let (mut creator, mut producer) = (connect(), connect());
    // The producer knows the log with its one partition.
    let mut produced = s.produce_many(&mut producer, 998, None);
    let (creator_pid, producer_pid) = (backend_pid(&mut creator), backend_pid(&mut producer));

    // The creator's batch crosses into the second partition and attaches it; it stops where its
    // commit sends the invalidations (AtEOXact_Inval(isCommit = true)), already committed. Only
    // in a transaction that took an id: an idle backend far behind on invalidations reads them
    // in an empty transaction, which commits too (so does preparing a statement).
    let batch = creator.prepare("SELECT sqlstreams.produce_batch($1, ARRAY['{}', '{}', '{}']::jsonb[])").unwrap();
    let wrote = "(unsigned int) GetTopTransactionIdIfAny() != 0";
    let mut ending = Debugger::attach(creator_pid, "AtEOXact_Inval", &format!("($rdi & 0xff) == 1 && {wrote}"));
    let name = s.name.clone();
    let creating = std::thread::spawn(move || {
        creator.query(&batch, &[&name]).unwrap().iter().map(|r| r.get::<_, i64>(0)).collect::<Vec<_>>()
    });
    assert!(ending.wait_for_stop(|| creating.is_finished()), "the creator's commit stops");
    let through: i64 =
        c.query_one("SELECT partitions_through FROM sqlstreams.stream WHERE id = $1", &[&s.id]).unwrap().get(0);
    assert_eq!(through, 2001, "the second partition is committed while its creator has not sent its invalidations");

    let name = s.name.clone();
    let producing = std::thread::spawn(move || {
        let id = producer.query_one("SELECT sqlstreams.produce($1, '{}')", &[&name]).map(|r| r.get::<_, i64>(0));
        (id.map_err(|e| describe(&e)), producer)
    });
    let waited = waits_for_a_relation(&mut c, producer_pid, || producing.is_finished());
    ending.detach();
    produced.extend(join(creating));
    let id = join(producing).0.expect("the producer's message is written once the partition's creator has ended");
    assert!(waited, "the producer waits for the partition's lock, which its creator holds until it has ended");
    assert!(id > 1000, "{id} is in the second partition");
    produced.push(id);
    let mut delivered = g.drain(&mut c);
    delivered.sort_unstable();
    assert_eq!(delivered, produced, "every message is delivered once");
}

#[test]
fn a_batch_with_idempotency_keys_produces_each_key_once() {
    let mut c = connect();
    let s = Stream::create(&mut c, "batch-idempotency");
    let g = s.group(&mut c, "g", None);
    let batch = |c: &mut postgres::Client, keys: Vec<Option<&str>>| -> Vec<Option<i64>> {
        let payloads: Vec<serde_json::Value> = (0..keys.len()).map(|i| json!({ "n": i })).collect();
        c.query("SELECT sqlstreams.produce_batch($1, $2, idempotency_keys => $3)", &[&s.name, &payloads, &keys])
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect()
    };
    let first = batch(&mut c, vec![Some("order-1"), None, Some("order-2"), Some("order-1")]);
    assert!(first[0].is_some() && first[1].is_some() && first[2].is_some());
    assert_eq!(first[3], None, "a key repeated within the batch produces once");
    let second = batch(&mut c, vec![Some("order-2"), Some("order-3")]);
    assert_eq!(second[0], None, "a key used by an earlier batch produces nothing");
    let produced: Vec<i64> = first.iter().chain(&second).flatten().copied().collect();
    assert_eq!(ids(&g.claim(&mut c, 10)), produced, "only what was produced is delivered, in order");
    let err = c
        .query(
            "SELECT sqlstreams.produce_batch($1, ARRAY['{}']::jsonb[], idempotency_keys => ARRAY['a', 'b'])",
            &[&s.name],
        )
        .unwrap_err();
    assert_eq!(sqlstate(&err), "22023");
}

/// A batch and single produces write each partition's rows in one multi-insert (src/append.rs),
/// and the rows hold what the log's `INSERT` writes: `sqlstreams.lane`, `now()`, `deliver_at`,
/// keys, headers, payloads in order, across a partition boundary.
#[test]
fn produced_rows_are_written_as_the_insert_writes_them_one_wal_record_per_page() {
    // A database of its own: pg_walinspect is created in it.
    let (mut c, _) = own_database("append");
    let s = Stream::create_sized(&mut c, "append", 1000);
    c.execute(&format!("SELECT setval('{}_seq', 950)", s.table("message_log")), &[]).unwrap();
    let walinspect: bool = c
        .query_one("SELECT count(*) > 0 FROM pg_available_extensions WHERE name = 'pg_walinspect'", &[])
        .unwrap()
        .get(0);

    let payloads: Vec<serde_json::Value> = (0..120).map(|i| json!({ "i": i, "pad": "x".repeat(i % 50) })).collect();
    let keys: Vec<String> = (0..120).map(|i| format!("kéy-{}{}", i % 17, "z".repeat(i % 5))).collect();
    let headers: Vec<Option<serde_json::Value>> = (0..120).map(|i| (i % 2 == 0).then(|| json!({ "h": i }))).collect();
    let start: String = c.query_one("SELECT pg_current_wal_insert_lsn()::text", &[]).unwrap().get(0);
    let mut tx = c.transaction().unwrap();
    // Its commit waits for its WAL to be flushed, so pg_walinspect can read it.
    tx.batch_execute("SET LOCAL synchronous_commit = on").unwrap();
    let ids: Vec<i64> = tx
        .query(
            "SELECT sqlstreams.produce_batch($1, $2, $3, 'ordered', headers => $4, deliver_after => '5 minutes')",
            &[&s.name, &payloads, &keys, &headers],
        )
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(ids, (951..=1070).collect::<Vec<i64>>(), "the batch crosses into the second partition");
    let keyless = s.produce_many(&mut tx, 10, None);
    let single: i64 = tx
        .query_one(
            "SELECT sqlstreams.produce($1, '{\"one\": 1}', 'single', 'exclusive', headers => '{\"x\": 1}')",
            &[&s.name],
        )
        .unwrap()
        .get(0);
    let compacted: i64 =
        tx.query_one("SELECT sqlstreams.produce($1, '{}', 'c', compaction => true)", &[&s.name]).unwrap().get(0);
    let log = s.table("message_log");
    let wrong: i64 = tx
        .query_one(
            &format!(
                "SELECT count(*) FROM {log} m, sqlstreams.stream s
                 WHERE s.id = $1 AND (m.lane IS DISTINCT FROM sqlstreams.lane(m.message_key, m.id, s.lanes)
                                      OR m.produced_at IS DISTINCT FROM now())"
            ),
            &[&s.id],
        )
        .unwrap()
        .get(0);
    assert_eq!(wrong, 0, "every row's lane and produced_at are what the INSERT computes");
    let lane_order: bool = tx
        .query_one(
            &format!(
                "SELECT bool_and(after) FROM (
                     SELECT (lane, id) > lag((lane, id)) OVER (PARTITION BY tableoid ORDER BY ctid) AS after
                     FROM {log} WHERE id <= $1) b"
            ),
            &[&ids[119]],
        )
        .unwrap()
        .get(0);
    assert!(lane_order, "the batch's rows lie in each partition in lane order");
    let rows = tx
        .query(
            &format!(
                "SELECT id, message_key, concurrency, compaction, payload, headers, deliver_at = now() + '5 minutes'
                 FROM {log} ORDER BY id"
            ),
            &[],
        )
        .unwrap();
    assert_eq!(rows.len(), 132);
    for (i, row) in rows[..120].iter().enumerate() {
        assert_eq!(row.get::<_, i64>(0), ids[i]);
        assert_eq!(row.get::<_, Option<String>>(1).as_deref(), Some(keys[i].as_str()));
        assert_eq!(row.get::<_, Option<String>>(2).as_deref(), Some("ordered"));
        assert!(!row.get::<_, bool>(3));
        assert_eq!(row.get::<_, serde_json::Value>(4), payloads[i]);
        assert_eq!(row.get::<_, Option<serde_json::Value>>(5), headers[i]);
        assert_eq!(row.get::<_, Option<bool>>(6), Some(true), "deliver_at is the transaction's start plus the delay");
    }
    for row in &rows[120..130] {
        assert!(keyless.contains(&row.get(0)));
        let (key, concurrency, deliver_at): (Option<String>, Option<String>, Option<bool>) =
            (row.get(1), row.get(2), row.get(6));
        assert_eq!((key, concurrency, deliver_at), (None, None, None));
    }
    let (id, key, concurrency, headers): (i64, Option<String>, Option<String>, Option<serde_json::Value>) =
        (rows[130].get(0), rows[130].get(1), rows[130].get(2), rows[130].get(5));
    assert_eq!((id, key.as_deref(), concurrency.as_deref()), (single, Some("single"), Some("exclusive")));
    assert_eq!(headers, Some(json!({ "x": 1 })));
    assert_eq!((rows[131].get::<_, i64>(0), rows[131].get::<_, bool>(3)), (compacted, true));
    tx.commit().unwrap();
    let end: String = c.query_one("SELECT pg_current_wal_flush_lsn()::text", &[]).unwrap().get(0);

    // A batch over three partitions, written in chunks of 1,000 rows.
    let many = s.produce_many(&mut c, 2500, Some("many"));
    let (written, right): (i64, i64) = {
        let row = c
            .query_one(
                &format!(
                    "SELECT count(*), count(*) FILTER (WHERE m.lane = sqlstreams.lane('many', m.id, s.lanes)
                                                         AND m.payload = jsonb_build_object('n', m.id - $2))
                     FROM {log} m, sqlstreams.stream s WHERE s.id = $1 AND m.id = ANY($3)"
                ),
                &[&s.id, &many[0], &many],
            )
            .unwrap();
        (row.get(0), row.get(1))
    };
    assert_eq!((written, right), (2500, 2500));
    // Payloads of 200 kB, a chunk each.
    let big: Vec<serde_json::Value> = (0..3).map(|i| json!({ "i": i, "pad": "y".repeat(200_000) })).collect();
    let big_ids: Vec<i64> = c
        .query("SELECT sqlstreams.produce_batch($1, $2)", &[&s.name, &big])
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let stored: Vec<serde_json::Value> = c
        .query(&format!("SELECT payload FROM {log} WHERE id = ANY($1) ORDER BY id"), &[&big_ids])
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert!(stored == big, "large payloads are stored whole");

    if !walinspect {
        eprintln!("pg_walinspect is not available here: the WAL records are not looked at");
        return;
    }
    c.batch_execute("CREATE EXTENSION pg_walinspect").unwrap();
    let records: Vec<(String, i64)> = c
        .query(
            &format!(
                "SELECT w.record_type, count(*) FROM pg_get_wal_records_info($1::text::pg_lsn, $2::text::pg_lsn) w
                 JOIN pg_inherits i ON i.inhparent = '{log}'::regclass
                 WHERE w.block_ref LIKE '%/' || (SELECT oid FROM pg_database WHERE datname = current_database())
                                        || '/' || pg_relation_filenode(i.inhrelid) || ' fork main %'
                 GROUP BY 1 ORDER BY 1"
            ),
            &[&start, &end],
        )
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    // (A hint bit's page image may be there too, when a later reader set one.)
    assert!(
        records.iter().all(|(kind, _)| !kind.starts_with("INSERT")),
        "no row of the log is written by a single insert: {records:?}"
    );
    let multi: i64 = records.iter().filter(|(kind, _)| kind.starts_with("MULTI_INSERT")).map(|(_, n)| n).sum();
    assert!((2..=10).contains(&multi), "a record per heap page and call, not per row: {records:?}");
}

/// What a DBA adds to the log (a trigger, a check, a NOT NULL, a default, a deferrable index)
/// sends produces to the log's `INSERT`, which honours it; so does a partition that was detached, which no
/// `INSERT` routes to.
#[test]
fn a_log_a_dba_changed_is_written_by_its_insert() {
    // A database of its own: what this test does to the log, maintain() elsewhere must not meet.
    let (mut c, _) = own_database("append_insert");
    let s = Stream::create_sized(&mut c, "append-insert", 1000);
    let log = s.table("message_log");
    c.batch_execute(&format!("ALTER TABLE {log} ALTER COLUMN message_key SET NOT NULL")).unwrap();
    let refused = s.produce_with(&mut c, json!({}), None, None, false).expect_err("the key is NOT NULL now");
    assert_eq!(sqlstate(&refused), "23502", "{}", describe(&refused));
    let mut produced = vec![s.produce(&mut c, json!({}), Some("k"))];
    c.batch_execute(&format!("ALTER TABLE {log} ALTER COLUMN message_key DROP NOT NULL")).unwrap();

    c.batch_execute(&format!("ALTER TABLE {log} ALTER COLUMN produced_at SET DEFAULT '2000-01-01 UTC'")).unwrap();
    let dated = s.produce(&mut c, json!({}), None);
    produced.push(dated);
    let defaulted: bool = c
        .query_one(&format!("SELECT produced_at = '2000-01-01 UTC' FROM {log} WHERE id = $1"), &[&dated])
        .unwrap()
        .get(0);
    assert!(defaulted, "the log's default is the DBA's");
    c.batch_execute(&format!("ALTER TABLE {log} ALTER COLUMN produced_at SET DEFAULT now()")).unwrap();

    let audit = format!("audit_{}", s.id);
    c.batch_execute(&format!(
        "CREATE TABLE {audit} (id bigint);
         CREATE FUNCTION {audit}() RETURNS trigger LANGUAGE plpgsql AS
             $$BEGIN INSERT INTO public.{audit} VALUES (NEW.id); RETURN NULL; END$$;
         CREATE TRIGGER audit AFTER INSERT ON {log} FOR EACH ROW EXECUTE FUNCTION public.{audit}();"
    ))
    .unwrap();
    let audited_from = produced.len();
    produced.extend(s.produce_many(&mut c, 5, Some("k")));
    produced.push(s.produce(&mut c, json!({}), None));
    let audited: Vec<i64> =
        c.query(&format!("SELECT id FROM {audit} ORDER BY id"), &[]).unwrap().iter().map(|r| r.get(0)).collect();
    assert_eq!(audited, produced[audited_from..], "the trigger fired for every message");
    c.batch_execute(&format!("DROP TRIGGER audit ON {log}")).unwrap();

    c.batch_execute(&format!("ALTER TABLE {log} ADD CONSTRAINT small CHECK (pg_column_size(payload) < 100)")).unwrap();
    let big = json!({ "pad": "x".repeat(200) });
    let refused = c
        .query("SELECT sqlstreams.produce_batch($1, ARRAY[$2::jsonb])", &[&s.name, &big])
        .expect_err("the check refuses a big payload");
    assert_eq!(sqlstate(&refused), "23514", "{}", describe(&refused));
    let refused = s.produce_with(&mut c, big, None, None, false).expect_err("the check refuses a big payload");
    assert_eq!(sqlstate(&refused), "23514", "{}", describe(&refused));
    c.batch_execute(&format!("ALTER TABLE {log} DROP CONSTRAINT small")).unwrap();

    let g = s.group(&mut c, "g", None);
    assert_eq!(ids(&g.claim(&mut c, 100)), produced, "the messages written by the INSERT are claimed");

    // A deferrable unique index on the second of two partitions a batch goes to (1001 to 2000,
    // then 2001 to 3000, which a producer attaches first).
    c.execute(&format!("SELECT setval('{log}_seq', 2500)"), &[]).unwrap();
    s.produce(&mut c, json!({}), None);
    c.batch_execute(&format!("ALTER TABLE {log}_p2 ADD CONSTRAINT deferred UNIQUE (id) DEFERRABLE INITIALLY DEFERRED"))
        .unwrap();
    c.execute(&format!("SELECT setval('{log}_seq', 1997)"), &[]).unwrap();
    assert_eq!(s.produce_many(&mut c, 4, None), vec![1998, 1999, 2000, 2001]);

    // A DBA detaches partition 2, and keeps the table.
    c.batch_execute(&format!("ALTER TABLE {log} DETACH PARTITION {log}_p2")).unwrap();
    c.execute(&format!("SELECT setval('{log}_seq', 2600)"), &[]).unwrap();
    let refused = c
        .query("SELECT sqlstreams.produce_batch($1, ARRAY['{}', '{}']::jsonb[])", &[&s.name])
        .expect_err("no partition of the log holds ids 2601 and 2602");
    assert_eq!(sqlstate(&refused), "23514", "{}", describe(&refused));
    let stray: i64 = c.query_one(&format!("SELECT count(*) FROM {log}_p2"), &[]).unwrap().get(0);
    assert_eq!(stray, 2, "nothing more was written into the detached table");
    // With no partition attached at all.
    c.batch_execute(&format!(
        "ALTER TABLE {log} DETACH PARTITION {log}_p0; ALTER TABLE {log} DETACH PARTITION {log}_p1"
    ))
    .unwrap();
    let refused = s.produce_with(&mut c, json!({}), None, None, false).expect_err("the log has no partition");
    assert_eq!(sqlstate(&refused), "23514", "{}", describe(&refused));
}

/// A serialization failure raised while the rows are written (the partition's write checks for
/// read/write conflicts) is an ordinary error: 40001, nothing produced, the session usable.
#[test]
fn a_producer_in_a_serializable_write_skew_fails_with_40001_and_leaves_nothing() {
    let mut c = connect();
    let s = Stream::create(&mut c, "append-serializable");
    s.produce(&mut c, json!({}), None);
    let log = s.table("message_log");
    let app = format!("app_{}", s.id);
    c.batch_execute(&format!("CREATE TABLE {app} (id int)")).unwrap();
    let (mut reader, mut producer) = (connect(), connect());
    let mut t1 = reader.build_transaction().isolation_level(IsolationLevel::Serializable).start().unwrap();
    let mut t2 = producer.build_transaction().isolation_level(IsolationLevel::Serializable).start().unwrap();
    t1.query_one(&format!("SELECT count(*) FROM {log}"), &[]).unwrap();
    t2.query_one(&format!("SELECT count(*) FROM {app}"), &[]).unwrap();
    t1.execute(&format!("INSERT INTO {app} VALUES (1)"), &[]).unwrap();
    t1.commit().unwrap();
    let refused = t2
        .query("SELECT sqlstreams.produce_batch($1, ARRAY['{}', '{}']::jsonb[])", &[&s.name])
        .expect_err("the write completes a dangerous structure");
    assert_eq!(sqlstate(&refused), "40001", "{}", describe(&refused));
    drop(t2);
    let count: i64 = producer.query_one(&format!("SELECT count(*) FROM {log}"), &[]).unwrap().get(0);
    assert_eq!(count, 1, "nothing of the failed batch is there");
    s.produce(&mut producer, json!({}), None);
}

/// A partition a DBA attached again with other bounds gets only the ids its bounds hold, as the
/// log's `INSERT` routes them, though its name says more.
#[test]
fn a_partition_attached_with_other_bounds_gets_only_its_ids() {
    // A database of its own: maintain() elsewhere must not meet the log as it is left.
    let (mut c, _) = own_database("append_bounds");
    let s = Stream::create_sized(&mut c, "append-bounds", 1000);
    let log = s.table("message_log");
    c.execute("SELECT sqlstreams.add_partitions($1, 2500, true)", &[&s.id]).unwrap();
    c.batch_execute(&format!(
        "ALTER TABLE {log} DETACH PARTITION {log}_p1;
         DROP TABLE {log}_p1;
         CREATE TABLE {log}_p1 (LIKE {log} INCLUDING DEFAULTS INCLUDING CONSTRAINTS);
         CREATE TABLE {log}_p1b (LIKE {log} INCLUDING DEFAULTS INCLUDING CONSTRAINTS);
         ALTER TABLE {log} ATTACH PARTITION {log}_p1 FOR VALUES FROM (1001) TO (1500);
         ALTER TABLE {log} ATTACH PARTITION {log}_p1b FOR VALUES FROM (1500) TO (2001);"
    ))
    .unwrap();
    c.execute(&format!("SELECT setval('{log}_seq', 1700)"), &[]).unwrap();
    let single = s.produce(&mut c, json!({}), None);
    c.execute(&format!("SELECT setval('{log}_seq', 1497)"), &[]).unwrap();
    let batch = s.produce_many(&mut c, 4, None);
    let placed: Vec<(i64, String)> = c
        .query(&format!("SELECT id, tableoid::regclass::text FROM {log} ORDER BY id"), &[])
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    let (p1, p1b) = (format!("{log}_p1"), format!("{log}_p1b"));
    assert_eq!(
        placed,
        vec![(batch[0], p1.clone()), (batch[1], p1), (batch[2], p1b.clone()), (batch[3], p1b.clone()), (single, p1b)],
        "each row is in the partition whose bounds hold it"
    );
    let found: i64 = c.query_one(&format!("SELECT count(*) FROM {log} WHERE id = $1"), &[&single]).unwrap().get(0);
    assert_eq!(found, 1, "a query by id finds the row");
}
