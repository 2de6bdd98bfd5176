//! What this backend's own committed claims handed out, by lease token: whether a claim held a
//! lane, whether it put an exception row in flight, and how many messages it handed out from
//! ranges. A consumer that acks with its next claim (or on the connection it claimed on) then
//! skips the two statements an ack runs for the first two, which find nothing for most claims:
//! the release of the lanes the token holds, and the delete of its rows in flight. An ack of as
//! many messages as the claim's ranges held deletes them whole in one statement (src/range.rs,
//! `resolve_covered`).
//!
//! Both facts are final once the claim commits: only the claim that made a token holds a lane
//! or puts a row in flight under it (a claim handing out an expired row or range again does so
//! under its own new token). A claim's facts count once its transaction commits, and go with it
//! when it rolls back or is prepared. A token this backend does not know (a claim made on
//! another connection, or forgotten) gets both statements, as before.

use std::cell::RefCell;
use std::collections::VecDeque;

/// Claims remembered per backend: a consumer pipelining its claims has a few open at once.
const KEPT: usize = 64;

/// What one claim handed out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Facts {
    /// It holds a lane (it handed out ordered or exclusive work of a key).
    pub held_lanes: bool,
    /// It handed out an exception row (a retry, a delayed or woken row, an expired delivery).
    pub rows_in_flight: bool,
    /// How many messages it handed out from ranges (src/range.rs, `may_cover`).
    pub range_messages: usize,
}

thread_local! {
    /// Claims of the transaction in progress.
    static MADE: RefCell<Vec<(pgrx::Uuid, Facts)>> = const { RefCell::new(Vec::new()) };
    /// Claims committed, newest last.
    static KNOWN: RefCell<VecDeque<(pgrx::Uuid, Facts)>> = const { RefCell::new(VecDeque::new()) };
}

/// A claim of the transaction in progress handed out work under `token`.
pub fn made(token: pgrx::Uuid, facts: Facts) {
    MADE.with(|made| made.borrow_mut().push((token, facts)));
}

/// What the committed claim of `token` handed out, if this backend made it.
pub fn facts(token: pgrx::Uuid) -> Option<Facts> {
    KNOWN.with(|known| known.borrow().iter().rev().find(|(t, _)| *t == token).map(|(_, f)| *f))
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

    const NOTHING: Facts = Facts { held_lanes: false, rows_in_flight: false, range_messages: 0 };

    #[test]
    fn a_claim_counts_once_committed() {
        made(token(1), NOTHING);
        assert_eq!(facts(token(1)), None, "not before the commit");
        committed();
        assert_eq!(facts(token(1)), Some(NOTHING));
    }

    #[test]
    fn a_rolled_back_claim_is_not_known() {
        made(token(2), NOTHING);
        rolled_back();
        committed();
        assert_eq!(facts(token(2)), None);
    }

    #[test]
    fn the_oldest_claims_are_forgotten() {
        for n in 10..10 + KEPT as u8 + 1 {
            made(token(n), NOTHING);
        }
        committed();
        assert_eq!(facts(token(10)), None);
        assert_eq!(facts(token(11)), Some(NOTHING));
    }
}
