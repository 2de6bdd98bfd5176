//! W9 growth: what one claim costs as a stream ages, as its backlog grows, as retries wait and
//! as an ordered key stays blocked. Each curve is one operation timed at growing sizes of one
//! dimension, each size on a stream of its own, and compared with its smallest size.
//!
//! An operation is timed as the round trip of its statement, inside a transaction that is then
//! rolled back: every repetition does the same work on the same rows, and the sizes stay what
//! they were built to be. (An idle claim commits, as a consumer's does: it writes nothing, and
//! what it learned of the lanes counts once it commits.) The sizes of a curve are timed in turns, one repetition of each per
//! round (who goes first rotates), with a `SELECT 1` per round: a stretch of noise from the
//! machine's neighbours then falls on every size alike. Server time is what the server counted
//! in the operation's functions (`track_functions = all`, read before and after it inside the
//! repetition's own transaction), so the round trip's noise stays out of it; without
//! those counts, the round trip less `SELECT 1`'s estimates it. Before each repetition of an
//! operation that writes, the tables it writes are vacuumed and one untimed repetition runs:
//! rolled-back repetitions leave dead index entries on the very keys and ids the next ones
//! write again, which a committed claim never meets, and walking the dead entries of hundreds
//! of them would be the benchmark's cost, not the claim's; the untimed one plans again what
//! the vacuum's new statistics invalidated, and leaves the timed one the dead entries of one.

use std::time::Instant;

use tokio_postgres::Statement;

use crate::systems::{connect, Pg};

/// One measured point of a curve.
#[derive(Clone, Debug)]
pub struct Point {
    /// The curve: an operation under one growing dimension.
    pub curve: &'static str,
    /// The size, as printed ("500 partitions").
    pub size: String,
    pub median_us: f64,
    pub p99_us: f64,
    /// Median round trip of `SELECT 1` in the same rounds.
    pub floor_us: f64,
    /// Median time spent in the operation's sqlstreams functions, as the server counted it
    /// (`track_functions = all`); `None` when the server does not count it.
    pub function_us: Option<f64>,
}

/// The whole workload's measurements.
#[derive(Clone, Debug, Default)]
pub struct Growth {
    pub points: Vec<Point>,
}

const REPS_FULL: usize = 200;
const REPS_QUICK: usize = 40;
/// Untimed rounds before the timed ones.
const WARM_UP: usize = 10;

/// A stream built to one size of a dimension.
struct Subject {
    size: String,
    stream: String,
    /// The stream's tables that the claim path writes (vacuumed after each repetition).
    written: String,
}

pub async fn run(url: &str, quick: bool) -> Growth {
    let db = connect(url).await;
    let reps = if quick { REPS_QUICK } else { REPS_FULL };
    let mut growth = Growth::default();

    let partitions: &[i64] = if quick { &[10, 50, 100] } else { &[10, 100, 500] };
    let mut subjects = vec![];
    for &n in partitions {
        subjects.push(history(&db, n).await);
    }
    measure(&db, &mut growth, "claim+ack 100, consumed partitions kept", &subjects, reps, Op::ClaimAck).await;
    for (subject, &n) in subjects.iter_mut().zip(partitions) {
        retain(&db, &subject.stream).await;
        subject.size = format!("{n} consumed ({} partitions)", partition_count(&db, &subject.stream).await);
    }
    let curve = "claim+ack 100, after retention (a dead letter at the start)";
    measure(&db, &mut growth, curve, &subjects, reps, Op::ClaimAck).await;
    drop_all(&db, subjects).await;

    let backlogs: &[i64] = if quick { &[0, 100_000, 500_000] } else { &[0, 1_000_000, 5_000_000] };
    let mut subjects = vec![];
    for &n in backlogs {
        subjects.push(backlog(&db, n).await);
    }
    measure(&db, &mut growth, "claim+ack 100, backlog", &subjects, reps, Op::ClaimAck).await;
    drop_all(&db, subjects).await;

    let rows: &[i64] = if quick { &[0, 10_000, 30_000] } else { &[0, 10_000, 100_000] };
    let mut subjects = vec![];
    for &n in rows {
        subjects.push(retries(&db, n).await);
    }
    measure(&db, &mut growth, "idle claim, future retries", &subjects, reps, Op::Idle).await;
    measure(&db, &mut growth, "group_status, future retries", &subjects, reps, Op::Status).await;
    for subject in &subjects {
        produce(&db, &subject.stream, 101, None).await;
        settle(&db, &subject.stream).await;
    }
    measure(&db, &mut growth, "claim+ack 100, future retries", &subjects, reps, Op::ClaimAck).await;
    drop_all(&db, subjects).await;

    let mut subjects = vec![];
    for &n in rows {
        subjects.push(blocked(&db, n).await);
    }
    measure(&db, &mut growth, "idle claim, blocked key", &subjects, reps, Op::Idle).await;
    measure(&db, &mut growth, "group_status, blocked key", &subjects, reps, Op::Status).await;
    for subject in &subjects {
        produce(&db, &subject.stream, 100, Some("blocked")).await;
    }
    measure(&db, &mut growth, "claim of 100 on the blocked key", &subjects, reps, Op::BlockedClaim).await;
    drop_all(&db, subjects).await;
    growth
}

