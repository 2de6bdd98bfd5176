//! The life of a message in a consumer group, told by its exception-queue row. Every state
//! change is one function here; the claim (src/claim.rs), the outcomes (src/outcome.rs) and the
//! lease calls (src/lease.rs) decide *when*, these functions decide *what*.
//!
//! ```text
//! message of a claimed range (no row)
//!   ├─ handler succeeds ........................ no row, ever            (succeed: range side)
//!   ├─ fails or is delayed ..................... ready | dead            setback_first_delivery
//!   ├─ must wait for its key ................... deferred (parked)       defer_behind
//!   ├─ a newer compacted message of its key .... superseded             supersede
//!   ├─ an earlier row of its chain failed ...... deferred (parked)       defer_chain
//!   ├─ given back unstarted .................... ready, due now          give_back
//!   ├─ its range kept expiring ................. ready, isolated, due now quarantine
//!   └─ produced with a deliver_after to come ... ready, due then          delayed
//! ready | deferred, once due
//!   ├─ the gate lets it run .................... inflight (leased)       hand_out
//!   ├─ still blocked ........................... same status, parked     defer_behind
//!   └─ superseded .............................. superseded             supersede
//! inflight
//!   ├─ ack ..................................... row deleted            succeed
//!   ├─ fail / delay ............................ ready | dead            setback_again
//!   ├─ lease runs out, next claim .............. attempt counted: handed out again | dead   expire
//!   ├─ lease ran out, the claim has no room .... inflight, expired, no one's token   take_over_left
//!   ├─ later rows of its chain ................. deferred (parked)       defer_chain
//!   └─ given back unstarted .................... ready, due now          give_back
//! parked (any waiting row)
//!   └─ its key's blocker resolves .............. due now                wake (after_resolution)
//! dead, superseded: resolved, kept for triage.
//! ```
//!
//! `ready`, `inflight` and `deferred` are unresolved: they hold the group's `committed` cursor
//! and, for ordered keys, every later message of the key.

use pgrx::pg_sys::BuiltinOid::*;
use pgrx::spi::SpiClient;

use super::{Change, NewRow, RowUpdate, Status};
use crate::backoff::Setback;
use crate::concurrency::Concurrency;
use crate::error::Result;
use crate::group::GroupRef;
use crate::key_gate::Candidate;
use crate::locks;
use crate::message;
use crate::notify;
use crate::range::{RangeLease, Ranges};
use crate::statement::{self, Columns, Statement};

/// What a failure or a delay does to a queue row (the type is backoff.rs's, which computes it).
impl Setback {
    pub fn status(self) -> Status {
        match self {
            Setback::Retry { .. } => Status::Ready,
            Setback::Dead { .. } => Status::Dead,
        }
    }

    fn columns(self, now: i64) -> (i32, i32, i64) {
        match self {
            Setback::Retry { attempts, delays, can_run_after } => (attempts, delays, can_run_after),
            Setback::Dead { attempts, delays, .. } => (attempts, delays, now),
        }
    }

    fn error(self, error: Option<String>) -> Option<String> {
        match self {
            Setback::Dead { note: Some(note), .. } => Some(note.to_string()),
            _ => error,
        }
    }
}

/// Where a message stands when a claim decides it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Held {
    /// In the range this claim hands out: it has no row.
    Range,
    /// An exception row with its status before this claim; `expired` when it was inflight and
    /// its lease ran out.
    Row { status: Status, expired: bool },
}

/// Why an expired delivery's row records it.
pub const LEASE_EXPIRED: &str = "the delivery's lease expired before an outcome was recorded";

fn new_row(c: &Candidate, status: Status, can_run_after: i64) -> NewRow {
    NewRow {
        message_id: c.message_id,
        key: c.key.as_deref().map(str::to_owned),
        concurrency: c.concurrency,
        compaction: c.compaction,
        status,
        attempts: 0,
        delays: 0,
        can_run_after,
        parked: false,
        isolated: false,
        last_error: None,
        lane: c.lane,
    }
}

