//! The systems under test, each with a producer and a consumer doing the same work:
//! - `Client`: sqlstreams through the Rust client (handlers, pipelined acks, LISTEN wake-ups);
//! - `Sql`: sqlstreams through raw SQL calls (claim, then one ack_batch per claim);
//! - `Pgq`: PgQ (insert_event; next_batch / get_batch_events / finish_batch; a 50 ms ticker);
//! - `Floor`: a plain table and an id cursor (insert; select the next 100 and store the cursor).
//!   It skips rows of transactions that commit late: fast, not safe.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use serde::{Deserialize, Serialize};
use tokio::sync::Notify;
use tokio_postgres::{AsyncMessage, NoTls};
use tokio_util::sync::CancellationToken;

use crate::stats::now_us;

pub type Pg = tokio_postgres::Client;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum System {
    Client,
    Sql,
    Pgq,
    Floor,
}

impl System {
    pub fn name(self) -> &'static str {
        match self {
            System::Client => "sqlstreams (client)",
            System::Sql => "sqlstreams (SQL)",
            System::Pgq => "PgQ",
            System::Floor => "floor",
        }
    }

    pub fn is_sqlstreams(self) -> bool {
        matches!(self, System::Client | System::Sql)
    }
}

/// One benchmark message (~200 bytes of JSON).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Event {
    pub producer: u32,
    pub seq: u64,
    pub produced_us: i64,
    pub key: Option<String>,
    pub pad: String,
}

impl Event {
    pub fn new(producer: u32, seq: u64, key: Option<String>) -> Event {
        Event { producer, seq, produced_us: now_us(), key, pad: "x".repeat(110) }
    }
}

/// What a consumer saw of one message.
#[derive(Clone, Debug)]
pub struct Consumed {
    pub producer: u32,
    pub seq: u64,
    pub produced_us: i64,
    pub handled_us: i64,
    /// The sqlstreams message id (0 for the other systems).
    pub id: i64,
    pub key: Option<String>,
}

impl Consumed {
    fn of(event: Event, id: i64) -> Consumed {
        Consumed {
            producer: event.producer,
            seq: event.seq,
            produced_us: event.produced_us,
            handled_us: now_us(),
            id,
            key: event.key,
        }
    }
}

/// Where a consumer's handler puts what it saw: appended under a lock, waking nobody; the bench
/// collects it every millisecond (`take`). A channel would wake the bench's loop for each
/// message that a handler sends on its own: a cost of the harness, a thread wake-up per message,
/// that a consumer calling its handler message by message pays and one handing over a batch at
/// once does not.
#[derive(Clone, Default)]
pub struct Sink(Arc<std::sync::Mutex<Vec<Consumed>>>);

impl Sink {
    pub fn send(&self, consumed: Consumed) {
        self.0.lock().unwrap().push(consumed);
    }

    /// What was put since the last call.
    pub fn take(&self) -> Vec<Consumed> {
        std::mem::take(&mut *self.0.lock().unwrap())
    }

