//! The results page (markdown) and its plots (SVG), plus the ratios printed at the end.

use std::fmt::Write as _;
use std::path::Path;

use plotters::prelude::*;

use crate::scaling::{Policy, Scaling, CONSUMERS, HANDLER_US};
use crate::systems::System;
use crate::workloads::{Idle, Latency, Throughput};

mod rounds;
use rounds::rounds_table;

pub struct Results {
    pub machine: Vec<(String, String)>,
    pub w1: Vec<Throughput>,
    /// Every W1 round of every system, in `SYSTEMS` order, for the paired ratios.
    pub w1_rounds: Vec<Vec<Throughput>>,
    pub w2: Vec<Throughput>,
    pub w3: Vec<Latency>,
    pub w4: Vec<Latency>,
    pub w5: Vec<Idle>,
    pub w7: Vec<Scaling>,
    /// W7's one-consumer drains without handler cost, side by side (`scaling::side_by_side`).
    pub w7_side_by_side: Vec<Vec<Scaling>>,
    pub w8: Vec<crate::soak::Sample>,
    pub w10: Vec<crate::drain::Drain>,
    /// Every W10 round of every case, in `drain::CASES` order, for the paired ratios.
    pub w10_rounds: Vec<Vec<crate::drain::Drain>>,
    pub w11: Vec<crate::poll::Polled>,
    pub w6: Vec<crate::cost::Cost>,
}

fn name(system: Option<System>) -> &'static str {
    system.map_or("?", System::name)
}

fn find(rows: &[Throughput], system: System) -> Option<&Throughput> {
    rows.iter().find(|t| t.system == Some(system))
}

fn per_call_us(t: &Throughput, function: &str) -> Option<(i64, f64)> {
    t.functions
        .iter()
        .find(|(f, _, _)| f == function)
        .map(|(_, calls, ms)| (*calls, ms * 1000.0 / (*calls).max(1) as f64))
}

fn ratio(a: f64, b: f64) -> String {
    if a.is_finite() && b.is_finite() && b != 0.0 {
        format!("{:.2}×", a / b)
    } else {
        "n/a".into()
    }
}

impl Results {
    /// Ratios of sqlstreams to PgQ and to the floor, as lines for the terminal and the page.
    pub fn ratios(&self) -> Vec<String> {
        let mut lines = Vec::new();
        let sql = find(&self.w1, System::Sql);
        let client = find(&self.w1, System::Client);
        // W1's rounds of a system, and a ratio over them (`stats::paired_ratio`).
        let rounds = |system| {
            self.w1_rounds
                .iter()
                .find(|r| r.first().is_some_and(|t| t.system == Some(system)))
                .map_or(&[][..], Vec::as_slice)
        };
        let paired =
            |a, b, value: fn(&Throughput) -> f64| ratio(crate::stats::paired_ratio(rounds(a), rounds(b), value), 1.0);
        let has = |system| !rounds(system).is_empty();
        for (label, ours) in [("SQL", System::Sql), ("client", System::Client)] {
            if !has(ours) {
                continue;
            }
            if has(System::Pgq) {
                lines.push(format!(
                    "W1 consumed/s, sqlstreams ({label}) / PgQ: {}   e2e p50, sqlstreams / PgQ: {}",
                    paired(ours, System::Pgq, |t| t.consume_rate),
                    paired(ours, System::Pgq, |t| t.e2e_p50_ms)
                ));
            }
            if has(System::Floor) {
                lines.push(format!(
                    "W1 consumed/s, sqlstreams ({label}) / floor: {}",
                    paired(ours, System::Floor, |t| t.consume_rate)
                ));
            }
            // The W1 targets, each against its bound.
            let kept_up = crate::stats::median(rounds(ours).iter().map(|t| t.consume_rate / t.produce_rate).collect());
            lines
                .push(format!("W1 sqlstreams ({label}) consumed / produced: {} (target ≥ 0.97×)", ratio(kept_up, 1.0)));
            if has(System::Pgq) {
                lines.push(format!(
                    "W1 sqlstreams ({label}) / PgQ: produced/s {} (target ≥ 0.95×), e2e p50 {} (target ≤ 2.00×), \
                     server CPU per message {} (target ≤ 1.00×), WAL bytes per message {} (target ≤ 1.10×)",
                    paired(ours, System::Pgq, |t| t.produce_rate),
                    paired(ours, System::Pgq, |t| t.e2e_p50_ms),
                    paired(ours, System::Pgq, |t| t.server_cpu_us_per_message),
                    paired(ours, System::Pgq, |t| t.wal_bytes_per_message)
                ));
            }
        }
        // The client against the SQL it wraps (issue 13: within 5%), W1 and each W2 case.
        if has(System::Sql) && has(System::Client) {
            lines.push(format!(
                "W1 consumed/s, client / SQL: {}",
                paired(System::Client, System::Sql, |t| t.consume_rate)
            ));
        }
        for t in self.w2.iter().filter(|t| t.system == Some(System::Client)) {
            let sql = self.w2.iter().find(|s| s.system == Some(System::Sql) && s.label == t.label);
            if let Some(sql) = sql {
                lines.push(format!("W2 {}, client / SQL: {}", t.label, ratio(t.consume_rate, sql.consume_rate)));
            }
        }
        if let Some(base) = sql {
            for t in self.w2.iter().filter(|t| t.system == Some(System::Sql)) {
                lines.push(format!("W2 {} / W1 (SQL): {}", t.label, ratio(t.consume_rate, base.consume_rate)));
            }
        }
        if let Some(base) = client {
            for t in self.w2.iter().filter(|t| t.system == Some(System::Client)) {
                lines.push(format!("W2 {} / W1 (client): {}", t.label, ratio(t.consume_rate, base.consume_rate)));
            }
        }
        lines.extend(self.scaling_ratios());
        lines.extend(self.drain_ratios());
        lines.extend(self.poll_ratios());
        for c in &self.w6 {
            lines.push(format!(
                "W6 claim of 100 carrying the previous acks, {}: {:.0} µs of server time (target ≤ 300 µs), {:.0} µs of it outside its statements",
                c.label,
                c.claim_us,
                c.outside_statements_us()
            ));
        }
        let quiet = |s| self.w3.iter().find(|l| l.system == Some(s));
        if let (Some(ours), Some(pgq)) = (quiet(System::Client), quiet(System::Pgq)) {
            lines.push(format!("W3 pickup p50, sqlstreams (client) / PgQ: {}", ratio(ours.p50_ms, pgq.p50_ms)));
        }
        lines
    }

