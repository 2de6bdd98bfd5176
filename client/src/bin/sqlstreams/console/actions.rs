//! What the console changes: each action is one call of the extension's SQL API, the call the
//! CLI makes for the same command. Redrive, skip, purge and seek are previewed first: the call
//! runs in a transaction that is rolled back, and the group is read inside it before and after,
//! so the operator sees what would change (and which keys it would release, in order) before
//! anything does.

use serde::Deserialize;
use tokio_postgres::types::ToSql;
use tokio_postgres::GenericClient;

use super::view::{Blocked, Status};

/// A change as the console's forms post it.
#[derive(Deserialize)]
pub struct Form {
    /// Missing, it is refused as a wrong one is.
    #[serde(default)]
    pub csrf: String,
    pub stream: String,
    pub group: String,
    pub action: String,
    /// Message ids, comma-separated (redrive: none for every dead letter; skip: one).
    #[serde(default)]
    pub ids: String,
    /// An interval Postgres reads (purge).
    #[serde(default)]
    pub older_than: String,
    /// A time Postgres reads (purge, as a preview pinned it).
    #[serde(default)]
    pub died_before: String,
    /// A message id (seek).
    #[serde(default)]
    pub to_id: String,
    /// Seek although consumers hold open leases.
    #[serde(default)]
    pub force: Option<String>,
}

/// Which dead letters a purge removes.
#[derive(Clone, Debug, PartialEq)]
pub enum Cutoff {
    /// Those that died at least this long ago (an interval), as the operator asked.
    OlderThan(String),
    /// Those that died before this time, as a preview found it.
    DiedBefore(String),
}

/// One change of a group.
#[derive(Clone, Debug, PartialEq)]
pub enum Action {
    /// Dead messages run again with a fresh budget: these, or (`None`) every one.
    Redrive(Option<Vec<i64>>),
    /// A dead message is resolved for good without running (releases a held ordered key).
    Skip(i64),
    Purge(Cutoff),
    /// The group moves to this position: back replays, forward skips.
    Seek {
        to_id: i64,
        force: bool,
    },
    Pause,
    Resume,
}

/// What an action did (or, previewed, would do).
#[derive(Clone, Debug, PartialEq)]
pub enum Outcome {
    Redriven(Vec<i64>),
    Skipped { id: i64, done: bool },
    Purged(i64),
    Moved(i64),
    Paused(bool),
    Resumed(bool),
}

impl std::fmt::Display for Outcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Outcome::Redriven(ids) if ids.is_empty() => write!(f, "nothing redriven (no such dead message)"),
            Outcome::Redriven(ids) => write!(f, "{} message(s) redriven: {}", ids.len(), join(ids)),
            Outcome::Skipped { id, done: true } => write!(f, "message {id} skipped"),
            Outcome::Skipped { id, done: false } => write!(f, "nothing skipped: {id} is not a dead message"),
            Outcome::Purged(n) => write!(f, "{n} dead message(s) purged"),
            Outcome::Moved(position) => {
                write!(f, "the group moved to position {position}: it receives the messages after it")
            }
            Outcome::Paused(true) => write!(f, "the group paused"),
            Outcome::Paused(false) => write!(f, "the group was paused already"),
            Outcome::Resumed(true) => write!(f, "the group resumed"),
            Outcome::Resumed(false) => write!(f, "the group was not paused"),
        }
    }
}

/// What a previewed action would do, read inside its rolled-back transaction, and the action
/// that confirms it: pinned to what the preview found, so a confirmation changes no dead letter
/// that died after the operator looked.
pub struct Preview {
    pub outcome: Outcome,
    pub confirm: Action,
    pub before: Status,
    pub after: Status,
    pub blocked_before: Vec<Blocked>,
    pub blocked_after: Vec<Blocked>,
}

/// The `ids` of a redrive that names no message (an empty field means every dead letter).
const NONE: &str = "none";

fn message_ids(value: &str) -> Result<Vec<i64>, String> {
    value
        .split(',')
        .map(str::trim)
        .filter(|v| !v.is_empty())
        .map(|v| v.parse().map_err(|_| format!("ids must be message ids (whole numbers), not {v:?}")))
        .collect()
}

fn message_id(field: &str, value: &str) -> Result<i64, String> {
    value.trim().parse().map_err(|_| format!("{field} must be a message id (a whole number), not {value:?}"))
}

