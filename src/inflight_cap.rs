//! `max_inflight`: a cap on how many of a group's messages are under unexpired leases at once,
//! across all its consumers (docs/semantics.md, "A cap on messages in flight").
//!
//! A claim of a capped group takes the group's cap lock (src/locks.rs), then counts what is in
//! flight and claims at most the rest. The lock is held until the claim's transaction ends, so
//! the next claim of the group counts after this one's leases are committed: two claims never
//! both see room that only one of them may fill. Uncapped groups take no lock and count nothing.
//! What is in flight: messages of the group's range leases without an outcome, and its inflight
//! exception rows, whose lease has not expired. An expired lease's messages are not counted: the
//! claim that takes them over counts them again.

use pgrx::pg_sys::BuiltinOid::*;
use pgrx::spi::SpiClient;

use crate::clock;
use crate::error::Result;
use crate::group::GroupRef;
use crate::locks;
use crate::statement::{self, Columns, Statement};

/// Messages of group `$1` under leases that expire after `$2`.
const IN_FLIGHT: Statement = Statement {
    name: "inflight_count",
    sql: concat!(
        "SELECT (SELECT count(*) FROM sqlstreams.range_lease_@id@ r, unnest(r.pending) AS p(id)
                 WHERE r.consumer_group_id = $1 AND r.lease_expires_at > $2
                   AND NOT EXISTS (SELECT FROM sqlstreams.range_done_@id@ d
                                   WHERE d.consumer_group_id = $1 AND d.lease_token = r.lease_token
                                     AND d.message_id = p.id))
              + (SELECT count(*) FROM sqlstreams.exception_queue_@id@
                 WHERE consumer_group_id = $1 AND ",
        crate::exception_queue::in_flight!(),
        " AND lease_expires_at > $2) AS inflight"
    ),
    params: &[INT8OID, TIMESTAMPTZOID],
};

/// Takes a capped group's cap lock (waits); nothing for an uncapped group. A claim takes it
/// before it records the acks it carries, which would otherwise wait with row locks held.
pub fn lock(group: &GroupRef) {
    if group.max_inflight.is_some() {
        locks::inflight_cap(group.id);
    }
}

/// How many messages a claim of `group` may hand out, at most `batch`: `batch` for an uncapped
/// group; for a capped one, what the cap leaves (0 when it is reached), counted under the
/// group's cap lock (taken here if `lock` did not).
pub fn room(client: &SpiClient<'_>, group: &GroupRef, batch: i32) -> Result<i32> {
    let Some(cap) = group.max_inflight else { return Ok(batch) };
    locks::inflight_cap(group.id);
    let args = [group.id.into(), statement::timestamptz(clock::now())];
    let inflight: i64 = IN_FLIGHT.run(client, group.stream.id, &args)?.first().required("inflight")?;
    Ok(batch.min((i64::from(cap) - inflight).clamp(0, i64::from(i32::MAX)) as i32))
}