    pub fn markdown(&self) -> String {
        let mut md = String::new();
        let _ = writeln!(md, "# sqlstreams benchmarks\n");
        let _ = writeln!(
            md,
            "Every number on this page comes from one run of `scripts/rig bench` on the machine below, all systems \
             side by side against the same durable PostgreSQL cluster. Each run checks that every produced message \
             was consumed exactly once (missing, duplicates) and, for ordered runs, in order per key.\n"
        );
        let _ = writeln!(md, "## Machine\n\n| | |\n|---|---|");
        for (k, v) in &self.machine {
            let _ = writeln!(md, "| {k} | {v} |");
        }
        let _ = writeln!(
            md,
            "\n## Reading these numbers\n\n\
             - **W1 consumed/s is capped by the producers when a consumer keeps up**; then its end-to-end latency \
             stays low. A consumer that falls behind shows a growing backlog as end-to-end latency in seconds.\n\
             - **Commit modes.** sqlstreams' consumer-side calls (claim, ack) commit without waiting for the WAL \
             flush when they are alone in their transaction (a server crash loses no message but may deliver again; see the README). PgQ's and \
             the floor's consumers run as shipped, with `synchronous_commit = on`. Producers of every system commit \
             durably.\n\
             - **The floor is not safe**: it reads past rows of transactions that commit late and never sees them \
             (its `missing` column counts them when it happens). sqlstreams' fence waits for them instead.\n\
             - **PgQ** is consumed in its own batches (everything between two 50 ms ticks); sqlstreams in claims of \
             100 messages, as W1 prescribes.\n\
             - **Each run starts clean**: a run drops its stream, queue or table once it is measured, so no run \
             shares the cluster with earlier runs' tables (their autovacuum), and PgQ's ticker ticks only the \
             queue of the run in progress.\n\
             - One 2-core machine runs the producers, the consumer and Postgres: numbers move by 10-20% between runs."
        );
        let _ = writeln!(md, "\n## Ratios\n");
        for line in self.ratios() {
            let _ = writeln!(md, "- {line}");
        }
        let _ = writeln!(
            md,
            "\n## W1 throughput\n\n2 producers in 100-message transactions (~200-byte JSON), 1 consumer in batches of 100. \
             Server CPU is every process of the cluster (from `/proc`) from the consumer's start to its last message, \
             per message produced; WAL likewise. Each system runs in {} rounds, interleaved, every other round in \
             reverse order: each row is its median round by consumed/s, the upper of the two middle ones (missing, \
             duplicates: all rounds). Each ratio to PgQ above takes the two systems' ratio within each round, joins \
             each forward (odd) round's with the reversed round's after it (their geometric mean), and takes the \
             median of those pairs on a log scale, which for two pairs is their geometric mean \
             (`stats::paired_ratio`). Every round is in the table below the first.\n\n\
             ![throughput](throughput.svg)\n\n{}\n{}",
            self.w1_rounds.iter().map(Vec::len).max().unwrap_or(0),
            throughput_table(&self.w1),
            rounds_table(
                &self.w1_rounds,
                |t| format!("{} {}", name(t.system), t.label),
                &[
                    ("consumed/s", |t: &Throughput| format!("{:.0}", t.consume_rate)),
                    ("server CPU µs/msg", |t: &Throughput| format!("{:.1}", t.server_cpu_us_per_message)),
                ]
            )
        );
        let _ = writeln!(md, "{}", crate::processes::section(&self.w1));
        let _ = writeln!(md, "## W2 keyed throughput\n\nW1 with message keys (sqlstreams only: PgQ and the floor have no per-key delivery).\n\n![keyed](keyed.svg)\n\n{}", throughput_table(&self.w2));
        if !self.w10.is_empty() {
            let _ = writeln!(md, "{}", self.drain_section());
        }
        if !self.w7.is_empty() {
            let _ = writeln!(md, "{}", self.scaling_section());
        }
        if !self.w8.is_empty() {
            let _ = writeln!(
                md,
                "## W8 disk over a long run\n\nOne producer at 5,000 messages/s and one consumer keeping up, on the default \
                 setup: no cron, no `maintain()`, no preloaded library; retention runs from the consumer's claims (at most \
                 once a minute). partition_size 100,000, so the run fills a partition every 20 s. The stream's size on disk \
                 (every table of its family):\n\n| elapsed s | produced | consumed | partitions | MB on disk |\n|---|---|---|---|---|"
            );
            for s in &self.w8 {
                let _ = writeln!(
                    md,
                    "| {:.0} | {} | {} | {} | {:.1} |",
                    s.elapsed_s,
                    s.produced,
                    s.consumed,
                    s.partitions,
                    s.bytes as f64 / 1e6
                );
            }
            let _ = writeln!(md);
        }
        let _ = writeln!(
            md,
            "## W6 claim cost\n\nFrom W1's function statistics (`track_functions = all`), server time per call.\n\n{}",
            claim_cost_table(&self.w1)
        );
        if !self.w6.is_empty() {
            let _ = writeln!(md, "{}", self.cost_section());
        }
        let _ = writeln!(
            md,
            "## W3 quiet latency\n\nOne message every 5 ms (200/s), one per transaction; time from the produce call to the handler. \
             sqlstreams waits for NOTIFY (1 s poll as fallback); PgQ polls every 10 ms with its ticker every 50 ms; \
             the floor polls every 5 ms.\n\n![latency](latency.svg)\n\n{}",
            latency_table(&self.w3)
        );
        let _ = writeln!(
            md,
            "## W4 ordered hand-off\n\nPer key, the head fails once and is retried at once; the time from its resolution to its \
             successor's handler start (PgQ and the floor: n/a, no per-key order).\n\n{}",
            latency_table(&self.w4)
        );
        let _ = writeln!(md, "## W5 idle cost\n\n10 idle, caught-up consumers polling once a second (autovacuum paused during the measurement: its own transactions are not the consumers' cost).\n\n| system | consumers | seconds | statements/s | transaction ids used |\n|---|---|---|---|---|");
        for i in &self.w5 {
            let _ = writeln!(
                md,
                "| {} | {} | {:.0} | {:.1} | {} |",
                name(i.system),
                i.consumers,
                i.seconds,
                i.statements_per_second,
                i.xids
            );
        }
        if !self.w11.is_empty() {
            let _ = writeln!(md, "{}", self.poll_section());
        }
        md
    }

