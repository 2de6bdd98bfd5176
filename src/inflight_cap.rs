//! `max_inflight`: a cap on how many of a group's messages are under unexpired leases at once,
//! across all its consumers (docs/semantics.md, "A cap on messages in flight").
//!
//! A claim of a capped group first takes the group's cap lock (src/locks.rs), holding nothing
//! else but the stream's and group's locks, then counts what is in flight and claims at most the
//! rest. The lock is held until the claim's transaction ends, so the next claim of the group
//! counts after this one's leases are committed: two claims never both see room that only one of
//! them may fill. So a claim of a capped group runs in a transaction of its own: in a transaction
//! block the caller could keep the group's turn for as long as it liked. Uncapped groups take no
//! lock and count nothing.
//!
//! In flight: messages of the group's range leases without an outcome, and its inflight
//! exception rows, whose lease has not expired. An expired lease's messages are not counted (the
//! claim that takes them over counts them again), so in a capped group an expired lease cannot be
//! extended (src/lease.rs): its room may have gone to another claim.

use pgrx::pg_sys::BuiltinOid::*;
use pgrx::spi::SpiClient;

use crate::clock;
use crate::error::{Result, StreamError};
use crate::group::GroupRef;
use crate::locks;
use crate::statement::{self, Columns, Statement};

/// Group `$1`'s pause and cap as they are now, and its messages under leases that expire after
/// `$2`.
const IN_FLIGHT: Statement = Statement {
    name: "inflight_count",
    sql: concat!(
        "SELECT g.paused, g.max_inflight,
                (SELECT count(*) FROM sqlstreams.range_lease_@id@ r, unnest(r.pending) AS p(id)
                 WHERE r.consumer_group_id = $1 AND r.lease_expires_at > $2
                   AND NOT EXISTS (SELECT FROM sqlstreams.range_done_@id@ d
                                   WHERE d.consumer_group_id = $1 AND d.lease_token = r.lease_token
                                     AND d.message_id = p.id))
              + (SELECT count(*) FROM sqlstreams.exception_queue_@id@
                 WHERE consumer_group_id = $1 AND ",
        crate::exception_queue::in_flight!(),
        " AND lease_expires_at > $2) AS inflight
          FROM sqlstreams.consumer_group g WHERE g.id = $1"
    ),
    params: &[INT8OID, TIMESTAMPTZOID],
};

/// Takes a capped group's turn (waits for the claim of the group in progress); nothing for an
/// uncapped group. Refused in a transaction block (`in_block`), before anything changed.
pub fn lock(group: &GroupRef, in_block: bool) -> Result<()> {
    if group.max_inflight.is_none() {
        return Ok(());
    }
    if in_block {
        return Err(StreamError::WrongTransactionState {
            message: "a claim of a group with max_inflight runs in its own transaction".into(),
            hint: "The group's claims take turns until each one's transaction ends: call claim outside \
                   BEGIN ... COMMIT (autocommit), or remove the cap with sqlstreams.alter_group(stream, \
                   group_name, max_inflight => 0)."
                .into(),
        });
    }
    locks::inflight_cap(group.id);
    Ok(())
}

/// How many messages a claim of `group` may hand out, at most `batch`: `batch` for an uncapped
/// group; for a capped one, what the cap leaves (0 when it is reached or the group was paused
/// meanwhile), counted after `lock` waited, with the cap as it is now.
pub fn room(client: &SpiClient<'_>, group: &GroupRef, batch: i32) -> Result<i32> {
    if group.max_inflight.is_none() {
        return Ok(batch);
    }
    let args = [group.id.into(), statement::timestamptz(clock::now())];
    let row = IN_FLIGHT.run(client, group.stream.id, &args)?.first();
    if row.is_empty() || row.required::<bool>("paused")? {
        return Ok(0);
    }
    let Some(cap) = row.value::<i32>("max_inflight")? else { return Ok(batch) };
    let inflight: i64 = row.required("inflight")?;
    Ok(batch.min((i64::from(cap) - inflight).clamp(0, i64::from(i32::MAX)) as i32))
}
