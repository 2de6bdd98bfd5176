//! A claim's first lane with a due isolated row (a message of a quarantined range): the row goes
//! out alone, so that a failure or an expiry of its delivery is its own (docs/semantics.md,
//! "Quarantine of a range that keeps expiring").
//!
//! Unless it would wait for its key: then it is parked, as the gate parks any row (under the
//! lane's wake lock, the facts read again once the lock is held; left due instead while an
//! outcome holds that lock, as any row), at once, so that the claim's gate sees it waiting, and
//! the claim goes on with the lane's other work and other lanes. What holds the key may be that very work (a later
//! message of an exclusive key, in a range whose lease ran out; an expired delivery), which a
//! claim that handed out only the isolated row would never reach while the row came due first
//! again and again; and a parked row leaves the lane's next isolated row its turn.

use pgrx::spi::SpiClient;

use super::due_rows::DUE_ISOLATED;
use super::Claim;
use crate::error::Result;
use crate::exception_queue;
use crate::key_gate::{self, Candidate, GatherInput, Verdict};
use crate::locks;
use crate::statement;

impl Claim<'_> {
    /// The lane's due isolated row, as the claim's only work. Returns whether it is to be handed
    /// out: not one whose delivery expired for the last time (it went dead), nor one that waits
    /// for its key (parked, and the claim goes on).
    pub(super) fn collect_isolated(&mut self, client: &SpiClient<'_>, lane: i32) -> Result<bool> {
        let rows = DUE_ISOLATED.run(
            client,
            self.group.stream.id,
            &[self.group.id.into(), statement::timestamptz(self.now), lane.into()],
        )?;
        self.push_rows(client, rows)?;
        if self.work.is_empty() || self.waits_until(client, lane)?.is_none() {
            return Ok(!self.work.is_empty());
        }
        let parkable = locks::try_lanes_exclusive(self.group.id, &[lane]);
        let Some(until) = self.waits_until(client, lane)? else { return Ok(true) };
        let Some(work) = self.work.pop() else { return Ok(false) };
        let parked = work.candidate.key.is_some() && parkable.contains(&lane);
        let until = if parked { until } else { self.now };
        let handout = &work.handout;
        let park = exception_queue::defer_behind(&handout.held, &work.candidate, handout.attempt, until, parked);
        exception_queue::write(client, self.group.stream.id, self.group.id, vec![park], self.now)?;
        Ok(false)
    }

    /// When the gate, asked now, would let the claim's work (the isolated row) run: `None` if at
    /// once.
    fn waits_until(&self, client: &SpiClient<'_>, lane: i32) -> Result<Option<i64>> {
        let candidates: Vec<Candidate> = self.work.iter().map(|w| w.candidate.clone()).collect();
        let ids: Vec<i64> = candidates.iter().map(|c| c.message_id).collect();
        let input = GatherInput {
            stream_id: self.group.stream.id,
            group_id: self.group.id,
            candidates: &candidates,
            exception_ids: &ids,
            own_ranges: vec![],
            lanes: vec![lane],
            hold_on_dead: self.group.hold_on_dead,
        };
        let facts = key_gate::gather(client, &input)?.facts;
        let verdicts = key_gate::gate(&candidates, &facts, self.expires, self.now, self.group.hold_on_dead);
        Ok(verdicts.into_iter().find_map(|v| match v {
            Verdict::Defer { until } => Some(until),
            _ => None,
        }))
    }
}
