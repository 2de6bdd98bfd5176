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
//!   PREPARED` or `ROLLBACK PREPARED`, perhaps in another backend: those move every epoch.
//! - A claim reads its stream's epoch before any statement of its own (`Watch::start`). When it
//!   finds nothing to claim and leaves nothing pending (every id handed out is proven, so no
//!   producer that already ended can still be holding the fence back), it remembers that
//!   epoch; when a second one finds the same, it also reads the earliest time anything of the
//!   group waits for (src/due.rs), once. A later claim that finds the same epoch before that time
//!   has nothing to claim either, and runs no statement.
//!
//! Epochs live in a fixed array, a stream's slot chosen by a hash of its database and id: two
//! streams in one slot only make each other's claims look again. What changes the stream's
//! tables other than through sqlstreams' functions (a superuser's UPDATE of its tables) moves
//! no epoch: that is not supported, as docs/operations.md says.

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
    /// Nothing falls due before this time (`i64::MAX`: nothing waits for a time); `None`
    /// until a second claim at the same epoch asks.
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
    /// Streams the transaction in progress marked, once per call that may have changed them.
    static TOUCHED: RefCell<Vec<StreamId>> = const { RefCell::new(Vec::new()) };
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
    if ENABLED.get() {
        TOUCHED.with(|touched| touched.borrow_mut().push(stream_id));
    }
}

/// The transaction ended (committed, rolled back, or prepared: `prepared`). Moves the epochs of
/// the streams it marked, now that its changes are visible; a prepared one's move when it is
/// committed or rolled back (`on_utility`).
pub fn ended(prepared: bool) {
    let touched = TOUCHED.take();
    if prepared || !ENABLED.get() {
        return;
    }
    for stream_id in touched {
        slot(stream_id).fetch_add(1, Ordering::SeqCst);
    }
}

/// Every epoch moves: a prepared transaction ended, and which streams it changed is not known.
fn move_all() {
    for epoch in EPOCHS.get() {
        epoch.fetch_add(1, Ordering::SeqCst);
    }
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
    /// any statement of its own. `Err(())`: what this backend learned says the claim finds
    /// nothing, and the claim's mark is taken back.
    /// A claim that carries outcomes (`carries`) changes the stream: it is not watched.
    pub fn start(group_id: i64, stream_id: StreamId, carries: bool, now: i64) -> std::result::Result<Watch, ()> {
        // Only a transaction that changed nothing else so far: its own changes are not in any
        // epoch yet.
        let alone = TOUCHED.with(|touched| touched.borrow().as_slice() == [stream_id]);
        let watched = ENABLED.get() && alone && !carries;
        let Some(catalog) = crate::catalog::generation().filter(|_| watched) else {
            return Ok(Watch { group_id, stream_id, seen: None });
        };
        let epoch = slot(stream_id).load(Ordering::SeqCst);
        let quiet = QUIET.with(|q| q.borrow().get(&group_id).copied());
        if quiet.is_some_and(|q| q.seen(stream_id, epoch, catalog) && q.until.is_some_and(|until| now < until)) {
            take_back(stream_id);
            return Err(());
        }
        Ok(Watch { group_id, stream_id, seen: Some((epoch, catalog)) })
    }

    /// The claim found nothing, wrote nothing and left nothing pending: remembered, and its
    /// mark taken back. The second such claim at the same epoch asks `until` when anything
    /// falls due (`i64::MAX`: nothing waits for a time).
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
}

/// Takes back one mark of `stream_id`: the call that made it changed nothing.
fn take_back(stream_id: StreamId) {
    TOUCHED.with(|touched| {
        let mut touched = touched.borrow_mut();
        if let Some(at) = touched.iter().rposition(|&s| s == stream_id) {
            touched.remove(at);
        }
    });
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

#[pgrx::pg_guard]
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
    // SAFETY: the hook's contract: the arguments are Postgres', passed on unchanged, to the
    // previous hook or the standard one, either of which may raise an error (below). The
    // statement is read before it runs.
    unsafe {
        let utility = (*statement).utilityStmt;
        let ends_prepared = !utility.is_null()
            && (*utility).type_ == pg_sys::NodeTag::T_TransactionStmt
            && matches!(
                (*utility.cast::<pg_sys::TransactionStmt>()).kind,
                pg_sys::TransactionStmtKind::TRANS_STMT_COMMIT_PREPARED
                    | pg_sys::TransactionStmtKind::TRANS_STMT_ROLLBACK_PREPARED
            );
        match PREVIOUS_UTILITY_HOOK {
            // A hook is a bare C pointer: its error crosses into Rust behind pgrx's guard.
            Some(previous) => pg_sys::ffi::pg_guard_ffi_boundary(|| {
                previous(statement, query, read_only_tree, context, params, environment, destination, completion)
            }),
            // pgrx's binding is guarded already; a second guard around it would turn the error
            // into a panic inside the first, which aborts the server.
            None => pg_sys::standard_ProcessUtility(
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
        // The prepared transaction has left the proc array and released its locks.
        if ends_prepared && ENABLED.get() {
            move_all();
        }
    }
}
