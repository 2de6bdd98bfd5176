//! How consumer-side calls commit.
//!
//! `claim`, `ack`, `ack_batch`, `fail`, `delay`, `release` and `extend_lease` record who has a
//! message and what became of it. Losing the last few of those records in a crash loses no
//! message: an unrecorded claim or outcome means the message is delivered again (at least once),
//! and WAL order keeps every earlier record. So a transaction that wrote nothing but those
//! records commits without waiting for the WAL flush (`synchronous_commit = off` for that
//! transaction only); under durable settings the flush was the largest cost of a consumer's
//! cycle.
//!
//! "Nothing but those records" is decided at commit, from this backend's WAL position
//! (`XactLastRecEnd`): it must not have moved before the first consumer call, between consumer
//! calls, or after the last one. So `WITH a AS (SELECT sqlstreams.ack_batch(...)) INSERT INTO
//! biz ...` or `SELECT sqlstreams.produce(...) FROM sqlstreams.claim(...)` keep the caller's
//! durability: the business row or the produced message moved the WAL position outside a
//! consumer call. Inside a transaction block the caller's setting always applies. `produce`
//! never relaxes anything.

use std::cell::Cell;

use pgrx::pg_sys;
use pgrx::prelude::*;
use pgrx::spi::SpiClient;

use crate::access::{self, Right};
use crate::error::{Result, StreamError};
use crate::exception_queue::counts;
use crate::group::{self, GroupRef};
use crate::statement::Access;
use pgrx::pg_sys::panic::ErrorReport;

/// What this transaction's consumer calls have seen of its WAL.
#[derive(Clone, Copy, Default)]
struct Bracket {
    /// Where this backend's WAL stood when the last consumer call of the transaction ended.
    after_last_call: Option<pg_sys::XLogRecPtr>,
    /// Something other than a consumer call wrote WAL, or a call ran in a transaction block.
    mixed: bool,
}

thread_local! {
    static BRACKET: Cell<Bracket> = const { Cell::new(Bracket { after_last_call: None, mixed: false }) };
}

fn wal_position() -> pg_sys::XLogRecPtr {
    // SAFETY: reads this backend's end of WAL written by the current transaction (0 when none).
    unsafe { pg_sys::XactLastRecEnd }
}

/// Registers the commit hooks once per backend (from `_PG_init`).
pub fn init() {
    // SAFETY: registers callbacks with a null argument; they live as long as the library.
    unsafe {
        pg_sys::RegisterXactCallback(Some(on_xact_event), std::ptr::null_mut());
        pg_sys::RegisterSubXactCallback(Some(on_subxact_event), std::ptr::null_mut());
    }
}

/// Runs a consumer call on group `group_name` of `stream`: looks the group up, checks the
/// caller's right to consume as it (src/access.rs), runs `f` as the owner, and notes whether anything else wrote before the call and where the WAL stands after it.
pub fn consumer_call<T>(
    stream: &str,
    group_name: &str,
    f: impl FnOnce(&SpiClient<'_>, &GroupRef) -> Result<T>,
) -> Result<T> {
    let mut bracket = BRACKET.get();
    // SAFETY: reads this backend's transaction state.
    let in_block = unsafe { pg_sys::IsTransactionBlock() };
    bracket.mixed |= in_block || wal_position() != bracket.after_last_call.unwrap_or(0);
    BRACKET.set(bracket);
    let result = access::as_owner(|caller| {
        Spi::connect_mut(|client| {
            let group = group::lookup(client, stream, group_name, Access::Write)?;
            caller.require(client, group.stream.id, stream, Right::Consume(group_name))?;
            f(client, &group)
        })
    })?;
    BRACKET.set(Bracket { after_last_call: Some(wal_position()), ..BRACKET.get() });
    Ok(result)
}

#[pg_guard]
unsafe extern "C-unwind" fn on_xact_event(event: pg_sys::XactEvent::Type, _arg: *mut std::ffi::c_void) {
    use pg_sys::XactEvent::*;
    match event {
        XACT_EVENT_PRE_COMMIT => {
            // The exception counts this transaction changed are part of its consumer records:
            // the WAL they write does not count against relaxing.
            let before_counts = wal_position();
            flush_counts();
            let bracket = BRACKET.get();
            if bracket.after_last_call.is_some_and(|end| !bracket.mixed && end == before_counts) {
                relax();
            }
        }
        XACT_EVENT_PRE_PREPARE => {
            if crate::notify::pending() {
                refuse_prepare_while_notifying();
            }
            flush_counts();
        }
        XACT_EVENT_COMMIT
        | XACT_EVENT_ABORT
        | XACT_EVENT_PREPARE
        | XACT_EVENT_PARALLEL_COMMIT
        | XACT_EVENT_PARALLEL_ABORT => {
            BRACKET.set(Bracket::default());
            crate::quiet::ended(event == XACT_EVENT_PREPARE);
            crate::notify::forget();
            counts::forget();
            if event == XACT_EVENT_COMMIT {
                crate::lanes::committed();
                crate::own_claims::committed();
            } else {
                crate::lanes::rolled_back();
                crate::own_claims::rolled_back();
            }
        }
        _ => {}
    }
}

#[pg_guard]
unsafe extern "C-unwind" fn on_subxact_event(
    event: pg_sys::SubXactEvent::Type,
    sub: pg_sys::SubTransactionId,
    parent: pg_sys::SubTransactionId,
    _arg: *mut std::ffi::c_void,
) {
    use pg_sys::SubXactEvent::*;
    match event {
        SUBXACT_EVENT_COMMIT_SUB => counts::end_subtransaction(true, sub, parent),
        SUBXACT_EVENT_ABORT_SUB => {
            counts::end_subtransaction(false, sub, parent);
            crate::lanes::rolled_back();
            crate::own_claims::rolled_back();
        }
        _ => {}
    }
}

/// Writes the exception counts this transaction changed; an error aborts the transaction.
fn flush_counts() {
    if !counts::pending() {
        return;
    }
    if let Err(e) = counts::flush() {
        ErrorReport::from(e).report(pgrx::PgLogLevel::ERROR);
    }
}

fn refuse_prepare_while_notifying() {
    // Postgres refuses it too, with a message that does not say what to do.
    ErrorReport::from(StreamError::WrongTransactionState {
        message: "a transaction that called sqlstreams cannot be prepared while it notifies consumers".into(),
        hint: "Run SET LOCAL sqlstreams.notify = off before the first sqlstreams call of a transaction \
               you will PREPARE; consumers then find its messages when they poll."
            .into(),
    })
    .report(pgrx::PgLogLevel::ERROR);
}

/// `SET LOCAL synchronous_commit = off`, just before the commit record is written.
fn relax() {
    crate::settings::set(c"synchronous_commit", c"off", pg_sys::GucAction::GUC_ACTION_LOCAL);
}
