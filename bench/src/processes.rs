//! Where a run's server CPU goes, by process: the producers' backends, the consumer's (with its
//! LISTEN connection), the client system's pool (its producers and consumer share it, so they
//! cannot be told apart), PgQ's ticker, the WAL writer, autovacuum, the rest.
//!
//! Each connection of a run names its role in `application_name` (`role_url`). A sampler reads
//! every process of the cluster from `/proc` every 100 ms, and asks `pg_stat_activity` what each
//! one is every 500 ms; a process is known by its pid and start time, so a pid used again is
//! another process. What a process spent up to its last read counts for its kind; a process
//! that lived between two questions (a short autovacuum worker) counts as "other", and what
//! ended processes spent after their last read, or unseen, is left in "other" through the
//! cluster's total, which counts them as the postmaster reaped them.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::systems::System;
use crate::workloads::Throughput;

/// What a connection of a run does, as its `application_name` says.
#[derive(Clone, Copy, Debug)]
pub enum Role {
    Producer,
    Consumer,
    /// The client system's one `sqlstreams_client::Client`, whose pool both its producers and
    /// its consumer use.
    Client,
    Ticker,
}

impl Role {
    fn application_name(self) -> &'static str {
        match self {
            Role::Producer => "bench-producer",
            Role::Consumer => "bench-consumer",
            Role::Client => "bench-client",
            Role::Ticker => "bench-ticker",
        }
    }
}

/// `url` with the role's `application_name`.
pub fn role_url(url: &str, role: Role) -> String {
    let separator = if url.contains('?') { '&' } else { '?' };
    format!("{url}{separator}application_name={}", role.application_name())
}

/// The kinds of process a breakdown reports, in its columns' order.
pub const KINDS: [&str; 8] = [
    "producers",
    "consumer",
    "producers and consumer, one client pool",
    "PgQ ticker",
    "WAL writer",
    "autovacuum",
    "checkpointer, background writer",
    "other",
];

fn kind(backend_type: &str, application_name: &str) -> &'static str {
    match (backend_type, application_name) {
        ("client backend", "bench-producer") => KINDS[0],
        ("client backend", "bench-consumer") => KINDS[1],
        ("client backend", "bench-client") => KINDS[2],
        ("client backend", "bench-ticker") => KINDS[3],
        ("walwriter", _) => KINDS[4],
        ("autovacuum worker", _) => KINDS[5],
        ("checkpointer" | "background writer", _) => KINDS[6],
        _ => KINDS[7],
    }
}

/// The postmaster of the cluster whose data directory is `data_dir`, and its children now.
pub fn cluster_pids(data_dir: &str) -> (u32, Vec<u32>) {
    let postmaster: u32 = std::fs::read_to_string(format!("{data_dir}/postmaster.pid"))
        .ok()
        .and_then(|s| s.lines().next().and_then(|l| l.trim().parse().ok()))
        .unwrap_or(0);
    let Ok(dir) = std::fs::read_dir("/proc") else { return (postmaster, vec![]) };
    let pids = dir
        .flatten()
        .filter_map(|entry| entry.file_name().to_string_lossy().parse::<u32>().ok())
        .filter(|&pid| {
            // Fields after the command (which may hold spaces) start after the last ')':
            // state, then the parent's pid.
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            let parent = stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().nth(1));
            pid == postmaster || parent.and_then(|p| p.parse::<u32>().ok()) == Some(postmaster)
        })
        .collect();
    (postmaster, pids)
}

/// CPU time of process `pid` so far, in µs (`None` once it has ended).
pub fn cpu_us(pid: u32) -> Option<u64> {
    let schedstat = std::fs::read_to_string(format!("/proc/{pid}/schedstat")).ok()?;
    schedstat.split_whitespace().next()?.parse::<u64>().ok().map(|ns| ns / 1000)
}

/// A process: its pid and its start time (field 22 of `/proc/<pid>/stat`, after the command).
type Process = (u32, u64);

fn process(pid: u32) -> Option<Process> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, rest) = stat.rsplit_once(')')?;
    rest.split_whitespace().nth(19)?.parse().ok().map(|start| (pid, start))
}

/// A sampler running beside a run (`start`, then `stop`).
pub struct Sampler {
    stop: CancellationToken,
    task: tokio::task::JoinHandle<BTreeMap<&'static str, u64>>,
}