/// A stream whose `consumed` messages went through one group, in partitions of 1,000 ids, the
/// very first of them dead-lettered: the cost of claiming and acking 100 fresh messages with
/// every consumed partition still there (as between two retention steps), then after retention
/// (`retain`) dropped them. The dead letter keeps no partition (its message is archived).
async fn history(db: &Pg, partitions: i64) -> Subject {
    let stream = new_stream(db, &format!("history-{partitions}"), "partition_size => 1000").await;
    group(db, &stream, "NULL").await;
    produce(db, &stream, partitions * 1000, None).await;
    let claim_one = "SELECT message_id, lease_token FROM sqlstreams.claim($1, 'consumer', 1)";
    let first = db.query_one(claim_one, &[&stream]).await.unwrap();
    let (id, token): (i64, uuid::Uuid) = (first.get(0), first.get(1));
    db.execute("SELECT sqlstreams.fail($1, 'consumer', $2, $3, 'growth', permanent => true)", &[&stream, &token, &id])
        .await
        .unwrap();
    drain(db, &stream).await;
    produce(db, &stream, 101, None).await;
    settle(db, &stream).await;
    let size = format!("{partitions} consumed ({} partitions)", partition_count(db, &stream).await);
    subject(db, size, stream).await
}

/// Retention (`maintain()`, which the consumers' own claims also run) until it drops nothing more.
async fn retain(db: &Pg, stream: &str) {
    loop {
        let dropped: i64 = db
            .query_one("SELECT coalesce(sum(partitions_dropped), 0)::int8 FROM sqlstreams.maintain()", &[])
            .await
            .unwrap()
            .get(0);
        if dropped == 0 {
            break;
        }
    }
    vacuum(db, &format!("{}, sqlstreams.stream", written_tables(db, stream).await)).await;
}

/// A backlog of `n` messages nobody claimed yet: claim and ack 100 of them.
async fn backlog(db: &Pg, n: i64) -> Subject {
    let stream = new_stream(db, &format!("backlog-{n}"), "partition_size => 1000000").await;
    group(db, &stream, "NULL").await;
    produce(db, &stream, n.max(100) + 1, None).await;
    settle(db, &stream).await;
    subject(db, format!("{n} backlog"), stream).await
}

/// `n` failed messages waiting an hour for their retry: an idle claim, `group_status`, and (once
/// `run` produced 101 more) a claim and ack of 100 fresh messages.
async fn retries(db: &Pg, n: i64) -> Subject {
    let stream = new_stream(db, &format!("retries-{n}"), "").await;
    group(db, &stream, "NULL").await;
    produce(db, &stream, n, None).await;
    fail_all(db, &stream).await;
    subject(db, format!("{n} future retries"), stream).await
}

