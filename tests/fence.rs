//! The claim fence: a claim never passes an id whose producer transaction is still open,
//! whatever order producers commit in. Each test holds producer transactions open on other
//! connections and checks what claims return at every step; no test waits for time to pass.

use sqlstreams_tests::*;

#[test]
fn an_open_producer_holds_later_committed_messages_back() {
    let mut c = connect();
    let mut slow = connect();
    let s = Stream::create(&mut c, "fence-open");
    let g = s.group(&mut c, "g", None);

    let mut slow_tx = slow.transaction().unwrap();
    let first = s.produce(&mut slow_tx, json!({"slow": true}), None);
    let second = s.produce(&mut c, json!({"fast": true}), None);
    assert!(second > first);

    for _ in 0..3 {
        assert!(g.claim(&mut c, 10).is_empty(), "claiming {second} would skip the open {first}");
    }
    assert_eq!(g.cursor(&mut c).0, 0);
    slow_tx.commit().unwrap();
    assert_eq!(ids(&g.claim(&mut c, 10)), vec![first, second]);
}

/// A prepared producer keeps its locks but no backend: the claim finds its transaction id in
/// `pg_locks` (src/locks.rs `producer_xids` cannot read it from a backend), and an open one's
/// there too while the prepared one holds on.
#[test]
fn a_prepared_producer_holds_later_committed_messages_back() {
    let mut c = connect();
    let mut preparer = connect();
    let mut open = connect();
    let s = Stream::create(&mut c, "fence-prepared");
    let g = s.group(&mut c, "g", None);
    let before = s.produce(&mut c, json!({}), None);
    assert_eq!(ids(&g.claim(&mut c, 10)), vec![before]);
    let gid = unique("fence-prepared");
    preparer.batch_execute("BEGIN; SET LOCAL sqlstreams.notify = off").unwrap();
    let prepared: i64 = preparer.query_one("SELECT sqlstreams.produce($1, '{}')", &[&s.name]).unwrap().get(0);
    preparer.batch_execute(&format!("PREPARE TRANSACTION '{gid}'")).unwrap();

    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let after = s.produce(&mut c, json!({}), None);
        for _ in 0..3 {
            assert!(g.claim(&mut c, 10).is_empty(), "claiming {after} would skip the prepared {prepared}");
        }
        // An open producer beside it holds the stream back too, and its later message waits.
        let mut tx = open.transaction().unwrap();
        let opened = s.produce(&mut tx, json!({}), None);
        assert!(g.claim(&mut c, 10).is_empty());
        tx.commit().unwrap();
        (after, opened)
    }));
    // The prepared transaction must not outlive the test, whatever happened.
    preparer.batch_execute(&format!("COMMIT PREPARED '{gid}'")).unwrap();
    let (after, opened) = result.unwrap_or_else(|panic| std::panic::resume_unwind(panic));
    // The fence may prove the older observation first (up to `after`) and the newer one on the
    // next claim: which, depends on what else runs in the cluster, so two claims.
    let mut claimed = ids(&g.claim(&mut c, 10));
    claimed.extend(ids(&g.claim(&mut c, 10)));
    assert_eq!(claimed, vec![prepared, after, opened]);
}

#[test]
fn a_rolled_back_producer_leaves_a_gap_that_is_passed() {
    let mut c = connect();
    let mut other = connect();
    let s = Stream::create(&mut c, "fence-rollback");
    let g = s.group(&mut c, "g", None);
    let mut tx = other.transaction().unwrap();
    let gone = s.produce(&mut tx, json!({}), None);
    let kept = s.produce(&mut c, json!({}), None);
    assert!(g.claim(&mut c, 10).is_empty());
    tx.rollback().unwrap();
    assert_eq!(ids(&g.claim(&mut c, 10)), vec![kept]);
    assert!(gone < kept);
    assert_eq!(g.cursor(&mut c).0, kept);
}

