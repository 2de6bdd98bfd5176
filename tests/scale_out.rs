//! Streams spread over three PostgreSQL clusters through a PL/Proxy router
//! (sql/router/sqlstreams-router.sql, docs/scale-out.md): the router is a database of the test
//! cluster, and the shards are three throwaway clusters this test starts, stops and restarts.
//! Its own test binary: it starts clusters, and stops one.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::process::Command;
use std::sync::{Arc, Mutex};

use postgres::{Client, NoTls};
use sqlstreams_tests::*;

/// A throwaway cluster of the PostgreSQL under test, run as the `postgres` OS user.
struct Shard {
    dir: PathBuf,
    port: u16,
}

impl Shard {
    fn bin(program: &str) -> String {
        let bin = std::env::var("SQLSTREAMS_PG_BIN").expect("SQLSTREAMS_PG_BIN is not set: run `scripts/rig test`");
        format!("{bin}/{program}")
    }

    fn as_postgres(args: &[&str]) {
        let out = Command::new("runuser").args(["-u", "postgres", "--"]).args(args).output().expect("runuser");
        assert!(out.status.success(), "{args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    }

    fn start_new() -> Shard {
        let dir = std::env::temp_dir().join(unique("sqlstreams-shard"));
        std::fs::create_dir(&dir).unwrap();
        let status = Command::new("chown").args(["postgres:", dir.to_str().unwrap()]).status().unwrap();
        assert!(status.success(), "chown {}", dir.display());
        let data = dir.join("data");
        Shard::as_postgres(&[
            &Shard::bin("initdb"),
            "-D",
            data.to_str().unwrap(),
            "-U",
            "postgres",
            "-A",
            "trust",
            "--no-sync",
        ]);
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let shard = Shard { dir, port };
        shard.start();
        let mut c = shard.connect();
        c.batch_execute("CREATE EXTENSION sqlstreams").unwrap();
        shard
    }

    fn pg_ctl(&self, action: &[&str]) {
        let data = self.dir.join("data");
        let log = self.dir.join("postgres.log");
        let mut args = vec![
            Shard::bin("pg_ctl"),
            "-D".into(),
            data.display().to_string(),
            "-l".into(),
            log.display().to_string(),
            "-w".into(),
        ];
        args.extend(action.iter().map(|a| a.to_string()));
        Shard::as_postgres(&args.iter().map(String::as_str).collect::<Vec<_>>());
    }

    fn start(&self) {
        let options = format!(
            "-p {} -c listen_addresses=127.0.0.1 -c unix_socket_directories={} -c fsync=off -c max_connections=100",
            self.port,
            self.dir.display()
        );
        self.pg_ctl(&["-o", &options, "start"]);
    }

    fn stop(&self) {
        self.pg_ctl(&["-m", "fast", "stop"]);
    }

    fn conninfo(&self) -> String {
        format!("host=127.0.0.1 port={} dbname=postgres", self.port)
    }

    fn connect(&self) -> Client {
        Client::connect(&format!("postgres://postgres@127.0.0.1:{}/postgres", self.port), NoTls)
            .expect("connect to a shard")
    }
}

impl Drop for Shard {
    fn drop(&mut self) {
        let data = self.dir.join("data");
        let _ = Command::new("runuser")
            .args([
                "-u",
                "postgres",
                "--",
                &Shard::bin("pg_ctl"),
                "-D",
                data.to_str().unwrap(),
                "-m",
                "immediate",
                "stop",
            ])
            .output();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The tests take turns: each starts three clusters of its own, and one stops a shard.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Three shards and a router database over them; `None` (and a note) where PL/Proxy is not
/// installed (it comes from Debian for PostgreSQL 15 only).
struct Deployment {
    shards: Vec<Shard>,
    router_url: String,
}

impl Deployment {
    fn start() -> Option<Deployment> {
        match std::env::var("SQLSTREAMS_TEST_PLPROXY").as_deref() {
            Ok("available") => {}
            Ok("unavailable") => {
                eprintln!("skipped: PL/Proxy is not installed for the PostgreSQL under test");
                return None;
            }
            _ => panic!("SQLSTREAMS_TEST_PLPROXY is not set: run `scripts/rig test`"),
        }
        let shards: Vec<Shard> = (0..3).map(|_| Shard::start_new()).collect();
        // The router: a new database of the test cluster, without the extension.
        let name = unique("router").replace('-', "_");
        connect().batch_execute(&format!("CREATE DATABASE {name}")).unwrap();
        let url = database_url();
        let router_url = format!("{}/{name}", url.rsplit_once('/').expect("a database URL").0);
        let mut router = Client::connect(&router_url, NoTls).unwrap();
        let script =
            std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../sql/router/sqlstreams-router.sql"))
                .unwrap();
        router.batch_execute(&script).expect("install the router");
        for (n, shard) in shards.iter().enumerate() {
            let added: i32 =
                router.query_one("SELECT sqlstreams_router.add_shard($1)", &[&shard.conninfo()]).unwrap().get(0);
            assert_eq!(added as usize, n);
        }
        Some(Deployment { shards, router_url })
    }

    fn router(&self) -> Client {
        Client::connect(&self.router_url, NoTls).expect("connect to the router")
    }

    /// Names of streams whose names hash to shards 0, 1 and 2, in that order.
    fn one_stream_per_shard(&self, router: &mut Client, prefix: &str) -> Vec<String> {
        let mut by_shard: BTreeMap<i32, String> = BTreeMap::new();
        for i in 0.. {
            let name = format!("{prefix}-{i}");
            let target: i32 = router.query_one("SELECT sqlstreams_router.target_of($1)", &[&name]).unwrap().get(0);
            by_shard.entry(target).or_insert(name);
            if by_shard.len() == self.shards.len() {
                break;
            }
        }
        by_shard.into_values().collect()
    }
}

fn create(router: &mut Client, stream: &str) {
    router.query_one("SELECT sqlstreams.create_stream($1)", &[&stream]).unwrap();
    router.query_one("SELECT sqlstreams.create_group($1, 'g', 'ordered')", &[&stream]).unwrap();
}

/// Produces `n` messages over `keys` keys through the router, in batches; returns their ids by key.
fn produce(router: &mut Client, stream: &str, n: usize, keys: usize) -> HashMap<String, Vec<i64>> {
    let mut by_key: HashMap<String, Vec<i64>> = HashMap::new();
    for batch in (0..n).collect::<Vec<_>>().chunks(50) {
        let payloads: Vec<serde_json::Value> = batch.iter().map(|i| json!({ "n": i })).collect();
        let names: Vec<String> = batch.iter().map(|i| format!("k{}", i % keys)).collect();
        let rows = router.query("SELECT sqlstreams.produce_batch($1, $2, $3)", &[&stream, &payloads, &names]).unwrap();
        for (row, key) in rows.iter().zip(names) {
            by_key.entry(key).or_default().push(row.get(0));
        }
    }
    by_key
}

/// Claims and acks through the router with `consumers` competing sessions until `expected`
/// messages were delivered; returns the deliveries in the order each key's were handed out.
fn drain(router_url: &str, stream: &str, consumers: usize, expected: usize) -> HashMap<String, Vec<i64>> {
    let delivered: Arc<Mutex<HashMap<String, Vec<i64>>>> = Arc::default();
    let count = Arc::new(Mutex::new(0usize));
    let threads: Vec<_> = (0..consumers)
        .map(|_| {
            let (url, stream, delivered, count) =
                (router_url.to_string(), stream.to_string(), delivered.clone(), count.clone());
            std::thread::spawn(move || {
                let mut c = Client::connect(&url, NoTls).unwrap();
                let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
                while *count.lock().unwrap() < expected {
                    assert!(
                        std::time::Instant::now() < deadline,
                        "not drained: {} of {expected}",
                        count.lock().unwrap()
                    );
                    let rows = c
                        .query(
                            "SELECT message_id, message_key, lease_token FROM sqlstreams.claim($1, 'g', 20)",
                            &[&stream],
                        )
                        .unwrap();
                    if rows.is_empty() {
                        std::thread::yield_now();
                        continue;
                    }
                    // Recorded before the ack: an ordered key's next message is handed out only after it.
                    {
                        let mut delivered = delivered.lock().unwrap();
                        for r in &rows {
                            delivered.entry(r.get::<_, String>(1)).or_default().push(r.get(0));
                        }
                        *count.lock().unwrap() += rows.len();
                    }
                    let token: uuid::Uuid = rows[0].get(2);
                    let ids: Vec<i64> = rows.iter().map(|r| r.get(0)).collect();
                    let acked: Vec<i64> = c
                        .query_one("SELECT sqlstreams.ack_batch($1, 'g', $2, $3)", &[&stream, &token, &ids])
                        .unwrap()
                        .get(0);
                    assert_eq!(acked.len(), ids.len(), "every delivery acked once");
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    Arc::try_unwrap(delivered).unwrap().into_inner().unwrap()
}

#[test]
fn streams_spread_over_shards_keep_every_guarantee_through_the_router() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let Some(deployment) = Deployment::start() else { return };
    let mut router = deployment.router();
    let streams = deployment.one_stream_per_shard(&mut router, "spread");
    for stream in &streams {
        create(&mut router, stream);
    }
    // Each stream is on its own shard, and only there.
    for (n, (stream, shard)) in streams.iter().zip(&deployment.shards).enumerate() {
        let placed: i32 =
            router.query_one("SELECT shard FROM sqlstreams.streams WHERE name = $1", &[stream]).unwrap().get(0);
        assert_eq!(placed as usize, n);
        let mut direct = shard.connect();
        let here: i64 =
            direct.query_one("SELECT count(*) FROM sqlstreams.streams WHERE name = $1", &[stream]).unwrap().get(0);
        assert_eq!(here, 1, "{stream} lives on shard {n}");
        for other in streams.iter().filter(|s| *s != stream) {
            let there: i64 =
                direct.query_one("SELECT count(*) FROM sqlstreams.streams WHERE name = $1", &[other]).unwrap().get(0);
            assert_eq!(there, 0);
        }
    }
    // Produced through the router, drained by competing consumers through it: every message
    // once, each key in order.
    for stream in &streams {
        let produced = produce(&mut router, stream, 600, 7);
        let delivered = drain(&deployment.router_url, stream, 3, 600);
        assert_eq!(delivered, produced, "{stream}: every key's messages, each once, in order");
    }
    // An idempotency key is its stream's, so it routes to one shard: a repeat produces nothing.
    let first: Option<i64> = router
        .query_one("SELECT sqlstreams.produce($1, '{}', idempotency_key => 'order-7')", &[&streams[1]])
        .unwrap()
        .get(0);
    let again: Option<i64> = router
        .query_one("SELECT sqlstreams.produce($1, '{}', idempotency_key => 'order-7')", &[&streams[1]])
        .unwrap()
        .get(0);
    assert!(first.is_some());
    assert_eq!(again, None, "the repeat is suppressed");
    // A stream the router does not know is refused as a shard would refuse it.
    let err = router.query_one("SELECT sqlstreams.produce('no-such-stream', '{}')", &[]).unwrap_err();
    assert_eq!(sqlstate(&err), "42704");
}

#[test]
fn a_stopped_shard_holds_back_only_its_own_streams() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let Some(deployment) = Deployment::start() else { return };
    let mut router = deployment.router();
    let streams = deployment.one_stream_per_shard(&mut router, "outage");
    for stream in &streams {
        create(&mut router, stream);
    }
    let mut before: Vec<HashMap<String, Vec<i64>>> = streams.iter().map(|s| produce(&mut router, s, 100, 3)).collect();

    deployment.shards[1].stop();
    // Its stream's calls fail (PL/Proxy reports a connection it cannot open as XX000, with
    // libpq's words); the other shards' streams are produced to and drained, and the views
    // show them, leaving the stopped shard out with a warning.
    // (A connection PL/Proxy had open ends with the shard's 57P01 first.)
    let mut err = router.query_one("SELECT sqlstreams.produce($1, '{}', 'k0')", &[&streams[1]]).unwrap_err();
    if sqlstate(&err) == "57P01" {
        err = router.query_one("SELECT sqlstreams.produce($1, '{}', 'k0')", &[&streams[1]]).unwrap_err();
    }
    assert!(describe(&err).contains("PQconnectPoll"), "{}", describe(&err));
    for n in [0, 2] {
        for (key, ids) in produce(&mut router, &streams[n], 100, 3) {
            before[n].entry(key).or_default().extend(ids);
        }
        assert_eq!(drain(&deployment.router_url, &streams[n], 2, 200), before[n], "{} flows", streams[n]);
    }
    let shown: Vec<i32> = router
        .query("SELECT shard FROM sqlstreams.streams ORDER BY shard", &[])
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(shown, vec![0, 2], "the views go on without the stopped shard");

    // Back up, its stream goes on where it stopped, through the same router session: nothing
    // produced before is lost.
    deployment.shards[1].start();
    for (key, ids) in produce(&mut router, &streams[1], 50, 3) {
        before[1].entry(key).or_default().extend(ids);
    }
    assert_eq!(drain(&deployment.router_url, &streams[1], 2, 150), before[1], "every message, each key in order");
    for stream in &streams {
        let lag: i64 = router.query_one("SELECT lag FROM sqlstreams.group_status($1, 'g')", &[stream]).unwrap().get(0);
        assert_eq!(lag, 0, "{stream} is drained");
    }
}

/// Every kind of call runs through the router as on one server.
#[test]
fn every_call_runs_through_the_router() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let Some(deployment) = Deployment::start() else { return };
    let mut r = deployment.router();
    let stream = deployment.one_stream_per_shard(&mut r, "calls").remove(2);
    create(&mut r, &stream);
    let one = |r: &mut Client, sql: &str| -> postgres::Row {
        r.query_one(sql, &[&stream]).unwrap_or_else(|e| panic!("{sql}: {}", describe(&e)))
    };
    one(&mut r, "SELECT sqlstreams.alter_group($1, 'g', max_retries => 0, on_dead => 'hold')");
    one(&mut r, "SELECT sqlstreams.alter_stream($1, dead_retention => '2 days')");
    let ids: Vec<i64> = r
        .query("SELECT sqlstreams.produce_batch($1, ARRAY['{\"n\": 1}', '{\"n\": 2}', '{\"n\": 3}']::jsonb[], ARRAY['a', 'a', 'b'])", &[&stream])
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect();
    let row = one(
        &mut r,
        "SELECT message_id, lease_token, produced_at IS NOT NULL FROM sqlstreams.claim_with_metadata($1, 'g', 1)",
    );
    let (first, token): (i64, uuid::Uuid) = (row.get(0), row.get(1));
    assert!(ids.contains(&first));
    assert!(r
        .query_one("SELECT sqlstreams.extend_lease($1, 'g', $2, '1 minute')", &[&stream, &token])
        .unwrap()
        .get::<_, bool>(0));
    let failed: String = r
        .query_one("SELECT sqlstreams.fail($1, 'g', $2, $3, 'boom', true)", &[&stream, &token, &first])
        .unwrap()
        .get(0);
    assert_eq!(failed, "dead");
    let blocked: i64 =
        one(&mut r, "SELECT count(*) FROM sqlstreams.blocked_keys($1, 'g') WHERE status = 'dead'").get(0);
    assert_eq!(blocked, 1);
    let dead: i64 = one(&mut r, "SELECT count(*) FROM sqlstreams.dead_messages($1, 'g')").get(0);
    assert_eq!(dead, 1);
    let redriven: Vec<i64> = one(&mut r, "SELECT sqlstreams.redrive($1, 'g')").get(0);
    assert_eq!(redriven, vec![first]);
    let batch = r.query("SELECT message_id, lease_token FROM sqlstreams.claim($1, 'g', 10)", &[&stream]).unwrap();
    let token: uuid::Uuid = batch[0].get(1);
    let claimed: Vec<i64> = batch.iter().map(|row| row.get(0)).collect();
    assert!(claimed.contains(&first));
    let released: Vec<i64> =
        r.query_one("SELECT sqlstreams.release($1, 'g', $2, $3)", &[&stream, &token, &claimed]).unwrap().get(0);
    assert_eq!(released.len(), claimed.len());
    let open: i64 = one(&mut r, "SELECT count(*) FROM sqlstreams.open_leases($1, 'g')").get(0);
    assert_eq!(open, 0);
    one(&mut r, "SELECT sqlstreams.pause_group($1, 'g')");
    assert!(r.query("SELECT * FROM sqlstreams.claim($1, 'g', 10)", &[&stream]).unwrap().is_empty(), "paused");
    one(&mut r, "SELECT sqlstreams.resume_group($1, 'g')");
    let peeked: i64 = one(&mut r, "SELECT count(*) FROM sqlstreams.peek($1, 0, 10)").get(0);
    assert_eq!(peeked, 3);
    assert_eq!(one(&mut r, "SELECT sqlstreams.seek($1, 'g', to_id => 0)").get::<_, i64>(0), 0);
    let paused: bool = one(&mut r, "SELECT paused FROM sqlstreams.consumer_groups WHERE stream = $1").get(0);
    assert!(!paused);
    let maintained: i64 = r.query_one("SELECT count(*) FROM sqlstreams.maintain()", &[]).unwrap().get(0);
    assert!(maintained >= 1);
    let located: i32 = one(&mut r, "SELECT shard FROM sqlstreams_router.locate($1)").get(0);
    assert_eq!(located, 2);
    assert!(one(&mut r, "SELECT sqlstreams.drop_group($1, 'g')").get::<_, bool>(0));
    assert!(one(&mut r, "SELECT sqlstreams.drop_stream($1)").get::<_, bool>(0));
    assert!(!one(&mut r, "SELECT sqlstreams.drop_stream($1)").get::<_, bool>(0), "dropped once");
    let err = r.query_one("SELECT sqlstreams.produce($1, '{}')", &[&stream]).unwrap_err();
    assert_eq!(sqlstate(&err), "42704", "a dropped stream is forgotten");
}

#[test]
fn the_shard_checks_the_calling_role() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let Some(deployment) = Deployment::start() else { return };
    let mut router = deployment.router();
    let stream = deployment.one_stream_per_shard(&mut router, "roles").remove(0);
    create(&mut router, &stream);
    // Roles belong to each cluster: the same names on the router's and the shard's.
    let producer = unique("router_producer").replace('-', "_");
    let stranger = unique("router_stranger").replace('-', "_");
    let mut clusters = vec![connect()];
    clusters.extend(deployment.shards.iter().map(Shard::connect));
    for c in &mut clusters {
        c.batch_execute(&format!(
            "CREATE ROLE {producer} LOGIN IN ROLE sqlstreams_producer; CREATE ROLE {stranger} LOGIN"
        ))
        .unwrap();
    }
    let mut shard = deployment.shards[0].connect();
    shard.query_one("SELECT sqlstreams.grant_stream($1, $2, 'produce')", &[&stream, &producer]).unwrap();
    let as_role = |role: &str| {
        let mut config: postgres::Config = deployment.router_url.parse().unwrap();
        config.user(role);
        config.connect(NoTls).unwrap()
    };
    let id: i64 = as_role(&producer).query_one("SELECT sqlstreams.produce($1, '{}')", &[&stream]).unwrap().get(0);
    assert!(id > 0, "a granted producer produces through the router");
    let err = as_role(&stranger).query_one("SELECT sqlstreams.produce($1, '{}')", &[&stream]).unwrap_err();
    assert_eq!(sqlstate(&err), "42501", "{}", describe(&err));
    let err = as_role(&stranger).query_one("SELECT sqlstreams.create_stream('stranger-stream')", &[]).unwrap_err();
    assert_eq!(sqlstate(&err), "42501", "{}", describe(&err));
    let placed: i64 = router
        .query_one("SELECT count(*) FROM sqlstreams_router.placement WHERE stream = 'stranger-stream'", &[])
        .unwrap()
        .get(0);
    assert_eq!(placed, 0, "a refused create places nothing");
    // Nor can a stranger move a stream: it may not see it on any shard.
    for shard in 0..3 {
        let err =
            as_role(&stranger).query_one("SELECT sqlstreams_router.place($1, $2)", &[&stream, &shard]).unwrap_err();
        assert!(["42501", "42704"].contains(&sqlstate(&err).as_str()), "{}", describe(&err));
    }
    let err = as_role(&stranger).query_one("SELECT sqlstreams_router.record($1, 1)", &[&stream]).unwrap_err();
    assert_eq!(sqlstate(&err), "42501");
    assert_eq!(
        router.query_one("SELECT shard FROM sqlstreams_router.locate($1)", &[&stream]).unwrap().get::<_, i32>(0),
        0
    );
}

/// Every call of a shard's API that names its stream exists on the router with the same
/// arguments (names, types, defaults) and result, so code written for one server runs there.
#[test]
fn the_router_mirrors_the_api() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let Some(deployment) = Deployment::start() else { return };
    let mut router = deployment.router();
    let mut shard = deployment.shards[0].connect();
    let signatures = |c: &mut Client| -> HashMap<String, (String, String)> {
        c.query(
            "SELECT p.proname::text, pg_get_function_arguments(p.oid), pg_get_function_result(p.oid)
             FROM pg_proc p WHERE p.pronamespace = 'sqlstreams'::regnamespace",
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| (r.get(0), (r.get(1), r.get(2))))
        .collect()
    };
    let (on_shard, on_router) = (signatures(&mut shard), signatures(&mut router));
    // What needs no stream (or is the library's own) has no place on the router.
    let not_routed: HashSet<&str> = [
        "catalog_changed",
        "lane_count_refused",
        "lane",
        "exception_count_written",
        "create_stream_tables",
        "drop_stream_tables",
        "add_partitions",
        "lock_log",
        "log_head",
        "drop_partitions",
        "stream_head",
        "stream_channel",
        "visible",
        "exception_counts_changed",
        "refuse_drop",
    ]
    .into();
    let mut missing = vec![];
    for (name, signature) in &on_shard {
        if not_routed.contains(name.as_str()) || name.starts_with("exception_count_") {
            continue;
        }
        match on_router.get(name) {
            Some(routed) => assert_eq!(routed, signature, "sqlstreams.{name} on the router"),
            None => missing.push(name.clone()),
        }
    }
    assert!(missing.is_empty(), "not on the router: {missing:?}");
}
