//! sqlstreams benchmarks: every workload for every system in one run, against the cluster in
//! `DATABASE_URL` (started by `scripts/rig bench` with durable settings). Writes
//! `results.md` and SVG plots to `--out` (default `docs/benchmarks`) and prints the ratios.
//!
//! Usage: sqlstreams-bench [--quick] [--out DIR] [--only w1,w2,w3,w4,w5,w6,w7,w8,w9,w10,w11]

mod cost;
mod drain;
mod growth;
mod poll;
mod processes;
mod report;
mod scaling;
mod soak;
mod stats;
mod systems;
mod workloads;

use std::path::PathBuf;

use report::Results;
use systems::System;
use workloads::{Bench, Keys};

const SYSTEMS: [System; 4] = [System::Sql, System::Client, System::Pgq, System::Floor];

#[tokio::main(flavor = "multi_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let quick = args.iter().any(|a| a == "--quick");
    let value = |flag: &str| args.iter().position(|a| a == flag).and_then(|i| args.get(i + 1)).cloned();
    let out = PathBuf::from(value("--out").unwrap_or_else(|| "docs/benchmarks".into()));
    let only: Vec<String> = value("--only").map(|o| o.split(',').map(str::to_string).collect()).unwrap_or_default();
    let run = |w: &str| only.is_empty() || only.iter().any(|o| o == w);
    let url = std::env::var("DATABASE_URL").map_err(|_| "DATABASE_URL is not set: run `scripts/rig bench`")?;

    let bench = Bench::new(&url, quick).await;
    bench.db.batch_execute("CREATE EXTENSION IF NOT EXISTS sqlstreams;").await?;
    if ["w1", "w3", "w5", "w10"].iter().any(|w| run(w)) {
        bench.db.batch_execute("CREATE EXTENSION IF NOT EXISTS pgq;").await?;
    }
    let mut results = Results {
        machine: machine(&bench).await,
        w1: vec![],
        w1_rounds: vec![],
        w2: vec![],
        w3: vec![],
        w4: vec![],
        w5: vec![],
        w7: vec![],
        w7_side_by_side: vec![],
        w8: vec![],
        w10: vec![],
        w10_rounds: vec![],
        w11: vec![],
        w6: vec![],
    };
    for (k, v) in &results.machine {
        println!("{k}: {v}");
    }

    if run("w1") {
        // Rounds, as W10's: an even count, since the ratios to PgQ pair each forward round with
        // the reversed one after it (stats::paired_ratio).
        let rounds = if bench.quick { 1 } else { 4 };
        let runs = stats::in_rounds(SYSTEMS.len(), rounds, |round, i| {
            let bench = &bench;
            async move {
                let t = bench.throughput(SYSTEMS[i], Keys::None).await;
                println!("W1 round {round} {:<20} consumed {:>8.0}/s produced {:>8.0}/s e2e p50 {:>7.1} ms p99 {:>7.1} ms missing {} duplicates {}",
                    SYSTEMS[i].name(), t.consume_rate, t.produce_rate, t.e2e_p50_ms, t.e2e_p99_ms, t.missing, t.duplicates);
                t
            }
        })
        .await;
        results.w1_rounds = runs.clone();
        results.w1 = runs.into_iter().filter_map(workloads::median_round).collect();
    }
    if run("w2") {
        for system in [System::Sql, System::Client] {
            for keys in [Keys::Ordered(1), Keys::Ordered(64), Keys::Ordered(1024), Keys::Exclusive(1024)] {
                let t = bench.throughput(system, keys).await;
                println!("W2 {:<20} {:<22} consumed {:>8.0}/s e2e p50 {:>7.1} ms missing {} duplicates {} order violations {}",
                    system.name(), t.label, t.consume_rate, t.e2e_p50_ms, t.missing, t.duplicates, t.order_violations);
                results.w2.push(t);
            }
        }
    }
    if run("w3") {
        for system in [System::Client, System::Sql, System::Pgq, System::Floor] {
            let l = bench.quiet(system).await;
            println!(
                "W3 {:<20} p50 {:>7.2} ms p99 {:>7.2} ms ({} samples, missing {})",
                system.name(),
                l.p50_ms,
                l.p99_ms,
                l.samples,
                l.missing
            );
            results.w3.push(l);
        }
    }
    if run("w4") {
        for l in [bench.hand_off_client().await, bench.hand_off_sql().await] {
            println!("W4 {:<45} p50 {:>7.3} ms p99 {:>7.3} ms ({} keys)", l.label, l.p50_ms, l.p99_ms, l.samples);
            results.w4.push(l);
        }
    }
    if run("w5") {
        for system in SYSTEMS {
            let i = bench.idle(system).await;
            println!(
                "W5 {:<20} {:>6.1} statements/s, {} transaction ids in {:.0} s",
                system.name(),
                i.statements_per_second,
                i.xids,
                i.seconds
            );
            results.w5.push(i);
        }
    }

    if run("w6") {
        // Rounds of both drains, interleaved, and each one's median round: one drain of each
        // moved by a third between runs on this machine.
        let cases = [Keys::None, Keys::Ordered(1024)];
        let rounds = if bench.quick { 1 } else { 4 };
        let runs = stats::in_rounds(cases.len(), rounds, |round, i| {
            let bench = &bench;
            async move {
                let c = bench.cost(cases[i]).await;
                if let Some(c) = &c {
                    println!(
                        "W6 round {round} {:<20} claim {:>6.0} µs of server time ({:.0} µs outside its statements), WAL {:>5.0} B per claim",
                        c.label, c.claim_us, c.outside_statements_us(), c.wal_bytes_per_claim
                    );
                }
                c
            }
        })
        .await;
        for case in runs {
            match stats::median_by(case.into_iter().flatten().collect(), |c| c.claim_us) {
                Some(c) => {
                    println!(
                        "W6 {:<20} claim {:>6.0} µs of server time (median of {rounds} rounds)",
                        c.label, c.claim_us
                    );
                    results.w6.push(c);
                }
                None => println!("W6: pg_stat_statements is not loaded; no per-statement costs"),
            }
        }
    }
    if run("w10") {
        // Rounds of every case, interleaved, and each case's median round: the machine's noise
        // moves single runs by more than the differences measured. An even count: the ratios
        // join each forward round with the reversed one after it (stats::paired_ratio).
        let rounds = if bench.quick { 1 } else { 6 };
        let runs = stats::in_rounds(drain::CASES.len(), rounds, |round, i| {
            let (system, keys) = drain::CASES[i];
            let bench = &bench;
            async move {
                let d = bench.drain(system, keys).await;
                println!(
                    "W10 round {round} {:<20} {:<20} {:>8.0}/s, server CPU {:>5.1} µs/msg, consumer CPU {:>5.1} µs/msg, WAL {:>4.0} B/msg, claim {:>6.0} µs, missing {} duplicates {}",
                    system.name(), d.label, d.rate, d.server_cpu_us_per_message, d.consumer_cpu_us_per_message, d.wal_bytes_per_message, d.claim_us, d.missing, d.duplicates
                );
                d
            }
        })
        .await;
        results.w10_rounds = runs.clone();
        results.w10 = runs.into_iter().filter_map(drain::median).collect();
    }
    if run("w11") {
        let stream = bench.idle_poll_stream().await;
        bench.pause_autovacuum().await;
        let rounds = if bench.quick { 2 } else { 8 };
        let runs = bench.idle_polls(&stream, rounds).await;
        bench.resume_autovacuum().await;
        results.w11 = poll::summarize(runs);
    }
    if run("w7") {
        // Consumers are threads with blocking connections: off the async runtime.
        let (url, quick) = (url.clone(), bench.quick);
        (results.w7, results.w7_side_by_side) =
            std::thread::spawn(move || (scaling::run_all(&url, quick), scaling::side_by_side(&url, quick)))
                .join()
                .expect("W7");
    }

    if run("w8") {
        results.w8 = soak::run(&url, bench.quick).await;
    }
    let growth = if run("w9") { Some(growth::run(&url, bench.quick).await) } else { None };

    std::fs::create_dir_all(&out)?;
    println!();
    // The results page holds every workload but W9, which has a page of its own, so each can be
    // re-run alone.
    if ["w1", "w2", "w3", "w4", "w5", "w6", "w7", "w8", "w10", "w11"].iter().any(|w| run(w)) {
        for line in results.ratios() {
            println!("{line}");
        }
        std::fs::write(out.join("results.md"), results.markdown())?;
        results.plots(&out)?;
        println!("wrote {}", out.join("results.md").display());
    }
    if let Some(growth) = growth {
        for line in growth.ratios() {
            println!("{line}");
        }
        growth.write(&out, &results.machine)?;
        println!("wrote {}", out.join("growth.md").display());
    }
    Ok(())
}

async fn machine(bench: &Bench) -> Vec<(String, String)> {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into());
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0);
    let mut facts = vec![("cpu".to_string(), format!("{cores} × {cpu}"))];
    let version: String = bench.db.query_one("SELECT version()", &[]).await.unwrap().get(0);
    facts.push(("postgres".into(), version));
    for setting in ["fsync", "synchronous_commit", "shared_buffers", "wal_level", "track_functions", "max_connections"]
    {
        let v: String = bench.db.query_one(&format!("SHOW {setting}"), &[]).await.unwrap().get(0);
        facts.push((setting.into(), v));
    }
    let pgq: Option<String> = bench
        .db
        .query_opt("SELECT extversion FROM pg_extension WHERE extname = 'pgq'", &[])
        .await
        .unwrap()
        .map(|r| r.get(0));
    if let Some(pgq) = pgq {
        facts.push(("PgQ".into(), format!("{pgq} (Debian postgresql-15-pgq3), ticker called every 50 ms")));
    }
    facts.push(("mode".into(), if bench.quick { "quick (short runs)".into() } else { "full".to_string() }));
    facts
}
