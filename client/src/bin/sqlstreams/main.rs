//! `sqlstreams`: the admin CLI. Every command is one call of the extension's SQL API (nothing
//! reads the extension's tables), printed as a table, or as JSON with `--json` for scripts.
//!
//! ```text
//! sqlstreams [--dsn URL] [--json] [--statement-timeout 30s] status [--stream S]
//! sqlstreams streams | describe --stream S | fence-holders [--stream S]
//! sqlstreams lag|blocked --stream S --group G
//! sqlstreams dead list --stream S --group G
//! sqlstreams dead redrive --stream S --group G [--ids 1,2] [--dry-run | --yes]
//! sqlstreams dead purge --stream S --group G (--older-than '7 days' | --all) [--dry-run | --yes]
//! sqlstreams dead skip --stream S --group G --id N [--dry-run | --yes]
//! sqlstreams alter-stream --stream S [--dead-retention I] [--idempotency-ttl I] [--max-age I] [--max-bytes N]
//! sqlstreams alter-group --stream S --group G [--max-retries N] ... [--on-dead hold|release] [--max-inflight N]
//! sqlstreams seek --stream S --group G (--to-id N | --to-time T) [--force] [--dry-run | --yes]
//! sqlstreams pause|resume --stream S --group G
//! sqlstreams tail --stream S [--after ID] [--limit N] [--follow]
//! sqlstreams completions bash|zsh|fish|elvish|powershell
//! sqlstreams console [--listen 127.0.0.1:8089] [--allowed-host HOST:PORT] (token: SQLSTREAMS_CONSOLE_TOKEN)
//! ```
//!
//! What changes messages (redrive, purge, seek) first runs in a transaction that is rolled
//! back, to show what it would do: `--dry-run` stops there; otherwise the change is made when
//! `--yes` is given or the operator answers yes on a terminal, and refused (exit 2) when
//! neither.

mod console;

use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use serde_json::Value;
use tokio_postgres::types::ToSql;

/// How many of a group's open leases consumers hold: what a seek would make their outcomes
/// lose. Expired work a claim took over and left for the next claim of its lane is listed under
/// a token no consumer holds, a version-8 UUID (docs/sql-api.md, "open_leases"), and is not
/// counted: no consumer's outcome can be lost there, and a paused group would never drain it.
const CONSUMERS_LEASES: &str = "SELECT count(*) AS open FROM sqlstreams.open_leases($1, $2)
                                WHERE get_byte(uuid_send(lease_token), 6) >> 4 <> 8";

#[derive(Parser)]
#[command(
    name = "sqlstreams",
    version,
    about = "Operate sqlstreams streams and consumer groups",
    after_help = "Exit status: 0 done; 1 the database refused or could not be reached (its message, \
                  SQLSTATE and hint on stderr); 2 a usage error, or a change not confirmed (no --yes \
                  and no terminal to ask on) or refused by the CLI itself (seek of a group with open \
                  leases without --force)."
)]
struct Cli {
    /// Connection string (URL or key=value); defaults to DATABASE_URL. What it leaves out comes
    /// from libpq's PG* variables and the password file (PGPASSFILE or ~/.pgpass), as psql
    /// reads them. `sslmode=require` (or PGSSLMODE) connects over TLS and verifies the server
    /// against the system's roots and the CA file in PGSSLROOTCERT.
    #[arg(long, env = "DATABASE_URL", global = true)]
    dsn: Option<String>,
    /// Print JSON (one array of objects; `tail --follow`: one object per line) instead of a table.
    #[arg(long, global = true)]
    json: bool,
    /// How long any one statement may run (a seek waits for the claims in progress), as
    /// Postgres reads `statement_timeout`: '30s', '5min', '0' for none.
    #[arg(long, global = true, default_value = "30s")]
    statement_timeout: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Args)]
struct Target {
    #[arg(long)]
    stream: String,
    #[arg(long)]
    group: String,
}

/// How a change is confirmed.
#[derive(Args)]
struct Confirm {
    /// Show what would change, and change nothing.
    #[arg(long, conflicts_with = "yes")]
    dry_run: bool,
    /// Make the change without asking.
    #[arg(long, short = 'y')]
    yes: bool,
}

