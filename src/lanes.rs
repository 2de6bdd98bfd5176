//! Lanes: how consumers of one group divide the stream's keys between them.
//!
//! Every message is in one lane (`sqlstreams.lane`: the hash of its key, or blocks of ids for
//! messages without a key), so every message of a key is in the same lane. Each group has a
//! position in every lane (`lane_<id>`). A claim takes lanes with work one at a time, each with
//! `SKIP LOCKED`, and from each its due exception rows and its next range, until the batch is
//! full.
//!
//! A group whose messages may be ordered or exclusive *holds* a lane from the claim that hands
//! out ordered or exclusive work from it until that claim's work there is resolved, or until
//! its lease runs out: one claim's deliveries per lane at a time. (A claim that hands out only
//! parallel messages from a lane does not hold it: they may run beside anything.) Since a key
//! never leaves its lane, two consumers never hold the same key, and a claim never finds a
//! same-key predecessor in another consumer's open range: consumers divide the keys, not the
//! id space. No static assignment and no rebalancing protocol: a new consumer gets work on its
//! first claim from any lane nobody holds, one consumer alone drains every lane, a consumer
//! takes at most its share of the lanes while others hold some (`candidates`), and a consumer
//! that dies loses its lanes when its lease runs out. A group with
//! `concurrency_override = 'parallel'` does not hold lanes.

use std::ops::ControlFlow;

use pgrx::pg_sys::{self, BuiltinOid::*};
use pgrx::spi::SpiClient;

use crate::error::Result;
use crate::group::GroupRef;
use crate::message::Address;
use crate::partition::{self, Log};
use crate::statement::{self, Access, Columns, Part, Statement};
use crate::stream::StreamRef;

mod empty;
mod free;
mod holds;
mod next;
mod stay;

pub use holds::{end_holds_with_ranges, release, store, store_with_new_range};
pub use stay::{lane_to_stay_with, stay_run};

/// A claim's read of lane `lane` of log `log` found message `id` after what it handed out, up to
/// the safe head: the next claim to take the lane knows it has work without probing it (as a
/// probe that found `id` would have learned, src/lanes/next.rs).
pub fn saw_next(stream_id: i64, log: pg_sys::Oid, lane: i32, id: i64) {
    next::learn(stream_id, log, lane, id);
}

/// The transaction committed: what its probes and reads learned of lanes counts from now on
/// (src/lanes/empty.rs, src/lanes/next.rs).
pub fn committed() {
    empty::committed();
    next::committed();
}

/// The transaction, or one of its savepoints, was rolled back or prepared: what its probes and
/// reads learned goes.
pub fn rolled_back() {
    empty::rolled_back();
    next::rolled_back();
}

/// Forgets what this backend learned of a dropped stream's lanes.
pub fn forget(stream_id: i64) {
    empty::forget(stream_id);
    next::forget(stream_id);
}

/// A lane a claim holds (its row is locked until the claim commits).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lane {
    pub lane: i32,
    /// Every message of the lane with id <= claimed has been handed out.
    pub claimed: i64,
    /// `claimed` when the claim took it.
    pub taken_at: i64,
    /// Whether a hold (one whose lease ran out) was on it when taken.
    pub was_held: bool,
}

/// Whether group `$1` has any exception row due (`$2`: now), as a SQL expression: one probe of
/// each of the two indexes that answer it, whatever the queue holds.
macro_rules! any_due {
    () => {
        concat!(
            "(coalesce((SELECT true FROM sqlstreams.exception_queue_@id@ e
                        WHERE e.consumer_group_id = $1 AND ",
            crate::exception_queue::waiting!("e"),
            " AND e.can_run_after <= $2
                        ORDER BY e.can_run_after LIMIT 1), false)
              OR coalesce((SELECT true FROM sqlstreams.exception_queue_@id@ e
                           WHERE e.consumer_group_id = $1 AND ",
            crate::exception_queue::in_flight!("e"),
            " AND e.lease_expires_at <= $2
                           ORDER BY e.lease_expires_at LIMIT 1), false))"
        )
    };
}

