//! What the stream's log says about messages, with their policy resolved for a group.

use pgrx::pg_sys::BuiltinOid::*;
use pgrx::spi::SpiClient;

use crate::error::Result;
use crate::group::GroupRef;
use crate::key_gate::Candidate;
use crate::policy::{self, Policy};
use crate::statement::Statement;

const INFO: Statement = Statement {
    name: "message_info",
    sql: "SELECT id, message_key, concurrency, compaction FROM sqlstreams.message_log_@id@
          WHERE id = ANY($1) ORDER BY id",
    params: &[INT8ARRAYOID],
};

/// The messages `ids` (those that exist), in id order, as the group sees them.
pub fn info(client: &SpiClient<'_>, group: &GroupRef, ids: &[i64]) -> Result<Vec<Candidate>> {
    let mut out = Vec::with_capacity(ids.len());
    for row in INFO.run(client, group.stream.id, &[ids.to_vec().into()])? {
        let key: Option<String> = row.get(2)?;
        let requested = row.get::<String>(3)?.map(|p| Policy::from_stored(&p));
        out.push(Candidate {
            message_id: row.get(1)?.expect("id"),
            policy: policy::resolve(group.concurrency_override, requested, key.is_some()),
            key,
            compaction: row.get(4)?.expect("compaction"),
        });
    }
    Ok(out)
}
