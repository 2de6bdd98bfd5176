//! `claim`: one call returns what the caller may run now.
//!
//! 1. Outcomes the call carries (`ack_lease_token`) are recorded first, as any outcome.
//! 2. The fence (src/fence.rs): the stored fence is read, with what this backend proved before,
//!    then the world, and what is proven safe now follows; the new fence is stored unless another
//!    transaction holds the group's cursor row, and kept in this backend either way.
//! 3. Lanes (src/lanes.rs) with work that no other claim holds, each taken with `SKIP LOCKED`,
//!    until the batch is full (or the claim has its share of the lanes). None: the call
//!    returns at once, and it wrote nothing unless the fence moved.
//! 4. Candidates, from each lane taken: a due isolated row alone (a message of a quarantined
//!    range: the claim hands out nothing else; one that waits for its key is parked, and the
//!    claim goes on: src/claim/isolated.rs), else the lane's oldest work first: due exception
//!    rows (retries, delays, woken or expired rows) before its oldest expired range's messages,
//!    its expired ranges handed out again (or quarantined after `max_reclaims`:
//!    src/claim/takeover.rs), the due rows after them, and a range of the lane's next messages up
//!    to the safe head. The lane's expired work it has no room for is taken over too, and left
//!    for the next claim under a token no consumer holds.
//! 5. Gate them (src/key_gate.rs), record every verdict, lease the ranges, store each
//!    lane's position and hold, return the runs. Now and then, a retention step for the
//!    stream (src/retention.rs).
//!
//! Partitions ahead of the head and retention steps lock what every producer and every group
//! need until the transaction ends: a claim does them only as a transaction of its own
//! (autocommit), never in a transaction block the caller may leave open, where it holds
//! nothing but its own lanes and rows.
//!
//! A claim never waits for a row or wake lock (src/locks.rs): lanes, rows and wake locks are all
//! taken only when free. Its waits of its own, for a capped group's turn and for the log's lock
//! while retention drops partitions, come first, before it holds anything or reads the clock. So
//! the fence and the clock it reads are never older than what it claims against, and no outcome
//! that waits for a claim can be waited for in turn.

use std::collections::HashMap;

use pgrx::pg_sys;
use pgrx::spi::SpiClient;

use crate::clock;
use crate::concurrency::Concurrency;
use crate::cursor;
use crate::error::{Result, StreamError};
use crate::exception_queue::{self, Change, Held, Waker};
use crate::fence::{self, Fence};
use crate::group::GroupRef;
use crate::key::Key;
use crate::key_gate::{self, Candidate, GatherInput, Verdict};
use crate::lanes::{self, Lane};
use crate::locks;
use crate::message::{self, Message, Meta};
use crate::notify;
use crate::outcome::{self, Signal};
use crate::own_claims;
use crate::partition::{self, Log};
use crate::payload::RawJsonb;
use crate::quiet;
use crate::range::{self, RangeLease};
use crate::retention;
use crate::token;

mod calls;
mod due_rows;
mod isolated;
mod takeover;

/// Largest `batch_size` a claim accepts.
pub const MAX_BATCH: i32 = 10_000;

/// Reads of one lane's messages per claim when messages are held back for their
/// `deliver_after` (each read moves up to a batch of them into the queue).
const MAX_DELAYED_READS: i32 = 8;

/// One row of a claim result.
pub struct Delivery {
    pub message_id: i64,
    pub message_key: Option<Key>,
    pub concurrency: Concurrency,
    pub attempt: i32,
    pub payload: RawJsonb,
    pub lease_token: pgrx::Uuid,
    pub run_after: Option<i64>,
    pub meta: Meta,
}

/// A message the claim could hand out: what the gate decides on, and the rest.
struct Work {
    candidate: Candidate,
    handout: Handout,
}

/// A message handed out from a range, pending in the range's row until its outcome: its
/// delivery (by position in the claim's result, which holds its key) and its range's first id.
struct Pending {
    id: i64,
    delivery: usize,
    range: i64,
}

/// Where a message the claim could hand out stands, and what its delivery would carry.
struct Handout {
    held: Held,
    attempt: i32,
    payload: RawJsonb,
    meta: Meta,
    /// The first id of the range it is in, when it is a range message.
    range: Option<i64>,
}

