//! Every lock sqlstreams takes (the order they are taken in: docs/semantics.md, "One lock order").
//!
//! ## The order
//!
//! The order in which every path takes these locks, and why no cycle of waits can form, is
//! written once, for users and maintainers alike: docs/semantics.md, "One lock order". A change
//! to any path's locking changes that text in the same commit. The paths take them in
//! src/claim.rs and src/inflight_cap.rs (claims), src/outcome.rs and src/lease.rs (outcomes), src/produce.rs,
//! src/retention.rs, src/bounds.rs, src/admin/seek.rs, src/admin/dead_letters.rs,
//! src/admin/streams.rs and src/admin/groups.rs (drops) and src/admin/maintain.rs.
//!
//! ## Which locks
//!
//! The locks are lock-manager locks of the advisory kind, in classes of their own (the
//! fourth field of the lock tag). SQL's `pg_advisory_*` functions only reach classes 1 and 2,
//! so a role with no grants cannot take these locks and cannot hold a stream or a key back.
//! They show in `pg_locks` as `locktype = 'advisory'` with `objsubid` = the class.

use pgrx::pg_sys;

/// The producer lock of a stream: `(stream id high 32 bits, low 32 bits)`.
pub const PRODUCER_CLASS: u16 = 0x5350; // 'SP'
/// The per-(group, lane) lock that orders parking against wake-ups (`src/key_gate.rs`): a key's
/// lock is its lane's (a key is in one lane, and a stream's lanes never change).
pub const WAKE_CLASS: u16 = 0x534C; // 'SL'
/// The per-lease-token lock that serializes outcomes of one token.
pub const TOKEN_CLASS: u16 = 0x5354; // 'ST'
/// The per-stream lock that orders `drop_stream` against everything else on the stream.
pub const STREAM_CLASS: u16 = 0x5353; // 'SS'
/// The per-group lock that orders `drop_group` and `seek` against everything else on the group.
pub const GROUP_CLASS: u16 = 0x5347; // 'SG'
/// The per-stream lock of a retention step run from a claim (one session at a time).
pub const RETENTION_CLASS: u16 = 0x5352; // 'SR'
/// The per-group lock that serializes the claims of a group with `max_inflight`
/// (src/inflight_cap.rs).
pub const INFLIGHT_CLASS: u16 = 0x5349; // 'SI'

extern "C-unwind" {
    /// Postgres' own byte hash (`hash_any`, the hash behind `hashtext`): stable across
    /// versions and processes.
    fn hash_bytes(k: *const u8, keylen: std::ffi::c_int) -> u32;
    /// Its 64-bit form (`hash_any_extended`, behind `hashtextextended`).
    fn hash_bytes_extended(k: *const u8, keylen: std::ffi::c_int, seed: u64) -> u64;
}

/// Postgres' hash of `bytes`, as `hashtext()` computes it for a deterministic collation.
pub fn hash(bytes: &[u8]) -> u32 {
    // SAFETY: reads `bytes` only.
    unsafe { hash_bytes(bytes.as_ptr(), bytes.len() as std::ffi::c_int) }
}

fn tag(class: u16, high: u32, low: u32) -> pg_sys::LOCKTAG {
    pg_sys::LOCKTAG {
        // SAFETY: reads this backend's database id.
        locktag_field1: unsafe { pg_sys::MyDatabaseId }.to_u32(),
        locktag_field2: high,
        locktag_field3: low,
        locktag_field4: class,
        locktag_type: pg_sys::LockTagType::LOCKTAG_ADVISORY as u8,
        locktag_lockmethodid: pg_sys::USER_LOCKMETHOD as u8,
    }
}

/// Takes a transaction-scoped lock; with `wait = false` only if it is free. Returns whether
/// this transaction holds it now.
fn acquire(tag: &pg_sys::LOCKTAG, mode: u32, wait: bool) -> bool {
    lock(tag, mode, wait) != pg_sys::LockAcquireResult::LOCKACQUIRE_NOT_AVAIL
}

