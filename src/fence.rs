//! The claim fence: how far a group may claim without skipping a message whose producer has
//! not committed yet.
//!
//! Ids are handed out in call order but transactions commit in any order, so "the highest
//! visible id" is not a safe place to stop: a lower id may still be inside an open transaction
//! (a long one, or one in a savepoint) and would be skipped forever once the cursor passed it.
//!
//! The proof used here:
//! 1. `produce` takes its top-level transaction id *before* it takes a message id.
//! 2. A claim reads `H`, the highest id handed out (the sequence's last value, under the
//!    sequence's buffer lock: src/head.rs says why), and only then
//!    `X`, the next transaction id to be assigned. Every id `<= H` was taken by a transaction
//!    whose id is `< X` (its xid came before its message id, which came before the read of `H`).
//! 3. Once the oldest running transaction is `>= X`, all of those transactions have ended: each
//!    id `<= H` is now committed (visible to a new snapshot) or rolled back (never visible).
//!    So `H` is safe. The observation `(H, X)` is "mature".
//!
//! Each group stores its fence (`Fence`): the head proven so far, and a pending observation. A
//! claim proves what the pending one now proves, then makes a fresh one; a fresh observation is
//! mature at once when no transaction is running, otherwise it is stored and a later claim finds
//! it mature. Every lane of the group claims up to the same proven head.
//!
//! "Oldest running transaction" would let any long writing transaction anywhere in the database
//! hold every stream back. So each producer also takes its stream's producer lock (shared,
//! `src/locks.rs`) before its message ids, and when the global bound proves nothing new, the
//! claim reads the oldest transaction id among that stream's lock holders (from the lock manager,
//! `locks::producer_xids`, or from `pg_locks` for a prepared holder): only
//! this stream's open producers hold it back. An outbox producer that wrote its business row
//! first already has a transaction id when it registers; that is fine, since what matters is
//! that both come before its message ids. Read-only transactions take no transaction id and
//! hold nothing back either way.
//!
//! The order of the reads is the proof, also across claims: a claim reads the stored fence (and
//! what its backend proved in earlier claims, `known`) first and takes its `Reading` after it,
//! and it never waits for another claim in between (src/claim.rs). A bound read before an
//! observation was stored must never be applied to it: that is exactly how a message gets
//! skipped.

use std::cell::RefCell;
use std::collections::HashMap;

use pgrx::pg_guard;
use pgrx::pg_sys::{self, BuiltinOid::*};
use pgrx::spi::SpiClient;

use crate::error::Result;
use crate::locks;
use crate::statement::{Columns, Statement};

/// Transaction ids held by the stream's running producers, as 32-bit values. A holder without a
/// transaction id has not taken a message id yet and cannot hold anything back. pg_locks is
/// readable by every role (pg_stat_activity hides other roles' xids) and also shows prepared
/// transactions, whose locks stay with the same virtual transaction.
const PRODUCER_XIDS: Statement = Statement {
    name: "fence_producer_xids",
    sql: concat!(
        "SELECT coalesce(pg_catalog.array_agg(t.transactionid::text::int8), '{}') AS xids
          FROM pg_catalog.pg_locks a
          JOIN pg_catalog.pg_locks t
            ON t.virtualtransaction = a.virtualtransaction AND t.locktype = 'transactionid'
           AND t.mode = 'ExclusiveLock' AND t.granted
          WHERE a.database = (SELECT oid FROM pg_catalog.pg_database WHERE datname = pg_catalog.current_database())
            AND ",
        locks::producer_locks_where!()
    ),
    params: &[INT8OID, INT8OID],
};

/// The oldest transaction id (64-bit) among the stream's running producers; `next_xid` when
/// there is none. Must be called after `next_xid` was read. From the lock manager, or from
/// `pg_locks` when a holder's transaction id is not readable there (a prepared transaction).
pub fn oldest_producer(client: &SpiClient<'_>, stream_id: i64, next_xid: u64) -> Result<u64> {
    let xids: Vec<pg_sys::TransactionId> = match locks::producer_xids(stream_id) {
        Some(xids) => xids,
        None => {
            let (high, low) = locks::producer_lock_params(stream_id);
            let xids: Vec<i64> = PRODUCER_XIDS.run(client, 0, &[high.into(), low.into()])?.first().required("xids")?;
            xids.into_iter().map(|x| pg_sys::TransactionId::from(x as u32)).collect()
        }
    };
    Ok(xids.into_iter().map(|x| widen_xid(x, next_xid)).min().unwrap_or(next_xid).min(next_xid))
}

