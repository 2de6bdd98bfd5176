//! The key gate: for each message a claim could hand out, decide whether it runs now (and
//! behind which earlier row of the same result), waits, or is superseded.
//!
//! The decision (`gate`) is pure; `gather` reads the facts it needs in a handful of set-based
//! statements per claim:
//! - ordered, check 1: the earliest unresolved exception row of the key outside this claim;
//! - ordered and exclusive, check 2: a same-key message pending in another open range (for
//!   exclusive, one a consumer holds: not expired work a claim took over and left for the next);
//! - exclusive: a same-key delivery in flight from the exception queue under another claim (a
//!   consumer's: not one a claim took over and left for the next);
//! - compaction: the key's compaction head.
//!
//! Both ordered checks are exact per key: a different key stuck in retry never holds this key.
//! A key is in one lane, and a group with ordered or exclusive messages hands out one
//! claim's deliveries per lane at a time (src/lanes.rs), so checks 2 and the exclusive check
//! find nothing while lanes do their job; they stay as the safety net for the moments they do
//! not: a lane taken over after its lease ran out.
//! That is also how exclusive delivery holds a key: one delivery per key at a time, because
//! the key's lane admits one claim at a time and the gate chains same-key rows of a result.
//!
//! ## Parking and wake-ups
//!
//! A waiting row is parked until its blocker could clear on its own, and every resolution wakes
//! the key's parked rows (src/exception_queue/lifecycle.rs). A wake-up must not be lost between
//! a claim that parks rows of a key and an outcome that resolves that key at the same moment,
//! each unable to see the other's uncommitted rows. So both take the key's wake lock, which is
//! its lane's (src/locks.rs): an outcome shared, before it wakes anything; a claim exclusive,
//! before it parks, and then it gathers the facts again. If the claim got the lock, every
//! earlier outcome on the lane's keys has committed (the claim's second look sees it) and every
//! later one waits for the claim to commit (its wake-up sees the parked rows). If an outcome
//! holds the lock right now, the claim does not wait (a claim never waits): it leaves the row
//! due instead of parked, and the next claim looks again. An outcome that holds, locked and
//! still held by its token, the lane of a key needs no wake lock: no claim can have parked its
//! rows since, or park them before the outcome commits (`Waker::HeldLanes` in
//! src/exception_queue/lifecycle.rs; the proof is in docs/semantics.md, "One lock order",
//! outcome step 4).

use foldhash::{HashMap, HashMapExt};

use pgrx::pg_sys::BuiltinOid::*;
use pgrx::spi::SpiClient;

use crate::concurrency::Concurrency;
use crate::error::Result;
use crate::key::Key;
use crate::statement::{Columns, Statement};
use crate::token::held_by_a_consumer;

mod any_blocker;

/// The statuses of an unresolved exception row (`exception_queue::unresolved!`, which this module
/// cannot name: the queue's module uses this one): the rows that can block a key.
pub(crate) const UNRESOLVED: [&str; 3] = ["ready", "inflight", "deferred"];

/// A row that would wait is parked at least this long (microseconds), unless a resolution wakes
/// it earlier. Keeps a blocked row from being re-examined by every claim.
pub const MIN_PARK_MICROS: i64 = 1_000_000;

/// A message a claim could hand out.
#[derive(Clone, Debug, PartialEq)]
pub struct Candidate {
    pub message_id: i64,
    pub key: Option<Key>,
    /// Resolved for the group (see `concurrency::resolve`).
    pub concurrency: Concurrency,
    pub compaction: bool,
    pub lane: i32,
}

/// Something earlier that holds a key, and the latest it could clear on its own (a retry time,
/// a lease expiry), in Postgres microseconds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Blocker {
    pub message_id: i64,
    pub clears_at: i64,
}

