//! What this backend's own committed claims handed out, by lease token: the lanes a claim
//! stored its hold on, whether it put an exception row in flight, which messages it handed out
//! from ranges, the lanes of those ranges with a keyed message (whose wake locks a whole ack
//! takes before its statement: src/outcome.rs), and the lane it held first with the run of claims
//! that held it first (the next claim carrying its acks may stay with it: src/lanes/stay.rs).
//! A consumer that acks with its next claim (or on
//! the connection it claimed on) then skips the two statements an ack runs for the first two,
//! which find nothing for most claims: the release of the lanes the token holds, and the delete
//! of its rows in flight. An ack that names every message the claim handed out from ranges
//! deletes the token's ranges whole, in one statement (src/range.rs, `resolve_covered`), which
//! ends the holds too, reading only the lane rows of the lanes the claim held.
//!
//! The facts are final once the claim commits: only the claim that made a token holds a lane
//! or puts a row in flight under it (a claim handing out an expired row or range again does so
//! under its own new token, and moves the token's rows it leaves under a token no one holds, so
//! the token only ever loses rows), and a range row under the token only ever lists messages the
//! claim handed out (one handed out again gets a new token, and so does the rest a claim splits
//! off).
//! A claim's facts count once its transaction commits, and go with it when it rolls back or is
//! prepared. A token this backend does not know (a claim made on another connection, or
//! forgotten) gets every statement, as before.

use std::cell::RefCell;
use std::collections::VecDeque;

/// Claims remembered per backend: a consumer pipelining its claims has a few open at once.
const KEPT: usize = 64;

/// A claim that handed out more messages from ranges than this is remembered without them (its
/// ack takes the general path): at most `KEPT` times this many ids per backend.
const RANGE_IDS_KEPT: usize = 1_000;

/// What one claim handed out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Facts {
    /// It holds a lane (it handed out ordered or exclusive work of a key).
    pub held_lanes: bool,
    /// It handed out an exception row (a retry, a delayed or woken row, an expired delivery).
    pub rows_in_flight: bool,
    /// Its gate found nothing that could block a key (no unresolved exception row in the group,
    /// no range but its own in the lanes it took: src/key_gate/any_blocker.rs), and it parked
    /// nothing. While a lane stays held under its token, no row of the lane's keys waits then
    /// but one an outcome of the token parked (docs/semantics.md, "One lock order", outcome
    /// step 4).
    pub nothing_waited: bool,
}

/// The lane a claim held first (in the order it took its lanes), and how many claims in a row
/// held that lane first, each carrying the acks of the one before: remembered here with the
/// claim's token, read and counted by src/lanes/stay.rs (this module imports no lane code).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stay {
    pub lane: i32,
    pub claims: u32,
}

/// One claim remembered.
struct Claim {
    token: pgrx::Uuid,
    facts: Facts,
    /// The messages it handed out from ranges, in id order.
    range_ids: Box<[i64]>,
    /// The lanes of its ranges that handed out a message with a key, sorted.
    keyed_lanes: Box<[i32]>,
    /// The lanes it stored its hold on, sorted.
    held: Box<[i32]>,
    /// The lane it held first, and the run (src/lanes/stay.rs).
    stay: Option<Stay>,
}

/// The newest claim of `token` this backend remembers.
fn known(known: &VecDeque<Claim>, token: pgrx::Uuid) -> Option<&Claim> {
    known.iter().rev().find(|c| c.token == token)
}

thread_local! {
    /// Claims of the transaction in progress.
    static MADE: RefCell<Vec<Claim>> = const { RefCell::new(Vec::new()) };
    /// Claims committed, newest last.
    static KNOWN: RefCell<VecDeque<Claim>> = const { RefCell::new(VecDeque::new()) };
}

/// What a claim handed out, as `made` records it.
pub struct Made {
    /// It handed out an exception row (`Facts::rows_in_flight`).
    pub rows_in_flight: bool,
    /// `Facts::nothing_waited`.
    pub nothing_waited: bool,
    /// The messages it handed out from ranges.
    pub range_ids: Vec<i64>,
    /// The lanes of its ranges that handed out a message with a key.
    pub keyed_lanes: Vec<i32>,
    /// The lanes it stored its hold on.
    pub held: Vec<i32>,
    /// The lane it held first, and the run (`Stay`).
    pub stay: Option<Stay>,
}

/// A claim of the transaction in progress handed out `made` under `token`.
pub fn made(token: pgrx::Uuid, made: Made) {
    let Made { rows_in_flight, nothing_waited, mut range_ids, mut keyed_lanes, mut held, stay } = made;
    let facts = Facts { held_lanes: !held.is_empty(), rows_in_flight, nothing_waited };
    if range_ids.len() > RANGE_IDS_KEPT {
        range_ids = vec![];
    }
    range_ids.sort_unstable();
    for lanes in [&mut keyed_lanes, &mut held] {
        lanes.sort_unstable();
        lanes.dedup();
    }
    MADE.with(|claims| {
        let mut made = claims.borrow_mut();
        // A transaction that claims many times (a loop in a DO block) counts its last claims only.
        if made.len() == KEPT {
            made.remove(0);
        }
        made.push(Claim {
            token,
            facts,
            range_ids: range_ids.into_boxed_slice(),
            keyed_lanes: keyed_lanes.into_boxed_slice(),
            held: held.into_boxed_slice(),
            stay,
        })
    });
}

/// What the committed claim of `token` handed out, if this backend made it.
pub fn facts(token: pgrx::Uuid) -> Option<Facts> {
    KNOWN.with(|k| known(&k.borrow(), token).map(|c| c.facts))
}

