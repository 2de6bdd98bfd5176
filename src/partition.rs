//! Partitions of `message_log_<id>`: blocks of `partition_size` ids, created ahead of the head
//! by `sqlstreams.add_partitions` (the DDL lives in the versioned install script).

use pgrx::pg_sys::BuiltinOid::*;
use pgrx::spi::SpiClient;

use crate::error::Result;
use crate::statement::Statement;
use crate::stream::StreamRef;

const ADD: Statement = Statement {
    name: "partition_add",
    sql: "SELECT sqlstreams.add_partitions($1, $2, $3)",
    params: &[INT8OID, INT8OID, BOOLOID],
};

/// Who asks for partitions, and how much they may wait for them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Need {
    /// A producer about to insert `id`: only when no partition holds it yet, and then it waits
    /// for another transaction creating that partition (it cannot insert without it). Creating
    /// ahead is left to claims and `maintain()`, so a long producer transaction never holds
    /// other producers back.
    Now,
    /// Claims and `maintain()`: keep half a partition of headroom ahead of the head, skipping
    /// the work when another transaction is creating partitions right now.
    Ahead,
}

/// Whether message id `id` is close enough to the end of the partitions to add more.
/// Half a partition of headroom keeps producers from ever reaching a missing partition.
pub fn needs_more(stream: &StreamRef, id: i64) -> bool {
    id.saturating_add(headroom(stream.partition_size)) >= stream.partitions_through
}

fn headroom(partition_size: i64) -> i64 {
    (partition_size / 2).max(1)
}

/// Makes sure partitions cover `id` (`Need::Now`) or `id` plus headroom (`Need::Ahead`). Cheap
/// when they already do.
pub fn ensure(client: &SpiClient<'_>, stream: &StreamRef, id: i64, need: Need) -> Result<()> {
    match need {
        Need::Now => {
            if id >= stream.partitions_through {
                ADD.run(client, 0, &[stream.id.into(), id.into(), true.into()])?;
            }
            // A partition another transaction attached since this one first touched the log
            // is not in this backend's partition descriptor until it reads the invalidations
            // (it holds the log's lock already, so nothing else makes it): without this, an
            // insert into that partition fails with "no partition of relation found for row".
            // SAFETY: processes pending catalog invalidations, as any lock acquisition does.
            unsafe { pgrx::pg_sys::AcceptInvalidationMessages() };
        }
        Need::Ahead if needs_more(stream, id) => {
            let upto = id.saturating_add(headroom(stream.partition_size));
            ADD.run(client, 0, &[stream.id.into(), upto.into(), false.into()])?;
        }
        _ => {}
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stream(partition_size: i64, partitions_through: i64) -> StreamRef {
        StreamRef { id: 1, partition_size, partitions_through, lanes: 16 }
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
