//! Shared helpers of the integration tests: connections to the throwaway cluster started by
//! `scripts/rig test`, uniquely named streams, and typed wrappers over the SQL API.
//!
//! Tests never wait for wall-clock time to pass where a proof is possible: to let a lease run
//! out they move its expiry into the past (`expire_leases`), to let a retry come due they move
//! its time (`make_due`). Those two helpers are the only places tests write to the extension's
//! tables.

pub mod debugger;

use postgres::{Client, NoTls};
use serde_json::Value;
use uuid::Uuid;

pub use postgres;
pub use serde_json::json;

/// The throwaway cluster's URL, exported by `scripts/rig`.
pub fn database_url() -> String {
    std::env::var("DATABASE_URL")
        .expect("DATABASE_URL is not set: run the tests through `scripts/rig test`, which starts a throwaway Postgres")
}

/// Installs the extension. Tests run in parallel; the lock (held to commit) keeps concurrent
/// CREATE EXTENSIONs apart.
pub const CREATE_EXTENSION: &str =
    "BEGIN; SELECT pg_advisory_xact_lock(727274); CREATE EXTENSION IF NOT EXISTS sqlstreams; COMMIT;";

/// A new connection with the extension installed.
pub fn connect() -> Client {
    let mut client = Client::connect(&database_url(), NoTls).expect("connect to the test cluster");
    client.batch_execute(CREATE_EXTENSION).expect("create the extension");
    client
}

/// A connection whose warnings (and other notices) are kept, in the order they came.
pub fn connect_listening() -> (Client, std::sync::Arc<std::sync::Mutex<Vec<String>>>) {
    let (mut c, warnings) = listening_to(&database_url());
    c.batch_execute(CREATE_EXTENSION).expect("create the extension");
    (c, warnings)
}

/// A DBA's trigger on `table` that refuses each `event` statement (`UPDATE`, `DELETE`) with
/// `message` (`P0001`): how a maintenance test makes one stream's step fail. It goes with
/// `DROP FUNCTION public.refuse() CASCADE`.
pub fn refuse_on(c: &mut Client, table: &str, event: &str, message: &str) {
    c.batch_execute(&format!(
        "CREATE FUNCTION public.refuse() RETURNS trigger LANGUAGE plpgsql AS
           $$BEGIN RAISE EXCEPTION '{message}' USING ERRCODE = 'P0001'; END$$;
         CREATE TRIGGER audit BEFORE {event} ON {table} FOR EACH STATEMENT EXECUTE FUNCTION public.refuse();"
    ))
    .expect("create the trigger");
}

/// `maintain()`'s rows: each stream maintained, with the expired idempotency keys it purged.
pub fn maintained(c: &mut Client) -> Vec<(String, i64)> {
    c.query("SELECT stream, idempotency_keys_purged FROM sqlstreams.maintain()", &[])
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect()
}

/// A connection to `url` whose warnings (and other notices) are kept, in the order they came:
/// each its message, its SQLSTATE in brackets, and its hint.
pub fn listening_to(url: &str) -> (Client, std::sync::Arc<std::sync::Mutex<Vec<String>>>) {
    let warnings = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let kept = warnings.clone();
    let mut config: postgres::Config = url.parse().unwrap();
    config.notice_callback(move |n| {
        let hint = n.hint().map(|hint| format!(" HINT: {hint}")).unwrap_or_default();
        kept.lock().unwrap().push(format!("{} [{}]{hint}", n.message(), n.code().code()))
    });
    (config.connect(NoTls).expect("connect to the test cluster"), warnings)
}

/// A database of its own for one test, with the extension: for tests whose ids must come out
/// as written, or that drop the extension. Returns a connection to it and its URL.
pub fn own_database(prefix: &str) -> (Client, String) {
    database_with(prefix, "")
}

/// `own_database` in `encoding` (with the C locale, which suits every encoding).
pub fn own_database_in(prefix: &str, encoding: &str) -> (Client, String) {
    database_with(prefix, &format!("TEMPLATE template0 ENCODING '{encoding}' LC_COLLATE 'C' LC_CTYPE 'C'"))
}

fn database_with(prefix: &str, options: &str) -> (Client, String) {
    let mut admin = connect();
    let name = unique(prefix).replace('-', "_");
    admin.batch_execute(&format!("CREATE DATABASE {name} {options}")).expect("create a database");
    let url = database_url();
    let base = url.rsplit_once('/').map(|(base, _)| base).expect("a database URL");
    let url = format!("{base}/{name}");
    let mut c = Client::connect(&url, NoTls).expect("connect to the new database");
    c.batch_execute("CREATE EXTENSION sqlstreams").expect("create the extension");
    (c, url)
}