    pub fn plots(&self, dir: &Path) -> Result<(), Box<dyn std::error::Error>> {
        let w1: Vec<(String, f64)> = self.w1.iter().map(|t| (name(t.system).to_string(), t.consume_rate)).collect();
        bars(&dir.join("throughput.svg"), "W1: messages consumed per second", &w1)?;
        let w2: Vec<(String, f64)> = self
            .w1
            .iter()
            .filter(|t| t.system.is_some_and(System::is_sqlstreams))
            .chain(&self.w2)
            .map(|t| {
                (
                    format!("{} {}", if t.system == Some(System::Sql) { "SQL" } else { "client" }, t.label),
                    t.consume_rate,
                )
            })
            .collect();
        bars(&dir.join("keyed.svg"), "W1/W2: sqlstreams messages consumed per second, by keys", &w2)?;
        let mut lat: Vec<(String, f64)> = Vec::new();
        for t in &self.w1 {
            lat.push((format!("W1 e2e p50 {}", name(t.system)), t.e2e_p50_ms));
        }
        for l in &self.w3 {
            lat.push((format!("W3 p50 {}", name(l.system)), l.p50_ms));
            lat.push((format!("W3 p99 {}", name(l.system)), l.p99_ms));
        }
        bars(&dir.join("latency.svg"), "Latency in milliseconds (lower is better)", &lat)?;
        if !self.w7.is_empty() {
            scaling_plot(&dir.join("scaling.svg"), &self.w7)?;
        }
        Ok(())
    }

