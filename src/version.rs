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

/// The refusal when SQL at version `theirs` meets this library: what to do depends on which is
/// behind.
fn mismatch(what: String, theirs: &str) -> StreamError {
    let hint = if newer(theirs, LIBRARY) {
        format!(
            "The extension was updated to {theirs} after this session loaded the library, version {LIBRARY}: \
             reconnect, and the new session loads the new library (with sqlstreams in \
             shared_preload_libraries, restart the server: new sessions inherit the old one)."
        )
    } else {
        "Run ALTER EXTENSION sqlstreams UPDATE, which migrates the catalog and every stream's tables.".into()
    };
    StreamError::WrongPrerequisite { message: what, hint }
}

/// Whether version `a` comes after `b` ("0.10.0" after "0.9.1"); one that is not numbers does not.
fn newer(a: &str, b: &str) -> bool {
    let parse = |v: &str| v.split('.').map(str::parse::<u64>).collect::<std::result::Result<Vec<_>, _>>().ok();
    matches!((parse(a), parse(b)), (Some(a), Some(b)) if a > b)
}

/// Checks (once per backend) that the installed extension SQL is this library's version.
pub fn check(client: &SpiClient<'_>, access: Access) -> Result<()> {
    if MATCHED.get() {
        return Ok(());
    }
    check_now(client, access)
}

/// `check`, even when this backend matched before: for a call off the hot path (`maintain()`),
/// in a session that may have loaded its library before the extension was updated.
pub fn check_now(client: &SpiClient<'_>, access: Access) -> Result<()> {
    let installed: String = INSTALLED.exec(client, 0, &[], access)?.first().required("extversion")?;
    if installed != LIBRARY {
        MATCHED.set(false);
        return Err(mismatch(
            format!("the sqlstreams library is version {LIBRARY} but the installed extension is {installed}"),
            &installed,
        ));
    }
    MATCHED.set(true);
    Ok(())
}

/// Checks that stream `name`'s tables were built (or migrated) by this version.
pub fn check_stream(name: &str, schema_version: &str) -> Result<()> {
    if schema_version == LIBRARY {
        return Ok(());
    }
    Err(mismatch(
        format!(
            "the tables of stream {} are version {schema_version}, not {LIBRARY} like the library",
            crate::error::named(name)
        ),
        schema_version,
    ))
}

#[cfg(test)]
mod tests {
    use super::newer;

    #[test]
    fn versions_compare_as_numbers() {
        assert!(newer("0.10.0", "0.9.1"));
        assert!(newer("0.3.0", "0.2.0"));
        assert!(!newer("0.2.0", "0.2.0"));
        assert!(!newer("0.1.0", "0.2.0"));
        assert!(!newer("0.3.0-beta", "0.2.0"));
    }
}
