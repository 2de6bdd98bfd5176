//! The key gate: for each message a claim could hand out, decide whether it runs now (and
//! behind which earlier row of the same result), waits, or is superseded.
//!
//! The decision (`gate`) is pure; `gather` reads the facts it needs in a handful of set-based
//! statements per claim:
//! - ordered, check 1: the earliest unresolved exception row of the key outside this claim;
//! - ordered, check 2: the earliest same-key message still pending in another open range;
//! - exclusive: a live key lease held by another delivery;
//! - compaction: the key's compaction head.
//!
//! Both ordered checks are exact per key: a different key stuck in retry never holds this key.
//!
//! ## Parking and wake-ups
//!
//! A waiting row is parked until its blocker could clear on its own, and every resolution wakes
//! the key's parked rows (src/exception_queue/lifecycle.rs). A wake-up must not be lost between a claim
//! that parks rows of a key and an outcome that resolves that key at the same moment, each
//! unable to see the other's uncommitted rows. So both take the key's lock (src/locks.rs): an
//! outcome shared, before it releases or wakes anything; a claim exclusive, before it parks,
//! and then it gathers the facts again. If the claim got the lock, every earlier outcome on the
//! key has committed (the claim's second look sees it) and every later one waits for the claim
//! to commit (its wake-up sees the parked rows). If an outcome holds the lock right now, the
//! claim does not wait (it holds the cursor row, and the outcome may be a claim's carried ack
//! waiting for that row): it leaves the row due instead of parked, and the next claim looks
//! again.

use std::collections::HashMap;

use pgrx::pg_sys::BuiltinOid::*;
use pgrx::spi::SpiClient;

use crate::concurrency::Concurrency;
use crate::error::Result;
use crate::statement::{self, Columns, Statement};

/// A row that would wait is parked at least this long (microseconds), unless a resolution wakes
/// it earlier. Keeps a blocked row from being re-examined by every claim.
pub const MIN_PARK_MICROS: i64 = 1_000_000;

/// A message a claim could hand out.
#[derive(Clone, Debug, PartialEq)]
pub struct Candidate {
    pub message_id: i64,
    pub key: Option<String>,
    /// Resolved for the group (see `concurrency::resolve`).
    pub concurrency: Concurrency,
    pub compaction: bool,
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
    /// Check 1: an unresolved exception row of the key that is not part of this claim.
    pub unresolved: Option<Blocker>,
    /// Check 2: a same-key message pending in another open range.
    pub pending_elsewhere: Option<Blocker>,
    /// Expiry of a live key lease held by another delivery.
    pub leased_until: Option<i64>,
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

#[derive(Clone, Debug, PartialEq)]
pub struct Gated {
    /// One verdict per candidate, in candidate order.
    pub verdicts: Vec<Verdict>,
    /// Keys whose exclusive lease this claim takes.
    pub lease_keys: Vec<String>,
}

#[derive(Default)]
struct KeyState {
    /// The last gated row of the key that runs in this result.
    chain_tail: Option<i64>,
    /// Set once a gated row of the key waits: every later gated row of the key waits too.
    blocked_until: Option<i64>,
    /// A parallel row of the key runs in this result (an ordered row must not overtake it).
    parallel_running: bool,
    lease_taken: bool,
}

/// Decides every candidate. `candidates` must be sorted by message id; `lease_expires` is this
/// claim's lease expiry, `now` the call time.
pub fn gate(candidates: &[Candidate], facts: &HashMap<String, KeyFacts>, lease_expires: i64, now: i64) -> Gated {
    let no_facts = KeyFacts::default();
    let mut states: HashMap<&str, KeyState> = HashMap::new();
    let mut lease_keys = Vec::new();
    let verdicts = candidates
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
            let state = states.entry(key).or_default();
            if c.concurrency == Concurrency::Parallel {
                state.parallel_running = true;
                return Verdict::Run { run_after: None };
            }
            if let Some(until) = state.blocked_until {
                return Verdict::Defer { until };
            }
            let earlier = |b: Option<Blocker>| b.filter(|b| b.message_id < c.message_id).map(|b| b.clears_at);
            let blocked = match c.concurrency {
                Concurrency::Ordered => [
                    earlier(facts.unresolved),
                    earlier(facts.pending_elsewhere),
                    state.parallel_running.then_some(lease_expires),
                ]
                .into_iter()
                .flatten()
                .min(),
                Concurrency::Exclusive if !state.lease_taken => facts.leased_until,
                _ => None,
            };
            if let Some(clears_at) = blocked {
                let until = clears_at.max(now + MIN_PARK_MICROS);
                state.blocked_until = Some(until);
                return Verdict::Defer { until };
            }
            if c.concurrency == Concurrency::Exclusive && !state.lease_taken {
                state.lease_taken = true;
                lease_keys.push(key.to_string());
            }
            let run_after = state.chain_tail.replace(c.message_id);
            Verdict::Run { run_after }
        })
        .collect();
    Gated { verdicts, lease_keys }
}