/// "Every id <= head is safe once the oldest running transaction is >= xid."
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Observation {
    pub head: i64,
    pub xid: u64,
}

impl Observation {
    pub fn is_mature(&self, oldest_running: u64) -> bool {
        self.xid <= oldest_running
    }
}

/// One reading of the fence, taken in this order: `head`, then `next_xid`, then `oldest_running`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reading {
    /// Highest message id handed out so far (0 when none).
    pub head: i64,
    /// Next transaction id to be assigned (64-bit).
    pub next_xid: u64,
    /// Oldest transaction id still running (64-bit); `next_xid` when none.
    pub oldest_running: u64,
}

impl Reading {
    fn observation(&self) -> Observation {
        Observation { head: self.head, xid: self.next_xid }
    }
}

impl Reading {
    /// Tightens the bound with the oldest running producer of this stream (a transaction that
    /// does not produce to it cannot hold one of its ids).
    pub fn with_producer_bound(self, oldest_producer: u64) -> Reading {
        Reading { oldest_running: self.oldest_running.max(oldest_producer), ..self }
    }
}

/// What a group stores of the fence (in its cursor row): every id up to `safe` is proven
/// committed or rolled back; `pending` is an observation that may prove more once it matures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fence {
    pub safe: i64,
    pub pending: Option<Observation>,
}

impl Fence {
    /// The fence after `reading`: what it proves now, and the observation left to mature (an
    /// older pending one matures sooner than a fresh one, so it is kept while it covers more
    /// than what is proven).
    pub fn advance(self, reading: &Reading) -> Fence {
        let mature = |o: &Observation| o.is_mature(reading.oldest_running);
        // A stored xid beyond the next one this cluster will assign was not read in this
        // cluster's history: the cursor came with a restore from another cluster, or a crash (or
        // point-in-time recovery) lost the end of the WAL, which may roll the next xid back below
        // one that was read. It proves nothing here, and kept it would wait until this cluster's
        // ids caught up, holding the group back whenever a producer is open: the fresh
        // observation below takes its place.
        let stored = self.pending.filter(|o| o.xid <= reading.next_xid);
        let mut safe = self.safe;
        if let Some(pending) = stored.filter(mature) {
            safe = safe.max(pending.head);
        }
        if mature(&reading.observation()) {
            safe = safe.max(reading.head);
        }
        let pending = match stored {
            _ if reading.head <= safe => None,
            Some(older) if older.head > safe && !mature(&older) => Some(older),
            _ => Some(reading.observation()),
        };
        Fence { safe, pending }
    }

    /// What `self` and `other` prove together: the higher proven head, and of their pending
    /// observations that cover more than it, the one that matures first.
    pub fn merge(self, other: Fence) -> Fence {
        let safe = self.safe.max(other.safe);
        let pending = [self.pending, other.pending]
            .into_iter()
            .flatten()
            .filter(|o| o.head > safe)
            .min_by_key(|o| (o.xid, std::cmp::Reverse(o.head)));
        Fence { safe, pending }
    }

    /// Whether the global bound of `reading` proves nothing new, so that looking up the
    /// stream's own producers (`oldest_producer`) could.
    pub fn stalled(self, reading: &Reading) -> bool {
        reading.head > self.safe && self.advance(reading).safe == self.safe
    }
}

/// Groups whose fence a backend keeps; past this many, all are forgotten.
const MAX_KNOWN: usize = 4096;

thread_local! {
    /// The fence as this backend's last claim of each group left it, and the head it read then,
    /// by group id and the oid of the stream's sequence it read the head from.
    static KNOWN: RefCell<HashMap<(i64, pg_sys::Oid), (Fence, i64)>> = RefCell::new(HashMap::new());
}

/// What this backend proved for group `group_id` in its earlier claims, for a stream whose head
/// is now `head`, read from sequence `sequence`: claims go on from it as from the stored fence,
/// which a claim left open in a transaction block keeps them from storing (docs/semantics.md,
/// "The claim fence"). Kept per sequence, and forgotten with it (`sequence_changed`); a head
/// below the one read then says the sequence was moved back by hand, and it is forgotten too.
pub fn known(group_id: i64, sequence: pg_sys::Oid, head: i64) -> Option<Fence> {
    let (fence, then) = KNOWN.with(|known| known.borrow().get(&(group_id, sequence)).copied())?;
    (head >= then && fence.safe <= head).then_some(fence)
}