/// Whether group `$1` has any range whose lease expired (`$2`: now), as a SQL expression.
macro_rules! any_expired {
    () => {
        "coalesce((SELECT true FROM sqlstreams.range_lease_@id@ r
                   WHERE r.consumer_group_id = $1 AND r.lease_expires_at <= $2
                   ORDER BY r.lease_expires_at LIMIT 1), false)"
    };
}

/// How many claims hold lanes of group `$1` now (`$2`), when it holds lanes (`$3`), as a SQL
/// expression.
macro_rules! holders {
    () => {
        "(SELECT count(DISTINCT held_by) FROM sqlstreams.lane_@id@
          WHERE $3 AND consumer_group_id = $1 AND held_until > $2)"
    };
}

/// Lanes with work that a claim may take, best first: one with a due isolated row (it is
/// handed out alone, so it goes first or never), then the lane furthest behind, the lane the
/// caller just released first among equals (it stays with the keys it knows; where nothing is
/// due, `candidates` may put a released lane first: src/lanes/stay.rs). Work is due
/// exception rows, an expired range, or perhaps messages:
/// the lane's position is below the safe head `$4` (`NEXT` looks). Also how many claims hold
/// lanes now. Reads only; `take` locks.
const CANDIDATES: Statement = Statement {
    name: "lanes_candidates",
    sql: concat!(
        "WITH g AS (
              -- Whether the group has any such work at all: one probe each, so the per-lane
              -- probes below run only when there is something to find. Every probe here and
              -- below is a scalar subquery with LIMIT 1 ordered by exactly the columns of one
              -- index, never EXISTS: an EXISTS may be planned as a bitmap scan (which reads
              -- every match before the first) or as one hashed scan of the whole table. A
              -- plan cached while the tables were young stays for as long as the backend
              -- lives.
              SELECT ",
        any_due!(),
        " AS any_due, ",
        any_expired!(),
        " AS any_expired, ",
        holders!(),
        " AS holders
          )
          SELECT c.lane, c.claimed, c.waiting_due OR c.expired_rows AS due_rows, c.expired_rows, c.expired_range,
                 c.isolated, c.holders
          FROM (
          SELECT l.lane, l.claimed, g.holders,
                 g.any_due AND coalesce((SELECT true FROM sqlstreams.exception_queue_@id@ e
                                         WHERE e.consumer_group_id = $1 AND e.lane = l.lane
                                           AND ",
        crate::exception_queue::waiting!("e"),
        " AND e.can_run_after <= $2
                                         ORDER BY e.lane, e.can_run_after LIMIT 1), false) AS waiting_due,
                 g.any_due AND coalesce((SELECT true FROM sqlstreams.exception_queue_@id@ e
                                         WHERE e.consumer_group_id = $1 AND e.lane = l.lane
                                           AND ",
        crate::exception_queue::in_flight!("e"),
        " AND e.lease_expires_at <= $2
                                         ORDER BY e.lane, e.lease_expires_at LIMIT 1), false) AS expired_rows,
                 g.any_expired AND coalesce((SELECT true FROM sqlstreams.range_lease_@id@ r
                                             WHERE r.consumer_group_id = $1 AND r.lane = l.lane
                                               AND r.lease_expires_at <= $2
                                             ORDER BY r.lease_expires_at LIMIT 1), false) AS expired_range,
                 g.any_due AND coalesce((SELECT true FROM sqlstreams.exception_queue_@id@ e
                                         WHERE e.consumer_group_id = $1 AND e.lane = l.lane
                                           AND e.isolated AND e.status IN ",
        crate::exception_queue::unresolved!(),
        " AND ",
        crate::exception_queue::due_or_expired!("e", "$2"),
        "
                                         ORDER BY e.lane, e.message_id LIMIT 1), false) AS isolated
          FROM sqlstreams.lane_@id@ l CROSS JOIN g
          WHERE l.consumer_group_id = $1 AND (NOT $3 OR l.held_until IS NULL OR l.held_until <= $2)
          OFFSET 0 -- evaluated once per lane, not again in the filter below
          ) c
          WHERE c.claimed < $4 OR c.waiting_due OR c.expired_rows OR c.expired_range
          ORDER BY c.isolated DESC, c.claimed, c.lane = $5 DESC, c.lane"
    ),
    params: &[INT8OID, TIMESTAMPTZOID, BOOLOID, INT8OID, INT4OID],
};

