//! A claim takes over a lane's work whose lease ran out (the consumer that held it died, or
//! stopped renewing), oldest first, while the batch has room: the due rows before the lane's
//! oldest expired range (retries and expired deliveries of exception rows:
//! src/claim/due_rows.rs), that range handed out again (or quarantined after `max_reclaims`:
//! docs/semantics.md, "Quarantine of a range that keeps expiring"), the due rows up to the next
//! expired range, that one, and so on. Due work after an expired range's messages would wait for
//! them (an ordered key's predecessors; an exclusive key's delivery, which its consumer may still
//! renew), so taken first by claims with room for only a part, it would wait claim after claim.
//!
//! A claim that takes a lane takes all of its expired work over: what the batch has no room for
//! is left for the next claim, still expired, under a token no consumer holds (src/token.rs):
//! the rest of a range it splits, the expired ranges after it, and the expired deliveries of
//! exception rows. Left under their consumer's token, they would hold their exclusive keys
//! (`extend_lease` could still renew them), and the work the claim took would wait for them:
//! due rows before a dead consumer's range or rows, taken first, would be deferred behind it
//! claim after claim, and never reach it.

use pgrx::spi::SpiClient;

use super::Claim;
use crate::error::Result;
use crate::exception_queue;
use crate::lanes;
use crate::message::{self, Message};
use crate::range::{self, Expired, RangeLease};
use crate::token;

impl Claim<'_> {
    /// The lane's due rows (`due_rows`, `expired_rows`: the lanes' candidates saw some, and
    /// deliveries among them that expired) and expired ranges (`expired_range`), oldest first,
    /// while the batch has room; then what it has no room for of the lane's expired work is
    /// taken over too, and left for the next claim.
    pub(super) fn take_over_lane(&mut self, client: &SpiClient<'_>, lane: i32, kinds: [bool; 3]) -> Result<()> {
        let [due_rows, expired_rows, expired_range] = kinds;
        let (stream_id, group_id, now) = (self.group.stream.id, self.group.id, self.now);
        // Left to no one, work holds no exclusive key; a group whose override is parallel has
        // none, and its claims leave nothing.
        let leaves = lanes::holds(self.group);
        let oldest = |after: i64, which| range::oldest_expired(client, stream_id, group_id, lane, now, (after, which));
        let mut next = if expired_range { oldest(i64::MIN, Expired::Any)? } else { None };
        let mut lower = i64::MIN;
        loop {
            let upper = next.as_ref().map_or(i64::MAX, |(_, r)| r.pending.first().copied().unwrap_or(r.first_id));
            if due_rows {
                self.collect_rows(client, lane, lower..upper)?;
            }
            let Some((token, range)) = next.take() else { break };
            let after = range.first_id;
            if self.room() > 0 {
                self.take_over_range(client, token, range)?;
                lower = upper;
            } else if !leaves {
                break;
            } else if !token::is_no_ones(token) {
                range::leave(client, stream_id, group_id, &range)?;
            }
            // Past the room, only what a consumer still holds: each is left to no one once.
            let which = if self.room() > 0 { Expired::Any } else { Expired::Held };
            next = oldest(after, which)?;
        }
        // With room left, every due row of the lane was taken but those passed by.
        if expired_rows && leaves && self.room() <= 0 {
            let taken: Vec<i64> =
                self.work.iter().map(|w| w.candidate.message_id).chain(self.dead_on_expiry.iter().copied()).collect();
            exception_queue::take_over_left(client, self.group, lane, &taken, self.now)?;
        }
        Ok(())
    }

    /// Hands `expired` (its row locked, leased under `token`) out again, as much as the batch has
    /// room for, or quarantines it.
    fn take_over_range(&mut self, client: &SpiClient<'_>, token: pgrx::Uuid, mut expired: RangeLease) -> Result<()> {
        let stream_id = self.group.stream.id;
        let messages = message::by_id(client, self.group, &expired.addresses())?;
        self.met_in_range(token, &messages);
        if expired.reclaims >= self.group.max_reclaims {
            // Written at once, so this claim's gate sees them as unresolved predecessors of
            // later same-key messages it hands out.
            let rows: Vec<_> =
                messages.iter().map(|m| exception_queue::quarantine(&m.candidate, &expired, self.now)).collect();
            exception_queue::insert(client, stream_id, self.group.id, &rows, self.now)?;
            return range::delete(client, stream_id, self.group.id, expired.first_id);
        }
        let room = self.room() as usize;
        if expired.pending.len() > room {
            let rest = expired.split_off(room);
            range::split(client, stream_id, self.group.id, expired.first_id, &rest, token::no_ones())?;
        }
        let messages: Vec<Message> =
            messages.into_iter().filter(|m| expired.pending.contains(&m.candidate.message_id)).collect();
        expired.reclaims += 1;
        self.push_range(messages, expired.reclaims, expired.first_id);
        self.ranges.push(expired);
        Ok(())
    }
}