    /// The drain rate of `policy` over 1,000 keys with `consumers`.
    fn scaling_rate(&self, policy: Policy, handler_us: u64, consumers: usize) -> Option<f64> {
        self.w7
            .iter()
            .find(|s| s.policy == policy && s.keys > 1 && s.handler_us == handler_us && s.consumers == consumers)
            .map(|s| s.rate)
    }

    /// W7's ratios, each next to its target.
    fn scaling_ratios(&self) -> Vec<String> {
        let mut lines = Vec::new();
        let rate = |p, h, c| self.scaling_rate(p, h, c).unwrap_or(f64::NAN);
        for policy in [Policy::Ordered, Policy::Exclusive] {
            lines.push(format!(
                "W7 {} 4 consumers / 1, 100 µs handler: {} (target ≥ 3.20×)",
                policy.name(),
                ratio(rate(policy, 100, 4), rate(policy, 100, 1))
            ));
            for c in [2, 4] {
                lines.push(format!(
                    "W7 {} {c} consumers / 1, no handler cost: {} (target ≥ 1.00×)",
                    policy.name(),
                    ratio(rate(policy, 0, c), rate(policy, 0, 1))
                ));
            }
        }
        for h in HANDLER_US {
            let (exclusive, ordered) = match self.side_by_side(h) {
                Some(rounds) => {
                    let paired = |i: usize| crate::stats::paired_ratio(&rounds[i], &rounds[0], |s: &Scaling| s.rate);
                    (paired(2), paired(1))
                }
                None => (
                    rate(Policy::Exclusive, h, 1) / rate(Policy::Parallel, h, 1),
                    rate(Policy::Ordered, h, 1) / rate(Policy::Parallel, h, 1),
                ),
            };
            lines.push(format!(
                "W7 1 consumer, {h} µs handler: exclusive / parallel {} (target ≥ 0.85×), ordered / parallel {} (target ≥ 0.90×){}",
                ratio(exclusive, 1.0),
                ratio(ordered, 1.0),
                if self.side_by_side(h).is_some() { ", side by side" } else { "" }
            ));
        }
        lines
    }

    /// The side-by-side rounds of one consumer with `handler_us` (`scaling::SIDE_BY_SIDE` order),
    /// if they were run.
    fn side_by_side(&self, handler_us: u64) -> Option<&[Vec<Scaling>]> {
        let ran = self.w7_side_by_side.len() == crate::scaling::SIDE_BY_SIDE.len()
            && self.w7_side_by_side.iter().all(|r| r.first().is_some_and(|s| s.handler_us == handler_us));
        ran.then_some(&self.w7_side_by_side[..])
    }

