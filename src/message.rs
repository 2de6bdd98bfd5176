//! Reading the stream's log (`message_log_<id>`), with each message's concurrency resolved for
//! the group that reads it.

use std::collections::{BTreeMap, HashSet};

use pgrx::datum::TimestampWithTimeZone;
use pgrx::pg_sys::{self, BuiltinOid::*};
use pgrx::spi::SpiClient;
use pgrx::{FromDatum, IntoDatum};

use crate::concurrency::{self, Concurrency};
use crate::error::{Result, StreamError};
use crate::group::GroupRef;
use crate::key::Key;
use crate::key_gate::Candidate;
use crate::partition::{self, Log};
use crate::payload::RawJsonb;
use crate::statement::{Access, Columns, Deformed, Part, Row, Statement};
use crate::stream::StreamRef;
use scan::LaneRange;

mod scan;

/// The columns a message is read with (`messages`), in the order of `Column`.
macro_rules! columns {
    () => {
        "id, message_key, concurrency, compaction, lane, payload, produced_at, headers, deliver_at"
    };
}

/// `columns!()`, for reading a partition without a statement (`scan`).
const READ_COLUMNS: [&str; 9] =
    ["id", "message_key", "concurrency", "compaction", "lane", "payload", "produced_at", "headers", "deliver_at"];

/// The position of each of `columns!()` in a row (1-based): a claim reads its messages by
/// position, since a lookup by name costs a search of the row's columns per value.
#[derive(Clone, Copy)]
enum Column {
    Id = 1,
    Key,
    Concurrency,
    Compaction,
    Lane,
    Payload,
    ProducedAt,
    Headers,
    DeliverAt,
}

/// A message row's value at `column`.
fn at<T: FromDatum + IntoDatum>(row: &Row<'_>, column: Column) -> Result<Option<T>> {
    row.get(column as usize)
}

fn required_at<T: FromDatum + IntoDatum>(row: &Row<'_>, column: Column) -> Result<T> {
    at(row, column)?
        .ok_or_else(|| StreamError::Internal(format!("message column {} is unexpectedly NULL", column as usize)))
}

