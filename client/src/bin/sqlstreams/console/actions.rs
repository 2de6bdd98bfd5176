//! What the console changes: each action is one call of the extension's SQL API, the call the
//! CLI makes for the same command. Redrive, skip, purge and seek are previewed first: the call
//! runs in a transaction that is rolled back, and the group is read inside it before and after,
//! so the operator sees what would change (and which keys it would release, in order) before
//! anything does.

use serde::Deserialize;
use tokio_postgres::types::ToSql;
use tokio_postgres::Client;

use super::view::{Blocked, Status};

/// A change as the console's forms post it.
#[derive(Deserialize)]
pub struct Form {
    pub csrf: String,
    pub stream: String,
    pub group: String,
    pub action: String,
    /// A message id (redrive one, skip).
    #[serde(default)]
    pub id: String,
    /// An interval Postgres reads (purge).
    #[serde(default)]
    pub older_than: String,
    /// A message id (seek).
    #[serde(default)]
    pub to_id: String,
    /// Seek although consumers hold open leases.
    #[serde(default)]
    pub force: Option<String>,
}

/// One change of a group.
#[derive(Clone, Debug, PartialEq)]
pub enum Action {
    /// Dead messages run again with a fresh budget: one, or (`None`) every one.
    Redrive(Option<i64>),
    /// A dead message is resolved for good without running (releases a held ordered key).
    Skip(i64),
    /// Dead messages that died at least this long ago (an interval) are removed.
    Purge(String),
    /// The group moves to this position: back replays, forward skips.
    Seek {
        to_id: i64,
        force: bool,
    },
    Pause,
    Resume,
}

/// What a previewed action would do, read inside its rolled-back transaction.
pub struct Preview {
    pub outcome: String,
    pub before: Status,
    pub after: Status,
    pub blocked_before: Vec<Blocked>,
    pub blocked_after: Vec<Blocked>,
}

fn message_id(field: &str, value: &str) -> Result<i64, String> {
    value.trim().parse().map_err(|_| format!("{field} must be a message id (a whole number), not {value:?}"))
}