/// An ordered key whose first message waits an hour for its retry, with `n` later messages of
/// the key deferred behind it: an idle claim, `group_status`, and (once `run` produced 100 more
/// of the key) a claim of those 100, all of which wait too.
async fn blocked(db: &Pg, n: i64) -> Subject {
    let stream = new_stream(db, &format!("blocked-{n}"), "").await;
    group(db, &stream, "'ordered'").await;
    produce(db, &stream, 1, Some("blocked")).await;
    fail_all(db, &stream).await;
    produce(db, &stream, n, Some("blocked")).await;
    defer_all(db, &stream, n).await;
    subject(db, format!("{n} deferred behind one key"), stream).await
}

/// The stream as built, vacuumed and analyzed, so no repetition waits for autovacuum's work.
async fn subject(db: &Pg, size: String, stream: String) -> Subject {
    let written = written_tables(db, &stream).await;
    db.batch_execute(&format!("VACUUM (ANALYZE) {written}")).await.unwrap();
    Subject { size, stream, written }
}

/// The stream's tables that claims and outcomes write, as a list for VACUUM.
async fn written_tables(db: &Pg, stream: &str) -> String {
    let id: i64 = db.query_one("SELECT id FROM sqlstreams.streams WHERE name = $1", &[&stream]).await.unwrap().get(0);
    ["exception_queue", "exception_count", "range_lease", "range_done", "lane", "cursor"]
        .map(|t| format!("sqlstreams.{t}_{id}"))
        .join(", ")
}

/// Vacuums `tables`, index entries included however few (a rolled-back repetition leaves only
/// a few, which VACUUM would otherwise leave in the indexes).
async fn vacuum(db: &Pg, tables: &str) {
    db.batch_execute(&format!("VACUUM (INDEX_CLEANUP ON) {tables}")).await.unwrap();
}

async fn new_stream(db: &Pg, name: &str, options: &str) -> String {
    let stream = format!("bench.growth-{name}-{}", std::process::id());
    let options = if options.is_empty() { String::new() } else { format!(", {options}") };
    db.execute(&format!("SELECT sqlstreams.create_stream($1{options})"), &[&stream]).await.unwrap();
    stream
}

/// One committed claim and ack of a single message, before a measurement: it creates the
/// partitions ahead of the head that a claim makes once, and which a rolled-back repetition would
/// otherwise make (and undo) every time.
async fn settle(db: &Pg, stream: &str) {
    let row = db
        .query_one("SELECT message_id, lease_token FROM sqlstreams.claim($1, 'consumer', 1)", &[&stream])
        .await
        .unwrap();
    let (id, token): (i64, uuid::Uuid) = (row.get(0), row.get(1));
    db.execute("SELECT sqlstreams.ack($1, 'consumer', $2, $3)", &[&stream, &token, &id]).await.unwrap();
}

async fn partition_count(db: &Pg, stream: &str) -> i64 {
    db.query_one(
        "SELECT count(*) FROM pg_inherits i JOIN sqlstreams.stream s ON s.name = $1
         WHERE i.inhparent = format('sqlstreams.message_log_%s', s.id)::regclass",
        &[&stream],
    )
    .await
    .unwrap()
    .get(0)
}

async fn group(db: &Pg, stream: &str, concurrency: &str) {
    db.execute(
        &format!("SELECT sqlstreams.create_group($1, 'consumer', {concurrency}, max_retries => 1000)"),
        &[&stream],
    )
    .await
    .unwrap();
}

async fn drop_all(db: &Pg, subjects: Vec<Subject>) {
    for subject in subjects {
        db.execute("SELECT sqlstreams.drop_stream($1)", &[&subject.stream]).await.unwrap();
    }
}

