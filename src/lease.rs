//! What a consumer can do with a lease besides recording outcomes: extend it while handlers are
//! still running (a heartbeat), and release deliveries it will not start (shutdown, or a lease
//! too short for the handler's timeout) without spending an attempt.
//!
//! Both are outcomes in the lock order of src/locks.rs: the token lock, the token's rows, then
//! the clock.

use pgrx::pg_sys::{self, BuiltinOid::*};
use pgrx::prelude::*;

use crate::error::{Result, SqlResult};
use crate::exception_queue::{self, NewRow, Status};
use crate::group;
use crate::locks;
use crate::message;
use crate::names::{positive_micros, required, validate_name};
use crate::range;
use crate::statement::{self, Statement};

/// Locks everything `token` holds, so the new expiry is computed after any wait for it.
const LOCK_HELD: Statement = Statement {
    name: "lease_lock_held",
    sql: "WITH r AS (SELECT 1 FROM sqlstreams.range_lease_@id@
                     WHERE consumer_group_id = $1 AND lease_token = $2 FOR UPDATE),
               e AS (SELECT 1 FROM sqlstreams.exception_queue_@id@
                     WHERE consumer_group_id = $1 AND lease_token = $2 AND status = 'inflight' FOR UPDATE),
               k AS (SELECT 1 FROM sqlstreams.message_key_lease_@id@
                     WHERE consumer_group_id = $1 AND lease_token = $2 FOR UPDATE)
          SELECT (SELECT count(*) FROM r) + (SELECT count(*) FROM e) + (SELECT count(*) FROM k)",
    params: &[INT8OID, UUIDOID],
};

const EXTEND: Statement = Statement {
    name: "lease_extend",
    sql: "WITH r AS (UPDATE sqlstreams.range_lease_@id@ SET lease_expires_at = $3
                     WHERE consumer_group_id = $1 AND lease_token = $2 RETURNING 1),
               e AS (UPDATE sqlstreams.exception_queue_@id@ SET lease_expires_at = $3
                     WHERE consumer_group_id = $1 AND lease_token = $2 AND status = 'inflight' RETURNING 1),
               k AS (UPDATE sqlstreams.message_key_lease_@id@ SET lease_expires_at = $3
                     WHERE consumer_group_id = $1 AND lease_token = $2 RETURNING 1)
          SELECT (SELECT count(*) FROM r) + (SELECT count(*) FROM e) + (SELECT count(*) FROM k)",
    params: &[INT8OID, UUIDOID, TIMESTAMPTZOID],
};

const RELEASE_ROWS: Statement = Statement {
    name: "lease_release_rows",
    sql: "UPDATE sqlstreams.exception_queue_@id@
          SET status = 'ready', lease_token = NULL, lease_expires_at = NULL, can_run_after = $4,
              parked = false, updated_at = $4
          WHERE consumer_group_id = $1 AND lease_token = $2 AND status = 'inflight' AND message_id = ANY($3)
          RETURNING message_id, message_key",
    params: &[INT8OID, UUIDOID, INT8ARRAYOID, TIMESTAMPTZOID],
};

fn now() -> i64 {
    // SAFETY: reads the clock.
    unsafe { pg_sys::GetCurrentTimestamp() }
}

/// Moves every expiry under `token` to now + `lease`; false when nothing is held any more.
pub fn extend(stream: &str, group_name: &str, token: pgrx::Uuid, lease_micros: i64) -> Result<bool> {
    crate::commit::consumer_call(|| {
        Spi::connect_mut(|client| {
            let group = group::lookup(client, stream, group_name)?;
            locks::token(token);
            LOCK_HELD.run(client, group.stream.id, &[group.id.into(), token.into()])?;
            let expires = now().saturating_add(lease_micros);
            let held: i64 = EXTEND
                .run(client, group.stream.id, &[group.id.into(), token.into(), statement::timestamptz(expires)])?
                .first()
                .get(1)?
                .unwrap_or(0);
            Ok(held > 0)
        })
    })
}

