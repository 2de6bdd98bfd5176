//! What a claim writes to a lane it took, its position and its hold, and how outcomes end holds
//! (src/lanes.rs says what a hold is), with the statements that write them together with the
//! token's ranges.

use pgrx::datum::DatumWithOid;
use pgrx::pg_sys::BuiltinOid::*;
use pgrx::spi::SpiClient;

use super::{holds, Lane};
use crate::error::Result;
use crate::group::GroupRef;
use crate::own_claims;
use crate::range::{self, Lease};
use crate::statement::{self, Columns, Statement};

/// The statement storing a lane of group `$1`: each argument is the SQL parameter (such as
/// `"$2"`) that holds the lane, its position, and its hold (token and expiry). For `STORE`, and
/// `STORE_WITH_NEW_RANGE` with a range's row.
macro_rules! store_sql {
    ($lane:literal, $claimed:literal, $held_by:literal, $held_until:literal) => {
        concat!(
            "UPDATE sqlstreams.lane_@id@ SET claimed = ",
            $claimed,
            ", held_by = ",
            $held_by,
            ", held_until = ",
            $held_until,
            " WHERE consumer_group_id = $1 AND lane = ",
            $lane
        )
    };
}

/// Ends group `$1`'s holds under token `$2` (the lanes as `l`): `RELEASE`, which adds its
/// conditions, and `END_HOLDS_WITH_RANGES`, with the deletion of the token's ranges.
macro_rules! end_holds {
    () => {
        "UPDATE sqlstreams.lane_@id@ l SET held_by = NULL, held_until = NULL
          WHERE l.consumer_group_id = $1 AND l.held_by = $2"
    };
}

/// `END_HOLDS_WITH_RANGES`, whose ranges in lanes it ends the token's holds on return no keys when
/// `$quiet` holds (an SQL condition): nothing of their keys waits to be woken.
macro_rules! end_holds_with_ranges {
    ($quiet:expr) => {
        range::delete_token!(
            concat!(", l AS (", end_holds!(), " AND l.lane = ANY($3) RETURNING l.lane)"),
            concat!("CASE WHEN r.lane = ANY(one.lanes) AND ", $quiet, " THEN NULL ELSE r.pending_keys END"),
            "SELECT coalesce(array_agg(lane), '{}') AS lanes FROM l"
        )
    };
}

const STORE: Statement = Statement {
    name: "lanes_store",
    sql: store_sql!("$2", "$3", "$4", "$5"),
    params: &[INT8OID, INT4OID, INT8OID, UUIDOID, TIMESTAMPTZOID],
};

/// A range handed out for the first time (`range::LEASE_NEW`, `$1` … `$9`), and its lane's new
/// position and hold (`STORE`: `$10` the position, `$11` and `$12` the hold) in one statement:
/// what most claims write.
const STORE_WITH_NEW_RANGE: Statement = Statement {
    name: "lanes_store_with_new_range",
    sql: concat!("WITH r AS (", range::insert_new!(), ") ", store_sql!("$9", "$10", "$11", "$12")),
    params: &[
        INT8OID,
        INT8OID,
        INT8OID,
        UUIDOID,
        TIMESTAMPTZOID,
        INT4OID,
        INT8ARRAYOID,
        TEXTARRAYOID,
        INT4OID,
        INT8OID,
        UUIDOID,
        TIMESTAMPTZOID,
    ],
};

/// Every range under token `$2` deleted (`range::DELETE_TOKEN`, with its columns), and the
/// token's lane holds ended (as `RELEASE`) in the same statement: for a claim that put no row in
/// flight, the token's ranges were all its work (`end_holds_with_ranges`). `$3` lists the lanes
/// the claim stored its hold on (src/own_claims.rs), so that only their rows are read: no other
/// lane is held under the token. Of those, `held_by = $2` ends the holds the token still has; a
/// lane another claim took over since has another holder, and is left alone.
///
/// A range whose lane it found still held by the token returns no keys while the group has no
/// parked row. No claim can have parked a row of those keys since the token's claim
/// (docs/semantics.md, "One lock order", outcome step 4), and every earlier parking, the token's
/// own claim's included, has committed and would be found by the probe: so there is nothing to
/// wake, and the ack skips reading, sorting and probing its keys.
const END_HOLDS_WITH_RANGES: Statement = Statement {
    name: "lanes_end_holds_with_ranges",
    sql: end_holds_with_ranges!(concat!("NOT ", crate::exception_queue::any_parked!())),
    params: &[INT8OID, UUIDOID, INT4ARRAYOID],
};

/// `END_HOLDS_WITH_RANGES` for a claim whose gate found nothing that could block a key and which
/// parked nothing (`own_claims::Facts::nothing_waited`): a row of a key of a lane still held by
/// the token can then have been parked only by an outcome of the token since (a failure parks
/// the rest of its chain), and every outcome of the token on a message of its ranges either left
/// a row in `range_done`, which the statement deletes, or resolved its range's last message and
/// deleted the range (which then has no row here). With none deleted, the keys are not returned,
/// and the group's parked rows are not probed (docs/semantics.md, outcome step 4).
const END_HOLDS_WITH_RANGES_NOTHING_WAITED: Statement = Statement {
    name: "lanes_end_holds_with_ranges_nothing_waited",
    sql: end_holds_with_ranges!("NOT EXISTS (SELECT FROM d)"),
    params: &[INT8OID, UUIDOID, INT4ARRAYOID],
};