/// Keeps `fence`, made with a reading of `head`, as what this backend proved for group
/// `group_id` of the stream whose sequence is `sequence`.
pub fn remember(group_id: i64, sequence: pg_sys::Oid, fence: Fence, head: i64) {
    KNOWN.with(|known| {
        let mut known = known.borrow_mut();
        if known.len() >= MAX_KNOWN && !known.contains_key(&(group_id, sequence)) {
            known.clear();
        }
        known.insert((group_id, sequence), (fence, head));
    });
}

/// Registers the invalidation callback once per backend (from `_PG_init`).
pub fn init() {
    // SAFETY: registers a callback with a null argument; it lives as long as the backend.
    unsafe { pg_sys::CacheRegisterRelcacheCallback(Some(sequence_changed), pg_sys::Datum::from(0)) };
}

/// A relation changed or was dropped (every one: `InvalidOid`): what was kept for a stream whose
/// sequence it is is forgotten.
#[pg_guard]
unsafe extern "C-unwind" fn sequence_changed(_arg: pg_sys::Datum, relid: pg_sys::Oid) {
    KNOWN.with(|known| {
        let mut known = known.borrow_mut();
        if relid == pg_sys::InvalidOid {
            known.clear();
        } else {
            known.retain(|(_, sequence), _| *sequence != relid);
        }
    });
}

/// Reads the fence for a stream whose sequence's last value is `head`. The caller must have read
/// `head` before calling this; the order of the reads is the proof.
pub fn read(head: i64) -> Reading {
    // SAFETY: plain reads of shared transaction state under Postgres' own locks.
    unsafe {
        let next = pg_sys::ReadNextFullTransactionId().value;
        let snapshot = pg_sys::GetLatestSnapshot();
        let oldest = widen_xid((*snapshot).xmin, next);
        Reading { head, next_xid: next, oldest_running: oldest.min(next) }
    }
}

