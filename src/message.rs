//! Reading the stream's log (`message_log_<id>`), with each message's concurrency resolved for
//! the group that reads it.

use pgrx::datum::TimestampWithTimeZone;
use pgrx::pg_sys::BuiltinOid::*;
use pgrx::spi::{SpiClient, SpiHeapTupleData, SpiTupleTable};

use crate::concurrency::{self, Concurrency};
use crate::error::Result;
use crate::group::GroupRef;
use crate::key_gate::Candidate;
use crate::payload::RawJsonb;
use crate::statement::{Columns, Statement};

/// Messages by id, from the log or, once retention dropped their partition, from the archive
/// (src/retention.rs; an id archived just before a drop that then did not happen is in both,
/// and the log's copy is used).
const BY_ID: Statement = Statement {
    name: "message_by_id",
    sql: "SELECT DISTINCT ON (id) id, message_key, concurrency, compaction, lane, payload, produced_at, headers, deliver_at
          FROM (SELECT m.*, 0 AS source FROM sqlstreams.message_log_@id@ m WHERE m.id = ANY($1)
                UNION ALL
                SELECT a.*, 1 AS source FROM sqlstreams.message_archive_@id@ a WHERE a.id = ANY($1)) found
          ORDER BY id, source",
    params: &[INT8ARRAYOID],
};

/// The next messages of a lane. The bounds are row comparisons on (lane, id), which only the
/// lane index can answer: written as `lane = $4`, a plan made while one hot lane filled the
/// statistics walks the primary key instead, through every row of other lanes. The plain lower
/// bound prunes consumed partitions; a plain upper one too would make the id range look narrow
/// enough to take the primary key and sort.
const AFTER: Statement = Statement {
    name: "message_after",
    sql: "SELECT id, message_key, concurrency, compaction, lane, payload, produced_at, headers, deliver_at FROM sqlstreams.message_log_@id@
          WHERE (lane, id) > ($4, $1) AND (lane, id) <= ($4, $2) AND id > $1
          ORDER BY lane, id LIMIT $3",
    params: &[INT8OID, INT8OID, INT4OID, INT4OID],
};

/// A message as a group's claim sees it.
pub struct Message {
    pub candidate: Candidate,
    pub payload: RawJsonb,
    pub meta: Meta,
    /// Not to be handed out before this time (produce's `deliver_after`).
    pub deliver_at: Option<i64>,
}

/// What a delivery carries besides the payload: when the message was produced, its headers.
#[derive(Clone, Copy)]
pub struct Meta {
    pub produced_at: i64,
    pub headers: Option<RawJsonb>,
}

impl Meta {
    /// Reads `produced_at` and `headers` from a row that selected them.
    pub fn from_row(row: &SpiHeapTupleData<'_>) -> Result<Meta> {
        Ok(Meta { produced_at: micros(row.required("produced_at")?), headers: row.value("headers")? })
    }
}

fn micros(t: TimestampWithTimeZone) -> i64 {
    t.into_inner()
}

fn candidate(row: &SpiHeapTupleData<'_>, group: &GroupRef) -> Result<Candidate> {
    let key: Option<String> = row.value("message_key")?;
    let requested = row.value::<String>("concurrency")?.map(|c| Concurrency::from_stored(&c)).transpose()?;
    Ok(Candidate {
        message_id: row.required("id")?,
        concurrency: concurrency::resolve(group.concurrency_override, requested, key.is_some()),
        key,
        compaction: row.required("compaction")?,
        lane: row.required("lane")?,
    })
}

fn messages(rows: SpiTupleTable<'_>, group: &GroupRef) -> Result<Vec<Message>> {
    rows.map(|row| {
        Ok(Message {
            candidate: candidate(&row, group)?,
            payload: row.required("payload")?,
            meta: Meta::from_row(&row)?,
            deliver_at: row.value::<TimestampWithTimeZone>("deliver_at")?.map(micros),
        })
    })
    .collect()
}

/// The messages `ids` (those that exist), in id order, with their payloads.
pub fn by_id(client: &SpiClient<'_>, group: &GroupRef, ids: &[i64]) -> Result<Vec<Message>> {
    messages(BY_ID.run(client, group.stream.id, &[ids.to_vec().into()])?, group)
}

/// The messages `ids` (those that exist), in id order, as the gate sees them.
pub fn candidates(client: &SpiClient<'_>, group: &GroupRef, ids: &[i64]) -> Result<Vec<Candidate>> {
    BY_ID.run(client, group.stream.id, &[ids.to_vec().into()])?.map(|row| candidate(&row, group)).collect()
}

/// Up to `limit` messages of `lane` with ids in `(after, upto]`, in id order, with payloads.
pub fn after(
    client: &SpiClient<'_>,
    group: &GroupRef,
    lane: i32,
    after: i64,
    upto: i64,
    limit: i32,
) -> Result<Vec<Message>> {
    messages(AFTER.run(client, group.stream.id, &[after.into(), upto.into(), limit.into(), lane.into()])?, group)
}