#[derive(Subcommand)]
enum Command {
    /// Every group (of one stream) with its cursor, lag, age of its backlog and queue counts.
    Status {
        #[arg(long)]
        stream: Option<String>,
    },
    /// Every stream with its head, lanes, retention and bounds.
    Streams,
    /// One stream's settings, then its groups.
    Describe {
        #[arg(long)]
        stream: String,
    },
    /// Transactions producing to a stream (or any) that have not ended: claims wait for them.
    FenceHolders {
        #[arg(long)]
        stream: Option<String>,
    },
    /// Changes a stream's settings; only those given.
    AlterStream {
        #[arg(long)]
        stream: String,
        /// How long dead and superseded rows are kept, e.g. '7 days'.
        #[arg(long)]
        dead_retention: Option<String>,
        #[arg(long)]
        idempotency_ttl: Option<String>,
        /// The stream's age bound, e.g. '30 days' ('0' removes it).
        #[arg(long)]
        max_age: Option<String>,
        /// The stream's size bound in bytes (0 removes it).
        #[arg(long)]
        max_bytes: Option<i64>,
    },
    /// Changes a group's settings; only those given.
    AlterGroup {
        #[command(flatten)]
        target: Target,
        /// parallel, exclusive, ordered, or none to remove the override.
        #[arg(long)]
        concurrency_override: Option<String>,
        #[arg(long)]
        max_retries: Option<i32>,
        #[arg(long)]
        backoff_base: Option<String>,
        #[arg(long)]
        backoff_cap: Option<String>,
        #[arg(long)]
        backoff_exponent: Option<f64>,
        #[arg(long)]
        max_delays: Option<i32>,
        #[arg(long)]
        max_reclaims: Option<i32>,
        /// hold or release.
        #[arg(long)]
        on_dead: Option<String>,
        /// The most messages in flight across the group's consumers (0 removes the cap).
        #[arg(long)]
        max_inflight: Option<i32>,
    },
    /// Serves the web console (docs/console.md) until stopped: streams, groups, blocked keys and
    /// dead letters, with previewed changes where the role may make them.
    Console {
        /// Where it listens (a wildcard address needs --allowed-host).
        #[arg(long, default_value = "127.0.0.1:8089")]
        listen: std::net::SocketAddr,
        /// What every request must carry (a session cookie set by opening /?token=... once, or a
        /// bearer token); without one, a new one is made and printed. Better given in the
        /// environment than on a command line others can read.
        #[arg(long, env = "SQLSTREAMS_CONSOLE_TOKEN", hide_env_values = true)]
        token: Option<String>,
        /// Another HOST:PORT the console is reached by (a name, a proxy's); requests for other
        /// hosts are refused.
        #[arg(long = "allowed-host")]
        allowed_hosts: Vec<String>,
        /// How often the rate charts read every group, in seconds.
        #[arg(long, default_value_t = 5)]
        sample_every: u64,
    },
    /// Prints a shell completion script (e.g. `sqlstreams completions bash > /etc/bash_completion.d/sqlstreams`).
    Completions { shell: clap_complete::Shell },
    /// One group's cursor, head, lag and exception-queue counts.
    Lag(Target),
    /// Keys waiting in a group's exception queue.
    Blocked(Target),
    /// Dead letters.
    Dead {
        #[command(subcommand)]
        action: Dead,
    },
    /// Moves a group: back replays, forward skips (its open leases and exception rows are
    /// forgotten).
    Seek {
        #[command(flatten)]
        target: Target,
        #[arg(long, conflicts_with = "to_time", required_unless_present = "to_time")]
        to_id: Option<i64>,
        /// A timestamp Postgres understands, e.g. '2026-11-30 12:00+00'.
        #[arg(long)]
        to_time: Option<String>,
        /// Seek although consumers hold open leases (their outcomes will report a lost lease).
        #[arg(long)]
        force: bool,
        #[command(flatten)]
        confirm: Confirm,
    },
    /// Stops a group's claims (outcomes still count).
    Pause(Target),
    /// Resumes a paused group.
    Resume(Target),
    /// The messages of a stream after an id; with --follow, new ones as they come.
    Tail {
        #[arg(long)]
        stream: String,
        #[arg(long, default_value_t = 0)]
        after: i64,
        #[arg(long, default_value_t = 20)]
        limit: i32,
        #[arg(long)]
        follow: bool,
    },
}

#[derive(Subcommand)]
enum Dead {
    /// The group's dead messages with their errors and payloads.
    List(Target),
    /// Gives dead messages (all, or --ids) another run with a fresh retry budget.
    Redrive {
        #[command(flatten)]
        target: Target,
        /// Comma-separated message ids.
        #[arg(long, value_delimiter = ',')]
        ids: Option<Vec<i64>>,
        #[command(flatten)]
        confirm: Confirm,
    },
    /// Removes dead messages that died at least --older-than ago, or with --all every one.
    Purge {
        #[command(flatten)]
        target: Target,
        /// An interval Postgres understands, e.g. '7 days'.
        #[arg(long, required_unless_present = "all")]
        older_than: Option<String>,
        /// Every dead message of the group, however recent.
        #[arg(long, conflicts_with = "older_than")]
        all: bool,
        #[command(flatten)]
        confirm: Confirm,
    },
    /// Resolves one dead message for good without running it (releases a held ordered key).
    Skip {
        #[command(flatten)]
        target: Target,
        #[arg(long)]
        id: i64,
        #[command(flatten)]
        confirm: Confirm,
    },
}

