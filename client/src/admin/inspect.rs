//! The inspection calls and the rows they return, column for column as the SQL functions and
//! views name them. Intervals come back as [`Duration`]s (read as seconds), times as
//! [`SystemTime`]s.

use std::time::{Duration, SystemTime};

use tokio_postgres::Row;

use super::Admin;
use crate::error::{Error, Result};
use crate::Concurrency;

/// A row of `sqlstreams.streams`.
#[derive(Clone, Debug, PartialEq)]
pub struct StreamInfo {
    /// The stream id; its tables are named with it.
    pub id: i64,
    /// The stream's name.
    pub name: String,
    /// The highest id handed out.
    pub head: i64,
    /// Lanes its messages are spread over.
    pub lanes: i32,
    /// Ids per log partition.
    pub partition_size: i64,
    /// How long an idempotency key suppresses a repeat.
    pub idempotency_ttl: Duration,
    /// How long dead and superseded rows are kept.
    pub dead_retention: Duration,
    /// The age bound, if any.
    pub max_age: Option<Duration>,
    /// The size bound in bytes, if any.
    pub max_bytes: Option<i64>,
    /// The extension version of its tables.
    pub schema_version: String,
    /// Its creation time.
    pub created_at: SystemTime,
}

/// A row of `sqlstreams.consumer_groups`: a group's settings and its [`GroupStatus`].
#[derive(Clone, Debug, PartialEq)]
pub struct GroupInfo {
    /// The group id.
    pub id: i64,
    /// Its stream.
    pub stream: String,
    /// Its name.
    pub name: String,
    /// The policy every message gets, if the group overrides the messages' own requests.
    pub concurrency_override: Option<Concurrency>,
    /// Failures before a message goes dead.
    pub max_retries: i32,
    /// Whether its claims hand out nothing.
    pub paused: bool,
    /// `"release"` or `"hold"`.
    pub on_dead: String,
    /// The most messages in flight across its consumers, if capped.
    pub max_inflight: Option<i32>,
    /// Its position and queue, as `group_status` reports them.
    pub status: GroupStatus,
}

/// `sqlstreams.group_status`: where a group stands.
#[derive(Clone, Debug, PartialEq)]
pub struct GroupStatus {
    /// Claimed up to this id.
    pub claimed: i64,
    /// Every message up to this id is resolved.
    pub committed: i64,
    /// The highest id handed out on the stream.
    pub head: i64,
    /// `head - committed`.
    pub lag: i64,
    /// Range leases open, including expired ranges no consumer holds any more.
    pub open_ranges: i64,
    /// Exception-queue rows ready to claim.
    pub ready: i64,
    /// Exception-queue rows claimed and not resolved, including expired deliveries no consumer
    /// holds any more.
    pub inflight: i64,
    /// Exception-queue rows waiting for a retry or a delay.
    pub deferred: i64,
    /// Dead letters kept.
    pub dead: i64,
    /// Rows superseded by compaction and kept.
    pub superseded: i64,
    /// When the oldest message the group has not resolved was produced.
    pub oldest_unresolved_at: Option<SystemTime>,
    /// Messages the stream's bounds dropped before the group consumed them.
    pub lost: i64,
    /// Log the group's position keeps on disk, in bytes.
    pub held_back_bytes: i64,
}

/// A row of `sqlstreams.blocked_keys`: the oldest unresolved row of a key.
#[derive(Clone, Debug, PartialEq)]
pub struct BlockedKey {
    /// The key.
    pub message_key: Option<String>,
    /// Its oldest unresolved message.
    pub oldest_message_id: i64,
    /// That row's status.
    pub status: String,
    /// Its attempts so far.
    pub attempts: i32,
    /// When it may run.
    pub can_run_after: Option<SystemTime>,
    /// Its last error.
    pub last_error: Option<String>,
    /// Unresolved rows of the key behind it.
    pub waiting_behind: i64,
}

