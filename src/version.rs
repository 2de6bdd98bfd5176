//! The library and the extension's SQL must be the same version, and so must every stream's
//! tables. Installing a new library without `ALTER EXTENSION sqlstreams UPDATE` (or a stream an
//! upgrade did not reach) is refused with a clear error instead of failing half-way through a
//! call on a missing column.

use std::cell::Cell;

use pgrx::spi::SpiClient;

use crate::error::{Result, StreamError};
use crate::statement::{Access, Columns, Statement};

/// The version of this library, which is the version of the SQL it was written against.
pub const LIBRARY: &str = env!("CARGO_PKG_VERSION");

const INSTALLED: Statement = Statement {
    name: "version_installed",
    sql: "SELECT extversion FROM pg_catalog.pg_extension WHERE extname = 'sqlstreams'",
    params: &[],
};

thread_local! {
    /// Set once this backend has seen the installed SQL match the library.
    static MATCHED: Cell<bool> = const { Cell::new(false) };
}

fn mismatch(what: String) -> StreamError {
    StreamError::WrongPrerequisite {
        message: what,
        hint: "Run ALTER EXTENSION sqlstreams UPDATE, which migrates the catalog and every stream's tables.".into(),
    }
}

/// Checks (once per backend) that the installed extension SQL is this library's version.
pub fn check(client: &SpiClient<'_>, access: Access) -> Result<()> {
    if MATCHED.get() {
        return Ok(());
    }
    let installed: String = INSTALLED.exec(client, 0, &[], access)?.first().required("extversion")?;
    if installed != LIBRARY {
        return Err(mismatch(format!(
            "the sqlstreams library is version {LIBRARY} but the installed extension is {installed}"
        )));
    }
    MATCHED.set(true);
    Ok(())
}

/// Checks that stream `name`'s tables were built (or migrated) by this version.
pub fn check_stream(name: &str, schema_version: &str) -> Result<()> {
    if schema_version == LIBRARY {
        return Ok(());
    }
    Err(mismatch(format!(
        "the tables of stream {} are version {schema_version}, not {LIBRARY} like the library",
        crate::error::named(name)
    )))
}
