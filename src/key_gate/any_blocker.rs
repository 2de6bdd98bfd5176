//! Whether anything could block a key of a claim, asked before the gate's question (`CHECK`):
//! as a rule nothing can, and the question is not asked.
//!
//! Two probes: any unresolved exception row of the group (the first entry of the group in the
//! queue's `unresolved_idx`, as a rule), any range of the group but this claim's in a lane the
//! claim took (the ranges' primary key: every open range of the group is passed, and those of
//! other lanes are filtered out). `CHECK` looks at nothing else: with `on_dead = 'hold'` a dead
//! row could block, and the caller does not ask. Both read one snapshot, so `CHECK` in that
//! snapshot would find nothing when they find nothing. They are read from the indexes directly
//! (src/statement/probe.rs); a table or index of another shape than the install script's is
//! asked through `ANY_BLOCKER`, the same question as a statement. Debug builds ask both ways, in
//! the one snapshot, and check that the answers agree.

use pgrx::pg_sys::{self, BuiltinOid::*};
use pgrx::spi::SpiClient;
use pgrx::PgRelation;

use super::{GatherInput, UNRESOLVED};
use crate::error::Result;
use crate::statement::probe::{self, Column, GroupIndex, Snapshot};
use crate::statement::{Columns, Statement};

/// The question as a statement, much smaller than `CHECK` (whose plan costs more to set up than
/// a group keeping up needs): group `$1`, this claim's ranges `$2`, the lanes it took `$3`.
/// Other consumers' ranges, always open beside a consumer's claims, are in other lanes (a key
/// is in one), so they never make the answer true.
const ANY_BLOCKER: Statement = Statement {
    name: "gate_any_blocker",
    sql: "SELECT coalesce((SELECT true FROM sqlstreams.exception_queue_@id@ u
                           WHERE u.consumer_group_id = $1 AND u.status IN ('ready', 'inflight', 'deferred')
                           ORDER BY u.message_id LIMIT 1), false)
              OR coalesce((SELECT true FROM sqlstreams.range_lease_@id@ o
                           WHERE o.consumer_group_id = $1 AND o.first_id <> ALL($2) AND o.lane = ANY($3)
                           ORDER BY o.first_id LIMIT 1), false) AS any",
    params: &[INT8OID, INT8ARRAYOID, INT4ARRAYOID],
};

/// Whether `CHECK` could find anything for the claim.
pub fn may_block(client: &SpiClient<'_>, input: &GatherInput<'_>) -> Result<bool> {
    if input.hold_on_dead {
        return Ok(true);
    }
    let (Some(queue), Some(ranges)) = (Queue::open(input.stream_id), Ranges::open(input.stream_id)) else {
        return ask(client, input);
    };
    let snapshot = Snapshot::take();
    let found = queue.any_unresolved(&snapshot, input.group_id)? || ranges.any_other(&snapshot, input)?;
    #[cfg(debug_assertions)]
    assert_eq!(found, ask_in(&snapshot, input), "the probes and gate_any_blocker disagree in one snapshot");
    Ok(found)
}

fn args(input: &GatherInput<'_>) -> [pgrx::datum::DatumWithOid<'static>; 3] {
    [input.group_id.into(), input.own_ranges.clone().into(), input.lanes.clone().into()]
}

/// The question as the statement, in a snapshot of its own.
fn ask(client: &SpiClient<'_>, input: &GatherInput<'_>) -> Result<bool> {
    ANY_BLOCKER.run(client, input.stream_id, &args(input))?.first().required("any")
}

