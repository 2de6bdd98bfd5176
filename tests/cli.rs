//! The admin CLI (`client/src/bin/sqlstreams/main.rs`) against the throwaway cluster: every command,
//! as an operator runs it, in table and JSON form.

use std::process::Command;

use serde_json::Value;
use sqlstreams_tests::*;

fn cli_command() -> Command {
    let bin = std::env::var("SQLSTREAMS_CLI").expect("SQLSTREAMS_CLI is not set: run `scripts/rig test`");
    let mut command = Command::new(bin);
    // No terminal to ask on: a change needs --yes.
    command.env("DATABASE_URL", database_url()).stdin(std::process::Stdio::null());
    command
}

/// Runs the CLI with `args`; returns (exit code, stdout, stderr).
fn run(args: &[&str]) -> (i32, String, String) {
    let out = cli_command().args(args).output().expect("run the CLI");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

/// Runs the CLI with `args`; returns (success, stdout, stderr).
fn cli(args: &[&str]) -> (bool, String, String) {
    let (code, out, err) = run(args);
    (code == 0, out, err)
}

fn json(args: &[&str]) -> Vec<Value> {
    let mut all = vec!["--json"];
    all.extend_from_slice(args);
    let (ok, out, err) = cli(&all);
    assert!(ok, "{args:?}: {err}");
    serde_json::from_str::<Value>(&out).unwrap().as_array().unwrap().clone()
}

#[test]
fn an_operator_inspects_and_repairs_a_group_from_the_command_line() {
    let mut c = connect();
    let s = Stream::create(&mut c, "cli");
    let g = s.group(&mut c, "billing", Some("ordered"));
    let produced = s.produce_many(&mut c, 3, Some("acct-1"));
    let batch = g.claim(&mut c, 10);
    g.fail(&mut c, &batch[0], "card declined", true, None);
    let target = ["--stream", &s.name, "--group", "billing"];

    let status = json(&["status", "--stream", &s.name]);
    assert_eq!(status.len(), 1);
    assert_eq!(status[0]["group"], "billing");
    assert_eq!(status[0]["dead"], 1);
    let (ok, table, _) = cli(&["status", "--stream", &s.name]);
    assert!(ok && table.lines().next().unwrap().starts_with("stream") && table.contains("billing"), "{table}");

    let lag = json(&[&["lag"][..], &target[..]].concat());
    assert_eq!(lag[0]["head"], produced[2]);

    let dead = json(&[&["dead", "list"][..], &target[..]].concat());
    assert_eq!(
        (dead[0]["message_id"].as_i64(), dead[0]["last_error"].as_str()),
        (Some(produced[0]), Some("card declined"))
    );
    let redriven =
        json(&[&["dead", "redrive", "--yes"][..], &target[..], &["--ids", &produced[0].to_string()][..]].concat());
    assert_eq!(redriven[0]["redriven"], produced[0]);
    assert!(json(&[&["dead", "purge", "--all", "--yes"][..], &target[..]].concat())[0]["purged"] == 0);

    assert_eq!(json(&[&["pause"][..], &target[..]].concat())[0]["paused"], true);
    assert!(g.claim(&mut c, 10).is_empty());
    assert_eq!(json(&[&["resume"][..], &target[..]].concat())[0]["resumed"], true);

    let seek = [&["seek", "--force", "--yes"][..], &target[..], &["--to-id", "0"][..]].concat();
    assert_eq!(json(&seek)[0]["position"], 0);
    assert_eq!(ids(&g.claim(&mut c, 1)), vec![produced[0]], "replayed from the beginning");

    let tail = json(&["tail", "--stream", &s.name, "--after", &produced[0].to_string()]);
    let tailed: Vec<i64> = tail.iter().map(|m| m["message_id"].as_i64().unwrap()).collect();
    assert_eq!(tailed, produced[1..]);

    // Refusals come back as a failure with the server's message and hint.
    let (ok, _, err) = cli(&["lag", "--stream", &s.name, "--group", "nobody"]);
    assert!(!ok && err.contains("does not exist") && err.contains("42704") && err.contains("hint:"), "{err}");
}

/// Runs the CLI against `url` with PGSSLROOTCERT set to `root`.
fn cli_tls(url: &str, root: &str, args: &[&str]) -> (bool, String, String) {
    let bin = std::env::var("SQLSTREAMS_CLI").expect("SQLSTREAMS_CLI is not set: run `scripts/rig test`");
    let out = Command::new(bin).args(args).env("DATABASE_URL", url).env("PGSSLROOTCERT", root).output().unwrap();
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into(), String::from_utf8_lossy(&out.stderr).into())
}

