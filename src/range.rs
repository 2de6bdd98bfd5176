//! Range leases: the ids one claim handed out together, under one token and expiry.
//!
//! `pending` lists the range's messages that have no outcome yet, with their keys alongside (for
//! the ordered check of other claims). An outcome removes its message; the row is deleted when
//! nothing is pending, which lets cursor advancement pass the range.

use pgrx::pg_sys::BuiltinOid::*;
use pgrx::spi::SpiClient;

use crate::error::Result;
use crate::statement::{self, Columns, Statement};

#[derive(Clone, Debug, PartialEq)]
pub struct RangeLease {
    /// The range's first message (its key among the group's ranges).
    pub first_id: i64,
    pub last_id: i64,
    pub reclaims: i32,
    pub pending: Vec<i64>,
    pub pending_keys: Vec<Option<String>>,
    /// `None` for a range claimed before lanes existed (it may hold messages of every lane).
    pub lane: Option<i32>,
}

impl RangeLease {
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
        removed
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
    sql: "SELECT first_id, last_id, reclaims, pending, pending_keys, lane FROM sqlstreams.range_lease_@id@
          WHERE consumer_group_id = $1 AND lease_token = $2 ORDER BY first_id FOR UPDATE",
    params: &[INT8OID, UUIDOID],
};

/// The lane's oldest expired range (a range from before lanes belongs to every lane).
const OLDEST_EXPIRED: Statement = Statement {
    name: "range_oldest_expired",
    sql: "SELECT first_id, last_id, reclaims, pending, pending_keys, lane FROM sqlstreams.range_lease_@id@
          WHERE consumer_group_id = $1 AND lease_expires_at <= $2 AND (lane = $3 OR lane IS NULL)
          ORDER BY first_id LIMIT 1 FOR UPDATE SKIP LOCKED",
    params: &[INT8OID, TIMESTAMPTZOID, INT4OID],
};

/// A new range, or an expired one handed out again (its row is locked by `oldest_expired`).
const LEASE: Statement = Statement {
    name: "range_lease",
    sql: "INSERT INTO sqlstreams.range_lease_@id@
              (consumer_group_id, first_id, last_id, lease_token, lease_expires_at, reclaims, pending, pending_keys, lane)
          VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)
          ON CONFLICT (consumer_group_id, first_id) DO UPDATE
          SET last_id = EXCLUDED.last_id, lease_token = EXCLUDED.lease_token, lease_expires_at = EXCLUDED.lease_expires_at,
              reclaims = EXCLUDED.reclaims, pending = EXCLUDED.pending, pending_keys = EXCLUDED.pending_keys",
    params: &[INT8OID, INT8OID, INT8OID, UUIDOID, TIMESTAMPTZOID, INT4OID, INT8ARRAYOID, TEXTARRAYOID, INT4OID],
};

/// The rest of range `$2` as a range of its own (`split_off`), under its old token and
/// expiry: still expired, it waits for the next claim.
const SPLIT: Statement = Statement {
    name: "range_split",
    sql: "INSERT INTO sqlstreams.range_lease_@id@
              (consumer_group_id, first_id, last_id, lease_token, lease_expires_at, reclaims, pending, pending_keys, lane)
          SELECT consumer_group_id, $3, last_id, lease_token, lease_expires_at, reclaims, $4, $5, lane
          FROM sqlstreams.range_lease_@id@ WHERE consumer_group_id = $1 AND first_id = $2",
    params: &[INT8OID, INT8OID, INT8OID, INT8ARRAYOID, TEXTARRAYOID],
};

const SET_PENDING: Statement = Statement {
    name: "range_set_pending",
    sql: "UPDATE sqlstreams.range_lease_@id@ SET pending = $3, pending_keys = $4
          WHERE consumer_group_id = $1 AND first_id = $2",
    params: &[INT8OID, INT8OID, INT8ARRAYOID, TEXTARRAYOID],
};

const DELETE: Statement = Statement {
    name: "range_delete",
    sql: "DELETE FROM sqlstreams.range_lease_@id@ WHERE consumer_group_id = $1 AND first_id = $2",
    params: &[INT8OID, INT8OID],
};

fn from_row<R: Columns>(row: &R) -> Result<RangeLease> {
    Ok(RangeLease {
        first_id: row.required("first_id")?,
        last_id: row.required("last_id")?,
        reclaims: row.required("reclaims")?,
        pending: row.required("pending")?,
        pending_keys: row.required("pending_keys")?,
        lane: row.value("lane")?,
    })
}

/// The open ranges one token holds (a claim leases one range per lane it takes), as an outcome
/// sees them: what it removes is stored by `store`.
#[derive(Default)]
pub struct Ranges {
    ranges: Vec<RangeLease>,
    changed: Vec<bool>,
}

impl Ranges {
    pub fn contains(&self, id: i64) -> bool {
        self.ranges.iter().any(|r| r.pending.contains(&id))
    }

