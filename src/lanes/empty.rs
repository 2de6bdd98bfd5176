//! What this backend has proven about lanes with nothing new: "lane L of the log has no
//! message with an id in `(from, through]`", learned from a probe that found none up to a safe
//! head `through`.
//!
//! Every id up to a safe head is final: each producer that could have taken one has ended
//! (src/fence.rs), and the probe ran with a snapshot taken after the fence proved it. Nothing
//! ever adds a message there afterwards: seeks and other claims move lanes, retention drops
//! partitions, and none of them writes the log below its head. So the fact stays true for as long
//! as the log exists, and a claim whose lanes sit behind the head with nothing after them (a
//! stream with few keys leaves most lanes so, and moving them up on every idle claim would make
//! idle claims write) does not probe them again until the head moves on.
//!
//! The facts are kept per stream together with the oid of its log, so a stream dropped and
//! created again with the same id (after `DROP EXTENSION`) starts with none.

use std::cell::RefCell;
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

thread_local! {
    static FACTS: RefCell<HashMap<StreamId, Facts>> = RefCell::new(HashMap::new());
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
/// `safe`; a fact it continues is extended.
pub fn learn(stream_id: StreamId, log: pg_sys::Oid, lane: i32, claimed: i64, safe: i64) {
    FACTS.with(|facts| {
        let mut facts = facts.borrow_mut();
        if facts.values().map(|f| f.lanes.len()).sum::<usize>() >= MAX_FACTS {
            facts.clear();
        }
        let stream = facts.entry(stream_id).or_default();
        if stream.log != log {
            *stream = Facts { log, lanes: HashMap::new() };
        }
        let fact = match stream.lanes.get(&lane) {
            Some(&(from, through)) if from <= claimed && claimed <= through => (from, through.max(safe)),
            _ => (claimed, safe),
        };
        stream.lanes.insert(lane, fact);
    })
}

/// Forgets a dropped stream's facts.
pub fn forget(stream_id: StreamId) {
    FACTS.with(|facts| facts.borrow_mut().remove(&stream_id));
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOG: pg_sys::Oid = pg_sys::Oid::from_u32(16_384);

    #[test]
    fn a_fact_covers_positions_and_heads_inside_it() {
        learn(1, LOG, 3, 100, 500);
        assert!(known(1, LOG, 3, 100, 500));
        assert!(known(1, LOG, 3, 250, 400), "a later position and an earlier head are inside");
        assert!(!known(1, LOG, 3, 99, 500), "id 100 itself may be a message of the lane");
        assert!(!known(1, LOG, 3, 100, 501), "nothing is known past the head probed");
        assert!(!known(1, LOG, 4, 100, 500), "other lanes know nothing");
        assert!(!known(2, LOG, 3, 100, 500), "other streams know nothing");
    }

    #[test]
    fn a_probe_that_continues_a_fact_extends_it() {
        learn(5, LOG, 0, 10, 20);
        learn(5, LOG, 0, 20, 30);
        assert!(known(5, LOG, 0, 10, 30));
        learn(5, LOG, 0, 40, 50);
        assert!(!known(5, LOG, 0, 10, 50), "a gap in between is not known");
        assert!(known(5, LOG, 0, 40, 50));
    }

    #[test]
    fn a_new_log_of_the_same_stream_id_knows_nothing() {
        learn(7, LOG, 1, 0, 100);
        let recreated = pg_sys::Oid::from_u32(16_999);
        assert!(!known(7, recreated, 1, 0, 100));
        learn(7, recreated, 2, 0, 100);
        assert!(!known(7, LOG, 2, 0, 100), "the old log's facts went with it");
        forget(7);
        assert!(!known(7, recreated, 2, 0, 100));
    }
}