/// The usual claim's question, in a statement much smaller than `CANDIDATES` (whose many
/// subplans cost more to set up than to run): whether group `$1` has anything due or expired
/// at all, and if not, its free lanes whose positions are below the safe head `$4` (put in
/// `CANDIDATES`' order by `candidates`). A claim needs `CANDIDATES` only when something is due
/// or expired. Read from the indexes without the statement where the tables are as installed
/// (src/lanes/free.rs).
const FREE_LANES: Statement = Statement {
    name: "lanes_free",
    sql: concat!(
        "SELECT w.any_work, l.lane, l.claimed
         FROM (SELECT ",
        any_due!(),
        " OR ",
        any_expired!(),
        " AS any_work
               OFFSET 0) w -- once, not once per use
         LEFT JOIN sqlstreams.lane_@id@ l
           ON NOT w.any_work AND l.consumer_group_id = $1 AND l.claimed < $4
              AND (NOT $3 OR l.held_until IS NULL OR l.held_until <= $2)"
    ),
    params: &[INT8OID, TIMESTAMPTZOID, BOOLOID, INT8OID],
};

/// `holders!` alone, for a claim whose candidates came from `FREE_LANES`.
const HOLDERS: Statement = Statement {
    name: "lanes_holders",
    sql: concat!("SELECT ", holders!(), " AS holders"),
    params: &[INT8OID, TIMESTAMPTZOID, BOOLOID],
};

/// The next message of each of the lanes `$1` after its position `$2`, up to the safe head `$3`,
/// in one partition of the log (lanes with none there are left out). The bounds are scalar, so
/// the scan of a lane with nothing up to the safe head stops there: on PostgreSQL 15 to 17 a
/// row comparison `(lane, id) <= (l, $3)` stops a btree scan at its first column only, and read
/// on through the lane's later messages (those of producers the fence is still waiting for).
/// The lane and position come from the outer row and the statement wants one row, so every
/// plan tried is the ordered scan of the key, with or without statistics (unlike
/// `message_after`'s, docs/benchmarks/cost-model.md).
const NEXT: Statement = Statement {
    name: "lanes_next",
    sql: "SELECT l.lane, n.id FROM unnest($1::int4[], $2::int8[]) AS l(lane, claimed)
          CROSS JOIN LATERAL (SELECT m.id FROM sqlstreams.message_log_@id@_p@part@ m
                              WHERE m.lane = l.lane AND m.id > l.claimed AND m.id <= $3
                              ORDER BY m.id LIMIT 1) n",
    params: &[INT4ARRAYOID, INT8ARRAYOID, INT8OID],
};

/// The positions of group `$1`'s lanes below the safe head `$2`.
const POSITIONS: Statement = Statement {
    name: "lanes_positions",
    sql: "SELECT lane, claimed FROM sqlstreams.lane_@id@ WHERE consumer_group_id = $1 AND claimed < $2",
    params: &[INT8OID, INT8OID],
};

