//! Creating, changing and dropping consumer groups: `create_group`, `alter_group`,
//! `drop_group`, `pause_group`, `resume_group`.

use pgrx::pg_sys::panic::ErrorReport;
use pgrx::pg_sys::BuiltinOid::*;
use pgrx::prelude::*;
use pgrx::spi::SpiClient;
use pgrx::PgSqlErrorCode;

use crate::access::{self, Right};
use crate::admin::admin_call;
use crate::backoff::Backoff;
use crate::concurrency::Concurrency;
use crate::error::{named, quoted, Result, SqlResult, StreamError};
use crate::group::{group_from, lookup_exclusive, settings_columns, GroupRef};
use crate::lanes;
use crate::names::{positive_micros, seconds, validate_name, StartAt};
use crate::statement::{Columns, Statement};
use crate::stream;
use crate::text::{sendable, Text};

/// A new group (`$1` the stream, `$2` the name, `$3` ... `$9` its settings as `GroupSettings::args`
/// passes them); no row when the stream has one of that name: two consumers declaring a new group
/// at once then find each other's row, the second one waiting for the first to commit.
const INSERT: Statement = Statement {
    name: "group_insert",
    sql: "INSERT INTO sqlstreams.consumer_group
              (stream_id, name, concurrency_override, max_retries, backoff_base, backoff_cap,
               backoff_exponent, max_delays, max_reclaims)
          VALUES ($1, $2, $3, $4, make_interval(secs => $5 / 1e6), make_interval(secs => $6 / 1e6), $7, $8, $9)
          ON CONFLICT (stream_id, name) DO NOTHING
          RETURNING id",
    params: &[INT8OID, TEXTOID, TEXTOID, INT4OID, INT8OID, INT8OID, FLOAT8OID, INT4OID, INT4OID],
};

/// Group `$2` of stream `$1` with the settings a declaration sets (intervals in microseconds),
/// its row locked as an update of it locks it (the row's only lock: docs/semantics.md, "One lock
/// order"), so that a declaration committed meanwhile is the one compared with.
const DECLARED: Statement = Statement {
    name: "group_declared",
    sql: "SELECT id, concurrency_override, max_retries,
                 (extract(epoch FROM backoff_base) * 1000000)::int8 AS backoff_base,
                 (extract(epoch FROM backoff_cap) * 1000000)::int8 AS backoff_cap,
                 backoff_exponent, max_delays, max_reclaims
          FROM sqlstreams.consumer_group WHERE stream_id = $1 AND name = $2
          FOR NO KEY UPDATE",
    params: &[INT8OID, TEXTOID],
};

/// Group `$1`'s settings as a declaration sets them (`$2` ... `$8` as `INSERT`'s `$3` ... `$9`).
const REDECLARE: Statement = Statement {
    name: "group_redeclare",
    sql: "UPDATE sqlstreams.consumer_group SET
              concurrency_override = $2, max_retries = $3,
              backoff_base = make_interval(secs => $4 / 1e6), backoff_cap = make_interval(secs => $5 / 1e6),
              backoff_exponent = $6, max_delays = $7, max_reclaims = $8
          WHERE id = $1",
    params: &[INT8OID, TEXTOID, INT4OID, INT8OID, INT8OID, FLOAT8OID, INT4OID, INT4OID],
};