/// A new login role for one test (roles belong to the cluster: the name is unique), created by
/// the superuser connection `c` with `options` such as `IN ROLE sqlstreams_consumer`. Returns
/// its name.
pub fn role(c: &mut Client, prefix: &str, options: &str) -> String {
    let name = format!("{prefix}_{}", &Uuid::new_v4().simple().to_string()[..10]);
    c.batch_execute(&format!("CREATE ROLE {name} LOGIN {options}")).expect("create role");
    name
}

/// A connection as `role` (the test cluster trusts local connections).
pub fn connect_as(role: &str) -> Client {
    let mut config: postgres::Config = database_url().parse().expect("DATABASE_URL");
    config.user(role);
    config.connect(NoTls).expect("connect as a test role")
}

/// The rig's certificate authority for TLS tests, or `None` when the server under test was built
/// without OpenSSL (the relocatable PostgreSQL 16 and 18 `scripts/rig test --pg` runs on are):
/// the rig then says so with `SQLSTREAMS_TEST_TLS=unavailable`. Without either, the run is not
/// the rig's and the test fails rather than pass untested.
pub fn test_ca() -> Option<String> {
    if let Ok(ca) = std::env::var("SQLSTREAMS_TEST_CA") {
        return Some(ca);
    }
    match std::env::var("SQLSTREAMS_TEST_TLS").as_deref() {
        Ok("unavailable") => {
            eprintln!("skipped: the server under test has no TLS (SQLSTREAMS_TEST_TLS=unavailable)");
            None
        }
        _ => panic!("neither SQLSTREAMS_TEST_CA nor SQLSTREAMS_TEST_TLS is set: run `scripts/rig test`"),
    }
}

/// The server's version as a number (`160002` for 16.2).
pub fn server_version(c: &mut impl postgres::GenericClient) -> i32 {
    c.query_one("SELECT current_setting('server_version_num')::int", &[]).unwrap().get(0)
}

/// The setting that makes the planner use parallel workers for testing: `force_parallel_mode`
/// until PostgreSQL 15, `debug_parallel_query` from 16 on.
pub fn debug_parallel_setting(c: &mut impl postgres::GenericClient) -> &'static str {
    if server_version(c) >= 160000 {
        "debug_parallel_query"
    } else {
        "force_parallel_mode"
    }
}

/// A unique name, so tests never share a stream.
pub fn unique(prefix: &str) -> String {
    format!("{prefix}-{}", &Uuid::new_v4().simple().to_string()[..12])
}

/// The SQLSTATE of an error from Postgres.
pub fn sqlstate(err: &postgres::Error) -> String {
    err.code().map(|c| c.code().to_string()).unwrap_or_else(|| format!("no SQLSTATE: {err}"))
}

/// Scans of `table` and its indexes by this backend that it has not reported yet: its
/// transaction's so far, and perhaps earlier ones' (take differences).
pub fn scans(c: &mut impl postgres::GenericClient, table: &str) -> i64 {
    c.query_one(
        "SELECT sum(pg_stat_get_xact_numscans(r))::int8
         FROM (SELECT $1::text::regclass AS r UNION ALL SELECT indexrelid FROM pg_index WHERE indrelid = $1::text::regclass) i",
        &[&table],
    )
    .unwrap()
    .get(0)
}

/// Index pages of `table` that this backend has read and not reported yet: its transaction's so
/// far, and perhaps earlier ones' (read it on a backend of its own, or after
/// `pg_stat_force_next_flush()` and a commit).
pub fn index_pages_read(c: &mut impl postgres::GenericClient, table: &str) -> i64 {
    over_indexes(c, table, "pg_stat_get_xact_blocks_fetched")
}

/// Index entries of `table` that this backend's scans returned and it has not reported yet (as
/// `scans`: take differences, inside one transaction).
pub fn index_entries_read(c: &mut impl postgres::GenericClient, table: &str) -> i64 {
    over_indexes(c, table, "pg_stat_get_xact_tuples_returned")
}

/// The sum of a `pg_stat_get_xact_*` counter over the indexes of `table`.
fn over_indexes(c: &mut impl postgres::GenericClient, table: &str, counter: &str) -> i64 {
    let sql = format!(
        "SELECT coalesce(sum({counter}(indexrelid)), 0)::int8 FROM pg_index WHERE indrelid = $1::text::regclass"
    );
    c.query_one(&sql, &[&table]).unwrap().get(0)
}

