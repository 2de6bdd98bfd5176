//! W9 growth: what one claim costs as a stream ages, as its backlog grows, as retries wait and
//! as an ordered key stays blocked. Each curve is one operation timed at growing sizes of one
//! dimension, each size on a stream of its own, and compared with its smallest size.
//!
//! An operation is timed as the round trip of its statement, inside a transaction that is then
//! rolled back: every repetition does the same work on the same rows, and the sizes stay what
//! they were built to be. `SELECT 1`'s round trip is the floor the page subtracts to estimate
//! server time.

use std::time::Instant;

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
}

/// The whole workload's measurements.
#[derive(Clone, Debug, Default)]
pub struct Growth {
    pub points: Vec<Point>,
    /// Round trip of `SELECT 1`, median (µs).
    pub floor_us: f64,
}

const REPS_FULL: usize = 200;
const REPS_QUICK: usize = 40;

pub async fn run(url: &str, quick: bool) -> Growth {
    let db = connect(url).await;
    let reps = if quick { REPS_QUICK } else { REPS_FULL };
    let mut growth = Growth::default();
    let floor = time(reps * 5, || async { db.execute("SELECT 1", &[]).await.unwrap() }).await;
    growth.floor_us = floor.0;
    println!("W9 SELECT 1 round trip: median {:.0} µs", floor.0);

    let partitions: &[i64] = if quick { &[10, 50, 100] } else { &[10, 100, 500] };
    for &n in partitions {
        history(&db, n, reps, &mut growth).await;
    }
    let backlogs: &[i64] = if quick { &[0, 100_000, 500_000] } else { &[0, 1_000_000, 5_000_000] };
    for &n in backlogs {
        backlog(&db, n, reps, &mut growth).await;
    }
    let rows: &[i64] = if quick { &[0, 10_000, 30_000] } else { &[0, 10_000, 100_000] };
    for &n in rows {
        retries(&db, n, reps, &mut growth).await;
    }
    for &n in rows {
        blocked(&db, n, reps, &mut growth).await;
    }
    growth
}

/// A stream whose `consumed` messages went through one group, in partitions of 1,000 ids, the
/// very first of them dead-lettered: the cost of claiming and acking 100 fresh messages with
/// every consumed partition still there (as between two retention steps), then after retention
/// (`maintain()`, which the consumers' own claims also run) dropped them. The dead letter keeps
/// no partition (its message is archived).
async fn history(db: &Pg, partitions: i64, reps: usize, growth: &mut Growth) {
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
    record(growth, "claim+ack 100, consumed partitions kept", &size, claim_ack(db, &stream, reps).await);
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
    let size = format!("{partitions} consumed ({} partitions)", partition_count(db, &stream).await);
    record(
        growth,
        "claim+ack 100, after retention (a dead letter at the start)",
        &size,
        claim_ack(db, &stream, reps).await,
    );
    drop_stream(db, &stream).await;
}

/// A backlog of `n` messages nobody claimed yet: claim and ack 100 of them.
async fn backlog(db: &Pg, n: i64, reps: usize, growth: &mut Growth) {
    let stream = new_stream(db, &format!("backlog-{n}"), "partition_size => 1000000").await;
    group(db, &stream, "NULL").await;
    produce(db, &stream, n.max(100) + 1, None).await;
    settle(db, &stream).await;
    record(growth, "claim+ack 100, backlog", &format!("{n} backlog"), claim_ack(db, &stream, reps).await);
    drop_stream(db, &stream).await;
}

/// `n` failed messages waiting an hour for their retry: an idle claim, `group_status`, and a
/// claim and ack of 100 fresh messages.
async fn retries(db: &Pg, n: i64, reps: usize, growth: &mut Growth) {
    let stream = new_stream(db, &format!("retries-{n}"), "").await;
    group(db, &stream, "NULL").await;
    produce(db, &stream, n, None).await;
    fail_all(db, &stream).await;
    let size = format!("{n} future retries");
    record(growth, "idle claim, future retries", &size, idle(db, &stream, reps).await);
    record(growth, "group_status, future retries", &size, status(db, &stream, reps).await);
    produce(db, &stream, 101, None).await;
    settle(db, &stream).await;
    record(growth, "claim+ack 100, future retries", &size, claim_ack(db, &stream, reps).await);
    drop_stream(db, &stream).await;
}