    fn scaling_section(&self) -> String {
        let mut md = String::from(
            "## W7 scaling with competing consumers\n\n\
             A backlog (60,000 messages produced by 2 producers in 100-message transactions, keys interleaved) drained \
             by 1, 2, 4 and 8 consumers of one group at once, each a connection claiming 100 at a time with the previous \
             claim's acks carried along and running its handler message by message. The handler sleeps 0 or 100 µs per \
             message (a handler waiting on another service; the OS rounds the sleep up, the actual time is in the \
             table). msg/s is the backlog over the time to its last handler. Server time is claim and ack_batch \
             (`track_functions`) per message. Every run checks nothing lost, nothing run twice and, per key, no \
             overlapping runs (ordered, exclusive) and no run before its predecessor (ordered).\n\n\
             ![scaling](scaling.svg)\n\n\
             | policy | keys | handler µs (actual) | 1 consumer | 2 | 4 | 8 | 4 / 1 | 8 / 1 | server µs/msg (1 → 8) | claims (empty) at 8 | missing | duplicates | order violations | overlaps |\n\
             |---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
        );
        let mut groups: Vec<(Policy, usize, u64)> = Vec::new();
        for s in &self.w7 {
            if !groups.contains(&(s.policy, s.keys, s.handler_us)) {
                groups.push((s.policy, s.keys, s.handler_us));
            }
        }
        for (policy, keys, handler_us) in groups {
            let runs: Vec<&Scaling> =
                self.w7.iter().filter(|s| s.policy == policy && s.keys == keys && s.handler_us == handler_us).collect();
            let at = |c: usize| runs.iter().find(|s| s.consumers == c);
            let cell = |c: usize| at(c).map_or("".to_string(), |s| format!("{:.0}", s.rate));
            let base = at(1).map_or(f64::NAN, |s| s.rate);
            let scale = |c: usize| at(c).map_or("".to_string(), |s| ratio(s.rate, base));
            let last = runs.iter().max_by_key(|s| s.consumers).copied();
            let sum = |f: fn(&Scaling) -> usize| runs.iter().map(|s| f(s)).sum::<usize>();
            let _ = writeln!(
                md,
                "| {} | {} | {} ({:.0}) | {} | {} | {} | {} | {} | {} | {:.0} → {:.0} | {} | {} | {} | {} | {} |",
                policy.name(),
                if keys == 1 { "1 (hot key)".to_string() } else { keys.to_string() },
                handler_us,
                runs.iter().map(|s| s.handler_actual_us).fold(0.0, f64::max),
                cell(1),
                cell(2),
                cell(4),
                cell(8),
                scale(4),
                scale(8),
                at(1).map_or(f64::NAN, |s| s.server_us_per_message),
                last.map_or(f64::NAN, |s| s.server_us_per_message),
                last.map_or("".to_string(), |s| format!("{} ({})", s.claims, s.empty_claims)),
                sum(|s| s.missing),
                sum(|s| s.duplicates),
                sum(|s| s.order_violations),
                sum(|s| s.overlaps),
            );
        }
        if !self.w7_side_by_side.is_empty() {
            let _ = writeln!(
                md,
                "\nOne consumer without handler cost, side by side: each policy drains the same backlog once per round, \
                 every other round in reverse order. The one-consumer ratios printed above without handler cost take each \
                 round's ratio, join each forward round's with the reversed round's after it and take the median of those \
                 pairs (`stats::paired_ratio`), as W1 and W10 do; in the table above the policies' drains are minutes \
                 apart.\n\n{}",
                rounds_table(
                    &self.w7_side_by_side,
                    |s| s.policy.name().to_string(),
                    &[
                        ("msg/s", |s: &Scaling| format!("{:.0}", s.rate)),
                        ("server µs/msg", |s: &Scaling| format!("{:.1}", s.server_us_per_message)),
                    ]
                )
            );
        }
        md
    }
}

/// W7: msg/s by consumers, one line per policy and handler cost (1,000 keys).
fn scaling_plot(path: &Path, runs: &[Scaling]) -> Result<(), Box<dyn std::error::Error>> {
    let root = SVGBackend::new(path, (900, 520)).into_drawing_area();
    root.fill(&WHITE)?;
    let max = runs.iter().map(|s| s.rate).fold(0.0f64, f64::max).max(1.0) * 1.1;
    let mut chart = ChartBuilder::on(&root)
        .caption("W7: messages per second by competing consumers (1,000 keys)", ("sans-serif", 20))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(0.5f64..8.5f64, 0f64..max)?;
    chart.configure_mesh().x_desc("consumers").y_desc("msg/s").draw()?;
    let mut i = 0;
    for handler_us in HANDLER_US {
        for policy in [Policy::Parallel, Policy::Ordered, Policy::Exclusive] {
            let points: Vec<(f64, f64)> = CONSUMERS
                .iter()
                .filter_map(|c| {
                    runs.iter()
                        .find(|s| s.policy == policy && s.keys > 1 && s.handler_us == handler_us && s.consumers == *c)
                        .map(|s| (*c as f64, s.rate))
                })
                .collect();
            let color = Palette99::pick(i).to_rgba();
            chart
                .draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))?
                .label(format!("{} {handler_us} µs", policy.name()))
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
            chart.draw_series(points.iter().map(|p| Circle::new(*p, 4, color.filled())))?;
            i += 1;
        }
    }
    chart.configure_series_labels().border_style(BLACK).background_style(WHITE.mix(0.8)).draw()?;
    root.present()?;
    Ok(())
}