/// A row of `sqlstreams.dead_messages`.
#[derive(Clone, Debug, PartialEq)]
pub struct DeadMessage {
    /// The message.
    pub message_id: i64,
    /// Its key.
    pub message_key: Option<String>,
    /// Its failed attempts.
    pub attempts: i32,
    /// Its delays.
    pub delays: i32,
    /// Its last error.
    pub last_error: Option<String>,
    /// When it went dead.
    pub died_at: Option<SystemTime>,
    /// Its payload (JSON).
    pub payload: Option<serde_json::Value>,
}

/// A row of `sqlstreams.open_leases`.
#[derive(Clone, Debug, PartialEq)]
pub struct OpenLease {
    /// `"range"`, `"exception"` (an inflight exception row) or `"lane"` (a lane a claim holds).
    pub kind: String,
    /// Its first message (none for a lane).
    pub first_id: Option<i64>,
    /// Its last message (none for a lane).
    pub last_id: Option<i64>,
    /// The key, for an exception row.
    pub message_key: Option<String>,
    /// The lease's token: the claim's, or one no consumer holds (`held_by_a_consumer`).
    pub lease_token: uuid::Uuid,
    /// When it expires.
    pub lease_expires_at: SystemTime,
    /// Messages without an outcome (none for a lane).
    pub pending: Option<i32>,
    /// Its lane (a range's or a lane's).
    pub lane: Option<i32>,
}

impl OpenLease {
    /// Whether a consumer holds it (its outcomes and renewals count, until the lease is taken
    /// over), rather than being expired work a claim took over and left for the next claim of
    /// its lane, under a token no consumer holds (a version-8 UUID, which no claim hands out).
    pub fn held_by_a_consumer(&self) -> bool {
        self.lease_token.get_version_num() != NO_ONES_VERSION
    }
}

/// The UUID version of the token of work no consumer holds (docs/sql-api.md, "open_leases").
const NO_ONES_VERSION: usize = 8;

/// A row of `sqlstreams.peek`.
#[derive(Clone, Debug, PartialEq)]
pub struct PeekedMessage {
    /// The message.
    pub message_id: i64,
    /// Its key.
    pub message_key: Option<String>,
    /// When its producer's transaction started.
    pub produced_at: SystemTime,
    /// Its payload.
    pub payload: serde_json::Value,
}

/// A row of `sqlstreams.fence_holders`: a transaction that produced to a stream and has not
/// ended, which claims wait for.
#[derive(Clone, Debug, PartialEq)]
pub struct FenceHolder {
    /// The stream it holds back.
    pub stream: String,
    /// Its backend (none for a prepared transaction).
    pub pid: Option<i32>,
    /// When its transaction started.
    pub xact_start: Option<SystemTime>,
    /// Its session's user.
    pub usename: Option<String>,
    /// Its session's application name.
    pub application_name: Option<String>,
    /// The name of a prepared transaction.
    pub prepared_gid: Option<String>,
}

/// A row of `sqlstreams.maintain()`: what one pass did to one stream.
#[derive(Clone, Debug, PartialEq)]
pub struct MaintainReport {
    /// The stream.
    pub stream: String,
    /// Partitions exist up to this id.
    pub partitions_through: i64,
    /// Expired idempotency keys deleted.
    pub idempotency_keys_purged: i64,
    /// Group cursors stored.
    pub cursors_advanced: i64,
    /// Lane holds cleared.
    pub lane_holds_cleared: i64,
    /// Log partitions dropped.
    pub partitions_dropped: i64,
    /// Exception rows deleted.
    pub exception_rows_purged: i64,
}

impl MaintainReport {
    pub(super) fn from_row(r: &Row) -> Self {
        MaintainReport {
            stream: r.get("stream"),
            partitions_through: r.get("partitions_through"),
            idempotency_keys_purged: r.get("idempotency_keys_purged"),
            cursors_advanced: r.get("cursors_advanced"),
            lane_holds_cleared: r.get("lane_holds_cleared"),
            partitions_dropped: r.get("partitions_dropped"),
            exception_rows_purged: r.get("exception_rows_purged"),
        }
    }
}

fn seconds(r: &Row, column: &str) -> Option<Duration> {
    r.get::<_, Option<f64>>(column).map(Duration::from_secs_f64)
}

