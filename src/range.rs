//! Range leases: the ids one claim handed out together, under one token and expiry.
//!
//! A range's row lists the messages it handed out (`pending`, with their keys alongside for the
//! ordered check of other claims), and is written only when a claim leases it. An outcome
//! leaves the row as it is and adds a row per message it resolved to `range_done_<id>`, under
//! the range's lease token; the range is deleted, with those rows, once every message has one,
//! which lets cursor advancement pass it. A range handed out again gets a new token, so an
//! outcome row only ever counts for the lease it answered, even one left behind. So an outcome writes what it resolved, not the whole range again, and
//! the range table gets one row version per lease however many outcomes there are: what reads
//! it (`group_status`, a claim's look for expired ranges) does not step over a dead version
//! per outcome until vacuum comes.
//!
//! Which messages are resolved is read after the range's row is locked, with the newest
//! snapshot: every outcome that held that lock has committed by then, and its rows are seen
//! whatever the caller's isolation level (an outcome may run under REPEATABLE READ). The one
//! exception, an ack of a whole claim under READ COMMITTED (`resolve_covered`), reads them in
//! its statement's snapshot, taken after the token's lock.

use foldhash::HashSet;

use pgrx::datum::DatumWithOid;
use pgrx::pg_sys::BuiltinOid::*;
use pgrx::spi::SpiClient;
use pgrx::{pg_sys, IntoDatum};

use crate::error::Result;
use crate::message::Address;
use crate::statement::{self, Access, Columns, Statement};
use crate::token;

#[derive(Clone, Debug, Default, PartialEq)]
pub struct RangeLease {
    /// The range's first message (its key among the group's ranges).
    pub first_id: i64,
    pub last_id: i64,
    pub reclaims: i32,
    /// The range's messages that have no outcome yet.
    pub pending: Vec<i64>,
    pub pending_keys: Vec<Option<String>>,
    /// The lane every message of the range is in.
    pub lane: i32,
    /// Messages removed from `pending` since the range was read, not stored yet.
    resolved: Vec<i64>,
}

impl RangeLease {
    /// A fresh range of `lane`: its messages are set as the claim hands them out.
    pub fn new(first_id: i64, last_id: i64, lane: i32) -> RangeLease {
        RangeLease { first_id, last_id, lane, ..Default::default() }
    }

    /// Where in the log its pending messages are.
    pub fn addresses(&self) -> Vec<Address> {
        self.pending.iter().map(|&id| Address { lane: self.lane, id }).collect()
    }

    /// Removes `ids` from `pending`; returns the removed (id, key) pairs in id order.
    pub fn remove(&mut self, ids: &[i64]) -> Vec<(i64, Option<String>)> {
        let mut removed = Vec::new();
        let mut kept_ids = Vec::with_capacity(self.pending.len());
        let mut kept_keys = Vec::with_capacity(self.pending.len());
        for (id, key) in self.pending.drain(..).zip(self.pending_keys.drain(..)) {
            if ids.contains(&id) {
                removed.push((id, key));
            } else {
                kept_ids.push(id);
                kept_keys.push(key);
            }
        }
        self.pending = kept_ids;
        self.pending_keys = kept_keys;
        self.resolved.extend(removed.iter().map(|(id, _)| *id));
        removed
    }

    /// Leaves out of `pending` the messages `done` lists (stored outcomes).
    fn forget(&mut self, done: &HashSet<i64>) {
        if done.is_empty() {
            return;
        }
        let (pending, pending_keys) = self
            .pending
            .iter()
            .zip(&self.pending_keys)
            .filter(|(id, _)| !done.contains(id))
            .map(|(id, k)| (*id, k.clone()))
            .unzip();
        self.pending = pending;
        self.pending_keys = pending_keys;
    }

    /// Splits off the pending messages after the first `keep`, as a range of their own that
    /// starts at the first of them and ends where this one did; this one ends before it.
    pub fn split_off(&mut self, keep: usize) -> RangeLease {
        let pending = self.pending.split_off(keep);
        let pending_keys = self.pending_keys.split_off(keep);
        let rest = RangeLease {
            first_id: pending[0],
            last_id: self.last_id,
            reclaims: self.reclaims,
            pending,
            pending_keys,
            lane: self.lane,
            resolved: vec![],
        };
        self.last_id = rest.first_id - 1;
        rest
    }