    /// What was put since the last call, after waiting a millisecond when nothing was.
    pub async fn next(&self) -> Vec<Consumed> {
        let taken = self.take();
        if taken.is_empty() {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        taken
    }
}

/// Names of one run's stream (or queue, or table) and group.
#[derive(Clone, Debug)]
pub struct Target {
    pub system: System,
    pub stream: String,
    pub group: String,
}

pub async fn connect(url: &str) -> Pg {
    let (client, connection) = tokio_postgres::connect(url, NoTls).await.expect("connect");
    tokio::spawn(connection);
    client
}

/// Creates what one run needs; `policy` is the sqlstreams group's override.
pub async fn setup(db: &Pg, system: System, run: &str, policy: Option<&str>) -> Target {
    let target = Target { system, stream: format!("bench.{run}"), group: "consumer".into() };
    match system {
        System::Client | System::Sql => {
            db.execute("SELECT sqlstreams.create_stream($1)", &[&target.stream]).await.unwrap();
            db.execute("SELECT sqlstreams.create_group($1, $2, $3)", &[&target.stream, &target.group, &policy])
                .await
                .unwrap();
        }
        System::Pgq => {
            let q = &target.stream;
            db.execute("SELECT pgq.create_queue($1)", &[q]).await.unwrap();
            // Tick on every ticker call that finds new events: "PgQ ticking every 50 ms".
            db.execute("SELECT pgq.set_queue_config($1, 'ticker_max_lag', '1 millisecond')", &[q]).await.unwrap();
            db.execute("SELECT pgq.set_queue_config($1, 'ticker_max_count', '1000000')", &[q]).await.unwrap();
            db.execute("SELECT pgq.register_consumer($1, $2)", &[q, &target.group]).await.unwrap();
        }
        System::Floor => {
            let (t, c) = (floor_table(&target), floor_cursor(&target));
            db.batch_execute(&format!(
                "CREATE TABLE {t} (id bigserial PRIMARY KEY, payload jsonb NOT NULL);
                 CREATE TABLE {c} (pos bigint NOT NULL); INSERT INTO {c} VALUES (0);"
            ))
            .await
            .unwrap();
        }
    }
    target
}

/// Drops what `setup` created for `target`, once its run is measured: a run shares the cluster
/// with no earlier run's tables (their autovacuum and checkpoints) nor, for PgQ, with queues
/// its ticker would go on ticking.
pub async fn teardown(db: &Pg, target: &Target) {
    match target.system {
        System::Client | System::Sql => {
            db.execute("SELECT sqlstreams.drop_stream($1)", &[&target.stream]).await.unwrap();
        }
        // Forced: with its consumers still registered.
        System::Pgq => {
            db.execute("SELECT pgq.drop_queue($1, true)", &[&target.stream]).await.unwrap();
        }
        System::Floor => {
            let (t, c) = (floor_table(target), floor_cursor(target));
            db.batch_execute(&format!("DROP TABLE {t}; DROP TABLE {c};")).await.unwrap();
        }
    }
}

/// Registers another PgQ consumer on `target`'s queue.
pub async fn pgq_consumer(db: &Pg, target: &Target, name: &str) -> Target {
    db.execute("SELECT pgq.register_consumer($1, $2)", &[&target.stream, &name]).await.unwrap();
    Target { group: name.to_string(), ..target.clone() }
}

/// The floor's table, named from the run name (letters, digits and separators only).
fn floor_table(target: &Target) -> String {
    format!("\"floor_{}\"", target.stream.replace(['.', '-'], "_"))
}

fn floor_cursor(target: &Target) -> String {
    format!("\"floor_{}_cursor\"", target.stream.replace(['.', '-'], "_"))
}

/// A producer of one system.
pub enum Producer {
    Client(sqlstreams_client::Producer<Event>),
    Raw(Pg, Target, tokio_postgres::Statement),
}

impl Producer {
    pub async fn new(url: &str, client: &sqlstreams_client::Client, target: &Target) -> Producer {
        match target.system {
            System::Client => Producer::Client(client.stream::<Event>(target.stream.clone()).producer()),
            system => {
                let pg = connect(url).await;
                let sql = match system {
                    System::Sql => "SELECT count(*) FROM sqlstreams.produce_batch($1, $2::text[]::jsonb[], $3)".to_string(),
                    System::Pgq => "SELECT count(pgq.insert_event($1, 'bench', p)) FROM unnest($2::text[]) p WHERE $3::text[] IS NULL OR true".to_string(),
                    _ => format!(
                        "INSERT INTO {} (payload) SELECT p::jsonb FROM unnest($2::text[]) p WHERE $1::text IS NOT NULL AND ($3::text[] IS NULL OR true)",
                        floor_table(target)
                    ),
                };
                let statement = pg.prepare(&sql).await.unwrap();
                Producer::Raw(pg, target.clone(), statement)
            }
        }
    }