/// Moves lanes `$2` with nothing after their positions `$3` up to the safe head `$4` to it,
/// unless another claim has them (`SKIP LOCKED`) or moved them back (`seek`) meanwhile. A lane
/// left at an old position would have every later partition probed by every claim.
/// Only the lanes it moves stay locked.
const CATCH_UP: Statement = Statement {
    name: "lanes_catch_up",
    sql: "UPDATE sqlstreams.lane_@id@ l SET claimed = $4
          FROM unnest($2::int4[], $3::int8[]) AS c(lane, probed_from)
          WHERE l.consumer_group_id = $1 AND l.lane = c.lane AND l.claimed >= c.probed_from AND l.claimed < $4
            AND (l.consumer_group_id, l.lane) IN (
                SELECT x.consumer_group_id, x.lane FROM sqlstreams.lane_@id@ x
                JOIN unnest($2::int4[], $3::int8[]) AS p(lane, probed_from) ON p.lane = x.lane
                WHERE x.consumer_group_id = $1 AND x.claimed >= p.probed_from AND x.claimed < $4
                FOR UPDATE OF x SKIP LOCKED)",
    params: &[INT8OID, INT4ARRAYOID, INT8ARRAYOID, INT8OID],
};

/// Locks lane `$4` if it is still free. `SKIP LOCKED`: a claim never waits for a lane.
const TAKE: Statement = Statement {
    name: "lanes_take",
    sql: "SELECT lane, claimed, held_by IS NOT NULL AS was_held FROM sqlstreams.lane_@id@
          WHERE consumer_group_id = $1 AND lane = $4 AND (NOT $3 OR held_until IS NULL OR held_until <= $2)
          FOR UPDATE SKIP LOCKED",
    params: &[INT8OID, TIMESTAMPTZOID, BOOLOID, INT4OID],
};

const CREATE: Statement = Statement {
    name: "lanes_create",
    sql: "INSERT INTO sqlstreams.lane_@id@ (consumer_group_id, lane, claimed)
          SELECT $1, l, $3 FROM generate_series(0, $2 - 1) AS l",
    params: &[INT8OID, INT4OID, INT8OID],
};

/// Whether the group holds lanes (see the module documentation).
pub fn holds(group: &GroupRef) -> bool {
    group.may_park()
}

/// A lane with work, and what kind: the claim looks only for what is there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Candidate {
    pub lane: i32,
    /// Due exception rows (retries, delays, woken or expired rows).
    pub due_rows: bool,
    /// Exception rows in flight whose lease expired.
    pub expired_rows: bool,
    /// An expired range.
    pub expired_range: bool,
    /// A due isolated row (it goes out alone).
    pub isolated: bool,
    /// The lane's position.
    claimed: i64,
    /// Whether it has messages after its position up to the safe head; `None` until probed.
    messages: Option<bool>,
    /// Its position is in an earlier partition than the safe head's: probed even when it has
    /// other work, so that it moves up if it has no messages (`probe`).
    behind: bool,
}

impl Candidate {
    fn needs_probe(&self) -> bool {
        self.messages.is_none() && (self.behind || !(self.due_rows || self.expired_range))
    }
}

/// The lanes a claim may take, best first (see `candidates`), probed for messages as the claim
/// reaches them, a few at a time: a claim whose batch the first lanes fill probes no others.
pub struct Candidates {
    lanes: Vec<Candidate>,
    next: usize,
    probe_size: usize,
    safe: i64,
    /// How many lanes one claim may take, once known (`share`).
    share: Option<usize>,
}

/// Lanes probed together, as long as probes find messages; after one that finds none, the rest
/// are probed together (they are likely empty too, as on a stream with few keys).
const PROBE_LANES: usize = 4;

impl Candidates {
    /// No free lane may have work (lanes not probed yet may turn out to have none).
    pub fn is_empty(&self) -> bool {
        self.lanes.is_empty()
    }

    /// How many lanes one claim may take (`share_of`): read when first asked, if the
    /// candidates did not tell.
    pub fn share(&mut self, client: &SpiClient<'_>, group: &GroupRef, now: i64) -> Result<usize> {
        if let Some(share) = self.share {
            return Ok(share);
        }
        let holders = if holds(group) {
            let args = [group.id.into(), statement::timestamptz(now), true.into()];
            HOLDERS.run(client, group.stream.id, &args)?.first().value("holders")?.unwrap_or(0)
        } else {
            0
        };
        let share = share_of(group, holders);
        self.share = Some(share);
        Ok(share)
    }

