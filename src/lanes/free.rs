//! The usual claim's first question, `FREE_LANES`, read straight from the indexes
//! (src/statement/probe.rs): whether the group has anything due or expired at all (a waiting
//! exception row due, an in-flight row or a range whose lease ran out: the first entry of a group
//! in each of the three indexes that order them by that time), and if not, its lanes below the
//! safe head that no claim holds (the group's entries of the lanes' primary key, sixteen or so).
//!
//! As a statement it was a claim's most expensive one (some 220,000 instructions of a claim's
//! 1,320,000 without keys, for three subplans set up on every execution and sixteen rows copied
//! out, docs/benchmarks/cost-model.md, "A twenty-sixth pass"). The answer is the statement's,
//! read under one snapshot taken as SPI takes one; a table or an index not of the install
//! script's shape is asked through the statement. Debug builds ask both ways, in the one
//! snapshot, and check that the answers agree.

use pgrx::pg_sys;
use pgrx::spi::SpiClient;
use pgrx::PgRelation;

use super::FREE_LANES;
use crate::error::Result;
use crate::exception_queue::{IN_FLIGHT, WAITING};
use crate::group::GroupRef;
use crate::statement::probe::{self, Column, GroupIndex, Snapshot, TimeIndex};
use crate::statement::{self, Columns, Row};

/// `FREE_LANES`' answer.
#[derive(Debug, PartialEq, Eq)]
pub struct Free {
    /// Something is due or expired: the claim asks `CANDIDATES`.
    pub any_work: bool,
    /// Otherwise the lanes free to take whose positions are below the safe head, as (lane,
    /// position), in lane order.
    pub lanes: Vec<(i32, i64)>,
}

/// `FREE_LANES` for `group` at time `now` with safe head `safe`; `holds` says whether the group
/// holds lanes (a held lane is not free until its hold runs out).
pub fn read(client: &SpiClient<'_>, group: &GroupRef, now: i64, holds: bool, safe: i64) -> Result<Free> {
    let Some(tables) = Tables::open(group.stream.id) else { return by_statement(client, group, now, holds, safe) };
    let snapshot = Snapshot::take();
    let free = tables.read(&snapshot, group.id, now, holds, safe)?;
    #[cfg(debug_assertions)]
    assert_eq!(free, ask_in(&snapshot, group, now, holds, safe), "the probes and lanes_free disagree in one snapshot");
    Ok(free)
}

fn args(group: &GroupRef, now: i64, holds: bool, safe: i64) -> [pgrx::datum::DatumWithOid<'static>; 4] {
    [group.id.into(), statement::timestamptz(now), holds.into(), safe.into()]
}

/// `FREE_LANES` as the statement.
fn by_statement(client: &SpiClient<'_>, group: &GroupRef, now: i64, holds: bool, safe: i64) -> Result<Free> {
    let mut free = Free { any_work: false, lanes: vec![] };
    for row in FREE_LANES.run(client, group.stream.id, &args(group, now, holds, safe))? {
        if row.required("any_work")? {
            return Ok(Free { any_work: true, lanes: vec![] });
        }
        if let Some(lane) = row.value("lane")? {
            free.lanes.push((lane, row.required("claimed")?));
        }
    }
    free.lanes.sort_unstable();
    Ok(free)
}

/// The statement in `snapshot` exactly (`probe::rows_in`).
#[cfg(debug_assertions)]
fn ask_in(snapshot: &Snapshot, group: &GroupRef, now: i64, holds: bool, safe: i64) -> Free {
    let rows = probe::rows_in(snapshot, &FREE_LANES, group.stream.id, &args(group, now, holds, safe));
    let mut free = Free { any_work: rows.iter().any(|row| row[0].is_some_and(|any| any.value() != 0)), lanes: vec![] };
    if !free.any_work {
        free.lanes = rows.iter().filter_map(|row| Some((row[1]?.value() as i32, row[2]?.value() as i64))).collect();
        free.lanes.sort_unstable();
    }
    free
}