/// What the gate knows about one key.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct KeyFacts {
    /// Check 1: the earliest unresolved exception row of the key that is not part of this claim.
    pub unresolved: Option<Blocker>,
    /// Check 2: the earliest same-key message pending in another open range.
    pub pending_elsewhere: Option<Blocker>,
    /// The same, in another open range that a consumer holds: not one a claim took over and
    /// left for the next (it is no one's; docs/semantics.md, "Exclusive delivery"). Set only with
    /// `pending_elsewhere`, never earlier than it.
    pub held_elsewhere: Option<Blocker>,
    /// The earliest same-key exception row in flight under another claim (a consumer's token).
    pub inflight_elsewhere: Option<Blocker>,
    /// The newest compacted message of the key.
    pub compaction_head: Option<i64>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Hand it out; start it after `run_after` (a row of the same result) was resolved.
    Run { run_after: Option<i64> },
    /// Record it deferred (parked) until `until`, unless a resolution wakes it earlier.
    Defer { until: i64 },
    /// A newer compacted message of its key exists: record it superseded; it never runs.
    Supersede,
}

#[derive(Default)]
struct KeyState {
    /// The last gated row of the key that runs in this result.
    chain_tail: Option<i64>,
    /// Set once a gated row of the key waits: every later gated row of the key waits too.
    blocked_until: Option<i64>,
    /// A parallel row of the key runs in this result (an ordered or exclusive row must not run
    /// beside it).
    parallel_running: bool,
    /// An exclusive row of the key runs in this result: the key's later exclusive rows chain.
    exclusive_running: bool,
}

/// Decides every candidate; one verdict each, in candidate order. `candidates` must be sorted
/// by message id; `lease_expires` is this claim's lease expiry, `now` the call time. With
/// `hold_on_dead` (the group's `on_dead = 'hold'`), a dead message blocks the later ordered
/// messages of its key (check 1 counts it), and an ordered key runs one message per result:
/// the contract lets a caller start the next row of a chain once `fail` returned 'dead', which
/// a held key must not do, so there are no ordered chains to start.
pub fn gate(
    candidates: &[Candidate],
    facts: &HashMap<String, KeyFacts>,
    lease_expires: i64,
    now: i64,
    hold_on_dead: bool,
) -> Vec<Verdict> {
    let no_facts = KeyFacts::default();
    // What a parallel row of a key did matters only to a later gated row of the key: without
    // one in the result (a group without an override, as a rule), no key needs a state.
    let any_gated = candidates.iter().any(|c| c.key.is_some() && c.concurrency.is_keyed_gate());
    let mut states: HashMap<&str, KeyState> = HashMap::with_capacity(if any_gated { candidates.len() } else { 0 });
    candidates
        .iter()
        .map(|c| {
            let Some(key) = c.key.as_deref() else {
                return Verdict::Run { run_after: None };
            };
            let facts = facts.get(key).unwrap_or(&no_facts);
            // Ordered delivery must run every message, so it never supersedes.
            if c.compaction
                && c.concurrency != Concurrency::Ordered
                && facts.compaction_head.is_some_and(|h| h > c.message_id)
            {
                return Verdict::Supersede;
            }
            if c.concurrency == Concurrency::Parallel {
                if any_gated {
                    states.entry(key).or_default().parallel_running = true;
                }
                return Verdict::Run { run_after: None };
            }
            let state = states.entry(key).or_default();
            if let Some(until) = state.blocked_until {
                return Verdict::Defer { until };
            }
            let earlier = |b: Option<Blocker>| b.filter(|b| b.message_id < c.message_id).map(|b| b.clears_at);
            let any = |b: Option<Blocker>| b.map(|b| b.clears_at);
            let blocked = match c.concurrency {
                Concurrency::Ordered => [
                    earlier(facts.unresolved),
                    earlier(facts.pending_elsewhere),
                    state.parallel_running.then_some(lease_expires),
                ]
                .into_iter()
                .flatten()
                .min(),
                // Exclusive ignores a waiting retry (it may overtake it), but never runs beside
                // another delivery of its key: elsewhere, or a parallel one of this result.
                Concurrency::Exclusive if !state.exclusive_running => [
                    any(facts.held_elsewhere),
                    any(facts.inflight_elsewhere),
                    state.parallel_running.then_some(lease_expires),
                ]
                .into_iter()
                .flatten()
                .min(),
                _ => None,
            };
            if let Some(clears_at) = blocked {
                let until = clears_at.max(now + MIN_PARK_MICROS);
                state.blocked_until = Some(until);
                return Verdict::Defer { until };
            }
            if hold_on_dead && c.concurrency == Concurrency::Ordered && state.chain_tail.is_some() {
                // Due again at once: the next claim hands it out once its predecessor resolved.
                state.blocked_until = Some(now);
                return Verdict::Defer { until: now };
            }
            state.exclusive_running |= c.concurrency == Concurrency::Exclusive;
            let run_after = state.chain_tail.replace(c.message_id);
            Verdict::Run { run_after }
        })
        .collect()
}