#[test]
fn the_cli_connects_over_tls_and_verifies_the_server() {
    let mut c = connect();
    let s = Stream::create(&mut c, "cli-tls");
    s.group(&mut c, "g", None);
    let Some(ca) = test_ca() else { return };
    let url = format!("{}?sslmode=require", database_url());
    let (ok, out, err) = cli_tls(&url, &ca, &["--json", "status", "--stream", &s.name]);
    assert!(ok, "{err}");
    assert_eq!(serde_json::from_str::<Value>(&out).unwrap()[0]["group"], "g");

    // The server's own certificate is not the authority that signed it: refused, so the
    // connection above was TLS and verified.
    let not_the_ca = std::path::Path::new(&ca).with_file_name("server.crt");
    let (ok, _, err) = cli_tls(&url, not_the_ca.to_str().unwrap(), &["status", "--stream", &s.name]);
    assert!(!ok && err.to_lowercase().contains("certificate"), "{err}");
}

/// What (group_status) claimed, and the dead messages' ids, of `g`.
fn state(c: &mut postgres::Client, s: &Stream) -> (i64, Vec<i64>) {
    let claimed: i64 = c.query_one("SELECT claimed FROM sqlstreams.group_status($1, 'g')", &[&s.name]).unwrap().get(0);
    let dead = c.query("SELECT message_id FROM sqlstreams.dead_messages($1, 'g') ORDER BY 1", &[&s.name]).unwrap();
    (claimed, dead.iter().map(|r| r.get(0)).collect())
}