/// The three tables and the indexes the question reads.
struct Tables {
    queue: PgRelation,
    /// `exception_queue_<id>_due_any_idx`: waiting rows by `can_run_after`.
    due: TimeIndex,
    /// `exception_queue_<id>_expiry_any_idx`: in-flight rows by `lease_expires_at`.
    expiry: TimeIndex,
    status: Column,
    ranges: PgRelation,
    /// `range_lease_<id>_expiry_idx`: ranges by `lease_expires_at`.
    range_expiry: TimeIndex,
    lanes: PgRelation,
    lane_key: GroupIndex,
    /// The lanes' `lane`, `claimed` and `held_until`.
    lane_columns: [Column; 3],
}

impl Tables {
    fn open(stream_id: i64) -> Option<Tables> {
        let queue = probe::table(&format!("exception_queue_{stream_id}"))?;
        // Compared byte for byte below, as the statement compares under a deterministic collation.
        let status = probe::column(&queue, "status", pg_sys::TEXTOID)
            .filter(|c| [pg_sys::DEFAULT_COLLATION_OID, pg_sys::C_COLLATION_OID].contains(&c.collation))?;
        let time = |name: &'static str| probe::column(&queue, name, pg_sys::TIMESTAMPTZOID);
        let due =
            probe::time_index(&queue, &format!("exception_queue_{stream_id}_due_any_idx"), time("can_run_after")?)
                .filter(|i| probe::holds_every_row_with(i.relation(), status.attnum, &WAITING))?;
        let expiry = probe::time_index(
            &queue,
            &format!("exception_queue_{stream_id}_expiry_any_idx"),
            time("lease_expires_at")?,
        )
        .filter(|i| probe::holds_every_row_with(i.relation(), status.attnum, &IN_FLIGHT))?;
        let ranges = probe::table(&format!("range_lease_{stream_id}"))?;
        let range_expiry = probe::time_index(
            &ranges,
            &format!("range_lease_{stream_id}_expiry_idx"),
            probe::column(&ranges, "lease_expires_at", pg_sys::TIMESTAMPTZOID)?,
        )
        .filter(|i| probe::holds_every_row(i.relation()))?;
        let lanes = probe::table(&format!("lane_{stream_id}"))?;
        let lane_key = probe::primary_key(&lanes)?;
        let lane_columns = [
            probe::column(&lanes, "lane", pg_sys::INT4OID)?,
            probe::column(&lanes, "claimed", pg_sys::INT8OID)?,
            probe::column(&lanes, "held_until", pg_sys::TIMESTAMPTZOID)?,
        ];
        Some(Tables { queue, due, expiry, status, ranges, range_expiry, lanes, lane_key, lane_columns })
    }

    fn read(&self, snapshot: &Snapshot, group: i64, now: i64, holds: bool, safe: i64) -> Result<Free> {
        let with_status = |statuses: &'static [&'static str]| {
            move |row: &Row<'_>| Ok(row.text(1, |s| statuses.contains(&s))?.unwrap_or(false))
        };
        let any_work =
            probe::any_until(&self.queue, &self.due, snapshot, group, now, &[self.status], with_status(&WAITING))?
                || probe::any_until(
                    &self.queue,
                    &self.expiry,
                    snapshot,
                    group,
                    now,
                    &[self.status],
                    with_status(&IN_FLIGHT),
                )?
                || probe::any_until(&self.ranges, &self.range_expiry, snapshot, group, now, &[], |_| Ok(true))?;
        if any_work {
            return Ok(Free { any_work, lanes: vec![] });
        }
        let mut lanes = Vec::new();
        probe::any(&self.lanes, &self.lane_key, snapshot, group, &self.lane_columns, |row| {
            let (Some(lane), Some(claimed)) = (row.get::<i32>(1)?, row.get::<i64>(2)?) else { return Ok(false) };
            let held_until = row.get::<pgrx::datum::TimestampWithTimeZone>(3)?.map(|t| t.into_inner());
            if claimed < safe && (!holds || held_until.is_none_or(|until| until <= now)) {
                lanes.push((lane, claimed));
            }
            Ok(false)
        })?;
        lanes.sort_unstable();
        Ok(Free { any_work, lanes })
    }
}