impl Action {
    pub fn from_form(form: &Form) -> Result<Action, String> {
        Ok(match form.action.as_str() {
            "redrive" if form.ids.trim().is_empty() => Action::Redrive(None),
            // What a preview that found no dead letter confirms: not "every one".
            "redrive" if form.ids.trim() == NONE => Action::Redrive(Some(vec![])),
            "redrive" => Action::Redrive(Some(message_ids(&form.ids)?)),
            "skip" => Action::Skip(message_id("ids", &form.ids)?),
            "purge" if !form.died_before.trim().is_empty() => {
                Action::Purge(Cutoff::DiedBefore(form.died_before.trim().to_string()))
            }
            "purge" if form.older_than.trim().is_empty() => {
                return Err("purge needs an age (older than, e.g. '7 days'; '0 seconds' for every one)".into())
            }
            "purge" => Action::Purge(Cutoff::OlderThan(form.older_than.trim().to_string())),
            "seek" => Action::Seek { to_id: message_id("to_id", &form.to_id)?, force: form.force.is_some() },
            "pause" => Action::Pause,
            "resume" => Action::Resume,
            other => return Err(format!("unknown action {other:?}")),
        })
    }

    /// Whether it is shown before it is made (what changes messages).
    pub fn previewed(&self) -> bool {
        !matches!(self, Action::Pause | Action::Resume)
    }

    /// What it does, in words.
    pub fn describe(&self) -> String {
        match self {
            Action::Redrive(Some(ids)) if ids.is_empty() => "redrive nothing".into(),
            Action::Redrive(Some(ids)) => format!("redrive dead message(s) {}", join(ids)),
            Action::Redrive(None) => "redrive every dead message".into(),
            Action::Skip(id) => format!("skip dead message {id}"),
            Action::Purge(Cutoff::OlderThan(age)) => format!("purge dead messages older than {age}"),
            Action::Purge(Cutoff::DiedBefore(time)) => format!("purge dead messages that died before {time}"),
            Action::Seek { to_id, .. } => format!("seek to message {to_id}"),
            Action::Pause => "pause the group".into(),
            Action::Resume => "resume the group".into(),
        }
    }

    /// The form fields that post it.
    pub fn fields(&self) -> Vec<(&'static str, String)> {
        match self {
            Action::Redrive(None) => vec![("action", "redrive".into()), ("ids", String::new())],
            Action::Redrive(Some(ids)) if ids.is_empty() => vec![("action", "redrive".into()), ("ids", NONE.into())],
            Action::Redrive(Some(ids)) => vec![("action", "redrive".into()), ("ids", join(ids))],
            Action::Skip(id) => vec![("action", "skip".into()), ("ids", id.to_string())],
            Action::Purge(Cutoff::OlderThan(age)) => vec![("action", "purge".into()), ("older_than", age.clone())],
            Action::Purge(Cutoff::DiedBefore(time)) => vec![("action", "purge".into()), ("died_before", time.clone())],
            Action::Seek { to_id, force } => {
                let mut fields = vec![("action", "seek".into()), ("to_id", to_id.to_string())];
                if *force {
                    fields.push(("force", "on".into()));
                }
                fields
            }
            Action::Pause => vec![("action", "pause".into())],
            Action::Resume => vec![("action", "resume".into())],
        }
    }

    /// Makes the change on `db`.
    pub async fn run(&self, db: &impl GenericClient, stream: &str, group: &str) -> Result<Outcome, String> {
        if let Action::Seek { force: false, .. } = self {
            let open: i64 = one(db, crate::CONSUMERS_LEASES, &[&stream, &group]).await?;
            if open > 0 {
                return Err(format!(
                    "group {group} has {open} open lease(s) held by consumers: a seek forgets them, and their \
                     outcomes report a lost lease. Pause the group and let them finish, or seek with \"force\"."
                ));
            }
        }
        Ok(match self {
            Action::Redrive(Some(ids)) if ids.is_empty() => Outcome::Redriven(vec![]),
            Action::Redrive(ids) => {
                Outcome::Redriven(one(db, "SELECT sqlstreams.redrive($1, $2, $3)", &[&stream, &group, ids]).await?)
            }
            Action::Skip(id) => Outcome::Skipped {
                id: *id,
                done: one(db, "SELECT sqlstreams.skip($1, $2, $3)", &[&stream, &group, id]).await?,
            },
            Action::Purge(Cutoff::OlderThan(age)) => {
                let sql = "SELECT sqlstreams.purge_dead($1, $2, $3::text::interval)";
                Outcome::Purged(one(db, sql, &[&stream, &group, age]).await?)
            }
            Action::Purge(Cutoff::DiedBefore(time)) => {
                let sql = "SELECT sqlstreams.purge_dead($1, $2, now() - $3::text::timestamptz)";
                Outcome::Purged(one(db, sql, &[&stream, &group, time]).await?)
            }
            Action::Seek { to_id, .. } => {
                Outcome::Moved(one(db, "SELECT sqlstreams.seek($1, $2, $3)", &[&stream, &group, to_id]).await?)
            }
            Action::Pause => {
                Outcome::Paused(one(db, "SELECT sqlstreams.pause_group($1, $2)", &[&stream, &group]).await?)
            }
            Action::Resume => {
                Outcome::Resumed(one(db, "SELECT sqlstreams.resume_group($1, $2)", &[&stream, &group]).await?)
            }
        })
    }