/// A claim in progress: everything it decided, written at the end.
struct Claim<'a> {
    group: &'a GroupRef,
    /// The lanes taken, with their new positions.
    lanes: Vec<Lane>,
    /// The ranges handed out (one new one per lane at most, and expired ones taken over).
    ranges: Vec<RangeLease>,
    /// The clock, read after the fence.
    now: i64,
    token: pgrx::Uuid,
    expires: i64,
    batch: i32,
    work: Vec<Work>,
    /// Lanes whose waiting rows may be parked: this claim holds their wake locks.
    parkable: Vec<i32>,
    changes: Vec<Change>,
    /// Exception rows this claim resolves before gating (expired deliveries that went dead).
    dead_on_expiry: Vec<i64>,
    /// The chains of expired deliveries this claim met, by lease token and key, with the lowest
    /// id of an unresolved message of each: only a row with none below it counts the expiry as
    /// an attempt (src/claim/due_rows.rs, `started_in_its_delivery`).
    expired_chains: HashMap<([u8; 16], String), i64>,
    /// Keys of messages this claim resolved (superseded, dead): their parked rows may wake.
    resolved_keys: Vec<Option<String>>,
    /// It hands out an exception row, in flight under its token (src/own_claims.rs).
    work_in_flight: bool,
    /// Its gate found nothing that could block a key and parked nothing (src/own_claims.rs).
    nothing_waited: bool,
    /// The lane it takes first to stay with it, and the run so far (src/lanes/stay.rs).
    stay: Option<own_claims::Stay>,
}

/// Outcomes a claim records before it claims (`ack_lease_token`, `ack_message_ids`).
pub struct CarriedAcks {
    pub token: pgrx::Uuid,
    pub ids: Vec<i64>,
}

/// Claims for `group_name`. See the module documentation.
pub fn claim(
    stream_name: &str,
    group_name: &str,
    batch: i32,
    lease_micros: i64,
    carried: Option<CarriedAcks>,
) -> Result<Vec<Delivery>> {
    if let Some(level) = crate::error::stricter_than_read_committed() {
        return Err(StreamError::WrongTransactionState {
            message: format!("claim needs a READ COMMITTED transaction, not {level}"),
            hint: format!(
                "A {level} snapshot is older than the claim and could skip committed messages; call claim in \
                 its own READ COMMITTED transaction. {}",
                crate::error::DEFAULT_ISOLATION_HINT
            ),
        });
    }
    crate::commit::consumer_call(stream_name, group_name, |client, group| {
        // What this backend learned may say the claim finds nothing (src/quiet.rs); read
        // before any statement of the claim.
        let watch = match quiet::Watch::start(group.id, group.stream.id, carried.is_some(), clock::now()) {
            quiet::Start::Quiet => return Ok(vec![]),
            quiet::Start::Claim(watch) => watch,
        };
        // A capped group's claims take turns (src/inflight_cap.rs), first, while the claim holds
        // nothing but the stream's and group's locks; none runs in a transaction block, where
        // its turn would last as long as the caller keeps the transaction open.
        crate::inflight_cap::lock(group, in_transaction_block())?;
        // The log's lock, while the claim holds nothing of its own: a retention step dropping
        // partitions holds the log until its transaction ends, and that transaction may go on to
        // record outcomes that wait for rows a claim holds. The clock is read after it.
        let log = Log::open(&group.stream)?;
        let acked_token = carried.as_ref().map(|acks| acks.token);
        let (released, acked) = match carried {
            Some(acks) => {
                let acked = outcome::ack_in(client, group, acks.token, &acks.ids, Signal::Later)?;
                (acked.released_lanes, !acked.recorded.is_empty())
            }
            None => (vec![], false),
        };
        let stream_id = group.stream.id;
        let room = if group.paused { 0 } else { crate::inflight_cap::room(client, group, batch)? };
        // Room the carried acks made and this claim leaves: other consumers of a capped group
        // may be idle for want of it.
        let room_left = |handed: usize| acked && group.max_inflight.is_some() && (handed as i32) < room;
        let batch = room;
        if batch == 0 {
            signal_left(stream_id, &released, &[]);
            watch.wrote_nothing();
            return Ok(vec![]);
        }
        // The stored fence and what this backend proved before first, then the world
        // (src/fence.rs): the order is the proof.
        let (stored, head, sequence) = cursor::read_fence_and_head(client, stream_id, group.id)?;
        let known = fence::known(group.id, sequence, head).map_or(stored, |known| stored.merge(known));
        let fence = advance_fence(client, stream_id, known, head)?;
        let now = clock::now();
        let stay = lanes::lane_to_stay_with(acked_token, &released);
        let candidates =
            lanes::candidates(client, group, &log, fence.safe, now, released.first().copied(), stay.map(|s| s.lane))?;
        if fence != stored {
            cursor::store_fence(client, stream_id, group.id, fence)?;
        }
        fence::remember(group.id, sequence, fence, head);
        if candidates.is_empty() {
            signal_left(stream_id, &released, &[]);
            // Nothing stored, and no id handed out left to prove: only a transaction that
            // changes the stream, or the clock, can give the next claim anything.
            if fence == stored && fence.safe == head {
                watch.found_nothing(|| crate::due::until(client, stream_id, group.id, now))?;
            }
            return Ok(vec![]);
        }
        let claim = Claim {
            group,
            lanes: vec![],
            ranges: vec![],
            now,
            token: token::new(),
            expires: now.saturating_add(lease_micros),
            batch,
            work: vec![],
            parkable: vec![],
            changes: vec![],
            dead_on_expiry: vec![],
            expired_chains: HashMap::new(),
            resolved_keys: vec![],
            work_in_flight: false,
            nothing_waited: false,
            stay,
        };
        let (deliveries, holding) = claim.run(client, fence.safe, candidates, head)?;
        signal_left(stream_id, &released, &holding);
        if room_left(deliveries.len()) {
            notify::signal(stream_id);
        }
        Ok(deliveries)
    })
}

