//! The maintenance worker (src/worker.rs), on a cluster that preloads the library. `scripts/rig
//! test` restarts its cluster with `shared_preload_libraries = 'sqlstreams'`,
//! `sqlstreams.worker_database = 'worker_sqlstreams'` and `sqlstreams.maintain_interval = 1s`,
//! then runs this file with `--ignored --test-threads=1`: without preloading there is no worker
//! to test, and one test sets the installed extension's version for the whole database.

use std::time::{Duration, Instant};

use postgres::{Client, NoTls};
use sqlstreams_tests::*;

/// A connection to the worker's database as `user` (the rig's superuser when `None`). Its own
/// search_path is set, over the one the hostile test gives the database.
fn connect_worker_database_as(user: Option<&str>) -> Client {
    let url = std::env::var("SQLSTREAMS_WORKER_DATABASE_URL")
        .expect("SQLSTREAMS_WORKER_DATABASE_URL is not set: scripts/rig test runs this test on a preloaded cluster");
    let mut config: postgres::Config = url.parse().expect("SQLSTREAMS_WORKER_DATABASE_URL");
    if let Some(user) = user {
        config.user(user);
    }
    config.options("-c search_path=public,pg_catalog");
    config.connect(NoTls).expect("connect to the worker's database")
}

fn connect_worker_database() -> Client {
    let mut client = connect_worker_database_as(None);
    client.batch_execute(CREATE_EXTENSION).expect("create the extension");
    client
}

/// The worker's process id, once one runs in this database.
fn worker_pid(c: &mut Client) -> i32 {
    let query = "SELECT EXISTS (SELECT FROM pg_stat_activity
                 WHERE backend_type = 'sqlstreams maintenance' AND datname = current_database())";
    eventually(c, "the worker runs in this database", query, &[]);
    c.query_one(
        "SELECT pid FROM pg_stat_activity WHERE backend_type = 'sqlstreams maintenance' AND datname = current_database()",
        &[],
    )
    .unwrap()
    .get(0)
}