/// Produces `n` small messages (with `key`, if any) in batches of 10,000.
async fn produce(db: &Pg, stream: &str, n: i64, key: Option<&str>) {
    let mut left = n;
    while left > 0 {
        let batch = left.min(10_000);
        db.execute(
            "SELECT count(*) FROM sqlstreams.produce_batch($1,
                 (SELECT array_agg(jsonb_build_object('n', i)) FROM generate_series(1, $2::int8) i),
                 CASE WHEN $3::text IS NULL THEN NULL
                      ELSE (SELECT array_agg($3::text) FROM generate_series(1, $2::int8)) END)",
            &[&stream, &batch, &key],
        )
        .await
        .unwrap();
        left -= batch;
    }
}

/// Claims (10,000 at a time) and acks until a claim returns nothing; returns how many messages
/// were handed out.
async fn drain(db: &Pg, stream: &str) -> i64 {
    let mut handed = 0;
    loop {
        let (token, ids) = claim_all(db, stream).await;
        let Some(token) = token else { return handed };
        handed += ids.len() as i64;
        db.execute("SELECT sqlstreams.ack_batch($1, 'consumer', $2, $3)", &[&stream, &token, &ids]).await.unwrap();
    }
}

/// Claims everything due, 100 at a time as every consumer in this benchmark does, and fails
/// it one call per message, to retry in an hour. (Until outcomes stopped rewriting their range's
/// list of pending ids, claims of 10,000 made the setup write ~80 KB per failure and leave
/// `range_lease_<id>` hundreds of MB of dead rows, which every curve at that size then read.)
async fn fail_all(db: &Pg, stream: &str) {
    loop {
        let rows = db
            .query("SELECT message_id, lease_token FROM sqlstreams.claim($1, 'consumer', 100, '1 hour')", &[&stream])
            .await
            .unwrap();
        let (token, ids): (Option<uuid::Uuid>, Vec<i64>) =
            (rows.first().map(|r| r.get(1)), rows.iter().map(|r| r.get(0)).collect());
        let Some(token) = token else { return };
        db.execute(
            "SELECT count(sqlstreams.fail($1, 'consumer', $2, id, 'growth', retry_after => '1 hour'))
             FROM unnest($3::int8[]) AS id",
            &[&stream, &token, &ids],
        )
        .await
        .unwrap();
    }
}

/// Claims until the group has handed out or deferred everything (a claim that only defers
/// returns nothing, so the loop asks the group how far it got).
async fn defer_all(db: &Pg, stream: &str, expected: i64) {
    for _ in 0..expected / 10_000 + 5 {
        let (token, _) = claim_all(db, stream).await;
        assert!(token.is_none(), "a blocked key handed out a message");
        let deferred: i64 = db
            .query_one("SELECT deferred FROM sqlstreams.group_status($1, 'consumer')", &[&stream])
            .await
            .unwrap()
            .get(0);
        if deferred == expected {
            return;
        }
    }
    panic!("{expected} rows did not defer behind the blocked key");
}

/// One claim of up to 10,000 messages with an hour's lease: its token (None when it handed out
/// nothing) and the ids.
async fn claim_all(db: &Pg, stream: &str) -> (Option<uuid::Uuid>, Vec<i64>) {
    let rows = db
        .query("SELECT message_id, lease_token FROM sqlstreams.claim($1, 'consumer', 10000, '1 hour')", &[&stream])
        .await
        .unwrap();
    (rows.first().map(|r| r.get(1)), rows.iter().map(|r| r.get(0)).collect())
}

/// What a curve times, one repetition.
#[derive(Clone, Copy, PartialEq)]
enum Op {
    /// Claim 100 and ack them with `ack_batch`.
    ClaimAck,
    /// A claim that finds nothing to hand out.
    Idle,
    Status,
    /// A claim of 100 messages of the blocked key, each of which waits.
    BlockedClaim,
}