/// The first delivery (from a range) failed or was delayed: its first row, `ready` or `dead`.
pub fn setback_first_delivery(c: &Candidate, setback: Setback, error: Option<String>, now: i64) -> NewRow {
    let (attempts, delays, can_run_after) = setback.columns(now);
    NewRow { attempts, delays, last_error: setback.error(error), ..new_row(c, setback.status(), can_run_after) }
}

/// A delivery from the queue failed or was delayed: `inflight` → `ready` or `dead`.
pub fn setback_again(message_id: i64, setback: Setback, error: Option<String>, now: i64) -> RowUpdate {
    let (attempts, delays, can_run_after) = setback.columns(now);
    RowUpdate {
        message_id,
        status: setback.status(),
        attempts,
        delays: Some(delays),
        can_run_after: Some(can_run_after),
        parked: false,
        lease: None,
        last_error: setback.error(error),
    }
}

/// The gate lets it run under the claim's lease: a row goes `inflight`; a range message needs
/// no row (its range lease covers it).
pub fn hand_out(held: &Held, message_id: i64, attempts: i32, token: pgrx::Uuid, expires: i64) -> Option<RowUpdate> {
    let Held::Row { expired, .. } = held else { return None };
    Some(RowUpdate {
        message_id,
        status: Status::Inflight,
        attempts,
        delays: None,
        can_run_after: None,
        parked: false,
        lease: Some((token, expires)),
        last_error: expired.then(|| LEASE_EXPIRED.into()),
    })
}

/// It must wait (its key is in flight elsewhere, or an earlier message of its key is
/// unresolved): a range message becomes `deferred`; a row keeps its status (a retry stays `ready`) and waits. Parked
/// rows wait until `until` unless a resolution of their key wakes them first.
pub fn defer_behind(held: &Held, c: &Candidate, attempts: i32, until: i64, parked: bool) -> Change {
    match held {
        Held::Range => Change::Insert(NewRow { parked, ..new_row(c, Status::Deferred, until) }),
        Held::Row { status, expired } => Change::Update(RowUpdate {
            message_id: c.message_id,
            status: if *status == Status::Deferred { Status::Deferred } else { Status::Ready },
            attempts,
            delays: None,
            can_run_after: Some(until),
            parked,
            lease: None,
            last_error: expired.then(|| LEASE_EXPIRED.into()),
        }),
    }
}

/// A newer compacted message of its key exists: `superseded`, resolved, never runs.
pub fn supersede(held: &Held, c: &Candidate, attempts: i32, now: i64) -> Change {
    match held {
        Held::Range => Change::Insert(new_row(c, Status::Superseded, now)),
        Held::Row { .. } => Change::Update(RowUpdate {
            message_id: c.message_id,
            status: Status::Superseded,
            attempts,
            delays: None,
            can_run_after: None,
            parked: false,
            lease: None,
            last_error: None,
        }),
    }
}

/// What a claim does with an `inflight` row whose lease ran out.
pub enum Expired {
    /// The lost delivery counts as a failed attempt; the row may be handed out again.
    Again { attempts: i32 },
    /// That attempt spent the retry budget.
    Dead(RowUpdate),
}

/// Expired deliveries in lane `$2` under a consumer's token, but for rows the claim took
/// (`$5`), moved under token `$3`; rows an outcome is recording are passed by.
const TAKE_OVER_LEFT: Statement = Statement {
    name: "eq_take_over_left",
    sql: concat!(
        "UPDATE sqlstreams.exception_queue_@id@ e SET lease_token = $3, updated_at = $4
         FROM (SELECT message_id FROM sqlstreams.exception_queue_@id@
               WHERE consumer_group_id = $1 AND lane = $2 AND status = 'inflight' AND lease_expires_at <= $4
                 AND ",
        crate::token::held_by_a_consumer!("lease_token"),
        " AND message_id <> ALL($5)
               FOR UPDATE SKIP LOCKED) left_over
         WHERE e.consumer_group_id = $1 AND e.message_id = left_over.message_id"
    ),
    params: &[INT8OID, INT4OID, UUIDOID, TIMESTAMPTZOID, INT8ARRAYOID],
};

