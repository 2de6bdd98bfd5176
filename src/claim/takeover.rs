//! A claim takes over a lane's ranges whose lease ran out: the consumer that held them died, or
//! stopped renewing. Oldest first, while the batch has room, each handed out again under the
//! claim's token (or quarantined after `max_reclaims`: docs/semantics.md, "Quarantine of a range
//! that keeps expiring"). A range with more than the room left is split: the claim takes the
//! part it has room for, and the rest, taken over too, waits for the next claim as an expired
//! range of its own that no consumer holds (src/token.rs).
//!
//! Deliveries of exception rows (retries, woken rows) are taken over one by one, as due rows
//! (src/claim/due_rows.rs); those of the same claims that the batch has no room for are taken
//! over too, as a range's rest: they stay expired, under a token no consumer holds. Left under
//! their consumer's token, they would hold their exclusive keys (`extend_lease` could renew
//! them), and the rows taken would wait for them.

use pgrx::pg_sys::BuiltinOid::*;
use pgrx::spi::SpiClient;

use super::Claim;
use crate::error::Result;
use crate::exception_queue;
use crate::message::{self, Message};
use crate::range::{self, RangeLease};
use crate::statement::{self, Statement};
use crate::token;

/// Expired deliveries in lane `$2` under the tokens `$3`, but for the claim's own rows (`$6`),
/// moved under token `$4`; skips any an outcome is recording.
const ROWS_LEFT: Statement = Statement {
    name: "claim_rows_left",
    sql: "UPDATE sqlstreams.exception_queue_@id@ e SET lease_token = $4, updated_at = $5
          FROM (SELECT message_id FROM sqlstreams.exception_queue_@id@
                WHERE consumer_group_id = $1 AND lane = $2 AND status = 'inflight' AND lease_expires_at <= $5
                  AND lease_token = ANY($3) AND message_id <> ALL($6)
                FOR UPDATE SKIP LOCKED) left_over
          WHERE e.consumer_group_id = $1 AND e.message_id = left_over.message_id",
    params: &[INT8OID, INT4OID, UUIDARRAYOID, UUIDOID, TIMESTAMPTZOID, INT8ARRAYOID],
};

impl Claim<'_> {
    /// Takes `expired` over, the lane's oldest expired range (its row locked), then the lane's
    /// next expired ones while the batch has room.
    pub(super) fn take_over(&mut self, client: &SpiClient<'_>, mut expired: RangeLease) -> Result<()> {
        let (stream_id, lane) = (self.group.stream.id, expired.lane);
        while self.room() > 0 {
            let after = expired.first_id;
            if !self.take_over_one(client, expired)? {
                break;
            }
            match range::oldest_expired(client, stream_id, self.group.id, lane, self.now, Some(after))? {
                Some(next) => expired = next,
                None => break,
            }
        }
        Ok(())
    }

    /// Hands `expired` out again, or quarantines it; returns whether the batch had room for all
    /// of it.
    fn take_over_one(&mut self, client: &SpiClient<'_>, mut expired: RangeLease) -> Result<bool> {
        let stream_id = self.group.stream.id;
        let messages = message::by_id(client, self.group, &expired.addresses())?;
        if expired.reclaims >= self.group.max_reclaims {
            // Written at once, so this claim's gate sees them as unresolved predecessors of
            // later same-key messages it hands out.
            let rows: Vec<_> =
                messages.iter().map(|m| exception_queue::quarantine(&m.candidate, &expired, self.now)).collect();
            exception_queue::insert(client, stream_id, self.group.id, &rows, self.now)?;
            range::delete(client, stream_id, self.group.id, expired.first_id)?;
            return Ok(true);
        }
        let room = self.room() as usize;
        let whole = expired.pending.len() <= room;
        if !whole {
            let rest = expired.split_off(room);
            range::split(client, stream_id, self.group.id, expired.first_id, &rest, token::no_ones())?;
        }
        let messages: Vec<Message> =
            messages.into_iter().filter(|m| expired.pending.contains(&m.candidate.message_id)).collect();
        expired.reclaims += 1;
        self.push_range(messages, expired.reclaims, expired.first_id);
        self.ranges.push(expired);
        Ok(whole)
    }

    /// The other expired deliveries in `lane` of the tokens (`tokens`) whose deliveries the
    /// claim took over: under a token no consumer holds, still expired, for the next claim.
    pub(super) fn take_over_rows_left(
        &mut self,
        client: &SpiClient<'_>,
        lane: i32,
        tokens: &[pgrx::Uuid],
    ) -> Result<()> {
        let own: Vec<i64> =
            self.work.iter().map(|w| w.candidate.message_id).chain(self.dead_on_expiry.iter().copied()).collect();
        let args = [
            self.group.id.into(),
            lane.into(),
            tokens.to_vec().into(),
            token::no_ones().into(),
            statement::timestamptz(self.now),
            own.into(),
        ];
        ROWS_LEFT.run(client, self.group.stream.id, &args)?;
        Ok(())
    }
}