/// A query's result: its column names in order, and each row as a JSON object.
struct Rows {
    columns: Vec<String>,
    rows: Vec<Value>,
}

fn describe(e: tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => match db.hint() {
            Some(hint) => format!("{} ({})\nhint: {hint}", db.message(), db.code().code()),
            None => format!("{} ({})", db.message(), db.code().code()),
        },
        None => e.to_string(),
    }
}

/// Runs `sql`, each row as `to_jsonb`.
async fn rows(db: &tokio_postgres::Client, sql: &str, params: &[&(dyn ToSql + Sync)]) -> Result<Rows, String> {
    let columns = db.prepare(sql).await.map_err(describe)?.columns().iter().map(|c| c.name().to_string()).collect();
    let wrapped = format!("SELECT to_jsonb(r) FROM ({sql}) r");
    let rows = db.query(&wrapped, params).await.map_err(describe)?;
    Ok(Rows { columns, rows: rows.iter().map(|r| r.get::<_, Value>(0)).collect() })
}

/// Why the CLI stops: the database said no (exit 1), or the operator did not confirm, or the
/// CLI refused on its own (exit 2).
enum Failure {
    Database(String),
    Refused(String),
}

impl From<String> for Failure {
    fn from(message: String) -> Self {
        Failure::Database(message)
    }
}

/// A change to messages: `sql` runs once in a transaction that is rolled back, for what it
/// would do (`--dry-run` prints that and stops), then, confirmed, for real.
async fn change(
    db: &tokio_postgres::Client,
    what: &str,
    sql: &str,
    params: &[&(dyn ToSql + Sync)],
    confirm: &Confirm,
    json: bool,
) -> Result<Rows, Failure> {
    db.batch_execute("BEGIN").await.map_err(describe)?;
    let preview = rows(db, sql, params).await;
    db.batch_execute("ROLLBACK").await.map_err(describe)?;
    let preview = preview?;
    if confirm.dry_run {
        eprintln!("sqlstreams: dry run, nothing changed; it would {what}:");
        return Ok(preview);
    }
    if !confirm.yes {
        use std::io::{BufRead, IsTerminal, Write};
        if !std::io::stdin().is_terminal() {
            return Err(Failure::Refused(format!(
                "not confirmed: pass --yes to {what}, or --dry-run to see what it would do"
            )));
        }
        print(&preview, json);
        eprint!("sqlstreams: {what}, as above? [y/N] ");
        let _ = std::io::stderr().flush();
        let mut answer = String::new();
        std::io::stdin().lock().read_line(&mut answer).map_err(|e| e.to_string())?;
        if !matches!(answer.trim(), "y" | "Y" | "yes") {
            return Err(Failure::Refused("not confirmed: nothing changed".into()));
        }
    }
    Ok(rows(db, sql, params).await?)
}

/// Prints rows as JSON or as an aligned table, columns in the query's order.
fn print(out: &Rows, json: bool) {
    if json {
        println!("{}", Value::Array(out.rows.clone()));
        return;
    }
    if out.rows.is_empty() {
        println!("(none)");
        return;
    }
    let cell = |v: &Value| match v {
        Value::String(s) => s.clone(),
        Value::Null => String::new(),
        other => other.to_string(),
    };
    let table: Vec<Vec<String>> = out
        .rows
        .iter()
        .map(|r| out.columns.iter().map(|c| cell(r.get(c.as_str()).unwrap_or(&Value::Null))).collect())
        .collect();
    let widths: Vec<usize> = out
        .columns
        .iter()
        .enumerate()
        .map(|(i, c)| table.iter().map(|r| r[i].chars().count()).max().unwrap_or(0).max(c.len()))
        .collect();
    let line = |cells: &[String]| {
        cells.iter().zip(&widths).map(|(c, w)| format!("{c:<w$}")).collect::<Vec<_>>().join("  ").trim_end().to_string()
    };
    println!("{}", line(&out.columns));
    for row in &table {
        println!("{}", line(row));
    }
}

