//! The exception queue (`exception_queue_<stream id>`): one row per (group, message) that left
//! the happy path. A message that succeeds on its first delivery never gets a row.
//!
//! This file says what a row is and how rows are stored; `lifecycle.rs` holds every state change
//! a row can go through, one named function each, so the whole life of a failed message reads
//! top to bottom in one place.

pub mod counts;
mod lifecycle;

pub use lifecycle::*;

use pgrx::pg_sys::BuiltinOid::*;
use pgrx::spi::SpiClient;

use crate::concurrency::Concurrency;
use crate::error::{Result, StreamError};
use crate::statement::{self, Columns, Statement};

/// The statuses of unresolved rows, as a SQL list: `status IN unresolved!()`.
macro_rules! unresolved {
    () => {
        "('ready', 'inflight', 'deferred')"
    };
}
pub(crate) use unresolved;

// The conditions below are the predicates of the queue's partial indexes (sql/). Postgres uses
// a partial index only for a statement whose conditions imply its predicate, so a statement
// that needs one says it with these macros, and a test holds the indexes to the same text.

/// The statuses of `waiting!` and `in_flight!`, for what reads rows without SQL
/// (src/lanes/free.rs; a test holds them to the macros).
pub const WAITING: [&str; 2] = ["ready", "deferred"];
pub const IN_FLIGHT: [&str; 1] = ["inflight"];

/// Rows waiting for a time (`can_run_after`): retries, delays, rows a resolution woke. The
/// `_due` and `_due_any` indexes' predicate; `waiting!("e")` for alias `e`.
macro_rules! waiting {
    () => {
        "status IN ('ready', 'deferred')"
    };
    ($alias:literal) => {
        concat!($alias, ".", $crate::exception_queue::waiting!())
    };
}
pub(crate) use waiting;

/// Whether group `$1` has any parked row, as a SQL expression: one probe of the `_parked` index
/// (a scalar subquery ordered by the index's columns, as `src/lanes.rs` explains, not EXISTS).
macro_rules! any_parked {
    () => {
        "coalesce((SELECT true FROM sqlstreams.exception_queue_@id@
                   WHERE consumer_group_id = $1 AND parked
                   ORDER BY message_key, message_id LIMIT 1), false)"
    };
}
pub(crate) use any_parked;

/// Rows handed out under a lease that may expire. The `_inflight` and `_expiry_any` indexes'
/// predicate; `in_flight!("e")` for alias `e`.
macro_rules! in_flight {
    () => {
        "status = 'inflight'"
    };
    ($alias:literal) => {
        concat!($alias, ".", $crate::exception_queue::in_flight!())
    };
}
pub(crate) use in_flight;

/// Rows of alias `$alias` that a claim may hand out at time `$now`: waiting and due, or in
/// flight with their lease expired.
macro_rules! due_or_expired {
    ($alias:literal, $now:literal) => {
        concat!(
            "((",
            $crate::exception_queue::waiting!($alias),
            " AND ",
            $alias,
            ".can_run_after <= ",
            $now,
            ") OR (",
            $crate::exception_queue::in_flight!($alias),
            " AND ",
            $alias,
            ".lease_expires_at <= ",
            $now,
            "))"
        )
    };
}
pub(crate) use due_or_expired;

/// In the order `group_status` reports them (`Status as usize` indexes its counts).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    /// Waiting until `can_run_after` (retry backoff or a requested delay).
    Ready,
    /// Handed out from the queue under a lease.
    Inflight,
    /// Never ran: its key was busy or an earlier same-key message was unresolved.
    Deferred,
    /// Failed permanently or spent its budget; kept for triage. Resolved.
    Dead,
    /// A newer compacted message of its key replaced it; never runs. Resolved.
    Superseded,
}

impl Status {
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Ready => "ready",
            Status::Inflight => "inflight",
            Status::Deferred => "deferred",
            Status::Dead => "dead",
            Status::Superseded => "superseded",
        }
    }

    /// Parses a status the table stored (its check constraint admits only these).
    pub fn from_stored(value: &str) -> Result<Status> {
        [Status::Ready, Status::Inflight, Status::Deferred, Status::Dead, Status::Superseded]
            .into_iter()
            .find(|s| s.as_str() == value)
            .ok_or_else(|| StreamError::Internal(format!("unknown exception-queue status {value:?}")))
    }
}