    /// The next lane with work, in order. What a candidate says it has was true when read; a
    /// claim that finds less (another claim took the lane meanwhile) finds nothing, and what it
    /// does not look for stays due for the next claim.
    pub fn next(&mut self, client: &SpiClient<'_>, group: &GroupRef) -> Result<Option<Candidate>> {
        while let Some(candidate) = self.lanes.get(self.next) {
            if candidate.needs_probe() {
                self.probe_from(client, group)?;
            }
            let candidate = self.lanes[self.next];
            self.next += 1;
            if candidate.due_rows || candidate.expired_range || candidate.messages == Some(true) {
                return Ok(Some(candidate));
            }
        }
        Ok(None)
    }

    /// Probes the next `probe_size` lanes that need it, from the current one on (see
    /// `PROBE_LANES`).
    fn probe_from(&mut self, client: &SpiClient<'_>, group: &GroupRef) -> Result<()> {
        let unprobed: Vec<usize> =
            (self.next..self.lanes.len()).filter(|&i| self.lanes[i].needs_probe()).take(self.probe_size).collect();
        let positions = unprobed.iter().map(|&i| (self.lanes[i].lane, self.lanes[i].claimed)).collect();
        let found = probe(client, group, positions, self.safe)?;
        if found.is_empty() {
            self.probe_size = usize::MAX;
        }
        for i in unprobed {
            self.lanes[i].messages = Some(found.contains(&self.lanes[i].lane));
        }
        Ok(())
    }
}

/// Lanes that no other claim holds and that may have work, best first (see `share` for how
/// many one claim may take). `preferred` is a lane the caller's carried acks just released;
/// `stay` one of them to take first where nothing is due (src/lanes/stay.rs).
/// Lanes this backend knows have nothing after their positions up to `safe` are left out
/// (src/lanes/empty.rs): an idle claim then finds none without probing any. Reads only.
pub fn candidates(
    client: &SpiClient<'_>,
    group: &GroupRef,
    log: &Log<'_>,
    safe: i64,
    now: i64,
    preferred: Option<i32>,
    stay: Option<i32>,
) -> Result<Candidates> {
    let args = [
        group.id.into(),
        statement::timestamptz(now),
        holds(group).into(),
        safe.into(),
        preferred.unwrap_or(-1).into(),
    ];
    let stream = &group.stream;
    let safe_part = partition::of(stream, safe);
    let candidate = |lane: i32, claimed: i64, [due_rows, expired_rows, expired_range, isolated]: [bool; 4]| {
        let behind = partition::of(stream, claimed + 1) < safe_part;
        let messages = if claimed >= safe || (!behind && empty::known(stream.id, log.oid(), lane, claimed, safe)) {
            Some(false)
        } else if !behind && next::known(stream.id, log.oid(), lane, claimed, safe) {
            Some(true)
        } else {
            None
        };
        Candidate { lane, due_rows, expired_rows, expired_range, isolated, claimed, messages, behind }
    };
    let free = free::read(client, group, now, holds(group), safe)?;
    let mut lanes: Vec<Candidate> =
        free.lanes.iter().map(|&(lane, claimed)| candidate(lane, claimed, [false; 4])).collect();
    let mut share = None;
    if free.any_work {
        let mut holders = 0i64;
        for row in CANDIDATES.run(client, stream.id, &args)? {
            let kinds = [
                row.required("due_rows")?,
                row.required("expired_rows")?,
                row.required("expired_range")?,
                row.required("isolated")?,
            ];
            lanes.push(candidate(row.required("lane")?, row.required("claimed")?, kinds));
            holders = row.value("holders")?.unwrap_or(0);
        }
        share = Some(share_of(group, holders));
    } else {
        // CANDIDATES' order, where nothing is due: the lane furthest behind first, the
        // preferred one first among equals; but the lane to stay with before them all.
        lanes.sort_by_key(|c| (Some(c.lane) != stay, c.claimed, Some(c.lane) != preferred, c.lane));
    }
    lanes.retain(|c| c.due_rows || c.expired_range || c.messages != Some(false));
    Ok(Candidates { lanes, next: 0, probe_size: PROBE_LANES, safe, share })
}

