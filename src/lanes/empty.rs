//! What this backend has proven about lanes with nothing new: "lane L of the log has no
//! message with an id in `(from, through]`", learned from a probe that found none up to a safe
//! head `through`.
//!
//! Every id up to a safe head is final: each producer that could have taken one has ended
//! (src/fence.rs), and the probe ran with a snapshot taken after the fence proved it. Nothing
//! ever adds a message there afterwards: seeks and other claims move lanes, retention drops
//! partitions, and no id at or below a safe head is ever written again. So the fact stays true for as long
//! as the log exists, and a claim whose lanes sit behind the head with nothing after them (a
//! stream with few keys leaves most lanes so, and moving them up on every idle claim would make
//! idle claims write) does not probe them again until the head moves on.
//!
//! A probe sees what its own transaction did, and a transaction could have dropped a partition
//! (a retention step) and then been rolled back: so what a transaction learns counts once it
//! commits, and goes with it when it rolls back (or any of its savepoints does, or it is
//! prepared). The facts are kept per stream together with the oid of its log, so a stream
//! dropped and created again with the same id (after `DROP EXTENSION`) starts with none.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;

use pgrx::pg_sys;

use crate::statement::StreamId;

/// Lanes' facts kept per backend; past this many (streams × lanes), all are forgotten.
const MAX_FACTS: usize = 65_536;

#[derive(Default)]
struct Facts {
    /// Oid of the stream's log when the facts were learned.
    log: pg_sys::Oid,
    /// Per lane: no message in `(from, through]`.
    lanes: HashMap<i32, (i64, i64)>,
}

/// A fact learned by the transaction in progress.
struct Learned {
    stream_id: StreamId,
    log: pg_sys::Oid,
    lane: i32,
    claimed: i64,
    safe: i64,
}

thread_local! {
    static FACTS: RefCell<HashMap<StreamId, Facts>> = RefCell::new(HashMap::new());
    static KNOWN: Cell<usize> = const { Cell::new(0) };
    static LEARNED: RefCell<Vec<Learned>> = const { RefCell::new(Vec::new()) };
}

/// Whether lane `lane` of stream `stream_id` (log `log`) is known to have no message after
/// `claimed` up to `safe`.
pub fn known(stream_id: StreamId, log: pg_sys::Oid, lane: i32, claimed: i64, safe: i64) -> bool {
    FACTS.with(|facts| {
        let facts = facts.borrow();
        let Some(stream) = facts.get(&stream_id).filter(|f| f.log == log) else { return false };
        stream.lanes.get(&lane).is_some_and(|&(from, through)| from <= claimed && safe <= through)
    })
}

/// Records that a probe found no message of lane `lane` after `claimed` up to the safe head
/// `safe`; it counts once the transaction commits (`committed`).
/// A transaction that claims in a loop learns no more than `MAX_FACTS` (its facts count only
/// once it commits, so each of its claims probes and learns again).
pub fn learn(stream_id: StreamId, log: pg_sys::Oid, lane: i32, claimed: i64, safe: i64) {
    LEARNED.with(|learned| {
        let mut learned = learned.borrow_mut();
        if learned.len() < MAX_FACTS {
            learned.push(Learned { stream_id, log, lane, claimed, safe });
        }
    });
}

/// The transaction committed: what it learned counts from now on (a fact it continues is
/// extended).
pub fn committed() {
    for Learned { stream_id, log, lane, claimed, safe } in LEARNED.take() {
        FACTS.with(|facts| {
            let mut facts = facts.borrow_mut();
            if KNOWN.get() >= MAX_FACTS {
                facts.clear();
                KNOWN.set(0);
            }
            let stream = facts.entry(stream_id).or_default();
            if stream.log != log {
                KNOWN.set(KNOWN.get() - stream.lanes.len());
                *stream = Facts { log, lanes: HashMap::new() };
            }
            let fact = match stream.lanes.get(&lane) {
                Some(&(from, through)) if from <= claimed && claimed <= through => (from, through.max(safe)),
                _ => (claimed, safe),
            };
            if stream.lanes.insert(lane, fact).is_none() {
                KNOWN.set(KNOWN.get() + 1);
            }
        })
    }
}

/// The transaction, or one of its savepoints, was rolled back or prepared: what it learned goes
/// (all of it on a savepoint's rollback, such as a PL/pgSQL exception block's: only speed is lost).
pub fn rolled_back() {
    LEARNED.take();
}

/// Forgets a dropped stream's facts.
pub fn forget(stream_id: StreamId) {
    if let Some(stream) = FACTS.with(|facts| facts.borrow_mut().remove(&stream_id)) {
        KNOWN.set(KNOWN.get() - stream.lanes.len());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOG: pg_sys::Oid = pg_sys::Oid::from_u32(16_384);

    fn learn_and_commit(stream_id: StreamId, log: pg_sys::Oid, lane: i32, claimed: i64, safe: i64) {
        learn(stream_id, log, lane, claimed, safe);
        committed();
    }

    #[test]
    fn a_fact_covers_positions_and_heads_inside_it() {
        learn_and_commit(1, LOG, 3, 100, 500);
        assert!(known(1, LOG, 3, 100, 500));
        assert!(known(1, LOG, 3, 250, 400), "a later position and an earlier head are inside");
        assert!(!known(1, LOG, 3, 99, 500), "id 100 itself may be a message of the lane");
        assert!(!known(1, LOG, 3, 100, 501), "nothing is known past the head probed");
        assert!(!known(1, LOG, 4, 100, 500), "other lanes know nothing");
        assert!(!known(2, LOG, 3, 100, 500), "other streams know nothing");
    }

    #[test]
    fn a_probe_that_continues_a_fact_extends_it() {
        learn_and_commit(5, LOG, 0, 10, 20);
        learn_and_commit(5, LOG, 0, 20, 30);
        assert!(known(5, LOG, 0, 10, 30));
        learn_and_commit(5, LOG, 0, 40, 50);
        assert!(!known(5, LOG, 0, 10, 50), "a gap in between is not known");
        assert!(known(5, LOG, 0, 40, 50));
    }

    #[test]
    fn a_new_log_of_the_same_stream_id_knows_nothing() {
        learn_and_commit(7, LOG, 1, 0, 100);
        let recreated = pg_sys::Oid::from_u32(16_999);
        assert!(!known(7, recreated, 1, 0, 100));
        learn_and_commit(7, recreated, 2, 0, 100);
        assert!(!known(7, LOG, 2, 0, 100), "the old log's facts went with it");
        forget(7);
        assert!(!known(7, recreated, 2, 0, 100));
    }

    #[test]
    fn what_a_transaction_learned_counts_once_it_commits_and_goes_with_its_rollback() {
        learn(9, LOG, 1, 0, 100);
        assert!(!known(9, LOG, 1, 0, 100), "not before the commit");
        rolled_back();
        committed();
        assert!(!known(9, LOG, 1, 0, 100), "a rolled-back transaction's facts are gone");
        learn(9, LOG, 1, 0, 100);
        committed();
        assert!(known(9, LOG, 1, 0, 100));
    }
}
