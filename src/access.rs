//! Who may do what: the extension's roles, per-stream grants, and running as the owner.
//!
//! Functions are revoked from PUBLIC and granted to three roles the install script creates:
//! `sqlstreams_admin` (streams, groups, grants, maintenance, breaking leases, everything),
//! `sqlstreams_producer` (produce) and `sqlstreams_consumer` (create_group, claim, outcomes,
//! inspection). Membership lets a role call the functions; what it may touch is granted per
//! stream by an admin (`grant_stream(stream, role, 'produce' | 'consume', group_name)`; a
//! consume grant without a group covers every group of the stream). Superusers and members of
//! `sqlstreams_admin` may touch everything; members of `pg_monitor` may inspect everything.
//!
//! The tables are the extension owner's and no other role may write them. So every function
//! checks the caller's right first and then runs its SQL as the owner (the way a SECURITY
//! DEFINER function does, but only after the check, which needs the caller's identity). Every
//! statement still runs with the function's pinned search_path, and nothing a caller passes is
//! ever SQL text.

use pgrx::pg_sys::{self, BuiltinOid::*};
use pgrx::prelude::*;
use pgrx::spi::SpiClient;

use crate::catalog;
use crate::error::{named, quoted};
use crate::error::{Result, StreamError};
use crate::statement::{Columns, Statement};
use crate::text::RawText;

/// What a call needs on a stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Right<'a> {
    Produce,
    /// Claims, outcomes and declaring the group: a consume grant on the group (or the stream).
    Consume(&'a str),
    /// Reading a group's state: a consume grant on it, or `pg_monitor`.
    Inspect(&'a str),
    /// Reading a stream's head or channel: any grant on the stream, or `pg_monitor`.
    Observe,
    /// Reading a stream's payloads (`peek`): a consume grant on any of its groups, or
    /// `pg_monitor` (a produce grant alone reads nothing back).
    ReadMessages,
}

impl Right<'_> {
    fn privilege(&self) -> &'static str {
        match self {
            Right::Produce => "produce",
            Right::Consume(_) | Right::Inspect(_) => "consume",
            Right::Observe => "any",
            Right::ReadMessages => "consume-any",
        }
    }

    fn group(&self) -> Option<&str> {
        match self {
            Right::Consume(group) | Right::Inspect(group) => Some(group),
            Right::Produce | Right::Observe | Right::ReadMessages => None,
        }
    }

    fn monitor_may(&self) -> bool {
        matches!(self, Right::Inspect(_) | Right::Observe | Right::ReadMessages)
    }
}

/// The role that called the function, captured before the switch to the owner.
#[derive(Clone, Copy, Debug)]
pub struct Caller {
    role: pg_sys::Oid,
}

const OWNER: Statement = Statement {
    name: "access_owner",
    sql: "SELECT extowner FROM pg_catalog.pg_extension WHERE extname = 'sqlstreams'",
    params: &[],
};

const MAY: Statement = Statement {
    name: "access_may",
    sql: "SELECT r.rolsuper
              OR pg_catalog.pg_has_role(r.oid, 'sqlstreams_admin', 'USAGE')
              OR ($4 AND pg_catalog.pg_has_role(r.oid, 'pg_monitor', 'USAGE'))
              OR EXISTS (SELECT 1 FROM sqlstreams.stream_grant g
                         WHERE g.stream_id = $2
                           AND ($3 = 'any' OR ($3 = 'consume-any' AND g.privilege = 'consume')
                                OR (g.privilege = $3 AND (g.group_name IS NULL OR g.group_name = $5)))
                           AND pg_catalog.pg_has_role(r.oid, g.grantee, 'USAGE')) AS may,
                 r.rolname::text AS rolname
          FROM pg_catalog.pg_roles r WHERE r.oid = $1",
    params: &[OIDOID, INT8OID, TEXTOID, BOOLOID, TEXTOID],
};

const ADMIN: Statement = Statement {
    name: "access_admin",
    sql: "SELECT r.rolsuper OR pg_catalog.pg_has_role(r.oid, 'sqlstreams_admin', 'USAGE') AS may,
                 r.rolname::text AS rolname
          FROM pg_catalog.pg_roles r WHERE r.oid = $1",
    params: &[OIDOID],
};