impl GroupStatus {
    fn from_row(r: &Row) -> Self {
        GroupStatus {
            claimed: r.get("claimed"),
            committed: r.get("committed"),
            head: r.get("head"),
            lag: r.get("lag"),
            open_ranges: r.get("open_ranges"),
            ready: r.get("ready"),
            inflight: r.get("inflight"),
            deferred: r.get("deferred"),
            dead: r.get("dead"),
            superseded: r.get("superseded"),
            oldest_unresolved_at: r.get("oldest_unresolved_at"),
            lost: r.get("lost"),
            held_back_bytes: r.get("held_back_bytes"),
        }
    }
}

impl Admin {
    /// The streams the role may see, by name.
    pub async fn streams(&self) -> Result<Vec<StreamInfo>> {
        let sql = "SELECT id, name, head, lanes, partition_size, created_at, schema_version, max_bytes,
                          extract(epoch FROM idempotency_ttl)::float8 AS idempotency_ttl,
                          extract(epoch FROM dead_retention)::float8 AS dead_retention,
                          extract(epoch FROM max_age)::float8 AS max_age
                   FROM sqlstreams.streams ORDER BY name";
        let rows = self.rows(sql, &[]).await?;
        Ok(rows
            .iter()
            .map(|r| StreamInfo {
                id: r.get("id"),
                name: r.get("name"),
                head: r.get("head"),
                lanes: r.get("lanes"),
                partition_size: r.get("partition_size"),
                idempotency_ttl: seconds(r, "idempotency_ttl").unwrap_or_default(),
                dead_retention: seconds(r, "dead_retention").unwrap_or_default(),
                max_age: seconds(r, "max_age"),
                max_bytes: r.get("max_bytes"),
                schema_version: r.get("schema_version"),
                created_at: r.get("created_at"),
            })
            .collect())
    }

    /// The groups the role may see (of `stream`, or of every stream), by stream and name.
    pub async fn groups(&self, stream: Option<&str>) -> Result<Vec<GroupInfo>> {
        let sql =
            "SELECT * FROM sqlstreams.consumer_groups WHERE $1::text IS NULL OR stream = $1 ORDER BY stream, name";
        let rows = self.rows(sql, &[&stream]).await?;
        rows.iter()
            .map(|r| {
                let policy: Option<&str> = r.get("concurrency_override");
                Ok(GroupInfo {
                    id: r.get("id"),
                    stream: r.get("stream"),
                    name: r.get("name"),
                    concurrency_override: policy.map(str::parse).transpose()?,
                    max_retries: r.get("max_retries"),
                    paused: r.get("paused"),
                    on_dead: r.get("on_dead"),
                    max_inflight: r.get("max_inflight"),
                    status: GroupStatus::from_row(r),
                })
            })
            .collect()
    }

    /// Where the group stands: position, lag and exception-queue counts.
    pub async fn group_status(&self, stream: &str, group: &str) -> Result<GroupStatus> {
        let rows = self.rows("SELECT * FROM sqlstreams.group_status($1, $2)", &[&stream, &group]).await?;
        rows.first().map(GroupStatus::from_row).ok_or_else(|| Error::Config("group_status returned no row".into()))
    }

    /// One row per key with unresolved exception rows: the oldest, and how many wait behind it.
    pub async fn blocked_keys(&self, stream: &str, group: &str) -> Result<Vec<BlockedKey>> {
        let rows = self.rows("SELECT * FROM sqlstreams.blocked_keys($1, $2)", &[&stream, &group]).await?;
        Ok(rows
            .iter()
            .map(|r| BlockedKey {
                message_key: r.get("message_key"),
                oldest_message_id: r.get("oldest_message_id"),
                status: r.get("status"),
                attempts: r.get("attempts"),
                can_run_after: r.get("can_run_after"),
                last_error: r.get("last_error"),
                waiting_behind: r.get("waiting_behind"),
            })
            .collect())
    }

