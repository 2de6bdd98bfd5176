//! The exception queue: rows for every (group, message) that left the happy path, and the two
//! things that happen when a message resolves: its exclusive key lease is released, and rows
//! parked behind its key are woken.
//!
//! Parking: a row that must wait (deferred, or a retry whose key is busy) gets
//! `parked = true` and `can_run_after` = the latest time its blocker could clear on its own (a
//! retry time, a lease expiry). Every resolution wakes the key's parked rows that can now run,
//! so a successor is claimable by the very next claim; the timer only bounds a wait whose
//! blocker vanished without an outcome (a crashed consumer). A due row that a claim finds still
//! blocked is parked again, so no claim examines the same blocked row twice in a row.

use pgrx::pg_sys::BuiltinOid::*;
use pgrx::spi::SpiClient;

use crate::error::Result;
use crate::group::GroupRef;
use crate::locks;
use crate::notify;
use crate::policy::Policy;
use crate::statement::{self, Statement};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    Ready,
    Inflight,
    Deferred,
    Dead,
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
}

/// A row to insert for a message that had none.
#[derive(Clone, Debug)]
pub struct NewRow {
    pub message_id: i64,
    pub key: Option<String>,
    pub policy: Policy,
    pub compaction: bool,
    pub status: Status,
    pub attempts: i32,
    pub delays: i32,
    pub can_run_after: i64,
    pub parked: bool,
    /// Delivered alone until resolved (a message of a quarantined range).
    pub isolated: bool,
    pub last_error: Option<String>,
}

/// A change to an existing row, decided by a claim.
#[derive(Clone, Debug)]
pub struct RowUpdate {
    pub message_id: i64,
    pub status: Status,
    pub attempts: i32,
    /// `None` keeps the row's time.
    pub can_run_after: Option<i64>,
    pub parked: bool,
    /// Set exactly when `status` is `Inflight`.
    pub lease: Option<(pgrx::Uuid, i64)>,
    /// `None` keeps the row's last error.
    pub last_error: Option<String>,
}

const INSERT: Statement = Statement {
    name: "eq_insert",
    sql: "INSERT INTO sqlstreams.exception_queue_@id@
              (consumer_group_id, message_id, message_key, concurrency, compaction, status, attempts,
               delays, can_run_after, parked, isolated, last_error, created_at, updated_at)
          SELECT $1, u.id, u.message_key, u.concurrency, u.compaction, u.status, u.attempts,
                 u.delays, u.can_run_after, u.parked, u.isolated, u.last_error, $13, $13
          FROM unnest($2::bigint[], $3::text[], $4::text[], $5::bool[], $6::text[], $7::int[],
                      $8::int[], $9::timestamptz[], $10::bool[], $11::bool[], $12::text[])
               AS u(id, message_key, concurrency, compaction, status, attempts, delays, can_run_after, parked,
                    isolated, last_error)",
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
    ],
};

const UPDATE: Statement = Statement {
    name: "eq_update",
    sql: "UPDATE sqlstreams.exception_queue_@id@ e
          SET status = u.status, attempts = u.attempts, can_run_after = coalesce(u.can_run_after, e.can_run_after),
              parked = u.parked, lease_token = u.lease_token, lease_expires_at = u.lease_expires_at,
              last_error = coalesce(u.last_error, e.last_error), updated_at = $10
          FROM unnest($2::bigint[], $3::text[], $4::int[], $5::timestamptz[], $6::bool[], $7::uuid[],
                      $8::timestamptz[], $9::text[])
               AS u(id, status, attempts, can_run_after, parked, lease_token, lease_expires_at, last_error)
          WHERE e.consumer_group_id = $1 AND e.message_id = u.id",
    params: &[
        INT8OID,
        INT8ARRAYOID,
        TEXTARRAYOID,
        INT4ARRAYOID,
        TIMESTAMPTZARRAYOID,
        BOOLARRAYOID,
        UUIDARRAYOID,
        TIMESTAMPTZARRAYOID,
        TEXTARRAYOID,
        TIMESTAMPTZOID,
    ],
};

/// Wakes, per key, the parked rows that may run once the key's last resolution is recorded: an
/// exclusive row always (it only needs the key lease), an ordered row only when no unparked
/// ready or inflight row of its key precedes it. At most `$4` rows per key, in id order, which
/// is what one claim can chain. Rows a claim holds are skipped: that claim is deciding them and
/// sees this resolution (it waits for this transaction's key locks before it parks anything).
const WAKE: Statement = Statement {
    name: "eq_wake",
    sql: "WITH candidates AS (
              SELECT w.message_id
              FROM unnest($2::text[]) AS k(message_key)
              CROSS JOIN LATERAL (
                  SELECT p.message_id FROM sqlstreams.exception_queue_@id@ p
                  WHERE p.consumer_group_id = $1 AND p.message_key = k.message_key AND p.parked
                    AND (p.concurrency <> 'ordered' OR p.message_id < coalesce(
                            (SELECT min(b.message_id) FROM sqlstreams.exception_queue_@id@ b
                             WHERE b.consumer_group_id = $1 AND b.message_key = k.message_key
                               AND b.status IN ('ready', 'inflight') AND NOT b.parked),
                            9223372036854775807))
                  ORDER BY p.message_id
                  LIMIT $4) w
          ), free AS (
              SELECT e.message_id FROM sqlstreams.exception_queue_@id@ e
              WHERE e.consumer_group_id = $1 AND e.message_id IN (SELECT message_id FROM candidates) AND e.parked
              FOR UPDATE SKIP LOCKED
          )
          UPDATE sqlstreams.exception_queue_@id@ e
          SET parked = false, can_run_after = $3, updated_at = $3
          FROM free
          WHERE e.consumer_group_id = $1 AND e.message_id = free.message_id",
    params: &[INT8OID, TEXTARRAYOID, TIMESTAMPTZOID, INT4OID],
};