thread_local! {
    /// The extension's owner, until the catalog changes (src/catalog.rs).
    static OWNER_OF: catalog::Memo<(), pg_sys::Oid> = catalog::Memo::new();
    /// Rights granted, until the catalog or a role changes.
    static GRANTED: catalog::Memo<Granted, ()> = catalog::Memo::new();
}

/// What a remembered check answered: a role's right on a stream. Every input of `MAY` is in
/// it (inspection may pass on `pg_monitor` where a claim may not).
#[derive(PartialEq, Eq, Hash)]
struct Granted {
    role: pg_sys::Oid,
    stream_id: i64,
    privilege: &'static str,
    monitor_may: bool,
    group: Option<String>,
}

fn owner() -> Result<pg_sys::Oid> {
    let generation = catalog::generation();
    if let Some(owner) = OWNER_OF.with(|memo| memo.get(&(), generation)) {
        return Ok(owner);
    }
    let owner =
        Spi::connect(|client| -> Result<pg_sys::Oid> { OWNER.run(client, 0, &[])?.first().required("extowner") })?;
    OWNER_OF.with(|memo| memo.put((), generation, owner));
    Ok(owner)
}

/// Runs `f` as the extension's owner, for the role calling now. The caller's identity and
/// security context come back when `f` returns; an error aborts the (sub)transaction, and
/// Postgres restores them itself.
pub fn as_owner<T>(f: impl FnOnce(&Caller) -> Result<T>) -> Result<T> {
    let mut role = pg_sys::InvalidOid;
    let mut context = 0;
    // SAFETY: reads this backend's current user and security context.
    unsafe { pg_sys::GetUserIdAndSecContext(&mut role, &mut context) };
    let caller = Caller { role };
    let owner = owner()?;
    // SAFETY: switches the current user the way fmgr_security_definer does; a transaction or
    // subtransaction abort restores the saved identity, and so do we on return.
    unsafe { pg_sys::SetUserIdAndSecContext(owner, context | pg_sys::SECURITY_LOCAL_USERID_CHANGE as i32) };
    let result = f(&caller);
    // SAFETY: restores what was read above.
    unsafe { pg_sys::SetUserIdAndSecContext(role, context) };
    result
}

impl Caller {
    /// A superuser may do everything, without a catalog query.
    fn is_superuser(&self) -> bool {
        // SAFETY: a syscache lookup of a role's rolsuper.
        unsafe { pg_sys::superuser_arg(self.role) }
    }

    /// Refuses (42501) unless the caller holds `right` on stream `stream_id` (named `stream`).
    pub fn require(&self, client: &SpiClient<'_>, stream_id: i64, stream: &str, right: Right<'_>) -> Result<()> {
        if self.is_superuser() {
            return Ok(());
        }
        let generation = catalog::generation();
        let key = Granted {
            role: self.role,
            stream_id,
            privilege: right.privilege(),
            monitor_may: right.monitor_may(),
            group: right.group().map(str::to_string),
        };
        if GRANTED.with(|memo| memo.get(&key, generation)).is_some() {
            return Ok(());
        }
        let row = MAY
            .run(
                client,
                0,
                &[
                    self.role.into(),
                    stream_id.into(),
                    right.privilege().into(),
                    right.monitor_may().into(),
                    right.group().into(),
                ],
            )?
            .first();
        if row.value::<bool>("may")?.unwrap_or(false) {
            GRANTED.with(|memo| memo.put(key, generation, ()));
            return Ok(());
        }
        let role = role_name(&row)?;
        let (what, grant) = match right {
            Right::Produce => (format!("produce to stream {}", named(stream)), "'produce'".to_string()),
            Right::Consume(group) | Right::Inspect(group) => (
                format!("consume as group {} of stream {}", named(group), named(stream)),
                format!("'consume', {}", quoted(Some(group))),
            ),
            Right::Observe | Right::ReadMessages => (format!("read stream {}", named(stream)), "'consume'".to_string()),
        };
        Err(StreamError::PermissionDenied {
            message: format!("role {} may not {what}", named(&role.text)),
            hint: match role.literal() {
                Some(role) => {
                    format!("An admin grants it with sqlstreams.grant_stream({}, {role}, {grant}).", quoted(Some(stream)))
                }
                // A name from a database of another encoding, which no text here can spell.
                None => format!(
                    "This database cannot spell the role's name (it was created in a database of another encoding): \
                     an admin grants it to a role whose rights this one inherits, with sqlstreams.grant_stream({}, <that role>, {grant}).",
                    quoted(Some(stream))
                ),
            },
        })
    }

