//! The maintenance worker: when the library is preloaded (`shared_preload_libraries =
//! 'sqlstreams'`), a background worker does what `maintain()` does in one database every
//! `sqlstreams.maintain_interval`, stream by stream in a transaction each (`maintain_stream()`),
//! so retention, partitions ahead and expired idempotency keys need no external scheduler. Without preloading, consumers' claims run retention themselves
//! (src/retention.rs) and `maintain()` is there for cron.
//!
//! - `sqlstreams.worker_database` (server start): the database it maintains; default `postgres`.
//!   A database without the extension is left alone.
//! - `sqlstreams.worker_role` (server start): the role it connects as; default the bootstrap
//!   superuser. A login role that is a member of `sqlstreams_admin` is all the work needs.
//! - `sqlstreams.maintain_interval` (reload): seconds between rounds; 0 pauses the worker.
//!
//! A stream whose maintenance fails is left for the next round with a warning; a library the
//! installed SQL does not match (an upgrade half done) leaves every stream, with one warning a
//! round. Any other error in a round, or a `pg_terminate_backend` (at once, a wait for a lock
//! included), ends the worker process with the error in the server log, and so does a cancel
//! (`pg_cancel_backend`); the postmaster starts it again after `RESTART`.
//!
//! The worker's database may belong to a role that is not a superuser, who can `ALTER DATABASE
//! ... SET search_path` to a schema of its own: the worker pins `search_path` over anything a
//! database or role sets, and qualifies what it names, so nothing of theirs runs as the worker.

use std::ffi::CString;
use std::time::Duration;

use pgrx::bgworkers::{BackgroundWorker, BackgroundWorkerBuilder, SignalWakeFlags};
use pgrx::prelude::*;
use pgrx::{GucContext, GucFlags, GucRegistry, GucSetting};

use crate::statement::{Access, Columns};
use crate::subtransaction::{caught, not_maintained, raise, Caught};

static DATABASE: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(Some(c"postgres"));
static ROLE: GucSetting<Option<CString>> = GucSetting::<Option<CString>>::new(None);
/// Seconds.
static INTERVAL: GucSetting<i32> = GucSetting::<i32>::new(60);

const RESTART: Duration = Duration::from_secs(10);

/// While `shared_preload_libraries` is being loaded: registers the worker's settings and the
/// worker. (A library loaded later may not define a server-start setting, and has no worker.)
pub fn init() {
    // SAFETY: reads a flag the postmaster sets while it loads preloaded libraries.
    if !unsafe { pg_sys::process_shared_preload_libraries_in_progress } {
        return;
    }
    GucRegistry::define_string_guc(
        c"sqlstreams.worker_database",
        c"The database the sqlstreams maintenance worker runs maintain() in.",
        c"Only used when sqlstreams is in shared_preload_libraries.",
        &DATABASE,
        GucContext::Postmaster,
        GucFlags::default(),
    );
    GucRegistry::define_string_guc(
        c"sqlstreams.worker_role",
        c"The role the sqlstreams maintenance worker connects as; empty: the bootstrap superuser.",
        c"A login role that is a member of sqlstreams_admin is all maintain() needs.",
        &ROLE,
        GucContext::Postmaster,
        GucFlags::default(),
    );
    GucRegistry::define_int_guc(
        c"sqlstreams.maintain_interval",
        c"How often the sqlstreams maintenance worker runs maintain(); 0 pauses it.",
        c"Only used when sqlstreams is in shared_preload_libraries.",
        &INTERVAL,
        0,
        // The wait is in milliseconds, in a C int.
        i32::MAX / 1000,
        GucContext::Sighup,
        GucFlags::UNIT_S,
    );
    BackgroundWorkerBuilder::new("sqlstreams maintenance")
        .set_type("sqlstreams maintenance")
        .set_library("sqlstreams")
        .set_function("sqlstreams_maintenance_main")
        .enable_spi_access()
        .set_restart_time(Some(RESTART))
        .load();
}

fn interval() -> Option<Duration> {
    match INTERVAL.get() {
        0 => None,
        seconds => Some(Duration::from_secs(seconds as u64)),
    }
}

/// One round: `maintain_stream()` for each stream, one transaction each (a partition drop keeps
/// its stream's log locked until commit: only that stream's step long), if the extension is
/// installed here.
fn round() {
    let streams: Vec<String> = BackgroundWorker::transaction(|| {
        let installed = Spi::get_one::<bool>(
            "SELECT true FROM pg_catalog.pg_extension WHERE extname OPERATOR(pg_catalog.=) 'sqlstreams'",
        )
        .ok()
        .flatten()
        .unwrap_or(false);
        if !installed {
            return vec![];
        }
        Spi::connect(|client| {
            // A library the installed SQL does not match fails every stream alike: said once a
            // round, with its hint, as maintain() refuses once, not stream by stream.
            if let Err(e) = crate::version::check_now(client, Access::Read) {
                Caught::from_error(&e).warn("sqlstreams: no stream is maintained this round");
                return Ok(vec![]);
            }
            // So is a database whose transactions are read-only (default_transaction_read_only).
            if let Err(e) = crate::admin::maintain::require_read_write("maintain_stream") {
                Caught::from_error(&e).warn("sqlstreams: no stream is maintained this round");
                return Ok(vec![]);
            }
            let rows = client.select("SELECT name FROM sqlstreams.streams ORDER BY id", None, &[])?;
            // A name this database cannot read as UTF-8 (a restore's: src/text.rs) is left out, with a warning.
            let name = |row: pgrx::spi::SpiHeapTupleData<'_>| match row.value::<String>("name") {
                Ok(name) => name,
                Err(e) => {
                    Caught::from_error(&e).warn("sqlstreams: a stream is not maintained");
                    None
                }
            };
            Ok(rows.filter_map(name).collect())
        })
        .unwrap_or_else(|e: pgrx::spi::SpiError| {
            warning!("sqlstreams: no stream is maintained this round: {e}");
            vec![]
        })
    });
    for name in streams {
        BackgroundWorker::transaction(|| {
            // A stream that cannot be maintained (an error of its own) is left for the next
            // round, with a warning: the streams after it are maintained all the same.
            let maintained = caught(|| {
                Spi::get_one_with_args::<i64>(
                    "SELECT pg_catalog.count(*) FROM sqlstreams.maintain_stream($1)",
                    &[name.as_str().into()],
                )
                .unwrap_or_else(|e| raise(e.into()))
            });
            if let Err(error) = maintained {
                not_maintained(&name, &error);
            }
        });
    }
}