    /// Pending messages of `key` after `after`, in id order.
    pub fn pending_after(&self, key: &str, after: i64) -> Vec<i64> {
        self.pending
            .iter()
            .zip(&self.pending_keys)
            .filter(|(id, k)| **id > after && k.as_deref() == Some(key))
            .map(|(id, _)| *id)
            .collect()
    }
}

const FOR_TOKEN: Statement = Statement {
    name: "range_for_token",
    sql: "SELECT first_id, last_id, lease_token, reclaims, pending, pending_keys, lane FROM sqlstreams.range_lease_@id@
          WHERE consumer_group_id = $1 AND lease_token = $2 ORDER BY first_id FOR UPDATE",
    params: &[INT8OID, UUIDOID],
};

/// The lane's oldest expired range after `$4` (`$5`: one a consumer holds, not one left to no
/// one).
macro_rules! oldest_expired {
    ($($held:expr),*) => {
        concat!(
            "SELECT first_id, last_id, lease_token, reclaims, pending, pending_keys, lane FROM sqlstreams.range_lease_@id@
             WHERE consumer_group_id = $1 AND lease_expires_at <= $2 AND lane = $3 AND first_id > $4",
            $($held,)*
            " ORDER BY first_id LIMIT 1 FOR UPDATE SKIP LOCKED"
        )
    };
}

const OLDEST_EXPIRED: Statement = Statement {
    name: "range_oldest_expired",
    sql: oldest_expired!(),
    params: &[INT8OID, TIMESTAMPTZOID, INT4OID, INT8OID],
};

const OLDEST_EXPIRED_HELD: Statement = Statement {
    name: "range_oldest_expired_held",
    sql: oldest_expired!(" AND ", crate::token::held_by_a_consumer!("lease_token")),
    params: &[INT8OID, TIMESTAMPTZOID, INT4OID, INT8OID],
};

/// The messages resolved under token `$2`.
const DONE: Statement = Statement {
    name: "range_done",
    sql: "SELECT message_id FROM sqlstreams.range_done_@id@ WHERE consumer_group_id = $1 AND lease_token = $2",
    params: &[INT8OID, UUIDOID],
};

/// Range `$2`'s row taken over under a new token: a CTE that deletes the outcomes stored under
/// its old token, before `$statement`, which writes the new one.
macro_rules! forget_old_outcomes {
    ($statement:expr) => {
        concat!(
            "WITH old AS (SELECT lease_token, pending FROM sqlstreams.range_lease_@id@
                          WHERE consumer_group_id = $1 AND first_id = $2),
                  done AS (DELETE FROM sqlstreams.range_done_@id@ d USING old
                           WHERE d.consumer_group_id = $1 AND d.lease_token = old.lease_token
                             AND d.message_id = ANY(old.pending)) ",
            $statement
        )
    };
}

/// A new range, or an expired one handed out again (its row is locked by `oldest_expired`)
/// with what is still pending, under a new token: the outcomes stored under the old one go.
const LEASE: Statement = Statement {
    name: "range_lease",
    sql: forget_old_outcomes!(
        "INSERT INTO sqlstreams.range_lease_@id@
             (consumer_group_id, first_id, last_id, lease_token, lease_expires_at, reclaims, pending, pending_keys, lane)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)
         ON CONFLICT (consumer_group_id, first_id) DO UPDATE
         SET last_id = EXCLUDED.last_id, lease_token = EXCLUDED.lease_token, lease_expires_at = EXCLUDED.lease_expires_at,
             reclaims = EXCLUDED.reclaims, pending = EXCLUDED.pending, pending_keys = EXCLUDED.pending_keys"
    ),
    params: &[INT8OID, INT8OID, INT8OID, UUIDOID, TIMESTAMPTZOID, INT4OID, INT8ARRAYOID, TEXTARRAYOID, INT4OID],
};

/// Range `$2`, expired and taken over without being handed out (`leave`): its messages still
/// pending `$4` with their keys `$5` under token `$3`, which no consumer holds, and its old
/// expiry, as a split's rest keeps it; the outcomes stored under the old token go.
const LEAVE: Statement = Statement {
    name: "range_leave",
    sql: forget_old_outcomes!(
        "UPDATE sqlstreams.range_lease_@id@ SET lease_token = $3, pending = $4, pending_keys = $5
         WHERE consumer_group_id = $1 AND first_id = $2"
    ),
    params: &[INT8OID, INT8OID, UUIDOID, INT8ARRAYOID, TEXTARRAYOID],
};