fn lock(tag: &pg_sys::LOCKTAG, mode: u32, wait: bool) -> pg_sys::LockAcquireResult::Type {
    // SAFETY: a transaction-scoped lock-manager lock on a tag built above; released at commit
    // or abort like any advisory transaction lock.
    unsafe { pg_sys::LockAcquire(tag, mode as pg_sys::LOCKMODE, false, !wait) }
}

fn split(id: i64) -> (u32, u32) {
    ((id as u64 >> 32) as u32, id as u32)
}

/// Marks this transaction as a producer of `stream_id` until it ends (shared: producers never
/// wait for each other, and nothing else takes this lock exclusively).
pub fn register_producer(stream_id: i64) {
    let (high, low) = split(stream_id);
    acquire(&tag(PRODUCER_CLASS, high, low), pg_sys::ShareLock, true);
}

/// The `pg_locks` condition (on alias `a`) that finds the producer locks of a stream whose id
/// has high bits `$1` and low bits `$2` (`producer_lock_params`), for the fence. 21328 is
/// `PRODUCER_CLASS`.
macro_rules! producer_locks_where {
    () => {
        "a.locktype = 'advisory' AND a.granted AND a.objsubid = 21328
            AND a.classid = $1::int8::oid AND a.objid = $2::int8::oid"
    };
}
pub(crate) use producer_locks_where;

/// The top-level transaction ids of the stream's running producers (the holders of its
/// producer lock), read from the lock manager for this one lock: `pg_locks` copies the whole
/// lock table to answer the same, which cost a claim beside busy producers about 80 µs
/// (docs/benchmarks/cost-model.md).
///
/// `None` when a holder's transaction id cannot be read here, and the caller asks `pg_locks`:
/// a prepared transaction (its locks belong to no backend), a holder whose backend ended that
/// transaction, began another or is preparing it while this reads, or one that has no
/// transaction id to show. A producer takes its transaction id before the lock
/// (src/produce.rs), so a holder shows none only while its backend clears it: at the end, and
/// when `PREPARE TRANSACTION` hands it to a prepared transaction that holds on. So a holder's
/// id counts only when its backend ran the holder's virtual transaction before and after the
/// id was read, and the id was set: then it is the holder's (a backend sets its virtual
/// transaction before it takes an id, with barriers between). Any id it took before the caller
/// read the next transaction id is there to read: it is set under `XidGenLock`, which that read
/// takes. `PREPARE TRANSACTION` moves its locks to the prepared transaction, which keeps the
/// backend's virtual transaction, before it clears the backend (so in every PostgreSQL this
/// supports: since 2021, for `CREATE INDEX CONCURRENTLY`): the lock manager never shows a
/// preparing holder as ended.
pub fn producer_xids(stream_id: i64) -> Option<Vec<pg_sys::TransactionId>> {
    let (high, low) = split(stream_id);
    let tag = tag(PRODUCER_CLASS, high, low);
    let mut count = 0;
    // SAFETY: reads the holders of one lock under its partition's lock, into an array of
    // `count` entries (palloc'd in the call's memory context, which frees it; not freed here,
    // since during recovery the lock manager hands out an array of its own). Every mode a
    // producer takes (ShareLock) conflicts with ExclusiveLock.
    let vxids = unsafe { pg_sys::GetLockConflicts(&tag, pg_sys::ExclusiveLock as pg_sys::LOCKMODE, &mut count) };
    let mut xids = Vec::with_capacity(count as usize + 1);
    let mut readable = true;
    for i in 0..count.max(0) as usize {
        // SAFETY: `i` is below the array's length; `holder_xid` reads a PGPROC the lock manager
        // named, of a server whose PGPROCs all live as long as it does.
        match unsafe { holder_xid(*vxids.add(i)) } {
            Some(xid) => xids.push(xid),
            None => {
                readable = false;
                break;
            }
        }
    }
    // The lock manager leaves out this backend's own locks.
    if held_by_me(&tag, pg_sys::ShareLock) {
        // SAFETY: reads this backend's transaction state.
        let own = unsafe { pg_sys::GetTopTransactionIdIfAny() };
        if own != pg_sys::InvalidTransactionId {
            xids.push(own);
        }
    }
    readable.then_some(xids)
}