    /// The group's dead letters, with their payloads.
    pub async fn dead_messages(&self, stream: &str, group: &str) -> Result<Vec<DeadMessage>> {
        let sql = "SELECT message_id, message_key, attempts, delays, last_error, died_at, payload::text AS payload
                   FROM sqlstreams.dead_messages($1, $2)";
        let rows = self.rows(sql, &[&stream, &group]).await?;
        rows.iter()
            .map(|r| {
                let payload: Option<String> = r.get("payload");
                Ok(DeadMessage {
                    message_id: r.get("message_id"),
                    message_key: r.get("message_key"),
                    attempts: r.get("attempts"),
                    delays: r.get("delays"),
                    last_error: r.get("last_error"),
                    died_at: r.get("died_at"),
                    payload: payload.map(|p| serde_json::from_str(&p)).transpose()?,
                })
            })
            .collect()
    }

    /// Every lease the group has, expired ones not yet taken over included, and expired work a
    /// claim took over and left for the next claim, under a token no consumer holds.
    pub async fn open_leases(&self, stream: &str, group: &str) -> Result<Vec<OpenLease>> {
        let rows = self.rows("SELECT * FROM sqlstreams.open_leases($1, $2)", &[&stream, &group]).await?;
        Ok(rows
            .iter()
            .map(|r| OpenLease {
                kind: r.get("kind"),
                first_id: r.get("first_id"),
                last_id: r.get("last_id"),
                message_key: r.get("message_key"),
                lease_token: r.get("lease_token"),
                lease_expires_at: r.get("lease_expires_at"),
                pending: r.get("pending"),
                lane: r.get("lane"),
            })
            .collect())
    }

    /// When the group's next retry, delay or lease expiry comes due; `None` when nothing waits.
    pub async fn next_due(&self, stream: &str, group: &str) -> Result<Option<SystemTime>> {
        self.one("SELECT sqlstreams.next_due($1, $2)", &[&stream, &group]).await
    }

    /// Up to `max` of the stream's messages after `after_id`, oldest first, claiming nothing.
    pub async fn peek(&self, stream: &str, after_id: i64, max: i32) -> Result<Vec<PeekedMessage>> {
        let sql =
            "SELECT message_id, message_key, produced_at, payload::text AS payload FROM sqlstreams.peek($1, $2, $3)";
        let rows = self.rows(sql, &[&stream, &after_id, &max]).await?;
        rows.iter()
            .map(|r| {
                Ok(PeekedMessage {
                    message_id: r.get("message_id"),
                    message_key: r.get("message_key"),
                    produced_at: r.get("produced_at"),
                    payload: serde_json::from_str(r.get("payload"))?,
                })
            })
            .collect()
    }

    /// Transactions that produced to `stream` (or to any) and have not ended.
    pub async fn fence_holders(&self, stream: Option<&str>) -> Result<Vec<FenceHolder>> {
        let sql = "SELECT stream, pid, xact_start, usename::text AS usename, application_name, prepared_gid
                   FROM sqlstreams.fence_holders WHERE $1::text IS NULL OR stream = $1 ORDER BY xact_start";
        let rows = self.rows(sql, &[&stream]).await?;
        Ok(rows
            .iter()
            .map(|r| FenceHolder {
                stream: r.get("stream"),
                pid: r.get("pid"),
                xact_start: r.get("xact_start"),
                usename: r.get("usename"),
                application_name: r.get("application_name"),
                prepared_gid: r.get("prepared_gid"),
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::OpenLease;
    use std::time::SystemTime;

    fn lease(token: uuid::Uuid) -> OpenLease {
        OpenLease {
            kind: "range".into(),
            first_id: Some(1),
            last_id: Some(2),
            message_key: None,
            lease_token: token,
            lease_expires_at: SystemTime::UNIX_EPOCH,
            pending: Some(2),
            lane: Some(0),
        }
    }

    #[test]
    fn a_version_8_token_is_no_consumers() {
        assert!(lease(uuid::Uuid::new_v4()).held_by_a_consumer(), "a claim's token");
        let no_ones = uuid::Builder::from_bytes([7; 16]).with_version(uuid::Version::Custom).into_uuid();
        assert!(!lease(no_ones).held_by_a_consumer(), "work left for the next claim");
    }
}
