//! Wake-up signals for idle consumers: `NOTIFY sqlstreams_<stream id>`.
//!
//! Postgres delivers a notification when the sending transaction commits, so a consumer woken
//! by it sees the new message. Postgres already folds identical notifications of one
//! transaction into one; this module also skips the call itself after the first one per
//! (transaction, subtransaction, stream), so a producer writing many messages pays once. The
//! subtransaction is part of the key because a rolled-back savepoint discards its notifications.

use std::cell::{Cell, RefCell};

use pgrx::pg_sys;
use pgrx::IntoDatum;

/// The channel consumers of a stream LISTEN on.
pub fn channel(stream_id: i64) -> String {
    format!("sqlstreams_{stream_id}")
}

/// The channel a stream's consumers LISTEN on (produce NOTIFYs it at commit); the `channel`
/// column of `sqlstreams.streams`, so clients never spell it themselves.
#[pgrx::pg_extern(immutable, parallel_safe, sql = false)]
fn stream_channel(stream_id: i64) -> String {
    channel(stream_id)
}

thread_local! {
    static LAST: RefCell<Option<(u32, u32, i64)>> = const { RefCell::new(None) };
}

/// Signals the stream's consumers at commit, once per (sub)transaction; nothing when
/// `sqlstreams.notify` is off (src/settings.rs).
pub fn signal(stream_id: i64) {
    if !crate::settings::notify() {
        return;
    }
    // SAFETY: reads of this backend's transaction state.
    let key =
        unsafe { (u32::from(pg_sys::GetTopTransactionIdIfAny()), pg_sys::GetCurrentSubTransactionId(), stream_id) };
    // Without an xid there is no transaction identity to coalesce on (and nothing was written).
    if key.0 != 0 && LAST.with(|last| *last.borrow() == Some(key)) {
        return;
    }
    // `pg_notify(channel, '')` called as a function, not through a statement: the same queued
    // notification and the same refusal on a standby, without a plan and an executor. Nor the
    // EXECUTE check a statement makes: every caller runs as the extension's owner (src/access.rs),
    // who may run it.
    let (channel, payload) = (channel(stream_id).into_datum(), "".into_datum());
    // SAFETY: pg_notify takes two texts and returns void; an ERROR it raises is re-thrown.
    unsafe {
        let notify = pg_sys::Oid::from(pg_sys::F_PG_NOTIFY);
        pg_sys::OidFunctionCall2Coll(notify, pg_sys::InvalidOid, channel.unwrap(), payload.unwrap());
    }
    LAST.with(|last| *last.borrow_mut() = Some(key));
    PENDING.set(true);
}

thread_local! {
    /// This transaction signalled (its NOTIFYs are queued until commit).
    static PENDING: Cell<bool> = const { Cell::new(false) };
}

/// Whether this transaction queued a NOTIFY; `forget` at its end.
pub fn pending() -> bool {
    PENDING.get()
}

pub fn forget() {
    PENDING.set(false);
}
