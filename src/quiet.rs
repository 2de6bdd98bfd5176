//! Quiet groups: an idle claim that nothing could have changed answers from what this backend
//! learned, without a statement. Only when the library is preloaded
//! (`shared_preload_libraries = 'sqlstreams'`): the server then keeps, per stream, a count of
//! the transactions that changed it (its epoch, in shared memory).
//!
//! What a claim reads changes in two ways only: a transaction that called sqlstreams to change
//! the stream (a produce, an outcome, a claim that handed out or locked anything, an admin
//! call), or the clock (a retry's backoff, a lease, a lane hold). So:
//! - Every such call marks its stream (`touch`, from the stream and group lookups that may
//!   write); when the transaction ends, committed or rolled back, it moves the epochs of the
//!   streams it marked (`ended`). That is after its changes are visible (Postgres calls back
//!   after the transaction left the proc array). A prepared transaction ends in a `COMMIT
//!   PREPARED` or `ROLLBACK PREPARED`, perhaps in another backend: the transaction that runs
//!   one moves every epoch when it ends (`on_utility`).
//! - A claim reads its stream's epoch and the catalog's generation before any statement of its
//!   own (`Watch::start`). When it finds nothing to claim and leaves nothing pending, it
//!   remembers them; when a second one finds the same, it also reads the earliest time after
//!   now that anything of the group waits for (src/due.rs). A later claim that finds the same
//!   before that time has nothing to claim either, and runs no statement.
//!
//! The callback runs before the transaction releases its locks, and before its catalog
//! invalidations are sent. Neither matters: a claim that found nothing because of another
//! transaction's locks is never remembered (a producer still in `pg_locks` leaves an id
//! unproven, src/claim.rs; lanes and rows are taken `SKIP LOCKED` only when there are
//! candidates, and then the claim is not idle), and a claim is answered from memory only after
//! two found the same epoch and generation, the second reading the invalidations anew.
//!
//! Epochs live in a fixed array, a stream's slot chosen by a hash of its database and id: two
//! streams in one slot only make each other's claims look again. What changes the stream's
//! tables other than through sqlstreams' functions (a superuser's UPDATE of its tables) moves
//! no epoch: that is not supported (docs/semantics.md, "Quiet groups").

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

use pgrx::pg_sys;
use pgrx::shmem::PgSharedMemoryInitialization;
use pgrx::PgAtomic;

use crate::error::Result;
use crate::statement::StreamId;

/// Epoch slots: 32 kB of shared memory.
const SLOTS: usize = 4096;

/// Groups remembered per backend; past this many, all are forgotten.
const MAX_QUIET: usize = 4096;

// SAFETY: one name, used by this library only.
static EPOCHS: PgAtomic<[AtomicU64; SLOTS]> = unsafe { PgAtomic::new(c"sqlstreams.epochs") };

/// What a claim found nothing at.
#[derive(Clone, Copy)]
struct Quiet {
    stream_id: StreamId,
    epoch: u64,
    /// The catalog's generation (src/catalog.rs): a change of a stream, group or grant row, by
    /// hand too, makes claims look again.
    catalog: u64,
    /// Nothing falls due before this time (`i64::MAX`: nothing waits for one); `None` until a
    /// second claim at the same epoch asks.
    until: Option<i64>,
}

impl Quiet {
    /// Whether nothing changed since: the same stream, epoch and catalog.
    fn seen(&self, stream_id: StreamId, epoch: u64, catalog: u64) -> bool {
        self.stream_id == stream_id && self.epoch == epoch && self.catalog == catalog
    }
}

thread_local! {
    static ENABLED: Cell<bool> = const { Cell::new(false) };
    /// Streams the transaction in progress marked, with the number of calls that marked each.
    static TOUCHED: RefCell<Vec<(StreamId, u32)>> = const { RefCell::new(Vec::new()) };
    /// The transaction in progress runs a `COMMIT PREPARED` or `ROLLBACK PREPARED`.
    static ENDS_PREPARED: Cell<bool> = const { Cell::new(false) };
    static QUIET: RefCell<HashMap<i64, Quiet>> = RefCell::new(HashMap::new());
}

