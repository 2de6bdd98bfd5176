//! What a consumer can do with a lease besides recording outcomes: extend it while handlers are
//! still running (a heartbeat), and release deliveries it will not start (shutdown, or a lease
//! too short for the handler's timeout) without spending an attempt.
//!
//! Both take their locks as outcomes do (docs/semantics.md, "One lock order").

use pgrx::pg_sys::BuiltinOid::*;
use pgrx::prelude::*;

use pgrx::spi::SpiClient;

use crate::access;
use crate::clock;
use crate::commit::consumer_call;
use crate::error::{Result, SqlResult};
use crate::exception_queue;
use crate::group::{self, GroupRef};
use crate::locks;
use crate::names::{self, positive_micros, Answer};
use crate::notify;
use crate::outcome;
use crate::range;
use crate::statement::{self, Access, Columns, Statement};
use crate::text::Text;
use crate::token;

/// Locks everything `token` holds, so the new expiry is computed after any wait for it.
const LOCK_HELD: Statement = Statement {
    name: "lease_lock_held",
    sql: "WITH r AS (SELECT 1 FROM sqlstreams.range_lease_@id@
                     WHERE consumer_group_id = $1 AND lease_token = $2 FOR UPDATE),
               e AS (SELECT 1 FROM sqlstreams.exception_queue_@id@
                     WHERE consumer_group_id = $1 AND lease_token = $2 AND status = 'inflight' FOR UPDATE),
               k AS (SELECT 1 FROM sqlstreams.lane_@id@
                     WHERE consumer_group_id = $1 AND held_by = $2 FOR UPDATE)
          SELECT (SELECT count(*) FROM r) + (SELECT count(*) FROM e) + (SELECT count(*) FROM k)",
    params: &[INT8OID, UUIDOID],
};

/// Sets the expiry of what `$2` holds to `$3`; with `$4`, only of what has not expired by `$4`.
const EXTEND: Statement = Statement {
    name: "lease_extend",
    sql: "WITH r AS (UPDATE sqlstreams.range_lease_@id@ SET lease_expires_at = $3
                     WHERE consumer_group_id = $1 AND lease_token = $2
                       AND ($4::timestamptz IS NULL OR lease_expires_at > $4) RETURNING 1),
               e AS (UPDATE sqlstreams.exception_queue_@id@ SET lease_expires_at = $3
                     WHERE consumer_group_id = $1 AND lease_token = $2 AND status = 'inflight'
                       AND ($4::timestamptz IS NULL OR lease_expires_at > $4) RETURNING 1),
               k AS (UPDATE sqlstreams.lane_@id@ SET held_until = $3
                     WHERE consumer_group_id = $1 AND held_by = $2
                       AND ($4::timestamptz IS NULL OR held_until > $4) RETURNING 1)
          SELECT (SELECT count(*) FROM r) + (SELECT count(*) FROM e) + (SELECT count(*) FROM k) AS held",
    params: &[INT8OID, UUIDOID, TIMESTAMPTZOID, TIMESTAMPTZOID],
};

/// Moves every expiry under `token` to now + `lease`; false when nothing is held any more. In a
/// capped group, what expired is lost: another claim may have been given its room
/// (src/inflight_cap.rs).
pub fn extend(stream: &str, group_name: &str, token: pgrx::Uuid, lease_micros: i64) -> Result<bool> {
    consumer_call(stream, group_name, |client, group| {
        set_expiry(client, group, token, lease_micros, group.max_inflight.is_some())
    })
}

fn set_expiry(
    client: &SpiClient<'_>,
    group: &GroupRef,
    token: pgrx::Uuid,
    lease_micros: i64,
    unexpired_only: bool,
) -> Result<bool> {
    if token::is_no_ones(token) {
        return Ok(false);
    }
    locks::token(token);
    LOCK_HELD.run(client, group.stream.id, &[group.id.into(), token.into()])?;
    let now = clock::now();
    let expires = now.saturating_add(lease_micros);
    let args = [
        group.id.into(),
        token.into(),
        statement::timestamptz(expires),
        statement::timestamptz_opt(unexpired_only.then_some(now)),
    ];
    let held: i64 = EXTEND.run(client, group.stream.id, &args)?.first().required("held")?;
    Ok(held > 0)
}