unsafe extern "C-unwind" {
    /// Postgres' handler of a backend's SIGTERM (postgres.c), by its own symbol: pgrx's binding
    /// of it is a Rust wrapper, which is no signal handler.
    fn die(signal: std::ffi::c_int);
}

/// Waits for the next round (for good while `interval` is paused), or for the postmaster's
/// end, which ends the worker. A SIGTERM ends it here too (`die`'s FATAL), and a SIGHUP wakes it.
fn wait(interval: Option<Duration>) {
    let (events, timeout) = match interval {
        Some(interval) => {
            (pg_sys::WL_LATCH_SET | pg_sys::WL_TIMEOUT, interval.as_millis().try_into().unwrap_or(i64::MAX))
        }
        None => (pg_sys::WL_LATCH_SET, 0),
    };
    // SAFETY: waits on this process's latch as a backend does, then takes its interrupts.
    unsafe {
        pg_sys::WaitLatch(
            pg_sys::MyLatch,
            (events | pg_sys::WL_EXIT_ON_PM_DEATH) as i32,
            timeout,
            pg_sys::PG_WAIT_EXTENSION,
        );
        pg_sys::ResetLatch(pg_sys::MyLatch);
        pg_sys::check_for_interrupts!();
    }
}

#[pg_guard]
#[no_mangle]
pub extern "C-unwind" fn sqlstreams_maintenance_main(_arg: pg_sys::Datum) {
    // SIGTERM (a shutdown, pg_terminate_backend) ends the worker as it ends a backend, at the
    // next check for interrupts, a wait for a lock included: pgrx's handler only raises a flag
    // that nothing reads while a round waits, so a lock held to a shutdown's end (a prepared
    // transaction's) held the shutdown back. Set before pgrx unblocks the signals.
    // SAFETY: installs Postgres' own handler for a backend's SIGTERM, as its worker_spi does.
    unsafe {
        #[cfg(not(feature = "pg18"))]
        pg_sys::pqsignal(pg_sys::SIGTERM as i32, Some(die));
        #[cfg(feature = "pg18")]
        pg_sys::pqsignal_be(pg_sys::SIGTERM as i32, Some(die));
    }
    BackgroundWorker::attach_signal_handlers(SignalWakeFlags::SIGHUP);
    let database = DATABASE.get().and_then(|d| d.into_string().ok()).unwrap_or_else(|| "postgres".into());
    let role = ROLE.get().and_then(|r| r.into_string().ok()).filter(|r| !r.is_empty());
    BackgroundWorker::connect_worker_to_spi(Some(&database), role.as_deref());
    pin_settings();
    log!("sqlstreams maintenance worker started in database \"{database}\"");
    loop {
        if interval().is_some() {
            round();
        }
        wait(interval());
        if BackgroundWorker::sighup_received() {
            // SAFETY: rereads the configuration files, as any backend does on SIGHUP.
            unsafe { pg_sys::ProcessConfigFile(pg_sys::GucContext::PGC_SIGHUP) };
        }
    }
    // No way out but `die`'s FATAL (exit code 1) or the postmaster's end: a clean exit would
    // unregister the worker for good, and a pg_terminate_backend meant to end a session would
    // end maintenance until the server restarts. At shutdown nothing restarts it.
}

/// The settings a round needs, above every source a database owner or role controls (`ALTER
/// DATABASE ... SET`, `ALTER ROLE ... SET`), for the life of the process: `search_path =
/// pg_catalog, pg_temp`, and READ COMMITTED transactions, which maintain needs (a database whose
/// default is SERIALIZABLE for its applications would have every round refused, and retention
/// would stop until someone read the warnings).
fn pin_settings() {
    for (name, value) in
        [(c"search_path", crate::search_path::SEARCH_PATH), (c"default_transaction_isolation", c"read committed")]
    {
        // SAFETY: sets a setting in this process, outside any transaction, before any query.
        unsafe {
            pg_sys::SetConfigOption(
                name.as_ptr(),
                value.as_ptr(),
                pg_sys::GucContext::PGC_SUSET,
                pg_sys::GucSource::PGC_S_OVERRIDE,
            );
        }
    }
}
