//! The head: the highest message id handed out on a stream, its id sequence's last value.
//!
//! Read under the sequence's buffer lock, never with `SELECT last_value FROM` the sequence.
//! While `nextval` logs values ahead, it writes the value it logs (up to 32 past the last id
//! handed out) into the sequence's row, and puts the real one back before it lets the buffer's
//! lock go. A scan reads the row after it has let that lock go, so it can see the first: an id
//! nobody has taken yet. A claim fence that took it for handed out proved ids that producers took
//! later, and skipped their messages (docs/semantics.md, "A head read without the lock").
//!
//! `pg_sequence_last_value` reads under the lock too, but it opens the sequence the way
//! `nextval` does (`RowExclusiveLock`), which would make claims wait for a stream's bound step,
//! which holds the sequence `EXCLUSIVE` (src/bounds.rs). This takes what a `SELECT` took:
//! `AccessShareLock`.

use std::ffi::CString;

use pgrx::pg_sys;
use pgrx::pg_sys::panic::ErrorReport;
use pgrx::prelude::*;

use crate::error::{Result, StreamError};

/// A sequence's row (`FormData_pg_sequence_data`, commands/sequence.h; unchanged since
/// PostgreSQL 10).
#[repr(C)]
struct SequenceData {
    last_value: i64,
    #[allow(dead_code)] // its place in the row
    log_cnt: i64,
    is_called: bool,
}

/// The page's special space of a sequence, and what it holds (`SEQ_MAGIC`).
#[repr(C)]
struct SequenceMagic {
    magic: u32,
}
const SEQ_MAGIC: u32 = 0x1717;

/// The last id handed out on stream `stream_id` (0 when none): its sequence's last value, read
/// under the sequence's buffer lock. The sequence is looked up by name on every call, so nothing
/// keeps the oid of a sequence dropped since.
pub fn read(stream_id: i64) -> Result<i64> {
    Ok(read_with_sequence(stream_id)?.0)
}

/// `read`, with the oid of the sequence it was read from.
pub fn read_with_sequence(stream_id: i64) -> Result<(i64, pg_sys::Oid)> {
    let name = CString::new(format!("message_log_{stream_id}_seq")).expect("no NUL in a number");
    let unreadable = |why: &str| Err(StreamError::Internal(format!("{}: {why}", name.to_string_lossy())));
    // SAFETY: catalog lookups by name; the relation is opened under a lock and checked to be a
    // sequence before its one page is read. That page is read under its buffer's share lock,
    // which `nextval` cannot hold exclusively meanwhile, is laid out as commands/sequence.c writes
    // it (checked by its magic number), and is let go before anything returns.
    unsafe {
        let schema = pg_sys::get_namespace_oid(c"sqlstreams".as_ptr(), false);
        let sequence = pg_sys::get_relname_relid(name.as_ptr(), schema);
        if sequence == pg_sys::InvalidOid {
            return unreadable("no such sequence");
        }
        let relation = pg_sys::relation_open(sequence, pg_sys::AccessShareLock as pg_sys::LOCKMODE);
        // The lock is held to the end of the transaction, as a SELECT's is.
        let close = || pg_sys::relation_close(relation, pg_sys::NoLock as pg_sys::LOCKMODE);
        if (*(*relation).rd_rel).relkind != pg_sys::RELKIND_SEQUENCE as std::ffi::c_char {
            close();
            return unreadable("not a sequence");
        }
        let buffer = pg_sys::ReadBuffer(relation, 0);
        pg_sys::LockBuffer(buffer, pg_sys::BUFFER_LOCK_SHARE as std::ffi::c_int);
        let page = pg_sys::BufferGetPage(buffer);
        let read = if (*pg_sys::PageGetSpecialPointer(page).cast::<SequenceMagic>()).magic == SEQ_MAGIC {
            let item = pg_sys::PageGetItemId(page, pg_sys::FirstOffsetNumber as pg_sys::OffsetNumber);
            let tuple = pg_sys::PageGetItem(page, item).cast::<pg_sys::HeapTupleHeaderData>();
            let row = tuple.cast::<u8>().add((*tuple).t_hoff as usize).cast::<SequenceData>();
            Some(((*row).last_value, (*row).is_called))
        } else {
            None
        };
        pg_sys::UnlockReleaseBuffer(buffer);
        close();
        match read {
            Some((last_value, true)) => Ok((last_value, sequence)),
            Some((_, false)) => Ok((0, sequence)),
            None => unreadable("bad magic number"),
        }
    }
}

/// `read` for SQL statements (`cursor::head_sql!`). Internal.
#[pg_extern(volatile, strict, parallel_safe, sql = false)]
fn log_head(stream_id: i64) -> std::result::Result<i64, ErrorReport> {
    Ok(read(stream_id)?)
}