/// Every check in one statement, so they read one snapshot: a message moving from a range's
/// pending list into the exception queue (a concurrent `fail`) is seen in one place or the
/// other, never in neither.
/// - Kind 1, for ordered keys `$2` (with the highest candidate id of each in `$3`): the
///   earliest unresolved exception row below it, outside this claim (`$4`); with `$9`
///   (`on_dead = 'hold'`) a dead row counts too, and never clears on its own. One index probe
///   per key, however many rows wait behind it: the key is blocked until that row resolves
///   (which wakes the key's parked rows), so its own clear time is the one that matters. No
///   key is probed when the group has no unresolved row at all.
/// - Kind 2, for ordered and exclusive keys `$6`: the earliest same-key message pending in
///   another open range (`$5` are this claim's own) of a lane the claim took (`$7`); and, as
///   `holder`, in one that a consumer holds: not one a claim took over and left for the next,
///   whose token (version 8, `token::no_ones`) no consumer was handed.
/// - Kind 3, for exclusive keys `$8`: the earliest same-key exception row in flight outside
///   this claim, under a consumer's token (not one a claim took over and left for the next:
///   src/claim/takeover.rs).
const CHECK: Statement = Statement {
    name: "gate_check",
    sql: concat!(
        "SELECT 1 AS kind, k.message_key, b.message_id AS blocker, b.clears_at,
                 NULL::bigint AS holder, NULL::timestamptz AS holder_clears
          FROM unnest($2::text[], $3::bigint[]) AS k(message_key, upto)
          CROSS JOIN LATERAL (
              SELECT e.message_id,
                     CASE e.status WHEN 'inflight' THEN e.lease_expires_at WHEN 'dead' THEN 'infinity'
                                   ELSE e.can_run_after END AS clears_at
              FROM sqlstreams.exception_queue_@id@ e
              -- Row comparisons: only the key's index answers them (with `message_key = k`, a
              -- plan made while one key filled the statistics walks the whole group's rows).
              WHERE e.consumer_group_id = $1
                AND (e.message_key, e.message_id) > (k.message_key, 0)
                AND (e.message_key, e.message_id) < (k.message_key, k.upto)
                AND (e.status IN ('ready', 'inflight', 'deferred') OR ($9 AND e.status = 'dead'))
                AND e.message_id <> ALL($4)
              ORDER BY e.message_key, e.message_id
              LIMIT 1) b
          -- Evaluated once, before any key is probed: a group with no unresolved row (as a
          -- rule, while it keeps up) pays one index probe instead of one per key.
          WHERE $9 OR coalesce((SELECT true FROM sqlstreams.exception_queue_@id@ u
                                WHERE u.consumer_group_id = $1 AND u.status IN ('ready', 'inflight', 'deferred')
                                ORDER BY u.message_id LIMIT 1), false)
          UNION ALL
          SELECT 2, u.message_key, min(u.id), min(r.lease_expires_at),
                 min(u.id) FILTER (WHERE ",
        held_by_a_consumer!("r.lease_token"),
        "),
                 min(r.lease_expires_at) FILTER (WHERE ",
        held_by_a_consumer!("r.lease_token"),
        ")
          FROM sqlstreams.range_lease_@id@ r
          CROSS JOIN LATERAL unnest(r.pending, r.pending_keys) AS u(id, message_key)
          WHERE r.consumer_group_id = $1 AND r.first_id <> ALL($5) AND r.lane = ANY($7)
            AND u.message_key = ANY($6)
            AND NOT EXISTS (SELECT 1 FROM sqlstreams.range_done_@id@ d
                            WHERE d.consumer_group_id = $1 AND d.lease_token = r.lease_token AND d.message_id = u.id)
            -- Once: a consumer alone, whose acks went with its claim, has no other open range
            -- in its lanes. (An index scan, which learns which entries are dead; a bitmap scan
            -- of the group's ranges reads every range a busy consumer wrote since the last
            -- vacuum.)
            AND coalesce((SELECT true FROM sqlstreams.range_lease_@id@ o
                          WHERE o.consumer_group_id = $1 AND o.first_id <> ALL($5) AND o.lane = ANY($7)
                          ORDER BY o.first_id LIMIT 1), false)
          GROUP BY u.message_key
          UNION ALL
          SELECT 3, e.message_key, min(e.message_id), min(e.lease_expires_at), NULL, NULL
          FROM sqlstreams.exception_queue_@id@ e
          WHERE e.consumer_group_id = $1 AND e.message_key = ANY($8) AND e.status = 'inflight'
            AND e.message_id <> ALL($4) AND ",
        held_by_a_consumer!("e.lease_token"),
        "
          GROUP BY e.message_key"
    ),
    params: &[
        INT8OID,
        TEXTARRAYOID,
        INT8ARRAYOID,
        INT8ARRAYOID,
        INT8ARRAYOID,
        TEXTARRAYOID,
        INT4ARRAYOID,
        TEXTARRAYOID,
        BOOLOID,
    ],
};

const COMPACTION_HEADS: Statement = Statement {
    name: "gate_compaction_heads",
    sql: "SELECT message_key, message_id FROM sqlstreams.compaction_head_@id@ WHERE message_key = ANY($1)",
    params: &[TEXTARRAYOID],
};

/// Keys of the candidates the gate defers.
pub fn deferred_keys(candidates: &[Candidate], verdicts: &[Verdict]) -> Vec<String> {
    let mut keys: Vec<String> = candidates
        .iter()
        .zip(verdicts)
        .filter(|(_, v)| matches!(v, Verdict::Defer { .. }))
        .filter_map(|(c, _)| c.key.as_deref().map(str::to_owned))
        .collect();
    keys.sort_unstable();
    keys.dedup();
    keys
}

/// What `gather` needs to know about the claim.
pub struct GatherInput<'a> {
    pub stream_id: i64,
    pub group_id: i64,
    pub candidates: &'a [Candidate],
    /// Ids of exception rows this claim decides: candidates (not their own blockers) and rows it
    /// dead-letters (resolved by this claim).
    pub exception_ids: &'a [i64],
    /// First ids of the ranges this claim hands out (their pending messages are candidates).
    pub own_ranges: Vec<i64>,
    /// The lanes the claim took.
    pub lanes: Vec<i32>,
    /// The group's `on_dead = 'hold'`: dead rows count for check 1.
    pub hold_on_dead: bool,
}

/// What `gather` read.
pub struct Gathered {
    /// The facts of the keys that need them.
    pub facts: HashMap<String, KeyFacts>,
    /// The claim has a key to gate, and nothing could block one: the group has no unresolved
    /// exception row, and no range but the claim's own is open in the lanes it took.
    pub nothing_waits: bool,
}

/// Reads the facts `gate` needs, only for the keys that need them.
pub fn gather(client: &SpiClient<'_>, input: &GatherInput<'_>) -> Result<Gathered> {
    let mut facts: HashMap<String, KeyFacts> = HashMap::new();
    let timestamp = |micros: Option<pgrx::datum::TimestampWithTimeZone>| micros.map(|t| t.into_inner()).unwrap_or(0);
    let gated = input.candidates.iter().any(|c| c.key.is_some() && c.concurrency.is_keyed_gate());
    // The keys are gathered only once something could block one: as a rule nothing does.
    let may_block = gated && any_blocker::may_block(client, input)?;
    if may_block {
        let mut ordered: HashMap<&str, i64> = HashMap::with_capacity(input.candidates.len()); // key -> highest id
        let mut exclusive: Vec<&str> = Vec::new();
        for c in input.candidates {
            let Some(key) = c.key.as_deref() else { continue };
            match c.concurrency {
                Concurrency::Ordered => {
                    let upto = ordered.entry(key).or_default();
                    *upto = (*upto).max(c.message_id);
                }
                Concurrency::Exclusive => exclusive.push(key),
                Concurrency::Parallel => {}
            }
        }
        exclusive.sort_unstable();
        exclusive.dedup();
        let (keys, uptos): (Vec<&str>, Vec<i64>) = ordered.iter().map(|(k, v)| (*k, *v)).unzip();
        let gated_keys: Vec<&str> = keys.iter().chain(&exclusive).copied().collect();
        let rows = CHECK.run(
            client,
            input.stream_id,
            &[
                input.group_id.into(),
                keys.into(),
                uptos.into(),
                input.exception_ids.to_vec().into(),
                input.own_ranges.clone().into(),
                gated_keys.into(),
                input.lanes.clone().into(),
                exclusive.into(),
                input.hold_on_dead.into(),
            ],
        )?;
        for row in rows {
            let kind: i32 = row.required("kind")?;
            let key: String = row.required("message_key")?;
            let blocker =
                Blocker { message_id: row.required("blocker")?, clears_at: timestamp(row.value("clears_at")?) };
            let facts = facts.entry(key).or_default();
            match kind {
                1 => facts.unresolved = Some(blocker),
                2 => {
                    facts.pending_elsewhere = Some(blocker);
                    if let Some(message_id) = row.value("holder")? {
                        let clears_at = timestamp(row.value("holder_clears")?);
                        facts.held_elsewhere = Some(Blocker { message_id, clears_at });
                    }
                }
                _ => facts.inflight_elsewhere = Some(blocker),
            }
        }
    }
    let mut compacted: Vec<&str> = input
        .candidates
        .iter()
        .filter(|c| c.compaction && c.concurrency != Concurrency::Ordered)
        .filter_map(|c| c.key.as_deref())
        .collect();
    compacted.sort_unstable();
    compacted.dedup();
    if !compacted.is_empty() {
        for row in COMPACTION_HEADS.run(client, input.stream_id, &[compacted.into()])? {
            let key: String = row.required("message_key")?;
            facts.entry(key).or_default().compaction_head = row.value("message_id")?;
        }
    }
    Ok(Gathered { facts, nothing_waits: gated && !may_block })
}

#[cfg(test)]
mod tests {
    use super::*;
    use Concurrency::*;

    const NOW: i64 = 1_000_000_000;
    const LEASE: i64 = NOW + 30_000_000;

    fn c(id: i64, key: Option<&str>, concurrency: Concurrency) -> Candidate {
        Candidate { message_id: id, key: key.map(Key::new), concurrency, compaction: false, lane: 0 }
    }

    fn compacted(id: i64, key: &str, concurrency: Concurrency) -> Candidate {
        Candidate { compaction: true, ..c(id, Some(key), concurrency) }
    }

    fn facts(key: &str, f: KeyFacts) -> HashMap<String, KeyFacts> {
        HashMap::from_iter([(key.to_string(), f)])
    }

    fn run(after: Option<i64>) -> Verdict {
        Verdict::Run { run_after: after }
    }

    #[test]
    fn same_key_ordered_rows_form_one_chain() {
        let cands = [
            c(101, Some("acct-42"), Ordered),
            c(102, Some("acct-7"), Ordered),
            c(103, Some("acct-42"), Ordered),
            c(104, None, Ordered),
            c(105, Some("acct-42"), Ordered),
        ];
        let g = gate(&cands, &HashMap::new(), LEASE, NOW, false);
        assert_eq!(g, vec![run(None), run(None), run(Some(101)), run(None), run(Some(103))]);
    }

    #[test]
    fn an_unresolved_predecessor_defers_the_whole_key() {
        let retry_at = NOW + 5_000_000;
        let f = facts(
            "acct-42",
            KeyFacts { unresolved: Some(Blocker { message_id: 101, clears_at: retry_at }), ..Default::default() },
        );
        let cands =
            [c(102, Some("acct-42"), Ordered), c(103, Some("acct-42"), Ordered), c(104, Some("acct-9"), Ordered)];
        let g = gate(&cands, &f, LEASE, NOW, false);
        assert_eq!(g, vec![Verdict::Defer { until: retry_at }, Verdict::Defer { until: retry_at }, run(None)]);
    }

    #[test]
    fn a_later_blocker_defers_only_what_follows_it() {
        // An unresolved row 150 of the key sits between candidates 101 and 160.
        let f = facts(
            "k",
            KeyFacts { unresolved: Some(Blocker { message_id: 150, clears_at: NOW }), ..Default::default() },
        );
        let g = gate(&[c(101, Some("k"), Ordered), c(160, Some("k"), Ordered)], &f, LEASE, NOW, false);
        assert_eq!(g, vec![run(None), Verdict::Defer { until: NOW + MIN_PARK_MICROS }]);
    }

    #[test]
    fn pending_in_another_range_defers_until_that_lease_expires() {
        let expiry = NOW + 20_000_000;
        let f = facts(
            "k",
            KeyFacts { pending_elsewhere: Some(Blocker { message_id: 90, clears_at: expiry }), ..Default::default() },
        );
        let g = gate(&[c(101, Some("k"), Ordered)], &f, LEASE, NOW, false);
        assert_eq!(g, vec![Verdict::Defer { until: expiry }]);
    }

    #[test]
    fn ordered_waits_for_an_earlier_parallel_row_of_the_same_result() {
        let g = gate(&[c(101, Some("k"), Parallel), c(102, Some("k"), Ordered)], &HashMap::new(), LEASE, NOW, false);
        assert_eq!(g, vec![run(None), Verdict::Defer { until: LEASE }]);
    }

    #[test]
    fn exclusive_waits_for_a_parallel_row_of_the_same_result() {
        let g = gate(&[c(101, Some("k"), Parallel), c(102, Some("k"), Exclusive)], &HashMap::new(), LEASE, NOW, false);
        assert_eq!(g, vec![run(None), Verdict::Defer { until: LEASE }]);
    }

    #[test]
    fn exclusive_takes_one_lease_per_key_and_chains_the_rest() {
        let cands = [c(101, Some("a"), Exclusive), c(102, Some("a"), Exclusive), c(103, Some("b"), Exclusive)];
        let g = gate(&cands, &HashMap::new(), LEASE, NOW, false);
        assert_eq!(g, vec![run(None), run(Some(101)), run(None)]);
    }

    #[test]
    fn exclusive_defers_while_another_delivery_holds_the_key() {
        let held = NOW + 10_000_000;
        let f = facts(
            "a",
            KeyFacts { inflight_elsewhere: Some(Blocker { message_id: 90, clears_at: held }), ..Default::default() },
        );
        let g = gate(&[c(101, Some("a"), Exclusive), c(102, Some("a"), Exclusive)], &f, LEASE, NOW, false);
        assert_eq!(g, vec![Verdict::Defer { until: held }, Verdict::Defer { until: held }]);
        // A later same-key message pending in another range a consumer holds holds the key too.
        let pending = Some(Blocker { message_id: 500, clears_at: held });
        let f = facts("a", KeyFacts { pending_elsewhere: pending, held_elsewhere: pending, ..Default::default() });
        assert_eq!(gate(&[c(101, Some("a"), Exclusive)], &f, LEASE, NOW, false), vec![Verdict::Defer { until: held }]);
    }

    #[test]
    fn the_rest_of_a_split_range_holds_no_exclusive_key_but_stays_an_ordered_predecessor() {
        // Message 150 is pending only in the rest a claim split off an expired range.
        let rest =
            KeyFacts { pending_elsewhere: Some(Blocker { message_id: 150, clears_at: NOW }), ..Default::default() };
        let g = gate(
            &[c(101, Some("a"), Exclusive), c(160, Some("a"), Exclusive)],
            &facts("a", rest.clone()),
            LEASE,
            NOW,
            false,
        );
        assert_eq!(g, vec![run(None), run(Some(101))]);
        let g = gate(&[c(101, Some("a"), Ordered), c(160, Some("a"), Ordered)], &facts("a", rest), LEASE, NOW, false);
        assert_eq!(g, vec![run(None), Verdict::Defer { until: NOW + MIN_PARK_MICROS }]);
    }

    #[test]
    fn exclusive_ignores_earlier_unresolved_rows() {
        // 101 waits for its retry; exclusive may run 102 first (the ordering guide's reorder).
        let f = facts(
            "acct-42",
            KeyFacts { unresolved: Some(Blocker { message_id: 101, clears_at: NOW + 9 }), ..Default::default() },
        );
        let g = gate(&[c(102, Some("acct-42"), Exclusive)], &f, LEASE, NOW, false);
        assert_eq!(g, vec![run(None)]);
    }

    #[test]
    fn compaction_supersedes_all_but_the_head() {
        let f = facts("k", KeyFacts { compaction_head: Some(103), ..Default::default() });
        let cands = [compacted(101, "k", Exclusive), compacted(102, "k", Exclusive), compacted(103, "k", Exclusive)];
        let g = gate(&cands, &f, LEASE, NOW, false);
        assert_eq!(g, vec![Verdict::Supersede, Verdict::Supersede, run(None)]);
        let parallel = [compacted(101, "k", Parallel), compacted(103, "k", Parallel)];
        assert_eq!(gate(&parallel, &f, LEASE, NOW, false), vec![Verdict::Supersede, run(None)]);
    }

    #[test]
    fn ordered_never_supersedes() {
        let f = facts("k", KeyFacts { compaction_head: Some(103), ..Default::default() });
        let g = gate(&[compacted(101, "k", Ordered), compacted(103, "k", Ordered)], &f, LEASE, NOW, false);
        assert_eq!(g, vec![run(None), run(Some(101))]);
    }

    #[test]
    fn keyless_and_parallel_rows_always_run() {
        let f = facts(
            "k",
            KeyFacts {
                unresolved: Some(Blocker { message_id: 1, clears_at: NOW }),
                inflight_elsewhere: Some(Blocker { message_id: 2, clears_at: LEASE }),
                ..Default::default()
            },
        );
        let g =
            gate(&[c(5, None, Ordered), c(6, Some("k"), Parallel), c(7, Some("k"), Parallel)], &f, LEASE, NOW, false);
        assert_eq!(g, vec![run(None), run(None), run(None)]);
    }

    #[test]
    fn holding_on_dead_runs_one_ordered_message_per_key_and_never_passes_a_dead_one() {
        let cands = [c(101, Some("k"), Ordered), c(102, Some("k"), Ordered), c(103, Some("j"), Ordered)];
        let g = gate(&cands, &HashMap::new(), LEASE, NOW, true);
        assert_eq!(g, vec![run(None), Verdict::Defer { until: NOW }, run(None)]);
        // Check 1 found a dead row of the key (it never clears on its own).
        let f = facts(
            "k",
            KeyFacts { unresolved: Some(Blocker { message_id: 90, clears_at: i64::MAX }), ..Default::default() },
        );
        let g = gate(&cands[..2], &f, LEASE, NOW, true);
        assert_eq!(g, vec![Verdict::Defer { until: i64::MAX }; 2]);
    }
}
