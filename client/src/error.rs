//! Errors of the client, with the extension's SQLSTATEs mapped to variants.

use tokio_postgres::error::SqlState;

/// Everything a client call can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The stream or group does not exist (SQLSTATE 42704).
    #[error("{message}")]
    UnknownObject {
        /// The server's message.
        message: String,
        /// What to do instead.
        hint: Option<String>,
    },
    /// An argument was refused (SQLSTATE 22023); nothing was changed.
    #[error("{message}")]
    InvalidArgument {
        /// The server's message, naming the refused value.
        message: String,
        /// What to do instead.
        hint: Option<String>,
    },
    /// The caller's role lacks a right on the stream or group (SQLSTATE 42501): an admin grants
    /// it with `sqlstreams.grant_stream`, which the hint spells out.
    #[error("{message}")]
    PermissionDenied {
        /// The server's message, naming the role and what it may not do.
        message: String,
        /// The grant that would allow it.
        hint: Option<String>,
    },
    /// The server's TLS certificate was refused (not signed by a trusted authority, or not for
    /// this host): retrying will not help; fix `ssl_root_cert` or the server's certificate.
    #[error("TLS: {0}")]
    Tls(String),
    /// The group exists with other settings than the consumer's configuration, and
    /// `update_settings` was not set: nothing was changed.
    #[error("consumer group \"{group}\" exists with other settings ({}); set update_settings to replace them", differences.join(", "))]
    SettingsMismatch {
        /// The group.
        group: String,
        /// "setting: stored → wanted", one per difference.
        differences: Vec<String>,
    },
    /// The database has no sqlstreams extension, or one older than this client needs
    /// ([`MIN_EXTENSION_VERSION`](crate::MIN_EXTENSION_VERSION)): nothing was sent.
    #[error("{}", extension_message(installed.as_deref(), required))]
    Extension {
        /// The version installed in the database, if any.
        installed: Option<String>,
        /// The oldest version this client works with.
        required: &'static str,
    },
    /// The client's own configuration is inconsistent.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// A message could not be serialized to JSON.
    #[error("could not encode a message as JSON: {0}")]
    Encode(#[from] serde_json::Error),
    /// Any other error from Postgres or the connection: the server's message and SQLSTATE,
    /// or what broke the connection.
    #[error("{}", postgres_message(.0))]
    Postgres(#[source] tokio_postgres::Error),
    /// No connection could be taken from the pool.
    #[error("connection pool: {0}")]
    Pool(String),
}

impl Error {
    /// True for an unknown stream or group.
    pub fn is_unknown_object(&self) -> bool {
        matches!(self, Error::UnknownObject { .. })
    }

    /// True for a refused argument.
    pub fn is_invalid_argument(&self) -> bool {
        matches!(self, Error::InvalidArgument { .. })
    }

    /// True when the caller's role lacks a right (42501).
    pub fn is_permission_denied(&self) -> bool {
        matches!(self, Error::PermissionDenied { .. })
    }

    /// True when retrying later, on a new connection, may succeed: the connection was lost, the
    /// server ended the session (terminated, shut down, still starting) or refused it for want
    /// of connections (`53300`), the server is a standby now (`25006`, after a failover), or the
    /// statement was rolled back for a conflict that passes (`40001`, `40P01`) or a lock timeout
    /// (`55P03`). These are what docs/sql-api.md ("The consumer loop") tells any consumer to
    /// retry. Not a statement timeout or a resource limit, which may fail the same way for ever.
    pub fn is_transient(&self) -> bool {
        match self {
            Error::Pool(_) => true,
            Error::Postgres(e) => e.is_closed() || e.as_db_error().is_none_or(|db| is_transient_state(db.code())),
            _ => false,
        }
    }

    /// True for a cancelled statement (`57014`: `pg_cancel_backend`, a `statement_timeout`).
    pub(crate) fn is_cancel(&self) -> bool {
        matches!(self, Error::Postgres(e) if e.code() == Some(&SqlState::QUERY_CANCELED))
    }

    /// True when the connection this came from is of no further use: its socket closed, it broke,
    /// or the server ended its session.
    pub(crate) fn ends_session(&self) -> bool {
        match self {
            Error::Postgres(e) => e.is_closed() || e.as_db_error().is_none_or(|db| is_session_end(db.code())),
            _ => false,
        }
    }
}

/// Class 08 (connection exception), the server ended the session, or it is a standby now (after
/// a failover: a new connection may reach the new primary, as `target_session_attrs` picks it).
fn is_session_end(code: &SqlState) -> bool {
    const SESSION_ENDED: [SqlState; 5] = [
        SqlState::ADMIN_SHUTDOWN,
        SqlState::CRASH_SHUTDOWN,
        SqlState::CANNOT_CONNECT_NOW,
        SqlState::IDLE_SESSION_TIMEOUT,
        SqlState::READ_ONLY_SQL_TRANSACTION,
    ];
    code.code().starts_with("08") || SESSION_ENDED.contains(code)
}

/// SQLSTATEs that say nothing about the statement itself. A session's end arrives as an error
/// of the statement it was running (`pg_terminate_backend`, a fast shutdown: 57P01), before the
/// connection reads as closed.
fn is_transient_state(code: &SqlState) -> bool {
    const PASSING: [SqlState; 4] = [
        SqlState::T_R_SERIALIZATION_FAILURE,
        SqlState::T_R_DEADLOCK_DETECTED,
        SqlState::LOCK_NOT_AVAILABLE,
        SqlState::TOO_MANY_CONNECTIONS,
    ];
    is_session_end(code) || PASSING.contains(code)
}

impl From<tokio_postgres::Error> for Error {
    fn from(err: tokio_postgres::Error) -> Self {
        if let Some(db) = err.as_db_error() {
            let (message, hint) = (db.message().to_string(), db.hint().map(str::to_string));
            if *db.code() == SqlState::UNDEFINED_OBJECT {
                return Error::UnknownObject { message, hint };
            }
            if *db.code() == SqlState::INVALID_PARAMETER_VALUE {
                return Error::InvalidArgument { message, hint };
            }
            if *db.code() == SqlState::INSUFFICIENT_PRIVILEGE {
                return Error::PermissionDenied { message, hint };
            }
        }
        if let Some(refused) = tls_refusal(&err) {
            return Error::Tls(refused);
        }
        Error::Postgres(err)
    }
}

impl From<deadpool_postgres::PoolError> for Error {
    fn from(err: deadpool_postgres::PoolError) -> Self {
        match err {
            deadpool_postgres::PoolError::Backend(e) => e.into(),
            other => Error::Pool(other.to_string()),
        }
    }
}

fn extension_message(installed: Option<&str>, required: &str) -> String {
    match installed {
        None => format!(
            "the sqlstreams extension is not installed in this database; this client needs version \
             {required} or later: a superuser runs CREATE EXTENSION sqlstreams"
        ),
        Some(installed) => format!(
            "the sqlstreams extension in this database is version {installed}; this client needs \
             {required} or later: install a newer extension and run ALTER EXTENSION sqlstreams UPDATE"
        ),
    }
}

/// The server's own words for its error (tokio-postgres' `Display` says only "db error"), or
/// the connection error with what caused it.
fn postgres_message(err: &tokio_postgres::Error) -> String {
    match err.as_db_error() {
        Some(db) => {
            let mut text = format!("{} (SQLSTATE {})", db.message(), db.code().code());
            if let Some(detail) = db.detail() {
                text.push_str(&format!("; detail: {detail}"));
            }
            if let Some(hint) = db.hint() {
                text.push_str(&format!("; hint: {hint}"));
            }
            text
        }
        None => match std::error::Error::source(err) {
            Some(cause) => format!("{err}: {cause}"),
            None => err.to_string(),
        },
    }
}

/// The rustls error behind a failed connection, if that is why it failed.
fn tls_refusal(err: &tokio_postgres::Error) -> Option<String> {
    let mut source = std::error::Error::source(err);
    while let Some(e) = source {
        let inner = e.downcast_ref::<std::io::Error>().and_then(|io| io.get_ref()).map(|i| i as &dyn std::error::Error);
        if let Some(tls) = inner.unwrap_or(e).downcast_ref::<rustls::Error>() {
            return Some(tls.to_string());
        }
        source = e.source();
    }
    None
}

/// The client's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_session_the_server_ended_is_transient_a_refusal_is_not() {
        let transient =
            ["57P01", "57P02", "57P03", "57P05", "08006", "08P01", "25006", "40001", "40P01", "53300", "55P03"];
        for code in transient {
            assert!(is_transient_state(&SqlState::from_code(code)), "{code} is transient");
        }
        let for_ever =
            ["42704", "22023", "42501", "23505", "P0001", "XX000", "57P04", "55000", "57014", "53100", "40002"];
        for code in for_ever {
            assert!(!is_transient_state(&SqlState::from_code(code)), "{code} is final");
        }
    }
}