/// An error from Postgres with its SQLSTATE and message, for assertion messages.
pub fn describe(err: &postgres::Error) -> String {
    match err.as_db_error() {
        Some(db) => format!("{}: {}", db.code().code(), db.message()),
        None => err.to_string(),
    }
}

/// A stream created for one test.
#[derive(Clone, Debug)]
pub struct Stream {
    pub name: String,
    pub id: i64,
}

impl Stream {
    pub fn create(c: &mut Client, prefix: &str) -> Stream {
        Stream::create_sized(c, prefix, 1_000_000)
    }

    /// A stream with exactly this name (for tests that own their database).
    pub fn named(c: &mut Client, name: &str) -> Stream {
        let id = c.query_one("SELECT sqlstreams.create_stream($1)", &[&name]).expect("create_stream").get(0);
        Stream { name: name.to_string(), id }
    }

    /// A stream of `lanes` lanes: with one, every key's messages share a lane, and its ranges.
    pub fn create_with_lanes(c: &mut Client, prefix: &str, lanes: i32) -> Stream {
        Stream::create_with(c, prefix, 1_000_000, lanes)
    }

    pub fn create_sized(c: &mut Client, prefix: &str, partition_size: i64) -> Stream {
        Stream::create_with(c, prefix, partition_size, 16)
    }

    fn create_with(c: &mut Client, prefix: &str, partition_size: i64, lanes: i32) -> Stream {
        let name = unique(prefix);
        let id = c
            .query_one("SELECT sqlstreams.create_stream($1, $2, lanes => $3)", &[&name, &partition_size, &lanes])
            .expect("create_stream")
            .get(0);
        Stream { name, id }
    }

    /// The names of its log's partitions, in name order.
    pub fn partitions(&self, c: &mut Client) -> Vec<String> {
        c.query(
            "SELECT c.relname::text FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
             WHERE i.inhparent = $1::text::regclass ORDER BY 1",
            &[&self.table("message_log")],
        )
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
    }

    /// The lane of `key` in this stream.
    pub fn lane(&self, c: &mut Client, key: &str) -> i32 {
        c.query_one("SELECT sqlstreams.lane($1, 0, lanes) FROM sqlstreams.streams WHERE name = $2", &[&key, &self.name])
            .expect("lane")
            .get(0)
    }

    /// `sqlstreams.<family>_<id>`, e.g. `table("exception_queue")`.
    pub fn table(&self, family: &str) -> String {
        format!("sqlstreams.{family}_{}", self.id)
    }

    pub fn produce(&self, c: &mut impl postgres::GenericClient, payload: Value, key: Option<&str>) -> i64 {
        self.produce_with(c, payload, key, None, false).expect("produce").expect("an id")
    }

    pub fn produce_with(
        &self,
        c: &mut impl postgres::GenericClient,
        payload: Value,
        key: Option<&str>,
        concurrency: Option<&str>,
        compaction: bool,
    ) -> Result<Option<i64>, postgres::Error> {
        Ok(c.query_one(
            "SELECT sqlstreams.produce($1, $2, $3, $4, $5)",
            &[&self.name, &payload, &key, &concurrency, &compaction],
        )?
        .get(0))
    }

    /// Produces `n` keyless messages `{"n": i}` in one batch; returns their ids.
    pub fn produce_many(&self, c: &mut impl postgres::GenericClient, n: usize, key: Option<&str>) -> Vec<i64> {
        let payloads: Vec<Value> = (0..n).map(|i| serde_json::json!({ "n": i })).collect();
        let keys: Vec<Option<&str>> = vec![key; n];
        c.query("SELECT sqlstreams.produce_batch($1, $2, $3)", &[&self.name, &payloads, &keys])
            .expect("produce_batch")
            .iter()
            .map(|r| r.get(0))
            .collect()
    }

    pub fn group(&self, c: &mut Client, name: &str, concurrency_override: Option<&str>) -> Group {
        let id = c
            .query_one("SELECT sqlstreams.create_group($1, $2, $3)", &[&self.name, &name, &concurrency_override])
            .expect("create_group")
            .get(0);
        Group { stream: self.clone(), name: name.to_string(), id }
    }

    /// A group with explicit retry settings (backoff base 1 s, cap 1 min, exponent 2).
    pub fn group_with(
        &self,
        c: &mut Client,
        name: &str,
        concurrency_override: Option<&str>,
        max_retries: i32,
    ) -> Group {
        let id = c
            .query_one(
                "SELECT sqlstreams.create_group($1, $2, $3, $4, backoff_base => '1 second', backoff_cap => '1 minute')",
                &[&self.name, &name, &concurrency_override, &max_retries],
            )
            .expect("create_group")
            .get(0);
        Group { stream: self.clone(), name: name.to_string(), id }
    }
}