impl Action {
    pub fn from_form(form: &Form) -> Result<Action, String> {
        Ok(match form.action.as_str() {
            "redrive" if form.id.trim().is_empty() => Action::Redrive(None),
            "redrive" => Action::Redrive(Some(message_id("id", &form.id)?)),
            "skip" => Action::Skip(message_id("id", &form.id)?),
            "purge" if form.older_than.trim().is_empty() => {
                return Err("purge needs an age (older than, e.g. '7 days'; '0 seconds' for every one)".into())
            }
            "purge" => Action::Purge(form.older_than.trim().to_string()),
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
            Action::Redrive(Some(id)) => format!("redrive dead message {id}"),
            Action::Redrive(None) => "redrive every dead message".into(),
            Action::Skip(id) => format!("skip dead message {id}"),
            Action::Purge(age) => format!("purge dead messages older than {age}"),
            Action::Seek { to_id, .. } => format!("seek to message {to_id}"),
            Action::Pause => "pause the group".into(),
            Action::Resume => "resume the group".into(),
        }
    }

    /// The form fields that post it again (to confirm a preview).
    pub fn fields(&self) -> Vec<(&'static str, String)> {
        match self {
            Action::Redrive(id) => {
                vec![("action", "redrive".into()), ("id", id.map(|i| i.to_string()).unwrap_or_default())]
            }
            Action::Skip(id) => vec![("action", "skip".into()), ("id", id.to_string())],
            Action::Purge(age) => vec![("action", "purge".into()), ("older_than", age.clone())],
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

    /// Makes the change on `db`; returns what changed, in words.
    pub async fn run(&self, db: &Client, stream: &str, group: &str) -> Result<String, String> {
        if let Action::Seek { force: false, .. } = self {
            let open: i64 = one(db, "SELECT count(*) FROM sqlstreams.open_leases($1, $2)", &[&stream, &group]).await?;
            if open > 0 {
                return Err(format!(
                    "group {group} has {open} open lease(s): a seek forgets them, and their consumers' outcomes \
                     report a lost lease. Pause the group and let them finish, or seek with \"force\"."
                ));
            }
        }
        Ok(match self {
            Action::Redrive(id) => {
                let ids = id.map(|id| vec![id]);
                let done: Vec<i64> = one(db, "SELECT sqlstreams.redrive($1, $2, $3)", &[&stream, &group, &ids]).await?;
                match done.as_slice() {
                    [] => "nothing redriven (no such dead message)".into(),
                    ids => format!("{} message(s) redriven: {}", ids.len(), join(ids)),
                }
            }
            Action::Skip(id) => {
                let done: bool = one(db, "SELECT sqlstreams.skip($1, $2, $3)", &[&stream, &group, id]).await?;
                if done {
                    format!("message {id} skipped")
                } else {
                    format!("nothing skipped: {id} is not a dead message")
                }
            }
            Action::Purge(age) => {
                let sql = "SELECT sqlstreams.purge_dead($1, $2, $3::text::interval)";
                let n: i64 = one(db, sql, &[&stream, &group, age]).await?;
                format!("{n} dead message(s) purged")
            }
            Action::Seek { to_id, .. } => {
                let position: i64 = one(db, "SELECT sqlstreams.seek($1, $2, $3)", &[&stream, &group, to_id]).await?;
                format!("the group moved to position {position}: it receives the messages after it")
            }
            Action::Pause => {
                let changed: bool = one(db, "SELECT sqlstreams.pause_group($1, $2)", &[&stream, &group]).await?;
                if changed {
                    "the group paused".into()
                } else {
                    "the group was paused already".into()
                }
            }
            Action::Resume => {
                let changed: bool = one(db, "SELECT sqlstreams.resume_group($1, $2)", &[&stream, &group]).await?;
                if changed {
                    "the group resumed".into()
                } else {
                    "the group was not paused".into()
                }
            }
        })
    }

    /// Runs it in a transaction that is rolled back, reading the group before and after.
    pub async fn preview(&self, db: &Client, stream: &str, group: &str) -> Result<Preview, String> {
        db.batch_execute("BEGIN").await.map_err(|e| super::describe(&e))?;
        let preview = async {
            let before = Status::read(db, stream, group).await?;
            let blocked_before = Blocked::read(db, stream, group).await?;
            let outcome = self.run(db, stream, group).await?;
            let after = Status::read(db, stream, group).await?;
            let blocked_after = Blocked::read(db, stream, group).await?;
            Ok::<_, String>(Preview { outcome, before, after, blocked_before, blocked_after })
        }
        .await;
        db.batch_execute("ROLLBACK").await.map_err(|e| super::describe(&e))?;
        preview
    }
}

fn join(ids: &[i64]) -> String {
    ids.iter().map(i64::to_string).collect::<Vec<_>>().join(", ")
}

/// The one value of a one-row statement.
async fn one<T>(db: &Client, sql: &str, params: &[&(dyn ToSql + Sync)]) -> Result<T, String>
where
    T: for<'a> tokio_postgres::types::FromSql<'a>,
{
    db.query_one(sql, params).await.map(|row| row.get(0)).map_err(|e| super::describe(&e))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn form(action: &str, id: &str, older_than: &str, to_id: &str) -> Form {
        Form {
            csrf: String::new(),
            stream: "s".into(),
            group: "g".into(),
            action: action.into(),
            id: id.into(),
            older_than: older_than.into(),
            to_id: to_id.into(),
            force: None,
        }
    }

    #[test]
    fn forms_read_as_actions_and_back() {
        for action in [
            Action::Redrive(None),
            Action::Redrive(Some(7)),
            Action::Skip(7),
            Action::Purge("7 days".into()),
            Action::Seek { to_id: 0, force: false },
            Action::Pause,
            Action::Resume,
        ] {
            let fields = action.fields();
            let get = |name: &str| fields.iter().find(|(n, _)| *n == name).map(|(_, v)| v.clone()).unwrap_or_default();
            let read = Action::from_form(&form(&get("action"), &get("id"), &get("older_than"), &get("to_id")));
            assert_eq!(read, Ok(action));
        }
    }

    #[test]
    fn what_is_not_an_action_is_refused_by_name() {
        assert!(Action::from_form(&form("drop", "", "", "")).unwrap_err().contains("\"drop\""));
        assert!(Action::from_form(&form("skip", "x1", "", "")).unwrap_err().contains("\"x1\""));
        assert!(Action::from_form(&form("purge", "", " ", "")).unwrap_err().contains("purge needs an age"));
    }
}