/// Ends every lease under `token` now, as if it had run out: the next claim takes its work
/// over (a consumer that hangs on to a lease it will never resolve). Admins only.
pub fn break_now(stream: &str, group_name: &str, token: pgrx::Uuid) -> Result<bool> {
    access::as_owner(|caller| {
        Spi::connect_mut(|client| {
            caller.require_admin(client, "break leases")?;
            let group = group::lookup(client, stream, group_name, Access::Write)?;
            let broken = set_expiry(client, &group, token, 0, false)?;
            if broken {
                notify::signal(group.stream.id);
            }
            Ok(broken)
        })
    })
}

/// Gives deliveries back unstarted (src/exception_queue/lifecycle.rs, `give_back`). Returns the
/// ids released.
pub fn release(stream: &str, group_name: &str, token: pgrx::Uuid, ids: &[i64]) -> Result<Vec<i64>> {
    consumer_call(stream, group_name, |client, group| {
        if token::is_no_ones(token) {
            return Ok(vec![]);
        }
        let stream_id = group.stream.id;
        locks::token(token);
        let mut ranges = range::for_token(client, stream_id, group.id, token)?;
        // Given-back rows are due at once: a clock read before a wait only makes them due sooner.
        let now = clock::now();
        let given = exception_queue::give_back(client, group, token, ids, &mut ranges, now)?;
        ranges.store(client, stream_id, group.id)?;
        let keys = exception_queue::distinct_keys(given.iter().map(|(_, k)| k));
        outcome::settle(client, group, token, &keys, now, outcome::Signal::Now, None)?;
        let mut ids: Vec<i64> = given.into_iter().map(|(id, _)| id).collect();
        ids.sort_unstable();
        Ok(ids)
    })
}

/// Extends every lease held under lease_token (its range, exception-queue deliveries and its
/// lane) to now + lease. Returns false when the token holds nothing any more (its
/// lease was taken over, or everything was resolved).
#[pg_extern(volatile, parallel_unsafe, sql = false)]
fn extend_lease(
    stream: Option<Text<'_>>,
    group_name: Option<Text<'_>>,
    lease_token: Option<pgrx::Uuid>,
    lease: default!(Option<Interval>, "'30 seconds'"),
) -> SqlResult<bool> {
    crate::standby::refuse_writes("extend_lease")?;
    let a = Answer::validate(stream.as_deref(), group_name.as_deref(), lease_token)?;
    let lease =
        crate::settings::check_lease("lease", positive_micros("lease", lease.map(|l| l.as_micros()), "'30 seconds'")?)?;
    Ok(extend(a.stream, a.group, a.token, lease)?)
}

/// Gives claimed deliveries back without running them (for a consumer shutting down): each is
/// due again at once and its attempt is not counted. Returns the ids released; an id the token
/// no longer holds (its lease lost, an outcome recorded, or deferred by the server behind a
/// predecessor that failed) is left out.
#[pg_extern(volatile, parallel_unsafe, name = "release", sql = false)]
fn release_sql(
    stream: Option<Text<'_>>,
    group_name: Option<Text<'_>>,
    lease_token: Option<pgrx::Uuid>,
    message_ids: Option<Vec<Option<i64>>>,
) -> SqlResult<Vec<i64>> {
    crate::standby::refuse_writes("release")?;
    let a = Answer::validate(stream.as_deref(), group_name.as_deref(), lease_token)?;
    Ok(release(a.stream, a.group, a.token, &names::message_ids("message_ids", message_ids)?)?)
}

/// Ends every lease held under lease_token now (its range, exception-queue deliveries and lane
/// holds), so the next claim takes the work over. Returns false when the token holds nothing.
/// For admins: a consumer that hangs on to work it will never finish.
#[pg_extern(volatile, parallel_unsafe, sql = false)]
fn break_lease(
    stream: Option<Text<'_>>,
    group_name: Option<Text<'_>>,
    lease_token: Option<pgrx::Uuid>,
) -> SqlResult<bool> {
    crate::standby::refuse_writes("break_lease")?;
    let a = Answer::validate(stream.as_deref(), group_name.as_deref(), lease_token)?;
    Ok(break_now(a.stream, a.group, a.token)?)
}