fn throughput_table(rows: &[Throughput]) -> String {
    let mut t = String::from(
        "| system | keys | produced | produced/s | consumed/s | e2e p50 ms | e2e p99 ms | missing | duplicates | order violations | WAL bytes/msg | server CPU µs/msg |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in rows {
        let _ = writeln!(
            t,
            "| {} | {} | {} | {:.0} | {:.0} | {:.1} | {:.1} | {} | {} | {} | {:.0} | {:.1} |",
            name(r.system),
            r.label,
            r.produced,
            r.produce_rate,
            r.consume_rate,
            r.e2e_p50_ms,
            r.e2e_p99_ms,
            r.missing,
            r.duplicates,
            r.order_violations,
            r.wal_bytes_per_message,
            r.server_cpu_us_per_message
        );
    }
    t
}

fn claim_cost_table(rows: &[Throughput]) -> String {
    let mut t = String::from("| system | per 100 messages consumed | server time per call |\n|---|---|---|\n");
    for r in rows {
        let per_100 = r.produced.max(1) as f64 / 100.0;
        let line = match r.system {
            Some(System::Sql) | Some(System::Client) => {
                // The client claims through claim_with_metadata (headers, produced_at).
                let name = if r.system == Some(System::Client) {
                    "sqlstreams.claim_with_metadata"
                } else {
                    "sqlstreams.claim"
                };
                let claim = per_call_us(r, name);
                let ack = per_call_us(r, "sqlstreams.ack_batch").filter(|a| a.0 > 0);
                let trips = claim.map_or(0, |c| c.0) + ack.map_or(0, |a| a.0);
                let acks = match ack {
                    Some((calls, us)) => {
                        format!("; ack_batch {us:.0} µs ({calls} calls, when no claim carried the acks)")
                    }
                    None => "; every ack rode along with a claim".to_string(),
                };
                format!(
                    "{:.2} round trips (claims carrying the previous acks, plus ack_batch) | claim {:.0} µs{acks}",
                    trips as f64 / per_100,
                    claim.map_or(f64::NAN, |c| c.1),
                )
            }
            Some(System::Pgq) => {
                let next = per_call_us(r, "pgq.next_batch");
                let get = per_call_us(r, "pgq.get_batch_events");
                let finish = per_call_us(r, "pgq.finish_batch");
                let batches = next.map_or(0, |c| c.0) as f64;
                format!(
                    "{:.2} round trips (next_batch, get_batch_events, finish_batch per tick batch; {:.0} polls in all) | next_batch {:.0} µs, get_batch_events {:.0} µs, finish_batch {:.0} µs",
                    3.0 * get.map_or(0, |c| c.0) as f64 / per_100,
                    batches,
                    next.map_or(f64::NAN, |c| c.1),
                    get.map_or(f64::NAN, |c| c.1),
                    finish.map_or(f64::NAN, |c| c.1)
                )
            }
            _ => "2 round trips (select, store cursor) | plain SQL, not tracked".to_string(),
        };
        let _ = writeln!(t, "| {} | {line} |", name(r.system));
    }
    t
}

fn latency_table(rows: &[Latency]) -> String {
    let mut t = String::from("| system | what | samples | p50 ms | p99 ms | missing |\n|---|---|---|---|---|---|\n");
    for r in rows {
        let _ = writeln!(
            t,
            "| {} | {} | {} | {:.3} | {:.3} | {} |",
            name(r.system),
            r.label,
            r.samples,
            r.p50_ms,
            r.p99_ms,
            r.missing
        );
    }
    t
}

/// A horizontal bar chart of labelled values.
fn bars(path: &Path, title: &str, values: &[(String, f64)]) -> Result<(), Box<dyn std::error::Error>> {
    let height = 80 + 34 * values.len() as u32;
    let root = SVGBackend::new(path, (900, height)).into_drawing_area();
    root.fill(&WHITE)?;
    let max = values.iter().map(|(_, v)| *v).filter(|v| v.is_finite()).fold(0.0f64, f64::max).max(1e-9) * 1.15;
    let n = values.len() as u32;
    // A segmented range 0..k has k + 1 slots: one per value.
    let slots = n.saturating_sub(1).max(1);
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(300)
        .build_cartesian_2d(0f64..max, (0u32..slots).into_segmented())?;
    chart
        .configure_mesh()
        .disable_y_mesh()
        .y_label_formatter(&|y| match y {
            SegmentValue::CenterOf(i) => values.get(*i as usize).map(|(l, _)| l.clone()).unwrap_or_default(),
            _ => String::new(),
        })
        .draw()?;
    chart.draw_series(values.iter().enumerate().map(|(i, (_, v))| {
        let v = if v.is_finite() { *v } else { 0.0 };
        let (y0, y1) = (SegmentValue::Exact(i as u32), SegmentValue::Exact(i as u32 + 1));
        Rectangle::new([(0.0, y0), (v, y1)], Palette99::pick(i).filled())
    }))?;
    chart.draw_series(values.iter().enumerate().map(|(i, (_, v))| {
        Text::new(
            format!("{v:.1}"),
            (if v.is_finite() { *v } else { 0.0 }, SegmentValue::CenterOf(i as u32)),
            ("sans-serif", 14),
        )
    }))?;
    root.present()?;
    Ok(())
}