impl Op {
    async fn prepare(self, db: &Pg) -> Vec<Statement> {
        let sql: &[&str] = match self {
            Op::ClaimAck => &[
                "SELECT message_id, lease_token FROM sqlstreams.claim($1, 'consumer', 100)",
                "SELECT sqlstreams.ack_batch($1, 'consumer', $2, $3)",
            ],
            Op::Idle | Op::BlockedClaim => &["SELECT count(*) FROM sqlstreams.claim($1, 'consumer', 100)"],
            Op::Status => &["SELECT * FROM sqlstreams.group_status($1, 'consumer')"],
        };
        let mut statements = vec![];
        for sql in sql {
            statements.push(db.prepare(sql).await.unwrap());
        }
        statements
    }

    async fn run(self, db: &Pg, statements: &[Statement], stream: &str) {
        match self {
            Op::ClaimAck => {
                let rows = db.query(&statements[0], &[&stream]).await.unwrap();
                assert_eq!(rows.len(), 100, "claim+ack needs 100 messages to hand out");
                let token: uuid::Uuid = rows[0].get(1);
                let ids: Vec<i64> = rows.iter().map(|r| r.get(0)).collect();
                db.execute(&statements[1], &[&stream, &token, &ids]).await.unwrap();
            }
            Op::Idle | Op::BlockedClaim => {
                let n: i64 = db.query_one(&statements[0], &[&stream]).await.unwrap().get(0);
                assert_eq!(n, 0, "a claim that must find nothing to run handed out a message");
            }
            Op::Status => {
                db.query_one(&statements[0], &[&stream]).await.unwrap();
            }
        }
    }

    /// The sqlstreams functions it calls.
    fn functions(self) -> Vec<&'static str> {
        match self {
            Op::ClaimAck => vec!["claim", "ack_batch"],
            Op::Idle | Op::BlockedClaim => vec!["claim"],
            Op::Status => vec!["group_status"],
        }
    }

    /// How its transaction ends: an idle claim commits, as it would in a consumer (it writes
    /// nothing, and a backend counts what it learned of the lanes once its claim commits).
    fn end(self) -> &'static str {
        match self {
            Op::Idle => "COMMIT",
            Op::ClaimAck | Op::Status | Op::BlockedClaim => "ROLLBACK",
        }
    }

    fn writes(self) -> bool {
        matches!(self, Op::ClaimAck | Op::BlockedClaim)
    }
}

/// Times `op` on every subject, `reps` times each, in rounds (see the module documentation);
/// each repetition in a transaction of its own, rolled back afterwards unless it is an idle
/// claim (the BEGIN and the end are not timed). Records each subject's median and p99 with the round trip of `SELECT 1` in the
/// same rounds.
async fn measure(db: &Pg, growth: &mut Growth, curve: &'static str, subjects: &[Subject], reps: usize, op: Op) {
    let statements = op.prepare(db).await;
    let floor_statement = db.prepare("SELECT 1").await.unwrap();
    // This backend's counts not reported yet (in milliseconds): none are reported while a
    // transaction is open, so two readings around the operation in one transaction bracket it.
    let function_time = db
        .prepare(
            "SELECT coalesce(sum(total_time), 0)::float8 FROM pg_catalog.pg_stat_xact_user_functions
             WHERE schemaname = 'sqlstreams' AND funcname = ANY($1)",
        )
        .await
        .unwrap();
    let counted = db.query_one("SHOW track_functions", &[]).await.unwrap().get::<_, String>(0) == "all";
    let mut samples = vec![Vec::with_capacity(reps); subjects.len()];
    let mut function_samples = vec![Vec::with_capacity(reps); subjects.len()];
    let mut floor = Vec::with_capacity(reps);
    for round in 0..reps + WARM_UP {
        for turn in 0..subjects.len() {
            let i = (round + turn) % subjects.len();
            let subject = &subjects[i];
            if op.writes() {
                // VACUUM updates the tables' statistics, which makes every backend plan its
                // statements over them again: one untimed repetition does that.
                vacuum(db, &subject.written).await;
                db.batch_execute("BEGIN").await.unwrap();
                op.run(db, &statements, &subject.stream).await;
                db.batch_execute("ROLLBACK").await.unwrap();
            }
            db.batch_execute("BEGIN").await.unwrap();
            let before: f64 = db.query_one(&function_time, &[&op.functions()]).await.unwrap().get(0);
            let started = Instant::now();
            op.run(db, &statements, &subject.stream).await;
            let elapsed = started.elapsed().as_secs_f64() * 1e6;
            let after: f64 = db.query_one(&function_time, &[&op.functions()]).await.unwrap().get(0);
            let in_functions = after - before;
            db.batch_execute(op.end()).await.unwrap();
            if round >= WARM_UP {
                samples[i].push(elapsed);
                function_samples[i].push(in_functions * 1e3);
            }
        }
        let started = Instant::now();
        db.query_one(&floor_statement, &[]).await.unwrap();
        if round >= WARM_UP {
            floor.push(started.elapsed().as_secs_f64() * 1e6);
        }
    }
    let (floor_us, _) = percentiles(floor);
    for ((subject, samples), in_functions) in subjects.iter().zip(samples).zip(function_samples) {
        let (median_us, p99_us) = percentiles(samples);
        let function_us = counted.then(|| percentiles(in_functions).0);
        println!(
            "W9 {curve:<42} {:<28} median {median_us:>8.0} µs p99 {p99_us:>8.0} µs (SELECT 1 {floor_us:.0} µs) in functions {:.0} µs",
            subject.size,
            function_us.unwrap_or(f64::NAN)
        );
        growth.points.push(Point { curve, size: subject.size.clone(), median_us, p99_us, floor_us, function_us });
    }
}

