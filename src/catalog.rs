//! What this backend remembers of the extension's catalog (streams, groups, grants, who owns
//! it), and when it must forget it.
//!
//! Claims and outcomes look their group up, produces their stream, and each checks the caller's
//! right on every call; those statements cost an idle claim as much as everything else it does,
//! and a produce of one message a tenth to a fifth of its CPU. So a backend
//! keeps what they found, as Postgres keeps its own catalog rows: until an invalidation says
//! the rows changed. Row triggers on `sqlstreams.stream`, `consumer_group` and `stream_grant`
//! (`catalog_changed`, and `catalog_truncated` for TRUNCATE; fired always, whatever
//! `session_replication_role` says, and by logical replication's apply workers) send a relcache
//! invalidation of their table with the transaction; roles changing members or attributes send
//! their own (pg_authid, pg_auth_members). Every one of those, and a reset of every cache, makes
//! a new *generation*; a remembered entry is good only in its own. Changes of the calling
//! transaction count from its next command, and a rollback invalidates what it had changed.
//! (A relcache invalidation also makes every backend plan its statements over that table again:
//! the catalog tables change seldom, when a stream gets new partitions at the most.)
//!
//! A transaction's invalidations reach other backends as it commits, before its COMMIT returns
//! and before it lets its locks go. Those that must be seen at once are behind locks that the
//! caller waits for and reads the invalidations after (`drop_stream`, `drop_group`,
//! src/locks.rs). Otherwise a call that runs at the very moment another transaction commits a
//! group's new settings, a pause or a revoked grant may still use the old ones, until that
//! transaction's invalidations arrive, although it could already read other rows that
//! transaction wrote.
//!
//! Only READ COMMITTED calls remember or use catalog rows (`generation`). Inspection uses what is
//! remembered of the owner and of rights, never of groups: it reads its groups in its snapshot.
//! What src/statement/probe.rs remembers of relations (`relations_generation`) is read from the
//! catalog caches, not a snapshot, under any isolation level.

use std::cell::{Cell, RefCell};
use std::hash::Hash;

use foldhash::HashMap;
use pgrx::pg_sys;
use pgrx::prelude::*;

thread_local! {
    static GENERATION: Cell<u64> = const { Cell::new(1) };
    /// Bumped by every relcache invalidation, of any relation (`relations_generation`).
    static RELATIONS: Cell<u64> = const { Cell::new(1) };
    /// The catalog tables' oids, as this backend last looked them up (`InvalidOid` before).
    static TABLES: Cell<[pg_sys::Oid; 3]> = const { Cell::new([pg_sys::InvalidOid; 3]) };
}

/// Entries kept per memo; past this many, all are forgotten.
const MAX_ENTRIES: usize = 4_096;

/// Values remembered per key, each good in the generation it was found in.
pub struct Memo<K, V> {
    entries: RefCell<HashMap<K, (u64, V)>>,
}

impl<K: Eq + Hash, V: Clone> Memo<K, V> {
    pub fn new() -> Self {
        Memo { entries: RefCell::new(HashMap::default()) }
    }

    /// The value found for `key` in generation `generation`, if any.
    pub fn get<Q: Eq + Hash + ?Sized>(&self, key: &Q, generation: Option<u64>) -> Option<V>
    where
        K: std::borrow::Borrow<Q>,
    {
        let generation = generation?;
        self.entries.borrow().get(key).filter(|(g, _)| *g == generation).map(|(_, v)| v.clone())
    }

    /// Remembers what was found for `key` in `generation` (read before it was looked up).
    pub fn put(&self, key: K, generation: Option<u64>, value: V) {
        let Some(generation) = generation else { return };
        let mut entries = self.entries.borrow_mut();
        if entries.len() >= MAX_ENTRIES {
            entries.retain(|_, (g, _)| *g == generation);
            if entries.len() >= MAX_ENTRIES {
                entries.clear();
            }
        }
        entries.insert(key, (generation, value));
    }
}

/// Registers the invalidation callbacks once per backend (from `_PG_init`).
pub fn init() {
    // SAFETY: registers callbacks with a null argument; they live as long as the backend.
    unsafe {
        pg_sys::CacheRegisterRelcacheCallback(Some(relation_changed), pg_sys::Datum::from(0));
        for cache in [pg_sys::SysCacheIdentifier::AUTHOID, pg_sys::SysCacheIdentifier::AUTHMEMROLEMEM] {
            pg_sys::CacheRegisterSyscacheCallback(cache as i32, Some(role_changed), pg_sys::Datum::from(0));
        }
        pg_sys::CacheRegisterSyscacheCallback(
            pg_sys::SysCacheIdentifier::NAMESPACEOID as i32,
            Some(schema_changed),
            pg_sys::Datum::from(0),
        );
    }
}