/// Whether the claim runs in a transaction block (BEGIN ... COMMIT), which may stay open.
fn in_transaction_block() -> bool {
    // SAFETY: reads this backend's transaction state.
    unsafe { pg_sys::IsTransactionBlock() }
}

/// Signals idle consumers when the carried acks freed a lane that this claim does not hold
/// again: one it did not take, or took and handed out only parallel work from (or nothing),
/// which leaves it free at commit.
fn signal_left(stream_id: i64, released: &[i32], holding: &[i32]) {
    if released.iter().any(|lane| !holding.contains(lane)) {
        notify::signal(stream_id);
    }
}

/// The group's fence after a fresh reading of the world, the head `head` read after the fence
/// `stored` was read (from the cursor row, and what this backend proved before). The global
/// bound is cheap; only when it proves nothing new does the claim look up this stream's own
/// running producers.
fn advance_fence(client: &SpiClient<'_>, stream_id: i64, stored: Fence, head: i64) -> Result<Fence> {
    let reading = fence::read(head);
    if stored.stalled(&reading) {
        let bound = fence::oldest_producer(client, stream_id, reading.next_xid)?;
        return Ok(stored.advance(&reading.with_producer_bound(bound)));
    }
    Ok(stored.advance(&reading))
}

impl Claim<'_> {
    /// Runs the claim; returns its deliveries and the lanes it holds (sorted).
    fn run(
        mut self,
        client: &SpiClient<'_>,
        safe: i64,
        mut candidates: lanes::Candidates,
        head: i64,
    ) -> Result<(Vec<Delivery>, Vec<i32>)> {
        let stream_id = self.group.stream.id;
        // Lanes that gave work count toward the share: one taken for nothing (another claim
        // handed out what it had since the candidates were read) leaves the share to the next.
        let mut with_work = 0;
        loop {
            let room = self.batch - self.work.len() as i32;
            if room <= 0 || (with_work > 0 && with_work >= candidates.share(client, self.group, self.now)?) {
                break;
            }
            let Some(candidate) = candidates.next(client, self.group)? else { break };
            let Some(mut lane) = lanes::take(client, self.group, candidate.lane, self.now)? else { continue };
            let before = self.work.len();
            if candidate.isolated && self.work.is_empty() && self.collect_isolated(client, lane.lane)? {
                self.lanes.push(lane);
                break;
            }
            self.collect_lane(client, &mut lane, &candidate, safe)?;
            if self.work.len() > before {
                with_work += 1;
            }
            self.lanes.push(lane);
        }
        if self.lanes.is_empty() {
            return Ok((vec![], vec![]));
        }
        if !in_transaction_block() {
            partition::ensure(client, &self.group.stream, head, partition::Need::Ahead)?;
        }
        self.work.sort_by_key(|w| w.candidate.message_id);

        // The candidates go to the gate and the rest to `record`, each moved, not copied.
        let (candidates, handouts): (Vec<Candidate>, Vec<Handout>) =
            std::mem::take(&mut self.work).into_iter().map(|w| (w.candidate, w.handout)).unzip();
        // Rows this claim decides (candidates, and expired ones it dead-letters) are not blockers
        // of the candidates: the gate decides them together. Except a message going dead here
        // when the group holds on dead: it stops its key from now on, so it stays a blocker
        // (still inflight in this snapshot, then dead; the wake-up it triggers parks the key's
        // rows behind it for good).
        let dead_release = if self.group.hold_on_dead { &[][..] } else { &self.dead_on_expiry[..] };
        let exception_ids: Vec<i64> = candidates
            .iter()
            .zip(&handouts)
            .filter(|(_, h)| h.held != Held::Range)
            .map(|(c, _)| c.message_id)
            .chain(dead_release.iter().copied())
            .collect();
        let input = GatherInput {
            stream_id,
            group_id: self.group.id,
            candidates: &candidates,
            exception_ids: &exception_ids,
            own_ranges: self.ranges.iter().map(|r| r.first_id).collect(),
            hold_on_dead: self.group.hold_on_dead,
            lanes: self.lanes.iter().map(|l| l.lane).collect(),
        };
        let verdicts = self.decide(client, &candidates, &input)?;

        let (deliveries, pending, holding) = self.record(candidates, handouts, verdicts);
        own_claims::made(
            self.token,
            own_claims::Made {
                rows_in_flight: self.work_in_flight,
                nothing_waited: self.nothing_waited,
                range_ids: pending.iter().map(|p| p.id).collect(),
                keyed_lanes: self.keyed_lanes(&pending, &deliveries),
                held: holding.clone(),
                stay: lanes::stay_run(self.stay, self.lanes.iter().map(|l| l.lane), &holding),
            },
        );
        exception_queue::write(client, stream_id, self.group.id, std::mem::take(&mut self.changes), self.now)?;
        self.store(client, &deliveries, pending, &holding)?;
        let keys = exception_queue::distinct_keys(&self.resolved_keys);
        exception_queue::after_resolution(client, self.group, &keys, self.now, Waker::Claim)?;
        if !in_transaction_block() {
            retention::from_claim(client, &self.group.stream)?;
        }
        Ok((deliveries, holding))
    }

    /// Stores the claim's ranges, with the positions and holds of their lanes in the same
    /// statements where it can, then the other lanes it took.
    fn store(
        &mut self,
        client: &SpiClient<'_>,
        deliveries: &[Delivery],
        mut pending: Vec<Pending>,
        holding: &[i32],
    ) -> Result<()> {
        let (group, token, expires) = (self.group, self.token, self.expires);
        // Hold a lane while a key it handed out may need it: ordered and exclusive deliveries.
        let claim_hold = |lane: i32| holding.binary_search(&lane).is_ok().then_some((token, expires));
        let mut lanes = std::mem::take(&mut self.lanes);
        let ranges = std::mem::take(&mut self.ranges);
        // A range's row holds its messages' keys: past 2 kB compressed, with lz4 where it can.
        let keyed = deliveries.iter().any(|d| d.message_key.is_some());
        crate::search_path::with_lz4_if(keyed, || -> Result<()> {
            for range in ranges {
                let (mine, rest): (Vec<_>, Vec<_>) = pending.into_iter().partition(|p| p.range == range.first_id);
                pending = rest;
                // The keys stay with the deliveries; the range's row takes them from there.
                let ids: Vec<i64> = mine.iter().map(|p| p.id).collect();
                let keys: Vec<Option<&str>> =
                    mine.iter().map(|p| deliveries[p.delivery].message_key.as_deref()).collect();
                let lease = range::Lease { range: &range, pending: &ids, keys: &keys, token, expires };
                // A new range and its lane's position go in one statement (the usual claim).
                if let Some(i) = lanes.iter().position(|l| l.lane == range.lane) {
                    let (claimed, hold) = (lanes[i].claimed, claim_hold(range.lane));
                    if lanes::store_with_new_range(client, group, &lease, claimed, hold)? {
                        lanes.swap_remove(i);
                        continue;
                    }
                }
                range::lease(client, group.stream.id, group.id, &lease)?;
            }
            Ok(())
        })?;
        for lane in lanes {
            lanes::store(client, group, lane, claim_hold(lane.lane))?;
        }
        Ok(())
    }

    /// Room left in the batch.
    fn room(&self) -> i32 {
        self.batch - self.work.len() as i32
    }

    /// A lane's work, oldest first, while the batch has room: its due rows and expired ranges
    /// (src/claim/takeover.rs), then a range of its next messages.
    fn collect_lane(
        &mut self,
        client: &SpiClient<'_>,
        lane: &mut Lane,
        candidate: &lanes::Candidate,
        safe: i64,
    ) -> Result<()> {
        let kinds = [candidate.due_rows, candidate.expired_rows, candidate.expired_range];
        self.take_over_lane(client, lane.lane, kinds)?;
        self.collect_range(client, lane, safe)
    }

    /// With room left, a range of the lane's next messages up to `safe`, moving the lane's
    /// position.
    fn collect_range(&mut self, client: &SpiClient<'_>, lane: &mut Lane, safe: i64) -> Result<()> {
        let stream_id = self.group.stream.id;
        let mut room = self.room();
        // Messages held back for their deliver_after leave their room to the next ones: the lane
        // is read on, a few times at most; past that, consumers are woken to claim again.
        let mut messages = Vec::new();
        let mut first = None;
        let mut reads = 0;
        while lane.claimed < safe && room > 0 {
            let lane_read = message::after(client, self.group, lane.lane, lane.claimed, safe, room)?;
            // What lies after this read: the next claim to take the lane knows without a probe.
            if let Some(next) = lane_read.next {
                lanes::saw_next(stream_id, lane_read.log, lane.lane, next);
            }
            let full = lane_read.next.is_some();
            let mut read = lane_read.messages;
            first = first.or(read.first().map(|m| m.candidate.message_id));
            // A read with more after it ends at its last message; otherwise the lane is handed
            // out up to the safe head, including ids of rolled-back producers that will never
            // appear.
            lane.claimed = match read.last() {
                Some(last) if full => last.candidate.message_id,
                _ => safe,
            };
            let held = self.hold_back_delayed(client, &mut read)?;
            room -= read.len() as i32;
            messages.extend(read);
            reads += 1;
            if held == 0 {
                break;
            }
            if reads == MAX_DELAYED_READS {
                if full {
                    notify::signal(self.group.stream.id);
                }
                break;
            }
        }
        if let Some(first_id) = first {
            self.push_range(messages, 0, first_id);
            self.ranges.push(RangeLease::new(first_id, lane.claimed, lane.lane));
        }
        Ok(())
    }

    /// Messages produced with `deliver_after` whose time has not come leave the range for the
    /// queue: `ready` rows due at that time, written at once so this claim's gate sees them as
    /// unresolved predecessors of later messages of their ordered keys.
    /// Returns how many it held back.
    fn hold_back_delayed(&mut self, client: &SpiClient<'_>, messages: &mut Vec<Message>) -> Result<usize> {
        let now = self.now;
        let (later, due): (Vec<Message>, Vec<Message>) =
            std::mem::take(messages).into_iter().partition(|m| m.deliver_at.is_some_and(|at| at > now));
        *messages = due;
        if later.is_empty() {
            return Ok(0);
        }
        let rows: Vec<_> =
            later.iter().map(|m| exception_queue::delayed(&m.candidate, m.deliver_at.unwrap_or(now), now)).collect();
        exception_queue::insert(client, self.group.stream.id, self.group.id, &rows, now)?;
        Ok(later.len())
    }

    fn push_range(&mut self, messages: Vec<Message>, attempt: i32, first_id: i64) {
        self.work.extend(messages.into_iter().map(|m| Work {
            candidate: m.candidate,
            handout: Handout { held: Held::Range, attempt, payload: m.payload, meta: m.meta, range: Some(first_id) },
        }));
    }

    /// The gate's verdicts, with the waiting rows' lanes locked for parking where it may park
    /// them (`parkable`).
    fn decide(
        &mut self,
        client: &SpiClient<'_>,
        candidates: &[Candidate],
        input: &GatherInput<'_>,
    ) -> Result<Vec<Verdict>> {
        let hold = self.group.hold_on_dead;
        let gathered = key_gate::gather(client, input)?;
        let mut verdicts = key_gate::gate(candidates, &gathered.facts, self.expires, self.now, hold);
        let waiting = key_gate::deferred_keys(candidates, &verdicts);
        self.nothing_waited = gathered.nothing_waits && waiting.is_empty();
        if !waiting.is_empty() {
            // Lock the lanes of the keys about to be parked, then look again: a resolution that
            // committed meanwhile is seen now, and one that commits later waits for this claim
            // before its wake-up runs (src/key_gate.rs). A lane whose wake lock an outcome holds
            // right now is not waited for: its keys' rows are left due instead of parked, and
            // the next claim looks again. Facts only shrink between the two looks, so the
            // second can only turn waits into runs.
            self.parkable = locks::try_lanes_exclusive(self.group.id, &self.group.stream.lanes_of(&waiting));
            verdicts =
                key_gate::gate(candidates, &key_gate::gather(client, input)?.facts, self.expires, self.now, hold);
        }
        Ok(verdicts)
    }

    /// The lanes of the ranges that hand out a message with a key (`pending` and `deliveries`:
    /// what `record` returns).
    fn keyed_lanes(&self, pending: &[Pending], deliveries: &[Delivery]) -> Vec<i32> {
        pending
            .iter()
            .filter(|p| deliveries[p.delivery].message_key.is_some())
            .filter_map(|p| self.ranges.iter().find(|r| r.first_id == p.range))
            .map(|r| r.lane)
            .collect()
    }

    /// Turns verdicts into queue changes; returns the deliveries, the ranges' pending messages
    /// and the lanes that handed out ordered or exclusive work of a key.
    fn record(
        &mut self,
        candidates: Vec<Candidate>,
        handouts: Vec<Handout>,
        verdicts: Vec<Verdict>,
    ) -> (Vec<Delivery>, Vec<Pending>, Vec<i32>) {
        let mut deliveries = Vec::with_capacity(candidates.len());
        let mut pending = Vec::with_capacity(candidates.len());
        let mut holding = Vec::new();
        for ((c, work), verdict) in candidates.into_iter().zip(handouts).zip(verdicts) {
            match verdict {
                Verdict::Run { run_after } => {
                    match exception_queue::hand_out(&work.held, c.message_id, work.attempt, self.token, self.expires) {
                        Some(update) => {
                            self.work_in_flight = true;
                            self.changes.push(Change::Update(update));
                        }
                        None => pending.push(Pending {
                            id: c.message_id,
                            delivery: deliveries.len(),
                            range: work.range.unwrap_or_default(),
                        }),
                    }
                    if c.key.is_some() && c.concurrency.is_keyed_gate() {
                        holding.push(c.lane);
                    }
                    deliveries.push(Delivery {
                        message_id: c.message_id,
                        message_key: c.key,
                        concurrency: c.concurrency,
                        attempt: work.attempt,
                        payload: work.payload,
                        lease_token: self.token,
                        run_after,
                        meta: work.meta,
                    });
                }
                Verdict::Defer { until } => {
                    // Parked only under this claim's wake lock of the lane; otherwise due now
                    // (src/key_gate.rs).
                    let parked = c.key.is_some() && self.parkable.contains(&c.lane);
                    let until = if parked { until } else { self.now };
                    self.changes.push(exception_queue::defer_behind(&work.held, &c, work.attempt, until, parked));
                }
                Verdict::Supersede => {
                    self.changes.push(exception_queue::supersede(&work.held, &c, work.attempt, self.now));
                    self.resolved_keys.push(c.key.map(Key::into_string));
                }
            }
        }
        holding.sort_unstable();
        holding.dedup();
        (deliveries, pending, holding)
    }
}