/// One row of a claim result.
#[derive(Clone, Debug, PartialEq)]
pub struct Delivery {
    pub message_id: i64,
    pub message_key: Option<String>,
    pub concurrency: String,
    pub attempt: i32,
    pub payload: Value,
    pub lease_token: Uuid,
    pub run_after: Option<i64>,
}

/// One row of a group's exception queue.
#[derive(Clone, Debug, PartialEq)]
pub struct ExceptionRow {
    pub message_id: i64,
    pub message_key: Option<String>,
    pub concurrency: String,
    pub status: String,
    pub attempts: i32,
    pub delays: i32,
    pub parked: bool,
    /// Seconds from the row's last update to its can_run_after.
    pub wait_secs: f64,
    pub last_error: Option<String>,
}

/// A consumer group created for one test.
#[derive(Clone, Debug)]
pub struct Group {
    pub stream: Stream,
    pub name: String,
    pub id: i64,
}

impl Group {
    pub fn claim(&self, c: &mut Client, batch: i32) -> Vec<Delivery> {
        self.try_claim(c, batch, "30 seconds").expect("claim")
    }

    pub fn try_claim(&self, c: &mut Client, batch: i32, lease: &str) -> Result<Vec<Delivery>, postgres::Error> {
        let rows = c.query(
            "SELECT message_id, message_key, concurrency, attempt, payload, lease_token, run_after
             FROM sqlstreams.claim($1, $2, $3, $4::text::interval)",
            &[&self.stream.name, &self.name, &batch, &lease],
        )?;
        Ok(rows
            .iter()
            .map(|r| Delivery {
                message_id: r.get(0),
                message_key: r.get(1),
                concurrency: r.get(2),
                attempt: r.get(3),
                payload: r.get(4),
                lease_token: r.get(5),
                run_after: r.get(6),
            })
            .collect())
    }

    pub fn ack(&self, c: &mut Client, d: &Delivery) -> bool {
        c.query_one(
            "SELECT sqlstreams.ack($1, $2, $3, $4)",
            &[&self.stream.name, &self.name, &d.lease_token, &d.message_id],
        )
        .expect("ack")
        .get(0)
    }

    /// Acks many deliveries of one claim; returns the ids recorded.
    pub fn ack_batch(&self, c: &mut Client, ds: &[Delivery]) -> Vec<i64> {
        let Some(first) = ds.first() else { return vec![] };
        let ids: Vec<i64> = ds.iter().map(|d| d.message_id).collect();
        c.query_one(
            "SELECT sqlstreams.ack_batch($1, $2, $3, $4)",
            &[&self.stream.name, &self.name, &first.lease_token, &ids],
        )
        .expect("ack_batch")
        .get(0)
    }

    /// Records a failure; `retry_after` like `'0 seconds'` overrides the backoff.
    pub fn fail(
        &self,
        c: &mut Client,
        d: &Delivery,
        error: &str,
        permanent: bool,
        retry_after: Option<&str>,
    ) -> Option<String> {
        c.query_one(
            "SELECT sqlstreams.fail($1, $2, $3, $4, $5, $6, $7::text::interval)",
            &[&self.stream.name, &self.name, &d.lease_token, &d.message_id, &error, &permanent, &retry_after],
        )
        .expect("fail")
        .get(0)
    }

    /// `release` of `ids` under `token`: the ids released.
    pub fn release(&self, c: &mut Client, token: Uuid, ids: &[i64]) -> Vec<i64> {
        c.query_one("SELECT sqlstreams.release($1, $2, $3, $4)", &[&self.stream.name, &self.name, &token, &ids])
            .expect("release")
            .get(0)
    }

    pub fn delay(&self, c: &mut Client, d: &Delivery, delay: &str) -> bool {
        c.query_one(
            "SELECT sqlstreams.delay($1, $2, $3, $4, $5::text::interval)",
            &[&self.stream.name, &self.name, &d.lease_token, &d.message_id, &delay],
        )
        .expect("delay")
        .get(0)
    }