/// Messages by address in one partition of the log (src/partition.rs): each a probe of the
/// log's key, (lane, id).
const IN_PART: Statement = Statement {
    name: "message_in_part",
    sql: concat!(
        "SELECT m.* FROM unnest($1::int4[], $2::int8[]) AS a(l, i)
         CROSS JOIN LATERAL (SELECT ",
        columns!(),
        " FROM sqlstreams.message_log_@id@_p@part@ WHERE lane = a.l AND id = a.i) m"
    ),
    params: &[INT4ARRAYOID, INT8ARRAYOID],
};

/// Messages by id from the archive: retention copies there the messages of a partition it
/// drops that exception rows still refer to (src/retention.rs).
const ARCHIVED: Statement = Statement {
    name: "message_archived",
    sql: concat!("SELECT ", columns!(), " FROM sqlstreams.message_archive_@id@ WHERE id = ANY($1)"),
    params: &[INT8ARRAYOID],
};

/// The next messages of a lane in one partition, for a partition a DBA changed: the others are
/// read from their key without a statement (`scan`), whose scalar keys stop at the safe head and
/// leave no plan to choose. The bounds here are row comparisons on (lane, id),
/// the log's key: written as `lane = $4 AND id > $1 AND id <= $2`, the planner can estimate a
/// handful of rows (no statistics yet on a new partition, or a narrow range) and choose a bitmap
/// scan and a sort, which reads every message of the lane up to the safe head to return `$3`.
/// The row comparison's estimate keeps the ordered scan of the key. Its price: on PostgreSQL 15
/// to 17 such a scan stops at the first column only, so a lane with fewer messages up to the
/// safe head than wanted is read on to its end in the partition (docs/benchmarks/cost-model.md).
const AFTER: Statement = Statement {
    name: "message_after",
    sql: concat!(
        "SELECT ",
        columns!(),
        " FROM sqlstreams.message_log_@id@_p@part@
          WHERE (lane, id) > ($4, $1) AND (lane, id) <= ($4, $2)
          ORDER BY lane, id LIMIT $3"
    ),
    params: &[INT8OID, INT8OID, INT4OID, INT4OID],
};

/// The first message with an id in `($1, $3]` in one partition, and when it was produced: the
/// first of each of the stream's `$2` lanes, whichever has the lowest id (the log is keyed by
/// lane and id). The bounds are scalar: on PostgreSQL 15 to 17 a btree scan stops at a row
/// comparison's first column only, so `(lane, id) <= (l, $3)` would read on through the lane.
const FIRST_AFTER: Statement = Statement {
    name: "message_first_after",
    sql: "SELECT n.id, n.produced_at FROM generate_series(0, $2 - 1) AS l(lane)
          CROSS JOIN LATERAL (SELECT m.id, m.produced_at FROM sqlstreams.message_log_@id@_p@part@ m
                              WHERE m.lane = l.lane AND m.id > $1 AND m.id <= $3
                              ORDER BY m.id LIMIT 1) n
          ORDER BY n.id LIMIT 1",
    params: &[INT8OID, INT4OID, INT8OID],
};

/// The newest message with an id above `$2` in one partition, and when it was produced: the
/// newest of each of the stream's `$1` lanes, whichever has the highest id (scalar bounds, as
/// in `FIRST_AFTER`: a lane with nothing above `$2` costs one descent).
const NEWEST: Statement = Statement {
    name: "message_newest",
    sql: "SELECT n.id, n.produced_at FROM generate_series(0, $1 - 1) AS l(lane)
          CROSS JOIN LATERAL (SELECT m.id, m.produced_at FROM sqlstreams.message_log_@id@_p@part@ m
                              WHERE m.lane = l.lane AND m.id > $2
                              ORDER BY m.id DESC LIMIT 1) n
          ORDER BY n.id DESC LIMIT 1",
    params: &[INT4OID, INT8OID],
};

/// When the message at `$1, $2` (lane, id) in one partition was produced.
const PRODUCED_AT: Statement = Statement {
    name: "message_produced_at",
    sql: "SELECT produced_at FROM sqlstreams.message_log_@id@_p@part@ WHERE lane = $1 AND id = $2",
    params: &[INT4OID, INT8OID],
};

/// Where a message is in the log: its lane and id, the log's key. Whoever reads a message by
/// id knows its lane too: a range's messages are all in the range's lane, and an exception row
/// keeps its message's.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Address {
    pub lane: i32,
    pub id: i64,
}

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

fn micros(t: TimestampWithTimeZone) -> i64 {
    t.into_inner()
}

fn candidate(row: &Row<'_>, group: &GroupRef) -> Result<Candidate> {
    let key = row.text(Column::Key as usize, Key::new)?;
    let requested = row.text(Column::Concurrency as usize, Concurrency::from_stored)?.transpose()?;
    Ok(Candidate {
        message_id: required_at(row, Column::Id)?,
        concurrency: concurrency::resolve(group.concurrency_override, requested, key.is_some()),
        key,
        compaction: required_at(row, Column::Compaction)?,
        lane: required_at(row, Column::Lane)?,
    })
}

fn messages(rows: Deformed<'_>, group: &GroupRef) -> Result<Vec<Message>> {
    rows.map(|row| message(row, group))
}

/// The message in `row`, read with `columns!()`.
fn message(row: &Row<'_>, group: &GroupRef) -> Result<Message> {
    Ok(Message {
        candidate: candidate(row, group)?,
        payload: required_at(row, Column::Payload)?,
        meta: Meta { produced_at: micros(required_at(row, Column::ProducedAt)?), headers: at(row, Column::Headers)? },
        deliver_at: at::<TimestampWithTimeZone>(row, Column::DeliverAt)?.map(micros),
    })
}

/// The messages at `addresses` (those that exist), in id order, with their payloads: from the
/// partitions that hold them, else from the archive (an id archived just before a drop that then
/// did not happen is in both; either copy is the same, since log rows never change).
pub fn by_id(client: &SpiClient<'_>, group: &GroupRef, addresses: &[Address]) -> Result<Vec<Message>> {
    read_by_id(client, group, addresses, Access::Write)
}

