//! Per-stream grants: `grant_stream`, `revoke_stream` (who may do what: src/access.rs).

use pgrx::pg_sys::{self, BuiltinOid::*};
use pgrx::prelude::*;
use pgrx::spi::SpiClient;

use crate::access::as_owner;
use crate::error::quoted;
use crate::error::{Result, StreamError};
use crate::statement::{Columns, Statement};
use crate::text::{RawText, Text};

const ROLE: Statement = Statement {
    name: "access_role",
    sql: "SELECT oid FROM pg_catalog.pg_roles WHERE rolname = pg_catalog.convert_from($1, pg_catalog.getdatabaseencoding())",
    params: &[BYTEAOID],
};

const GRANT: Statement = Statement {
    name: "access_grant",
    sql: "INSERT INTO sqlstreams.stream_grant (stream_id, grantee, privilege, group_name)
          VALUES ($1, $2, $3, $4) ON CONFLICT DO NOTHING RETURNING 1",
    params: &[INT8OID, OIDOID, TEXTOID, TEXTOID],
};

const REVOKE: Statement = Statement {
    name: "access_revoke",
    sql: "DELETE FROM sqlstreams.stream_grant
          WHERE stream_id = $1 AND grantee = $2 AND privilege = $3 AND group_name IS NOT DISTINCT FROM $4
          RETURNING 1",
    params: &[INT8OID, OIDOID, TEXTOID, TEXTOID],
};

/// A grant's arguments, checked: (stream id, role oid, privilege, group).
fn grant_args(
    client: &SpiClient<'_>,
    stream: &str,
    role: RawText<'_>,
    privilege: &str,
    group: Option<&str>,
) -> Result<(i64, pg_sys::Oid)> {
    let stream_id = crate::stream::lookup(client, stream)?.id;
    // By its bytes: a role name need not be ASCII, in a database whose encoding is not UTF8 either.
    let row = ROLE.run(client, 0, &[role.bytes().into()])?.first();
    let Some(oid) = (if row.is_empty() { None } else { row.value::<pg_sys::Oid>("oid")? }) else {
        return Err(StreamError::UnknownRole(role.kept(64).into_owned()));
    };
    match (privilege, group) {
        ("consume", _) | ("produce", None) => Ok((stream_id, oid)),
        ("produce", Some(_)) => Err(StreamError::invalid(
            "a produce grant covers the whole stream, not a group",
            "Pass group_name => NULL with 'produce'.",
        )),
        (other, _) => Err(StreamError::invalid(
            format!("privilege {} is not valid", quoted(Some(other))),
            "Pass 'produce' or 'consume'.",
        )),
    }
}

/// Lets `role` produce to `stream`, or consume as `group_name` (every group when NULL). Returns
/// false when the role already had that grant. Admins only.
#[pg_extern(volatile, parallel_unsafe, sql = false)]
fn grant_stream(
    stream: Option<Text<'_>>,
    role: Option<RawText<'_>>,
    privilege: Option<Text<'_>>,
    group_name: default!(Option<Text<'_>>, "NULL"),
) -> crate::error::SqlResult<bool> {
    Ok(change_grant(
        "grant_stream",
        "grant access to streams",
        &GRANT,
        stream.as_deref(),
        role,
        privilege.as_deref(),
        group_name.as_deref(),
    )?)
}

/// Takes back exactly one grant of `grant_stream`. Returns false when there was none. Admins
/// only.
#[pg_extern(volatile, parallel_unsafe, sql = false)]
fn revoke_stream(
    stream: Option<Text<'_>>,
    role: Option<RawText<'_>>,
    privilege: Option<Text<'_>>,
    group_name: default!(Option<Text<'_>>, "NULL"),
) -> crate::error::SqlResult<bool> {
    Ok(change_grant(
        "revoke_stream",
        "revoke access to streams",
        &REVOKE,
        stream.as_deref(),
        role,
        privilege.as_deref(),
        group_name.as_deref(),
    )?)
}

/// `grant_stream` or `revoke_stream` (`call`): the arguments checked, then `statement` (`GRANT`
/// or `REVOKE`) run as the owner for an admin; whether it changed a row.
fn change_grant(
    call: &'static str,
    what: &str,
    statement: &Statement,
    stream: Option<&str>,
    role: Option<RawText<'_>>,
    privilege: Option<&str>,
    group_name: Option<&str>,
) -> Result<bool> {
    crate::standby::refuse_writes(call)?;
    let stream = crate::names::validate_name("stream", stream)?;
    let role = crate::names::required("role", role, "such as 'billing_app'")?;
    let privilege = crate::names::required("privilege", privilege, "'produce' or 'consume'")?;
    let group = group_name.map(|g| crate::names::validate_name("group", Some(g))).transpose()?;
    as_owner(|caller| {
        Spi::connect_mut(|client| {
            caller.require_admin(client, what)?;
            let (stream_id, oid) = grant_args(client, stream, role, privilege, group)?;
            Ok(!statement.run(client, 0, &[stream_id.into(), oid.into(), privilege.into(), group.into()])?.is_empty())
        })
    })
}