/// The transaction id of the holder `vxid`, read from its backend: `None` unless that backend
/// runs `vxid` before and after the read and the id is set (see `producer_xids`).
///
/// # Safety
/// Reads another backend's PGPROC without its lock: a PGPROC stays allocated for the life of
/// the server, and the fields read are 32-bit values its backend sets for itself.
unsafe fn holder_xid(vxid: pg_sys::VirtualTransactionId) -> Option<pg_sys::TransactionId> {
    // SAFETY: the caller's promise.
    let proc = unsafe { proc_of(vxid) };
    if proc.is_null() {
        return None;
    }
    // SAFETY: as above.
    let runs = || unsafe { lxid(proc) } == vxid.localTransactionId;
    if !runs() {
        return None;
    }
    // Each read after the one before (Postgres' pg_read_barrier): an id read here with the same
    // virtual transaction before and after it is that transaction's.
    std::sync::atomic::fence(std::sync::atomic::Ordering::Acquire);
    // SAFETY: as above.
    let xid = unsafe { std::ptr::read_volatile(&(*proc).xid) };
    std::sync::atomic::fence(std::sync::atomic::Ordering::Acquire);
    (xid != pg_sys::InvalidTransactionId && runs()).then_some(xid)
}

#[cfg(any(feature = "pg15", feature = "pg16"))]
unsafe fn proc_of(vxid: pg_sys::VirtualTransactionId) -> *mut pg_sys::PGPROC {
    extern "C-unwind" {
        /// The PGPROC of the backend with this id, NULL when none (src/backend/storage/ipc/sinvaladt.c).
        fn BackendIdGetProc(backend_id: std::ffi::c_int) -> *mut pg_sys::PGPROC;
    }
    // SAFETY: the lookup takes its own lock.
    unsafe { BackendIdGetProc(vxid.backendId) }
}

#[cfg(any(feature = "pg15", feature = "pg16"))]
unsafe fn lxid(proc: *mut pg_sys::PGPROC) -> pg_sys::LocalTransactionId {
    // SAFETY: the caller's promise (`holder_xid`).
    unsafe { std::ptr::read_volatile(&(*proc).lxid) }
}

#[cfg(any(feature = "pg17", feature = "pg18"))]
unsafe fn proc_of(vxid: pg_sys::VirtualTransactionId) -> *mut pg_sys::PGPROC {
    // SAFETY: a lookup in the array of every PGPROC.
    unsafe { pg_sys::ProcNumberGetProc(vxid.procNumber) }
}

#[cfg(any(feature = "pg17", feature = "pg18"))]
unsafe fn lxid(proc: *mut pg_sys::PGPROC) -> pg_sys::LocalTransactionId {
    // SAFETY: the caller's promise (`holder_xid`).
    unsafe { std::ptr::read_volatile(&(*proc).vxid.lxid) }
}

#[cfg(any(feature = "pg15", feature = "pg16"))]
fn held_by_me(tag: &pg_sys::LOCKTAG, mode: u32) -> bool {
    // SAFETY: looks up this backend's own lock table.
    unsafe { pg_sys::LockHeldByMe(tag, mode as pg_sys::LOCKMODE) }
}

#[cfg(any(feature = "pg17", feature = "pg18"))]
fn held_by_me(tag: &pg_sys::LOCKTAG, mode: u32) -> bool {
    // SAFETY: looks up this backend's own lock table.
    unsafe { pg_sys::LockHeldByMe(tag, mode as pg_sys::LOCKMODE, false) }
}