/// Both ordered checks in one statement, so they read one snapshot: a message moving from a
/// range's pending list into the exception queue (a concurrent `fail`) is seen in one place or
/// the other, never in neither. Kind 1: the earliest unresolved exception row of the key below
/// the key's last candidate, outside this claim. Kind 2: the earliest same-key message pending
/// in another open range.
const CHECK_ORDERED: Statement = Statement {
    name: "gate_check_ordered",
    sql: "SELECT 1 AS kind, k.message_key, min(e.message_id) AS blocker,
                 min(CASE WHEN e.status = 'inflight' THEN e.lease_expires_at ELSE e.can_run_after END) AS clears_at
          FROM unnest($2::text[], $3::bigint[]) AS k(message_key, upto)
          JOIN sqlstreams.exception_queue_@id@ e
            ON e.consumer_group_id = $1 AND e.message_key = k.message_key AND e.message_id < k.upto
          WHERE e.status IN ('ready', 'inflight', 'deferred') AND e.message_id <> ALL($4)
          GROUP BY k.message_key
          UNION ALL
          SELECT 2, u.message_key, min(u.id), min(r.lease_expires_at)
          FROM sqlstreams.range_lease_@id@ r
          CROSS JOIN LATERAL unnest(r.pending, r.pending_keys) AS u(id, message_key)
          WHERE r.consumer_group_id = $1 AND r.first_id <> $5 AND u.message_key = ANY($2)
          GROUP BY u.message_key",
    params: &[INT8OID, TEXTARRAYOID, INT8ARRAYOID, INT8ARRAYOID, INT8OID],
};

/// Key leases held by another delivery. An expired lease is taken over by this claim, so it is
/// locked here (`SKIP LOCKED`: a claim never waits); one that cannot be locked is being released
/// or extended by an outcome right now and counts as held until `$3`.
const KEY_LEASES: Statement = Statement {
    name: "gate_key_leases",
    sql: "WITH taken_over AS (
              SELECT message_key FROM sqlstreams.message_key_lease_@id@
              WHERE consumer_group_id = $1 AND message_key = ANY($2) AND lease_expires_at <= $3
              FOR UPDATE SKIP LOCKED)
          SELECT l.message_key, greatest(l.lease_expires_at, $3) AS held_until
          FROM sqlstreams.message_key_lease_@id@ l
          WHERE l.consumer_group_id = $1 AND l.message_key = ANY($2)
            AND l.message_key NOT IN (SELECT message_key FROM taken_over)",
    params: &[INT8OID, TEXTARRAYOID, TIMESTAMPTZOID],
};

const COMPACTION_HEADS: Statement = Statement {
    name: "gate_compaction_heads",
    sql: "SELECT message_key, message_id FROM sqlstreams.compaction_head_@id@ WHERE message_key = ANY($1)",
    params: &[TEXTARRAYOID],
};

const TAKE_LEASES: Statement = Statement {
    name: "gate_take_leases",
    sql: "INSERT INTO sqlstreams.message_key_lease_@id@ AS l (consumer_group_id, message_key, lease_token, lease_expires_at)
          SELECT $1, k, $3, $4 FROM unnest($2::text[]) AS k
          ON CONFLICT (consumer_group_id, message_key) DO UPDATE
              SET lease_token = EXCLUDED.lease_token, lease_expires_at = EXCLUDED.lease_expires_at
              WHERE l.lease_expires_at <= $5",
    params: &[INT8OID, TEXTARRAYOID, UUIDOID, TIMESTAMPTZOID, TIMESTAMPTZOID],
};

/// Keys of the candidates the gate defers.
pub fn deferred_keys(candidates: &[Candidate], verdicts: &[Verdict]) -> Vec<String> {
    let mut keys: Vec<String> = candidates
        .iter()
        .zip(verdicts)
        .filter(|(_, v)| matches!(v, Verdict::Defer { .. }))
        .filter_map(|(c, _)| c.key.clone())
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
    /// First id of the range this claim hands out (its own pending messages are candidates).
    pub own_range_first: Option<i64>,
    pub now: i64,
}

