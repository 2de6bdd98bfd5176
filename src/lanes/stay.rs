//! How long a consumer stays with a lane it holds: a claim whose carried acks released the lane
//! that the acked claim held first takes that lane first again, while it has work, until
//! `STAY_CLAIMS` claims in a row held it first; then the lane furthest behind, as any claim.
//!
//! Why: a lone consumer draining a backlog otherwise never takes the lane its acks released
//! (just read on, it is the lane least behind), so every claim ended one hold, took another
//! lane, and notified the stream's channel for the lane it left (src/claim.rs, `signal_left`),
//! waking every listening connection. Staying, it ends and takes the hold in one transaction
//! and notifies nobody for that lane: nobody else could have taken it between the two. The
//! price: with one consumer, a lane's turn lasts up to `STAY_CLAIMS` claims instead of one, so
//! the other lanes wait for theirs up to that many times as many claims.
//!
//! The run is counted along the chain of tokens (the acked claim's, src/own_claims.rs), not per
//! connection: a consumer that pipelines its claims (the next one carries the acks of the one
//! before the last) has two chains, each counted; a token this backend did not make (a claim
//! acked through a pooler on another backend) starts no stay. Nothing here decides what is
//! safe: a claim takes a lane it stays with exactly as any other (`SKIP LOCKED`, its hold
//! rules).

use crate::own_claims::{self, Stay};

/// The most claims in one run that hold one lane first: the first takes it as any claim does,
/// the others because the claim before held it. (A claim after a run may take the same lane
/// as the lane furthest behind, and start a new run.)
const STAY_CLAIMS: u32 = 4;

/// The lane of `released` (the lanes the acks of `acked`, a token, released) to take before
/// the lane furthest behind, with the run so far.
pub fn lane_to_stay_with(acked: Option<pgrx::Uuid>, released: &[i32]) -> Option<Stay> {
    own_claims::stay(acked?).filter(|s| s.claims < STAY_CLAIMS && released.contains(&s.lane))
}

/// The lane a claim held first and the run it makes: `taken`, the lanes it took in order,
/// `holding`, those it holds (sorted), `stayed`, what `lane_to_stay_with` said before it.
pub fn stay_run(stayed: Option<Stay>, taken: impl IntoIterator<Item = i32>, holding: &[i32]) -> Option<Stay> {
    let lane = taken.into_iter().find(|lane| holding.binary_search(lane).is_ok())?;
    let claims = match stayed {
        Some(s) if s.lane == lane => s.claims + 1,
        _ => 1,
    };
    Some(Stay { lane, claims })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_run_counts_the_claims_that_held_one_lane_first() {
        let stay = |lane, claims| Some(Stay { lane, claims });
        assert_eq!(stay_run(None, [3, 5], &[3, 5]), stay(3, 1));
        assert_eq!(stay_run(None, [3, 5], &[5]), stay(5, 1), "the first lane it holds, not one it only took");
        assert_eq!(stay_run(None, [3], &[]), None, "a claim that holds nothing");
        assert_eq!(stay_run(stay(3, 2), [3, 9], &[3, 9]), stay(3, 3), "the run goes on");
        assert_eq!(stay_run(stay(3, 2), [9, 3], &[3, 9]), stay(9, 1), "another lane first");
    }
}