/// `PRODUCER_LOCKS_WHERE`'s parameters for a stream.
pub fn producer_lock_params(stream_id: i64) -> (i64, i64) {
    let (high, low) = split(stream_id);
    (high as i64, low as i64)
}

/// Serializes the outcomes of one lease token (step 1 of an outcome). Waits.
pub fn token(token: pgrx::Uuid) {
    let bytes = token.as_bytes();
    let high = u32::from_be_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
    let low = u32::from_be_bytes([bytes[12], bytes[13], bytes[14], bytes[15]]);
    acquire(&tag(TOKEN_CLASS, high, low), pg_sys::ExclusiveLock, true);
}

/// How a call came to hold a stream's or a group's lock.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Held {
    /// Taken now: a drop may have committed while this call waited for it.
    Now,
    /// This transaction held it already.
    Already,
    /// Not taken: a drop holds it (only when asked not to wait).
    Busy,
}

fn held(result: pg_sys::LockAcquireResult::Type) -> Held {
    match result {
        pg_sys::LockAcquireResult::LOCKACQUIRE_NOT_AVAIL => Held::Busy,
        pg_sys::LockAcquireResult::LOCKACQUIRE_OK => Held::Now,
        _ => Held::Already,
    }
}

/// A 64-bit hash of `parts`, each ended by a NUL (which no name holds), so that two names
/// share a lock only if their hashes collide in 64 bits: a 32-bit one collides among a few
/// hundred thousand names, and two unrelated streams sharing a lock could deadlock.
fn name_hash(parts: &[&str]) -> (u32, u32) {
    let mut bytes = Vec::with_capacity(parts.iter().map(|p| p.len() + 1).sum());
    for part in parts {
        bytes.extend_from_slice(part.as_bytes());
        bytes.push(0);
    }
    // SAFETY: reads `bytes` only.
    let h = unsafe { hash_bytes_extended(bytes.as_ptr(), bytes.len() as std::ffi::c_int, 0) };
    ((h >> 32) as u32, h as u32)
}

fn stream_tag(stream: &str) -> pg_sys::LOCKTAG {
    let (high, low) = name_hash(&[stream]);
    tag(STREAM_CLASS, high, low)
}

fn group_tag(stream: &str, group: &str) -> pg_sys::LOCKTAG {
    let (high, low) = name_hash(&[stream, group]);
    tag(GROUP_CLASS, high, low)
}

/// The lock of the stream called `stream`, shared (see "The order" above). Waits for a
/// `drop_stream` in progress unless `wait` is false.
pub fn stream_shared(stream: &str, wait: bool) -> Held {
    held(lock(&stream_tag(stream), pg_sys::ShareLock, wait))
}

/// The stream's lock, exclusive: `drop_stream`, before anything else of the stream. Waits for
/// every call in progress on it.
pub fn stream_exclusive(stream: &str) {
    lock(&stream_tag(stream), pg_sys::ExclusiveLock, true);
}

/// The stream's lock, shared, then group `group`'s, shared (every call that changes the group)
/// or exclusive (`drop_group`, `seek`). Waits for a `drop_stream`, and for a `drop_group` or
/// `seek` of the group in progress (shared) or every call on the group in progress (exclusive).
///
/// A call that took the stream's lock only now never holds one of the two while it waits for
/// the other: that would deadlock with a transaction that holds the group's lock and goes on to
/// `drop_stream`, or holds the stream's exclusively (a `drop_stream`) and goes on to
/// `drop_group` or `seek`. When the group's lock is taken, it lets the stream's go and waits
/// for the group's, keeping its place in that lock's queue (calls keep their order behind a
/// seek or a drop); then it takes the stream's lock if it is free at once, and otherwise lets
/// the group's go too, waits for the stream's (a `drop_stream` runs), and starts again.
pub fn stream_and_group(stream: &str, group: &str, exclusive: bool) {
    let mode = if exclusive { pg_sys::ExclusiveLock } else { pg_sys::ShareLock };
    let group_tag = group_tag(stream, group);
    loop {
        if stream_shared(stream, true) != Held::Now {
            // Held before this call: this transaction's own order (a mixed transaction).
            acquire(&group_tag, mode, true);
            return;
        }
        if acquire(&group_tag, mode, false) {
            return;
        }
        release(&stream_tag(stream), pg_sys::ShareLock);
        acquire(&group_tag, mode, true);
        if stream_shared(stream, false) != Held::Busy {
            return;
        }
        release(&group_tag, mode);
    }
}

