//! A claim's due exception rows of a lane: retries, delays, woken or expired parked rows, and
//! deliveries whose lease ran out, which the claim takes over (src/claim/takeover.rs). Their
//! messages are read by id afterwards, from the partitions that hold them.

use std::collections::HashMap;

use pgrx::pg_sys::BuiltinOid::*;
use pgrx::spi::{SpiClient, SpiTupleTable};

use super::{Claim, Handout, Work};
use crate::concurrency::Concurrency;
use crate::error::Result;
use crate::exception_queue::{self, Change, Expired, Held, Status};
use crate::key::Key;
use crate::key_gate::Candidate;
use crate::message::{self, Address, Message};
use crate::statement::{self, Columns, Statement};

/// Due exception rows of lane `$3`: retries, delays, woken or expired parked rows, expired
/// deliveries. Their messages are read by id afterwards (`message::by_id`), from the partitions
/// that hold them.
macro_rules! due_rows {
    ($isolated:literal, $ids:literal, $limit:literal) => {
        concat!(
            "SELECT e.message_id, e.message_key, e.concurrency, e.compaction, e.status, e.attempts, e.lane, e.lease_token
             FROM sqlstreams.exception_queue_@id@ e
             WHERE e.consumer_group_id = $1 AND e.lane = $3 AND e.isolated = ",
            $isolated,
            $ids,
            " AND ",
            crate::exception_queue::due_or_expired!("e", "$2"),
            "
             ORDER BY e.message_id
             LIMIT ",
            $limit,
            "
             FOR UPDATE OF e SKIP LOCKED"
        )
    };
}

/// Up to `$4` of them.
const DUE_ROWS: Statement = Statement {
    name: "claim_due_rows",
    sql: due_rows!("false", "", "$4"),
    params: &[INT8OID, TIMESTAMPTZOID, INT4OID, INT4OID],
};

/// Up to `$4` of them with ids in `[$5, $6)`: those before or after an expired range
/// (src/claim/takeover.rs). A statement of its own, so that the usual one's plan does not
/// weigh bounds it never needs.
const DUE_ROWS_BETWEEN: Statement = Statement {
    name: "claim_due_rows_between",
    sql: due_rows!("false", " AND e.message_id >= $5 AND e.message_id < $6", "$4"),
    params: &[INT8OID, TIMESTAMPTZOID, INT4OID, INT4OID, INT8OID, INT8OID],
};

/// The oldest due row of a quarantined range: it is handed out alone.
pub(super) const DUE_ISOLATED: Statement = Statement {
    name: "claim_due_isolated",
    sql: due_rows!("true", "", "1"),
    params: &[INT8OID, TIMESTAMPTZOID, INT4OID],
};