/// `by_id` with `access` (`Access::Read` for inspection functions: the caller's snapshot).
pub fn read_by_id(
    client: &SpiClient<'_>,
    group: &GroupRef,
    addresses: &[Address],
    access: Access,
) -> Result<Vec<Message>> {
    let stream = &group.stream;
    let log = Log::open(stream)?;
    let mut by_part: BTreeMap<Part, Vec<Address>> = BTreeMap::new();
    for &address in addresses {
        by_part.entry(partition::of(stream, address.id)).or_default().push(address);
    }
    let read_in = |part: Part, addresses: &mut Vec<Address>| -> Result<Vec<Message>> {
        addresses.sort_unstable();
        addresses.dedup();
        let (lanes, ids): (Vec<i32>, Vec<i64>) = addresses.iter().map(|a| (a.lane, a.id)).unzip();
        messages(IN_PART.exec_in_deformed(client, stream.id, part, &[lanes.into(), ids.into()], access)?, group)
    };
    let mut found = Vec::with_capacity(addresses.len());
    let mut missing = Vec::new();
    let mut unknown = Vec::new();
    for (part, mut addresses) in by_part {
        if !log.cached(part) {
            // Dropped by retention (its messages archived), as a rule; see below.
            missing.extend(addresses.iter().map(|a| a.id));
            unknown.push((part, addresses));
            continue;
        }
        let read = read_in(part, &mut addresses)?;
        if read.len() < addresses.len() {
            let read: HashSet<i64> = read.iter().map(|m| m.candidate.message_id).collect();
            missing.extend(addresses.iter().map(|a| a.id).filter(|id| !read.contains(id)));
        }
        found.extend(read);
    }
    if !missing.is_empty() {
        let archived = messages(ARCHIVED.exec_deformed(client, stream.id, &[missing.into()], access)?, group)?;
        let in_archive: HashSet<i64> = archived.iter().map(|m| m.candidate.message_id).collect();
        found.extend(archived);
        // Neither in the cache's partitions nor in the archive: a partition this backend has
        // not seen created yet (`Log::exists`) may hold them.
        for (part, addresses) in unknown {
            let mut addresses: Vec<Address> = addresses.into_iter().filter(|a| !in_archive.contains(&a.id)).collect();
            if !addresses.is_empty() && log.exists(client, part)? {
                found.extend(read_in(part, &mut addresses)?);
            }
        }
    }
    found.sort_by_key(|m| m.candidate.message_id);
    Ok(found)
}

/// The messages at `addresses` (those that exist), in id order, as the gate sees them.
pub fn candidates(client: &SpiClient<'_>, group: &GroupRef, addresses: &[Address]) -> Result<Vec<Candidate>> {
    Ok(by_id(client, group, addresses)?.into_iter().map(|m| m.candidate).collect())
}

/// What a claim read of a lane (`after`).
pub struct LaneRead {
    /// Up to the limit asked for, in id order, with payloads.
    pub messages: Vec<Message>,
    /// The lane's next message in the span, when there is one after `messages`: read with them,
    /// one row more than asked for, its id alone.
    pub next: Option<i64>,
    /// The log read (what a backend learns of its lanes is kept by its oid, src/lanes/next.rs).
    pub log: pg_sys::Oid,
}

/// A row of a lane's read: a message to hand out, or the id of the one after the limit.
enum Read {
    Message(Message),
    Next(i64),
}

/// Up to `limit` messages of `lane` with ids in `(after, upto]`, and whether there are more.
pub fn after(
    client: &SpiClient<'_>,
    group: &GroupRef,
    lane: i32,
    after: i64,
    upto: i64,
    limit: i32,
) -> Result<LaneRead> {
    let log = Log::open(&group.stream)?;
    let mut found = Vec::new();
    let mut next = None;
    for part in log.holding(client, after, upto, Access::Write)? {
        let part = part?;
        let mut seen = found.len() as i32;
        let mut read = |row: &Row<'_>| {
            seen += 1;
            if seen > limit {
                Ok(Read::Next(required_at(row, Column::Id)?))
            } else {
                message(row, group).map(Read::Message)
            }
        };
        let range = LaneRange { lane, after, upto, limit: limit + 1 - found.len() as i32 };
        let rows = match log.part_oid(part) {
            Some(oid) => scan::lane_after(oid, &READ_COLUMNS, range, &mut read)?,
            None => None,
        };
        let rows = match rows {
            Some(rows) => rows,
            None => {
                let args = [after.into(), upto.into(), range.limit.into(), lane.into()];
                AFTER.exec_in_deformed(client, group.stream.id, part, &args, Access::Write)?.map(&mut read)?
            }
        };
        for row in rows {
            match row {
                Read::Message(message) => found.push(message),
                Read::Next(id) => next = Some(id),
            }
        }
        if next.is_some() {
            break;
        }
    }
    Ok(LaneRead { messages: found, next, log: log.oid() })
}