/// The group's lock, shared, only if it is free at once (retention and `maintain()`, which
/// leave a group that a seek or drop holds or waits for).
pub fn try_group_shared(stream: &str, group: &str) -> bool {
    acquire(&group_tag(stream, group), pg_sys::ShareLock, false)
}

/// Lets a lock that this call took go (`stream_and_group`), before the transaction ends.
fn release(tag: &pg_sys::LOCKTAG, mode: u32) {
    // SAFETY: a transaction-scoped lock this call took and has not used yet.
    unsafe { pg_sys::LockRelease(tag, mode as pg_sys::LOCKMODE, false) };
}

/// The claims of a capped group, one at a time (src/inflight_cap.rs): exclusive, waits, held
/// to the end of the claim's transaction.
pub fn inflight_cap(group_id: i64) {
    let (high, low) = split(group_id);
    acquire(&tag(INFLIGHT_CLASS, high, low), pg_sys::ExclusiveLock, true);
}

/// A claim's retention step for `stream_id` (src/retention.rs): exclusive, never waiting.
pub fn try_retention(stream_id: i64) -> bool {
    let (high, low) = split(stream_id);
    acquire(&tag(RETENTION_CLASS, high, low), pg_sys::ExclusiveLock, false)
}

fn wake_tag(group_id: i64, lane: i32) -> pg_sys::LOCKTAG {
    tag(WAKE_CLASS, group_id as u32, lane as u32)
}

/// The wake locks of `lanes` (those of the keys an outcome resolves, or a whole ack's keyed
/// lanes), shared, in lane order (`lanes` sorted): an outcome's step 4. Waits for a claim that
/// is parking rows in one of them to commit.
pub fn lanes_shared(group_id: i64, lanes: &[i32]) {
    for &lane in lanes {
        acquire(&wake_tag(group_id, lane), pg_sys::ShareLock, true);
    }
}

/// A claim's wake locks for parking: exclusive, never waiting. Returns the lanes this
/// transaction now holds; a lane another transaction holds (an outcome resolving a key of it
/// right now) is left out.
pub fn try_lanes_exclusive(group_id: i64, lanes: &[i32]) -> Vec<i32> {
    lanes.iter().copied().filter(|&lane| acquire(&wake_tag(group_id, lane), pg_sys::ExclusiveLock, false)).collect()
}

/// A claim's wake locks for waking: shared, never waiting. Returns the lanes this transaction
/// now holds; a lane another claim is parking rows in right now is left out.
pub fn try_lanes_shared(group_id: i64, lanes: &[i32]) -> Vec<i32> {
    lanes.iter().copied().filter(|&lane| acquire(&wake_tag(group_id, lane), pg_sys::ShareLock, false)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_producer_class_is_the_one_pg_locks_is_searched_for() {
        assert!(producer_locks_where!().contains(&format!("objsubid = {PRODUCER_CLASS}")));
    }

    #[test]
    fn classes_are_out_of_reach_of_sql_advisory_locks() {
        // pg_advisory_lock(bigint) uses class 1, pg_advisory_lock(int, int) class 2.
        for class in
            [PRODUCER_CLASS, WAKE_CLASS, TOKEN_CLASS, RETENTION_CLASS, STREAM_CLASS, GROUP_CLASS, INFLIGHT_CLASS]
        {
            assert!(class > 2);
        }
        assert_eq!(split(-1), (u32::MAX, u32::MAX));
        assert_eq!(split((7 << 32) | 9), (7, 9));
    }
}