/// A claim took `lane` while deliveries of its rows had expired, and hands out only those it has
/// room for (`taken`): the others are taken over too, still expired, under a token no consumer
/// holds (`token::no_ones`), for the next claim, which counts their expiry. Left under their
/// consumer's token, they would hold their exclusive keys (`extend_lease` could still renew
/// them), and the work the claim took would wait for them.
pub fn take_over_left(client: &SpiClient<'_>, group: &GroupRef, lane: i32, taken: &[i64], now: i64) -> Result<()> {
    let args = [
        group.id.into(),
        lane.into(),
        crate::token::no_ones().into(),
        statement::timestamptz(now),
        taken.to_vec().into(),
    ];
    TAKE_OVER_LEFT.run(client, group.stream.id, &args)?;
    Ok(())
}

/// An expired delivery counts as a failed attempt (`attempts` is the row's count before it).
pub fn expire(message_id: i64, attempts: i32, max_retries: i32) -> Expired {
    let attempts = attempts + 1;
    if attempts <= max_retries {
        return Expired::Again { attempts };
    }
    Expired::Dead(RowUpdate {
        message_id,
        status: Status::Dead,
        attempts,
        delays: None,
        can_run_after: None,
        parked: false,
        lease: None,
        last_error: Some(LEASE_EXPIRED.into()),
    })
}

/// A message of a range that kept expiring: an isolated `ready` row, due now, with no failure
/// counted. It is handed out alone until it resolves, so only its own deliveries count against
/// it: one poison message never dead-letters its innocent range-mates.
pub fn quarantine(c: &Candidate, range: &RangeLease, now: i64) -> NewRow {
    let error = format!(
        "quarantined: the range {}..{} was handed out {} times and its lease expired each time",
        range.first_id,
        range.last_id,
        range.reclaims + 1
    );
    NewRow { isolated: true, last_error: Some(error), ..new_row(c, Status::Ready, now) }
}

/// A message produced with `deliver_after` whose time has not come: it has never run, so no
/// attempt is counted; it is `ready` from `deliver_at` on. Until then it holds its ordered
/// key's later messages like any unresolved row.
pub fn delayed(c: &Candidate, deliver_at: i64, now: i64) -> NewRow {
    new_row(c, Status::Ready, deliver_at.max(now))
}

/// Later inflight rows of a key under the same token: the rest of a failed row's chain.
/// Ordered rows wait for the failed row's retry; exclusive ones only for the key.
const DEFER_CHAIN_ROWS: Statement = Statement {
    name: "eq_defer_chain_rows",
    sql: "UPDATE sqlstreams.exception_queue_@id@
          SET status = 'deferred', lease_token = NULL, lease_expires_at = NULL, parked = true,
              can_run_after = CASE WHEN concurrency = 'ordered' THEN $5 ELSE $6 END, updated_at = $6
          WHERE consumer_group_id = $1 AND message_key = $3 AND lease_token = $2 AND status = 'inflight'
            AND message_id > $4 AND concurrency <> 'parallel'",
    params: &[INT8OID, UUIDOID, TEXTOID, INT8OID, TIMESTAMPTZOID, TIMESTAMPTZOID],
};

/// A chained row failed or was delayed: the rest of its chain (the later gated rows of its key
/// under the same token, in the queue and in the range) becomes `deferred` without running.
/// Ordered ones wait for the failed row (`ordered_until`); exclusive ones only until the failed
/// row's retry is recorded (they are due at once and wait for the key in the next claim's gate).
#[allow(clippy::too_many_arguments)]
pub fn defer_chain(
    client: &SpiClient<'_>,
    group: &GroupRef,
    token: pgrx::Uuid,
    key: &str,
    after: i64,
    ordered_until: i64,
    ranges: &mut Ranges,
    now: i64,
) -> Result<()> {
    let stream_id = group.stream.id;
    DEFER_CHAIN_ROWS.run(
        client,
        stream_id,
        &[
            group.id.into(),
            token.into(),
            key.into(),
            after.into(),
            statement::timestamptz(ordered_until),
            statement::timestamptz(now),
        ],
    )?;
    let later = ranges.pending_after(key, after);
    if later.is_empty() {
        return Ok(());
    }
    let chained: Vec<Candidate> = message::candidates(client, group, &ranges.addresses(&later))?
        .into_iter()
        .filter(|m| m.concurrency.is_keyed_gate())
        .collect();
    let ids: Vec<i64> = chained.iter().map(|m| m.message_id).collect();
    ranges.remove(&ids);
    let rows: Vec<NewRow> = chained
        .iter()
        .map(|m| {
            let until = if m.concurrency == Concurrency::Ordered { ordered_until } else { now };
            NewRow { parked: true, ..new_row(m, Status::Deferred, until) }
        })
        .collect();
    super::insert(client, stream_id, group.id, &rows, now)
}

