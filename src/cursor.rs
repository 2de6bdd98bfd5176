//! A group's cursor: `claimed`, `committed`, and the claim fence's stored observation.
//!
//! `committed` is derived, not counted: every id at or below it is resolved when no open range
//! starts at or below it and no unresolved exception row holds it. Claims store it (they hold
//! the cursor row's lock anyway) and `maintain()` stores it for idle groups; `greatest()` keeps
//! it from ever moving backward. Outcomes (`ack`, `fail`) never touch the cursor row, so they
//! never wait on a claim.

use pgrx::pg_sys::BuiltinOid::*;
use pgrx::spi::SpiClient;

use crate::error::Result;
use crate::fence::Observation;
use crate::statement::{Access, Columns, Statement};

#[derive(Clone, Copy, Debug)]
pub struct Cursor {
    pub claimed: i64,
    pub committed: i64,
    pub observation: Option<Observation>,
}

/// The highest id at or below which everything is resolved, for group `$1` whose `claimed` is
/// the SQL expression `$claimed`.
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

const READ: Statement = Statement {
    name: "cursor_read",
    sql: "SELECT claimed, committed, fence_head, fence_xid FROM sqlstreams.cursor_@id@ WHERE consumer_group_id = $1",
    params: &[INT8OID],
};

const READ_LOCKED: Statement = Statement {
    name: "cursor_read_locked",
    sql: "SELECT claimed, committed, fence_head, fence_xid FROM sqlstreams.cursor_@id@
          WHERE consumer_group_id = $1 FOR UPDATE",
    params: &[INT8OID],
};

const STORE: Statement = Statement {
    name: "cursor_store",
    sql: concat!(
        "UPDATE sqlstreams.cursor_@id@
         SET claimed = $2, fence_head = $3, fence_xid = $4,
             committed = greatest(committed, ",
        committed_now!("$2"),
        ")
         WHERE consumer_group_id = $1"
    ),
    params: &[INT8OID, INT8OID, INT8OID, INT8OID],
};

const ADVANCE: Statement = Statement {
    name: "cursor_advance",
    sql: concat!(
        "UPDATE sqlstreams.cursor_@id@ c SET committed = n.committed
         FROM (SELECT ",
        committed_now!("$2"),
        " AS committed) n
         WHERE c.consumer_group_id = $1 AND n.committed > c.committed AND c.claimed = $2
         RETURNING c.committed"
    ),
    params: &[INT8OID, INT8OID],
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

/// Reads the cursor; with `lock`, also locks it until the transaction ends (serializing the
/// claims of one group).
pub fn read(client: &SpiClient<'_>, stream_id: i64, group_id: i64, lock: bool) -> Result<Cursor> {
    let statement = if lock { &READ_LOCKED } else { &READ };
    let row = statement.run(client, stream_id, &[group_id.into()])?.first();
    let head: Option<i64> = row.value("fence_head")?;
    let xid: Option<i64> = row.value("fence_xid")?;
    Ok(Cursor {
        claimed: row.required("claimed")?,
        committed: row.required("committed")?,
        observation: head.zip(xid).map(|(head, xid)| Observation { head, xid: xid as u64 }),
    })
}

/// Stores `claimed` and the fence observation, and advances `committed`.
pub fn store(
    client: &SpiClient<'_>,
    stream_id: i64,
    group_id: i64,
    claimed: i64,
    observation: Option<Observation>,
) -> Result<()> {
    STORE.run(
        client,
        stream_id,
        &[
            group_id.into(),
            claimed.into(),
            observation.map(|o| o.head).into(),
            observation.map(|o| o.xid as i64).into(),
        ],
    )?;
    Ok(())
}

/// Advances `committed` of an idle group whose cursor reads `claimed`; returns the new value
/// when it moved.
pub fn advance(client: &SpiClient<'_>, stream_id: i64, group_id: i64, claimed: i64) -> Result<Option<i64>> {
    let rows = ADVANCE.run(client, stream_id, &[group_id.into(), claimed.into()])?;
    if rows.is_empty() {
        return Ok(None);
    }
    rows.first().value("committed")
}

/// The highest message id handed out so far (0 when none).
pub fn sequence_head(client: &SpiClient<'_>, stream_id: i64, access: Access) -> Result<i64> {
    SEQUENCE_HEAD.exec(client, stream_id, &[], access)?.first().required("head")
}