/// When a message was produced, from the archive (retention copies there the messages of a
/// dropped partition that exception rows still refer to).
const ARCHIVED_AT: Statement = Statement {
    name: "message_archived_at",
    sql: "SELECT produced_at FROM sqlstreams.message_archive_@id@ WHERE id = $1",
    params: &[INT8OID],
};

/// When the message at `address` was produced: from the log, else from the archive (NULL when
/// it is in neither).
pub fn produced_at(
    client: &SpiClient<'_>,
    stream: &StreamRef,
    address: Address,
    access: Access,
) -> Result<Option<TimestampWithTimeZone>> {
    let log = Log::open(stream)?;
    for part in log.holding(client, address.id - 1, address.id, access)? {
        let args = [address.lane.into(), address.id.into()];
        let row = PRODUCED_AT.exec_in(client, stream.id, part?, &args, access)?;
        if !row.is_empty() {
            return row.first().value("produced_at");
        }
    }
    let row = ARCHIVED_AT.exec(client, stream.id, &[address.id.into()], access)?;
    if row.is_empty() {
        return Ok(None);
    }
    row.first().value("produced_at")
}

/// When the first message with an id in `(after, upto]` was produced (NULL when none is left).
pub fn produced_after(
    client: &SpiClient<'_>,
    stream: &StreamRef,
    after: i64,
    upto: i64,
    access: Access,
) -> Result<Option<TimestampWithTimeZone>> {
    let log = Log::open(stream)?;
    for part in log.holding(client, after, upto, access)? {
        if let Some((_, at)) = first_after(client, stream, part?, after, upto, access)? {
            return Ok(Some(at));
        }
    }
    Ok(None)
}

/// The first message with an id in `(after, upto]` in partition `part` (its id, and when it was
/// produced): a probe of each lane.
pub fn first_after(
    client: &SpiClient<'_>,
    stream: &StreamRef,
    part: Part,
    after: i64,
    upto: i64,
    access: Access,
) -> Result<Option<(i64, TimestampWithTimeZone)>> {
    let args = [after.into(), stream.lanes.into(), upto.into()];
    let row = FIRST_AFTER.exec_in(client, stream.id, part, &args, access)?;
    if row.is_empty() {
        return Ok(None);
    }
    let row = row.first();
    Ok(Some((row.required("id")?, row.required("produced_at")?)))
}

/// The newest message with an id above `above` in partition `part` (its id, and when it was
/// produced): a probe of each lane.
pub fn newest(
    client: &SpiClient<'_>,
    stream: &StreamRef,
    part: Part,
    above: i64,
    access: Access,
) -> Result<Option<(i64, TimestampWithTimeZone)>> {
    let row = NEWEST.exec_in(client, stream.id, part, &[stream.lanes.into(), above.into()], access)?;
    if row.is_empty() {
        return Ok(None);
    }
    let row = row.first();
    Ok(Some((row.required("id")?, row.required("produced_at")?)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_column_positions_are_those_of_the_select_list() {
        let names: Vec<&str> = columns!().split(", ").collect();
        let positions = [
            ("id", Column::Id),
            ("message_key", Column::Key),
            ("concurrency", Column::Concurrency),
            ("compaction", Column::Compaction),
            ("lane", Column::Lane),
            ("payload", Column::Payload),
            ("produced_at", Column::ProducedAt),
            ("headers", Column::Headers),
            ("deliver_at", Column::DeliverAt),
        ];
        assert_eq!(names.len(), positions.len());
        for (name, column) in positions {
            assert_eq!(names[column as usize - 1], name);
        }
    }

    #[test]
    fn the_columns_read_without_a_statement_are_the_statements_and_the_logs() {
        assert_eq!(READ_COLUMNS.join(", "), columns!());
        for name in READ_COLUMNS {
            assert!(crate::partition::LOG_COLUMNS.iter().any(|(column, _, _)| *column == name), "{name}");
        }
    }
}
