//! Whether anything could block a key of a claim, asked before the gate's question (`CHECK`):
//! as a rule nothing can, and the question is not asked.
//!
//! Two probes of an index entry each: any unresolved exception row of the group (through the
//! queue's `unresolved_idx`), any range of the group but this claim's in a lane the claim took
//! (through the ranges' primary key). `CHECK` looks at nothing else: with `on_dead = 'hold'` a
//! dead row could block, and the caller does not ask. Both read one snapshot, so `CHECK` in that
//! snapshot would find nothing when they find nothing. They are read from the indexes directly
//! (src/statement/probe.rs); a table or index of another shape than the install script's is
//! asked through `ANY_BLOCKER`, the same question as a statement.

use pgrx::pg_sys::{self, BuiltinOid::*};
use pgrx::spi::SpiClient;
use pgrx::{PgList, PgRelation};

use super::GatherInput;
use crate::error::Result;
use crate::statement::probe::{self, Snapshot};
use crate::statement::{Columns, Statement};

/// The statuses of an unresolved exception row, as `unresolved_idx`'s predicate lists them.
const UNRESOLVED: [&str; 3] = ["ready", "inflight", "deferred"];

/// The question as a statement, much smaller than `CHECK` (whose plan costs more to set up than
/// a group keeping up needs): group `$1`, this claim's ranges `$2`, the lanes it took `$3`.
/// Other consumers' ranges, always open beside a consumer's claims, are in other lanes (a key
/// is in one), so they cost its claims nothing.
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
    if let Some(found) = read(input)? {
        return Ok(found);
    }
    let args = [input.group_id.into(), input.own_ranges.clone().into(), input.lanes.clone().into()];
    ANY_BLOCKER.run(client, input.stream_id, &args)?.first().required("any")
}

/// The two probes read from the indexes; `None` when a table or index is not of the
/// install script's shape.
fn read(input: &GatherInput<'_>) -> Result<Option<bool>> {
    let Some(queue) = Queue::open(input.stream_id) else { return Ok(None) };
    let Some(ranges) = Ranges::open(input.stream_id) else { return Ok(None) };
    let snapshot = Snapshot::take();
    let found = queue.any_unresolved(&snapshot, input.group_id).and_then(|found| {
        if found {
            return Ok(true);
        }
        ranges.any_other(&snapshot, input)
    });
    snapshot.release();
    found.map(Some)
}

/// The exception queue and its index of unresolved rows.
struct Queue {
    heap: PgRelation,
    unresolved: PgRelation,
    status: usize,
}

impl Queue {
    fn open(stream_id: i64) -> Option<Queue> {
        let heap = probe::table(&format!("exception_queue_{stream_id}"))?;
        let status = probe::column(&heap, "status", pg_sys::TEXTOID)?;
        let unresolved = probe::group_index(&heap, &format!("exception_queue_{stream_id}_unresolved_idx"))
            .filter(|index| holds_every_unresolved_row(index, status))?;
        Some(Queue { heap, unresolved, status })
    }

    fn any_unresolved(&self, snapshot: &Snapshot, group: i64) -> Result<bool> {
        probe::any(&self.heap, &self.unresolved, snapshot, group, &[(self.status, pg_sys::TEXTOID)], |row| {
            Ok(row.text(1, |status| UNRESOLVED.contains(&status))?.unwrap_or(false))
        })
    }
}

/// The open ranges and their primary key, `(consumer_group_id, first_id)`.
struct Ranges {
    heap: PgRelation,
    key: PgRelation,
    first_id: usize,
    lane: usize,
}

impl Ranges {
    fn open(stream_id: i64) -> Option<Ranges> {
        let heap = probe::table(&format!("range_lease_{stream_id}"))?;
        let key = probe::primary_key_name(&heap).and_then(|name| probe::group_index(&heap, &name))?;
        let first_id = probe::column(&heap, "first_id", pg_sys::INT8OID)?;
        let lane = probe::column(&heap, "lane", pg_sys::INT4OID)?;
        Some(Ranges { heap, key, first_id, lane })
    }

    /// Any range of the group but the claim's own in a lane the claim took.
    fn any_other(&self, snapshot: &Snapshot, input: &GatherInput<'_>) -> Result<bool> {
        let columns = [(self.first_id, pg_sys::INT8OID), (self.lane, pg_sys::INT4OID)];
        probe::any(&self.heap, &self.key, snapshot, input.group_id, &columns, |row| {
            let first_id: Option<i64> = row.get(1)?;
            let lane: Option<i32> = row.get(2)?;
            Ok(first_id.is_some_and(|id| !input.own_ranges.contains(&id))
                && lane.is_some_and(|lane| input.lanes.contains(&lane)))
        })
    }
}

/// Whether `index` holds every unresolved row: it has no predicate, or the install script's,
/// `status IN (...)` naming at least the unresolved statuses (as Postgres keeps it: one
/// `status = ANY (constant text[])`). Any other predicate (a narrower one would hide rows) and the
/// statement asks instead.
fn holds_every_unresolved_row(index: &PgRelation, status: usize) -> bool {
    // SAFETY: the index is open; its predicate is a copy in the current memory context, of nodes
    // checked by tag before they are read as that node.
    unsafe {
        let predicate = PgList::<pg_sys::Node>::from_pg(pg_sys::RelationGetIndexPredicate(index.as_ptr()));
        if predicate.is_empty() {
            return true;
        }
        let Some(node) = predicate.get_ptr(0).filter(|_| predicate.len() == 1) else { return false };
        if !pgrx::is_a(node, pg_sys::NodeTag::T_ScalarArrayOpExpr) {
            return false;
        }
        let any = &*node.cast::<pg_sys::ScalarArrayOpExpr>();
        let args = PgList::<pg_sys::Node>::from_pg(any.args);
        let (Some(column), Some(list)) = (args.get_ptr(0), args.get_ptr(1)) else { return false };
        let compares_status = any.useOr
            && any.opno == pg_sys::Oid::from(pg_sys::TextEqualOperator)
            && pgrx::is_a(column, pg_sys::NodeTag::T_Var)
            && (*column.cast::<pg_sys::Var>()).varattno as usize == status;
        if !compares_status || !pgrx::is_a(list, pg_sys::NodeTag::T_Const) {
            return false;
        }
        let list = &*list.cast::<pg_sys::Const>();
        if list.consttype != pg_sys::TEXTARRAYOID || list.constisnull {
            return false;
        }
        let Some(statuses) = <Vec<Option<String>> as pgrx::FromDatum>::from_datum(list.constvalue, false) else {
            return false;
        };
        UNRESOLVED.iter().all(|s| statuses.iter().any(|listed| listed.as_deref() == Some(*s)))
    }
}
