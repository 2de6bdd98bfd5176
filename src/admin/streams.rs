//! Creating, changing and dropping streams: `create_stream`, `alter_stream`, `drop_stream`.
//!
//! A stream's table family is defined in the versioned install script
//! (`sqlstreams.create_stream_tables`, sql/sqlstreams--<version>.sql), so every schema change is
//! a new version whose upgrade script migrates every existing stream.

use pgrx::pg_sys::{self, BuiltinOid::*};
use pgrx::prelude::*;

use crate::access;
use crate::error::named;
use crate::error::{Result, SqlResult, StreamError};
use crate::locks;
use crate::names::{stream_period, validate_name};
use crate::statement::{self, Access, Columns, Statement};
use crate::stream::{find, lookup};
use crate::text::Text;

const INSERT: Statement = Statement {
    name: "stream_insert",
    sql: "INSERT INTO sqlstreams.stream (name, partition_size, partitions_through, idempotency_ttl, schema_version, lanes)
          SELECT $1, $2, 1, make_interval(secs => $3 / 1e6), e.extversion, $4
          FROM pg_catalog.pg_extension e WHERE e.extname = 'sqlstreams'
          ON CONFLICT (name) DO NOTHING
          RETURNING id",
    params: &[TEXTOID, INT8OID, INT8OID, INT4OID],
};

const CREATE_TABLES: Statement =
    Statement { name: "stream_create_tables", sql: "SELECT sqlstreams.create_stream_tables($1)", params: &[INT8OID] };

const DROP_TABLES: Statement =
    Statement { name: "stream_drop_tables", sql: "SELECT sqlstreams.drop_stream_tables($1)", params: &[INT8OID] };

const SET_TTL: Statement = Statement {
    name: "stream_set_ttl",
    sql: "UPDATE sqlstreams.stream SET idempotency_ttl = make_interval(secs => $2 / 1e6)
          WHERE id = $1 AND idempotency_ttl <> make_interval(secs => $2 / 1e6)",
    params: &[INT8OID, INT8OID],
};

/// The stream's catalog rows: its groups and grants first (no foreign key deletes them: a
/// parallel restore could not load the catalog tables with one, sqlstreams--0.2.0.sql).
const DELETE: Statement = Statement {
    name: "stream_delete",
    sql: "WITH g AS (DELETE FROM sqlstreams.consumer_group WHERE stream_id = $1),
               r AS (DELETE FROM sqlstreams.stream_grant WHERE stream_id = $1)
          DELETE FROM sqlstreams.stream WHERE id = $1",
    params: &[INT8OID],
};

/// Groups and grants of stream `$1` that the newest snapshot still sees: after `DELETE`, those
/// committed after the caller's snapshot (REPEATABLE READ), which it did not delete.
const LEFT_BEHIND: Statement = Statement {
    name: "stream_left_behind",
    sql: "SELECT (SELECT count(*) FROM sqlstreams.consumer_group WHERE stream_id = $1)
               + (SELECT count(*) FROM sqlstreams.stream_grant WHERE stream_id = $1)",
    params: &[INT8OID],
};

/// Creates the stream and its table family, or returns the id of the existing stream of that
/// name. The family is created in the caller's transaction, by `sqlstreams.create_stream_tables`.
pub fn create(name: &str, partition_size: i64, idempotency_ttl_micros: i64, lanes: i32) -> Result<i64> {
    access::as_owner(|caller| {
        Spi::connect_mut(|client| {
            caller.require_admin(client, "create streams")?;
            // A drop of the name in progress ends first: then the name is free.
            locks::stream_shared(name, true);
            // A size out of range only refuses a new stream: declaring an existing one (perhaps
            // from before the range) with its own size still returns its id.
            let inserted: Option<i64> = if PARTITION_SIZES.contains(&partition_size) {
                let rows = INSERT.run(
                    client,
                    0,
                    &[name.into(), partition_size.into(), idempotency_ttl_micros.into(), lanes.into()],
                )?;
                if rows.is_empty() {
                    None
                } else {
                    rows.first().value("id")?
                }
            } else {
                None
            };
            // No row: the name exists (ON CONFLICT DO NOTHING), or the size is out of range.
            let Some(id) = inserted else {
                let existing = match lookup(client, name) {
                    Err(StreamError::UnknownStream(_)) => return Err(invalid_partition_size(partition_size)),
                    other => other?,
                };
                if existing.partition_size != partition_size {
                    return Err(StreamError::invalid(
                        format!(
                            "stream {} already exists with partition_size {}, not {partition_size}",
                            named(name),
                            existing.partition_size
                        ),
                        format!(
                            "Declare it with partition_size => {} (a stream's partitioning cannot change).",
                            existing.partition_size
                        ),
                    ));
                }
                if existing.lanes != lanes {
                    return Err(StreamError::invalid(
                        format!("stream {} already exists with {} lanes, not {lanes}", named(name), existing.lanes),
                        format!(
                            "Declare it with lanes => {} (every key's lane depends on it, so it cannot change).",
                            existing.lanes
                        ),
                    ));
                }
                SET_TTL.run(client, 0, &[existing.id.into(), idempotency_ttl_micros.into()])?;
                return Ok(existing.id);
            };
            crate::quiet::touch(id);
            CREATE_TABLES.run(client, 0, &[id.into()])?;
            Ok(id)
        })
    })
}