/// The rest of range `$2` as a range of its own (`split_off`), under token `$6`, which no
/// consumer holds, and its old expiry: taken over from the consumer whose lease ran out (its
/// outcomes and `extend_lease` find it no more), it waits, expired, for the next claim.
const SPLIT: Statement = Statement {
    name: "range_split",
    sql: "INSERT INTO sqlstreams.range_lease_@id@
              (consumer_group_id, first_id, last_id, lease_token, lease_expires_at, reclaims, pending, pending_keys, lane)
          SELECT consumer_group_id, $3, last_id, $6, lease_expires_at, reclaims, $4, $5, lane
          FROM sqlstreams.range_lease_@id@ WHERE consumer_group_id = $1 AND first_id = $2",
    params: &[INT8OID, INT8OID, INT8OID, INT8ARRAYOID, TEXTARRAYOID, UUIDOID],
};

/// Inserts a range handed out for the first time (`$1` … `$9` as `LEASE_NEW`'s).
macro_rules! insert_new {
    () => {
        "INSERT INTO sqlstreams.range_lease_@id@
             (consumer_group_id, first_id, last_id, lease_token, lease_expires_at, reclaims, pending, pending_keys, lane)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)"
    };
}
pub(crate) use insert_new;

/// A range handed out for the first time: no row of it exists (its messages lie past the lane's
/// position, past every range of the lane), so it is inserted without `LEASE`'s look for one.
const LEASE_NEW: Statement = Statement {
    name: "range_lease_new",
    sql: insert_new!(),
    params: &[INT8OID, INT8OID, INT8OID, UUIDOID, TIMESTAMPTZOID, INT4OID, INT8ARRAYOID, TEXTARRAYOID, INT4OID],
};

/// Outcomes of messages `$3`, delivered under token `$2`.
const ADD_DONE: Statement = Statement {
    name: "range_add_done",
    sql: "INSERT INTO sqlstreams.range_done_@id@ (consumer_group_id, lease_token, message_id)
          SELECT $1, $2, unnest($3::int8[])",
    params: &[INT8OID, UUIDOID, INT8ARRAYOID],
};

const DELETE: Statement = Statement {
    name: "range_delete",
    sql: "WITH r AS (DELETE FROM sqlstreams.range_lease_@id@ WHERE consumer_group_id = $1 AND first_id = $2
                     RETURNING lease_token, pending)
          DELETE FROM sqlstreams.range_done_@id@ d USING r
          WHERE d.consumer_group_id = $1 AND d.lease_token = r.lease_token AND d.message_id = ANY(r.pending)",
    params: &[INT8OID, INT8OID],
};

/// `DELETE_TOKEN`'s text, with `$lanes`, a further part of the statement, `$keys_column`, the
/// keys it returns for a range `r`, and `$one`, the one row the result is joined to, whose
/// `lanes` column returns what the further part did (`END_HOLDS_WITH_RANGES` in
/// src/lanes/holds.rs; NULL without `$one`).
macro_rules! delete_token {
    ($lanes:expr, $keys_column:expr) => {
        $crate::range::delete_token!($lanes, $keys_column, "SELECT NULL::int4[] AS lanes")
    };
    ($lanes:expr, $keys_column:expr, $one:expr) => {
        concat!(
            "WITH r AS (DELETE FROM sqlstreams.range_lease_@id@ WHERE consumer_group_id = $1 AND lease_token = $2
                        RETURNING pending, pending_keys, lane),
                  d AS (DELETE FROM sqlstreams.range_done_@id@ d USING r
                        WHERE d.consumer_group_id = $1 AND d.lease_token = $2 AND d.message_id = ANY(r.pending)
                        RETURNING d.message_id)",
            $lanes,
            "
             SELECT r.pending, ",
            $keys_column,
            " AS pending_keys, ARRAY(SELECT message_id FROM d) AS done, one.lanes FROM (",
            $one,
            ") AS one LEFT JOIN r ON true"
        )
    };
}
pub(crate) use delete_token;

/// Every range under token `$2`, deleted with the outcomes stored under the token for them,
/// which it returns (`resolve_covered`). It locks the token's rows in the token index's order,
/// not `FOR_TOKEN`'s: only outcomes of the same token wait for them (claims and bounds skip
/// locked rows, a seek holds the group), and the token's lock runs those one at a time.
const DELETE_TOKEN: Statement =
    Statement { name: "range_delete_token", sql: delete_token!("", "r.pending_keys"), params: &[INT8OID, UUIDOID] };