/// Reads the facts `gate` needs, only for the keys that need them.
pub fn gather(client: &SpiClient<'_>, input: &GatherInput<'_>) -> Result<HashMap<String, KeyFacts>> {
    let mut facts: HashMap<String, KeyFacts> = HashMap::new();
    let mut ordered: HashMap<&str, i64> = HashMap::new(); // key -> highest candidate id
    let mut exclusive: Vec<&str> = Vec::new();
    let mut compacted: Vec<&str> = Vec::new();
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
        if c.compaction && c.concurrency != Concurrency::Ordered {
            compacted.push(key);
        }
    }
    exclusive.sort_unstable();
    exclusive.dedup();
    compacted.sort_unstable();
    compacted.dedup();
    let timestamp = |micros: Option<pgrx::datum::TimestampWithTimeZone>| micros.map(|t| t.into_inner()).unwrap_or(0);

    if !ordered.is_empty() {
        let (keys, uptos): (Vec<&str>, Vec<i64>) = ordered.iter().map(|(k, v)| (*k, *v)).unzip();
        let own = input.own_range_first.unwrap_or(-1);
        let rows = CHECK_ORDERED.run(
            client,
            input.stream_id,
            &[input.group_id.into(), keys.into(), uptos.into(), input.exception_ids.to_vec().into(), own.into()],
        )?;
        for row in rows {
            let kind: i32 = row.required("kind")?;
            let key: String = row.required("message_key")?;
            let blocker =
                Blocker { message_id: row.required("blocker")?, clears_at: timestamp(row.value("clears_at")?) };
            let facts = facts.entry(key).or_default();
            if kind == 1 {
                facts.unresolved = Some(blocker);
            } else {
                facts.pending_elsewhere = Some(blocker);
            }
        }
    }
    if !exclusive.is_empty() {
        let rows = KEY_LEASES.run(
            client,
            input.stream_id,
            &[input.group_id.into(), exclusive.into(), statement::timestamptz(input.now)],
        )?;
        for row in rows {
            let key: String = row.required("message_key")?;
            facts.entry(key).or_default().leased_until = Some(timestamp(row.value("held_until")?));
        }
    }
    if !compacted.is_empty() {
        for row in COMPACTION_HEADS.run(client, input.stream_id, &[compacted.into()])? {
            let key: String = row.required("message_key")?;
            facts.entry(key).or_default().compaction_head = row.value("message_id")?;
        }
    }
    Ok(facts)
}

