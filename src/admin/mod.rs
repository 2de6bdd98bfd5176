//! The operator API: creating, changing and dropping streams and groups, grants, seeks, dead
//! letters and maintenance. Operators call it; the claim, outcome and produce paths never
//! import it, so what they need (src/stream.rs, src/group.rs, src/access.rs) stays small.

mod dead_letters;
mod grants;
mod groups;
pub(crate) mod maintain;
mod seek;
mod streams;

use pgrx::prelude::*;
use pgrx::spi::SpiClient;

use crate::access;
use crate::error::Result;
use crate::group::{self, GroupRef};
use crate::locks;
use crate::statement::Access;

/// Runs an admin operation on group `group` of `stream`, as the owner.
pub fn admin_call<T>(
    stream: &str,
    group: &str,
    what: &str,
    f: impl FnOnce(&SpiClient<'_>, &GroupRef) -> Result<T>,
) -> Result<T> {
    admin_call_with(stream, group, what, false, f)
}

/// `admin_call` holding the group's lock exclusively (`seek`): every call on the group in
/// progress ends first, and the next ones wait.
pub fn exclusive_admin_call<T>(
    stream: &str,
    group: &str,
    what: &str,
    f: impl FnOnce(&SpiClient<'_>, &GroupRef) -> Result<T>,
) -> Result<T> {
    admin_call_with(stream, group, what, true, f)
}

fn admin_call_with<T>(
    stream: &str,
    group: &str,
    what: &str,
    exclusive: bool,
    f: impl FnOnce(&SpiClient<'_>, &GroupRef) -> Result<T>,
) -> Result<T> {
    access::as_owner(|caller| {
        Spi::connect_mut(|client| {
            caller.require_admin(client, what)?;
            // Read afresh, never remembered: an admin call changes what it reads.
            locks::stream_and_group(stream, group, exclusive);
            let group = group::find(client, stream, group, Access::Write)?;
            f(client, &group)
        })
    })
}