/// A new group's cursor, at the beginning or at the head; every id at or below it counts as
/// handed out (with `start_at => 'head'`, messages up to the head are not for it). Its fence
/// proves nothing yet: ids below the head may belong to producers still open, and a seek back
/// must not claim past them (the group's first claims prove what is safe, src/fence.rs).
const PLACE_CURSOR: Statement = Statement {
    name: "group_place_cursor",
    sql: concat!(
        "INSERT INTO sqlstreams.cursor_@id@ (consumer_group_id, claimed, committed, fence_safe)
         SELECT $1, h.head, h.head, 0
         FROM (SELECT CASE WHEN $2 THEN ",
        crate::cursor::head_sql!(),
        " ELSE 0 END AS head) h
         RETURNING claimed"
    ),
    params: &[INT8OID, BOOLOID],
};

const DELETE: Statement = Statement {
    name: "group_delete",
    sql: "WITH c AS (DELETE FROM sqlstreams.cursor_@id@ WHERE consumer_group_id = $1),
               r AS (DELETE FROM sqlstreams.range_lease_@id@ WHERE consumer_group_id = $1),
               d AS (DELETE FROM sqlstreams.range_done_@id@ WHERE consumer_group_id = $1),
               e AS (DELETE FROM sqlstreams.exception_queue_@id@ WHERE consumer_group_id = $1),
               l AS (DELETE FROM sqlstreams.lane_@id@ WHERE consumer_group_id = $1)
          DELETE FROM sqlstreams.consumer_group WHERE id = $1",
    params: &[INT8OID],
};

/// `BY_ID`, locking the row (`alter_group` changes it next).
const LOCK_BY_ID: Statement = Statement {
    name: "group_lock_by_id",
    sql: concat!("SELECT ", settings_columns!(), " FROM sqlstreams.consumer_group g WHERE g.id = $1 FOR NO KEY UPDATE"),
    params: &[INT8OID],
};

/// `group` as its row says once this transaction has locked it.
fn locked(client: &SpiClient<'_>, group: &GroupRef) -> Result<GroupRef> {
    let row = LOCK_BY_ID.run(client, 0, &[group.id.into()])?.first();
    if row.is_empty() {
        return Err(StreamError::Internal(format!("consumer group {} disappeared", group.id)));
    }
    group_from(&row, group.stream.clone(), group.id)
}

/// A group's settings, validated.
#[derive(Clone, Debug)]
pub struct GroupSettings {
    pub concurrency_override: Option<Concurrency>,
    pub max_retries: i32,
    pub start_at: StartAt,
    pub backoff: Backoff,
    pub max_delays: Option<i32>,
    pub max_reclaims: i32,
}

impl GroupSettings {
    /// The settings as statement parameters, in the order `INSERT` (after the stream and the name),
    /// `REDECLARE` and `ALTER` (after the id) take them.
    fn args<'a>(&self) -> [pgrx::datum::DatumWithOid<'a>; 7] {
        [
            self.concurrency_override.map(Concurrency::as_str).into(),
            self.max_retries.into(),
            self.backoff.base_micros.into(),
            self.backoff.cap_micros.into(),
            self.backoff.exponent.into(),
            self.max_delays.into(),
            self.max_reclaims.into(),
        ]
    }
}

/// Creates the group (placing its cursor) or updates the settings of the existing one, saying
/// what it changed.
pub fn create(stream_name: &str, name: &str, settings: &GroupSettings) -> Result<i64> {
    access::as_owner(|caller| {
        Spi::connect_mut(|client| {
            // The stream's lock and the group's, shared, as every call that changes a group takes
            // them before its rows (docs/semantics.md, "One lock order"): a drop_group then waits
            // for this transaction instead of locking the group's row first. (A seek or drop of the
            // group later in a transaction that declared it upgrades the lock: "Outside this
            // argument" there.)
            crate::locks::stream_and_group(stream_name, name, false);
            let stream = stream::lookup(client, stream_name)?;
            caller.require(client, stream.id, stream_name, Right::Consume(name))?;
            // The stored row first, and an insert only when there is none: an insert fires the
            // catalog's trigger (an invalidation for every backend) even when it conflicts. Twice
            // at most: a declaration that inserted the group since the read, which the insert
            // waited for, is found on the second turn.
            for _ in 0..2 {
                let row = DECLARED.run(client, 0, &[stream.id.into(), name.into()])?.first();
                if !row.is_empty() {
                    let id: i64 = row.required("id")?;
                    let changes = changes(&row, settings)?;
                    if !changes.is_empty() {
                        let args = [id.into()].into_iter().chain(settings.args()).collect::<Vec<_>>();
                        REDECLARE.run(client, 0, &args)?;
                        said_changed(stream_name, name, &changes);
                    }
                    return Ok(id);
                }
                let args = [stream.id.into(), name.into()].into_iter().chain(settings.args()).collect::<Vec<_>>();
                let inserted = INSERT.run(client, 0, &args)?.first();
                if !inserted.is_empty() {
                    let id: i64 = inserted.required("id")?;
                    let start: i64 = PLACE_CURSOR
                        .run(client, stream.id, &[id.into(), (settings.start_at == StartAt::Head).into()])?
                        .first()
                        .required("claimed")?;
                    lanes::create(client, stream.id, id, stream.lanes, start)?;
                    return Ok(id);
                }
            }
            Err(StreamError::Internal(format!("consumer group {} neither inserted nor found", named(name))))
        })
    })
}