impl Sampler {
    pub fn start(url: &str, data_dir: &str) -> Sampler {
        let (url, data_dir, stop) = (url.to_string(), data_dir.to_string(), CancellationToken::new());
        let stopped = stop.clone();
        let task = tokio::spawn(async move {
            // Per process: its CPU when first read (0 for one that started during the run) and
            // when last read, and its kind.
            let read = |pids: Vec<u32>| pids.into_iter().filter_map(|pid| Some((process(pid)?, cpu_us(pid)?)));
            let mut seen: HashMap<Process, (u64, u64)> =
                read(cluster_pids(&data_dir).1).map(|(p, cpu)| (p, (cpu, cpu))).collect();
            let mut kinds: HashMap<Process, &'static str> = HashMap::new();
            let db = crate::systems::connect(&url).await;
            let activity =
                "SELECT pid, coalesce(backend_type, ''), coalesce(application_name, '') FROM pg_stat_activity";
            for round in 0u64.. {
                if round % 5 == 0 {
                    for r in db.query(activity, &[]).await.unwrap_or_default() {
                        if let Some(p) = process(r.get::<_, i32>(0) as u32) {
                            kinds.insert(p, kind(r.get(1), r.get(2)));
                        }
                    }
                }
                for (p, cpu) in read(cluster_pids(&data_dir).1) {
                    seen.entry(p).or_insert((0, 0)).1 = cpu;
                }
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(100)) => {}
                    _ = stopped.cancelled() => break,
                }
            }
            let mut by_kind = BTreeMap::new();
            for (p, (first, last)) in seen {
                *by_kind.entry(kinds.get(&p).copied().unwrap_or(KINDS[7])).or_insert(0) += last.saturating_sub(first);
            }
            by_kind
        });
        Sampler { stop, task }
    }

    /// Each kind's CPU in µs, with "other" topped up to `total` (the cluster's CPU over the run,
    /// ended processes included). Nothing, if the sampler did not answer within 10 s.
    pub async fn stop(self, total: u64) -> BTreeMap<&'static str, u64> {
        self.stop.cancel();
        let mut task = self.task;
        let mut by_kind = match tokio::time::timeout(Duration::from_secs(10), &mut task).await {
            Ok(Ok(by_kind)) => by_kind,
            _ => {
                task.abort();
                eprintln!("the CPU sampler did not answer: this run's CPU is all \"other\"");
                BTreeMap::new()
            }
        };
        let attributed: u64 = by_kind.values().sum();
        *by_kind.entry(KINDS[7]).or_insert(0) += total.saturating_sub(attributed);
        by_kind
    }
}

/// W1's table: each system's median round by kind of process, in µs per message produced.
pub fn section(rows: &[Throughput]) -> String {
    let mut t = format!(
        "### Where W1's server CPU goes\n\nThe server CPU above of each system's median round, by process, in µs \
         per message produced (bench/src/processes.rs): the backends of the producers' connections, the \
         consumer's (with its LISTEN connection), the client system's pool (its producers and its consumer share \
         it), PgQ's ticker's, then the cluster's own processes. \"other\" is the rest: the bench's own \
         connections, processes that came and went between two looks, and what ended processes spent after the \
         sampler's last look (every 100 ms).\n\n| system | {} | total |\n|---|{}---|\n",
        KINDS.join(" | "),
        "---|".repeat(KINDS.len())
    );
    for r in rows {
        let cells: Vec<String> = r.server_cpu_by_process.iter().map(|us| format!("{us:.2}")).collect();
        let system = r.system.map_or("?", System::name);
        let _ = writeln!(t, "| {system} | {} | {:.1} |", cells.join(" | "), r.server_cpu_us_per_message);
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roles_join_the_url() {
        assert_eq!(
            role_url("postgres://u@h:1/db", Role::Producer),
            "postgres://u@h:1/db?application_name=bench-producer"
        );
        assert_eq!(
            role_url("postgres://u@h:1/db?sslmode=disable", Role::Ticker),
            "postgres://u@h:1/db?sslmode=disable&application_name=bench-ticker"
        );
    }

    #[test]
    fn processes_are_told_apart() {
        assert_eq!(kind("client backend", "bench-consumer"), "consumer");
        assert_eq!(kind("client backend", "bench-client"), "producers and consumer, one client pool");
        assert_eq!(kind("client backend", "psql"), "other");
        assert_eq!(kind("walwriter", ""), "WAL writer");
        assert_eq!(kind("autovacuum worker", ""), "autovacuum");
    }
}