const LOCK_FOR_DROP: Statement = Statement {
    name: "stream_lock_for_drop",
    sql: "SELECT 1 FROM sqlstreams.stream WHERE name = $1 FOR UPDATE",
    params: &[TEXTOID],
};

/// Drops the stream, its groups and its table family. False when no such stream exists.
pub fn drop(name: &str) -> Result<bool> {
    access::as_owner(|caller| {
        Spi::connect_mut(|client| {
            caller.require_admin(client, "drop streams")?;
            // The stream's lock first, exclusive: it waits for every call on the stream in
            // progress, and a call arriving now waits for this drop, then finds the stream
            // gone. Then its row, so that a concurrent drop under REPEATABLE READ fails to
            // serialize rather than drop twice.
            locks::stream_exclusive(name);
            let stream = match find(client, name, Access::Write) {
                Ok(stream) => stream,
                Err(StreamError::UnknownStream(_)) => return Ok(false),
                Err(other) => return Err(other),
            };
            LOCK_FOR_DROP.run(client, 0, &[name.into()])?;
            DROP_TABLES.run(client, 0, &[stream.id.into()])?;
            DELETE.run(client, 0, &[stream.id.into()])?;
            // The catalog has no foreign keys (a parallel restore loads it in any order), so no
            // cascade fails here for a group created after this transaction's snapshot.
            let left = LEFT_BEHIND.read_newest(client, 0, &[pg_sys::Datum::from(stream.id)])?;
            if left.first().and_then(|row| row[0]).unwrap_or(0) > 0 {
                return Err(StreamError::SerializationFailure {
                    message: format!(
                        "stream {} got a group or grant after this transaction's snapshot was taken",
                        named(name)
                    ),
                    hint: "Retry the transaction (or drop the stream in READ COMMITTED).".into(),
                });
            }
            statement::forget_stream(stream.id);
            crate::lanes::forget(stream.id);
            Ok(true)
        })
    })
}

/// Valid `partition_size`s for a new stream: with fewer ids per partition, producers would
/// spend their time creating partitions (a batch of 5,000 would create thousands); past a
/// trillion, partition bounds overflow long before the stream could fill one.
pub const PARTITION_SIZES: std::ops::RangeInclusive<i64> = 1_000..=1_000_000_000_000;

fn invalid_partition_size(size: i64) -> StreamError {
    StreamError::invalid(
        format!("partition_size {size} is not valid"),
        format!(
            "Pass between {} and {} message ids per partition, such as 1000000.",
            PARTITION_SIZES.start(),
            PARTITION_SIZES.end()
        ),
    )
}

/// How many lanes a stream may have.
pub const LANES: std::ops::RangeInclusive<i32> = 1..=1024;

