//! Typed calls for operators: every operation and inspection function of the extension's SQL
//! API (its `docs/sql-api.md`, "Operations" and "Inspection functions"), one call each, with
//! the extension's refusals mapped to [`Error`](crate::Error) variants as every client call
//! maps them. What each call changes, locks and needs is the SQL function's; the role the
//! client connects as needs the right each call needs (most of these are admin calls).

mod inspect;

use std::time::{Duration, SystemTime};

use tokio_postgres::types::ToSql;

pub use inspect::{
    BlockedKey, DeadMessage, FenceHolder, GroupInfo, GroupStatus, MaintainReport, OpenLease, PeekedMessage, StreamInfo,
};

use crate::error::Result;
use crate::pool::Pool;
use crate::Concurrency;

/// The operator's handle, from [`Client::admin`](crate::Client::admin). Cheap to clone.
#[derive(Clone)]
pub struct Admin {
    pool: Pool,
}

/// What a grant allows (`sqlstreams.grant_stream`'s `privilege`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Privilege {
    /// Producing to the stream.
    Produce,
    /// Consuming as a group of the stream (one named group, or every group).
    Consume,
}

/// Where [`Admin::seek`] moves a group: the position P whose later messages it receives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SeekTo {
    /// P is this id (at most the stream's head).
    Id(i64),
    /// P is the last message produced before this time (0 when there is none).
    Time(SystemTime),
}

/// What a group does with the later messages of a key whose message went dead.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnDead {
    /// They run (the default).
    Release,
    /// The key stops until the dead letter is redriven or skipped.
    Hold,
}

/// Stream settings to change with [`Admin::alter_stream`]; `None` leaves one as it is.
#[derive(Clone, Debug, Default)]
pub struct StreamChanges {
    /// How long dead and superseded rows are kept.
    pub dead_retention: Option<Duration>,
    /// How long an idempotency key suppresses a repeat.
    pub idempotency_ttl: Option<Duration>,
    /// The age bound; `Duration::ZERO` removes it.
    pub max_age: Option<Duration>,
    /// The size bound in bytes; 0 removes it.
    pub max_bytes: Option<i64>,
}

/// Group settings to change with [`Admin::alter_group`]; `None` leaves one as it is.
#[derive(Clone, Debug, Default)]
pub struct GroupChanges {
    /// `Some(None)` removes the override: each message's own request applies.
    pub concurrency_override: Option<Option<Concurrency>>,
    /// Failures before a message goes dead.
    pub max_retries: Option<i32>,
    /// The first retry's backoff.
    pub backoff_base: Option<Duration>,
    /// The longest backoff.
    pub backoff_cap: Option<Duration>,
    /// How fast the backoff grows.
    pub backoff_exponent: Option<f64>,
    /// Delays a message may ask for before it goes dead. "No limit" cannot be set back here
    /// (as with `alter_group`): declare the group again for that.
    pub max_delays: Option<i32>,
    /// Times an expired range is handed out again before its messages are quarantined.
    pub max_reclaims: Option<i32>,
    /// What a dead letter does to its key's later messages.
    pub on_dead: Option<OnDead>,
    /// The most messages in flight across the group's consumers; 0 removes the cap.
    pub max_inflight: Option<i32>,
}

fn secs(d: Option<Duration>) -> Option<f64> {
    d.map(|d| d.as_secs_f64())
}

impl Admin {
    pub(crate) fn new(pool: Pool) -> Self {
        Admin { pool }
    }

    /// Runs `sql` and returns its one row's first column.
    async fn one<T>(&self, sql: &str, params: &[&(dyn ToSql + Sync)]) -> Result<T>
    where
        T: for<'a> tokio_postgres::types::FromSql<'a>,
    {
        let conn = self.pool.conn().await?;
        Ok(conn.query_one(sql, params).await?.get(0))
    }

    async fn rows(&self, sql: &str, params: &[&(dyn ToSql + Sync)]) -> Result<Vec<tokio_postgres::Row>> {
        let conn = self.pool.conn().await?;
        Ok(conn.query(sql, params).await?)
    }

    /// Drops the stream, its tables, groups and grants; false when there is none of that name.
    pub async fn drop_stream(&self, name: &str) -> Result<bool> {
        self.one("SELECT sqlstreams.drop_stream($1)", &[&name]).await
    }

    /// Drops the group with its cursor, leases and exception queue; false when the stream has
    /// no group of that name.
    pub async fn drop_group(&self, stream: &str, group: &str) -> Result<bool> {
        self.one("SELECT sqlstreams.drop_group($1, $2)", &[&stream, &group]).await
    }

