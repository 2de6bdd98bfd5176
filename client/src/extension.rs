//! Which versions of the extension this client works with. Checked at a [`Client`]'s first
//! call, and at each call after until a check passes, so a missing or older extension fails
//! with [`Error::Extension`] instead of an unknown function half-way through a call.
//!
//! [`Client`]: crate::Client

use crate::error::{Error, Result};

/// The oldest extension version this client works with: the SQL API only grows (a function's
/// parameters and result columns never change), so every later version serves it too.
pub const MIN_EXTENSION_VERSION: &str = "0.2.0";

/// Fails unless the database `conn` is connected to has the extension at a version that fits.
pub(crate) async fn check(conn: &tokio_postgres::Client) -> Result<()> {
    let row =
        conn.query_opt("SELECT extversion FROM pg_catalog.pg_extension WHERE extname = 'sqlstreams'", &[]).await?;
    match row.map(|r| r.get::<_, String>(0)) {
        Some(installed) if fits(&installed) => Ok(()),
        installed => Err(Error::Extension { installed, required: MIN_EXTENSION_VERSION }),
    }
}

/// Whether an installed version is `MIN_EXTENSION_VERSION` or later (a version that does not
/// parse as numbers does not fit; a missing part counts as 0).
fn fits(installed: &str) -> bool {
    match (numbers(installed), numbers(MIN_EXTENSION_VERSION)) {
        (Some(installed), Some(required)) => installed >= required,
        _ => false,
    }
}

/// Major, minor, patch.
fn numbers(version: &str) -> Option<[u64; 3]> {
    let mut parts = [0; 3];
    let mut given = version.split('.');
    for part in parts.iter_mut() {
        if let Some(text) = given.next() {
            *part = text.parse().ok()?;
        }
    }
    given.next().is_none().then_some(parts)
}

#[cfg(test)]
mod tests {
    use super::fits;

    #[test]
    fn versions_from_the_minimum_on_fit() {
        assert!(fits("0.2.0"));
        assert!(fits("0.2.1"));
        assert!(fits("0.10.0"), "compared as numbers, not as text");
        assert!(fits("1.0.0"));
        assert!(fits("0.2"), "a missing part is 0");
        assert!(!fits("0.1.0"));
        assert!(!fits("0.2.0-dev"));
        assert!(!fits(""));
        assert!(!fits("0.2.0.1"));
    }
}