impl Results {
    /// The W10 rounds of a case.
    fn drain_rounds(&self, system: System, label: &str) -> &[crate::drain::Drain] {
        self.w10_rounds
            .iter()
            .find(|r| r.first().is_some_and(|d| d.system == Some(system) && d.label == label))
            .map_or(&[], Vec::as_slice)
    }

    /// W10's ratios, each next to its target, over the rounds (`stats::paired_ratio`).
    fn drain_ratios(&self) -> Vec<String> {
        let mut lines = Vec::new();
        let none = "no keys";
        if self.w10.is_empty() {
            return lines;
        }
        let rate = |d: &crate::drain::Drain| d.rate;
        let paired = |(sa, la): (System, &str), (sb, lb): (System, &str)| {
            let r = crate::stats::paired_ratio(self.drain_rounds(sa, la), self.drain_rounds(sb, lb), rate);
            ratio(r, 1.0)
        };
        lines.push(format!(
            "W10 drain, sqlstreams parallel (SQL) / floor: {} (target ≥ 1.00×); PgQ / floor: {}",
            paired((System::Sql, none), (System::Floor, none)),
            paired((System::Pgq, none), (System::Floor, none))
        ));
        lines.push(format!(
            "W10 drain, client / SQL: {} (target ≥ 0.95×)",
            paired((System::Client, none), (System::Sql, none))
        ));
        for label in ["ordered, 1024 keys", "exclusive, 1024 keys"] {
            lines.push(format!(
                "W10 drain (SQL), {label} / parallel: {} (target ≥ 0.90×)",
                paired((System::Sql, label), (System::Sql, none))
            ));
        }
        // What keys cost, and what order costs over them (no target: the targets above compare
        // with the drain without keys).
        lines.push(format!(
            "W10 drain (SQL), parallel, 1024 keys / parallel: {}; ordered / parallel, both over 1024 keys: {}",
            paired((System::Sql, "parallel, 1024 keys"), (System::Sql, none)),
            paired((System::Sql, "ordered, 1024 keys"), (System::Sql, "parallel, 1024 keys"))
        ));
        lines.push(format!(
            "W10 drain (client), ordered, 1024 keys / parallel: {}",
            paired((System::Client, "ordered, 1024 keys"), (System::Client, none))
        ));
        let cpu = |a: System, b: System| {
            let r = crate::stats::paired_ratio(self.drain_rounds(a, none), self.drain_rounds(b, none), |d| {
                d.server_cpu_us_per_message
            });
            ratio(r, 1.0)
        };
        lines.push(format!(
            "W10 drain, server CPU per message, sqlstreams (SQL) / PgQ: {}; / floor: {}",
            cpu(System::Sql, System::Pgq),
            cpu(System::Sql, System::Floor)
        ));
        lines
    }

    fn drain_section(&self) -> String {
        let mut md = String::from(
            "## W10 drain\n\nA consumer's capacity: a backlog (2 producers in 100-message transactions, keys as in W2) is \
             produced first, then one consumer drains it in batches of 100 with nothing else running (PgQ in its tick \
             batches, its ticker running). Every case runs in rounds, interleaved, every other round in reverse \
             order; each row is the case's median round by drained/s, the upper of the two middle ones (missing \
             and duplicates: all rounds). Each ratio printed above takes its two cases' ratio within each round, \
             joins each forward (odd) round's with the reversed round's after it (their geometric mean), and takes \
             the median of those pairs on a log scale (`stats::paired_ratio`), so that the machine's drift between \
             rounds and within one cancels. Every round is in the table below the first. Server CPU is every process of the cluster, from `/proc`; consumer CPU is the bench's own process \
             (the client library or the SQL loop, and the bench's handling of each message, the same for every \
             system); claim µs is `track_functions`' time per claim call.\n\n\
             | system | keys | messages | seconds | drained/s | server CPU µs/msg | consumer CPU µs/msg | WAL bytes/msg | claims | µs per claim | missing | duplicates |\n\
             |---|---|---|---|---|---|---|---|---|---|---|---|\n",
        );
        for d in &self.w10 {
            let _ = writeln!(
                md,
                "| {} | {} | {} | {:.2} | {:.0} | {:.1} | {:.1} | {:.0} | {} | {} | {} | {} |",
                name(d.system),
                d.label,
                d.messages,
                d.seconds,
                d.rate,
                d.server_cpu_us_per_message,
                d.consumer_cpu_us_per_message,
                d.wal_bytes_per_message,
                d.claims,
                if d.claim_us.is_finite() { format!("{:.0}", d.claim_us) } else { "n/a".into() },
                d.missing,
                d.duplicates
            );
        }
        md.push('\n');
        md.push_str(&rounds_table(
            &self.w10_rounds,
            |d| format!("{} {}", name(d.system), d.label),
            &[
                ("drained/s", |d: &crate::drain::Drain| format!("{:.0}", d.rate)),
                ("server CPU µs/msg", |d: &crate::drain::Drain| format!("{:.1}", d.server_cpu_us_per_message)),
                ("consumer CPU µs/msg", |d: &crate::drain::Drain| format!("{:.1}", d.consumer_cpu_us_per_message)),
            ],
        ));
        md
    }
}