/// A claim of a group that holds lanes takes at most its share of them (the lanes divided
/// among the claims holding some now and itself), so a consumer that finds every lane with
/// work leaves some for the next one; other groups take what fills the batch.
fn share_of(group: &GroupRef, holders: i64) -> usize {
    let lanes = group.stream.lanes as usize;
    if holds(group) {
        lanes.div_ceil(holders as usize + 1)
    } else {
        lanes
    }
}

/// Visits the partitions holding the next messages of lanes at `positions` (lane, claimed) up
/// to `safe`, oldest first, each with the lanes that may have messages in it (positions before
/// its end). `visit` returns the lanes it is done with, or `Break` to stop. Returns the lanes
/// left.
fn by_partition(
    client: &SpiClient<'_>,
    log: &Log<'_>,
    mut left: Vec<(i32, i64)>,
    safe: i64,
    access: Access,
    mut visit: impl FnMut(Part, Vec<i32>, Vec<i64>) -> Result<ControlFlow<(), Vec<i32>>>,
) -> Result<Vec<(i32, i64)>> {
    let Some(from) = left.iter().map(|&(_, claimed)| claimed).min() else { return Ok(left) };
    for part in log.holding(client, from, safe, access)? {
        let part = part?;
        let last = log.last_id(part);
        let (lanes, claimed): (Vec<i32>, Vec<i64>) =
            left.iter().filter(|&&(_, claimed)| claimed < last).copied().unzip();
        if lanes.is_empty() {
            continue;
        }
        let ControlFlow::Continue(done) = visit(part, lanes, claimed)? else { break };
        left.retain(|(lane, _)| !done.contains(lane));
        if left.is_empty() {
            break;
        }
    }
    Ok(left)
}

/// Which of the lanes at `positions` (lane, claimed) have messages after their positions up to
/// `safe`: probed one partition at a time, each lane until it is found, so a claim reads the
/// partitions the lanes are in and no others. A lane found empty while a partition behind
/// `safe` is moved up to `safe` (`CATCH_UP`), so it is probed from there next time; a lane
/// behind in the partition of `safe` is left as it is, so an idle claim writes nothing (it
/// writes once when the head enters a new partition). Every lane found empty is remembered so
/// (src/lanes/empty.rs).
fn probe(client: &SpiClient<'_>, group: &GroupRef, positions: Vec<(i32, i64)>, safe: i64) -> Result<Vec<i32>> {
    let stream = &group.stream;
    // Opened here, after the fence, and not the claim's: opening reads the catalog's
    // invalidations, so the walk sees every partition attached since, and a lane it finds empty
    // is empty (src/lanes/empty.rs).
    let log = Log::open(stream)?;
    let mut found = Vec::new();
    let empty = by_partition(client, &log, positions, safe, Access::Write, |part, lanes, claimed| {
        let args = [lanes.into(), claimed.into(), safe.into()];
        let rows = NEXT.exec_in(client, stream.id, part, &args, Access::Write)?;
        let here =
            rows.map(|row| Ok((row.required("lane")?, row.required("id")?))).collect::<Result<Vec<(i32, i64)>>>()?;
        for &(lane, id) in &here {
            next::learn(stream.id, log.oid(), lane, id);
        }
        let here: Vec<i32> = here.into_iter().map(|(lane, _)| lane).collect();
        found.extend(&here);
        Ok(ControlFlow::Continue(here))
    })?;
    for &(lane, claimed) in &empty {
        empty::learn(stream.id, log.oid(), lane, claimed, safe);
    }
    let safe_part = partition::of(stream, safe);
    let (behind, from): (Vec<i32>, Vec<i64>) =
        empty.into_iter().filter(|&(_, claimed)| partition::of(stream, claimed + 1) < safe_part).unzip();
    if !behind.is_empty() {
        CATCH_UP.run(client, stream.id, &[group.id.into(), behind.into(), from.into(), safe.into()])?;
    }
    Ok(found)
}