/// The generation of what may be remembered now, after reading every invalidation that other
/// transactions sent so far; to be read before what is remembered is looked up, and before the
/// statement that looks it up takes its snapshot. `None` under REPEATABLE READ and SERIALIZABLE:
/// there a lookup reads the transaction's snapshot, which may be older than the invalidations
/// read, so nothing is used or remembered.
pub fn generation() -> Option<u64> {
    // SAFETY: reads this backend's isolation level.
    if unsafe { pg_sys::XactIsoLevel } >= pg_sys::XACT_REPEATABLE_READ as i32 {
        return None;
    }
    // SAFETY: in a transaction: reads the invalidations other backends sent.
    unsafe { pg_sys::AcceptInvalidationMessages() };
    note_tables();
    // Without the tables' oids their invalidations would not be recognized.
    (TABLES.get()[0] != pg_sys::InvalidOid).then(|| GENERATION.get())
}

/// `generation`, also counting the calling transaction's own changes so far. Only for calls
/// that may write (each of their statements takes a fresh snapshot): it ends the current
/// command, as SPI does before each statement of such a call.
pub fn generation_for_write() -> Option<u64> {
    // SAFETY: in a transaction, in a volatile function: processes this transaction's own
    // invalidations, as any command end does.
    unsafe { pg_sys::CommandCounterIncrement() };
    generation()
}

/// Looks the catalog tables up when they are not known yet or were invalidated, so their
/// invalidations are recognized.
fn note_tables() {
    let tables = TABLES.get();
    if tables[0] != pg_sys::InvalidOid {
        return;
    }
    // SAFETY: syscache lookups by name, in a transaction.
    let oids = unsafe {
        let namespace = pg_sys::get_namespace_oid(c"sqlstreams".as_ptr(), true);
        if namespace == pg_sys::InvalidOid {
            return;
        }
        [c"stream", c"consumer_group", c"stream_grant"].map(|name| pg_sys::get_relname_relid(name.as_ptr(), namespace))
    };
    if oids.contains(&pg_sys::InvalidOid) {
        return;
    }
    TABLES.set(oids);
    forget_all();
}

fn forget_all() {
    GENERATION.set(GENERATION.get() + 1);
}

/// A count of the relcache invalidations this backend has read, of any relation, and of the
/// changes of schemas: what was found of a relation by name (src/statement/probe.rs) is good while
/// it has not moved. One relcache callback serves both memos, as a backend has ten slots.
pub fn relations_generation() -> u64 {
    RELATIONS.get()
}

#[pg_guard]
unsafe extern "C-unwind" fn relation_changed(_arg: pg_sys::Datum, relid: pg_sys::Oid) {
    RELATIONS.set(RELATIONS.get() + 1);
    let tables = TABLES.get();
    if relid == pg_sys::InvalidOid || tables.contains(&relid) {
        TABLES.set([pg_sys::InvalidOid; 3]);
        forget_all();
    }
}

/// A schema renamed, dropped or created sends no relcache invalidation, but changes which
/// relation a name such as `sqlstreams.lane_1` names, as Postgres's plans see it: the catalog
/// tables are looked up again, and what was found in them and of relations is forgotten.
#[pg_guard]
unsafe extern "C-unwind" fn schema_changed(_arg: pg_sys::Datum, _cache: std::ffi::c_int, _hash: u32) {
    RELATIONS.set(RELATIONS.get() + 1);
    TABLES.set([pg_sys::InvalidOid; 3]);
    forget_all();
}

#[pg_guard]
unsafe extern "C-unwind" fn role_changed(_arg: pg_sys::Datum, _cache: std::ffi::c_int, _hash: u32) {
    forget_all();
}

/// `catalog_changed()`: the catalog tables' triggers (before each row, and before TRUNCATE),
/// which tell every backend to forget what it remembers of them. The row goes on unchanged.
#[pg_trigger(sql = false)]
fn catalog_changed<'a>(
    trigger: &'a pgrx::PgTrigger<'a>,
) -> Result<Option<PgHeapTuple<'a, AllocatedByPostgres>>, pgrx::PgTriggerError> {
    let relid = trigger.relid()?;
    // SAFETY: registers an invalidation of a relation, processed here at the next command and
    // sent to every backend when the transaction commits.
    unsafe { pg_sys::CacheInvalidateRelcacheByRelid(relid) };
    Ok(trigger.new().or(trigger.old()))
}