/// An ordered key whose first message waits an hour for its retry, with `n` later messages of
/// the key deferred behind it: an idle claim, `group_status`, and a claim of 100 new messages
/// of the key (all of which wait too).
async fn blocked(db: &Pg, n: i64, reps: usize, growth: &mut Growth) {
    let stream = new_stream(db, &format!("blocked-{n}"), "").await;
    group(db, &stream, "'ordered'").await;
    produce(db, &stream, 1, Some("blocked")).await;
    fail_all(db, &stream).await;
    produce(db, &stream, n, Some("blocked")).await;
    defer_all(db, &stream, n).await;
    let size = format!("{n} deferred behind one key");
    record(growth, "idle claim, blocked key", &size, idle(db, &stream, reps).await);
    record(growth, "group_status, blocked key", &size, status(db, &stream, reps).await);
    produce(db, &stream, 100, Some("blocked")).await;
    let claim = db.prepare("SELECT count(*) FROM sqlstreams.claim($1, 'consumer', 100)").await.unwrap();
    let timed = rolled_back(db, reps, || async {
        let n: i64 = db.query_one(&claim, &[&stream]).await.unwrap().get(0);
        assert_eq!(n, 0, "a blocked key handed out a message");
    })
    .await;
    record(growth, "claim of 100 on the blocked key", &size, timed);
    drop_stream(db, &stream).await;
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

async fn drop_stream(db: &Pg, stream: &str) {
    db.execute("SELECT sqlstreams.drop_stream($1)", &[&stream]).await.unwrap();
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

/// Claim 100 and ack them with `ack_batch`, rolled back after each repetition.
async fn claim_ack(db: &Pg, stream: &str, reps: usize) -> (f64, f64) {
    let claim = db.prepare("SELECT message_id, lease_token FROM sqlstreams.claim($1, 'consumer', 100)").await.unwrap();
    let ack = db.prepare("SELECT sqlstreams.ack_batch($1, 'consumer', $2, $3)").await.unwrap();
    rolled_back(db, reps, || async {
        let rows = db.query(&claim, &[&stream]).await.unwrap();
        assert_eq!(rows.len(), 100, "claim+ack needs 100 messages to hand out");
        let token: uuid::Uuid = rows[0].get(1);
        let ids: Vec<i64> = rows.iter().map(|r| r.get(0)).collect();
        db.execute(&ack, &[&stream, &token, &ids]).await.unwrap();
    })
    .await
}

/// A claim that finds nothing to hand out.
async fn idle(db: &Pg, stream: &str, reps: usize) -> (f64, f64) {
    let claim = db.prepare("SELECT count(*) FROM sqlstreams.claim($1, 'consumer', 100)").await.unwrap();
    rolled_back(db, reps, || async {
        let n: i64 = db.query_one(&claim, &[&stream]).await.unwrap().get(0);
        assert_eq!(n, 0, "an idle claim handed out a message");
    })
    .await
}

async fn status(db: &Pg, stream: &str, reps: usize) -> (f64, f64) {
    let status = db.prepare("SELECT * FROM sqlstreams.group_status($1, 'consumer')").await.unwrap();
    rolled_back(db, reps, || async {
        db.query_one(&status, &[&stream]).await.unwrap();
    })
    .await
}

/// Times `op` `reps` times, each in a transaction rolled back afterwards (the BEGIN and the
/// ROLLBACK are not timed); returns the median and p99 in µs, after 10 untimed warm-ups.
async fn rolled_back<F, Fut>(db: &Pg, reps: usize, op: F) -> (f64, f64)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let mut samples = Vec::with_capacity(reps);
    for i in 0..reps + 10 {
        db.batch_execute("BEGIN").await.unwrap();
        let started = Instant::now();
        op().await;
        let elapsed = started.elapsed().as_secs_f64() * 1e6;
        db.batch_execute("ROLLBACK").await.unwrap();
        if i >= 10 {
            samples.push(elapsed);
        }
    }
    percentiles(samples)
}

async fn time<F, Fut, T>(reps: usize, op: F) -> (f64, f64)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = T>,
{
    let mut samples = Vec::with_capacity(reps);
    for _ in 0..reps {
        let started = Instant::now();
        op().await;
        samples.push(started.elapsed().as_secs_f64() * 1e6);
    }
    percentiles(samples)
}

fn percentiles(mut samples: Vec<f64>) -> (f64, f64) {
    samples.sort_by(f64::total_cmp);
    let at = |q: f64| samples[((samples.len() - 1) as f64 * q).round() as usize];
    (at(0.5), at(0.99))
}

fn record(growth: &mut Growth, curve: &'static str, size: &str, (median_us, p99_us): (f64, f64)) {
    println!("W9 {curve:<42} {size:<28} median {median_us:>8.0} µs p99 {p99_us:>8.0} µs");
    growth.points.push(Point { curve, size: size.to_string(), median_us, p99_us });
}

/// The targets: every curve within this factor of its smallest size.
const FLAT: f64 = 1.3;

impl Growth {
    /// Each curve's largest size against its smallest, with the target.
    pub fn ratios(&self) -> Vec<String> {
        self.curves()
            .into_iter()
            .map(|(curve, points)| {
                let (first, last) = (points[0], points[points.len() - 1]);
                let ratio = last.median_us / first.median_us;
                let verdict = if ratio <= FLAT { "met" } else { "missed" };
                format!(
                    "W9 {curve}: {} → {}: {:.0} → {:.0} µs, {ratio:.2}× (target ≤ {FLAT}×: {verdict})",
                    first.size, last.size, first.median_us, last.median_us
                )
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
             transaction that is rolled back, so it does the same work on the same rows. Times are round trips \
             from the benchmark's connection; `SELECT 1` takes {:.0} µs (median), so server time is about the \
             round trip minus that. Target (issue 14): every curve within {FLAT}× of its smallest size.\n",
            self.floor_us
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
            "\n| curve | size | median µs | p99 µs | server µs (median − SELECT 1) | × smallest |\n|---|---|---|---|---|---|"
        );
        for (curve, points) in self.curves() {
            for p in &points {
                let _ = writeln!(
                    md,
                    "| {curve} | {} | {:.0} | {:.0} | {:.0} | {:.2} |",
                    p.size,
                    p.median_us,
                    p.p99_us,
                    (p.median_us - self.floor_us).max(0.0),
                    p.median_us / points[0].median_us
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
        let ratio = |p: &Point, first: &Point| p.median_us / first.median_us;
        let max = curves.iter().flat_map(|(_, ps)| ps.iter().map(|p| ratio(p, ps[0]))).fold(FLAT, f64::max) * 1.1;
        let root = SVGBackend::new(path, (900, 560)).into_drawing_area();
        root.fill(&WHITE)?;
        let mut chart = ChartBuilder::on(&root)
            .caption("W9: cost at each size ÷ cost at the smallest size", ("sans-serif", 20))
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