    /// Removes `ids` from whichever range holds them; returns the removed (id, key) pairs.
    pub fn remove(&mut self, ids: &[i64]) -> Vec<(i64, Option<String>)> {
        let mut removed = Vec::new();
        for (range, changed) in self.ranges.iter_mut().zip(&mut self.changed) {
            let some = range.remove(ids);
            *changed |= !some.is_empty();
            removed.extend(some);
        }
        removed.sort_unstable_by_key(|(id, _)| *id);
        removed
    }

    /// Pending messages of `key` after `after`, in id order (a key's messages are all in its
    /// lane's range, or in a range claimed before lanes existed).
    pub fn pending_after(&self, key: &str, after: i64) -> Vec<i64> {
        let mut ids: Vec<i64> = self.ranges.iter().flat_map(|r| r.pending_after(key, after)).collect();
        ids.sort_unstable();
        ids
    }

    /// Stores the ranges an outcome changed (deleting those with nothing pending).
    pub fn store(&self, client: &SpiClient<'_>, stream_id: i64, group_id: i64) -> Result<()> {
        for (range, _) in self.ranges.iter().zip(&self.changed).filter(|(_, changed)| **changed) {
            store_pending(client, stream_id, group_id, range)?;
        }
        Ok(())
    }
}

/// The open ranges leased under `token`, locked.
pub fn for_token(client: &SpiClient<'_>, stream_id: i64, group_id: i64, token: pgrx::Uuid) -> Result<Ranges> {
    let ranges: Vec<RangeLease> = FOR_TOKEN
        .run(client, stream_id, &[group_id.into(), token.into()])?
        .map(|row| from_row(&row))
        .collect::<Result<_>>()?;
    Ok(Ranges { changed: vec![false; ranges.len()], ranges })
}

/// The lane's oldest range whose lease has expired, locked (skipping one an outcome is
/// recording).
pub fn oldest_expired(
    client: &SpiClient<'_>,
    stream_id: i64,
    group_id: i64,
    lane: i32,
    now: i64,
) -> Result<Option<RangeLease>> {
    let row =
        OLDEST_EXPIRED.run(client, stream_id, &[group_id.into(), statement::timestamptz(now), lane.into()])?.first();
    if row.is_empty() {
        return Ok(None);
    }
    from_row(&row).map(Some)
}

/// Leases `range` under `token` until `expires`: a new range, or an expired one handed out
/// again. A range with nothing pending is not kept.
pub fn lease(
    client: &SpiClient<'_>,
    stream_id: i64,
    group_id: i64,
    range: &RangeLease,
    token: pgrx::Uuid,
    expires: i64,
) -> Result<()> {
    if range.pending.is_empty() {
        // A fresh range (no reclaims yet) was never stored.
        return if range.reclaims > 0 { delete(client, stream_id, group_id, range.first_id) } else { Ok(()) };
    }
    LEASE.run(
        client,
        stream_id,
        &[
            group_id.into(),
            range.first_id.into(),
            range.last_id.into(),
            token.into(),
            statement::timestamptz(expires),
            range.reclaims.into(),
            range.pending.clone().into(),
            range.pending_keys.clone().into(),
            range.lane.into(),
        ],
    )?;
    Ok(())
}

/// Stores `rest`, split off range `first_id` (see `RangeLease::split_off`).
pub fn split(client: &SpiClient<'_>, stream_id: i64, group_id: i64, first_id: i64, rest: &RangeLease) -> Result<()> {
    SPLIT.run(
        client,
        stream_id,
        &[
            group_id.into(),
            first_id.into(),
            rest.first_id.into(),
            rest.pending.clone().into(),
            rest.pending_keys.clone().into(),
        ],
    )?;
    Ok(())
}

/// Stores what is still pending, deleting the range when nothing is.
fn store_pending(client: &SpiClient<'_>, stream_id: i64, group_id: i64, range: &RangeLease) -> Result<()> {
    if range.pending.is_empty() {
        return delete(client, stream_id, group_id, range.first_id);
    }
    SET_PENDING.run(
        client,
        stream_id,
        &[group_id.into(), range.first_id.into(), range.pending.clone().into(), range.pending_keys.clone().into()],
    )?;
    Ok(())
}

pub fn delete(client: &SpiClient<'_>, stream_id: i64, group_id: i64, first_id: i64) -> Result<()> {
    DELETE.run(client, stream_id, &[group_id.into(), first_id.into()])?;
    Ok(())
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
            lane: Some(0),
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
    }

    #[test]
    fn pending_after_filters_by_key_and_id() {
        let r = range();
        assert_eq!(r.pending_after("a", 101), vec![103]);
        assert_eq!(r.pending_after("a", 100), vec![101, 103]);
        assert!(r.pending_after("c", 0).is_empty());
    }
}
