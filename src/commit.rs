//! How consumer-side calls commit.
//!
//! `claim`, `ack`, `ack_batch`, `fail`, `delay`, `release` and `extend_lease` record who has a
//! message and what became of it. Losing the last few of those records in a crash loses no
//! message: an unrecorded claim or outcome means the message is delivered again (at least once),
//! and WAL order keeps every earlier record. So when such a call is its transaction's only
//! statement (not inside a transaction block), it commits without waiting for the WAL flush
//! (`synchronous_commit = off` for that transaction only). Under durable settings the flush was
//! the largest cost of a consumer's cycle. Inside a transaction block the caller's setting
//! applies: the same transaction may hold business writes that must be durable. `produce` never
//! does this.

use pgrx::pg_sys;
use pgrx::spi::SpiClient;

use crate::error::Result;
use crate::statement::Statement;

const RELAX: Statement =
    Statement { name: "commit_relax", sql: "SELECT set_config('synchronous_commit', 'off', true)", params: &[] };

/// Lets this transaction commit without waiting for the WAL flush, when the calling statement
/// is all the transaction does.
pub fn relax_for_outcome(client: &SpiClient<'_>) -> Result<()> {
    // SAFETY: reads this backend's transaction state.
    if unsafe { pg_sys::IsTransactionBlock() } {
        return Ok(());
    }
    RELAX.run(client, 0, &[])?;
    Ok(())
}