/// From `_PG_init` while the library is preloaded: the epochs' shared memory and the hook that
/// sees prepared transactions end. Loaded later, the library keeps no epochs and every claim
/// reads.
pub fn init() {
    // SAFETY: reads a flag the postmaster sets while it loads preloaded libraries.
    if !unsafe { pg_sys::process_shared_preload_libraries_in_progress } {
        return;
    }
    // SAFETY: at library load in the postmaster, before any backend; each hook chains to the
    // one installed before.
    unsafe {
        PREVIOUS_REQUEST_HOOK = pg_sys::shmem_request_hook;
        pg_sys::shmem_request_hook = Some(on_shmem_request);
        PREVIOUS_STARTUP_HOOK = pg_sys::shmem_startup_hook;
        pg_sys::shmem_startup_hook = Some(on_shmem_startup);
        PREVIOUS_UTILITY_HOOK = pg_sys::ProcessUtility_hook;
        pg_sys::ProcessUtility_hook = Some(on_utility);
    }
    ENABLED.set(true);
}

fn slot(stream_id: StreamId) -> &'static AtomicU64 {
    // SAFETY: reads this backend's database id.
    let database = u64::from(unsafe { pg_sys::MyDatabaseId }.to_u32());
    let mixed = ((database << 40) ^ stream_id as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    &EPOCHS.get()[(mixed >> 52) as usize % SLOTS]
}

/// A call that may change stream `stream_id` (or lock its rows) in this transaction.
pub fn touch(stream_id: StreamId) {
    if !ENABLED.get() {
        return;
    }
    TOUCHED.with(|touched| {
        let mut touched = touched.borrow_mut();
        match touched.iter_mut().find(|(s, _)| *s == stream_id) {
            Some((_, calls)) => *calls += 1,
            None => touched.push((stream_id, 1)),
        }
    });
}

/// Takes back one mark of `stream_id`: the call that made it changed nothing.
fn take_back(stream_id: StreamId) {
    TOUCHED.with(|touched| {
        let mut touched = touched.borrow_mut();
        if let Some(at) = touched.iter().position(|(s, _)| *s == stream_id) {
            touched[at].1 -= 1;
            if touched[at].1 == 0 {
                touched.remove(at);
            }
        }
    });
}

/// The transaction ended (committed, rolled back, or prepared: `prepared`). Moves the epochs of
/// the streams it marked, now that its changes are visible; a prepared one's move when a `COMMIT
/// PREPARED` or `ROLLBACK PREPARED` ends it.
pub fn ended(prepared: bool) {
    let touched = TOUCHED.take();
    let ends_prepared = ENDS_PREPARED.replace(false);
    if !ENABLED.get() {
        return;
    }
    if ends_prepared {
        move_all();
    }
    if !prepared {
        for (stream_id, _) in touched {
            slot(stream_id).fetch_add(1, Ordering::SeqCst);
        }
    }
}

/// Every epoch moves: a prepared transaction ended, and which streams it changed is not known.
fn move_all() {
    for epoch in EPOCHS.get() {
        epoch.fetch_add(1, Ordering::SeqCst);
    }
}

/// What a claim's start found (`Watch::start`).
pub enum Start {
    /// Nothing changed since claims found nothing: this one finds nothing either.
    Quiet,
    /// The claim runs, watched.
    Claim(Watch),
}

/// A claim watching for whether it finds nothing (see the module documentation).
pub struct Watch {
    group_id: i64,
    stream_id: StreamId,
    /// The stream's epoch and the catalog's generation, read before the claim's statements;
    /// `None`: not watched.
    seen: Option<(u64, u64)>,
}

impl Watch {
    /// Starts watching a claim of group `group_id` whose lookup just marked `stream_id`, before
    /// any statement of its own. A claim that carries outcomes (`carries`), or runs in a
    /// transaction that marked anything before (its changes are in no epoch yet), is not
    /// watched. `Start::Quiet` takes the claim's mark back.
    pub fn start(group_id: i64, stream_id: StreamId, carries: bool, now: i64) -> Start {
        let unwatched = Start::Claim(Watch { group_id, stream_id, seen: None });
        let alone = TOUCHED.with(|touched| touched.borrow().as_slice() == [(stream_id, 1)]);
        if !ENABLED.get() || !alone || carries {
            return unwatched;
        }
        let Some(catalog) = crate::catalog::generation() else { return unwatched };
        let epoch = slot(stream_id).load(Ordering::SeqCst);
        let quiet = QUIET.with(|q| q.borrow().get(&group_id).copied());
        if quiet.is_some_and(|q| q.seen(stream_id, epoch, catalog) && q.until.is_some_and(|until| now < until)) {
            take_back(stream_id);
            return Start::Quiet;
        }
        Start::Claim(Watch { group_id, stream_id, seen: Some((epoch, catalog)) })
    }

