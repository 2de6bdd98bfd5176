//! Periodic messages with pg_cron: the recipe in docs/operations.md ("Periodic messages"), run
//! word for word. `scripts/rig test` restarts its cluster preloading pg_cron (Debian's
//! postgresql-15-cron, with `cron.database_name = 'cron_sqlstreams'` and background workers),
//! then runs this file with `--ignored`; without pg_cron there is nothing to test, and the rig
//! says so.

use std::time::{Duration, Instant};

use postgres::{Client, NoTls};

/// The recipe's SQL blocks, in order, from docs/operations.md: the admin's, then the job owner's.
fn recipe() -> Vec<String> {
    let docs = include_str!("../docs/operations.md");
    let (_, after) = docs.split_once("<!-- tests/periodic.rs runs these blocks -->").expect("the recipe's marker");
    let blocks: Vec<String> = after
        .split("```sql\n")
        .skip(1)
        .take(2)
        .map(|b| b.split_once("```").expect("a closed block").0.to_owned())
        .collect();
    assert_eq!(blocks.len(), 2, "the recipe has an admin block and a job owner's block");
    blocks
}

fn connect_as(user: &str) -> Client {
    let url = std::env::var("SQLSTREAMS_CRON_DATABASE_URL")
        .expect("SQLSTREAMS_CRON_DATABASE_URL is not set: scripts/rig test runs this on a cluster preloading pg_cron");
    let mut config: postgres::Config = url.parse().unwrap();
    config.user(user);
    config.connect(NoTls).expect("connect to the cron database")
}

/// The minute `c`'s clock is in.
fn minute(c: &mut Client) -> String {
    c.query_one("SELECT date_trunc('minute', clock_timestamp())::text", &[]).unwrap().get(0)
}

fn sweeps(c: &mut Client) -> Vec<(i64, String)> {
    c.query("SELECT message_id, payload::text FROM sqlstreams.peek('maintenance.sweep', 0, 1000)", &[])
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect()
}

#[test]
#[ignore = "needs a cluster preloading pg_cron: scripts/rig test runs it"]
fn a_cron_job_produces_once_per_tick_even_when_the_tick_runs_twice() {
    let [admin_sql, owner_sql] = <[String; 2]>::try_from(recipe()).unwrap();
    let mut admin = connect_as("postgres");
    admin
        .batch_execute(
            "CREATE EXTENSION IF NOT EXISTS sqlstreams; CREATE EXTENSION IF NOT EXISTS pg_cron;
             DO $$ BEGIN CREATE ROLE sweeper LOGIN; EXCEPTION WHEN duplicate_object THEN NULL; END $$;
             SELECT cron.unschedule(jobid) FROM cron.job WHERE jobname = 'sqlstreams-sweep';
             SELECT sqlstreams.drop_stream('maintenance.sweep');",
        )
        .unwrap();
    admin.batch_execute(&admin_sql).expect("the recipe's admin block");
    let mut owner = connect_as("sweeper");
    owner.batch_execute(&owner_sql).expect("the recipe's job owner block");

    // A doubled tick: the job's own command, as pg_cron stores it, run by its owner in three
    // transactions within one minute (runs that straddle a minute are two ticks: again).
    let command: String =
        owner.query_one("SELECT command FROM cron.job WHERE jobname = 'sqlstreams-sweep'", &[]).unwrap().get(0);
    let mut attempts = 0;
    let produced = loop {
        attempts += 1;
        let start = minute(&mut owner);
        owner.batch_execute(&command).unwrap();
        owner.batch_execute(&command).unwrap();
        // By hand, from a session in another time zone: the same tick.
        owner.batch_execute(&format!("SET TimeZone = 'Pacific/Kiritimati'; {command}; RESET TimeZone")).unwrap();
        if minute(&mut owner) == start {
            // The messages of that tick (pg_cron's own run of it included).
            let tick: String = owner
                .query_one("SELECT jsonb_build_object('tick', $1::text::timestamptz)::text", &[&start])
                .unwrap()
                .get(0);
            break sweeps(&mut admin).iter().filter(|(_, payload)| *payload == tick).count();
        }
        assert!(attempts < 3, "three attempts straddled a minute");
    };
    assert_eq!(produced, 1, "a tick run twice (and perhaps by pg_cron too) produced {produced} messages");

    // And pg_cron itself runs the job as its owner on the next minute (bounded wait: ticks are
    // a minute apart).
    let deadline = Instant::now() + Duration::from_secs(150);
    loop {
        let run: Option<String> = admin
            .query_opt(
                "SELECT d.status FROM cron.job_run_details d JOIN cron.job j USING (jobid)
                 WHERE j.jobname = 'sqlstreams-sweep' ORDER BY d.runid DESC LIMIT 1",
                &[],
            )
            .unwrap()
            .map(|r| r.get(0));
        match run.as_deref() {
            Some("succeeded") => break,
            Some("failed") => {
                let why: String = admin
                    .query_one("SELECT return_message FROM cron.job_run_details ORDER BY runid DESC LIMIT 1", &[])
                    .unwrap()
                    .get(0);
                panic!("pg_cron ran the job and it failed: {why}");
            }
            _ => {}
        }
        assert!(Instant::now() < deadline, "pg_cron did not run the job within two and a half minutes");
        std::thread::sleep(Duration::from_millis(500));
    }
    let all = sweeps(&mut admin);
    let minutes: std::collections::HashSet<&str> = all.iter().map(|(_, p)| p.as_str()).collect();
    assert!(!all.is_empty() && minutes.len() == all.len(), "one message per minute: {all:?}");
    owner.batch_execute("SELECT cron.unschedule('sqlstreams-sweep')").unwrap();
}