/// Outcomes no open range refers to any more: left by a transaction whose snapshot did not see
/// them when it deleted their range (REPEATABLE READ). They are never read (their token leases
/// nothing any more); `maintain()` deletes them.
const PURGE_DONE: Statement = Statement {
    name: "range_purge_done",
    sql: "DELETE FROM sqlstreams.range_done_@id@ d
          WHERE NOT EXISTS (SELECT 1 FROM sqlstreams.range_lease_@id@ r
                            WHERE r.consumer_group_id = d.consumer_group_id AND r.lease_token = d.lease_token
                              AND d.message_id = ANY(r.pending))",
    params: &[],
};

fn from_row<R: Columns>(row: &R) -> Result<(pgrx::Uuid, RangeLease)> {
    let range = RangeLease {
        first_id: row.required("first_id")?,
        last_id: row.required("last_id")?,
        reclaims: row.required("reclaims")?,
        pending: row.required("pending")?,
        pending_keys: row.required("pending_keys")?,
        lane: row.required("lane")?,
        resolved: vec![],
    };
    Ok((row.required("lease_token")?, range))
}

/// `ranges` leased under `token`, just locked, without the messages that have an outcome,
/// read now (see the module documentation).
fn without_done(
    client: &SpiClient<'_>,
    stream_id: i64,
    group_id: i64,
    token: pgrx::Uuid,
    mut ranges: Vec<RangeLease>,
) -> Result<Vec<RangeLease>> {
    if ranges.is_empty() {
        return Ok(ranges);
    }
    let args = [group_id.into_datum(), token.into_datum()].map(|arg| arg.expect("not NULL"));
    let done: HashSet<i64> = DONE.read_newest(client, stream_id, &args)?.into_iter().filter_map(|row| row[0]).collect();
    for range in &mut ranges {
        range.forget(&done);
    }
    Ok(ranges)
}

/// The open ranges one token holds (a claim leases one range per lane it takes), as an outcome
/// sees them: what it removes is stored by `store`.
pub struct Ranges {
    token: pgrx::Uuid,
    ranges: Vec<RangeLease>,
}

impl Ranges {
    pub fn contains(&self, id: i64) -> bool {
        self.ranges.iter().any(|r| r.pending.contains(&id))
    }

    /// Where in the log the pending messages `ids` are (those pending in one of the ranges).
    pub fn addresses(&self, ids: &[i64]) -> Vec<Address> {
        self.ranges
            .iter()
            .flat_map(|r| r.pending.iter().filter(|id| ids.contains(id)).map(|&id| Address { lane: r.lane, id }))
            .collect()
    }

    /// Removes `ids` from whichever range holds them; returns the removed (id, key) pairs.
    pub fn remove(&mut self, ids: &[i64]) -> Vec<(i64, Option<String>)> {
        let mut removed: Vec<_> = self.ranges.iter_mut().flat_map(|range| range.remove(ids)).collect();
        removed.sort_unstable_by_key(|(id, _)| *id);
        removed
    }

    /// Pending messages of `key` after `after`, in id order (a key's messages are all in its
    /// lane's range).
    pub fn pending_after(&self, key: &str, after: i64) -> Vec<i64> {
        let mut ids: Vec<i64> = self.ranges.iter().flat_map(|r| r.pending_after(key, after)).collect();
        ids.sort_unstable();
        ids
    }

    /// Stores what an outcome resolved: a row per message, or, for a range with nothing
    /// pending any more, the range's deletion.
    pub fn store(&mut self, client: &SpiClient<'_>, stream_id: i64, group_id: i64) -> Result<()> {
        for range in self.ranges.iter_mut().filter(|r| !r.resolved.is_empty()) {
            let resolved = std::mem::take(&mut range.resolved);
            if range.pending.is_empty() {
                delete(client, stream_id, group_id, range.first_id)?;
            } else {
                ADD_DONE.run(client, stream_id, &[group_id.into(), self.token.into(), resolved.into()])?;
            }
        }
        Ok(())
    }
}