/// What a declaration with `settings` changes of a group's stored ones (`DECLARED`'s row): one
/// line per setting, old to new, as the arguments would be written (intervals in seconds).
fn changes<R: Columns>(row: &R, settings: &GroupSettings) -> Result<Vec<String>> {
    let mut changes = vec![];
    let mut compare = |name: &str, old: String, new: String| {
        if old != new {
            changes.push(format!("{name} {old} to {new}"));
        }
    };
    let policy = settings.concurrency_override.map(Concurrency::as_str);
    compare("concurrency_override", quoted(row.value::<String>("concurrency_override")?.as_deref()), quoted(policy));
    compare("max_retries", row.required::<i32>("max_retries")?.to_string(), settings.max_retries.to_string());
    let micros = |column: &str| row.required::<i64>(column).map(|m| seconds(m.into()));
    compare("backoff_base", micros("backoff_base")?, seconds(settings.backoff.base_micros.into()));
    compare("backoff_cap", micros("backoff_cap")?, seconds(settings.backoff.cap_micros.into()));
    compare(
        "backoff_exponent",
        row.required::<f64>("backoff_exponent")?.to_string(),
        settings.backoff.exponent.to_string(),
    );
    let limit = |n: Option<i32>| n.map_or("NULL".to_string(), |n| n.to_string());
    compare("max_delays", limit(row.value::<i32>("max_delays")?), limit(settings.max_delays));
    compare("max_reclaims", row.required::<i32>("max_reclaims")?.to_string(), settings.max_reclaims.to_string());
    Ok(changes)
}

/// A declaration that changed an existing group's settings says which, in a notice: one that omits
/// a setting sets it back to its default, which a consumer declaring the group with fewer
/// arguments than the others would otherwise do without a word.
fn said_changed(stream: &str, group: &str, changes: &[String]) {
    let message = format!(
        "sqlstreams: consumer group {} of stream {} declared again, with other settings: {}",
        named(group),
        named(stream),
        changes.join(", ")
    );
    let hint = "create_group sets every setting it is not given to its default; alter_group changes only the \
                settings it is given.";
    ErrorReport::new(PgSqlErrorCode::ERRCODE_SUCCESSFUL_COMPLETION, sendable(&message).into_owned(), "sqlstreams")
        .set_hint(hint)
        .report(PgLogLevel::NOTICE);
}

/// Drops a group with its cursor, leases and exception rows. False when it does not exist.
pub fn drop(stream: &str, name: &str) -> Result<bool> {
    access::as_owner(|caller| {
        Spi::connect_mut(|client| {
            caller.require_admin(client, "drop consumer groups")?;
            // The group's lock, exclusive, before its rows: it waits for every call on the
            // group in progress, and calls arriving now wait, then find the group gone.
            match lookup_exclusive(client, stream, name) {
                Ok(group) => {
                    DELETE.run(client, group.stream.id, &[group.id.into()])?;
                    Ok(true)
                }
                Err(StreamError::UnknownGroup { .. }) => Ok(false),
                Err(other) => Err(other),
            }
        })
    })
}

