//! What the console shows, read through the extension's views and inspection functions: a role
//! sees the streams and groups it may inspect (`pg_monitor` sees every one), nothing more.

use tokio_postgres::{GenericClient, Row};

use super::describe;

/// A group and where it stands (`sqlstreams.consumer_groups`).
#[derive(Clone, Debug)]
pub struct Status {
    pub stream: String,
    pub group: String,
    pub paused: bool,
    pub on_dead: String,
    pub concurrency_override: Option<String>,
    pub claimed: i64,
    pub committed: i64,
    pub head: i64,
    pub lag: i64,
    pub open_ranges: i64,
    pub ready: i64,
    pub inflight: i64,
    pub deferred: i64,
    pub dead: i64,
    /// Seconds since the oldest message the group has not resolved was produced.
    pub oldest_age: Option<f64>,
}

const STATUS: &str = "SELECT stream, name, paused, on_dead, concurrency_override, claimed, committed, head, lag,
        open_ranges, ready, inflight, deferred, dead, extract(epoch FROM oldest_unresolved_age)::float8
 FROM sqlstreams.consumer_groups";

impl Status {
    fn from_row(row: &Row) -> Status {
        Status {
            stream: row.get(0),
            group: row.get(1),
            paused: row.get(2),
            on_dead: row.get(3),
            concurrency_override: row.get(4),
            claimed: row.get(5),
            committed: row.get(6),
            head: row.get(7),
            lag: row.get(8),
            open_ranges: row.get(9),
            ready: row.get(10),
            inflight: row.get(11),
            deferred: row.get(12),
            dead: row.get(13),
            oldest_age: row.get(14),
        }
    }

    /// Every group this role may inspect, by stream and name.
    pub async fn all(db: &impl GenericClient) -> Result<Vec<Status>, String> {
        let rows = db.query(&format!("{STATUS} ORDER BY stream, name"), &[]).await.map_err(|e| describe(&e))?;
        Ok(rows.iter().map(Status::from_row).collect())
    }

    /// One group.
    pub async fn read(db: &impl GenericClient, stream: &str, group: &str) -> Result<Status, String> {
        let sql = format!("{STATUS} WHERE stream = $1 AND name = $2");
        match db.query_opt(&sql, &[&stream, &group]).await.map_err(|e| describe(&e))? {
            Some(row) => Ok(Status::from_row(&row)),
            None => Err(format!("group {group} of stream {stream} does not exist, or this role may not inspect it")),
        }
    }
}

/// A key waiting in the group's exception queue, with the message that holds it
/// (`sqlstreams.blocked_keys`).
#[derive(Clone, Debug, PartialEq)]
pub struct Blocked {
    pub key: Option<String>,
    pub message_id: i64,
    pub status: String,
    pub attempts: i32,
    pub can_run_after: Option<String>,
    pub last_error: Option<String>,
    pub waiting_behind: i64,
}

impl Blocked {
    pub async fn read(db: &impl GenericClient, stream: &str, group: &str) -> Result<Vec<Blocked>, String> {
        let rows = db
            .query(
                "SELECT message_key, oldest_message_id, status, attempts, can_run_after::text, last_error, waiting_behind
                 FROM sqlstreams.blocked_keys($1, $2) ORDER BY oldest_message_id",
                &[&stream, &group],
            )
            .await
            .map_err(|e| describe(&e))?;
        Ok(rows
            .iter()
            .map(|r| Blocked {
                key: r.get(0),
                message_id: r.get(1),
                status: r.get(2),
                attempts: r.get(3),
                can_run_after: r.get(4),
                last_error: r.get(5),
                waiting_behind: r.get(6),
            })
            .collect())
    }
}

/// A dead letter (`sqlstreams.dead_messages`).
#[derive(Clone, Debug)]
pub struct Dead {
    pub id: i64,
    pub key: Option<String>,
    pub attempts: i32,
    pub last_error: Option<String>,
    pub died_at: Option<String>,
    /// Its payload, pretty-printed JSON.
    pub payload: String,
}

impl Dead {
    pub async fn read(db: &impl GenericClient, stream: &str, group: &str) -> Result<Vec<Dead>, String> {
        let rows = db
            .query(
                "SELECT message_id, message_key, attempts, last_error, died_at::text, jsonb_pretty(payload)
                 FROM sqlstreams.dead_messages($1, $2) ORDER BY message_id",
                &[&stream, &group],
            )
            .await
            .map_err(|e| describe(&e))?;
        Ok(rows
            .iter()
            .map(|r| Dead {
                id: r.get(0),
                key: r.get(1),
                attempts: r.get(2),
                last_error: r.get(3),
                died_at: r.get(4),
                payload: r.get::<_, Option<String>>(5).unwrap_or_default(),
            })
            .collect())
    }
}

/// Whether the console's role may change groups: admin calls are for superusers and roles with
/// `sqlstreams_admin`'s rights (docs/sql-api.md, "Privileges"; src/access.rs checks the same). Read per page, so a role granted or
/// revoked meanwhile sees its buttons come and go.
pub async fn may_act(db: &impl GenericClient) -> Result<bool, String> {
    db.query_one(
        "SELECT r.rolsuper OR pg_catalog.pg_has_role(current_user, 'sqlstreams_admin', 'USAGE')
         FROM pg_catalog.pg_roles r WHERE r.rolname = current_user",
        &[],
    )
    .await
    .map(|row| row.get(0))
    .map_err(|e| describe(&e))
}
