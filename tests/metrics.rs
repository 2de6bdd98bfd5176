//! Prometheus metrics without the Rust client: Debian's postgres_exporter (installed by
//! `scripts/rig`) runs docs/prometheus/postgres_exporter.yaml as a `pg_monitor` member, and
//! every metric the file names is scraped with the value SQL reads.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use sqlstreams_tests::*;

const QUERIES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/prometheus/postgres_exporter.yaml");

/// The metric names the queries file declares (`<query>_<column>`, labels left out).
fn declared_metrics() -> Vec<String> {
    let mut query = String::new();
    let mut names = Vec::new();
    for line in std::fs::read_to_string(QUERIES).unwrap().lines() {
        if let Some(name) = line.strip_suffix(':').filter(|l| !l.starts_with([' ', '#'])) {
            query = name.to_owned();
        } else if let Some((column, usage)) = line.trim().strip_prefix("- ").and_then(|l| l.split_once(": {usage: ")) {
            if !usage.starts_with("\"LABEL\"") {
                names.push(format!("{query}_{column}"));
            }
        }
    }
    names
}

/// The exporter process, stopped when the test ends however it ends.
struct Exporter(Child);

impl Drop for Exporter {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn scrape(port: u16) -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) {
            s.write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n").unwrap();
            let mut body = String::new();
            s.read_to_string(&mut body).unwrap();
            return body;
        }
        assert!(Instant::now() < deadline, "postgres_exporter did not listen within 30 s");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The value of `metric` for the sample whose labels include every one of `labels`.
fn sample(body: &str, metric: &str, labels: &[&str]) -> Option<f64> {
    body.lines()
        .filter(|l| l.starts_with(&format!("{metric}{{")))
        .find(|l| labels.iter().all(|label| l.contains(label)))
        .and_then(|l| l.rsplit_once(' '))
        .map(|(_, v)| v.parse().unwrap())
}

#[test]
fn postgres_exporter_serves_every_metric_of_the_queries_file() {
    let (mut c, url) = own_database("metrics");
    let monitor = role(&mut c, "monitor", "IN ROLE pg_monitor");
    let s = Stream::create(&mut c, "metrics");
    let g = s.group(&mut c, "billing", None);
    s.produce_many(&mut c, 6, None);
    let claimed = g.claim(&mut c, 3);
    g.ack(&mut c, &claimed[0]);
    g.fail(&mut c, &claimed[1], "boom", true, None);
    c.batch_execute(&format!("SELECT sqlstreams.pause_group('{}', 'billing')", s.name)).unwrap();
    // A producer that has not committed: a fence holder.
    let mut producer = postgres::Client::connect(&url, postgres::NoTls).unwrap();
    let mut open = producer.transaction().unwrap();
    s.produce(&mut open, json!({}), Some("acct-2"));

    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let dsn = format!("{}?sslmode=disable", url.replacen("postgres://postgres@", &format!("postgres://{monitor}@"), 1));
    let _exporter = Exporter(
        Command::new("prometheus-postgres-exporter")
            .env("DATA_SOURCE_NAME", dsn)
            .args([
                &format!("--extend.query-path={QUERIES}"),
                "--disable-default-metrics",
                "--disable-settings-metrics",
                &format!("--web.listen-address=127.0.0.1:{port}"),
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("prometheus-postgres-exporter (Debian's, installed by scripts/rig)"),
    );
    let body = scrape(port);
    let scrape_error = body.lines().find_map(|l| l.strip_prefix("pg_exporter_last_scrape_error "));
    assert_eq!(scrape_error, Some("0"), "a query failed:\n{body}");

    let (stream, group) = (format!("stream=\"{}\"", s.name), "group=\"billing\"");
    let row = c
        .query_one(
            "SELECT claimed, committed, head, lag, open_ranges, ready, inflight, deferred, dead, superseded,
                    lost, held_back_bytes FROM sqlstreams.consumer_groups WHERE stream = $1",
            &[&s.name],
        )
        .unwrap();
    let columns = [
        "claimed",
        "committed",
        "head",
        "lag",
        "open_ranges",
        "ready",
        "inflight",
        "deferred",
        "dead",
        "superseded",
        "lost",
        "held_back_bytes",
    ];
    for (i, column) in columns.iter().enumerate() {
        let metric = format!("sqlstreams_group_{column}");
        assert_eq!(sample(&body, &metric, &[&stream, group]), Some(row.get::<_, i64>(i) as f64), "{metric}");
    }
    assert_eq!(sample(&body, "sqlstreams_group_dead", &[&stream, group]), Some(1.0));
    assert_eq!(sample(&body, "sqlstreams_group_paused", &[&stream, group]), Some(1.0));
    assert!(sample(&body, "sqlstreams_group_oldest_unresolved_age_seconds", &[&stream, group]).unwrap() > 0.0);
    assert_eq!(sample(&body, "sqlstreams_stream_head", &[&stream]), Some(7.0));
    assert_eq!(sample(&body, "sqlstreams_fence_holders", &[&stream]), Some(1.0));
    assert!(sample(&body, "sqlstreams_fence_oldest_holder_age_seconds", &[&stream]).unwrap() > 0.0);
    let declared = declared_metrics();
    assert!(declared.len() >= 18, "the file's metrics were read: {declared:?}");
    for metric in declared {
        assert!(sample(&body, &metric, &[&stream]).is_some(), "{metric} is declared and not served:\n{body}");
    }
    open.rollback().unwrap();
}
