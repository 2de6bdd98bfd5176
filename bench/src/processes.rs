//! Where a run's server CPU goes, by process: the producers' backends, the consumer's (with its
//! LISTEN connection), the client system's pool (its producers and consumer share it, so they
//! cannot be told apart), PgQ's ticker, the WAL writer, autovacuum, the rest.
//!
//! Each connection of a run names its role in `application_name` (`role_url`). A sampler reads
//! every process of the cluster from `/proc` every 100 ms and asks `pg_stat_activity` what each
//! one is; a process that ends between two reads (a producer's connection at the end of its run,
//! an autovacuum worker) is counted up to its last read, and what it spent after that, with any
//! process that came and went unseen, is left in "other" through the cluster's total.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

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
fn cpu_us(pid: u32) -> Option<u64> {
    let schedstat = std::fs::read_to_string(format!("/proc/{pid}/schedstat")).ok()?;
    schedstat.split_whitespace().next()?.parse::<u64>().ok().map(|ns| ns / 1000)
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
            let db = crate::systems::connect(&url).await;
            // Per process: its CPU when first read (0 for one that started during the run) and
            // when last read, and its kind.
            let (_, at_start) = cluster_pids(&data_dir);
            let mut seen: HashMap<u32, (u64, u64)> =
                at_start.iter().filter_map(|&pid| cpu_us(pid).map(|cpu| (pid, (cpu, cpu)))).collect();
            let mut kinds: HashMap<u32, &'static str> = HashMap::new();
            for round in 0u64.. {
                if round % 5 == 0 {
                    let rows = db
                        .query("SELECT pid, coalesce(backend_type, ''), coalesce(application_name, '') FROM pg_stat_activity", &[])
                        .await
                        .unwrap_or_default();
                    for r in rows {
                        let pid: i32 = r.get(0);
                        kinds.insert(pid as u32, kind(r.get(1), r.get(2)));
                    }
                }
                for pid in cluster_pids(&data_dir).1 {
                    if let Some(cpu) = cpu_us(pid) {
                        seen.entry(pid).or_insert((0, 0)).1 = cpu;
                    }
                }
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(100)) => {}
                    _ = stopped.cancelled() => break,
                }
            }
            let mut by_kind = BTreeMap::new();
            for (pid, (first, last)) in seen {
                *by_kind.entry(kinds.get(&pid).copied().unwrap_or(KINDS[7])).or_insert(0) += last.saturating_sub(first);
            }
            by_kind
        });
        Sampler { stop, task }
    }

    /// Each kind's CPU in µs, with "other" topped up to `total` (the cluster's CPU over the run,
    /// ended processes included).
    pub async fn stop(self, total: u64) -> BTreeMap<&'static str, u64> {
        self.stop.cancel();
        let mut by_kind = self.task.await.unwrap_or_default();
        let attributed: u64 = by_kind.values().sum();
        *by_kind.entry(KINDS[7]).or_insert(0) += total.saturating_sub(attributed);
        by_kind
    }
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