/// Releases `token`'s exclusive leases on `keys` once nothing of that key is left under the
/// token (a chain keeps its key until its last row resolves).
const RELEASE_KEYS: Statement = Statement {
    name: "eq_release_keys",
    sql: "DELETE FROM sqlstreams.message_key_lease_@id@ l
          WHERE l.consumer_group_id = $1 AND l.lease_token = $2 AND l.message_key = ANY($3)
            AND NOT EXISTS (SELECT 1 FROM sqlstreams.range_lease_@id@ r, unnest(r.pending_keys) AS pk(message_key)
                            WHERE r.consumer_group_id = $1 AND r.lease_token = $2 AND pk.message_key = l.message_key)
            AND NOT EXISTS (SELECT 1 FROM sqlstreams.exception_queue_@id@ e
                            WHERE e.consumer_group_id = $1 AND e.message_key = l.message_key
                              AND e.status = 'inflight' AND e.lease_token = $2)",
    params: &[INT8OID, UUIDOID, TEXTARRAYOID],
};

/// Rows one claim can chain per key; also the wake batch.
pub const WAKE_PER_KEY: i32 = 1000;

pub fn insert(client: &SpiClient<'_>, stream_id: i64, group_id: i64, rows: &[NewRow], now: i64) -> Result<()> {
    if rows.is_empty() {
        return Ok(());
    }
    let ids: Vec<i64> = rows.iter().map(|r| r.message_id).collect();
    let keys: Vec<Option<String>> = rows.iter().map(|r| r.key.clone()).collect();
    let policies: Vec<&str> = rows.iter().map(|r| r.policy.as_str()).collect();
    let compaction: Vec<bool> = rows.iter().map(|r| r.compaction).collect();
    let statuses: Vec<&str> = rows.iter().map(|r| r.status.as_str()).collect();
    let attempts: Vec<i32> = rows.iter().map(|r| r.attempts).collect();
    let delays: Vec<i32> = rows.iter().map(|r| r.delays).collect();
    let times: Vec<Option<i64>> = rows.iter().map(|r| Some(r.can_run_after)).collect();
    let parked: Vec<bool> = rows.iter().map(|r| r.parked).collect();
    let isolated: Vec<bool> = rows.iter().map(|r| r.isolated).collect();
    let errors: Vec<Option<String>> = rows.iter().map(|r| r.last_error.clone()).collect();
    INSERT.run(
        client,
        stream_id,
        &[
            group_id.into(),
            ids.into(),
            keys.into(),
            policies.into(),
            compaction.into(),
            statuses.into(),
            attempts.into(),
            delays.into(),
            statement::timestamptz_array(times),
            parked.into(),
            isolated.into(),
            errors.into(),
            statement::timestamptz(now),
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

/// After outcomes under `token` touched `keys`: releases the exclusive leases nothing holds any
/// more and wakes the rows parked behind those keys. Signals idle consumers when a row woke.
pub fn after_outcome(
    client: &SpiClient<'_>,
    group: &GroupRef,
    token: Option<pgrx::Uuid>,
    keys: &[String],
    now: i64,
) -> Result<()> {
    if keys.is_empty() {
        return Ok(());
    }
    let stream_id = group.stream.id;
    if group.may_park() {
        // Before the key is released or woken (src/key_gate.rs, "Parking and wake-ups").
        locks::keys_shared(group.id, keys);
    }
    if let (Some(token), true) = (token, group.may_hold_key_leases()) {
        RELEASE_KEYS.run(client, stream_id, &[group.id.into(), token.into(), keys.to_vec().into()])?;
    }
    if group.may_park() {
        let woken = WAKE.run(
            client,
            stream_id,
            &[group.id.into(), keys.to_vec().into(), statement::timestamptz(now), WAKE_PER_KEY.into()],
        )?;
        if !woken.is_empty() {
            notify::signal(client, stream_id)?;
        }
    }
    Ok(())
}

/// Sorted, de-duplicated keys of the keyed messages among `keys`.
pub fn distinct_keys<'a>(keys: impl IntoIterator<Item = &'a Option<String>>) -> Vec<String> {
    let mut keys: Vec<String> = keys.into_iter().flatten().cloned().collect();
    keys.sort_unstable();
    keys.dedup();
    keys
}
