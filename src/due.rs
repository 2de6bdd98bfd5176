//! When a group's waiting work falls due: what an idle consumer sleeps until. A produce, a
//! resolved blocker or a freed lane sends a NOTIFY (src/notify.rs); work that waits for a clock
//! sends nothing when its time comes: a retry's backoff, a delay, a `deliver_after`, a lease
//! that expires, a lane held until a time. `next_due` is the earliest of those times.

use pgrx::datum::TimestampWithTimeZone;
use pgrx::pg_sys::BuiltinOid::*;
use pgrx::prelude::*;
use pgrx::spi::SpiClient;

use crate::access;
use crate::error::{Result, SqlResult};
use crate::inspect::resolve;
use crate::statement::{Access, Columns, Statement};
use crate::text::Text;

/// The earliest `$column` of group `$1`'s queue rows (alias `e`) that match the predicate, among
/// those a claim could take: in a group whose lanes are held (`$3`), not in a lane another
/// delivery holds at `$2` (now). One probe of an index when the earliest row's lane is free;
/// otherwise one probe a free lane.
macro_rules! earliest_claimable {
    ($column:literal, $($predicate:tt)+) => {
        concat!(
            "(SELECT CASE WHEN NOT $3 OR NOT EXISTS (SELECT FROM sqlstreams.lane_@id@ l
                                                     WHERE l.consumer_group_id = $1 AND l.lane = f.lane
                                                       AND l.held_until > $2)
                          THEN f.t
                          ELSE (SELECT min(d.t) FROM sqlstreams.lane_@id@ l
                                CROSS JOIN LATERAL (
                                    SELECT e.", $column, " AS t FROM sqlstreams.exception_queue_@id@ e
                                    WHERE e.consumer_group_id = $1 AND e.lane = l.lane AND ", $($predicate)+, "
                                    ORDER BY e.lane, e.", $column, " LIMIT 1) d
                                WHERE l.consumer_group_id = $1 AND (l.held_until IS NULL OR l.held_until <= $2))
                     END
              FROM (SELECT e.lane, e.", $column, " AS t FROM sqlstreams.exception_queue_@id@ e
                    WHERE e.consumer_group_id = $1 AND ", $($predicate)+, "
                    ORDER BY e.", $column, " LIMIT 1) f)"
        )
    };
}

/// The earliest time a waiting row, lease or lane hold of group `$1` comes due; none for a
/// paused group, which `resume_group` wakes with a NOTIFY. A row parked behind a held dead row
/// waits for no time (`infinity`): what frees it notifies. A waiting row, an inflight row or a
/// range whose lease ran out, in a lane another delivery holds waits for the hold: its
/// `held_until`, or the outcomes that free it (which notify). Running range leases are one probe
/// of their index; expired ranges, as a rule none or a few (the next claim of their lane takes
/// them, and what it has no room for is left, expired, to the claim after it), are each looked
/// up with their lane. So after a consumer crashed holding lanes with
/// retries due in them, the others sleep until its holds run out, rather than claiming
/// nothing, again and again, until their poll interval.
const NEXT_DUE: Statement = Statement {
    name: "due_next",
    sql: concat!(
        "SELECT CASE WHEN g.paused THEN NULL ELSE least(",
        earliest_claimable!(
            "can_run_after",
            crate::exception_queue::waiting!("e"),
            " AND e.can_run_after < 'infinity'"
        ),
        ",
                ",
        earliest_claimable!("lease_expires_at", crate::exception_queue::in_flight!("e")),
        ",
                (SELECT r.lease_expires_at FROM sqlstreams.range_lease_@id@ r
                 WHERE r.consumer_group_id = $1 AND r.lease_expires_at > $2 ORDER BY r.lease_expires_at LIMIT 1),
                (SELECT min(greatest(r.lease_expires_at, l.held_until)) FROM sqlstreams.range_lease_@id@ r
                 LEFT JOIN sqlstreams.lane_@id@ l
                   ON $3 AND l.consumer_group_id = $1 AND l.lane = r.lane AND l.held_until > $2
                 WHERE r.consumer_group_id = $1 AND r.lease_expires_at <= $2),
                (SELECT min(held_until) FROM sqlstreams.lane_@id@
                 WHERE consumer_group_id = $1 AND held_by IS NOT NULL)) END AS due
          FROM sqlstreams.consumer_group g WHERE g.id = $1"
    ),
    params: &[INT8OID, TIMESTAMPTZOID, BOOLOID],
};

/// `NEXT_DUE` for a quiet claim (src/quiet.rs): the earliest of those times after `$2` (now).
/// What is due already and was not claimable waits for a later time (a lane hold) or for a
/// transaction; a paused group's claim never asks.
const UNTIL: Statement = Statement {
    name: "due_until",
    sql: concat!(
        "SELECT least(
              (SELECT e.can_run_after FROM sqlstreams.exception_queue_@id@ e
               WHERE e.consumer_group_id = $1 AND ",
        crate::exception_queue::waiting!("e"),
        " AND e.can_run_after > $2 ORDER BY e.can_run_after LIMIT 1),
              (SELECT e.lease_expires_at FROM sqlstreams.exception_queue_@id@ e
               WHERE e.consumer_group_id = $1 AND ",
        crate::exception_queue::in_flight!("e"),
        " AND e.lease_expires_at > $2 ORDER BY e.lease_expires_at LIMIT 1),
              (SELECT r.lease_expires_at FROM sqlstreams.range_lease_@id@ r
               WHERE r.consumer_group_id = $1 AND r.lease_expires_at > $2 ORDER BY r.lease_expires_at LIMIT 1),
              (SELECT min(l.held_until) FROM sqlstreams.lane_@id@ l
               WHERE l.consumer_group_id = $1 AND l.held_until > $2)) AS until"
    ),
    params: &[INT8OID, TIMESTAMPTZOID],
};

/// The earliest time after `now` that anything of group `group_id` falls due without a
/// transaction changing it, for a claim that found nothing; `i64::MAX` when nothing waits.
pub fn until(client: &SpiClient<'_>, stream_id: i64, group_id: i64, now: i64) -> Result<i64> {
    let args = [group_id.into(), crate::statement::timestamptz(now)];
    let due: Option<TimestampWithTimeZone> = UNTIL.run(client, stream_id, &args)?.first().value("until")?;
    Ok(due.map_or(i64::MAX, i64::from))
}

/// The earliest time something of the group waits for: a retry or delayed row (`ready`,
/// `deferred`), an expiring lease or lane hold; NULL when nothing waits for a time (or the group
/// is paused). A time already past means work is due now. Needs the inspect right.
#[pg_extern(stable, parallel_safe, sql = false)]
fn next_due(stream: Option<Text<'_>>, group_name: Option<Text<'_>>) -> SqlResult<Option<TimestampWithTimeZone>> {
    Ok(access::as_owner(|caller| {
        Spi::connect(|client| {
            let group = resolve(client, caller, stream.as_deref(), group_name.as_deref())?;
            let (now, holds) = (crate::statement::timestamptz(crate::clock::now()), crate::lanes::holds(&group));
            let args = [group.id.into(), now, holds.into()];
            NEXT_DUE.exec(client, group.stream.id, &args, Access::Read)?.first().value("due")
        })
    })?)
}