    /// Runs it in a transaction that is rolled back, reading the group before and after.
    pub async fn preview(
        &self,
        db: &mut deadpool_postgres::Object,
        stream: &str,
        group: &str,
    ) -> Result<Preview, String> {
        // Dropped without a commit (an error below, or the request dropped half-way when the
        // browser goes away), the transaction is rolled back before the connection's next
        // statement: it never goes back to the pool with the change in it.
        let tx = db.transaction().await.map_err(|e| super::describe(&e))?;
        // A seek's preview takes the seek's locks: it waits for claims in progress, but not for
        // an open transaction's, holding one of the console's few connections.
        tx.batch_execute("SET LOCAL lock_timeout = '5s'").await.map_err(|e| super::describe(&e))?;
        let before = Status::read(&*tx, stream, group).await?;
        let blocked_before = Blocked::read(&*tx, stream, group).await?;
        let confirm = match self {
            Action::Purge(Cutoff::OlderThan(age)) => {
                let sql = "SELECT (now() - $1::text::interval)::text";
                Action::Purge(Cutoff::DiedBefore(one(&*tx, sql, &[age]).await?))
            }
            other => other.clone(),
        };
        let outcome = confirm.run(&*tx, stream, group).await?;
        let confirm = match (&confirm, &outcome) {
            (Action::Redrive(None), Outcome::Redriven(ids)) => Action::Redrive(Some(ids.clone())),
            // A seek past the head stops at it: confirmed, it stops there, not at a later head.
            (Action::Seek { force, .. }, Outcome::Moved(position)) => Action::Seek { to_id: *position, force: *force },
            _ => confirm,
        };
        let after = Status::read(&*tx, stream, group).await?;
        let blocked_after = Blocked::read(&*tx, stream, group).await?;
        tx.rollback().await.map_err(|e| super::describe(&e))?;
        Ok(Preview { outcome, confirm, before, after, blocked_before, blocked_after })
    }
}

fn join(ids: &[i64]) -> String {
    ids.iter().map(i64::to_string).collect::<Vec<_>>().join(", ")
}

/// The one value of a one-row statement.
async fn one<T>(db: &impl GenericClient, sql: &str, params: &[&(dyn ToSql + Sync)]) -> Result<T, String>
where
    T: for<'a> tokio_postgres::types::FromSql<'a>,
{
    db.query_one(sql, params).await.map(|row| row.get(0)).map_err(|e| super::describe(&e))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn form(fields: &[(&'static str, String)]) -> Form {
        let get = |name: &str| fields.iter().find(|(n, _)| *n == name).map(|(_, v)| v.clone()).unwrap_or_default();
        Form {
            csrf: String::new(),
            stream: "s".into(),
            group: "g".into(),
            action: get("action"),
            ids: get("ids"),
            older_than: get("older_than"),
            died_before: get("died_before"),
            to_id: get("to_id"),
            force: fields.iter().any(|(n, _)| *n == "force").then(|| "on".into()),
        }
    }

    #[test]
    fn forms_read_as_actions_and_back() {
        for action in [
            Action::Redrive(None),
            Action::Redrive(Some(vec![7])),
            Action::Redrive(Some(vec![7, 9])),
            Action::Redrive(Some(vec![])),
            Action::Skip(7),
            Action::Purge(Cutoff::OlderThan("7 days".into())),
            Action::Purge(Cutoff::DiedBefore("2026-12-05 06:00:00+00".into())),
            Action::Seek { to_id: 0, force: false },
            Action::Seek { to_id: 3, force: true },
            Action::Pause,
            Action::Resume,
        ] {
            assert_eq!(Action::from_form(&form(&action.fields())), Ok(action));
        }
    }

    #[test]
    fn what_is_not_an_action_is_refused_by_name() {
        let refused = |fields: &[(&'static str, &str)]| {
            let fields: Vec<_> = fields.iter().map(|(n, v)| (*n, v.to_string())).collect();
            Action::from_form(&form(&fields)).unwrap_err()
        };
        assert!(refused(&[("action", "drop")]).contains("\"drop\""));
        assert!(refused(&[("action", "skip"), ("ids", "x1")]).contains("\"x1\""));
        assert!(refused(&[("action", "redrive"), ("ids", "1,x")]).contains("\"x\""));
        assert!(refused(&[("action", "purge"), ("older_than", " ")]).contains("purge needs an age"));
    }
}