/// The open ranges leased under `token`, locked, for an outcome. A lease that expired but was
/// not taken over still counts. A claim that took an expired range over while this waited for
/// its lock gave it a token of its own, or one no consumer holds (the rest it split off:
/// `split`; a range it had no room for: `leave`): neither is read. Nor is anything under such a
/// token, whoever names it.
pub fn for_token(client: &SpiClient<'_>, stream_id: i64, group_id: i64, token: pgrx::Uuid) -> Result<Ranges> {
    if token::is_no_ones(token) {
        return Ok(Ranges { token, ranges: vec![] });
    }
    let ranges: Vec<RangeLease> = FOR_TOKEN
        .run(client, stream_id, &[group_id.into(), token.into()])?
        .map(|row| Ok(from_row(&row)?.1))
        .collect::<Result<_>>()?;
    Ok(Ranges { token, ranges: without_done(client, stream_id, group_id, token, ranges)? })
}

/// What `resolve_covered` resolved.
pub struct Covered {
    /// The messages resolved now, with their keys when the statement returned them: not while
    /// the group had no parked row, for a lane whose hold it ended (`END_HOLDS_WITH_RANGES`) or
    /// any lane (`DELETE_TOKEN_KEYS_IF_PARKED` in src/exception_queue/lifecycle.rs).
    pub resolved: Vec<(i64, Option<String>)>,
    /// Every message of the ranges deleted: those resolved now, and those an earlier outcome
    /// under the token had resolved (whose outcome now is "lease lost").
    pub answered: HashSet<i64>,
    /// The lane holds the statement ended, when it was asked to (`end_holds`).
    pub released: Option<Released>,
}

/// Lane holds an outcome ended while deleting its token's ranges.
pub struct Released {
    /// Sorted. No claim can park rows of their keys before this transaction ends
    /// (`exception_queue::Waker::HeldLanes`).
    pub lanes: Vec<i32>,
}

/// Resolves the ranges under `token` whole, in one statement, for an outcome of `ids` that
/// covers them (`may_cover`): an ack carrying every message its claim handed out from ranges
/// (the common case) deletes their rows instead of locking, reading and deleting them in three.
///
/// Only under READ COMMITTED, with the token's lock held (`locks::token`): every earlier
/// outcome under the token has then committed before the statement's snapshot is taken, so
/// the outcomes it stored are seen and deleted with their ranges (the module documentation says
/// why the general path reads them apart). A range another claim handed out again meanwhile
/// has another token when its row's lock is granted, and is left alone. The resolved messages'
/// keys are read `with_keys` only: a group that parks nothing wakes nothing by key.
///
/// `instead`, a statement run instead of `DELETE_TOKEN` that returns the same columns:
/// - `lanes::end_holds_with_ranges`, when the token's claim put no row in flight: once its
///   ranges are gone nothing of it is left unresolved, and the statement also ends the holds of
///   its lanes (in its `lanes` column). A lane another claim took over meanwhile has another
///   holder when its row's lock is granted, and is left alone. The keys resolved in the lanes it
///   did end take no lock before their wake-up (`Released`; docs/semantics.md, "One lock order",
///   outcome step 4).
/// - `exception_queue::DELETE_TOKEN_KEYS_IF_PARKED`, which returns the keys only while the group
///   has a parked row.
pub fn resolve_covered(
    client: &SpiClient<'_>,
    stream_id: i64,
    group_id: i64,
    token: pgrx::Uuid,
    with_keys: bool,
    instead: Option<Instead>,
) -> Result<Covered> {
    let mut covered = Covered { resolved: vec![], answered: HashSet::default(), released: None };
    let Instead { statement, lanes } = instead.unwrap_or(Instead { statement: &DELETE_TOKEN, lanes: None });
    let mut args = vec![group_id.into(), token.into()];
    args.extend(lanes.map(DatumWithOid::from));
    let rows = statement.exec_deformed(client, stream_id, &args, Access::Write)?;
    let mut released_lanes = None;
    for (pending, keys, done, lanes) in rows.map(|row| {
        let keys: Option<Vec<Option<String>>> = if with_keys { row.get(2)? } else { None };
        let done: HashSet<i64> = row.get::<Vec<i64>>(3)?.unwrap_or_default().into_iter().collect();
        Ok((row.get::<Vec<i64>>(1)?.unwrap_or_default(), keys, done, row.get::<Vec<i32>>(4)?))
    })? {
        // Every row carries the lanes (and one row comes when no range was left).
        released_lanes = released_lanes.or(lanes);
        covered.answered.extend(&pending);
        let keys = keys.unwrap_or_else(|| vec![None; pending.len()]);
        covered.resolved.extend(pending.into_iter().zip(keys).filter(|(id, _)| !done.contains(id)));
    }
    covered.released = released_lanes.map(|mut lanes| {
        lanes.sort_unstable();
        Released { lanes }
    });
    Ok(covered)
}