/// A row to insert for a message that had none.
#[derive(Clone, Debug)]
pub struct NewRow {
    pub message_id: i64,
    pub key: Option<String>,
    pub concurrency: Concurrency,
    pub compaction: bool,
    pub status: Status,
    pub attempts: i32,
    pub delays: i32,
    pub can_run_after: i64,
    /// Waiting for a blocker: woken early when the blocker resolves (`lifecycle::wake`).
    pub parked: bool,
    /// Delivered alone until resolved (a message of a quarantined range).
    pub isolated: bool,
    pub last_error: Option<String>,
    pub lane: i32,
}

/// A change to an existing row.
#[derive(Clone, Debug)]
pub struct RowUpdate {
    pub message_id: i64,
    pub status: Status,
    pub attempts: i32,
    /// `None` keeps the row's count.
    pub delays: Option<i32>,
    /// `None` keeps the row's time.
    pub can_run_after: Option<i64>,
    pub parked: bool,
    /// Set exactly when `status` is `Inflight`.
    pub lease: Option<(pgrx::Uuid, i64)>,
    /// `None` keeps the row's last error.
    pub last_error: Option<String>,
}

/// One change to the queue.
#[derive(Clone, Debug)]
pub enum Change {
    Insert(NewRow),
    Update(RowUpdate),
}

/// The inflight row a token holds, as an outcome sees it (locked).
pub struct Inflight {
    pub key: Option<String>,
    /// The policy resolved when it was claimed.
    pub concurrency: Concurrency,
    pub attempts: i32,
    pub delays: i32,
}

const INSERT: Statement = Statement {
    name: "eq_insert",
    sql: "INSERT INTO sqlstreams.exception_queue_@id@
              (consumer_group_id, message_id, message_key, concurrency, compaction, status, attempts,
               delays, can_run_after, parked, isolated, last_error, lane, created_at, updated_at)
          SELECT $1, u.id, u.message_key, u.concurrency, u.compaction, u.status, u.attempts,
                 u.delays, u.can_run_after, u.parked, u.isolated, u.last_error, u.lane, $13, $13
          FROM unnest($2::bigint[], $3::text[], $4::text[], $5::bool[], $6::text[], $7::int[],
                      $8::int[], $9::timestamptz[], $10::bool[], $11::bool[], $12::text[], $14::int[])
               AS u(id, message_key, concurrency, compaction, status, attempts, delays, can_run_after, parked,
                    isolated, last_error, lane)",
    params: &[
        INT8OID,
        INT8ARRAYOID,
        TEXTARRAYOID,
        TEXTARRAYOID,
        BOOLARRAYOID,
        TEXTARRAYOID,
        INT4ARRAYOID,
        INT4ARRAYOID,
        TIMESTAMPTZARRAYOID,
        BOOLARRAYOID,
        BOOLARRAYOID,
        TEXTARRAYOID,
        TIMESTAMPTZOID,
        INT4ARRAYOID,
    ],
};
const UPDATE: Statement = Statement {
    name: "eq_update",
    sql: "UPDATE sqlstreams.exception_queue_@id@ e
          SET status = u.status, attempts = u.attempts, delays = coalesce(u.delays, e.delays),
              can_run_after = coalesce(u.can_run_after, e.can_run_after),
              parked = u.parked, lease_token = u.lease_token, lease_expires_at = u.lease_expires_at,
              last_error = coalesce(u.last_error, e.last_error), updated_at = $11
          FROM unnest($2::bigint[], $3::text[], $4::int[], $5::int[], $6::timestamptz[], $7::bool[], $8::uuid[],
                      $9::timestamptz[], $10::text[])
               AS u(id, status, attempts, delays, can_run_after, parked, lease_token, lease_expires_at, last_error)
          WHERE e.consumer_group_id = $1 AND e.message_id = u.id",
    params: &[
        INT8OID,
        INT8ARRAYOID,
        TEXTARRAYOID,
        INT4ARRAYOID,
        INT4ARRAYOID,
        TIMESTAMPTZARRAYOID,
        BOOLARRAYOID,
        UUIDARRAYOID,
        TIMESTAMPTZARRAYOID,
        TEXTARRAYOID,
        TIMESTAMPTZOID,
    ],
};