#[test]
fn savepoints_roll_back_their_messages_and_keep_the_fence() {
    let mut c = connect();
    let mut other = connect();
    let s = Stream::create(&mut c, "fence-savepoint");
    let g = s.group(&mut c, "g", None);

    let mut tx = other.transaction().unwrap();
    let mut sp = tx.savepoint("before").unwrap();
    let discarded = s.produce(&mut sp, json!({"discarded": true}), None);
    sp.rollback().unwrap();
    let mut sp = tx.savepoint("again").unwrap();
    let kept_in_savepoint = s.produce(&mut sp, json!({"kept": true}), None);
    sp.commit().unwrap(); // RELEASE SAVEPOINT: still inside the open transaction
    let outside = s.produce(&mut c, json!({}), None);

    assert!(g.claim(&mut c, 10).is_empty(), "the transaction holding {kept_in_savepoint} is still open");
    tx.commit().unwrap();
    let got = ids(&g.claim(&mut c, 10));
    assert_eq!(got, vec![kept_in_savepoint, outside]);
    assert!(!got.contains(&discarded));
}

#[test]
fn out_of_order_commits_never_let_a_claim_skip() {
    let mut c = connect();
    let s = Stream::create(&mut c, "fence-order");
    let g = s.group(&mut c, "g", None);
    let mut producers: Vec<postgres::Client> = (0..5).map(|_| connect()).collect();
    let mut open: Vec<(i64, postgres::Transaction<'_>)> = Vec::new();
    for p in producers.iter_mut() {
        let mut tx = p.transaction().unwrap();
        let id = s.produce(&mut tx, json!({}), None);
        open.push((id, tx));
    }
    let all: Vec<i64> = open.iter().map(|(id, _)| *id).collect();
    let mut claimed = Vec::new();
    // Commit newest first: every claim must stop below the oldest still-open producer.
    while let Some((_, tx)) = open.pop() {
        tx.commit().unwrap();
        let got = ids(&g.claim(&mut c, 10));
        let lowest_open = open.iter().map(|(id, _)| *id).min();
        if let Some(lowest) = lowest_open {
            assert!(got.iter().all(|id| *id < lowest), "claimed {got:?} while {lowest} is open");
        }
        claimed.extend(got);
    }
    assert_eq!(claimed, all, "every committed message exactly once, in id order");
}

#[test]
fn an_unrelated_writer_does_not_hold_the_stream_back() {
    let mut c = connect();
    let mut writer = connect();
    let s = Stream::create(&mut c, "fence-unrelated");
    let other = Stream::create(&mut c, "fence-other");
    let g = s.group(&mut c, "g", None);

    // A long transaction that writes, even one producing to another stream.
    let mut tx = writer.transaction().unwrap();
    tx.query_one("SELECT pg_current_xact_id()", &[]).unwrap();
    other.produce(&mut tx, json!({}), None);
    let id = s.produce(&mut c, json!({}), None);
    assert_eq!(ids(&g.claim(&mut c, 10)), vec![id], "only this stream's producers can hold its ids");
    tx.commit().unwrap();
}

#[test]
fn a_stored_observation_matures_while_newer_producers_run() {
    let mut c = connect();
    let mut first = connect();
    let mut second = connect();
    let s = Stream::create(&mut c, "fence-mature");
    let g = s.group(&mut c, "g", None);

    let mut old_tx = first.transaction().unwrap();
    let held = s.produce(&mut old_tx, json!({}), None);
    let committed = s.produce(&mut c, json!({}), None);
    assert!(g.claim(&mut c, 10).is_empty(), "{held} is open");
    let stored: Option<i64> = c
        .query_one(&format!("SELECT fence_head FROM {} WHERE consumer_group_id = $1", s.table("cursor")), &[&g.id])
        .unwrap()
        .get(0);
    assert_eq!(stored, Some(committed), "the claim stored what it saw, to prove later");

    // A newer producer opens before the old one ends: the stored observation is proven by the
    // old one ending, while the new one's message stays behind the fence.
    let mut new_tx = second.transaction().unwrap();
    let newer = s.produce(&mut new_tx, json!({}), None);
    old_tx.commit().unwrap();
    assert_eq!(ids(&g.claim(&mut c, 10)), vec![held, committed]);
    assert!(g.claim(&mut c, 10).is_empty(), "{newer} is open");
    new_tx.commit().unwrap();
    assert_eq!(ids(&g.claim(&mut c, 10)), vec![newer]);
}

#[test]
fn read_only_transactions_hold_nothing_back() {
    let mut c = connect();
    let mut reader = connect();
    let s = Stream::create(&mut c, "fence-reader");
    let g = s.group(&mut c, "g", None);
    let mut tx = reader.transaction().unwrap();
    tx.query_one("SELECT count(*) FROM sqlstreams.stream", &[]).unwrap();
    let id = s.produce(&mut c, json!({}), None);
    assert_eq!(ids(&g.claim(&mut c, 10)), vec![id]);
    tx.commit().unwrap();
}

#[test]
fn the_outbox_message_appears_exactly_when_the_business_write_commits() {
    let mut c = connect();
    let mut app = connect();
    let s = Stream::create(&mut c, "outbox");
    let g = s.group(&mut c, "g", None);
    app.batch_execute("CREATE TABLE IF NOT EXISTS outbox_accounts (id text PRIMARY KEY, balance int)").unwrap();
    let account = unique("acct");

    let mut tx = app.transaction().unwrap();
    tx.execute("INSERT INTO outbox_accounts VALUES ($1, 100)", &[&account]).unwrap();
    let id = s.produce(&mut tx, json!({"account": account}), Some(&account));
    assert!(g.claim(&mut c, 10).is_empty());
    tx.rollback().unwrap();
    assert!(g.claim(&mut c, 10).is_empty(), "a rolled-back business write sends nothing");

    let mut tx = app.transaction().unwrap();
    tx.execute("INSERT INTO outbox_accounts VALUES ($1, 100)", &[&account]).unwrap();
    let committed = s.produce(&mut tx, json!({"account": account}), Some(&account));
    tx.commit().unwrap();
    assert_eq!(ids(&g.claim(&mut c, 10)), vec![committed]);
    assert!(committed > id);
}

/// From an adversary: a group that starts at the head has a fence that proved nothing, so a
/// seek back replays the messages of producers that were open when it was created, once they
/// commit, in order. (It took the head as proven: the replay handed out the committed message
/// after the open one and moved the lane past it, and a backend that found the lane empty
/// remembered so.)
#[test]
fn a_group_started_at_the_head_replays_what_open_producers_commit_after_a_seek_back() {
    let mut c = connect();
    let mut slow = connect();
    let mut consumer = connect();
    let s = Stream::create(&mut c, "fence-head-seek");
    let mut slow_tx = slow.transaction().unwrap();
    let first = s.produce(&mut slow_tx, json!({"slow": true}), Some("k"));
    let second = s.produce(&mut c, json!({"fast": true}), Some("k"));
    let g = c
        .query_one("SELECT sqlstreams.create_group($1, 'g', start_at => 'head')", &[&s.name])
        .map(|r| Group { stream: s.clone(), name: "g".into(), id: r.get(0) })
        .unwrap();
    let other = s.group(&mut c, "other", None);
    c.execute("SELECT sqlstreams.seek($1, 'g', to_id => 0)", &[&s.name]).unwrap();
    for _ in 0..3 {
        assert!(g.claim(&mut consumer, 10).is_empty(), "claiming {second} would skip the open {first}");
    }
    slow_tx.commit().unwrap();
    assert_eq!(ids(&g.claim(&mut consumer, 10)), vec![first, second], "the replay has both, in order");
    assert_eq!(ids(&other.claim(&mut consumer, 10)), vec![first, second], "and so has every other group");
}

/// The interleaving behind the messages that `nextval`'s logged value let claims skip
/// (docs/semantics.md, "A head read without the lock"), set up with a debugger. While `nextval`
/// logs ahead it writes the value it logs (up to 32 past the last id handed out) into the
/// sequence's row, and puts the real one back before it lets the sequence's buffer go.
///
/// 1. The control: a plain `SELECT last_value`, as claims used to read the head, stops after its
///    scan let the sequence's buffer go and before it reads the row; a producer then stops inside
///    `nextval` while it logs ahead, and the read goes on. It returns the logged value, an id not
///    handed out: this is how the skipped messages came about, and it shows the setup works.
/// 2. The same with the head as the extension reads it (`group_status`, which reads it as claims
///    and `create_group` do): it must return an id that was handed out. (Read under the buffer's
///    lock, it scans no row and does not stop at all.)
/// 3. With a producer stopped inside `nextval` again, the extension's read of the head waits for
///    the buffer, and returns the producer's id once it goes on.
#[cfg(target_arch = "x86_64")] // the breakpoints' conditions read x86-64 registers
#[test]
fn the_head_is_never_the_value_nextval_logs_ahead() {
    use std::thread::JoinHandle;

    use postgres::Client;
    use sqlstreams_tests::debugger::{backend_pid, join, waits_for_a_buffer, Debugger};

    // XLogInsert(rmid, info): RM_SEQ_ID is 15 in every PostgreSQL this supports.
    const LOGGING_AHEAD: &str = "($rdi & 0xff) == 15";

    let mut c = connect();
    let s = Stream::create(&mut c, "fence-logged-head");
    s.group(&mut c, "g", None);
    s.produce(&mut c, json!({}), None);
    let sequence = format!("{}_seq", s.table("message_log"));
    let sequence_oid: u32 = c.query_one("SELECT $1::text::regclass::oid", &[&sequence]).unwrap().get(0);
    // The read stops where a scan of the sequence's row reads its columns (the slot's
    // tts_tableOid is at byte 56 in every PostgreSQL this supports).
    let row_read_stop = format!("*(unsigned int *)($rdi + 56) == {sequence_oid}");
    let read = |mut reader: Client, sql: String, name: String| -> JoinHandle<(Client, i64)> {
        std::thread::spawn(move || {
            let head: i64 = reader.query_one(sql.as_str(), &[&name]).unwrap().get(0);
            (reader, head)
        })
    };
    let produce = |mut producer: Client, name: String| -> JoinHandle<(Client, i64)> {
        std::thread::spawn(move || {
            producer.batch_execute("BEGIN; SET LOCAL sqlstreams.notify = off").unwrap();
            let id: i64 = producer.query_one("SELECT sqlstreams.produce($1, '{}')", &[&name]).unwrap().get(0);
            producer.batch_execute("COMMIT").unwrap();
            (producer, id)
        })
    };
    let mut reader = connect();
    let mut producer = connect();
    let (reader_pid, producer_pid) = (backend_pid(&mut reader), backend_pid(&mut producer));

    // 1 and 2: the head read with the stop armed, and a producer logging ahead if it stops.
    for (what, sql) in [
        ("a plain SELECT last_value", format!("SELECT last_value FROM {sequence} WHERE $1::text IS NOT NULL")),
        ("the extension's head", "SELECT head FROM sqlstreams.group_status($1, 'g')".to_string()),
    ] {
        c.batch_execute("CHECKPOINT").unwrap(); // the producer's next nextval logs ahead
        let mut row_read = Debugger::attach(reader_pid, "slot_getsomeattrs_int", &row_read_stop);
        let reading = read(reader, sql, s.name.clone());
        let stopped = row_read.wait_for_stop(|| reading.is_finished());
        let (returned, head, handed_out) = if stopped {
            let mut logging = Debugger::attach(producer_pid, "XLogInsert", LOGGING_AHEAD);
            let producing = produce(producer, s.name.clone());
            assert!(logging.wait_for_stop(|| producing.is_finished()), "after a checkpoint, nextval logs ahead");
            row_read.detach();
            // The read goes on now. group_status reads the head twice, and its second read waits
            // for the producer: the first is done once it waits (or returns).
            waits_for_a_buffer(&mut c, reader_pid, || reading.is_finished());
            logging.detach();
            let (returned, head) = join(reading);
            let (p, id) = join(producing);
            producer = p;
            (returned, head, id)
        } else {
            row_read.detach();
            let (returned, head) = join(reading);
            (returned, head, s.produce(&mut c, json!({}), None) - 1)
        };
        reader = returned;
        if what == "a plain SELECT last_value" {
            assert!(stopped && head > handed_out, "the control: {what} read {head} where {handed_out} was handed out");
        } else {
            assert!(
                head <= handed_out,
                "{what} was {head}, an id nextval logged but had not handed out ({handed_out})"
            );
        }
    }

    // 3.
    c.batch_execute("CHECKPOINT").unwrap();
    let mut logging = Debugger::attach(producer_pid, "XLogInsert", LOGGING_AHEAD);
    let producing = produce(producer, s.name.clone());
    assert!(logging.wait_for_stop(|| producing.is_finished()), "after a checkpoint, nextval logs ahead");
    let reading = read(reader, "SELECT head FROM sqlstreams.group_status($1, 'g')".to_string(), s.name.clone());
    let waited = waits_for_a_buffer(&mut c, reader_pid, || reading.is_finished());
    logging.detach();
    let (_, head) = join(reading);
    let (_, id) = join(producing);
    assert!(waited, "a read of the head while nextval logs ahead returned {head} without waiting for it");
    assert_eq!(head, id, "the head once nextval handed out {id}");
}