/// Takes the exclusive leases the gate granted. Claims of a group are serialized and only claims
/// create lease rows; an expired row this claim takes over is locked by `gather`. So a key the
/// gate saw free is free, and this never waits; a key that is not is a broken invariant, not a
/// race to paper over.
pub fn take_leases(
    client: &SpiClient<'_>,
    stream_id: i64,
    group_id: i64,
    keys: &[String],
    token: pgrx::Uuid,
    expires: i64,
    now: i64,
) -> Result<()> {
    if keys.is_empty() {
        return Ok(());
    }
    let taken = TAKE_LEASES.run(
        client,
        stream_id,
        &[
            group_id.into(),
            keys.to_vec().into(),
            token.into(),
            statement::timestamptz(expires),
            statement::timestamptz(now),
        ],
    )?;
    assert_eq!(taken.len(), keys.len(), "a key lease the gate saw free was held");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use Concurrency::*;

    const NOW: i64 = 1_000_000_000;
    const LEASE: i64 = NOW + 30_000_000;

    fn c(id: i64, key: Option<&str>, concurrency: Concurrency) -> Candidate {
        Candidate { message_id: id, key: key.map(str::to_string), concurrency, compaction: false }
    }

    fn compacted(id: i64, key: &str, concurrency: Concurrency) -> Candidate {
        Candidate { compaction: true, ..c(id, Some(key), concurrency) }
    }

    fn facts(key: &str, f: KeyFacts) -> HashMap<String, KeyFacts> {
        HashMap::from([(key.to_string(), f)])
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
        let g = gate(&cands, &HashMap::new(), LEASE, NOW);
        assert_eq!(g.verdicts, vec![run(None), run(None), run(Some(101)), run(None), run(Some(103))]);
        assert!(g.lease_keys.is_empty(), "ordered delivery takes no key lease");
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
        let g = gate(&cands, &f, LEASE, NOW);
        assert_eq!(g.verdicts, vec![Verdict::Defer { until: retry_at }, Verdict::Defer { until: retry_at }, run(None)]);
    }

    #[test]
    fn a_later_blocker_defers_only_what_follows_it() {
        // An unresolved row 150 of the key sits between candidates 101 and 160.
        let f = facts(
            "k",
            KeyFacts { unresolved: Some(Blocker { message_id: 150, clears_at: NOW }), ..Default::default() },
        );
        let g = gate(&[c(101, Some("k"), Ordered), c(160, Some("k"), Ordered)], &f, LEASE, NOW);
        assert_eq!(g.verdicts, vec![run(None), Verdict::Defer { until: NOW + MIN_PARK_MICROS }]);
    }

    #[test]
    fn pending_in_another_range_defers_until_that_lease_expires() {
        let expiry = NOW + 20_000_000;
        let f = facts(
            "k",
            KeyFacts { pending_elsewhere: Some(Blocker { message_id: 90, clears_at: expiry }), ..Default::default() },
        );
        let g = gate(&[c(101, Some("k"), Ordered)], &f, LEASE, NOW);
        assert_eq!(g.verdicts, vec![Verdict::Defer { until: expiry }]);
    }

    #[test]
    fn ordered_waits_for_an_earlier_parallel_row_of_the_same_result() {
        let g = gate(&[c(101, Some("k"), Parallel), c(102, Some("k"), Ordered)], &HashMap::new(), LEASE, NOW);
        assert_eq!(g.verdicts, vec![run(None), Verdict::Defer { until: LEASE }]);
    }

    #[test]
    fn exclusive_takes_one_lease_per_key_and_chains_the_rest() {
        let cands = [c(101, Some("a"), Exclusive), c(102, Some("a"), Exclusive), c(103, Some("b"), Exclusive)];
        let g = gate(&cands, &HashMap::new(), LEASE, NOW);
        assert_eq!(g.verdicts, vec![run(None), run(Some(101)), run(None)]);
        assert_eq!(g.lease_keys, vec!["a".to_string(), "b".to_string()]);
    }

    #[test]
    fn exclusive_defers_while_another_delivery_holds_the_key() {
        let held = NOW + 10_000_000;
        let f = facts("a", KeyFacts { leased_until: Some(held), ..Default::default() });
        let g = gate(&[c(101, Some("a"), Exclusive), c(102, Some("a"), Exclusive)], &f, LEASE, NOW);
        assert_eq!(g.verdicts, vec![Verdict::Defer { until: held }, Verdict::Defer { until: held }]);
        assert!(g.lease_keys.is_empty());
    }

    #[test]
    fn exclusive_ignores_earlier_unresolved_rows() {
        // 101 waits for its retry; exclusive may run 102 first (the ordering guide's reorder).
        let f = facts(
            "acct-42",
            KeyFacts { unresolved: Some(Blocker { message_id: 101, clears_at: NOW + 9 }), ..Default::default() },
        );
        let g = gate(&[c(102, Some("acct-42"), Exclusive)], &f, LEASE, NOW);
        assert_eq!(g.verdicts, vec![run(None)]);
    }

    #[test]
    fn compaction_supersedes_all_but_the_head() {
        let f = facts("k", KeyFacts { compaction_head: Some(103), ..Default::default() });
        let cands = [compacted(101, "k", Exclusive), compacted(102, "k", Exclusive), compacted(103, "k", Exclusive)];
        let g = gate(&cands, &f, LEASE, NOW);
        assert_eq!(g.verdicts, vec![Verdict::Supersede, Verdict::Supersede, run(None)]);
        let parallel = [compacted(101, "k", Parallel), compacted(103, "k", Parallel)];
        assert_eq!(gate(&parallel, &f, LEASE, NOW).verdicts, vec![Verdict::Supersede, run(None)]);
    }

    #[test]
    fn ordered_never_supersedes() {
        let f = facts("k", KeyFacts { compaction_head: Some(103), ..Default::default() });
        let g = gate(&[compacted(101, "k", Ordered), compacted(103, "k", Ordered)], &f, LEASE, NOW);
        assert_eq!(g.verdicts, vec![run(None), run(Some(101))]);
    }

    #[test]
    fn keyless_and_parallel_rows_always_run() {
        let f = facts(
            "k",
            KeyFacts {
                unresolved: Some(Blocker { message_id: 1, clears_at: NOW }),
                leased_until: Some(LEASE),
                ..Default::default()
            },
        );
        let g = gate(&[c(5, None, Ordered), c(6, Some("k"), Parallel), c(7, Some("k"), Parallel)], &f, LEASE, NOW);
        assert_eq!(g.verdicts, vec![run(None), run(None), run(None)]);
    }
}