/// The highest id at or below which group `group_id` has handed out everything, given that
/// its fence proved every id up to `safe`: below the first message a lane has not handed out
/// yet (a lane with nothing new does not hold it back). The first partition in which any lane
/// has a message holds the lowest such message.
pub fn claimed_through(
    client: &SpiClient<'_>,
    stream: &StreamRef,
    group_id: i64,
    safe: i64,
    access: Access,
) -> Result<i64> {
    Ok(first_unclaimed(client, stream, group_id, safe, access)?.map_or(safe, |first| safe.min(first.id - 1)))
}

/// The first message at or below `safe` that group `group_id` has not handed out, if any
/// (`claimed_through`). Lanes this backend knows have nothing after their positions up to
/// `safe` are not probed, as in a claim (`candidates`: the facts count only for a lane in the
/// partition of `safe`), and a walk that finds nothing teaches it so of every lane it probed:
/// a monitor polling `group_status` probes a lane left behind the head in its partition once,
/// not on every call. `safe` is a proven head, so what a probe finds empty up to it stays empty
/// (src/lanes/empty.rs), in any snapshot that sees the proof. Not in parallel mode, where a
/// partition created a moment ago may be missed (`Log::exists`): nothing is learned there.
pub fn first_unclaimed(
    client: &SpiClient<'_>,
    stream: &StreamRef,
    group_id: i64,
    safe: i64,
    access: Access,
) -> Result<Option<Address>> {
    let mut positions = POSITIONS
        .exec(client, stream.id, &[group_id.into(), safe.into()], access)?
        .map(|row| Ok((row.required("lane")?, row.required("claimed")?)))
        .collect::<Result<Vec<(i32, i64)>>>()?;
    let log = Log::open(stream)?;
    let safe_part = partition::of(stream, safe);
    positions.retain(|&(lane, claimed)| {
        let behind = partition::of(stream, claimed + 1) < safe_part;
        behind || !empty::known(stream.id, log.oid(), lane, claimed, safe)
    });
    let probed = positions.clone();
    let mut first = None;
    by_partition(client, &log, positions, safe, access, |part, lanes, claimed| {
        let rows = NEXT.exec_in(client, stream.id, part, &[lanes.into(), claimed.into(), safe.into()], access)?;
        first = rows
            .map(|row| Ok(Address { id: row.required("id")?, lane: row.required("lane")? }))
            .collect::<Result<Vec<Address>>>()?
            .into_iter()
            .min_by_key(|a| a.id);
        // Found here, it is the lowest: a lane not looked for here has its next message in a
        // later partition. Not found: no lane has one here.
        Ok(if first.is_some() { ControlFlow::Break(()) } else { ControlFlow::Continue(vec![]) })
    })?;
    // SAFETY: reads this backend's parallel state.
    if first.is_none() && !unsafe { pg_sys::IsInParallelMode() } {
        for (lane, claimed) in probed {
            empty::learn(stream.id, log.oid(), lane, claimed, safe);
        }
    }
    Ok(first)
}

/// Locks `lane` if it is still free; `None` when another claim has it (nothing waits).
pub fn take(client: &SpiClient<'_>, group: &GroupRef, lane: i32, now: i64) -> Result<Option<Lane>> {
    let row = TAKE.run(
        client,
        group.stream.id,
        &[group.id.into(), statement::timestamptz(now), holds(group).into(), lane.into()],
    )?;
    let row = row.first();
    if row.is_empty() {
        return Ok(None);
    }
    let claimed = row.required("claimed")?;
    Ok(Some(Lane { lane: row.required("lane")?, claimed, taken_at: claimed, was_held: row.required("was_held")? }))
}

/// A new group's lanes, every one at position `claimed`.
pub fn create(client: &SpiClient<'_>, stream_id: i64, group_id: i64, lanes: i32, claimed: i64) -> Result<()> {
    CREATE.run(client, stream_id, &[group_id.into(), lanes.into(), claimed.into()])?;
    Ok(())
}