const INFLIGHT: Statement = Statement {
    name: "eq_inflight",
    sql: "SELECT message_key, concurrency, attempts, delays FROM sqlstreams.exception_queue_@id@
          WHERE consumer_group_id = $1 AND message_id = $2 AND status = 'inflight' AND lease_token = $3
          FOR UPDATE",
    params: &[INT8OID, INT8OID, UUIDOID],
};

/// Writes `changes`: every insert in one statement, every update in another.
pub fn write(client: &SpiClient<'_>, stream_id: i64, group_id: i64, changes: Vec<Change>, now: i64) -> Result<()> {
    let (mut inserts, mut updates) = (Vec::new(), Vec::new());
    for change in changes {
        match change {
            Change::Insert(row) => inserts.push(row),
            Change::Update(row) => updates.push(row),
        }
    }
    insert(client, stream_id, group_id, &inserts, now)?;
    update(client, stream_id, group_id, &updates, now)
}

pub fn insert(client: &SpiClient<'_>, stream_id: i64, group_id: i64, rows: &[NewRow], now: i64) -> Result<()> {
    if rows.is_empty() {
        return Ok(());
    }
    let ids: Vec<i64> = rows.iter().map(|r| r.message_id).collect();
    let keys: Vec<Option<String>> = rows.iter().map(|r| r.key.clone()).collect();
    let concurrencies: Vec<&str> = rows.iter().map(|r| r.concurrency.as_str()).collect();
    let compaction: Vec<bool> = rows.iter().map(|r| r.compaction).collect();
    let statuses: Vec<&str> = rows.iter().map(|r| r.status.as_str()).collect();
    let attempts: Vec<i32> = rows.iter().map(|r| r.attempts).collect();
    let delays: Vec<i32> = rows.iter().map(|r| r.delays).collect();
    let times: Vec<Option<i64>> = rows.iter().map(|r| Some(r.can_run_after)).collect();
    let parked: Vec<bool> = rows.iter().map(|r| r.parked).collect();
    let isolated: Vec<bool> = rows.iter().map(|r| r.isolated).collect();
    let errors: Vec<Option<String>> = rows.iter().map(|r| r.last_error.clone()).collect();
    let lanes: Vec<i32> = rows.iter().map(|r| r.lane).collect();
    INSERT.run(
        client,
        stream_id,
        &[
            group_id.into(),
            ids.into(),
            keys.into(),
            concurrencies.into(),
            compaction.into(),
            statuses.into(),
            attempts.into(),
            delays.into(),
            statement::timestamptz_array(times),
            parked.into(),
            isolated.into(),
            errors.into(),
            statement::timestamptz(now),
            lanes.into(),
        ],
    )?;
    Ok(())
}

pub fn update(client: &SpiClient<'_>, stream_id: i64, group_id: i64, rows: &[RowUpdate], now: i64) -> Result<()> {
    if rows.is_empty() {
        return Ok(());
    }
    let ids: Vec<i64> = rows.iter().map(|r| r.message_id).collect();
    let statuses: Vec<&str> = rows.iter().map(|r| r.status.as_str()).collect();
    let attempts: Vec<i32> = rows.iter().map(|r| r.attempts).collect();
    let delays: Vec<Option<i32>> = rows.iter().map(|r| r.delays).collect();
    let times: Vec<Option<i64>> = rows.iter().map(|r| r.can_run_after).collect();
    let parked: Vec<bool> = rows.iter().map(|r| r.parked).collect();
    let tokens: Vec<Option<pgrx::Uuid>> = rows.iter().map(|r| r.lease.map(|(t, _)| t)).collect();
    let expiries: Vec<Option<i64>> = rows.iter().map(|r| r.lease.map(|(_, e)| e)).collect();
    let errors: Vec<Option<String>> = rows.iter().map(|r| r.last_error.clone()).collect();
    UPDATE.run(
        client,
        stream_id,
        &[
            group_id.into(),
            ids.into(),
            statuses.into(),
            attempts.into(),
            delays.into(),
            statement::timestamptz_array(times),
            parked.into(),
            tokens.into(),
            statement::timestamptz_array(expiries),
            errors.into(),
            statement::timestamptz(now),
        ],
    )?;
    Ok(())
}