/// A statement `resolve_covered` runs instead of `DELETE_TOKEN`, with the same columns and first
/// two parameters, and `lanes` as its third when it takes one.
pub struct Instead {
    pub statement: &'static Statement,
    pub lanes: Option<Vec<i32>>,
}

/// Whether `resolve_covered` may run for an outcome of `ids` under `token`: under READ
/// COMMITTED, when `ids` name every message this backend's claim of `token` handed out from
/// ranges (src/own_claims.rs). A range row under the token lists only messages the claim
/// handed out, so the outcome then resolves every range of the token; an ack of a part of a
/// claim, or of a claim made on another connection, takes the general path.
pub fn may_cover(token: pgrx::Uuid, ids: &[i64]) -> bool {
    // SAFETY: reading a backend-local setting.
    let read_committed = unsafe { pg_sys::XactIsoLevel } < pg_sys::XACT_REPEATABLE_READ as i32;
    read_committed && crate::own_claims::covers(token, ids)
}

/// Which expired ranges `oldest_expired` looks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Expired {
    Any,
    /// Held by a consumer: not one a claim took over and left to no one.
    Held,
}

/// The lane's oldest range whose lease has expired (after the one that starts at `after`),
/// locked (skipping one an outcome is recording), with the token it was leased under.
pub fn oldest_expired(
    client: &SpiClient<'_>,
    stream_id: i64,
    group_id: i64,
    lane: i32,
    now: i64,
    (after, which): (i64, Expired),
) -> Result<Option<(pgrx::Uuid, RangeLease)>> {
    let statement = if which == Expired::Held { &OLDEST_EXPIRED_HELD } else { &OLDEST_EXPIRED };
    let args = [group_id.into(), statement::timestamptz(now), lane.into(), after.into()];
    let row = statement.run(client, stream_id, &args)?.first();
    if row.is_empty() {
        return Ok(None);
    }
    let (token, range) = from_row(&row)?;
    if token::is_no_ones(token) {
        // No outcome is ever stored under such a token.
        return Ok(Some((token, range)));
    }
    Ok(without_done(client, stream_id, group_id, token, vec![range])?.pop().map(|range| (token, range)))
}

/// A range as a claim leases it: the messages it handed out from it, in id order, and their
/// keys (borrowed from the claim's deliveries) in place of the range's `pending` and
/// `pending_keys`, under the claim's token until its expiry.
pub struct Lease<'a> {
    pub range: &'a RangeLease,
    pub pending: &'a [i64],
    pub keys: &'a [Option<&'a str>],
    pub token: pgrx::Uuid,
    pub expires: i64,
}

/// Stores a claim's `lease`: a new range, or an expired one handed out again. A range with
/// nothing pending is not kept.
pub fn lease(client: &SpiClient<'_>, stream_id: i64, group_id: i64, lease: &Lease<'_>) -> Result<()> {
    let range = lease.range;
    if lease.pending.is_empty() {
        // A fresh range (no reclaims yet) was never stored.
        return if range.reclaims > 0 { delete(client, stream_id, group_id, range.first_id) } else { Ok(()) };
    }
    let statement = if range.reclaims == 0 { &LEASE_NEW } else { &LEASE };
    statement.run(client, stream_id, &lease_args(group_id, lease))?;
    Ok(())
}

/// The nine parameters of `LEASE`, `LEASE_NEW` and the first nine of
/// `lanes::STORE_WITH_NEW_RANGE`.
pub(crate) fn lease_args(group_id: i64, lease: &Lease<'_>) -> Vec<DatumWithOid<'static>> {
    let range = lease.range;
    // The table has no CHECK for it (the install script says why).
    debug_assert_eq!(lease.pending.len(), lease.keys.len(), "a key for each pending message");
    vec![
        group_id.into(),
        range.first_id.into(),
        range.last_id.into(),
        lease.token.into(),
        statement::timestamptz(lease.expires),
        range.reclaims.into(),
        lease.pending.into(),
        statement::text_array(lease.keys),
        range.lane.into(),
    ]
}

/// A `text[]` parameter of `keys`, without copying them first.
fn keys_arg(keys: &[Option<String>]) -> DatumWithOid<'static> {
    statement::text_array(&keys.iter().map(Option::as_deref).collect::<Vec<_>>())
}