const GIVE_BACK_ROWS: Statement = Statement {
    name: "eq_give_back_rows",
    sql: "UPDATE sqlstreams.exception_queue_@id@
          SET status = 'ready', lease_token = NULL, lease_expires_at = NULL, can_run_after = $4,
              parked = false, updated_at = $4
          WHERE consumer_group_id = $1 AND lease_token = $2 AND status = 'inflight' AND message_id = ANY($3)
          RETURNING message_id, message_key",
    params: &[INT8OID, UUIDOID, INT8ARRAYOID, TIMESTAMPTZOID],
};

/// Deliveries given back unstarted (shutdown, or a lease too short for the handler): each is
/// `ready` and due now, its attempts unchanged; a range message gets such a row. Returns the
/// (id, key) pairs given back.
pub fn give_back(
    client: &SpiClient<'_>,
    group: &GroupRef,
    token: pgrx::Uuid,
    ids: &[i64],
    ranges: &mut Ranges,
    now: i64,
) -> Result<Vec<(i64, Option<String>)>> {
    let stream_id = group.stream.id;
    let mut given: Vec<(i64, Option<String>)> = Vec::new();
    for row in GIVE_BACK_ROWS.run(
        client,
        stream_id,
        &[group.id.into(), token.into(), ids.to_vec().into(), statement::timestamptz(now)],
    )? {
        given.push((row.required("message_id")?, row.value("message_key")?));
    }
    let addresses = ranges.addresses(ids);
    let removed = ranges.remove(ids);
    if !removed.is_empty() {
        let rows: Vec<NewRow> =
            message::candidates(client, group, &addresses)?.iter().map(|m| new_row(m, Status::Ready, now)).collect();
        super::insert(client, stream_id, group.id, &rows, now)?;
        given.extend(removed);
    }
    Ok(given)
}

const SUCCEED_ROWS: Statement = Statement {
    name: "eq_succeed_rows",
    sql: "DELETE FROM sqlstreams.exception_queue_@id@
          WHERE consumer_group_id = $1 AND lease_token = $2 AND status = 'inflight' AND message_id = ANY($3)
          RETURNING message_id, message_key",
    params: &[INT8OID, UUIDOID, INT8ARRAYOID],
};

/// Whether group `$1` has any row in flight: one probe of the index of leases.
const ANY_INFLIGHT: Statement = Statement {
    name: "eq_any_inflight",
    sql: concat!(
        "SELECT coalesce((SELECT true FROM sqlstreams.exception_queue_@id@
                           WHERE consumer_group_id = $1 AND ",
        super::in_flight!(),
        " ORDER BY lease_expires_at LIMIT 1), false) AS any"
    ),
    params: &[INT8OID],
};