    /// Refuses (42501) unless the caller is a superuser or a member of `sqlstreams_admin`.
    pub fn require_admin(&self, client: &SpiClient<'_>, what: &str) -> Result<()> {
        if self.is_superuser() {
            return Ok(());
        }
        let row = ADMIN.run(client, 0, &[self.role.into()])?.first();
        if row.value::<bool>("may")?.unwrap_or(false) {
            return Ok(());
        }
        let role = role_name(&row)?;
        Err(StreamError::PermissionDenied {
            message: format!("role {} may not {what}", named(&role.text)),
            hint: "Ask an admin (a member of sqlstreams_admin) to do it, or to grant you that role.".into(),
        })
    }
}

/// The caller's role name, from the text column `rolname`, as messages show it. Read as bytes:
/// the catalog of roles is every database's, and a name holds the bytes of the database it was
/// created from, which may not be valid text here (pgrx's `String` would fail, or take them
/// unchecked in a UTF8 database).
fn role_name(row: &pgrx::spi::SpiTupleTable<'_>) -> Result<crate::text::Shown> {
    let Some(datum) = row.get_datum_by_ordinal(row.column_ordinal("rolname")?)? else {
        return Ok(crate::text::shown(b""));
    };
    // SAFETY: a text datum that is not NULL, valid while the row is; its bytes are copied by
    // `shown` before it returns.
    let bytes = unsafe { pgrx::varlena::varlena_to_byte_slice(pg_sys::pg_detoast_datum_packed(datum.cast_mut_ptr())) };
    Ok(crate::text::shown(bytes))
}

const MAY_SEE: Statement = Statement {
    name: "access_may_see",
    sql: "SELECT r.rolsuper
              OR pg_catalog.pg_has_role(r.oid, 'sqlstreams_admin', 'USAGE')
              OR pg_catalog.pg_has_role(r.oid, 'pg_monitor', 'USAGE')
              OR EXISTS (SELECT 1 FROM sqlstreams.stream_grant g
                         WHERE g.stream_id = $2
                           AND ($3 IS NULL OR g.group_name IS NULL
                                OR g.group_name = pg_catalog.convert_from($3, pg_catalog.getdatabaseencoding()))
                           AND ($3 IS NULL OR g.privilege = 'consume')
                           AND pg_catalog.pg_has_role(r.oid, g.grantee, 'USAGE')) AS may
          FROM pg_catalog.pg_roles r WHERE r.oid = $1",
    params: &[OIDOID, INT8OID, BYTEAOID],
};

/// Whether the calling role may see stream `stream_id` (any grant on it), or its group
/// `group_name` (a consume grant on it): the filter of the views, which never raise. The name
/// is the view's, read from the catalog, and compared as its bytes: a name this database cannot
/// read as UTF-8 (a restore's, src/text.rs) is not refused here, so a role never sees it in an
/// error from a row it may not see.
#[pg_extern(stable, parallel_safe, sql = false)]
fn visible(stream_id: Option<i64>, group_name: default!(Option<RawText<'_>>, "NULL")) -> crate::error::SqlResult<bool> {
    let Some(stream_id) = stream_id else { return Ok(false) };
    Ok(as_owner(|caller| {
        if caller.is_superuser() {
            return Ok(true);
        }
        Spi::connect(|client| {
            let row = MAY_SEE
                .read(client, 0, &[caller.role.into(), stream_id.into(), group_name.map(|g| g.bytes()).into()])?
                .first();
            Ok(row.value::<bool>("may")?.unwrap_or(false))
        })
    })?)
}
