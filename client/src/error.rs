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
    /// The client's own configuration is inconsistent.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// A message could not be serialized to JSON.
    #[error("could not encode a message as JSON: {0}")]
    Encode(#[from] serde_json::Error),
    /// Any other error from Postgres or the connection.
    #[error(transparent)]
    Postgres(tokio_postgres::Error),
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

    /// True when retrying later may succeed (a lost connection, a restarting server).
    pub fn is_transient(&self) -> bool {
        match self {
            Error::Pool(_) => true,
            Error::Postgres(e) => e.is_closed() || e.as_db_error().is_none(),
            _ => false,
        }
    }
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

/// The client's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
