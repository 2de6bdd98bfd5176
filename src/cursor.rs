//! A group's cursor (`cursor_<id>`): `claimed`, `committed`, and the claim fence.
//!
//! With lanes (src/lanes.rs) each lane has its own position, so the group's values are derived:
//! - `claimed`: every id at or below it has been handed out: below the fence's safe head and
//!   below the first message a lane has not handed out yet;
//! - `committed`: every id at or below it is resolved: at most `claimed`, below the first
//!   message of an open range, and below the lowest unresolved exception row.
//!
//! `group_status` computes both live; `maintain()` stores them, and `greatest()` keeps
//! `committed` from moving backward: only a seek and a redrive (src/admin/dead_letters.rs) move
//! the stored value back. Claims do not write them: claims of different lanes
//! never wait for one row. The fence is stored here too (src/fence.rs), and claims update it
//! only when they can take the row without waiting.

use pgrx::pg_sys;
use pgrx::pg_sys::BuiltinOid::*;
use pgrx::spi::SpiClient;

use crate::error::Result;
use crate::fence::{Fence, Observation};
use crate::lanes;
use crate::message;
use crate::partition::{self, Log};
use crate::statement::{Access, Columns, Statement};
use crate::stream::StreamRef;

/// The highest id at or below which everything is resolved, for group `$1` that has handed
/// out everything up to the SQL expression `$claimed` (`lanes::claimed_through`): below the
/// first message of an open range and the lowest unresolved exception row.
macro_rules! committed_now {
    ($claimed:literal) => {
        concat!(
            "least(",
            $claimed,
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

/// Locks group `$1`'s cursor row unless another transaction has it, and reads its fence.
const LOCK: Statement = Statement {
    name: "cursor_lock",
    sql: "SELECT fence_safe FROM sqlstreams.cursor_@id@ WHERE consumer_group_id = $1 FOR UPDATE SKIP LOCKED",
    params: &[INT8OID],
};

/// Stores `claimed` (`$2`, as it is now) and `committed`; `maintain()` runs it for every group.
const ADVANCE: Statement = Statement {
    name: "cursor_advance",
    sql: concat!(
        "UPDATE sqlstreams.cursor_@id@ c
         SET committed = n.committed, claimed = greatest(n.committed, n.claimed)
         FROM (SELECT greatest(c0.committed, ",
        committed_now!("$2"),
        ") AS committed, greatest(c0.claimed, $2) AS claimed
               FROM sqlstreams.cursor_@id@ c0 WHERE c0.consumer_group_id = $1) n
         WHERE c.consumer_group_id = $1
           AND (n.committed > c.committed OR greatest(n.committed, n.claimed) <> c.claimed)
         RETURNING c.committed"
    ),
    params: &[INT8OID, INT8OID],
};

/// The highest message id handed out so far (0 when none), as a SQL expression: read under the
/// sequence's buffer lock (src/head.rs says why a `SELECT last_value` is not enough).
macro_rules! head_sql {
    () => {
        "sqlstreams.log_head(@id@)"
    };
}
pub(crate) use head_sql;

/// The head as inspection reports it: on a primary the sequence's; on a hot standby the
/// statement's parameter `$replayed`, which `replayed_head` computes. A claim or maintain() never
/// runs on a standby.
macro_rules! observed_head_sql {
    ($replayed:literal) => {
        concat!(
            "(CASE WHEN NOT pg_catalog.pg_is_in_recovery() THEN ",
            $crate::cursor::head_sql!(),
            " ELSE ",
            $replayed,
            "::int8 END)"
        )
    };
}
pub(crate) use observed_head_sql;

const OBSERVED_HEAD: Statement = Statement {
    name: "cursor_observed_head",
    sql: concat!("SELECT ", observed_head_sql!("$1"), " AS head"),
    params: &[INT8OID],
};

/// What bounds the head on a standby: the sequence from above, the groups' positions from below.
const REPLAY_BOUNDS: Statement = Statement {
    name: "cursor_replay_bounds",
    sql: concat!(
        "SELECT ",
        head_sql!(),
        " AS ceiling,
                greatest((SELECT max(greatest(claimed, fence_safe)) FROM sqlstreams.cursor_@id@),
                         (SELECT max(claimed) FROM sqlstreams.lane_@id@), 0) AS floor"
    ),
    params: &[],
};

/// The group's stored fence (read without a lock).
pub fn read_fence(client: &SpiClient<'_>, stream_id: i64, group_id: i64, access: Access) -> Result<Fence> {
    fence_from(&READ_FENCE.exec(client, stream_id, &[group_id.into()], access)?.first())
}

/// The group's stored fence, then the highest message id handed out and the oid of the sequence
/// it was read from, for a claim (src/fence.rs: the order is the proof): the cursor row is read in
/// its statement's snapshot, and the head after that statement, so what the row shows was stored
/// before the head was read.
pub fn read_fence_and_head(client: &SpiClient<'_>, stream_id: i64, group_id: i64) -> Result<(Fence, i64, pg_sys::Oid)> {
    let fence = read_fence(client, stream_id, group_id, Access::Write)?;
    let (head, sequence) = crate::head::read_with_sequence(stream_id)?;
    Ok((fence, head, sequence))
}

fn fence_from(row: &impl Columns) -> Result<Fence> {
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
/// when anything moved. Skipped when another transaction holds the cursor row (a claim storing
/// its fence, another step): it never waits.
///
/// The cursor row is locked before the lanes are read: a `seek` moves the lanes back and then
/// takes the cursor row, so it either committed before (the lanes read are its) or waits for
/// this transaction (and then overwrites what it stores). Reading the lanes first could store a
/// position from before a seek that committed meanwhile, and retention would drop what the
/// replay needs.
pub fn advance(client: &SpiClient<'_>, stream: &StreamRef, group_id: i64) -> Result<Option<i64>> {
    let row = LOCK.run(client, stream.id, &[group_id.into()])?;
    if row.is_empty() {
        return Ok(None);
    }
    let safe: i64 = row.first().required("fence_safe")?;
    let claimed = lanes::claimed_through(client, stream, group_id, safe, Access::Write)?;
    let rows = ADVANCE.run(client, stream.id, &[group_id.into(), claimed.into()])?;
    if rows.is_empty() {
        return Ok(None);
    }
    rows.first().value("committed")
}

/// The head for inspection (`observed_head_sql!`), in the caller's snapshot.
pub fn observed_head(client: &SpiClient<'_>, stream: &StreamRef) -> Result<i64> {
    observed_head_of(client, stream.id, replayed_head(client, stream)?)
}

/// `observed_head` given `replayed_head`'s answer.
pub fn observed_head_of(client: &SpiClient<'_>, stream_id: i64, replayed: Option<i64>) -> Result<i64> {
    OBSERVED_HEAD.exec(client, stream_id, &[replayed.into()], Access::Read)?.first().required("head")
}

/// Whether this is a hot standby.
pub fn in_recovery() -> bool {
    // SAFETY: reads shared recovery state.
    unsafe { pg_sys::RecoveryInProgress() }
}

/// On a hot standby, the highest id it has replayed (`None` on a primary): the newest message of
/// the log, or a position some group has claimed through or proven safe (ids of rolled-back
/// producers have no message), whichever is higher. There the sequence reads what the primary
/// logged ahead of the ids it handed out (up to 32 more), so no message is above it: the
/// partitions are read from its one down, each lane's newest message above the positions, until
/// one has any, no lower than the oldest partition kept. So the read does not grow with the
/// partitions kept.
pub fn replayed_head(client: &SpiClient<'_>, stream: &StreamRef) -> Result<Option<i64>> {
    if !in_recovery() {
        return Ok(None);
    }
    let bounds = REPLAY_BOUNDS.exec(client, stream.id, &[], Access::Read)?.first();
    let (floor, ceiling): (i64, i64) = (bounds.required("floor")?, bounds.required("ceiling")?);
    if ceiling > floor {
        let log = Log::open(stream)?;
        // Partitions below the oldest kept were dropped: the walk stops there.
        let Some(oldest) = log.oldest(client, Access::Read)? else { return Ok(Some(floor)) };
        let lowest = partition::of(stream, floor + 1).max(oldest);
        for part in (lowest..=partition::of(stream, ceiling)).rev() {
            if !log.exists(client, part)? {
                continue;
            }
            if let Some((newest, _)) = message::newest(client, stream, part, floor, Access::Read)? {
                return Ok(Some(newest));
            }
        }
    }
    Ok(Some(floor))
}