#[allow(clippy::too_many_arguments)]
fn settings(
    concurrency_override: Option<&str>,
    max_retries: Option<i32>,
    start_at: Option<&str>,
    backoff_base: Option<Interval>,
    backoff_cap: Option<Interval>,
    backoff_exponent: Option<f64>,
    max_delays: Option<i32>,
    max_reclaims: Option<i32>,
) -> Result<GroupSettings> {
    let concurrency_override =
        concurrency_override.map(|p| Concurrency::parse("concurrency_override", p)).transpose()?;
    let max_retries = match max_retries {
        Some(n) if n >= 0 => n,
        other => {
            return Err(StreamError::invalid(
                format!("max_retries {} is not valid", other.map_or("NULL".into(), |n| n.to_string())),
                "Pass zero or more retries (3 means four runs in all).",
            ))
        }
    };
    let start_at = StartAt::parse(start_at)?;
    let base = positive_micros("backoff_base", backoff_base.map(|i| i.as_micros()), "'1 second'")?;
    let cap = positive_micros("backoff_cap", backoff_cap.map(|i| i.as_micros()), "'5 minutes'")?;
    if cap < base {
        return Err(StreamError::invalid(
            format!("backoff_cap {} is shorter than backoff_base {}", seconds(cap.into()), seconds(base.into())),
            "Pass a backoff_cap at least as long as backoff_base.",
        ));
    }
    let exponent = match backoff_exponent {
        Some(e) if e.is_finite() && e >= 1.0 => e,
        other => {
            return Err(StreamError::invalid(
                format!("backoff_exponent {} is not valid", other.map_or("NULL".into(), |e| e.to_string())),
                "Pass a growth factor of at least 1, such as 2.",
            ))
        }
    };
    if let Some(n) = max_delays.filter(|n| *n < 0) {
        return Err(StreamError::invalid(
            format!("max_delays {n} is negative"),
            "Pass zero or more delays, or NULL for no limit.",
        ));
    }
    let max_reclaims = match max_reclaims {
        Some(n) if n >= 0 => n,
        other => {
            return Err(StreamError::invalid(
                format!("max_reclaims {} is not valid", other.map_or("NULL".into(), |n| n.to_string())),
                "Pass how many times an expired range may be handed out again, such as 2.",
            ))
        }
    };
    Ok(GroupSettings {
        concurrency_override,
        max_retries,
        start_at,
        backoff: Backoff { base_micros: base, cap_micros: cap, exponent },
        max_delays,
        max_reclaims,
    })
}