    pub fn exception_rows(&self, c: &mut Client) -> Vec<ExceptionRow> {
        let sql = format!(
            "SELECT message_id, message_key, concurrency, status, attempts, delays, parked,
                    extract(epoch FROM can_run_after - updated_at)::float8, last_error
             FROM {} WHERE consumer_group_id = $1 ORDER BY message_id",
            self.stream.table("exception_queue")
        );
        c.query(&sql, &[&self.id])
            .expect("exception rows")
            .iter()
            .map(|r| ExceptionRow {
                message_id: r.get(0),
                message_key: r.get(1),
                concurrency: r.get(2),
                status: r.get(3),
                attempts: r.get(4),
                delays: r.get(5),
                parked: r.get(6),
                wait_secs: r.get(7),
                last_error: r.get(8),
            })
            .collect()
    }

    /// (message_id, status) of the group's exception rows.
    pub fn statuses(&self, c: &mut Client) -> Vec<(i64, String)> {
        self.exception_rows(c).into_iter().map(|r| (r.message_id, r.status)).collect()
    }

    /// `group_status`'s counts by status must be the queue's rows, counted: (ready, inflight,
    /// deferred, dead, superseded). Returns them.
    pub fn assert_counts_exact(&self, c: &mut Client) -> [i64; 5] {
        let reported = c
            .query_one(
                "SELECT ready, inflight, deferred, dead, superseded FROM sqlstreams.group_status($1, $2)",
                &[&self.stream.name, &self.name],
            )
            .expect("group_status");
        let sql = format!(
            "SELECT count(*) FILTER (WHERE status = 'ready'), count(*) FILTER (WHERE status = 'inflight'),
                    count(*) FILTER (WHERE status = 'deferred'), count(*) FILTER (WHERE status = 'dead'),
                    count(*) FILTER (WHERE status = 'superseded')
             FROM {} WHERE consumer_group_id = $1",
            self.stream.table("exception_queue")
        );
        let counted = c.query_one(&sql, &[&self.id]).expect("count the queue");
        let reported: [i64; 5] = std::array::from_fn(|i| reported.get(i));
        let counted: [i64; 5] = std::array::from_fn(|i| counted.get(i));
        assert_eq!(
            reported, counted,
            "group_status counts (ready, inflight, deferred, dead, superseded) of {}",
            self.name
        );
        reported
    }

    /// The group's cursor as `group_status` reads it now: (claimed, committed).
    pub fn cursor(&self, c: &mut Client) -> (i64, i64) {
        let row = c
            .query_one(
                "SELECT claimed, committed FROM sqlstreams.group_status($1, $2)",
                &[&self.stream.name, &self.name],
            )
            .expect("group_status");
        (row.get(0), row.get(1))
    }

    /// The cursor as `maintain()` last stored it: (claimed, committed).
    pub fn stored_cursor(&self, c: &mut Client) -> (i64, i64) {
        let sql =
            format!("SELECT claimed, committed FROM {} WHERE consumer_group_id = $1", self.stream.table("cursor"));
        let row = c.query_one(&sql, &[&self.id]).expect("cursor");
        (row.get(0), row.get(1))
    }

    /// Lets every lease of the group run out now (ranges, exception rows, held lanes).
    pub fn expire_leases(&self, c: &mut Client) {
        let past = "now() - interval '1 second'";
        let s = &self.stream;
        c.batch_execute(&format!(
            "UPDATE {r} SET lease_expires_at = {past} WHERE consumer_group_id = {g};
             UPDATE {e} SET lease_expires_at = {past} WHERE consumer_group_id = {g} AND status = 'inflight';
             UPDATE {l} SET held_until = {past} WHERE consumer_group_id = {g} AND held_by IS NOT NULL;",
            r = s.table("range_lease"),
            e = s.table("exception_queue"),
            l = s.table("lane"),
            g = self.id
        ))
        .expect("expire leases");
    }

    /// Lets every waiting exception row's time come (retry backoff, requested delay, parking).
    pub fn make_due(&self, c: &mut Client) {
        c.batch_execute(&format!(
            "UPDATE {} SET can_run_after = now() - interval '1 second'
             WHERE consumer_group_id = {} AND status IN ('ready', 'deferred')",
            self.stream.table("exception_queue"),
            self.id
        ))
        .expect("make due");
    }

    /// Claims until nothing comes back, acking everything; returns the ids acked in order.
    pub fn drain(&self, c: &mut Client) -> Vec<i64> {
        let mut acked = Vec::new();
        loop {
            let batch = self.claim(c, 100);
            if batch.is_empty() {
                return acked;
            }
            for d in &batch {
                assert!(self.ack(c, d), "ack of {} lost its lease", d.message_id);
                acked.push(d.message_id);
            }
        }
    }
}

/// Ids of a claim result.
pub fn ids(ds: &[Delivery]) -> Vec<i64> {
    ds.iter().map(|d| d.message_id).collect()
}