fn percentiles(mut samples: Vec<f64>) -> (f64, f64) {
    samples.sort_by(f64::total_cmp);
    let at = |q: f64| samples[((samples.len() - 1) as f64 * q).round() as usize];
    (at(0.5), at(0.99))
}

/// The targets: every curve within this factor of its smallest size.
const FLAT: f64 = 1.3;

/// The absolute targets, on server time at a curve's largest size (µs).
const CEILINGS: [(&str, f64); 4] = [
    ("claim of 100 on the blocked key", 2000.0),
    ("group_status, future retries", 1000.0),
    ("idle claim, future retries", 80.0),
    ("idle claim, blocked key", 80.0),
];

impl Point {
    /// Server time: the time the server counted in the operation's functions, or else the
    /// round trip less `SELECT 1`'s.
    fn server_us(&self) -> f64 {
        self.function_us.unwrap_or(self.median_us - self.floor_us).max(1.0)
    }
}

impl Growth {
    /// Each curve's largest size against its smallest, by server time (and by round trip),
    /// with the targets.
    pub fn ratios(&self) -> Vec<String> {
        self.curves()
            .into_iter()
            .map(|(curve, points)| {
                let (first, last) = (points[0], points[points.len() - 1]);
                let ratio = last.server_us() / first.server_us();
                let verdict = if ratio <= FLAT { "met" } else { "missed" };
                let mut line = format!(
                    "W9 {curve}: {} → {}: server {:.0} → {:.0} µs, {ratio:.2}× (target ≤ {FLAT}×: {verdict}; round trip {:.2}×)",
                    first.size,
                    last.size,
                    first.server_us(),
                    last.server_us(),
                    last.median_us / first.median_us
                );
                if let Some((_, ceiling)) = CEILINGS.iter().find(|(c, _)| *c == curve) {
                    let verdict = if last.server_us() <= *ceiling { "met" } else { "missed" };
                    line += &format!("; {:.0} µs at the largest size, target ≤ {ceiling:.0} µs: {verdict}", last.server_us());
                }
                line
            })
            .collect()
    }