/// The inflight row of `message_id` under `token`, locked; `None` when the token does not hold
/// it (the lease was lost, or the message is in a range instead).
pub fn inflight(
    client: &SpiClient<'_>,
    stream_id: i64,
    group_id: i64,
    message_id: i64,
    token: pgrx::Uuid,
) -> Result<Option<Inflight>> {
    let row = INFLIGHT.run(client, stream_id, &[group_id.into(), message_id.into(), token.into()])?.first();
    if row.is_empty() {
        return Ok(None);
    }
    Ok(Some(Inflight {
        key: row.value("message_key")?,
        concurrency: Concurrency::from_stored(&row.required::<String>("concurrency")?)?,
        attempts: row.required("attempts")?,
        delays: row.required("delays")?,
    }))
}

/// Sorted, de-duplicated keys of the keyed messages among `keys`.
pub fn distinct_keys<'a>(keys: impl IntoIterator<Item = &'a Option<String>>) -> Vec<String> {
    let mut keys: Vec<String> = keys.into_iter().flatten().cloned().collect();
    keys.sort_unstable();
    keys.dedup();
    keys
}

#[cfg(test)]
mod tests {
    use super::{IN_FLIGHT, WAITING};

    /// The predicate of every `CREATE INDEX exception_queue_@id@_<suffix>` in `sql`, by suffix.
    fn predicates(sql: &str) -> Vec<(String, String)> {
        let mut found = Vec::new();
        for definition in sql.split("CREATE INDEX exception_queue_@id@_").skip(1) {
            let definition = &definition[..definition.find(';').expect("an index definition ends with ;")];
            let suffix = definition.split_whitespace().next().unwrap_or_default().to_string();
            if let Some((_, predicate)) = definition.split_once(" WHERE ") {
                found.push((suffix, predicate.split_whitespace().collect::<Vec<_>>().join(" ")));
            }
        }
        found
    }

    #[test]
    fn the_queues_partial_indexes_are_the_statements_conditions() {
        let expected = [
            ("due_idx", waiting!()),
            ("due_any_idx", waiting!()),
            ("inflight_idx", in_flight!()),
            ("expiry_any_idx", in_flight!()),
            ("unresolved_idx", concat!("status IN ", unresolved!())),
            ("isolated_idx", concat!("isolated AND status IN ", unresolved!())),
        ];
        let current = predicates(include_str!("../../sql/sqlstreams--0.2.0.sql"));
        let upgrade = predicates(include_str!("../../sql/sqlstreams--0.1.0--0.2.0.sql"));
        for (suffix, condition) in expected {
            assert!(
                current.iter().any(|(s, _)| s == suffix),
                "sqlstreams--0.2.0.sql creates exception_queue_@id@_{suffix}"
            );
            for (s, predicate) in current.iter().chain(&upgrade).filter(|(s, _)| s == suffix) {
                assert_eq!(predicate, condition, "the predicate of exception_queue_@id@_{s}");
            }
        }
        let gate: Vec<String> = crate::key_gate::UNRESOLVED.iter().map(|s| format!("'{s}'")).collect();
        assert_eq!(format!("({})", gate.join(", ")), unresolved!(), "the key gate's unresolved statuses");
        let listed = |statuses: &[&str]| statuses.iter().map(|s| format!("'{s}'")).collect::<Vec<_>>().join(", ");
        assert_eq!(format!("status IN ({})", listed(&WAITING)), waiting!());
        assert_eq!(format!("status = {}", listed(&IN_FLIGHT)), in_flight!());
        assert_eq!(
            due_or_expired!("e", "$2"),
            "((e.status IN ('ready', 'deferred') AND e.can_run_after <= $2) OR (e.status = 'inflight' AND e.lease_expires_at <= $2))"
        );
    }
}