/// Widens a 32-bit xid that is not newer than `next` (a 64-bit xid) to 64 bits.
pub fn widen_xid(xid: pg_sys::TransactionId, next: u64) -> u64 {
    let xid = u32::from(xid) as u64;
    let next_low = next & 0xFFFF_FFFF;
    let epoch = next & !0xFFFF_FFFF;
    if xid <= next_low {
        epoch | xid
    } else {
        // xid belongs to the previous epoch.
        (epoch | xid).wrapping_sub(1 << 32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reading(head: i64, next_xid: u64, oldest_running: u64) -> Reading {
        Reading { head, next_xid, oldest_running }
    }

    const NOTHING: Fence = Fence { safe: 0, pending: None };

    #[test]
    fn quiet_database_matures_at_once() {
        // No transaction running: oldest_running == next_xid.
        assert_eq!(NOTHING.advance(&reading(10, 500, 500)), Fence { safe: 10, pending: None });
    }

    #[test]
    fn a_running_transaction_holds_a_fresh_observation() {
        // Transaction 480 is still running: ids up to 10 may belong to it.
        let f = NOTHING.advance(&reading(10, 500, 480));
        assert_eq!(f, Fence { safe: 0, pending: Some(Observation { head: 10, xid: 500 }) });
        // Later: 480 has ended, but 505 (newer) is running and more ids were taken.
        let later = f.advance(&reading(15, 510, 505));
        assert_eq!(later, Fence { safe: 10, pending: Some(Observation { head: 15, xid: 510 }) });
    }

    #[test]
    fn an_older_pending_observation_is_kept() {
        let f = Fence { safe: 0, pending: Some(Observation { head: 10, xid: 500 }) };
        assert_eq!(f.advance(&reading(20, 520, 490)), f, "it still waits, and matures before a fresh one would");
    }

    #[test]
    fn what_is_proven_stays_proven() {
        // A claim took only part of what was proven; the next one, with a transaction now
        // running, still has the rest.
        let f = NOTHING.advance(&reading(1000, 500, 500));
        assert_eq!(f.safe, 1000);
        let busy = f.advance(&reading(1200, 530, 520));
        assert_eq!(busy, Fence { safe: 1000, pending: Some(Observation { head: 1200, xid: 530 }) });
        // An old mature observation below the proven head never lowers it.
        let old = Fence { safe: 50, pending: Some(Observation { head: 5, xid: 1 }) };
        assert_eq!(old.advance(&reading(50, 10, 10)), Fence { safe: 50, pending: None });
    }

    #[test]
    fn an_unrelated_writer_stops_holding_once_producers_are_known() {
        // Writer 480 runs, but the stream's only open producer started at 495.
        let r = reading(10, 500, 480);
        let f = Fence { safe: 0, pending: Some(Observation { head: 8, xid: 490 }) };
        assert!(f.stalled(&r), "the global bound proves nothing");
        let refined = r.with_producer_bound(495);
        assert_eq!(f.advance(&refined).safe, 8);
        assert_eq!(f.advance(&refined).pending, Some(Observation { head: 10, xid: 500 }), "10 still waits for 495");
        // No producer at all: everything observed is safe.
        assert_eq!(f.advance(&r.with_producer_bound(500)).safe, 10);
        // The bound never loosens below the global one.
        assert_eq!(r.with_producer_bound(400).oldest_running, 480);
    }

    #[test]
    fn nothing_new_is_not_stalled() {
        let f = Fence { safe: 10, pending: None };
        assert!(!f.stalled(&reading(10, 500, 480)), "nothing beyond the proven head to wait for");
    }

    #[test]
    fn an_observation_from_another_history_is_observed_again() {
        // A restore onto a cluster whose transaction ids are far behind the dumped cluster's (or
        // a crash that rolled the next xid back): the stored xid lies in this cluster's future.
        let restored = Fence { safe: 20, pending: Some(Observation { head: 24, xid: 200_755 }) };
        // Producer 1,760 is open, and may hold any id up to 30 here: nothing is proven.
        let f = restored.advance(&reading(30, 1_770, 1_760));
        assert_eq!(f, Fence { safe: 20, pending: Some(Observation { head: 30, xid: 1_770 }) });
        // Once it ends, the observation made here is mature though a later producer is open.
        assert_eq!(
            f.advance(&reading(31, 1_780, 1_775)),
            Fence { safe: 30, pending: Some(Observation { head: 31, xid: 1_780 }) }
        );
        // Kept instead, the foreign one would never have matured while producers overlapped.
        assert!(!Observation { head: 24, xid: 200_755 }.is_mature(1_775));
    }

    #[test]
    fn what_two_fences_prove_together() {
        let stored = Fence { safe: 10, pending: Some(Observation { head: 20, xid: 500 }) };
        let known = Fence { safe: 15, pending: Some(Observation { head: 30, xid: 520 }) };
        let both = Fence { safe: 15, pending: Some(Observation { head: 20, xid: 500 }) };
        assert_eq!(stored.merge(known), both, "the observation that matures first");
        assert_eq!(known.merge(stored), both);
        // A pending observation that covers no more than the proven head is dropped.
        let ahead = Fence { safe: 25, pending: None };
        assert_eq!(stored.merge(ahead), Fence { safe: 25, pending: None });
        assert_eq!(known.merge(ahead), Fence { safe: 25, pending: Some(Observation { head: 30, xid: 520 }) });
        assert_eq!(NOTHING.merge(NOTHING), NOTHING);
    }

    #[test]
    fn a_claim_that_cannot_store_goes_on_from_what_it_knows() {
        // Another claim holds the cursor row: the stored fence stays as it was.
        let stored = Fence { safe: 0, pending: None };
        // Producers overlap: each reading sees one open that started before it.
        let first = stored.advance(&reading(10, 500, 495));
        assert_eq!(first.safe, 0);
        // Without what it knows, every claim starts from the stored fence again, and never
        // proves anything while producers overlap.
        assert_eq!(stored.advance(&reading(20, 510, 505)).safe, 0);
        // With it, the observation it made matures once the producers open then have ended.
        let second = stored.merge(first).advance(&reading(20, 510, 505));
        assert_eq!(second, Fence { safe: 10, pending: Some(Observation { head: 20, xid: 510 }) });
    }

    #[test]
    fn xids_widen_across_epochs() {
        let next = (3u64 << 32) | 100;
        assert_eq!(widen_xid(pg_sys::TransactionId::from(90u32), next), (3 << 32) | 90);
        assert_eq!(widen_xid(pg_sys::TransactionId::from(100u32), next), (3 << 32) | 100);
        assert_eq!(widen_xid(pg_sys::TransactionId::from(4_000_000_000u32), next), (2 << 32) | 4_000_000_000);
    }
}