#[test]
fn a_change_is_previewed_confirmed_and_bounded_in_time() {
    let mut c = connect();
    let s = Stream::create(&mut c, "cli-confirm");
    let g = s.group(&mut c, "g", None);
    let produced = s.produce_many(&mut c, 2, None);
    for d in g.claim(&mut c, 10) {
        g.fail(&mut c, &d, "broken", true, None);
    }
    let target = ["--stream", s.name.as_str(), "--group", "g"];
    fn args_for<'a>(args: &[&'a str], target: &[&'a str]) -> Vec<&'a str> {
        [args, target].concat()
    }
    let with = |args: &[&'static str]| args_for(args, &target);
    let before = state(&mut c, &s);
    assert_eq!(before.1, produced);

    // Purging every dead letter is said, not defaulted to.
    let (code, _, err) = run(&with(&["dead", "purge"]));
    assert!(code == 2 && err.contains("--older-than"), "{code} {err}");

    // A dry run shows what would change and changes nothing.
    let preview = json(&with(&["dead", "redrive", "--dry-run"]));
    let previewed: Vec<i64> = preview.iter().map(|r| r["redriven"].as_i64().unwrap()).collect();
    assert_eq!(previewed, produced);
    assert_eq!(state(&mut c, &s), before, "a dry run changes nothing");
    // Without --yes and without a terminal to ask on: refused, nothing changed.
    let (code, _, err) = run(&with(&["dead", "redrive"]));
    assert!(code == 2 && err.contains("--yes"), "{code} {err}");
    assert_eq!(state(&mut c, &s), before);
    let purged = json(&with(&["dead", "purge", "--all", "--dry-run"]));
    assert_eq!(purged[0]["purged"], 2);
    assert_eq!(state(&mut c, &s), before);

    // Redriven for real, then claimed: a consumer holds an open lease.
    assert_eq!(json(&with(&["dead", "redrive", "--yes"])).len(), 2);
    let held = g.claim(&mut c, 10);
    assert_eq!(ids(&held), produced);
    let claimed = state(&mut c, &s).0;
    let (code, _, err) = run(&with(&["seek", "--to-id", "0", "--yes"]));
    assert!(code == 2 && err.contains("open lease") && err.contains("--force"), "{code} {err}");
    assert_eq!(json(&with(&["seek", "--to-id", "0", "--force", "--dry-run"]))[0]["position"], 0);
    assert_eq!(state(&mut c, &s).0, claimed, "the dry run did not move the group");

    // A seek waits for the calls in progress on its group: here a claim whose transaction stays
    // open. The statement timeout ends the wait instead of hanging.
    let mut open = connect();
    let mut tx = open.transaction().unwrap();
    tx.query("SELECT * FROM sqlstreams.claim($1, 'g', 1)", &[&s.name]).unwrap();
    let (code, _, err) = run(&with(&["--statement-timeout", "1s", "seek", "--to-id", "0", "--force", "--yes"]));
    assert!(code == 1 && err.contains("57014"), "{code} {err}");
    tx.rollback().unwrap();
    assert_eq!(state(&mut c, &s).0, claimed, "the seek that timed out changed nothing");
}

/// A seek is refused while consumers hold open leases, not for expired work a claim took over
/// and left for the next claim of its lane: no consumer holds that (its outcomes could not be
/// lost), and a paused group, as the refusal advises, would never hand it out.
#[test]
fn a_seek_is_not_refused_for_work_no_consumer_holds() {
    let mut c = connect();
    let s = Stream::create(&mut c, "cli-seek-left");
    let g = s.group(&mut c, "g", Some("exclusive"));
    let produced: Vec<i64> = (0..3).map(|_| s.produce(&mut c, json!({}), Some("k"))).collect();
    assert_eq!(ids(&g.claim(&mut c, 10)), produced, "the consumer that dies");
    g.expire_leases(&mut c);
    let taken = g.claim(&mut c, 1);
    assert_eq!(ids(&taken), produced[..1], "the claim that takes the lane over, with room for one");
    assert!(g.ack(&mut c, &taken[0]));
    let left: Vec<(String, uuid::Uuid)> = c
        .query("SELECT kind, lease_token FROM sqlstreams.open_leases($1, 'g')", &[&s.name])
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert!(
        left.len() == 1 && left[0].0 == "range" && left[0].1.get_version_num() == 8,
        "only the rest, under a token no consumer holds: {left:?}"
    );

    let target = ["--stream", s.name.as_str(), "--group", "g"];
    let moved = json(&[&["seek", "--to-id", "0", "--yes"][..], &target[..]].concat());
    assert_eq!(moved[0]["position"], 0, "not refused: no consumer holds a lease");
    assert_eq!(ids(&g.claim(&mut c, 10)), produced, "replayed from the start");
    // Now a consumer holds them (the range, and the lane it holds): refused.
    let (code, _, err) = run(&[&["seek", "--to-id", "0", "--yes"][..], &target[..]].concat());
    assert!(code == 2 && err.contains("2 open lease(s) held by consumers") && err.contains("--force"), "{code} {err}");
}

#[test]
fn tail_follow_json_prints_one_object_per_line() {
    use std::io::{BufRead, BufReader};
    let mut c = connect();
    let s = Stream::create(&mut c, "cli-ndjson");
    let produced = s.produce_many(&mut c, 3, None);
    let mut follow = cli_command()
        .args(["--json", "tail", "--stream", &s.name, "--follow", "--limit", "2"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(follow.stdout.take().unwrap()).lines();
    let read: Vec<i64> = (0..3)
        .map(|_| {
            let line = lines.next().expect("a line").unwrap();
            serde_json::from_str::<Value>(&line).expect("each line is one JSON object")["message_id"].as_i64().unwrap()
        })
        .collect();
    follow.kill().unwrap();
    let _ = follow.wait();
    assert_eq!(read, produced, "in order, across two reads of two");
}

#[test]
fn an_operator_lists_describes_alters_and_skips_from_the_command_line() {
    let mut c = connect();
    let s = Stream::create(&mut c, "cli-describe");
    let g = s.group(&mut c, "g", Some("ordered"));
    let target = ["--stream", s.name.as_str(), "--group", "g"];

    let streams = json(&["streams"]);
    let listed = streams.iter().find(|r| r["name"] == s.name.as_str()).expect("the stream is listed");
    assert_eq!(listed["lanes"], 16);

    // Settings change only where given.
    let altered = json(&["alter-stream", "--stream", &s.name, "--max-age", "30 days"]);
    assert_eq!(altered[0]["altered"], true);
    let altered = json(
        &[&["alter-group"][..], &target[..], &["--max-retries", "5", "--on-dead", "hold", "--max-inflight", "100"][..]]
            .concat(),
    );
    assert_eq!(altered[0]["altered"], true);
    // With on_dead = 'hold', a key stops at its dead message.
    let produced = s.produce_many(&mut c, 2, Some("k"));
    let first = g.claim(&mut c, 1);
    g.fail(&mut c, &first[0], "broken", true, None);
    // describe: the stream, then its groups, one JSON array each.
    let (ok, out, err) = cli(&["--json", "describe", "--stream", &s.name]);
    assert!(ok, "{err}");
    let parts: Vec<Value> = out.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(parts.len(), 2, "{out}");
    assert_eq!(parts[0][0]["max_age"], "720:00:00", "30 days, as the bound is stored");
    assert_eq!((parts[1][0]["group"].as_str(), parts[1][0]["max_retries"].as_i64()), (Some("g"), Some(5)));
    assert_eq!(parts[1][0]["on_dead"], "hold");
    assert_eq!(parts[1][0]["max_inflight"], 100);

    // The held key's dead message, skipped: previewed first, then for real; the key goes on.
    let id = produced[0].to_string();
    let skip = [&["dead", "skip"][..], &target[..], &["--id", &id][..]].concat();
    assert_eq!(json(&[&skip[..], &["--dry-run"][..]].concat())[0]["skipped"], true);
    assert_eq!(g.claim(&mut c, 10).len(), 0, "the dry run left the key held");
    assert_eq!(json(&[&skip[..], &["--yes"][..]].concat())[0]["skipped"], true);
    assert_eq!(ids(&g.claim(&mut c, 10)), produced[1..], "skipped: the key goes on");

    // A producer that has not committed holds the fence back, and shows.
    let mut producer = connect();
    let mut tx = producer.transaction().unwrap();
    let pid: i32 = tx.query_one("SELECT pg_backend_pid()", &[]).unwrap().get(0);
    tx.query_one("SELECT sqlstreams.produce($1, '{}')", &[&s.name]).unwrap();
    let holders = json(&["fence-holders", "--stream", &s.name]);
    assert_eq!(holders.iter().map(|h| h["pid"].as_i64().unwrap()).collect::<Vec<_>>(), vec![pid as i64]);
    tx.rollback().unwrap();
    assert!(json(&["fence-holders", "--stream", &s.name]).is_empty());

    let (ok, script, _) = cli(&["completions", "bash"]);
    assert!(ok && script.contains("_sqlstreams") && script.contains("fence-holders"), "a bash completion script");
}

/// Runs the CLI with no connection string: libpq's variables and password file only.
fn run_env(vars: &[(&str, &str)], args: &[&str]) -> (i32, String) {
    let mut command = cli_command();
    // Only what the test sets: nothing inherited from the shell that runs the suite.
    for name in [
        "DATABASE_URL",
        "PGHOST",
        "PGHOSTADDR",
        "PGPORT",
        "PGUSER",
        "PGDATABASE",
        "PGPASSWORD",
        "PGPASSFILE",
        "PGSSLMODE",
        "PGOPTIONS",
        "PGSERVICE",
        "PGAPPNAME",
        "PGCONNECT_TIMEOUT",
        "PGTARGETSESSIONATTRS",
    ] {
        command.env_remove(name);
    }
    let out = command.envs(vars.iter().copied()).args(args).output().unwrap();
    (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stderr).into())
}

#[test]
fn without_a_connection_string_the_cli_reads_libpqs_environment_and_password_file() {
    use std::os::unix::fs::PermissionsExt;
    let mut c = connect();
    // The rig makes members of this group log in with a password (scripts/rig: start_cluster).
    c.batch_execute(
        "DO $$ BEGIN CREATE ROLE sqlstreams_password_login NOLOGIN;
         EXCEPTION WHEN duplicate_object THEN NULL; END $$",
    )
    .unwrap();
    let password = r"pa:ss\word";
    let who = role(
        &mut c,
        "pgpass",
        &format!("PASSWORD '{password}' IN ROLE sqlstreams_password_login, sqlstreams_consumer"),
    );
    let config: postgres::Config = database_url().parse().unwrap();
    let (port, db) = (config.get_ports()[0].to_string(), config.get_dbname().unwrap().to_owned());
    let home = std::env::temp_dir().join(format!("sqlstreams-cli-{who}"));
    std::fs::create_dir_all(&home).unwrap();
    let write = |name: &str, secret: &str, mode: u32| {
        let path = home.join(name);
        let escaped = secret.replace('\\', r"\\").replace(':', r"\:");
        std::fs::write(&path, format!("# ours\nelsewhere:*:*:*:nope\n127.0.0.1:{port}:{db}:{who}:{escaped}\n"))
            .unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
        path.to_str().unwrap().to_owned()
    };
    let home_str = home.to_str().unwrap().to_owned();
    let base =
        [("PGHOST", "127.0.0.1"), ("PGPORT", port.as_str()), ("PGUSER", who.as_str()), ("PGDATABASE", db.as_str())];
    let with = |extra: &[(&str, &str)]| -> (i32, String) {
        let mut vars = base.to_vec();
        vars.extend_from_slice(extra);
        run_env(&vars, &["streams"])
    };

    write(".pgpass", password, 0o600);
    let (code, err) = with(&[("HOME", &home_str)]);
    assert_eq!(code, 0, "~/.pgpass gives the password: {err}");

    let wrong = write("wrong", "not-it", 0o600);
    let (code, err) = with(&[("HOME", &home_str), ("PGPASSFILE", &wrong)]);
    assert!(code == 1 && err.contains("password authentication failed"), "PGPASSFILE is read first: {code} {err}");

    let (code, err) = with(&[("HOME", "/nonexistent"), ("PGPASSWORD", password)]);
    assert_eq!(code, 0, "PGPASSWORD: {err}");

    let (code, err) = with(&[("HOME", "/nonexistent")]);
    assert!(code == 1 && err.contains("password"), "no password, no login: {code} {err}");

    write(".pgpass", password, 0o644);
    let (code, err) = with(&[("HOME", &home_str)]);
    assert!(code == 1 && err.contains("password missing"), "a file others may read is ignored: {code} {err}");
    std::fs::remove_dir_all(&home).unwrap();
}
