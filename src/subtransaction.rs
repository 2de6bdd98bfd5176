//! What goes on after one part of a job fails: the maintenance worker's round and `maintain()`
//! each run a stream's housekeeping in a subtransaction, so that a stream that cannot be
//! maintained is left with a warning and the streams after it are maintained all the same.

use pgrx::pg_sys;
use pgrx::pg_sys::panic::{CaughtError, ErrorReport, ErrorReportWithLevel};
use pgrx::prelude::*;
use pgrx::PgSqlErrorCode;

use crate::error::StreamError;
use crate::text::sendable;

/// An error `caught` caught (its text decoded as UTF-8), or one of the library's own.
pub struct Caught {
    code: PgSqlErrorCode,
    message: String,
    detail: Option<String>,
    hint: Option<String>,
}

impl Caught {
    fn of(report: &ErrorReportWithLevel) -> Caught {
        Caught {
            code: report.sql_error_code(),
            message: report.message().to_string(),
            detail: report.detail().map(str::to_string),
            hint: report.hint().map(str::to_string),
        }
    }

    /// A library error that was never raised.
    pub fn from_error(error: &StreamError) -> Caught {
        Caught { code: error.sqlstate(), message: error.to_string(), detail: None, hint: error.hint() }
    }

    /// Raises it again as a WARNING, its message prefixed with `about` (once `sqlstreams: `),
    /// with its own SQLSTATE, detail and hint: a hint such as "Run ALTER EXTENSION sqlstreams
    /// UPDATE" is what to do about it. Its CONTEXT is not kept.
    pub fn warn(&self, about: &str) {
        let message = self.message.strip_prefix("sqlstreams: ").unwrap_or(&self.message);
        let mut report =
            ErrorReport::new(self.code, sendable(&format!("{about}: {message}")).into_owned(), "sqlstreams");
        if let Some(detail) = &self.detail {
            report = report.set_detail(sendable(detail).into_owned());
        }
        if let Some(hint) = &self.hint {
            report = report.set_hint(sendable(hint).into_owned());
        }
        report.report(PgLogLevel::WARNING);
    }
}

/// Runs `f` in a subtransaction: an error it raises rolls back what it did and comes back as
/// `Caught`, and the transaction goes on, as a PL/pgSQL block's `EXCEPTION WHEN
/// OTHERS` does. Like that clause, it lets a query cancel (`pg_cancel_backend`, a
/// `statement_timeout`) go on up.
pub fn caught<T>(f: impl FnOnce() -> T) -> Result<T, Caught> {
    // SAFETY: the subtransaction is begun and ended here, and the memory context and resource
    // owner put back after it either way, as PL/pgSQL's exception blocks do
    // (exec_stmt_block); pgrx has copied the error's data and flushed its state when a catch
    // runs, and what `f` made (SPI tuple tables among it) was dropped while its error unwound.
    unsafe {
        let context = pg_sys::CurrentMemoryContext;
        let owner = pg_sys::CurrentResourceOwner;
        let roll_back = move || {
            pg_sys::MemoryContextSwitchTo(context);
            pg_sys::RollbackAndReleaseCurrentSubTransaction();
            pg_sys::MemoryContextSwitchTo(context);
            pg_sys::CurrentResourceOwner = owner;
        };
        pg_sys::BeginInternalSubTransaction(std::ptr::null());
        pg_sys::MemoryContextSwitchTo(context);
        let f = std::panic::AssertUnwindSafe(f);
        PgTryBuilder::new(move || {
            let value = f();
            pg_sys::ReleaseCurrentSubTransaction();
            pg_sys::MemoryContextSwitchTo(context);
            pg_sys::CurrentResourceOwner = owner;
            Ok(value)
        })
        .catch_when(PgSqlErrorCode::ERRCODE_QUERY_CANCELED, move |cancel| {
            roll_back();
            cancel.rethrow()
        })
        .catch_others(move |error| {
            roll_back();
            Err(match &error {
                CaughtError::PostgresError(report)
                | CaughtError::ErrorReport(report)
                | CaughtError::RustPanic { ereport: report, .. } => Caught::of(report),
            })
        })
        .execute()
    }
}

/// Raises `error` as the Postgres error it stands for, inside `caught`: the subtransaction rolls
/// back, as for any error, where returning it would release what the step did.
pub fn raise<T>(error: StreamError) -> T {
    ErrorReport::from(error).report(PgLogLevel::ERROR);
    unreachable!("an ERROR does not return")
}

/// The warning about stream `name`, whose step failed with `error` and was rolled back
/// (`maintain()`'s and the worker's).
pub fn not_maintained(name: &str, error: &Caught) {
    error.warn(&format!("sqlstreams: stream {} is not maintained", crate::error::named(name)));
}