/// The lanes of the ranges with a keyed message that this backend's committed claim of `token`
/// handed out, sorted: every range row under the token that lists a keyed message is in one of
/// them.
pub fn keyed_lanes(token: pgrx::Uuid) -> Option<Vec<i32>> {
    KNOWN.with(|k| known(&k.borrow(), token).map(|c| c.keyed_lanes.to_vec()))
}

/// The lanes this backend's committed claim of `token` stored its hold on, sorted: no lane
/// outside them is held under the token (a lease's extension only moves a hold's expiry).
pub fn held_lanes(token: pgrx::Uuid) -> Option<Vec<i32>> {
    KNOWN.with(|k| known(&k.borrow(), token).map(|c| c.held.to_vec()))
}

/// The lane this backend's committed claim of `token` held first, and its run.
pub fn stay(token: pgrx::Uuid) -> Option<Stay> {
    KNOWN.with(|k| known(&k.borrow(), token).and_then(|c| c.stay))
}

/// Whether `ids` name every message this backend's committed claim of `token` handed out from
/// ranges (and it handed out some): then every range row under the token lists only messages
/// of `ids`.
pub fn covers(token: pgrx::Uuid, ids: &[i64]) -> bool {
    KNOWN.with(|k| {
        let claims = k.borrow();
        let Some(Claim { range_ids, .. }) = known(&claims, token) else { return false };
        if range_ids.is_empty() || ids.len() < range_ids.len() {
            return false;
        }
        let mut ids = ids.to_vec();
        ids.sort_unstable();
        range_ids.iter().all(|id| ids.binary_search(id).is_ok())
    })
}

/// The transaction committed: its claims count from now on.
pub fn committed() {
    let made = MADE.take();
    if made.is_empty() {
        return;
    }
    KNOWN.with(|known| {
        let mut known = known.borrow_mut();
        for claim in made {
            if known.len() == KEPT {
                known.pop_front();
            }
            known.push_back(claim);
        }
    });
}

/// The transaction, or one of its savepoints, was rolled back or prepared: its claims go (all
/// of them on a savepoint's rollback: only speed is lost).
pub fn rolled_back() {
    MADE.take();
}

#[cfg(test)]
mod tests {
    use super::*;

    fn token(n: u8) -> pgrx::Uuid {
        pgrx::Uuid::from_bytes([n; 16])
    }

    const NOTHING: Facts = Facts { held_lanes: false, rows_in_flight: false, nothing_waited: false };

    fn claim(range_ids: Vec<i64>, keyed_lanes: Vec<i32>, held: Vec<i32>) -> Made {
        Made { rows_in_flight: false, nothing_waited: false, range_ids, keyed_lanes, held, stay: None }
    }

    #[test]
    fn a_claim_counts_once_committed() {
        made(token(1), claim(vec![], vec![], vec![]));
        assert_eq!(facts(token(1)), None, "not before the commit");
        committed();
        assert_eq!(facts(token(1)), Some(NOTHING));
    }

    #[test]
    fn a_rolled_back_claim_is_not_known() {
        made(token(2), claim(vec![], vec![], vec![]));
        rolled_back();
        committed();
        assert_eq!(facts(token(2)), None);
    }

    #[test]
    fn the_oldest_claims_are_forgotten() {
        for n in 10..10 + KEPT as u8 + 1 {
            made(token(n), claim(vec![], vec![], vec![]));
        }
        committed();
        assert_eq!(facts(token(10)), None);
        assert_eq!(facts(token(11)), Some(NOTHING));
    }

    #[test]
    fn an_ack_covers_a_claim_when_it_names_every_message_of_its_ranges() {
        made(token(100), claim(vec![7, 5, 6], vec![], vec![]));
        assert!(!covers(token(100), &[5, 6, 7]), "not before the commit");
        committed();
        assert!(covers(token(100), &[7, 6, 5]), "in any order");
        assert!(covers(token(100), &[4, 5, 6, 7]), "with more besides");
        assert!(!covers(token(100), &[5, 6]), "not a part");
        assert!(!covers(token(100), &[5, 6, 6]), "not a part, named twice");
        assert!(!covers(token(101), &[5, 6, 7]), "not an unknown token");
        made(token(102), claim(vec![], vec![], vec![]));
        committed();
        assert!(!covers(token(102), &[1]), "not a claim that handed out no range");
    }

    #[test]
    fn a_claim_remembers_the_lanes_of_its_keyed_ranges() {
        made(token(103), claim(vec![1, 2, 3], vec![5, 1, 5], vec![]));
        assert_eq!(keyed_lanes(token(103)), None, "not before the commit");
        committed();
        assert_eq!(keyed_lanes(token(103)), Some(vec![1, 5]), "sorted, each once");
        assert_eq!(keyed_lanes(token(104)), None, "not an unknown token");
    }

    #[test]
    fn a_claim_remembers_the_lanes_it_holds() {
        made(token(105), claim(vec![1], vec![3], vec![7, 3, 7]));
        assert_eq!(held_lanes(token(105)), None, "not before the commit");
        committed();
        assert_eq!(held_lanes(token(105)), Some(vec![3, 7]), "sorted, each once");
        assert_eq!(facts(token(105)), Some(Facts { held_lanes: true, ..NOTHING }));
        assert_eq!(held_lanes(token(106)), None, "not an unknown token");
    }

    #[test]
    fn a_claim_remembers_the_lane_it_held_first() {
        let first = Stay { lane: 7, claims: 2 };
        made(token(107), Made { stay: Some(first), ..claim(vec![1], vec![7], vec![3, 7]) });
        assert_eq!(stay(token(107)), None, "not before the commit");
        committed();
        assert_eq!(stay(token(107)), Some(first));
        assert_eq!(stay(token(108)), None, "not an unknown token");
    }
}