/// Frees each lane token `$2` holds once nothing it handed out from that lane is unresolved.
/// It waits for a lane row another transaction has locked, never skips it: a claim that read
/// the lane free in an older snapshot keeps the row locked to the end of its (short)
/// transaction although it did not take it, and skipping would leave the hold until its
/// lease runs out.
const RELEASE: Statement = Statement {
    name: "lanes_release",
    sql: concat!(
        end_holds!(),
        "
            AND NOT EXISTS (SELECT 1 FROM sqlstreams.range_lease_@id@ r
                            WHERE r.consumer_group_id = $1 AND r.lease_token = $2
                              AND r.lane = l.lane)
            AND NOT EXISTS (SELECT 1 FROM sqlstreams.exception_queue_@id@ e
                            WHERE e.consumer_group_id = $1 AND e.lease_token = $2 AND e.status = 'inflight'
                              AND e.lane = l.lane)
          RETURNING l.lane"
    ),
    params: &[INT8OID, UUIDOID],
};

/// Stores the lane's new position and who holds it: `hold` is the claim's (token, expiry) when
/// it handed out ordered or exclusive work and the group holds lanes, `None` to leave it free.
/// A lane that did not move and is not held, before or after, is not written.
pub fn store(client: &SpiClient<'_>, group: &GroupRef, lane: Lane, hold: Option<(pgrx::Uuid, i64)>) -> Result<()> {
    let hold = hold_of(group, hold);
    if hold.is_none() && !lane.was_held && lane.claimed == lane.taken_at {
        return Ok(());
    }
    STORE.run(
        client,
        group.stream.id,
        &[group.id.into(), lane.lane.into(), lane.claimed.into(), hold_token(hold), hold_until(hold)],
    )?;
    Ok(())
}

/// Leases a range handed out for the first time, as `range::lease`, and stores its lane (at
/// position `claimed`, with `hold`) as `store` would, in one statement. Returns false, writing
/// nothing, for any other range: the caller then runs both.
pub fn store_with_new_range(
    client: &SpiClient<'_>,
    group: &GroupRef,
    lease: &Lease<'_>,
    claimed: i64,
    hold: Option<(pgrx::Uuid, i64)>,
) -> Result<bool> {
    if lease.range.reclaims != 0 || lease.pending.is_empty() {
        return Ok(false);
    }
    let hold = hold_of(group, hold);
    let mut args = range::lease_args(group.id, lease);
    args.extend([claimed.into(), hold_token(hold), hold_until(hold)]);
    STORE_WITH_NEW_RANGE.run(client, group.stream.id, &args)?;
    Ok(true)
}

/// A hold's token and expiry, as the parameters of `store_sql!`.
fn hold_token(hold: Option<(pgrx::Uuid, i64)>) -> DatumWithOid<'static> {
    hold.map(|(token, _)| token).into()
}

fn hold_until(hold: Option<(pgrx::Uuid, i64)>) -> DatumWithOid<'static> {
    statement::timestamptz_opt(hold.map(|(_, until)| until))
}

/// The hold a lane is stored with: none in a group that holds no lanes.
fn hold_of(group: &GroupRef, hold: Option<(pgrx::Uuid, i64)>) -> Option<(pgrx::Uuid, i64)> {
    hold.filter(|_| holds(group))
}

/// After outcomes under `token`: frees each lane it holds once everything it handed out there
/// is resolved. Returns the lanes freed. A token whose claim this backend made and which held
/// no lane holds none (src/own_claims.rs).
pub fn release(client: &SpiClient<'_>, group: &GroupRef, token: pgrx::Uuid) -> Result<Vec<i32>> {
    if !holds(group) || own_claims::facts(token).is_some_and(|f| !f.held_lanes) {
        return Ok(vec![]);
    }
    let rows = RELEASE.run(client, group.stream.id, &[group.id.into(), token.into()])?;
    rows.map(|row| row.required("lane")).collect()
}

/// The statement an ack that resolves every range of `token` (`range::resolve_covered`) runs to
/// end the token's lane holds with them, `END_HOLDS_WITH_RANGES`, with its parameter after the
/// group and the token: when the token is this backend's claim, which held a lane and put no
/// row in flight, so that its ranges were all it left unresolved. None otherwise (`release`
/// then runs after the outcome).
pub fn end_holds_with_ranges(group: &GroupRef, token: pgrx::Uuid) -> Option<range::Instead> {
    let facts = own_claims::facts(token).filter(|f| holds(group) && f.held_lanes && !f.rows_in_flight)?;
    let lanes = own_claims::held_lanes(token)?;
    let statement = if facts.nothing_waited { &END_HOLDS_WITH_RANGES_NOTHING_WAITED } else { &END_HOLDS_WITH_RANGES };
    Some(range::Instead { statement, lanes: Some(lanes) })
}