/// Creates a stream and its tables; returns its id. Idempotent by name: declaring an existing
/// stream returns its id (and updates its idempotency_ttl); a different partition_size or lane
/// count is refused.
#[pg_extern(volatile, parallel_unsafe, sql = false)]
fn create_stream(
    name: Option<Text<'_>>,
    partition_size: default!(Option<i64>, 1000000),
    idempotency_ttl: default!(Option<Interval>, "'1 day'"),
    lanes: default!(Option<i32>, 16),
) -> SqlResult<i64> {
    crate::standby::refuse_writes("create_stream")?;
    let name = validate_name("stream", name.as_deref())?;
    let Some(partition_size) = partition_size else {
        return Err(StreamError::invalid(
            "partition_size must not be NULL",
            "Pass the message ids per partition, such as 1000000.",
        )
        .into());
    };
    let lanes = match lanes {
        Some(n) if LANES.contains(&n) => n,
        other => {
            return Err(StreamError::invalid(
                format!("lanes {} is not valid", other.map_or("NULL".into(), |n| n.to_string())),
                format!(
                    "Pass between {} and {} lanes, such as 16 (at least as many as the consumers of one group).",
                    LANES.start(),
                    LANES.end()
                ),
            )
            .into())
        }
    };
    let ttl = stream_period("idempotency_ttl", idempotency_ttl.map(|i| i.as_micros()), "'1 day'")?;
    Ok(create(name, partition_size, ttl, lanes)?)
}

/// Drops a stream with its groups, messages and exception queue. Returns false when no stream
/// of that name exists.
#[pg_extern(volatile, parallel_unsafe, sql = false)]
fn drop_stream(name: Option<Text<'_>>) -> SqlResult<bool> {
    crate::standby::refuse_writes("drop_stream")?;
    let name = validate_name("stream", name.as_deref())?;
    Ok(drop(name)?)
}

const ALTER: Statement = Statement {
    name: "stream_alter",
    sql: "UPDATE sqlstreams.stream
          SET dead_retention = coalesce(make_interval(secs => $2 / 1e6), dead_retention),
              idempotency_ttl = coalesce(make_interval(secs => $3 / 1e6), idempotency_ttl),
              max_age = CASE WHEN $4 IS NULL THEN max_age WHEN $4 = 0 THEN NULL
                             ELSE make_interval(secs => $4 / 1e6) END,
              max_bytes = CASE WHEN $5 IS NULL THEN max_bytes WHEN $5 = 0 THEN NULL ELSE $5 END
          WHERE id = $1",
    params: &[INT8OID, INT8OID, INT8OID, INT8OID, INT8OID],
};

/// Changes a stream's settings: each argument that is not NULL replaces the current value.
/// `dead_retention`: how long dead and superseded exception rows are kept (retention).
/// `max_age`, `max_bytes`: the stream's bounds (src/bounds.rs); 0 removes one. Returns true.
/// Admins only.
#[pg_extern(volatile, parallel_unsafe, sql = false)]
fn alter_stream(
    name: Option<Text<'_>>,
    dead_retention: default!(Option<Interval>, "NULL"),
    idempotency_ttl: default!(Option<Interval>, "NULL"),
    max_age: default!(Option<Interval>, "NULL"),
    max_bytes: default!(Option<i64>, "NULL"),
) -> SqlResult<bool> {
    crate::standby::refuse_writes("alter_stream")?;
    let name = validate_name("stream", name.as_deref())?;
    let retention =
        dead_retention.map(|i| stream_period("dead_retention", Some(i.as_micros()), "'7 days'")).transpose()?;
    let ttl = idempotency_ttl.map(|i| stream_period("idempotency_ttl", Some(i.as_micros()), "'1 day'")).transpose()?;
    let max_age = max_age
        .map(|i| match i.as_micros() {
            0 => Ok(0),
            micros => stream_period("max_age", Some(micros), "'30 days' (or '0' for no bound)"),
        })
        .transpose()?;
    if max_bytes.is_some_and(|b| b < 0) {
        return Err(StreamError::invalid(
            format!("max_bytes must not be negative, not {}", max_bytes.unwrap_or_default()),
            "Pass a size in bytes such as 10737418240 (10 GB), or 0 for no bound.",
        )
        .into());
    }
    Ok(access::as_owner(|caller| {
        Spi::connect_mut(|client| {
            caller.require_admin(client, "alter streams")?;
            let stream = lookup(client, name)?;
            ALTER.run(
                client,
                0,
                &[stream.id.into(), retention.into(), ttl.into(), max_age.into(), max_bytes.into()],
            )?;
            Ok(true)
        })
    })?)
}
