//! What this backend has seen of lanes with work: "lane L of the log has message X", learned
//! from a probe that found X as the lane's next message up to a safe head, or from a claim's read
//! of the lane that found X after the batch it handed out (src/message.rs reads one row more). A
//! probe looks at a few lanes at once and a claim takes one of them, so the next claims take the
//! others without probing them again; a lane read before is taken again without a probe.
//!
//! X is at or below a safe head, so it is final (src/fence.rs); retention keeps it while any
//! group has not committed it. So while a lane's position is below X, the lane has work: X, at
//! least. Except after a seek back past partitions retention dropped meanwhile (or a group
//! created again from the beginning): the lane then sits in an older partition than the safe
//! head's, where the facts are not used (src/lanes.rs probes such a lane, and moves it up). Facts count once the
//! transaction that learned them commits, as in src/lanes/empty.rs, and are kept per stream with
//! the oid of its log.

use std::cell::RefCell;
use std::collections::HashMap;

use pgrx::pg_sys;

use crate::statement::StreamId;

/// Facts kept per backend; past this many (streams × lanes), all are forgotten.
const MAX_FACTS: usize = 65_536;

thread_local! {
    /// (stream, log, lane) -> a message of the lane.
    static FACTS: RefCell<HashMap<(StreamId, pg_sys::Oid, i32), i64>> = RefCell::new(HashMap::new());
    static LEARNED: RefCell<Vec<((StreamId, pg_sys::Oid, i32), i64)>> = const { RefCell::new(Vec::new()) };
}

/// Whether lane `lane` is known to have a message after `claimed` up to the safe head `safe`
/// (a group's safe head may lag behind the one the probe read with).
pub fn known(stream_id: StreamId, log: pg_sys::Oid, lane: i32, claimed: i64, safe: i64) -> bool {
    FACTS.with(|facts| facts.borrow().get(&(stream_id, log, lane)).is_some_and(|&id| claimed < id && id <= safe))
}

/// Records that a probe, or a claim's read, found message `id` in lane `lane` after the lane's
/// position; it counts once the transaction commits (`committed`).
pub fn learn(stream_id: StreamId, log: pg_sys::Oid, lane: i32, id: i64) {
    LEARNED.with(|learned| {
        let mut learned = learned.borrow_mut();
        if learned.len() < MAX_FACTS {
            learned.push(((stream_id, log, lane), id));
        }
    });
}

/// The transaction committed: what it learned counts from now on.
pub fn committed() {
    let learned = LEARNED.take();
    if learned.is_empty() {
        return;
    }
    FACTS.with(|facts| {
        let mut facts = facts.borrow_mut();
        if facts.len() + learned.len() > MAX_FACTS {
            facts.clear();
        }
        facts.extend(learned);
    });
}

/// The transaction, or one of its savepoints, was rolled back or prepared: what it learned goes.
pub fn rolled_back() {
    LEARNED.take();
}

/// Forgets a dropped stream's facts.
pub fn forget(stream_id: StreamId) {
    FACTS.with(|facts| facts.borrow_mut().retain(|(stream, _, _), _| *stream != stream_id));
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOG: pg_sys::Oid = pg_sys::Oid::from_u32(16_384);

    #[test]
    fn a_lane_has_work_while_its_position_is_below_the_message_seen() {
        learn(1, LOG, 3, 200);
        assert!(!known(1, LOG, 3, 100, 500), "not before the commit");
        committed();
        assert!(known(1, LOG, 3, 100, 500));
        assert!(known(1, LOG, 3, 199, 200));
        assert!(!known(1, LOG, 3, 200, 500), "handed out: nothing is known after it");
        assert!(!known(1, LOG, 3, 100, 199), "a safe head below it does not reach it");
        assert!(!known(1, LOG, 4, 100, 500), "other lanes know nothing");
        let recreated = pg_sys::Oid::from_u32(16_999);
        assert!(!known(1, recreated, 3, 100, 500), "a new log of the same stream id knows nothing");
        forget(1);
        assert!(!known(1, LOG, 3, 100, 500));
    }

    #[test]
    fn what_a_rolled_back_transaction_learned_goes() {
        learn(2, LOG, 0, 50);
        rolled_back();
        committed();
        assert!(!known(2, LOG, 0, 10, 100));
    }
}
