//! The admin CLI (`client/src/bin/sqlstreams.rs`) against the throwaway cluster: every command,
//! as an operator runs it, in table and JSON form.

use std::process::Command;

use serde_json::Value;
use sqlstreams_tests::*;

/// Runs the CLI with `args`; returns (success, stdout, stderr).
fn cli(args: &[&str]) -> (bool, String, String) {
    let bin = std::env::var("SQLSTREAMS_CLI").expect("SQLSTREAMS_CLI is not set: run `scripts/rig test`");
    let out = Command::new(bin).args(args).env("DATABASE_URL", database_url()).output().expect("run the CLI");
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into(), String::from_utf8_lossy(&out.stderr).into())
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
    let redriven = json(&[&["dead", "redrive"][..], &target[..], &["--ids", &produced[0].to_string()][..]].concat());
    assert_eq!(redriven[0]["redriven"], produced[0]);
    assert!(json(&[&["dead", "purge"][..], &target[..]].concat())[0]["purged"] == 0);

    assert_eq!(json(&[&["pause"][..], &target[..]].concat())[0]["paused"], true);
    assert!(g.claim(&mut c, 10).is_empty());
    assert_eq!(json(&[&["resume"][..], &target[..]].concat())[0]["resumed"], true);

    assert_eq!(json(&[&["seek"][..], &target[..], &["--to-id", "0"][..]].concat())[0]["position"], 0);
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