/// Waits (bounded: the worker runs every second) until `query` returns true.
fn eventually(c: &mut Client, what: &str, query: &str, params: &[&(dyn postgres::types::ToSql + Sync)]) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !c.query_one(query, params).unwrap().get::<_, bool>(0) {
        assert!(Instant::now() < deadline, "the worker did not get to it within a minute: {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
#[ignore = "needs a cluster that preloads sqlstreams: scripts/rig test runs it"]
fn the_worker_maintains_the_database_without_anyone_calling_maintain() {
    let mut c = connect_worker_database();
    eventually(
        &mut c,
        "the worker runs in this database",
        "SELECT count(*) = 1 FROM pg_stat_activity
         WHERE backend_type = 'sqlstreams maintenance' AND datname = current_database()",
        &[],
    );
    // As the role sqlstreams.worker_role names, which is no superuser.
    let role = std::env::var("SQLSTREAMS_WORKER_ROLE").expect("SQLSTREAMS_WORKER_ROLE: scripts/rig test sets it");
    eventually(
        &mut c,
        "the worker runs as sqlstreams.worker_role, no superuser",
        "SELECT EXISTS (SELECT FROM pg_stat_activity JOIN pg_roles ON oid = usesysid
         WHERE backend_type = 'sqlstreams maintenance' AND datname = current_database()
           AND usename = $1 AND NOT rolsuper)",
        &[&role],
    );

    // Only maintain() purges expired idempotency keys: nothing else here calls it.
    let s = Stream::create_sized(&mut c, "worker", 1000);
    c.query_one("SELECT sqlstreams.create_stream($1, 1000, idempotency_ttl => '1 microsecond')", &[&s.name]).unwrap();
    c.query_one("SELECT sqlstreams.produce($1, '{}', idempotency_key => 'order-1')", &[&s.name]).unwrap();
    let keys = format!("SELECT count(*) = 0 FROM {}", s.table("idempotency_key"));
    eventually(&mut c, "expired idempotency keys purged", &keys, &[]);

    // Retention: consumed partitions go without maintain() and without further claims.
    let g = s.group(&mut c, "g", None);
    s.produce_many(&mut c, 3500, None);
    assert_eq!(g.drain(&mut c).len(), 3501, "the batch and the message produced with a key");
    let first_partition = format!("{}_p0", s.table("message_log"));
    eventually(&mut c, "the consumed partitions dropped", "SELECT to_regclass($1) IS NULL", &[&first_partition]);
}

/// A stream whose maintenance fails (here its tables claim another version: `55000`) is left
/// with a warning, and the streams after it are maintained all the same. Before, the error ended
/// the worker's round, and the worker with it, every round.
#[test]
#[ignore = "needs a cluster that preloads sqlstreams: scripts/rig test runs it"]
fn a_stream_that_cannot_be_maintained_does_not_stop_the_others() {
    let mut c = connect_worker_database();
    let broken = Stream::create_sized(&mut c, "worker-broken", 1000);
    let version: String =
        c.query_one("SELECT schema_version FROM sqlstreams.stream WHERE id = $1", &[&broken.id]).unwrap().get(0);
    c.execute("UPDATE sqlstreams.stream SET schema_version = '0.0.1' WHERE id = $1", &[&broken.id]).unwrap();
    let refused = c.query_one("SELECT count(*) FROM sqlstreams.maintain_stream($1)", &[&broken.name]).unwrap_err();
    assert_eq!(sqlstate(&refused), "55000", "the broken stream's maintenance fails: {refused:?}");
    // Maintained after it (streams go by id): only maintain() purges expired idempotency keys.
    let healthy = Stream::create_sized(&mut c, "worker-healthy", 1000);
    assert!(healthy.id > broken.id);
    c.query_one("SELECT sqlstreams.create_stream($1, 1000, idempotency_ttl => '1 microsecond')", &[&healthy.name])
        .unwrap();
    c.query_one("SELECT sqlstreams.produce($1, '{}', idempotency_key => 'order-1')", &[&healthy.name]).unwrap();
    let keys = format!("SELECT count(*) = 0 FROM {}", healthy.table("idempotency_key"));
    eventually(&mut c, "the healthy stream's expired idempotency keys purged", &keys, &[]);
    c.execute("UPDATE sqlstreams.stream SET schema_version = $2 WHERE id = $1", &[&broken.id, &version]).unwrap();
    c.execute("SELECT sqlstreams.drop_stream($1)", &[&broken.name]).unwrap();
}

/// What the server log (`SQLSTREAMS_SERVER_LOG`, the rig's) says from byte `from` on.
fn server_log_from(from: u64) -> String {
    let path = std::env::var("SQLSTREAMS_SERVER_LOG").expect("SQLSTREAMS_SERVER_LOG: scripts/rig test sets it");
    let log = std::fs::read(&path).unwrap_or_else(|e| panic!("read the server log {path}: {e}"));
    String::from_utf8_lossy(&log[(from as usize).min(log.len())..]).into_owned()
}

/// The server log's length now: where `server_log_from` reads what comes after.
fn server_log_len() -> u64 {
    let path = std::env::var("SQLSTREAMS_SERVER_LOG").expect("SQLSTREAMS_SERVER_LOG: scripts/rig test sets it");
    std::fs::metadata(&path).unwrap_or_else(|e| panic!("the server log {path}: {e}")).len()
}

/// Waits (a minute at most) until the server log says `said` `times` times from byte `from` on.
fn await_said(from: u64, said: &str, times: usize) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while server_log_from(from).matches(said).count() < times {
        assert!(Instant::now() < deadline, "the worker did not say {said:?} {times} times within a minute");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Sets the installed extension's version to `0.1.0` until dropped, as a new library installed
/// before `ALTER EXTENSION sqlstreams UPDATE` meets it (the library is the one that differs
/// there; what the worker must do is the same).
struct InstalledVersion {
    was: String,
}

impl InstalledVersion {
    fn set(c: &mut Client) -> InstalledVersion {
        let was: String = c
            .query_one(
                "UPDATE pg_extension e SET extversion = '0.1.0' FROM pg_extension o
                  WHERE e.extname = 'sqlstreams' AND o.oid = e.oid RETURNING o.extversion",
                &[],
            )
            .unwrap()
            .get(0);
        InstalledVersion { was }
    }
}

impl Drop for InstalledVersion {
    fn drop(&mut self) {
        // Said, not unwrapped: a panic while the test panics already would abort the others.
        let mut c = connect_worker_database_as(None);
        if let Err(e) = c.execute("UPDATE pg_extension SET extversion = $1 WHERE extname = 'sqlstreams'", &[&self.was])
        {
            eprintln!("the installed extension's version was left at 0.1.0: {e}");
        }
    }
}

/// While the library and the installed SQL differ, the worker maintains no stream and says so
/// once a round, with the hint, not once for each stream; once they match again it maintains
/// them. Before, a worker that had matched once went on maintaining with the stale library, and
/// one that never had warned for every stream, every round.
#[test]
#[ignore = "needs a cluster that preloads sqlstreams: scripts/rig test runs it"]
fn a_library_the_installed_sql_does_not_match_is_said_once_a_round() {
    let mut c = connect_worker_database();
    let streams = [
        Stream::create_sized(&mut c, "worker-mismatch-a", 1000),
        Stream::create_sized(&mut c, "worker-mismatch-b", 1000),
    ];
    // A whole round, so that the worker has matched the installed SQL before it changes.
    let s = &streams[1];
    c.query_one("SELECT sqlstreams.create_stream($1, 1000, idempotency_ttl => '1 microsecond')", &[&s.name]).unwrap();
    c.query_one("SELECT sqlstreams.produce($1, '{}', idempotency_key => 'order-1')", &[&s.name]).unwrap();
    let keys = format!("SELECT count(*) = 0 FROM {}", s.table("idempotency_key"));
    eventually(&mut c, "a round before the mismatch", &keys, &[]);

    let from = server_log_len();
    let mismatch = InstalledVersion::set(&mut c);
    let said = "sqlstreams: no stream is maintained this round: the sqlstreams library is version";
    // Rounds go one after another: from the first that says it, none maintains anything. A key
    // that expires now, then a round begun after it.
    await_said(from, said, 1);
    // This session matched before: its produce goes on.
    c.query_one("SELECT sqlstreams.produce($1, '{}', idempotency_key => 'order-2')", &[&s.name]).unwrap();
    await_said(from, said, server_log_from(from).matches(said).count() + 2);
    let log = server_log_from(from);
    assert!(log.contains("HINT:  Run ALTER EXTENSION sqlstreams UPDATE"), "the warning's hint: {log}");
    assert!(!log.contains("is not maintained"), "one warning a round, none per stream: {log}");
    let purged: bool = c.query_one(&keys, &[]).unwrap().get(0);
    assert!(!purged, "no stream is maintained while the library and the SQL differ");

    drop(mismatch);
    eventually(&mut c, "the streams maintained once the versions match again", &keys, &[]);
    for s in &streams {
        c.execute("SELECT sqlstreams.drop_stream($1)", &[&s.name]).unwrap();
    }
}

/// A `pg_terminate_backend` (or a shutdown) ends the worker at once, even while its round waits
/// for a lock that another transaction holds: before, the worker's SIGTERM only raised a flag
/// that nothing read while it waited, and a lock held to a shutdown's end held the shutdown back.
#[test]
#[ignore = "needs a cluster that preloads sqlstreams: scripts/rig test runs it"]
fn the_worker_ends_at_once_when_terminated_while_it_waits_for_a_lock() {
    let mut c = connect_worker_database();
    let s = Stream::create_sized(&mut c, "worker-locked", 1000);
    let mut locker = connect_worker_database_as(None);
    let mut t = locker.transaction().unwrap();
    t.batch_execute(&format!("LOCK TABLE {} IN ACCESS EXCLUSIVE MODE", s.table("cursor"))).unwrap();
    let pid = worker_pid(&mut c);
    let waits = "SELECT EXISTS (SELECT FROM pg_stat_activity WHERE pid = $1 AND wait_event_type = 'Lock')";
    eventually(&mut c, "the worker's round waits for the lock", waits, &[&pid]);
    let ended: bool = c.query_one("SELECT pg_terminate_backend($1, 10000)", &[&pid]).unwrap().get(0);
    assert!(ended, "the worker ended within 10 seconds, the lock still held");
    t.rollback().unwrap();
    c.execute("SELECT sqlstreams.drop_stream($1)", &[&s.name]).unwrap();
}

/// Ends the worker, which starts again and so takes the database's settings as they are now.
fn restart(c: &mut Client) {
    let before = worker_pid(c);
    c.query_one("SELECT pg_terminate_backend($1)", &[&before]).unwrap();
    let restarted = "SELECT EXISTS (SELECT FROM pg_stat_activity WHERE backend_type = 'sqlstreams maintenance'
                     AND datname = current_database() AND pid <> $1)";
    eventually(c, "the worker started again after pg_terminate_backend", restarted, &[&before]);
}

/// `restart`, then waits for a whole round of the new one: a stream made after the restart is maintained (its
/// expired idempotency key purged).
fn restart_and_await_a_round(c: &mut Client, prefix: &str) {
    restart(c);
    let s = Stream::create_sized(c, prefix, 1000);
    c.query_one("SELECT sqlstreams.create_stream($1, 1000, idempotency_ttl => '1 microsecond')", &[&s.name]).unwrap();
    c.query_one("SELECT sqlstreams.produce($1, '{}', idempotency_key => 'order-1')", &[&s.name]).unwrap();
    let keys = format!("SELECT count(*) = 0 FROM {}", s.table("idempotency_key"));
    eventually(c, &format!("a round of the restarted worker ({prefix})"), &keys, &[]);
}

/// The database belongs to a role that is no superuser (`scripts/rig test` makes it so). It plants
/// an operator and an aggregate that would make it a superuser if a superuser ran them, and puts
/// its schema first on the database's search_path; the worker then starts again (terminated, as
/// a DBA may) and maintains the database: nothing of the owner's runs.
#[test]
#[ignore = "needs a cluster that preloads sqlstreams: scripts/rig test runs it"]
fn the_worker_runs_nothing_the_database_owner_planted() {
    let mut c = connect_worker_database();
    let owner: String = c
        .query_one("SELECT pg_get_userbyid(datdba)::text FROM pg_database WHERE datname = current_database()", &[])
        .unwrap()
        .get(0);
    let owner_is_superuser = "SELECT rolsuper FROM pg_roles WHERE rolname = $1";
    assert!(!c.query_one(owner_is_superuser, &[&owner]).unwrap().get::<_, bool>(0), "the rig's owner is no superuser");

    let mut o = connect_worker_database_as(Some(&owner));
    let _reset = DatabaseSetting("search_path");
    let schema = format!("planted_{}", &uuid::Uuid::new_v4().simple().to_string()[..8]);
    let escalate = format!(
        "INSERT INTO {schema}.ran SELECT current_user; \
         IF (SELECT rolsuper FROM pg_catalog.pg_roles WHERE rolname OPERATOR(pg_catalog.=) current_user) THEN \
           EXECUTE 'ALTER ROLE {owner} SUPERUSER'; END IF;"
    );
    o.batch_execute(&format!(
        "CREATE SCHEMA {schema};
         CREATE TABLE {schema}.ran (role_name name);
         GRANT INSERT ON {schema}.ran TO PUBLIC;
         GRANT USAGE ON SCHEMA {schema} TO PUBLIC;
         CREATE FUNCTION {schema}.eq(name, name) RETURNS boolean LANGUAGE plpgsql AS $$
           BEGIN {escalate} RETURN $1::text OPERATOR(pg_catalog.=) $2::text; END $$;
         CREATE OPERATOR {schema}.= (LEFTARG = name, RIGHTARG = name, FUNCTION = {schema}.eq);
         CREATE FUNCTION {schema}.count_step(bigint) RETURNS bigint LANGUAGE plpgsql AS $$
           BEGIN {escalate} RETURN $1 OPERATOR(pg_catalog.+) 1; END $$;
         CREATE AGGREGATE {schema}.count(*) (SFUNC = {schema}.count_step, STYPE = bigint, INITCOND = '0');
         ALTER DATABASE worker_sqlstreams SET search_path = {schema}, pg_catalog;"
    ))
    .unwrap();
    // The trap works: a superuser session that takes the database's search_path runs it.
    // (Checked in a transaction rolled back, so the owner does not become a superuser here.)
    let mut probe = {
        let url = std::env::var("SQLSTREAMS_WORKER_DATABASE_URL").unwrap();
        Client::connect(&url, NoTls).unwrap()
    };
    let mut t = probe.transaction().unwrap();
    t.query_one("SELECT true FROM pg_catalog.pg_extension WHERE extname = 'sqlstreams'", &[]).unwrap();
    let became: bool = t.query_one(owner_is_superuser, &[&owner]).unwrap().get(0);
    assert!(became, "the planted operator runs for a session that takes the database's search_path");
    t.rollback().unwrap();

    restart_and_await_a_round(&mut c, "planted");

    let ran: Vec<String> =
        c.query(&format!("SELECT role_name::text FROM {schema}.ran"), &[]).unwrap().iter().map(|r| r.get(0)).collect();
    assert!(ran.is_empty(), "the worker ran the owner's planted objects as {ran:?}");
    assert!(!c.query_one(owner_is_superuser, &[&owner]).unwrap().get::<_, bool>(0), "the owner became a superuser");
}

/// `ALTER DATABASE ... RESET` of a setting a test gave the worker's database, when the test ends
/// however it ends, with the worker started again without it: the worker's tests share the database.
struct DatabaseSetting(&'static str);

impl Drop for DatabaseSetting {
    fn drop(&mut self) {
        // Said, not unwrapped: a panic while the test panics already would abort the others.
        // Read-write first, whatever the setting is (default_transaction_read_only among them);
        // then the worker ends, and starts again without the setting, which it took when it
        // connected.
        let mut c = connect_worker_database_as(None);
        let reset = [
            "SET default_transaction_read_only = off".to_string(),
            format!("ALTER DATABASE worker_sqlstreams RESET {}", self.0),
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
             WHERE backend_type = 'sqlstreams maintenance' AND datname = current_database()"
                .to_string(),
        ];
        for statement in reset {
            if let Err(e) = c.batch_execute(&statement) {
                eprintln!("the worker's database kept its {}: {e}", self.0);
                return;
            }
        }
    }
}

#[test]
#[ignore = "needs a cluster that preloads sqlstreams: scripts/rig test runs it"]
fn the_worker_maintains_a_database_whose_transactions_are_serializable() {
    let mut c = connect_worker_database();
    let _reset = DatabaseSetting("default_transaction_isolation");
    c.batch_execute("ALTER DATABASE worker_sqlstreams SET default_transaction_isolation = 'serializable'").unwrap();
    // Where the setting is taken, maintain refuses to run, saying so.
    let mut session = connect_worker_database_as(None);
    let refused = session.query_one("SELECT count(*) FROM sqlstreams.maintain()", &[]).unwrap_err();
    assert_eq!(refused.code(), Some(&postgres::error::SqlState::INVALID_TRANSACTION_STATE), "{refused}");

    restart_and_await_a_round(&mut c, "serializable");
}

/// A database whose transactions are read-only (`default_transaction_read_only`) is not
/// maintained, and the worker says so once a round, not once for each stream (a stream's step
/// failed at its first write, with a warning for each).
#[test]
#[ignore = "needs a cluster that preloads sqlstreams: scripts/rig test runs it"]
fn a_read_only_database_is_said_once_a_round() {
    let mut c = connect_worker_database();
    let streams = [
        Stream::create_sized(&mut c, "worker-read-only-a", 1000),
        Stream::create_sized(&mut c, "worker-read-only-b", 1000),
    ];
    let from = server_log_len();
    let _reset = DatabaseSetting("default_transaction_read_only");
    c.batch_execute("ALTER DATABASE worker_sqlstreams SET default_transaction_read_only = on").unwrap();
    restart(&mut c);
    let said =
        "sqlstreams: no stream is maintained this round: maintain_stream writes, and this transaction is read-only";
    await_said(from, said, 2);
    let log = server_log_from(from);
    assert!(!log.contains("is not maintained"), "one warning a round, none per stream: {log}");
    // Called in such a transaction, maintain_stream says the same.
    let mut session = connect_worker_database_as(None);
    let refused =
        session.query_one("SELECT count(*) FROM sqlstreams.maintain_stream($1)", &[&streams[0].name]).unwrap_err();
    assert_eq!(sqlstate(&refused), "25006", "{refused}");
    for s in &streams {
        c.execute("SELECT sqlstreams.drop_stream($1)", &[&s.name]).unwrap();
    }
}