/// Handlers of deliveries from the queue succeeded: their rows are deleted. Returns the (id,
/// key) pairs deleted. (A first delivery that succeeds only leaves its range: src/outcome.rs.)
///
/// A token whose claim this backend made and which put no row in flight has none
/// (src/own_claims.rs); a group with no row in flight (a consumer keeping up acks only first
/// deliveries) deletes nothing either. Then no statement fires the queue's count triggers.
/// That look is final: rows in flight under `token` are written only by the claim that made the
/// token, which the ack's snapshot sees committed (or is the ack's own transaction), and
/// nothing else puts a row in flight under it.
pub fn succeed(
    client: &SpiClient<'_>,
    group: &GroupRef,
    token: pgrx::Uuid,
    ids: &[i64],
) -> Result<Vec<(i64, Option<String>)>> {
    let mut done = Vec::new();
    if crate::own_claims::facts(token).is_some_and(|f| !f.rows_in_flight)
        || !ANY_INFLIGHT.run(client, group.stream.id, &[group.id.into()])?.first().required::<bool>("any")?
    {
        return Ok(done);
    }
    for row in SUCCEED_ROWS.run(client, group.stream.id, &[group.id.into(), token.into(), ids.to_vec().into()])? {
        done.push((row.required("message_id")?, row.value("message_key")?));
    }
    Ok(done)
}

/// Wakes, per key, the parked rows that may run once the key's last resolution is recorded: an
/// exclusive row always (it only needs its key free), an ordered row only when no unparked
/// ready or inflight row of its key precedes it. At most `$4` rows per key, in id order, which
/// is what one claim can chain. Rows a claim holds are skipped: that claim is deciding them and
/// sees this resolution (src/key_gate.rs, "Parking and wake-ups").
///
/// The candidates are found once (`MATERIALIZED`), by the key's index, each parked row of the
/// key read once at most. Not inlined, a planner that believes the queue nearly empty (last
/// analyzed while it was) may read them again for every parked row of the group; and with none,
/// no row of the group is read again (`EXISTS`).
const WAKE: Statement = Statement {
    name: "eq_wake",
    sql: "WITH candidates AS MATERIALIZED (
              SELECT w.message_id
              FROM unnest($2::text[]) AS k(message_key)
              -- The key's first row that runs or retries (one probe of the runnable index).
              CROSS JOIN LATERAL (
                  SELECT coalesce(
                      (SELECT b.message_id FROM sqlstreams.exception_queue_@id@ b
                       WHERE b.consumer_group_id = $1
                         AND (b.message_key, b.message_id) > (k.message_key, 0)
                         AND (b.message_key, b.message_id) <= (k.message_key, 9223372036854775807)
                         AND b.status IN ('ready', 'inflight') AND NOT b.parked
                       ORDER BY b.message_key, b.message_id LIMIT 1),
                      9223372036854775807) AS id) head
              CROSS JOIN LATERAL (
                  SELECT p.message_id FROM sqlstreams.exception_queue_@id@ p
                  -- Row comparisons on (key, id): only the key's indexes answer them.
                  WHERE p.consumer_group_id = $1 AND p.parked
                    AND (p.message_key, p.message_id) > (k.message_key, 0)
                    AND (p.message_key, p.message_id) <= (k.message_key, 9223372036854775807)
                    AND (p.concurrency <> 'ordered' OR p.message_id < head.id)
                  ORDER BY p.message_key, p.message_id
                  LIMIT $4) w
          ), free AS (
              SELECT e.message_id FROM sqlstreams.exception_queue_@id@ e
              WHERE e.consumer_group_id = $1 AND e.message_id = ANY (ARRAY(SELECT message_id FROM candidates))
                AND e.parked AND EXISTS (SELECT FROM candidates)
              FOR UPDATE SKIP LOCKED
          )
          UPDATE sqlstreams.exception_queue_@id@ e
          SET parked = false, can_run_after = $3, updated_at = $3
          WHERE e.consumer_group_id = $1 AND e.message_id = ANY (ARRAY(SELECT message_id FROM free))
            AND EXISTS (SELECT FROM free)",
    params: &[INT8OID, TEXTARRAYOID, TIMESTAMPTZOID, INT4OID],
};

/// Whether group `$1` has any parked row, read after the wake locks as `WAKE` would read it: a
/// group with none (as a rule, while it keeps up) updates nothing, and no statement fires the
/// queue's count triggers.
const ANY_PARKED: Statement =
    Statement { name: "eq_any_parked", sql: concat!("SELECT ", super::any_parked!(), " AS any"), params: &[INT8OID] };

