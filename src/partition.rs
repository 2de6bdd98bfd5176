//! Partitions of `message_log_<id>`: blocks of `partition_size` ids, created ahead of the head.
//!
//! A new partition is created as a plain table and then attached: ATTACH PARTITION takes only a
//! SHARE UPDATE EXCLUSIVE lock on the parent, which does not block producers or claims, while
//! CREATE TABLE ... PARTITION OF would take an ACCESS EXCLUSIVE lock until the creating
//! transaction commits. Creation is serialized per stream by locking the stream's catalog row.

use pgrx::pg_sys::BuiltinOid::*;
use pgrx::spi::SpiClient;

use crate::error::Result;
use crate::statement::{self, Statement};
use crate::stream::StreamRef;

const LOCK_STREAM: Statement = Statement {
    name: "partition_lock_stream",
    sql: "SELECT partitions_through FROM sqlstreams.stream WHERE id = $1 FOR UPDATE",
    params: &[INT8OID],
};

const SET_THROUGH: Statement = Statement {
    name: "partition_set_through",
    sql: "UPDATE sqlstreams.stream SET partitions_through = $2 WHERE id = $1",
    params: &[INT8OID, INT8OID],
};

/// Whether message id `id` is close enough to the end of the partitions to add more.
/// Half a partition of headroom keeps producers from ever reaching a missing partition.
pub fn needs_more(stream: &StreamRef, id: i64) -> bool {
    id.saturating_add(headroom(stream.partition_size)) >= stream.partitions_through
}

fn headroom(partition_size: i64) -> i64 {
    (partition_size / 2).max(1)
}

/// Makes sure partitions cover every id up to `id` plus headroom. Cheap when they already do.
pub fn ensure(client: &mut SpiClient<'_>, stream: &StreamRef, id: i64) -> Result<()> {
    if !needs_more(stream, id) {
        return Ok(());
    }
    let mut through: i64 = LOCK_STREAM.run(client, 0, &[stream.id.into()])?.first().get(1)?.expect("stream row");
    let target = id.saturating_add(headroom(stream.partition_size));
    let start = through;
    while through <= target {
        let index = (through - 1) / stream.partition_size;
        let from = index * stream.partition_size + 1;
        let to = from + stream.partition_size;
        // Only numbers reach this SQL text.
        let ddl = statement::render(
            &format!(
                "CREATE TABLE sqlstreams.message_log_@id@_p{index}
                     (LIKE sqlstreams.message_log_@id@ INCLUDING DEFAULTS INCLUDING CONSTRAINTS);
                 ALTER TABLE sqlstreams.message_log_@id@ ATTACH PARTITION sqlstreams.message_log_@id@_p{index}
                     FOR VALUES FROM ({from}) TO ({to});"
            ),
            stream.id,
        );
        client.update(ddl.as_str(), None, &[])?;
        through = to;
    }
    if through != start {
        SET_THROUGH.run(client, 0, &[stream.id.into(), through.into()])?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stream(partition_size: i64, partitions_through: i64) -> StreamRef {
        StreamRef { id: 1, partition_size, partitions_through }
    }

    #[test]
    fn headroom_is_half_a_partition() {
        let s = stream(1000, 1001); // one partition: ids 1..=1000
        assert!(!needs_more(&s, 499));
        assert!(needs_more(&s, 501));
        assert!(needs_more(&s, 5000));
        let tiny = stream(1, 2);
        assert!(needs_more(&tiny, 1));
    }
}