/// Gives deliveries back unstarted: each becomes a `ready` row due at once, its attempts
/// unchanged. Returns the ids released.
pub fn release(stream: &str, group_name: &str, token: pgrx::Uuid, ids: &[i64]) -> Result<Vec<i64>> {
    crate::commit::consumer_call(|| {
        Spi::connect_mut(|client| {
            let group = group::lookup(client, stream, group_name)?;
            let stream_id = group.stream.id;
            locks::token(token);
            // Released rows are due at once: a clock read before a wait only makes them due sooner.
            let now = now();
            let mut released: Vec<(i64, Option<String>)> = Vec::new();
            for row in RELEASE_ROWS.run(
                client,
                stream_id,
                &[group.id.into(), token.into(), ids.to_vec().into(), statement::timestamptz(now)],
            )? {
                released.push((row.get(1)?.expect("id"), row.get(2)?));
            }
            if let Some(mut range) = range::for_token(client, stream_id, group.id, token)? {
                let removed = range.remove(ids);
                if !removed.is_empty() {
                    let removed_ids: Vec<i64> = removed.iter().map(|(id, _)| *id).collect();
                    let rows: Vec<NewRow> = message::info(client, &group, &removed_ids)?
                        .into_iter()
                        .map(|m| NewRow {
                            message_id: m.message_id,
                            key: m.key,
                            policy: m.policy,
                            compaction: m.compaction,
                            status: Status::Ready,
                            attempts: 0,
                            delays: 0,
                            can_run_after: now,
                            parked: false,
                            isolated: false,
                            last_error: None,
                        })
                        .collect();
                    exception_queue::insert(client, stream_id, group.id, &rows, now)?;
                    range::store_pending(client, stream_id, group.id, &range)?;
                    released.extend(removed);
                }
            }
            let keys = exception_queue::distinct_keys(released.iter().map(|(_, k)| k));
            exception_queue::after_outcome(client, &group, Some(token), &keys, now)?;
            let mut ids: Vec<i64> = released.into_iter().map(|(id, _)| id).collect();
            ids.sort_unstable();
            Ok(ids)
        })
    })
}

/// Extends every lease held under lease_token (its range, exception-queue deliveries and
/// exclusive keys) to now + lease. Returns false when the token holds nothing any more (its
/// lease was taken over, or everything was resolved).
#[pg_extern(volatile, parallel_unsafe)]
fn extend_lease(
    stream: Option<&str>,
    group_name: Option<&str>,
    lease_token: Option<pgrx::Uuid>,
    lease: default!(Option<Interval>, "'30 seconds'"),
) -> SqlResult<bool> {
    let stream = validate_name("stream", stream)?;
    let group_name = validate_name("group", group_name)?;
    let token = required("lease_token", lease_token, "of the claim to extend")?;
    let lease = positive_micros("lease", lease.map(|l| l.as_micros()), "'30 seconds'")?;
    Ok(extend(stream, group_name, token, lease)?)
}

/// Gives claimed deliveries back without running them (for a consumer shutting down): each is
/// due again at once and its attempt is not counted. Returns the ids released; an id whose
/// lease was lost is left out.
#[pg_extern(volatile, parallel_unsafe, name = "release")]
fn release_sql(
    stream: Option<&str>,
    group_name: Option<&str>,
    lease_token: Option<pgrx::Uuid>,
    message_ids: Option<Vec<Option<i64>>>,
) -> SqlResult<Vec<i64>> {
    let stream = validate_name("stream", stream)?;
    let group_name = validate_name("group", group_name)?;
    let token = required("lease_token", lease_token, "of the claim the ids came from")?;
    let ids: Vec<i64> = required("message_ids", message_ids, "to release")?.into_iter().flatten().collect();
    Ok(release(stream, group_name, token, &ids)?)
}