async fn run(cli: Cli) -> Result<(), Failure> {
    if let Command::Completions { shell } = cli.command {
        clap_complete::generate(
            shell,
            &mut <Cli as clap::CommandFactory>::command(),
            "sqlstreams",
            &mut std::io::stdout(),
        );
        return Ok(());
    }
    // The client library's connection, completed from libpq's environment: TLS when the DSN
    // or PGSSLMODE says require, verified against the system's roots and PGSSLROOTCERT.
    let pool_size = if matches!(cli.command, Command::Console { .. }) { 4 } else { 1 };
    let options = sqlstreams_client::ClientOptions { pool_size, ..Default::default() };
    let client = sqlstreams_client::Client::connect_env(cli.dsn.as_deref(), options).map_err(|e| e.to_string())?;
    client.check_extension().await.map_err(|e| e.to_string())?;
    if let Command::Console { listen, token, allowed_hosts, sample_every } = cli.command {
        let options = console::Options {
            listen,
            token,
            allowed_hosts,
            sample_every: Duration::from_secs(sample_every.max(1)),
            statement_timeout: cli.statement_timeout,
        };
        return console::serve(client, options).await.map_err(Failure::Refused);
    }
    let db = client.pool().get().await.map_err(|e| sqlstreams_client::Error::from(e).to_string())?;
    let db: &tokio_postgres::Client = &db;
    db.execute("SELECT set_config('statement_timeout', $1, false)", &[&cli.statement_timeout])
        .await
        .map_err(describe)?;
    let json = cli.json;
    let out = match cli.command {
        Command::Tail { stream, after, limit, follow } => tail(db, &stream, after, limit, follow, json).await?,
        command @ (Command::Dead { .. } | Command::Seek { .. }) => operate(db, command, json).await?,
        command => inspect(db, command, json).await?,
    };
    print(&out, json);
    Ok(())
}

/// The commands that read, and those that change settings or pause: one call each.
async fn inspect(db: &tokio_postgres::Client, command: Command, json: bool) -> Result<Rows, Failure> {
    Ok(match command {
        Command::Status { stream } => {
            rows(
                db,
                "SELECT stream, name AS group, paused, claimed, committed, head, lag, oldest_unresolved_age::text AS oldest_age,
                        open_ranges, ready, inflight, deferred, dead
                 FROM sqlstreams.consumer_groups WHERE $1::text IS NULL OR stream = $1 ORDER BY stream, name",
                &[&stream],
            )
            .await?
        }
        Command::Streams => {
            rows(
                db,
                "SELECT name, head, lanes, partition_size, idempotency_ttl::text, dead_retention::text,
                        max_age::text, max_bytes, schema_version FROM sqlstreams.streams ORDER BY name",
                &[],
            )
            .await?
        }
        Command::Describe { stream } => {
            let found = rows(
                db,
                "SELECT name, id, head, lanes, partition_size, idempotency_ttl::text, dead_retention::text,
                        max_age::text, max_bytes, schema_version, channel FROM sqlstreams.streams WHERE name = $1",
                &[&stream],
            )
            .await?;
            if found.rows.is_empty() {
                return Err(Failure::Database(format!("stream {stream} does not exist or is not visible to this role")));
            }
            print(&found, json);
            rows(
                db,
                "SELECT name AS group, concurrency_override, paused, on_dead, max_retries, backoff_base::text,
                        backoff_cap::text, max_delays, max_reclaims, max_inflight, claimed, committed, lag, lost,
                        held_back_bytes
                 FROM sqlstreams.consumer_groups WHERE stream = $1 ORDER BY name",
                &[&stream],
            )
            .await?
        }
        Command::FenceHolders { stream } => {
            rows(
                db,
                "SELECT stream, pid, xid::text, age::text, state, usename, application_name, prepared_gid
                 FROM sqlstreams.fence_holders WHERE $1::text IS NULL OR stream = $1 ORDER BY age DESC",
                &[&stream],
            )
            .await?
        }
        Command::AlterStream { stream, dead_retention, idempotency_ttl, max_age, max_bytes } => {
            rows(
                db,
                "SELECT sqlstreams.alter_stream($1, $2::text::interval, $3::text::interval, $4::text::interval, $5) AS altered",
                &[&stream, &dead_retention, &idempotency_ttl, &max_age, &max_bytes],
            )
            .await?
        }
        Command::AlterGroup {
            target: t,
            concurrency_override,
            max_retries,
            backoff_base,
            backoff_cap,
            backoff_exponent,
            max_delays,
            max_reclaims,
            on_dead,
            max_inflight,
        } => {
            rows(
                db,
                "SELECT sqlstreams.alter_group($1, $2, $3, $4, $5::text::interval, $6::text::interval, $7, $8, $9, $10,
                                               max_inflight => $11) AS altered",
                &[
                    &t.stream,
                    &t.group,
                    &concurrency_override,
                    &max_retries,
                    &backoff_base,
                    &backoff_cap,
                    &backoff_exponent,
                    &max_delays,
                    &max_reclaims,
                    &on_dead,
                    &max_inflight,
                ],
            )
            .await?
        }
        Command::Lag(t) => rows(db, "SELECT * FROM sqlstreams.group_status($1, $2)", &[&t.stream, &t.group]).await?,
        Command::Blocked(t) => rows(db, "SELECT * FROM sqlstreams.blocked_keys($1, $2)", &[&t.stream, &t.group]).await?,
        Command::Pause(t) => rows(db, "SELECT sqlstreams.pause_group($1, $2) AS paused", &[&t.stream, &t.group]).await?,
        Command::Resume(t) => rows(db, "SELECT sqlstreams.resume_group($1, $2) AS resumed", &[&t.stream, &t.group]).await?,
        Command::Completions { .. } | Command::Console { .. } | Command::Tail { .. } | Command::Dead { .. } | Command::Seek { .. } => {
            unreachable!("answered by run")
        }
    })
}