/// Creates a consumer group on a stream and returns its id. Declaring it again returns the same
/// id and updates its settings; the cursor is placed only when the group is created
/// (`start_at`: 'beginning' or 'head').
#[pg_extern(volatile, parallel_unsafe, sql = false)]
#[allow(clippy::too_many_arguments)]
fn create_group(
    stream: Option<Text<'_>>,
    name: Option<Text<'_>>,
    concurrency_override: default!(Option<Text<'_>>, "NULL"),
    max_retries: default!(Option<i32>, 3),
    start_at: default!(Option<Text<'_>>, "'beginning'"),
    backoff_base: default!(Option<Interval>, "'1 second'"),
    backoff_cap: default!(Option<Interval>, "'5 minutes'"),
    backoff_exponent: default!(Option<f64>, 2.0),
    max_delays: default!(Option<i32>, "NULL"),
    max_reclaims: default!(Option<i32>, 2),
) -> SqlResult<i64> {
    crate::standby::refuse_writes("create_group")?;
    let stream = validate_name("stream", stream.as_deref())?;
    let name = validate_name("group", name.as_deref())?;
    let settings = settings(
        concurrency_override.as_deref(),
        max_retries,
        start_at.as_deref(),
        backoff_base,
        backoff_cap,
        backoff_exponent,
        max_delays,
        max_reclaims,
    )?;
    Ok(create(stream, name, &settings)?)
}

/// Drops a consumer group with its cursor, leases and exception queue rows. Returns false when
/// the stream has no such group.
#[pg_extern(volatile, parallel_unsafe, sql = false)]
fn drop_group(stream: Option<Text<'_>>, name: Option<Text<'_>>) -> SqlResult<bool> {
    crate::standby::refuse_writes("drop_group")?;
    let stream = validate_name("stream", stream.as_deref())?;
    let name = validate_name("group", name.as_deref())?;
    Ok(drop(stream, name)?)
}

const ALTER: Statement = Statement {
    name: "group_alter",
    sql: "UPDATE sqlstreams.consumer_group g SET
              concurrency_override = $2, max_retries = $3,
              backoff_base = make_interval(secs => $4 / 1e6), backoff_cap = make_interval(secs => $5 / 1e6),
              backoff_exponent = $6, max_delays = $7, max_reclaims = $8, on_dead = $9, max_inflight = $10
          WHERE g.id = $1",
    params: &[INT8OID, TEXTOID, INT4OID, INT8OID, INT8OID, FLOAT8OID, INT4OID, INT4OID, TEXTOID, INT4OID],
};

/// Keys of a group's dead ordered messages (those a hold kept waiting).
const HELD_KEYS: Statement = Statement {
    name: "group_held_keys",
    sql: "SELECT DISTINCT message_key FROM sqlstreams.exception_queue_@id@
          WHERE consumer_group_id = $1 AND status = 'dead' AND concurrency = 'ordered' AND message_key IS NOT NULL",
    params: &[INT8OID],
};

const SET_PAUSED: Statement = Statement {
    name: "group_set_paused",
    sql: "UPDATE sqlstreams.consumer_group SET paused = $2 WHERE id = $1 AND paused <> $2 RETURNING id",
    params: &[INT8OID, BOOLOID],
};

/// Changes a group's settings: each argument that is not NULL replaces the current value
/// (`concurrency_override => 'none'` removes the override, `max_inflight => 0` the cap).
/// `create_group` re-declares a group
/// with every setting; this changes only what it is told to. Returns true. Admins only.
#[pg_extern(volatile, parallel_unsafe, sql = false)]
#[allow(clippy::too_many_arguments)]
fn alter_group(
    stream: Option<Text<'_>>,
    group_name: Option<Text<'_>>,
    concurrency_override: default!(Option<Text<'_>>, "NULL"),
    max_retries: default!(Option<i32>, "NULL"),
    backoff_base: default!(Option<Interval>, "NULL"),
    backoff_cap: default!(Option<Interval>, "NULL"),
    backoff_exponent: default!(Option<f64>, "NULL"),
    max_delays: default!(Option<i32>, "NULL"),
    max_reclaims: default!(Option<i32>, "NULL"),
    on_dead: default!(Option<Text<'_>>, "NULL"),
    max_inflight: default!(Option<i32>, "NULL"),
) -> SqlResult<bool> {
    crate::standby::refuse_writes("alter_group")?;
    if let Some(cap) = max_inflight.filter(|cap| *cap < 0) {
        return Err(StreamError::invalid(
            format!("max_inflight {cap} is negative"),
            "Pass the most messages the group may have in flight at once, or 0 to remove the cap.",
        )
        .into());
    }
    let stream = validate_name("stream", stream.as_deref())?;
    let group_name = validate_name("group", group_name.as_deref())?;
    let on_dead = match on_dead.as_deref() {
        None | Some("release") | Some("hold") => on_dead.as_deref(),
        Some(other) => {
            return Err(StreamError::invalid(
                format!("on_dead {} is not valid", crate::error::quoted(Some(other))),
                "Pass 'release' (a dead message releases its key) or 'hold' (an ordered key stops at it).",
            )
            .into())
        }
    };
    Ok(admin_call(stream, group_name, "alter consumer groups", |client, g| {
        // The settings as they are once the row is locked: another alter_group may have
        // committed while this one waited, and only what this one was told to change changes.
        let g = &locked(client, g)?;
        let micros = |i: Option<Interval>| i.map(|i| i.as_micros().clamp(i64::MIN as i128, i64::MAX as i128) as i64);
        let current_override = g.concurrency_override.map(Concurrency::as_str);
        let merged = settings(
            match concurrency_override.as_deref() {
                Some("none") => None,
                Some(c) => Some(c),
                None => current_override,
            },
            Some(max_retries.unwrap_or(g.max_retries)),
            Some("beginning"), // placement applies at creation only
            Some(Interval::from_micros(micros(backoff_base).unwrap_or(g.backoff.base_micros))),
            Some(Interval::from_micros(micros(backoff_cap).unwrap_or(g.backoff.cap_micros))),
            Some(backoff_exponent.unwrap_or(g.backoff.exponent)),
            max_delays.or(g.max_delays),
            Some(max_reclaims.unwrap_or(g.max_reclaims)),
        )?;
        let on_dead = on_dead.unwrap_or(if g.hold_on_dead { "hold" } else { "release" });
        let cap = max_inflight.map_or(g.max_inflight, |cap| Some(cap).filter(|cap| *cap > 0));
        let args = std::iter::once(g.id.into()).chain(merged.args()).chain([on_dead.into(), cap.into()]);
        ALTER.run(client, 0, &args.collect::<Vec<_>>())?;
        if g.max_inflight.is_some_and(|old| cap.is_none_or(|new| new > old)) {
            // More room, or no cap: consumers the cap left idle may claim now.
            crate::notify::signal(g.stream.id);
        }
        if g.hold_on_dead && on_dead == "release" {
            // Keys held at a dead message go on now: wake what waits behind them.
            let keys: Vec<Option<String>> = HELD_KEYS
                .run(client, g.stream.id, &[g.id.into()])?
                .map(|row| row.value("message_key"))
                .collect::<Result<_>>()?;
            let released = GroupRef { hold_on_dead: false, ..g.clone() };
            crate::exception_queue::after_resolution(
                client,
                &released,
                &crate::exception_queue::distinct_keys(&keys),
                crate::clock::now(),
                crate::exception_queue::Waker::Outcome,
            )?;
        }
        Ok(true)
    })?)
}

/// Pauses a group: its claims hand out nothing (outcomes of what it already holds still count)
/// until `resume_group`. Returns false when it was paused already. Admins only.
#[pg_extern(volatile, parallel_unsafe, sql = false)]
fn pause_group(stream: Option<Text<'_>>, group_name: Option<Text<'_>>) -> SqlResult<bool> {
    crate::standby::refuse_writes("pause_group")?;
    set_paused(stream.as_deref(), group_name.as_deref(), true)
}

/// Resumes a paused group. Returns false when it was not paused. Admins only.
#[pg_extern(volatile, parallel_unsafe, sql = false)]
fn resume_group(stream: Option<Text<'_>>, group_name: Option<Text<'_>>) -> SqlResult<bool> {
    crate::standby::refuse_writes("resume_group")?;
    set_paused(stream.as_deref(), group_name.as_deref(), false)
}

fn set_paused(stream: Option<&str>, group_name: Option<&str>, paused: bool) -> SqlResult<bool> {
    let stream = validate_name("stream", stream)?;
    let group_name = validate_name("group", group_name)?;
    Ok(admin_call(
        stream,
        group_name,
        if paused { "pause consumer groups" } else { "resume consumer groups" },
        |client, g| {
            let changed = !SET_PAUSED.run(client, 0, &[g.id.into(), paused.into()])?.is_empty();
            if changed && !paused {
                crate::notify::signal(g.stream.id);
            }
            Ok(changed)
        },
    )?)
}