impl Results {
    /// W6's statement-by-statement tables.
    fn cost_section(&self) -> String {
        let mut md = String::from(
            "### Where a claim's time and WAL go\n\nOne consumer drains a backlog through SQL in claims of 100 that \
             carry the previous claim's acks, with `pg_stat_statements.track = all` in its session only; the drains \
             without keys and ordered run in interleaved rounds, and each one's median round is shown. Each row \
             is a statement of the library, by the name in its leading comment (src/statement.rs): its calls, \
             execution time and WAL per claim. \"Outside the statements\" is the claim's `track_functions` time \
             less their execution time: the call, SPI, planning the execution (`ExecutorStart`), building the \
             result rows, the checks. A profile of the same drain (`perf record --call-graph dwarf` on the \
             backend) is in docs/benchmarks/cost-model.md.\n",
        );
        for c in &self.w6 {
            let _ = writeln!(
                md,
                "\n**{}** ({} claims): {:.0} µs per claim, {:.0} µs of it outside the statements; WAL {:.0} bytes per claim.\n\n\
                 | statement | calls per claim | µs per claim | WAL bytes per claim |\n|---|---|---|---|",
                c.label,
                c.claims,
                c.claim_us,
                c.outside_statements_us(),
                c.wal_bytes_per_claim
            );
            for l in &c.lines {
                let _ = writeln!(
                    md,
                    "| {} | {:.2} | {:.1} | {:.0} |",
                    l.statement, l.calls_per_claim, l.us_per_claim, l.wal_bytes_per_claim
                );
            }
        }
        md
    }
}

impl Results {
    /// A poll's server CPU over `SELECT 1`'s: the median of the rounds' ratios.
    fn per_select_one(&self, poll: crate::poll::Poll) -> f64 {
        self.w11.iter().find(|p| p.poll == poll).map_or(f64::NAN, |p| p.per_select_one)
    }

    /// W11's ratios: an idle poll's server CPU against `SELECT 1`'s.
    fn poll_ratios(&self) -> Vec<String> {
        use crate::poll::Poll;
        if self.w11.is_empty() {
            return vec![];
        }
        vec![format!(
            "W11 idle poll, {} groups, server CPU per poll / SELECT 1's: claim {} (target ≤ 2.00×), claim + next_due (the client's first idle poll) {}",
            crate::poll::GROUPS,
            ratio(self.per_select_one(Poll::Claim), 1.0),
            ratio(self.per_select_one(Poll::ClaimNextDue), 1.0)
        )]
    }

    fn poll_section(&self) -> String {
        let rounds = self.w11.first().map_or(0, |p| p.rounds);
        let mut md = format!(
            "## W11 idle poll\n\n{} groups of one caught-up stream, each polled every 20 ms from a connection of its own \
             (statements prepared); the same connections send each kind of poll in turn for a window, {rounds} rounds, \
             every other round in reverse order. Server CPU is the pollers' own backends' (`/proc/<pid>/schedstat`; an \
             idle poll writes nothing, so no other process works for it). A kind's ratio to `SELECT 1` pairs the two \
             within each round, so it is not the CPU column over `SELECT 1`'s row: the other columns are the kind's \
             median round's.\n\n\
             | poll | polls | seconds | server CPU µs per poll | / SELECT 1 |\n|---|---|---|---|---|\n",
            crate::poll::GROUPS
        );
        for p in &self.w11 {
            let _ = writeln!(
                md,
                "| {} | {} | {:.1} | {:.1} | {} |",
                p.poll.label(),
                p.polls,
                p.seconds,
                p.server_cpu_us,
                ratio(p.per_select_one, 1.0)
            );
        }
        md
    }
}