/// Dead letters and seeks: what changes messages is previewed and confirmed (`change`).
async fn operate(db: &tokio_postgres::Client, command: Command, json: bool) -> Result<Rows, Failure> {
    Ok(match command {
        Command::Dead { action: Dead::List(t) } => {
            rows(db, "SELECT * FROM sqlstreams.dead_messages($1, $2)", &[&t.stream, &t.group]).await?
        }
        Command::Dead { action: Dead::Redrive { target: t, ids, confirm } } => {
            let sql = "SELECT unnest(sqlstreams.redrive($1, $2, $3)) AS redriven";
            change(db, "redrive these dead messages", sql, &[&t.stream, &t.group, &ids], &confirm, json).await?
        }
        Command::Dead { action: Dead::Purge { target: t, older_than, all: _, confirm } } => {
            // Without --older-than, --all (clap requires one of them).
            let older_than = older_than.unwrap_or_else(|| "0 seconds".into());
            let sql = "SELECT sqlstreams.purge_dead($1, $2, $3::text::interval) AS purged";
            change(db, "purge this many dead messages", sql, &[&t.stream, &t.group, &older_than], &confirm, json)
                .await?
        }
        Command::Dead { action: Dead::Skip { target: t, id, confirm } } => {
            let sql = "SELECT sqlstreams.skip($1, $2, $3) AS skipped";
            change(db, "skip this message", sql, &[&t.stream, &t.group, &id], &confirm, json).await?
        }
        Command::Seek { target: t, to_id, to_time, force, confirm } => {
            let open = rows(db, CONSUMERS_LEASES, &[&t.stream, &t.group]).await?;
            let open = open.rows.first().and_then(|r| r["open"].as_i64()).unwrap_or(0);
            if open > 0 && !force {
                return Err(Failure::Refused(format!(
                    "group {} has {open} open lease(s) held by consumers: a seek forgets them, and their \
                     outcomes report a lost lease; pause the group and let them finish, or pass --force",
                    t.group
                )));
            }
            let sql = "SELECT sqlstreams.seek($1, $2, $3, $4::text::timestamptz) AS position";
            change(db, "move the group to this position", sql, &[&t.stream, &t.group, &to_id, &to_time], &confirm, json)
                .await?
        }
        _ => unreachable!("inspect answers the rest"),
    })
}

/// `tail`: the stream's messages after `after`; with `follow`, new ones as they come, forever.
async fn tail(
    db: &tokio_postgres::Client,
    stream: &str,
    mut after: i64,
    limit: i32,
    follow: bool,
    json: bool,
) -> Result<Rows, Failure> {
    loop {
        let batch = rows(
            db,
            "SELECT message_id, message_key, produced_at, payload FROM sqlstreams.peek($1, $2, $3)",
            &[&stream, &after, &limit],
        )
        .await?;
        if let Some(last) = batch.rows.last().and_then(|r| r.get("message_id")).and_then(Value::as_i64) {
            after = last;
        }
        if !follow {
            return Ok(batch);
        }
        if json {
            // One object per line (NDJSON): each can be read as it comes.
            for row in &batch.rows {
                println!("{row}");
            }
        } else if !batch.rows.is_empty() {
            print(&batch, json);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    match run(Cli::parse()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure::Database(e)) => {
            eprintln!("sqlstreams: {e}");
            ExitCode::FAILURE
        }
        Err(Failure::Refused(e)) => {
            eprintln!("sqlstreams: {e}");
            ExitCode::from(2)
        }
    }
}