impl Claim<'_> {
    /// Whether an expired delivery of `candidate` under `token` may have been started, and so
    /// counts as an attempt: not when an earlier message of its key's chain in the same delivery
    /// (same token) expired with it, a row or a range's message (`met_in_range`). A claim
    /// chains an exclusive or ordered key's rows (`run_after`) in id order, and a consumer starts
    /// a row only once the one before it resolved: when that one is still unresolved, this row
    /// never ran. The first of each chain is counted, and goes dead in time if it is what kills
    /// its consumers, while the rows behind it keep their budget. Rows come in id order, but a
    /// range taken over before them may hold a later message of their key: so the lowest id met
    /// of each chain decides, not which came first.
    ///
    /// Chained rows a claim took over without room for them are left under a token no consumer
    /// holds (`exception_queue::take_over_left`), in one token whatever their delivery was, and
    /// the chain's head, if that claim took it, is under the claim's token by now: such rows
    /// are not counted. A whole chain left so is not counted for the delivery that expired
    /// either; its head counts again once it runs under a consumer's lease.
    fn started_in_its_delivery(&mut self, candidate: &Candidate, token: Option<pgrx::Uuid>) -> bool {
        let (Some(key), Some(token)) = (candidate.key.as_deref(), token) else { return true };
        if candidate.concurrency == Concurrency::Parallel {
            return true;
        }
        !crate::token::is_no_ones(token) && !self.met_in_chain(token, key, candidate.message_id)
    }

    /// Records message `id` as unresolved in the chain of `key` of the delivery under `token`;
    /// returns whether an earlier message of that chain was met.
    fn met_in_chain(&mut self, token: pgrx::Uuid, key: &str, id: i64) -> bool {
        let lowest = self.expired_chains.entry((*token.as_bytes(), key.to_string())).or_insert(id);
        let behind = *lowest < id;
        *lowest = (*lowest).min(id);
        behind
    }

    /// The unresolved `messages` of a range whose delivery under `token` expired are in their
    /// ordered and exclusive keys' chains in it, as its expired rows are: a row of those keys
    /// with a higher id never started.
    pub(super) fn met_in_range(&mut self, token: pgrx::Uuid, messages: &[Message]) {
        if crate::token::is_no_ones(token) {
            return;
        }
        for m in messages.iter().filter(|m| m.candidate.concurrency != Concurrency::Parallel) {
            if let Some(key) = m.candidate.key.as_deref() {
                self.met_in_chain(token, key, m.candidate.message_id);
            }
        }
    }

    /// Due exception rows of `lane` with `ids`, while the batch has room. A row taken that does
    /// not become work (an expired delivery gone dead, a row whose message is gone) leaves its
    /// room: the rows after it are read on, so that those of its chain are taken (or left to no
    /// one) by this claim, which met the chain's head, and keep their budget.
    pub(super) fn collect_rows(&mut self, client: &SpiClient<'_>, lane: i32, ids: std::ops::Range<i64>) -> Result<()> {
        let mut from = ids.start;
        loop {
            let room = self.room();
            if room <= 0 {
                return Ok(());
            }
            let (group, now) = (self.group.id, statement::timestamptz(self.now));
            let rows = if (from, ids.end) == (i64::MIN, i64::MAX) {
                DUE_ROWS.run(client, self.group.stream.id, &[group.into(), now, lane.into(), room.into()])?
            } else {
                let args = [group.into(), now, lane.into(), room.into(), from.into(), ids.end.into()];
                DUE_ROWS_BETWEEN.run(client, self.group.stream.id, &args)?
            };
            match self.push_rows(client, rows)? {
                Some((read, last)) if read == room as usize && last < ids.end - 1 => from = last + 1,
                _ => return Ok(()),
            }
        }
    }

    /// Takes due rows as work, with their messages' payloads; a row whose message is gone
    /// (neither in the log nor in the archive) is passed over, unless its delivery expired for
    /// the last time (going dead needs no payload). Returns how many rows it read and the last
    /// one's id, none when there were none.
    pub(super) fn push_rows(
        &mut self,
        client: &SpiClient<'_>,
        rows: SpiTupleTable<'_>,
    ) -> Result<Option<(usize, i64)>> {
        let rows = rows
            .map(|row| {
                let candidate = Candidate {
                    message_id: row.required("message_id")?,
                    concurrency: Concurrency::from_stored(&row.required::<String>("concurrency")?)?,
                    key: row.value::<String>("message_key")?.map(Key::from),
                    compaction: row.required("compaction")?,
                    lane: row.required("lane")?,
                };
                let status = Status::from_stored(&row.required::<String>("status")?)?;
                let token: Option<pgrx::Uuid> = row.value("lease_token")?;
                Ok((candidate, status, row.required::<i32>("attempts")?, token))
            })
            .collect::<Result<Vec<_>>>()?;
        let Some(last) = rows.last().map(|(c, ..)| c.message_id) else { return Ok(None) };
        let read = rows.len();
        let addresses: Vec<Address> = rows.iter().map(|(c, ..)| Address { lane: c.lane, id: c.message_id }).collect();
        let messages: HashMap<i64, Message> =
            message::by_id(client, self.group, &addresses)?.into_iter().map(|m| (m.candidate.message_id, m)).collect();
        for (candidate, status, mut attempts, token) in rows {
            let id = candidate.message_id;
            let expired = status == Status::Inflight;
            if expired && self.started_in_its_delivery(&candidate, token) {
                match exception_queue::expire(id, attempts, self.group.max_retries) {
                    Expired::Again { attempts: counted } => attempts = counted,
                    Expired::Dead(update) => {
                        self.changes.push(Change::Update(update));
                        self.dead_on_expiry.push(id);
                        self.resolved_keys.push(candidate.key.map(Key::into_string));
                        continue;
                    }
                }
            }
            let Some(message) = messages.get(&id) else { continue };
            self.work.push(Work {
                candidate,
                handout: Handout {
                    held: Held::Row { status, expired },
                    attempt: attempts,
                    payload: message.payload,
                    meta: message.meta,
                    range: None,
                },
            });
        }
        Ok(Some((read, last)))
    }
}