/// Takes `expired` (its row locked by `oldest_expired`) over without handing it out: what is
/// still pending stays, expired (since its old expiry), under a new token that no consumer
/// holds (`token::no_ones`), for the next claim; the outcomes stored under the old token go. A
/// range with nothing pending is not kept.
pub fn leave(client: &SpiClient<'_>, stream_id: i64, group_id: i64, expired: &RangeLease) -> Result<()> {
    if expired.pending.is_empty() {
        return delete(client, stream_id, group_id, expired.first_id);
    }
    let args = [
        group_id.into(),
        expired.first_id.into(),
        token::no_ones().into(),
        expired.pending.as_slice().into(),
        keys_arg(&expired.pending_keys),
    ];
    // Its keys written as a claim writes them (src/claim.rs, `store`).
    crate::search_path::with_lz4_if(expired.pending_keys.iter().any(Option::is_some), || {
        LEAVE.run(client, stream_id, &args)?;
        Ok(())
    })
}

/// Stores `rest`, split off range `first_id` (see `RangeLease::split_off`), under `token`: a
/// new one that no consumer holds (`token::no_ones`).
pub fn split(
    client: &SpiClient<'_>,
    stream_id: i64,
    group_id: i64,
    first_id: i64,
    rest: &RangeLease,
    token: pgrx::Uuid,
) -> Result<()> {
    debug_assert_eq!(rest.pending.len(), rest.pending_keys.len(), "a key for each pending message");
    let args = [
        group_id.into(),
        first_id.into(),
        rest.first_id.into(),
        rest.pending.as_slice().into(),
        keys_arg(&rest.pending_keys),
        token.into(),
    ];
    // Its keys written as a claim writes them (src/claim.rs, `store`).
    crate::search_path::with_lz4_if(rest.pending_keys.iter().any(Option::is_some), || {
        SPLIT.run(client, stream_id, &args)?;
        Ok(())
    })
}

/// Deletes range `first_id` with the outcomes stored against it.
pub fn delete(client: &SpiClient<'_>, stream_id: i64, group_id: i64, first_id: i64) -> Result<()> {
    DELETE.run(client, stream_id, &[group_id.into(), first_id.into()])?;
    Ok(())
}

/// Deletes the outcomes no open range refers to (see `PURGE_DONE`); returns how many.
pub fn purge_done(client: &SpiClient<'_>, stream_id: i64) -> Result<usize> {
    Ok(PURGE_DONE.run(client, stream_id, &[])?.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn range() -> RangeLease {
        RangeLease {
            first_id: 101,
            last_id: 110,
            reclaims: 0,
            pending: vec![101, 102, 103, 105],
            pending_keys: vec![Some("a".into()), None, Some("a".into()), Some("b".into())],
            lane: 0,
            resolved: vec![],
        }
    }

    #[test]
    fn remove_returns_what_was_pending() {
        let mut r = range();
        let removed = r.remove(&[102, 103, 999]);
        assert_eq!(removed, vec![(102, None), (103, Some("a".into()))]);
        assert_eq!(r.pending, vec![101, 105]);
        assert_eq!(r.pending_keys, vec![Some("a".into()), Some("b".into())]);
        assert!(r.remove(&[102]).is_empty(), "a second outcome for the same message removes nothing");
        assert_eq!(r.resolved, vec![102, 103], "what is stored as the range's outcomes");
    }

    #[test]
    fn stored_outcomes_leave_pending() {
        let mut r = range();
        r.forget(&HashSet::from_iter([101, 105, 999]));
        assert_eq!(r.pending, vec![102, 103]);
        assert_eq!(r.pending_keys, vec![None, Some("a".into())]);
        assert!(r.resolved.is_empty(), "nothing to store: they were stored before");
    }

    #[test]
    fn pending_after_filters_by_key_and_id() {
        let r = range();
        assert_eq!(r.pending_after("a", 101), vec![103]);
        assert_eq!(r.pending_after("a", 100), vec![101, 103]);
        assert!(r.pending_after("c", 0).is_empty());
    }
}
