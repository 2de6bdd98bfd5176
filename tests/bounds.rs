//! Bounded streams (src/bounds.rs): past `max_bytes` or `max_age`, maintain() drops whole
//! partitions even though a group has not consumed them, moves that group past them, and counts
//! what it lost; before that, `consumer_groups` shows what each group holds back.

use postgres::Client;
use sqlstreams_tests::*;

/// (lost, held_back_bytes, committed) of a group, from the view.
fn bound_columns(c: &mut Client, s: &Stream, group: &str) -> (i64, i64, i64) {
    let row = c
        .query_one(
            "SELECT lost, held_back_bytes, committed FROM sqlstreams.consumer_groups WHERE stream = $1 AND name = $2",
            &[&s.name, &group],
        )
        .unwrap();
    (row.get(0), row.get(1), row.get(2))
}

/// maintain_stream until the partitions below `through` are gone (a drop gives way to any
/// other lock on a partition, autovacuum's included, and the next call drops it).
fn maintain_until_dropped(c: &mut Client, s: &Stream, through_partition: usize) {
    for _ in 0..20 {
        c.query("SELECT * FROM sqlstreams.maintain_stream($1)", &[&s.name]).unwrap();
        let left = s.partitions(c);
        if (0..through_partition)
            .all(|p| !left.contains(&format!("{}_p{p}", s.table("message_log")).replace("sqlstreams.", "")))
        {
            return;
        }
    }
    panic!("the partitions out of bounds are still there: {:?}", s.partitions(c));
}

/// A group's loss is said once the step that moved it stands, at the end of the call: a cancel of
/// the call after the step, or a step that fails after the move (here at a trigger a DBA put on
/// the stream's compaction heads, which retention cleans after the bounds), rolls the move back
/// and says no loss; the next step, which stands, says it once. Before, every failed step said a
/// loss that it then rolled back. In a database of its own:
/// `maintain()` meets every stream of its database.
#[test]
fn a_loss_is_said_only_once_the_step_that_made_it_stands() {
    let (_, url) = own_database("bound_fails");
    let (mut c, warnings) = listening_to(&url);
    let s = Stream::create_sized(&mut c, "bounded-fails", 1000);
    s.group(&mut c, "lagging", None);
    s.produce_many(&mut c, 3500, None);
    c.query_one("SELECT sqlstreams.alter_stream($1, max_bytes => 1)", &[&s.name]).unwrap();

    // A cancel after the step (a statement timeout while a DBA's lock holds the next stream's
    // cursors) rolls the move back with the call: no loss is said.
    let blocked = Stream::create_sized(&mut c, "blocked", 1000);
    let mut dba = Client::connect(&url, postgres::NoTls).unwrap();
    let mut locked = dba.transaction().unwrap();
    locked.batch_execute(&format!("LOCK TABLE {} IN ACCESS EXCLUSIVE MODE", blocked.table("cursor"))).unwrap();
    c.batch_execute("SET statement_timeout = '300ms'").unwrap();
    let cancelled = c.query("SELECT * FROM sqlstreams.maintain()", &[]).unwrap_err();
    assert_eq!(sqlstate(&cancelled), "57014", "{cancelled:?}");
    c.batch_execute("RESET statement_timeout").unwrap();
    locked.rollback().unwrap();
    let said = warnings.lock().unwrap().join("\n");
    assert!(!said.contains("lost"), "no loss said for a call cancelled: {said}");
    assert_eq!(bound_columns(&mut c, &s, "lagging").0, 0);

    // A step that fails after the move rolls it back, and says no loss either.
    refuse_on(&mut c, &s.table("compaction_head"), "DELETE", "compaction heads are audited");
    assert_eq!(maintained(&mut c), vec![(blocked.name.clone(), 0)], "the bounded stream's step failed");
    let said = warnings.lock().unwrap().join("\n");
    assert!(said.contains("compaction heads are audited"), "{said}");
    assert!(!said.contains("lost"), "no loss said for a move rolled back: {said}");
    assert_eq!(bound_columns(&mut c, &s, "lagging").0, 0);

    warnings.lock().unwrap().clear();
    c.batch_execute("DROP FUNCTION public.refuse() CASCADE").unwrap();
    maintain_until_dropped(&mut c, &s, 3);
    assert_eq!(bound_columns(&mut c, &s, "lagging").0, 3000);
    let said = warnings.lock().unwrap().join("\n");
    assert_eq!(said.matches("group \"lagging\" lost 3000 message(s)").count(), 1, "{said}");
}