    /// Changes the settings given in `changes`, the others kept; returns true.
    pub async fn alter_stream(&self, name: &str, changes: StreamChanges) -> Result<bool> {
        let sql = "SELECT sqlstreams.alter_stream($1,
                     dead_retention => $2::float8 * interval '1 second',
                     idempotency_ttl => $3::float8 * interval '1 second',
                     max_age => $4::float8 * interval '1 second', max_bytes => $5)";
        let (dead, ttl, age) = (secs(changes.dead_retention), secs(changes.idempotency_ttl), secs(changes.max_age));
        self.one(sql, &[&name, &dead, &ttl, &age, &changes.max_bytes]).await
    }

    /// Changes the settings given in `changes`, the others kept; returns true.
    pub async fn alter_group(&self, stream: &str, group: &str, changes: GroupChanges) -> Result<bool> {
        let sql = "SELECT sqlstreams.alter_group($1, $2, concurrency_override => $3, max_retries => $4,
                     backoff_base => $5::float8 * interval '1 second', backoff_cap => $6::float8 * interval '1 second',
                     backoff_exponent => $7, max_delays => $8, max_reclaims => $9, on_dead => $10,
                     max_inflight => $11)";
        let policy = changes.concurrency_override.map(|p| p.map_or("none", Concurrency::as_str));
        let on_dead = changes.on_dead.map(|o| match o {
            OnDead::Release => "release",
            OnDead::Hold => "hold",
        });
        let (base, cap) = (secs(changes.backoff_base), secs(changes.backoff_cap));
        let params: [&(dyn ToSql + Sync); 11] = [
            &stream,
            &group,
            &policy,
            &changes.max_retries,
            &base,
            &cap,
            &changes.backoff_exponent,
            &changes.max_delays,
            &changes.max_reclaims,
            &on_dead,
            &changes.max_inflight,
        ];
        self.one(sql, &params).await
    }

    /// Stops the group's claims from handing anything out; false when it was paused already.
    pub async fn pause_group(&self, stream: &str, group: &str) -> Result<bool> {
        self.one("SELECT sqlstreams.pause_group($1, $2)", &[&stream, &group]).await
    }

    /// Lets a paused group's claims hand out messages again; false when it was not paused.
    pub async fn resume_group(&self, stream: &str, group: &str) -> Result<bool> {
        self.one("SELECT sqlstreams.resume_group($1, $2)", &[&stream, &group]).await
    }

    /// Makes dead letters (these ids, or every one with `None`) run again; returns the ids
    /// redriven.
    pub async fn redrive(&self, stream: &str, group: &str, ids: Option<&[i64]>) -> Result<Vec<i64>> {
        self.one("SELECT sqlstreams.redrive($1, $2, $3)", &[&stream, &group, &ids]).await
    }

    /// Resolves a dead letter for good, releasing its key; false when it is not a dead letter.
    pub async fn skip(&self, stream: &str, group: &str, message_id: i64) -> Result<bool> {
        self.one("SELECT sqlstreams.skip($1, $2, $3)", &[&stream, &group, &message_id]).await
    }

    /// Deletes the dead letters that died more than `older_than` ago (`Duration::ZERO`: all);
    /// returns how many.
    pub async fn purge_dead(&self, stream: &str, group: &str, older_than: Duration) -> Result<i64> {
        let sql = "SELECT sqlstreams.purge_dead($1, $2, $3::float8 * interval '1 second')";
        self.one(sql, &[&stream, &group, &older_than.as_secs_f64()]).await
    }

    /// Moves the group to P (ending its open ranges, clearing its exception queue); returns P.
    pub async fn seek(&self, stream: &str, group: &str, to: SeekTo) -> Result<i64> {
        let (id, time) = match to {
            SeekTo::Id(id) => (Some(id), None),
            SeekTo::Time(t) => (None, Some(t)),
        };
        self.one("SELECT sqlstreams.seek($1, $2, to_id => $3, to_time => $4)", &[&stream, &group, &id, &time]).await
    }

    /// Lets `role` produce to `stream`, or consume as `group` (`None`: every group); false when
    /// it had exactly that grant.
    pub async fn grant(&self, stream: &str, role: &str, privilege: Privilege, group: Option<&str>) -> Result<bool> {
        let sql = "SELECT sqlstreams.grant_stream($1, $2, $3, $4)";
        self.one(sql, &[&stream, &role, &privilege.as_str(), &group]).await
    }

    /// Takes back exactly one grant; false when there was none.
    pub async fn revoke(&self, stream: &str, role: &str, privilege: Privilege, group: Option<&str>) -> Result<bool> {
        let sql = "SELECT sqlstreams.revoke_stream($1, $2, $3, $4)";
        self.one(sql, &[&stream, &role, &privilege.as_str(), &group]).await
    }

    /// Ends a lease now: its messages are handed out again. False when no lease has the token,
    /// and for a token no consumer holds (`OpenLease::held_by_a_consumer`): that work has
    /// expired already, and goes to the next claim of its lane.
    pub async fn break_lease(&self, stream: &str, group: &str, token: uuid::Uuid) -> Result<bool> {
        self.one("SELECT sqlstreams.break_lease($1, $2, $3)", &[&stream, &group, &token]).await
    }

    /// One maintenance pass over every stream (what the worker runs), one report per stream.
    pub async fn maintain(&self) -> Result<Vec<MaintainReport>> {
        let rows = self.rows("SELECT * FROM sqlstreams.maintain()", &[]).await?;
        Ok(rows.iter().map(MaintainReport::from_row).collect())
    }

    /// [`Admin::maintain`] for one stream.
    pub async fn maintain_stream(&self, name: &str) -> Result<Vec<MaintainReport>> {
        let rows = self.rows("SELECT * FROM sqlstreams.maintain_stream($1)", &[&name]).await?;
        Ok(rows.iter().map(MaintainReport::from_row).collect())
    }
}

impl Privilege {
    fn as_str(self) -> &'static str {
        match self {
            Privilege::Produce => "produce",
            Privilege::Consume => "consume",
        }
    }
}
