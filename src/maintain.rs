//! `maintain()`: the periodic housekeeping, as one idempotent function. Nothing depends on it
//! for correctness (claims advance cursors, produce creates partitions); running it from cron
//! or a worker keeps that work off the hot paths and stores `committed` for idle groups.

use pgrx::pg_sys::panic::ErrorReport;
use pgrx::pg_sys::BuiltinOid::*;
use pgrx::prelude::*;

use crate::cursor;
use crate::error::Result;
use crate::partition;
use crate::statement::{Access, Columns, Statement};
use crate::stream;

const STREAMS: Statement =
    Statement { name: "maintain_streams", sql: "SELECT name FROM sqlstreams.stream ORDER BY id", params: &[] };

const GROUPS: Statement = Statement {
    name: "maintain_groups",
    sql: "SELECT id FROM sqlstreams.consumer_group WHERE stream_id = $1 ORDER BY id",
    params: &[INT8OID],
};

// SKIP LOCKED: a group whose cursor a claim holds is being advanced by that claim already.
const LOCK_CURSOR: Statement = Statement {
    name: "maintain_lock_cursor",
    sql: "SELECT claimed FROM sqlstreams.cursor_@id@ WHERE consumer_group_id = $1 FOR UPDATE SKIP LOCKED",
    params: &[INT8OID],
};

/// Expired exclusive-key leases of consumers that never came back. An expired lease frees its
/// key either way; this keeps `open_leases` honest. Rows a claim is taking over are skipped.
const SWEEP_KEY_LEASES: Statement = Statement {
    name: "maintain_sweep_key_leases",
    sql: "DELETE FROM sqlstreams.message_key_lease_@id@
          WHERE (consumer_group_id, message_key) IN (
              SELECT consumer_group_id, message_key FROM sqlstreams.message_key_lease_@id@
              WHERE lease_expires_at <= now() FOR UPDATE SKIP LOCKED)",
    params: &[],
};

const PURGE_IDEMPOTENCY: Statement = Statement {
    name: "maintain_purge_idempotency",
    sql: "DELETE FROM sqlstreams.idempotency_key_@id@ WHERE expires_at <= now()",
    params: &[],
};

/// Per stream: (name, partitions through, idempotency keys purged, cursors advanced, expired
/// key leases swept).
fn maintain_all() -> Result<Vec<(String, i64, i64, i64, i64)>> {
    Spi::connect_mut(|client| {
        let mut names = Vec::new();
        for row in STREAMS.run(client, 0, &[])? {
            names.push(row.required::<String>("name")?);
        }
        let mut report = Vec::new();
        for name in names {
            let stream = stream::lookup(client, &name)?;
            let head = cursor::sequence_head(client, stream.id, Access::Write)?;
            partition::ensure(client, &stream, head)?;
            let through = stream::lookup(client, &name)?.partitions_through;
            let purged = PURGE_IDEMPOTENCY.run(client, stream.id, &[])?.len() as i64;
            let swept = SWEEP_KEY_LEASES.run(client, stream.id, &[])?.len() as i64;
            let mut groups = Vec::new();
            for row in GROUPS.run(client, 0, &[stream.id.into()])? {
                groups.push(row.required::<i64>("id")?);
            }
            let mut advanced = 0;
            for group in groups {
                let locked = LOCK_CURSOR.run(client, stream.id, &[group.into()])?.first();
                if locked.is_empty() {
                    continue;
                }
                let claimed: i64 = locked.required("claimed")?;
                if cursor::advance(client, stream.id, group, claimed)?.is_some() {
                    advanced += 1;
                }
            }
            report.push((name, through, purged, advanced, swept));
        }
        Ok(report)
    })
}

/// Housekeeping for every stream: creates message_log partitions ahead of the head, purges
/// expired idempotency keys, stores each idle group's committed cursor, and removes expired
/// exclusive-key leases. Idempotent; safe to run from cron at any frequency.
#[pg_extern(volatile, parallel_unsafe)]
fn maintain() -> std::result::Result<
    TableIterator<
        'static,
        (
            name!(stream, String),
            name!(partitions_through, i64),
            name!(idempotency_keys_purged, i64),
            name!(cursors_advanced, i64),
            name!(key_leases_swept, i64),
        ),
    >,
    ErrorReport,
> {
    Ok(TableIterator::new(maintain_all()?))
}
