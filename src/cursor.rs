//! A group's cursor (`cursor_<id>`): `claimed`, `committed`, and the claim fence.
//!
//! With lanes (src/lanes.rs) each lane has its own position, so the group's values are derived:
//! - `claimed`: every id at or below it has been handed out: below the fence's safe head and
//!   below the first message a lane has not handed out yet;
//! - `committed`: every id at or below it is resolved: at most `claimed`, below the first
//!   message of an open range, and below the lowest unresolved exception row.
//!
//! `group_status` computes both live; `maintain()` stores them, and `greatest()` keeps
//! `committed` from ever moving backward. Claims do not write them: claims of different lanes
//! never wait for one row. The fence is stored here too (src/fence.rs), and claims update it
//! only when they can take the row without waiting.

use pgrx::pg_sys::BuiltinOid::*;
use pgrx::spi::SpiClient;

use crate::error::Result;
use crate::fence::{Fence, Observation};
use crate::statement::{Access, Columns, Statement};

/// The highest id at or below which everything is handed out, for group `$1` whose fence has
/// proven every id up to the SQL expression `$safe`: below the first message a lane has not
/// handed out yet (a lane with nothing new does not hold it back).
macro_rules! claimed_now {
    ($safe:literal) => {
        concat!(
            "least(",
            $safe,
            ",
               (SELECT min(n.id) - 1 FROM sqlstreams.lane_@id@ l
                CROSS JOIN LATERAL (SELECT m.id FROM sqlstreams.message_log_@id@ m
                                    WHERE (m.lane, m.id) > (l.lane, l.claimed) AND m.id > l.claimed
                                      AND (m.lane, m.id) <= (l.lane, ",
            $safe,
            ")
                                    ORDER BY m.lane, m.id LIMIT 1) n
                WHERE l.consumer_group_id = $1))"
        )
    };
}
pub(crate) use claimed_now;

/// The highest id at or below which everything is resolved, for group `$1` (see
/// `claimed_now`): below what is not handed out yet, the first message of an open range and the
/// lowest unresolved exception row.
macro_rules! committed_now {
    ($safe:literal) => {
        concat!(
            "least(",
            claimed_now!($safe),
            ",
               (SELECT min(first_id) - 1 FROM sqlstreams.range_lease_@id@ WHERE consumer_group_id = $1),
               (SELECT min(message_id) - 1 FROM sqlstreams.exception_queue_@id@
                WHERE consumer_group_id = $1 AND status IN ('ready', 'inflight', 'deferred')))"
        )
    };
}
pub(crate) use committed_now;

const READ_FENCE: Statement = Statement {
    name: "cursor_read_fence",
    sql: "SELECT fence_safe, fence_head, fence_xid FROM sqlstreams.cursor_@id@ WHERE consumer_group_id = $1",
    params: &[INT8OID],
};

/// Stores the fence unless another claim is storing it right now (it never goes back).
const STORE_FENCE: Statement = Statement {
    name: "cursor_store_fence",
    sql: "UPDATE sqlstreams.cursor_@id@ c
          SET fence_safe = greatest(c.fence_safe, $2), fence_head = $3, fence_xid = $4
          WHERE c.consumer_group_id = (SELECT consumer_group_id FROM sqlstreams.cursor_@id@
                                       WHERE consumer_group_id = $1 FOR UPDATE SKIP LOCKED)",
    params: &[INT8OID, INT8OID, INT8OID, INT8OID],
};

/// Stores `claimed` and `committed` as they are now; `maintain()` runs it for every group.
const ADVANCE: Statement = Statement {
    name: "cursor_advance",
    sql: concat!(
        "UPDATE sqlstreams.cursor_@id@ c
         SET committed = n.committed, claimed = greatest(n.committed, n.claimed)
         FROM (SELECT greatest(c0.committed, ",
        committed_now!("c0.fence_safe"),
        ") AS committed, greatest(c0.claimed, ",
        claimed_now!("c0.fence_safe"),
        ") AS claimed
               FROM sqlstreams.cursor_@id@ c0 WHERE c0.consumer_group_id = $1) n
         WHERE c.consumer_group_id = (SELECT consumer_group_id FROM sqlstreams.cursor_@id@
                                      WHERE consumer_group_id = $1 FOR UPDATE SKIP LOCKED)
           AND (n.committed > c.committed OR greatest(n.committed, n.claimed) <> c.claimed)
         RETURNING c.committed"
    ),
    params: &[INT8OID],
};

/// The highest message id handed out so far (0 when none), as a SQL expression.
macro_rules! head_sql {
    () => {
        "(SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM sqlstreams.message_log_@id@_seq)"
    };
}
pub(crate) use head_sql;

const SEQUENCE_HEAD: Statement =
    Statement { name: "cursor_sequence_head", sql: concat!("SELECT ", head_sql!(), " AS head"), params: &[] };

/// The group's stored fence (read without a lock).
pub fn read_fence(client: &SpiClient<'_>, stream_id: i64, group_id: i64) -> Result<Fence> {
    let row = READ_FENCE.run(client, stream_id, &[group_id.into()])?.first();
    let head: Option<i64> = row.value("fence_head")?;
    let xid: Option<i64> = row.value("fence_xid")?;
    Ok(Fence {
        safe: row.required("fence_safe")?,
        pending: head.zip(xid).map(|(head, xid)| Observation { head, xid: xid as u64 }),
    })
}

/// Stores the fence, unless another claim holds the row (a claim never waits): a skipped store
/// only means a later claim proves the same again.
pub fn store_fence(client: &SpiClient<'_>, stream_id: i64, group_id: i64, fence: Fence) -> Result<()> {
    STORE_FENCE.run(
        client,
        stream_id,
        &[
            group_id.into(),
            fence.safe.into(),
            fence.pending.map(|o| o.head).into(),
            fence.pending.map(|o| o.xid as i64).into(),
        ],
    )?;
    Ok(())
}

/// Stores the group's `claimed` and `committed` as they are now; returns the new `committed`
/// when anything moved.
pub fn advance(client: &SpiClient<'_>, stream_id: i64, group_id: i64) -> Result<Option<i64>> {
    let rows = ADVANCE.run(client, stream_id, &[group_id.into()])?;
    if rows.is_empty() {
        return Ok(None);
    }
    rows.first().value("committed")
}

/// The highest message id handed out so far (0 when none).
pub fn sequence_head(client: &SpiClient<'_>, stream_id: i64, access: Access) -> Result<i64> {
    SEQUENCE_HEAD.exec(client, stream_id, &[], access)?.first().required("head")
}
