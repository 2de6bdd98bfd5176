//! The one error type of the extension and its single conversion into a Postgres error.
//!
//! Every refused call raises one of these before it writes anything, so a refusal changes
//! nothing. The SQLSTATEs are part of the SQL contract (docs/sql-api.md).

use pgrx::pg_sys::errcodes::PgSqlErrorCode;
use pgrx::pg_sys::panic::ErrorReport;

#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    #[error("stream {} does not exist", named(.0))]
    UnknownStream(String),

    #[error("no stream has id {0}")]
    UnknownStreamId(i64),

    #[error("role {} does not exist", named(.0))]
    UnknownRole(String),

    #[error("consumer group {} does not exist on stream {}", named(group), named(stream))]
    UnknownGroup { stream: String, group: String },

    /// A bad argument. `hint` says what to do instead.
    #[error("{message}")]
    InvalidArgument { message: String, hint: String },

    /// The call cannot work in the caller's transaction (for example `claim` under
    /// REPEATABLE READ, whose old snapshot could skip committed messages).
    #[error("{message}")]
    WrongTransactionState { message: String, hint: String },

    /// Something must be done first (for example `ALTER EXTENSION sqlstreams UPDATE`).
    #[error("{message}")]
    WrongPrerequisite { message: String, hint: String },

    /// The caller's role lacks a right (docs/sql-api.md, "Roles and grants").
    #[error("{message}")]
    PermissionDenied { message: String, hint: String },

    /// The call's snapshot is older than rows it must see (a REPEATABLE READ transaction):
    /// retried, it sees them.
    #[error("{message}")]
    SerializationFailure { message: String, hint: String },

    /// `DROP EXTENSION sqlstreams` while streams exist (src/drop_guard.rs).
    #[error("dropping the extension would lose {streams} stream(s): their names, groups and grants, and leave their tables behind")]
    StreamsExist { streams: i64 },

    /// A text stored in the extension's tables that this database cannot read as UTF-8: one that
    /// came another way than through the extension, such as a UTF8 database's dump restored into a
    /// LATIN1 one (`text::check_stored`).
    #[error("{message}")]
    UnreadableText { message: String, hint: String },

    /// A writing call on a hot standby (src/standby.rs).
    #[error("{function} writes, and this server is a standby: recovery is in progress")]
    Standby { function: &'static str },

    /// A writing call in a read-only transaction (`maintain()`, which refuses it before any
    /// stream rather than leave every stream out, `maintain_stream` and the worker's round).
    #[error("{function} writes, and this transaction is read-only")]
    ReadOnlyTransaction { function: &'static str },

    /// A broken invariant of the extension itself (a bug, never the caller's doing).
    #[error("internal error: {0}")]
    Internal(String),

    #[error(transparent)]
    Spi(#[from] pgrx::spi::Error),
}

pub type Result<T, E = StreamError> = std::result::Result<T, E>;

impl StreamError {
    pub fn invalid(message: impl Into<String>, hint: impl Into<String>) -> Self {
        StreamError::InvalidArgument { message: message.into(), hint: hint.into() }
    }

    pub(crate) fn sqlstate(&self) -> PgSqlErrorCode {
        match self {
            StreamError::UnknownStream(_)
            | StreamError::UnknownStreamId(_)
            | StreamError::UnknownRole(_)
            | StreamError::UnknownGroup { .. } => PgSqlErrorCode::ERRCODE_UNDEFINED_OBJECT,
            StreamError::InvalidArgument { .. } => PgSqlErrorCode::ERRCODE_INVALID_PARAMETER_VALUE,
            StreamError::WrongTransactionState { .. } => PgSqlErrorCode::ERRCODE_INVALID_TRANSACTION_STATE,
            StreamError::WrongPrerequisite { .. } => PgSqlErrorCode::ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE,
            StreamError::PermissionDenied { .. } => PgSqlErrorCode::ERRCODE_INSUFFICIENT_PRIVILEGE,
            StreamError::Standby { .. } | StreamError::ReadOnlyTransaction { .. } => {
                PgSqlErrorCode::ERRCODE_READ_ONLY_SQL_TRANSACTION
            }
            StreamError::SerializationFailure { .. } => PgSqlErrorCode::ERRCODE_T_R_SERIALIZATION_FAILURE,
            StreamError::StreamsExist { .. } => PgSqlErrorCode::ERRCODE_DEPENDENT_OBJECTS_STILL_EXIST,
            StreamError::UnreadableText { .. } => PgSqlErrorCode::ERRCODE_CHARACTER_NOT_IN_REPERTOIRE,
            StreamError::Internal(_) | StreamError::Spi(_) => PgSqlErrorCode::ERRCODE_INTERNAL_ERROR,
        }
    }

    pub(crate) fn hint(&self) -> Option<String> {
        match self {
            StreamError::UnknownStream(name) => Some(format!(
                "Create it first with sqlstreams.create_stream({}), or check the name in sqlstreams.streams.",
                quoted(Some(name))
            )),
            StreamError::UnknownStreamId(_) => Some("Look the stream's id up in sqlstreams.streams.".into()),
            StreamError::UnknownRole(_) => Some("Create the role first (CREATE ROLE), or check its name.".into()),
            StreamError::StreamsExist { .. } => Some(
                "Drop the streams first (SELECT sqlstreams.drop_stream(name) FROM sqlstreams.streams), \
                 or keep the extension. To move them, pg_dump the database instead."
                    .into(),
            ),
            StreamError::Standby { function } => Some(format!(
                "Call {function} on the primary. A standby serves the views and the inspection functions \
                 (group_status, blocked_keys, dead_messages, open_leases, peek, stream_head)."
            )),
            StreamError::ReadOnlyTransaction { function } => Some(format!(
                "Call {function} in a read-write transaction (BEGIN READ WRITE), as a role whose \
                 default_transaction_read_only is off."
            )),
            StreamError::UnknownGroup { stream, group } => Some(format!(
                "Create it first with sqlstreams.create_group({}, {}), or check the name in sqlstreams.consumer_groups.",
                quoted(Some(stream)),
                quoted(Some(group))
            )),
            StreamError::InvalidArgument { hint, .. }
            | StreamError::WrongTransactionState { hint, .. }
            | StreamError::WrongPrerequisite { hint, .. }
            | StreamError::PermissionDenied { hint, .. }
            | StreamError::SerializationFailure { hint, .. }
            | StreamError::UnreadableText { hint, .. } => Some(hint.clone()),
            StreamError::Internal(_) | StreamError::Spi(_) => None,
        }
    }
}

impl From<StreamError> for ErrorReport {
    fn from(err: StreamError) -> Self {
        let report = ErrorReport::new(err.sqlstate(), format!("sqlstreams: {err}"), "sqlstreams");
        match err.hint() {
            Some(hint) => report.set_hint(hint),
            None => report,
        }
    }
}

/// The return type of every `#[pg_extern]` shim: pgrx raises an `ErrorReport` with its own
/// SQLSTATE, while any other error type would become a generic 22000.
pub type SqlResult<T> = std::result::Result<T, ErrorReport>;

/// A name as messages show it, in double quotes like Postgres' own (`"orders"`).
pub fn named(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// The transaction's isolation level when it is stricter than READ COMMITTED, which claims and
/// maintenance need, by the name `SET TRANSACTION` takes.
pub fn stricter_than_read_committed() -> Option<&'static str> {
    // SAFETY: reads this backend's isolation level.
    match unsafe { pgrx::pg_sys::XactIsoLevel } as u32 {
        pgrx::pg_sys::XACT_REPEATABLE_READ => Some("REPEATABLE READ"),
        pgrx::pg_sys::XACT_SERIALIZABLE => Some("SERIALIZABLE"),
        _ => None,
    }
}

/// Where a stricter level comes from when the caller asked for none: the end of a refusal's hint.
pub const DEFAULT_ISOLATION_HINT: &str = "A transaction that names no level (autocommit, or a bare BEGIN) takes \
     default_transaction_isolation, which postgresql.conf or a database's or role's setting may make stricter: \
     SET default_transaction_isolation = 'read committed' in the session before it, or BEGIN ISOLATION LEVEL \
     READ COMMITTED.";

/// A value as SQL in a hint spells it: a literal (`'it''s'`) or NULL.
pub fn quoted(value: Option<&str>) -> String {
    match value {
        Some(v) => format!("'{}'", v.replace('\'', "''")),
        None => "NULL".to_string(),
    }
}