/// `DELETE_TOKEN` (src/range.rs) returning the keys only while the group has a parked row: the
/// statement of a whole ack (`range::resolve_covered`) that ends no lane hold, run after the ack
/// took the wake locks of every lane its claim handed out keyed messages from
/// (`own_claims::keyed_lanes`). Once those locks are granted, every claim that parked rows of
/// those lanes' keys has committed, and the statement's snapshot sees them; none can park more
/// before the ack commits. So in a group with no parked row, the usual case, the ack reads, sorts
/// and wakes no key (docs/semantics.md, "One lock order", outcome step 4). A group whose
/// override is `parallel` parks nothing, but may hold rows it parked before its override
/// changed: it runs the same statement.
pub const DELETE_TOKEN_KEYS_IF_PARKED: Statement = Statement {
    name: "eq_delete_token_keys_if_parked",
    sql: crate::range::delete_token!("", concat!("CASE WHEN ", super::any_parked!(), " THEN r.pending_keys END")),
    params: &[INT8OID, UUIDOID],
};

/// Rows one claim can chain per key; also the wake batch.
pub const WAKE_PER_KEY: i32 = 1000;

/// Who wakes parked rows, and so how it takes the wake locks of the keys' lanes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Waker<'a> {
    /// An outcome: waits for a claim that is parking rows in one of the lanes to commit.
    Outcome,
    /// An outcome that ended its token's holds of these lanes (sorted) in an update it has not
    /// committed (`range::resolve_covered`): it takes no wake lock of them, since no claim can
    /// have parked rows of their keys since the token's claim, nor park them before this
    /// transaction ends (why: docs/semantics.md, "One lock order", outcome step 4). Other lanes
    /// are locked as by `Outcome`.
    HeldLanes(&'a [i32]),
    /// A claim, which never waits, so it only tries the locks. It holds the rows of the lanes it
    /// resolves keys in, and a claim that parks holds its lanes' rows too, so no other claim
    /// holds one of those wake locks exclusively: the try succeeds while lanes do their job.
    /// Should it fail, the other claim's rows of the lane's keys are parked until their blocker
    /// could clear on its own (an expired lease: at once), and the next claim looks again.
    Claim,
}

/// After messages of `keys` resolved (by outcomes, or by a claim itself): wakes the rows parked
/// behind those keys, and signals idle consumers when a row woke.
pub fn after_resolution(
    client: &SpiClient<'_>,
    group: &GroupRef,
    keys: &[String],
    now: i64,
    waker: Waker<'_>,
) -> Result<()> {
    if keys.is_empty() {
        return Ok(());
    }
    let stream_id = group.stream.id;
    // Before the probe and anything woken (src/key_gate.rs, "Parking and wake-ups"): a key's
    // wake lock is its lane's, so the keys of one lane take one lock. A group whose override is
    // `parallel` takes them too: it may hold rows parked before its override changed, or being
    // parked by a claim that read the older override.
    let lanes = group.stream.lanes_of(keys);
    let keys = match waker {
        Waker::Outcome => {
            locks::lanes_shared(group.id, &lanes);
            keys.to_vec()
        }
        Waker::HeldLanes(held) => {
            let unheld: Vec<i32> = lanes.into_iter().filter(|lane| held.binary_search(lane).is_err()).collect();
            locks::lanes_shared(group.id, &unheld);
            keys.to_vec()
        }
        Waker::Claim => {
            let got = locks::try_lanes_shared(group.id, &lanes);
            keys.iter()
                .filter(|key| got.contains(&crate::stream::lane(Some(key), 0, group.stream.lanes)))
                .cloned()
                .collect()
        }
    };
    if keys.is_empty() || !ANY_PARKED.run(client, stream_id, &[group.id.into()])?.first().required::<bool>("any")? {
        return Ok(());
    }
    let woken =
        WAKE.run(client, stream_id, &[group.id.into(), keys.into(), statement::timestamptz(now), WAKE_PER_KEY.into()])?;
    if !woken.is_empty() {
        notify::signal(stream_id);
    }
    Ok(())
}
