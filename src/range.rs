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
    pub first_id: i64,
    pub last_id: i64,
    pub reclaims: i32,
    pub pending: Vec<i64>,
    pub pending_keys: Vec<Option<String>>,
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
    sql: "SELECT first_id, last_id, reclaims, pending, pending_keys FROM sqlstreams.range_lease_@id@
          WHERE consumer_group_id = $1 AND lease_token = $2 FOR UPDATE",
    params: &[INT8OID, UUIDOID],
};

const OLDEST_EXPIRED: Statement = Statement {
    name: "range_oldest_expired",
    sql: "SELECT first_id, last_id, reclaims, pending, pending_keys FROM sqlstreams.range_lease_@id@
          WHERE consumer_group_id = $1 AND lease_expires_at <= $2
          ORDER BY first_id LIMIT 1 FOR UPDATE SKIP LOCKED",
    params: &[INT8OID, TIMESTAMPTZOID],
};

/// A new range, or an expired one handed out again (its row is locked by `oldest_expired`).
const LEASE: Statement = Statement {
    name: "range_lease",
    sql: "INSERT INTO sqlstreams.range_lease_@id@
              (consumer_group_id, first_id, last_id, lease_token, lease_expires_at, reclaims, pending, pending_keys)
          VALUES ($1, $2, $3, $4, $5, $6, $7, $8)
          ON CONFLICT (consumer_group_id, first_id) DO UPDATE
          SET lease_token = EXCLUDED.lease_token, lease_expires_at = EXCLUDED.lease_expires_at,
              reclaims = EXCLUDED.reclaims, pending = EXCLUDED.pending, pending_keys = EXCLUDED.pending_keys",
    params: &[INT8OID, INT8OID, INT8OID, UUIDOID, TIMESTAMPTZOID, INT4OID, INT8ARRAYOID, TEXTARRAYOID],
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

fn from_row(row: pgrx::spi::SpiTupleTable<'_>) -> Result<Option<RangeLease>> {
    if row.is_empty() {
        return Ok(None);
    }
    Ok(Some(RangeLease {
        first_id: row.required("first_id")?,
        last_id: row.required("last_id")?,
        reclaims: row.required("reclaims")?,
        pending: row.required("pending")?,
        pending_keys: row.required("pending_keys")?,
    }))
}

/// The open range leased under `token`, locked.
pub fn for_token(
    client: &SpiClient<'_>,
    stream_id: i64,
    group_id: i64,
    token: pgrx::Uuid,
) -> Result<Option<RangeLease>> {
    from_row(FOR_TOKEN.run(client, stream_id, &[group_id.into(), token.into()])?.first())
}

/// The oldest range whose lease has expired, locked (skipping one an outcome is recording).
pub fn oldest_expired(client: &SpiClient<'_>, stream_id: i64, group_id: i64, now: i64) -> Result<Option<RangeLease>> {
    from_row(OLDEST_EXPIRED.run(client, stream_id, &[group_id.into(), statement::timestamptz(now)])?.first())
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
        ],
    )?;
    Ok(())
}

/// Stores what is still pending, deleting the range when nothing is.
pub fn store_pending(client: &SpiClient<'_>, stream_id: i64, group_id: i64, range: &RangeLease) -> Result<()> {
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