/// The question as the statement, in `snapshot` exactly (as foreign keys' checks run theirs):
/// a plan of its own, planned as the statement is (src/transient.rs) and run read-only by
/// `SPI_execute_snapshot`, inside the claim's connection.
#[cfg(debug_assertions)]
fn ask_in(snapshot: &Snapshot, input: &GatherInput<'_>) -> bool {
    use pgrx::IntoDatum;
    let sql = std::ffi::CString::new(crate::statement::render(ANY_BLOCKER.sql, input.stream_id)).unwrap();
    let mut types = [pg_sys::INT8OID, pg_sys::INT8ARRAYOID, pg_sys::INT4ARRAYOID];
    let values = [input.group_id.into_datum(), input.own_ranges.clone().into_datum(), input.lanes.clone().into_datum()];
    let mut values: Vec<pg_sys::Datum> = values.into_iter().map(Option::unwrap).collect();
    let mut nulls = [b' ' as std::ffi::c_char; 3];
    let _planned = crate::transient::guide(ANY_BLOCKER.name);
    // SAFETY: inside an SPI connection; the plan takes the three parameters given, of their
    // types, and returns one boolean row, read before the plan is freed.
    unsafe {
        let plan = pg_sys::SPI_prepare(sql.as_ptr(), 3, types.as_mut_ptr());
        assert!(!plan.is_null(), "gate_any_blocker prepares");
        let status = pg_sys::SPI_execute_snapshot(
            plan,
            values.as_mut_ptr(),
            nulls.as_mut_ptr(),
            snapshot.as_ptr(),
            std::ptr::null_mut(),
            true,
            false,
            1,
        );
        assert_eq!(status, pg_sys::SPI_OK_SELECT as i32, "gate_any_blocker runs");
        let processed = pg_sys::SPI_processed;
        assert_eq!(processed, 1, "gate_any_blocker returns one row");
        let table = pg_sys::SPI_tuptable;
        let mut null = false;
        let any = pg_sys::SPI_getbinval(*(*table).vals, (*table).tupdesc, 1, &mut null);
        pg_sys::SPI_freeplan(plan);
        !null && any.value() != 0
    }
}

/// The exception queue and its index of unresolved rows.
struct Queue {
    heap: PgRelation,
    unresolved: GroupIndex,
    status: Column,
}

impl Queue {
    fn open(stream_id: i64) -> Option<Queue> {
        let heap = probe::table(&format!("exception_queue_{stream_id}"))?;
        // Compared byte for byte below, as the statement compares under a deterministic collation.
        let status = probe::column(&heap, "status", pg_sys::TEXTOID)
            .filter(|c| [pg_sys::DEFAULT_COLLATION_OID, pg_sys::C_COLLATION_OID].contains(&c.collation))?;
        let unresolved = probe::index(&heap, &format!("exception_queue_{stream_id}_unresolved_idx"))
            .filter(|index| probe::holds_every_row_with(index.relation(), status.attnum, &UNRESOLVED))?;
        Some(Queue { heap, unresolved, status })
    }

    fn any_unresolved(&self, snapshot: &Snapshot, group: i64) -> Result<bool> {
        probe::any(&self.heap, &self.unresolved, snapshot, group, &[self.status], |row| {
            Ok(row.text(1, |status| UNRESOLVED.contains(&status))?.unwrap_or(false))
        })
    }
}

/// The open ranges and their primary key, `(consumer_group_id, first_id)`.
struct Ranges {
    heap: PgRelation,
    key: GroupIndex,
    first_id: Column,
    lane: Column,
}

impl Ranges {
    fn open(stream_id: i64) -> Option<Ranges> {
        let heap = probe::table(&format!("range_lease_{stream_id}"))?;
        let key = probe::primary_key(&heap)?;
        let first_id = probe::column(&heap, "first_id", pg_sys::INT8OID)?;
        let lane = probe::column(&heap, "lane", pg_sys::INT4OID)?;
        Some(Ranges { heap, key, first_id, lane })
    }

    /// Any range of the group but the claim's own in a lane the claim took.
    fn any_other(&self, snapshot: &Snapshot, input: &GatherInput<'_>) -> Result<bool> {
        probe::any(&self.heap, &self.key, snapshot, input.group_id, &[self.first_id, self.lane], |row| {
            let first_id: Option<i64> = row.get(1)?;
            let lane: Option<i32> = row.get(2)?;
            Ok(first_id.is_some_and(|id| !input.own_ranges.contains(&id))
                && lane.is_some_and(|lane| input.lanes.contains(&lane)))
        })
    }
}