    /// The claim found nothing, wrote nothing and left nothing pending: remembered, and its
    /// mark taken back. The second such claim at the same epoch asks `until` when anything
    /// falls due after now (`i64::MAX`: nothing waits for a time).
    pub fn found_nothing(self, until: impl FnOnce() -> Result<i64>) -> Result<()> {
        let Some((epoch, catalog)) = self.seen else { return Ok(()) };
        let known = QUIET.with(|q| q.borrow().get(&self.group_id).copied());
        let until = match known {
            Some(q) if q.seen(self.stream_id, epoch, catalog) => Some(until()?),
            _ => None,
        };
        QUIET.with(|q| {
            let mut q = q.borrow_mut();
            if q.len() >= MAX_QUIET {
                q.clear();
            }
            q.insert(self.group_id, Quiet { stream_id: self.stream_id, epoch, catalog, until });
        });
        take_back(self.stream_id);
        Ok(())
    }

    /// The claim returned at once and wrote nothing (a paused group, a capped one without
    /// room): its mark is taken back, so that it does not make other groups' claims look again.
    pub fn wrote_nothing(self) {
        if self.seen.is_some() {
            take_back(self.stream_id);
        }
    }
}

// The hooks that were installed before ours, each called first.
static mut PREVIOUS_REQUEST_HOOK: pg_sys::shmem_request_hook_type = None;
static mut PREVIOUS_STARTUP_HOOK: pg_sys::shmem_startup_hook_type = None;
static mut PREVIOUS_UTILITY_HOOK: pg_sys::ProcessUtility_hook_type = None;

#[pgrx::pg_guard]
unsafe extern "C-unwind" fn on_shmem_request() {
    // SAFETY: the postmaster asks for shared memory once, at start.
    unsafe {
        if let Some(previous) = PREVIOUS_REQUEST_HOOK {
            pg_sys::ffi::pg_guard_ffi_boundary(|| previous());
        }
        EPOCHS.on_shmem_request();
    }
}

#[pgrx::pg_guard]
unsafe extern "C-unwind" fn on_shmem_startup() {
    // SAFETY: the postmaster sets shared memory up at start and after a crash, zeroed again.
    unsafe {
        if let Some(previous) = PREVIOUS_STARTUP_HOOK {
            pg_sys::ffi::pg_guard_ffi_boundary(|| previous());
        }
        EPOCHS.on_shmem_startup([const { AtomicU64::new(0) }; SLOTS]);
    }
}

unsafe extern "C-unwind" {
    /// Postgres' own, not pgrx's guarded binding: an error passes through `on_utility` as
    /// Postgres raised it (context, position, fields), not caught and raised again.
    #[link_name = "standard_ProcessUtility"]
    fn standard_process_utility(
        statement: *mut pg_sys::PlannedStmt,
        query: *const std::ffi::c_char,
        read_only_tree: bool,
        context: pg_sys::ProcessUtilityContext::Type,
        params: pg_sys::ParamListInfo,
        environment: *mut pg_sys::QueryEnvironment,
        destination: *mut pg_sys::DestReceiver,
        completion: *mut pg_sys::QueryCompletion,
    );
}

/// Every utility statement of the cluster passes here: one that ends a prepared transaction
/// marks its own transaction, whose end moves every epoch (`ended`), after an error too. Not
/// `#[pg_guard]`: it holds nothing to drop and cannot panic, so an error of the statement
/// passes through untouched.
#[allow(clippy::too_many_arguments)]
unsafe extern "C-unwind" fn on_utility(
    statement: *mut pg_sys::PlannedStmt,
    query: *const std::ffi::c_char,
    read_only_tree: bool,
    context: pg_sys::ProcessUtilityContext::Type,
    params: pg_sys::ParamListInfo,
    environment: *mut pg_sys::QueryEnvironment,
    destination: *mut pg_sys::DestReceiver,
    completion: *mut pg_sys::QueryCompletion,
) {
    // SAFETY: the hook's contract: the arguments are Postgres', read and passed on unchanged.
    unsafe {
        let utility = (*statement).utilityStmt;
        if !utility.is_null() && (*utility).type_ == pg_sys::NodeTag::T_TransactionStmt {
            use pg_sys::TransactionStmtKind::*;
            let kind = (*utility.cast::<pg_sys::TransactionStmt>()).kind;
            if kind == TRANS_STMT_COMMIT_PREPARED || kind == TRANS_STMT_ROLLBACK_PREPARED {
                ENDS_PREPARED.set(true);
            }
        }
        match PREVIOUS_UTILITY_HOOK {
            Some(previous) => {
                previous(statement, query, read_only_tree, context, params, environment, destination, completion)
            }
            None => standard_process_utility(
                statement,
                query,
                read_only_tree,
                context,
                params,
                environment,
                destination,
                completion,
            ),
        }
    }
}