#[test]
fn a_size_bound_drops_what_a_paused_group_holds_back_and_counts_what_it_lost() {
    let (mut c, warnings) = connect_listening();
    let s = Stream::create_sized(&mut c, "bounded-size", 1000);
    let paused = s.group(&mut c, "paused", None);
    let active = s.group(&mut c, "active", None);
    s.produce_many(&mut c, 3500, None);

    // Before it is paused, the group takes five: acks three, fails one (a retry), and leaves one
    // without an outcome.
    let taken = paused.claim(&mut c, 5);
    assert_eq!(ids(&taken), vec![1, 2, 3, 4, 5]);
    paused.ack_batch(&mut c, &taken[..3]);
    paused.fail(&mut c, &taken[3], "later", false, Some("0 seconds"));
    c.query_one("SELECT sqlstreams.pause_group($1, 'paused')", &[&s.name]).unwrap();
    assert_eq!(active.drain(&mut c).len(), 3500);

    // Unbounded, retention keeps everything the paused group has not committed.
    c.query("SELECT * FROM sqlstreams.maintain_stream($1)", &[&s.name]).unwrap();
    let (lost, held_back, _) = bound_columns(&mut c, &s, "paused");
    assert_eq!(lost, 0);
    assert!(held_back > 0, "the paused group holds the first three partitions back");
    assert_eq!(bound_columns(&mut c, &s, "active").1, 0, "the active group holds nothing back");
    assert!(s.partitions(&mut c).iter().any(|p| p.ends_with("_p0")));

    // One byte: every partition but the head's is out of bounds.
    c.query_one("SELECT sqlstreams.alter_stream($1, max_bytes => 1)", &[&s.name]).unwrap();
    maintain_until_dropped(&mut c, &s, 3);
    let (lost, held_back, committed) = bound_columns(&mut c, &s, "paused");
    assert_eq!(committed, 3000);
    assert_eq!(lost, 2995 + 1, "never handed out (6..3000) and handed out without an outcome (5)");
    assert_eq!(held_back, 0);
    assert_eq!(bound_columns(&mut c, &s, "active").0, 0, "the active group lost nothing");
    let said = warnings.lock().unwrap().join("\n");
    assert!(said.contains("group \"paused\" lost 2996 message(s)"), "the loss is said: {said}");
    assert!(!said.contains("\"active\""), "{said}");

    // Running again loses nothing more.
    c.query("SELECT * FROM sqlstreams.maintain_stream($1)", &[&s.name]).unwrap();
    assert_eq!(bound_columns(&mut c, &s, "paused").0, 2996);

    // The open range's outcome reports its lease lost; the retry comes back (its message was
    // archived), then the messages after the bound, and nothing else.
    assert!(!paused.ack(&mut c, &taken[4]), "the range ended with the bound");
    c.query_one("SELECT sqlstreams.resume_group($1, 'paused')", &[&s.name]).unwrap();
    paused.make_due(&mut c);
    let mut got = paused.drain(&mut c);
    got.sort();
    let expected: Vec<i64> = std::iter::once(4).chain(3001..=3500).collect();
    assert_eq!(got, expected);
}

#[test]
fn an_age_bound_drops_partitions_whose_newest_message_is_older() {
    let mut c = connect();
    let s = Stream::create_sized(&mut c, "bounded-age", 1000);
    let g = s.group(&mut c, "forgotten", None);
    s.produce_many(&mut c, 2500, None);
    // The first two partitions were produced two days ago.
    c.batch_execute(&format!(
        "UPDATE {} SET produced_at = now() - interval '2 days' WHERE id <= 2000",
        s.table("message_log")
    ))
    .unwrap();
    c.query_one("SELECT sqlstreams.alter_stream($1, max_age => '3 days')", &[&s.name]).unwrap();
    c.query("SELECT * FROM sqlstreams.maintain_stream($1)", &[&s.name]).unwrap();
    assert_eq!(bound_columns(&mut c, &s, "forgotten").0, 0, "within three days nothing goes");

    c.query_one("SELECT sqlstreams.alter_stream($1, max_age => '1 day')", &[&s.name]).unwrap();
    maintain_until_dropped(&mut c, &s, 2);
    let (lost, _, committed) = bound_columns(&mut c, &s, "forgotten");
    assert_eq!((lost, committed), (2000, 2000));
    let streams = c
        .query_one(
            "SELECT extract(epoch FROM max_age)::float8, max_bytes FROM sqlstreams.streams WHERE name = $1",
            &[&s.name],
        )
        .unwrap();
    assert_eq!(streams.get::<_, Option<f64>>(0), Some(86400.0));
    assert_eq!(streams.get::<_, Option<i64>>(1), None);
    let mut got = g.drain(&mut c);
    got.sort();
    assert_eq!(got, (2001..=2500).collect::<Vec<i64>>());

    // 0 removes the bound.
    c.query_one("SELECT sqlstreams.alter_stream($1, max_age => '0')", &[&s.name]).unwrap();
    let age: Option<String> =
        c.query_one("SELECT max_age::text FROM sqlstreams.streams WHERE name = $1", &[&s.name]).unwrap().get(0);
    assert_eq!(age, None);
}