    fn curves(&self) -> Vec<(&'static str, Vec<&Point>)> {
        let mut curves: Vec<(&'static str, Vec<&Point>)> = Vec::new();
        for p in &self.points {
            match curves.iter_mut().find(|(c, _)| *c == p.curve) {
                Some((_, points)) => points.push(p),
                None => curves.push((p.curve, vec![p])),
            }
        }
        curves
    }

    /// `growth.md` and `growth.svg` in `dir`.
    pub fn write(&self, dir: &std::path::Path, machine: &[(String, String)]) -> Result<(), Box<dyn std::error::Error>> {
        use std::fmt::Write as _;
        let mut md = String::from("# sqlstreams: cost as a stream grows (W9)\n\n");
        let _ = writeln!(
            md,
            "One run of `scripts/rig bench --only w9` on the machine below. Each curve times one operation at \
             growing sizes of one dimension, each size on a stream of its own; every repetition runs in a \
             transaction that is rolled back (an idle claim's commits), so it does the same work on the same rows; before one that \
             writes, the tables it writes are vacuumed and one untimed repetition runs. The sizes of a curve take turns, one repetition \
             each per round, with a `SELECT 1` in every round. Round trips are timed from the benchmark's \
             connection; server time is the time the server counted in the operation's sqlstreams functions \
             (`track_functions = all`, read in the repetition's own transaction), median per size. Targets (issue 14): every curve within {FLAT}× of its smallest size, by server time; the \
             blocked-key claim ≤ 2 ms and `group_status` ≤ 1 ms at the largest size; an idle claim ≤ 80 µs.\n"
        );
        let _ = writeln!(md, "| | |\n|---|---|");
        for (k, v) in machine {
            let _ = writeln!(md, "| {k} | {v} |");
        }
        let _ = writeln!(md, "\n![growth](growth.svg)\n\n## Curves\n");
        for line in self.ratios() {
            let _ = writeln!(md, "- {line}");
        }
        let _ = writeln!(
            md,
            "\n| curve | size | round trip median µs | p99 µs | SELECT 1 µs | server µs | server × smallest |\n|---|---|---|---|---|---|---|"
        );
        for (curve, points) in self.curves() {
            for p in &points {
                let _ = writeln!(
                    md,
                    "| {curve} | {} | {:.0} | {:.0} | {:.0} | {:.0} | {:.2} |",
                    p.size,
                    p.median_us,
                    p.p99_us,
                    p.floor_us,
                    p.server_us(),
                    p.server_us() / points[0].server_us()
                );
            }
        }
        md.push('\n');
        md.push_str(include_str!("growth_misses.md"));
        std::fs::write(dir.join("growth.md"), md)?;
        self.plot(&dir.join("growth.svg"))
    }

    fn plot(&self, path: &std::path::Path) -> Result<(), Box<dyn std::error::Error>> {
        use plotters::prelude::*;
        let curves = self.curves();
        let ratio = |p: &Point, first: &Point| p.server_us() / first.server_us();
        let max = curves.iter().flat_map(|(_, ps)| ps.iter().map(|p| ratio(p, ps[0]))).fold(FLAT, f64::max) * 1.1;
        let root = SVGBackend::new(path, (900, 560)).into_drawing_area();
        root.fill(&WHITE)?;
        let mut chart = ChartBuilder::on(&root)
            .caption("W9: server time at each size ÷ at the smallest size", ("sans-serif", 20))
            .margin(15)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(-0.2f64..2.2f64, 0f64..max)?;
        chart.configure_mesh().x_desc("size step (smallest, middle, largest)").y_desc("× smallest").draw()?;
        chart.draw_series(LineSeries::new(vec![(-0.2, FLAT), (2.2, FLAT)], BLACK.stroke_width(1)))?.label("target");
        for (i, (curve, points)) in curves.iter().enumerate() {
            let color = Palette99::pick(i).to_rgba();
            let line: Vec<(f64, f64)> =
                points.iter().enumerate().map(|(x, p)| (x as f64, ratio(p, points[0]))).collect();
            chart
                .draw_series(LineSeries::new(line.clone(), color.stroke_width(2)))?
                .label(*curve)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
            chart.draw_series(line.iter().map(|p| Circle::new(*p, 4, color.filled())))?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .border_style(BLACK)
            .background_style(WHITE.mix(0.8))
            .draw()?;
        root.present()?;
        Ok(())
    }
}