    /// Sends `events` in one transaction.
    pub async fn send(&self, events: &[Event]) {
        match self {
            Producer::Client(p) => {
                let items = events.iter().map(|e| (e, e.key.as_deref()));
                p.produce_batch(items, sqlstreams_client::BatchOptions::default()).await.unwrap();
            }
            Producer::Raw(pg, target, statement) => {
                let payloads: Vec<String> = events.iter().map(|e| serde_json::to_string(e).unwrap()).collect();
                let keys: Vec<Option<&str>> = events.iter().map(|e| e.key.as_deref()).collect();
                pg.execute(statement, &[&target.stream, &payloads, &keys]).await.unwrap();
            }
        }
    }
}

/// How a consumer behaves.
#[derive(Clone, Copy, Debug)]
pub struct ConsumerOpts {
    pub batch: i32,
    /// Sleep between empty polls (sqlstreams also wakes on NOTIFY).
    pub idle_poll: Duration,
    /// The group's policy. The client registers its group, and registering declares the
    /// group's settings, so it must repeat the override.
    pub policy: Option<&'static str>,
}

/// A running consumer.
pub enum Running {
    Client(sqlstreams_client::RunningConsumer),
    Task(tokio::task::JoinHandle<()>, CancellationToken),
}

impl Running {
    pub async fn stop(self) {
        match self {
            Running::Client(c) => {
                c.shutdown(Duration::from_secs(30)).await;
            }
            Running::Task(task, stop) => {
                stop.cancel();
                let _stopped = task.await;
            }
        }
    }
}

pub async fn start_consumer(
    url: &str,
    client: &sqlstreams_client::Client,
    target: &Target,
    opts: ConsumerOpts,
    sink: Sink,
) -> Running {
    if target.system == System::Client {
        let config = sqlstreams_client::ConsumerConfig {
            concurrency_override: opts.policy.map(|p| p.parse().unwrap()),
            // Twice the batch: a claim overlapping the previous batch's tail is still full.
            message_concurrency: 2 * opts.batch as usize,
            batch_size: opts.batch as u32,
            poll_interval: opts.idle_poll,
            ..Default::default()
        };
        let consumer = client
            .stream::<Event>(target.stream.clone())
            .consumer(target.group.clone())
            .register(config)
            .await
            .unwrap();
        return Running::Client(consumer.start(move |d: sqlstreams_client::Delivery<Event>| {
            sink.send(Consumed::of(d.message, d.id));
            async { Ok(()) }
        }));
    }
    let stop = CancellationToken::new();
    let pg = connect(url).await;
    let (target, stop2) = (target.clone(), stop.clone());
    let wake = match target.system {
        System::Sql => Some(listen(url, &target, stop.clone()).await),
        _ => None,
    };
    let task = tokio::spawn(async move {
        let mut pos = 0i64;
        let mut acks: Option<(uuid::Uuid, Vec<i64>)> = None;
        let st = Statements::prepare(&pg, &target).await;
        while !stop2.is_cancelled() {
            let handled = match target.system {
                System::Sql => consume_sql(&pg, &st, &target, opts.batch, &mut acks, &sink).await,
                System::Pgq => consume_pgq(&pg, &st, &target, &sink).await,
                System::Floor => consume_floor(&pg, &st, opts.batch, &mut pos, &sink).await,
                System::Client => unreachable!(),
            };
            if handled == 0 {
                let notified = async {
                    match &wake {
                        Some(w) => w.notified().await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    _ = notified => {}
                    _ = tokio::time::sleep(opts.idle_poll) => {}
                    _ = stop2.cancelled() => {}
                }
            }
        }
        if let Some((token, ids)) = acks {
            pg.execute(&st.second, &[&target.stream, &target.group, &token, &ids]).await.unwrap();
        }
    });
    Running::Task(task, stop)
}

/// A consumer's statements, prepared once.
struct Statements {
    first: tokio_postgres::Statement,
    second: tokio_postgres::Statement,
    third: Option<tokio_postgres::Statement>,
}

impl Statements {
    async fn prepare(pg: &Pg, t: &Target) -> Statements {
        let (first, second, third) = match t.system {
            System::Sql => (
                // The previous claim's acks ride along with the next claim: one round trip.
                "SELECT message_id, payload::text, lease_token FROM sqlstreams.claim($1, $2, $3, '60 seconds', $4, $5)"
                    .to_string(),
                "SELECT sqlstreams.ack_batch($1, $2, $3, $4)".to_string(),
                None,
            ),
            System::Pgq => (
                "SELECT pgq.next_batch($1, $2)".to_string(),
                "SELECT ev_data FROM pgq.get_batch_events($1)".to_string(),
                Some("SELECT pgq.finish_batch($1)".to_string()),
            ),
            _ => (
                format!("SELECT id, payload::text FROM {} WHERE id > $1 ORDER BY id LIMIT $2", floor_table(t)),
                format!("UPDATE {} SET pos = $1", floor_cursor(t)),
                None,
            ),
        };
        Statements {
            first: pg.prepare(&first).await.unwrap(),
            second: pg.prepare(&second).await.unwrap(),
            third: match third {
                Some(sql) => Some(pg.prepare(&sql).await.unwrap()),
                None => None,
            },
        }
    }
}

/// One claim that also acks what the previous claim handed out; returns how many messages
/// were handled.
async fn consume_sql(
    pg: &Pg,
    st: &Statements,
    t: &Target,
    batch: i32,
    acks: &mut Option<(uuid::Uuid, Vec<i64>)>,
    sink: &Sink,
) -> usize {
    let (token, ids) = acks.take().unzip();
    let rows = pg.query(&st.first, &[&t.stream, &t.group, &batch, &token, &ids]).await.unwrap();
    if rows.is_empty() {
        return 0;
    }
    let mut ids = Vec::with_capacity(rows.len());
    for r in &rows {
        let event: Event = serde_json::from_str(r.get(1)).unwrap();
        ids.push(r.get::<_, i64>(0));
        sink.send(Consumed::of(event, r.get(0)));
    }
    *acks = Some((rows[0].get(2), ids));
    rows.len()
}

async fn consume_pgq(pg: &Pg, st: &Statements, t: &Target, sink: &Sink) -> usize {
    let batch: Option<i64> = pg.query_one(&st.first, &[&t.stream, &t.group]).await.unwrap().get(0);
    let Some(batch) = batch else { return 0 };
    let rows = pg.query(&st.second, &[&batch]).await.unwrap();
    for r in &rows {
        let event: Event = serde_json::from_str(r.get(0)).unwrap();
        sink.send(Consumed::of(event, 0));
    }
    pg.execute(st.third.as_ref().expect("finish_batch"), &[&batch]).await.unwrap();
    rows.len().max(1) // an empty batch still moved the consumer on
}

async fn consume_floor(pg: &Pg, st: &Statements, batch: i32, pos: &mut i64, sink: &Sink) -> usize {
    let rows = pg.query(&st.first, &[&*pos, &(batch as i64)]).await.unwrap();
    if rows.is_empty() {
        return 0;
    }
    for r in &rows {
        let event: Event = serde_json::from_str(r.get(1)).unwrap();
        sink.send(Consumed::of(event, 0));
    }
    *pos = rows.last().unwrap().get(0);
    pg.execute(&st.second, &[&*pos]).await.unwrap();
    rows.len()
}

/// LISTENs on a sqlstreams stream's channel until `stop`; notifications wake the returned Notify.
pub async fn listen(url: &str, target: &Target, stop: CancellationToken) -> Arc<Notify> {
    let id: i64 = connect(url)
        .await
        .query_one("SELECT id FROM sqlstreams.streams WHERE name = $1", &[&target.stream])
        .await
        .unwrap()
        .get(0);
    let (client, mut connection) = tokio_postgres::connect(url, NoTls).await.unwrap();
    let wake = Arc::new(Notify::new());
    let w = wake.clone();
    let stopped = stop.clone();
    tokio::spawn(async move {
        let mut messages = futures_util::stream::poll_fn(move |cx| connection.poll_message(cx));
        loop {
            tokio::select! {
                m = messages.next() => match m {
                    Some(Ok(AsyncMessage::Notification(_))) => w.notify_one(),
                    Some(Ok(_)) => {}
                    _ => return,
                },
                _ = stopped.cancelled() => return,
            }
        }
    });
    client.batch_execute(&format!("LISTEN sqlstreams_{id}")).await.unwrap();
    // The listening connection lives until the consumer stops.
    tokio::spawn(async move {
        stop.cancelled().await;
        drop(client);
    });
    wake
}

/// Calls pgq.ticker() every 50 ms until stopped (PgQ delivers nothing without ticks).
pub fn spawn_ticker(url: String, stop: CancellationToken) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let pg = connect(&url).await;
        loop {
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(50)) => {
                    pg.execute("SELECT pgq.ticker()", &[]).await.unwrap();
                }
                _ = stop.cancelled() => return,
            }
        }
    })
}
