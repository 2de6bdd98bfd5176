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

/// The question as the statement, in `snapshot` exactly (`probe::rows_in`).
#[cfg(debug_assertions)]
fn ask_in(snapshot: &Snapshot, input: &GatherInput<'_>) -> bool {
    let rows = probe::rows_in(snapshot, &ANY_BLOCKER, input.stream_id, &args(input));
    assert_eq!(rows.len(), 1, "gate_any_blocker returns one row");
    rows[0][0].is_some_and(|any| any.value() != 0)
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
