//! The scenarios. Each starts what it measures and measures its baseline in the same run.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use prost::Message;
use reelay_contracts::v1::{self, event::Payload};
use reelay_domain::NewEvent;
use reelay_harness::{Clients, NatsServer, Reelay, query_strings};
use reelay_outbox::{Database, DbConfig, WriteTx, enqueue_events};
use sqlx::{ConnectOptions, Connection, Executor};

use crate::Bench;
use crate::many::Deployment;
use crate::report::Report;

pub(crate) type Env = Vec<(String, String)>;

fn env_refs(env: &Env) -> Vec<(&str, &str)> {
    env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect()
}

pub(crate) fn nats_env(nats: &NatsServer) -> Env {
    vec![
        ("EVENT_BUS_BACKEND".into(), "nats".into()),
        ("NATS_URL".into(), nats.url()),
        ("REELAY_NATS_MONITOR_URL".into(), nats.monitor_url()),
        ("RUST_LOG".into(), "warn".into()),
    ]
}

pub(crate) async fn start(b: &Bench, db: &Path, services: &[&'static str], env: &Env) -> Reelay {
    Reelay::start(Reelay::spec(&b.reelay, db, services, &env_refs(env))).await
}

/// A temp dir for one scenario; `REELAY_BENCH_KEEP=1` keeps it (logs, databases) for a look.
pub(crate) fn scratch() -> std::io::Result<tempfile::TempDir> {
    let mut dir = tempfile::Builder::new().prefix("reelay-bench-").tempdir()?;
    if std::env::var_os("REELAY_BENCH_KEEP").is_some() {
        eprintln!("keeping {}", dir.path().display());
        dir.disable_cleanup(true);
    }
    Ok(dir)
}

fn now_us() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_micros() as i64
}

/// (current RSS, peak RSS) of a process in MB, from /proc.
fn rss_mb(pid: u32) -> (f64, f64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|kb| kb.parse::<f64>().ok())
            .map_or(0.0, |kb| kb / 1024.0)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// CPU seconds (user and system, all threads) a process has used so far: `pid`, or "self".
pub(crate) fn cpu_seconds(pid: &str) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // After the command name (which may hold spaces) the fields run from the 3rd (state): utime
    // and stime are the 14th and 15th, in clock ticks of 1/100 s (Linux's USER_HZ).
    let fields: Vec<&str> = stat.rsplit_once(')').map_or(Vec::new(), |(_, rest)| rest.split_whitespace().collect());
    let ticks = |i: usize| fields.get(i).and_then(|f| f.parse::<f64>().ok()).unwrap_or(0.0);
    (ticks(11) + ticks(12)) / 100.0
}

/// Users and one movie to review, so the measured calls create nothing else. Few users (the
/// clients share them): each costs the write service an RSA key generation first.
pub(crate) async fn fixtures(c: &mut Clients, db: &Path, users: usize) -> (Vec<String>, String) {
    let mut ids = Vec::with_capacity(users);
    for i in 0..users {
        ids.push(c.user(&format!("bench{i}")).await);
    }
    let movie = c
        .movies
        .discover_movie(v1::DiscoverMovieRequest {
            actor_user_id: ids[0].clone(),
            title: "Heat".into(),
            year: 1995,
            external_id: String::new(),
            ..Default::default()
        })
        .await
        .expect("discover the bench movie")
        .into_inner()
        .movie
        .expect("movie")
        .movie_id;
    // The write service makes each new user's signing key (RSA) in the background: wait for
    // them, or the key generation's CPU would be measured as part of what follows.
    let since = Instant::now();
    while query_strings(
        db,
        "SELECT COUNT(*) || '' FROM users u WHERE NOT EXISTS (SELECT 1 FROM actor_keys k WHERE k.user_id = u.id)",
    )
    .await[0][0]
        != "0"
    {
        assert!(since.elapsed() < Duration::from_secs(120), "the users' keys were not made in 2 minutes");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    (ids, movie)
}

fn log_review(user: &str, movie: &str, n: u64) -> v1::LogReviewRequest {
    v1::LogReviewRequest {
        actor_user_id: user.to_owned(),
        movie: Some(v1::MovieRef { by: Some(v1::movie_ref::By::MovieId(movie.to_owned())) }),
        rating: (n % 10 + 1) as u32,
        body: format!("Review number {n}: the diner scene still works, and the score carries the last act."),
        watched_on: "2024-03-01".into(),
        rewatch: false,
        ..Default::default()
    }
}

/// Calls per second of `clients` concurrent callers over `b.measure`, after `b.warmup`. With
/// `refused`, every call has a rating out of range, so the service refuses it before any write:
/// what the same call costs in gRPC alone.
pub(crate) async fn throughput(
    b: &Bench,
    c: &Clients,
    users: &[String],
    movie: &str,
    clients: usize,
    refused: bool,
) -> f64 {
    let start = Instant::now();
    let (from, until) = (start + b.warmup, start + b.warmup + b.measure);
    let mut tasks = Vec::new();
    for i in 0..clients {
        let mut c = c.clone();
        let (user, movie) = (users[i % users.len()].clone(), movie.to_owned());
        tasks.push(tokio::spawn(async move {
            let mut counted = 0u64;
            let mut n = 0;
            while Instant::now() < until {
                let mut request = log_review(&user, &movie, n);
                if refused {
                    request.rating = 11;
                    let status = c.reviews.log_review(request).await.expect_err("a rating of 11 is refused");
                    assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
                } else {
                    c.reviews.log_review(request).await.expect("LogReview");
                }
                n += 1;
                let done = Instant::now();
                if done >= from && done <= until {
                    counted += 1;
                }
            }
            counted
        }));
    }
    let mut total = 0;
    for task in tasks {
        total += task.await.expect("client task");
    }
    total as f64 / b.measure.as_secs_f64()
}

/// A connection with the service's pragmas (WAL, synchronous FULL).
async fn raw_connection(path: &Path) -> anyhow::Result<sqlx::SqliteConnection> {
    drop(Database::open(&DbConfig::new(path)).await?);
    Ok(sqlx::sqlite::SqliteConnectOptions::new()
        .filename(path)
        .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
        .synchronous(sqlx::sqlite::SqliteSynchronous::Full)
        .foreign_keys(true)
        .connect()
        .await?)
}

fn review_event(n: u64) -> Vec<u8> {
    v1::Event {
        event_id: uuid::Uuid::now_v7().to_string(),
        event_type: "ReviewLogged".into(),
        aggregate_id: uuid::Uuid::now_v7().to_string(),
        occurred_at_ms: 1,
        occurred_at_us: 1_000,
        traceparent: "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into(),
        payload: Some(Payload::ReviewLogged(v1::ReviewLogged {
            review_id: uuid::Uuid::now_v7().to_string(),
            user_id: uuid::Uuid::now_v7().to_string(),
            movie_id: uuid::Uuid::now_v7().to_string(),
            rating: 7,
            body: format!("Review number {n}: the diner scene still works, and the score carries the last act."),
            watched_on: "2024-03-01".into(),
            movie_title: "Heat".into(),
            movie_year: 1995,
            ..Default::default()
        })),
    }
    .encode_to_vec()
}

/// The raw SQLite limit: the same review row (and outbox row), one transaction each, in-process.
async fn raw_sqlite(b: &Bench, with_outbox: bool) -> anyhow::Result<f64> {
    let dir = scratch()?;
    let mut conn = raw_connection(&dir.path().join("raw.db")).await?;
    conn.execute("INSERT INTO users (id, handle, display_name, created_at) VALUES ('u', 'u', 'U', 0)").await?;
    conn.execute("INSERT INTO movies (id, title, title_key, year, created_at) VALUES ('m', 'Heat', 'heat', 1995, 0)")
        .await?;
    let start = Instant::now();
    let (from, until) = (start + b.warmup, start + b.warmup + b.measure);
    let (mut n, mut counted) = (0u64, 0u64);
    while Instant::now() < until {
        let mut tx = conn.begin_with("BEGIN IMMEDIATE").await?;
        sqlx::query(
            "INSERT INTO reviews (id, user_id, movie_id, rating, body, watched_on, rewatch, source, created_at, updated_at) \
             VALUES (?, 'u', 'm', 7, ?, '2024-03-01', 0, 'local', 0, 0)",
        )
        .bind(uuid::Uuid::now_v7().to_string())
        .bind(format!("Review number {n}: the diner scene still works, and the score carries the last act."))
        .execute(&mut *tx)
        .await?;
        if with_outbox {
            sqlx::query(
                "INSERT INTO event_queue (event_id, event_type, aggregate_id, payload, status, attempts, available_at, created_at) \
                 VALUES (?, 'ReviewLogged', 'r', ?, 'pending', 0, 0, 0)",
            )
            .bind(uuid::Uuid::now_v7().to_string())
            .bind(review_event(n))
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        n += 1;
        let done = Instant::now();
        if done >= from && done <= until {
            counted += 1;
        }
    }
    Ok(counted as f64 / b.measure.as_secs_f64())
}

/// Rows per multi-row INSERT of the group-commit baseline: two bound values a row, far below
/// SQLite's limit of 32,766 variables per statement.
const ROWS_PER_INSERT: usize = 1000;

/// One request to the group-commit baseline's writer: a review and its outbox row, made by the
/// task that asks, and where to say it is committed.
struct RawWrite {
    review_id: String,
    body: String,
    event_id: String,
    payload: Vec<u8>,
    committed: tokio::sync::oneshot::Sender<()>,
}

/// The raw SQLite limit with concurrency: `tasks` in-process tasks each write one review + outbox
/// row at a time through ONE connection with group commit. A single writer task owns the
/// connection (same pragmas); it takes every request waiting, writes them in one transaction
/// (`BEGIN IMMEDIATE`, one multi-row insert into `reviews` and one into `event_queue`, `COMMIT`:
/// one fsync per batch) and then answers each task. Requests per second over `b.measure`.
async fn raw_group_commit(b: &Bench, tasks: usize) -> anyhow::Result<f64> {
    let dir = scratch()?;
    let mut conn = raw_connection(&dir.path().join("raw.db")).await?;
    conn.execute("INSERT INTO users (id, handle, display_name, created_at) VALUES ('u', 'u', 'U', 0)").await?;
    conn.execute("INSERT INTO movies (id, title, title_key, year, created_at) VALUES ('m', 'Heat', 'heat', 1995, 0)")
        .await?;
    let (requests, mut waiting) = tokio::sync::mpsc::unbounded_channel::<RawWrite>();
    let writer = tokio::spawn(async move {
        let mut batch = Vec::new();
        while let Some(first) = waiting.recv().await {
            batch.push(first);
            while let Ok(next) = waiting.try_recv() {
                batch.push(next);
            }
            let mut tx = conn.begin_with("BEGIN IMMEDIATE").await?;
            for chunk in batch.chunks(ROWS_PER_INSERT) {
                let sql = format!(
                    "INSERT INTO reviews (id, user_id, movie_id, rating, body, watched_on, rewatch, source, created_at, \
                     updated_at) VALUES {}",
                    vec!["(?, 'u', 'm', 7, ?, '2024-03-01', 0, 'local', 0, 0)"; chunk.len()].join(", ")
                );
                let mut insert = sqlx::query(sqlx::AssertSqlSafe(sql));
                for w in chunk {
                    insert = insert.bind(w.review_id.as_str()).bind(w.body.as_str());
                }
                insert.execute(&mut *tx).await?;
                let sql = format!(
                    "INSERT INTO event_queue (event_id, event_type, aggregate_id, payload, status, attempts, \
                     available_at, created_at) VALUES {}",
                    vec!["(?, 'ReviewLogged', 'r', ?, 'pending', 0, 0, 0)"; chunk.len()].join(", ")
                );
                let mut insert = sqlx::query(sqlx::AssertSqlSafe(sql));
                for w in chunk {
                    insert = insert.bind(w.event_id.as_str()).bind(w.payload.as_slice());
                }
                insert.execute(&mut *tx).await?;
            }
            tx.commit().await?;
            for w in batch.drain(..) {
                let _ = w.committed.send(());
            }
        }
        anyhow::Ok(())
    });
    let start = Instant::now();
    let (from, until) = (start + b.warmup, start + b.warmup + b.measure);
    let mut senders = Vec::new();
    for task in 0..tasks {
        let requests = requests.clone();
        senders.push(tokio::spawn(async move {
            let (mut n, mut counted) = (task as u64 * 1_000_000, 0u64);
            while Instant::now() < until {
                let (committed, answer) = tokio::sync::oneshot::channel();
                let write = RawWrite {
                    review_id: uuid::Uuid::now_v7().to_string(),
                    body: format!(
                        "Review number {n}: the diner scene still works, and the score carries the last act."
                    ),
                    event_id: uuid::Uuid::now_v7().to_string(),
                    payload: review_event(n),
                    committed,
                };
                anyhow::ensure!(requests.send(write).is_ok(), "the group-commit writer stopped");
                anyhow::ensure!(answer.await.is_ok(), "the group-commit writer failed");
                n += 1;
                let done = Instant::now();
                if done >= from && done <= until {
                    counted += 1;
                }
            }
            anyhow::Ok(counted)
        }));
    }
    drop(requests);
    let mut total = 0;
    for sender in senders {
        total += sender.await??;
    }
    writer.await??;
    Ok(total as f64 / b.measure.as_secs_f64())
}

/// Scenario 1, the write path: LogReview over gRPC at 1, 8, 64 concurrent clients, with and
/// without its events, against the raw one-transaction-per-request SQLite rate; and the 64-client
/// rate against the same rows written by 64 in-process tasks with group commit (the physical
/// limit of one connection and one fsync per batch).
pub async fn write_path(b: &Bench, report: &mut Report) -> anyhow::Result<()> {
    eprintln!("write path");
    let raw_with = raw_sqlite(b, true).await?;
    let raw_without = raw_sqlite(b, false).await?;
    let (cpu, started) = (cpu_seconds("self"), Instant::now());
    let raw_group = raw_group_commit(b, 64).await?;
    let group_cores = (cpu_seconds("self") - cpu) / started.elapsed().as_secs_f64();
    report.add("raw SQLite: review + outbox row, 1 txn each, FULL", raw_with, "ops/s");
    report.add("raw SQLite: review only, 1 txn each, FULL", raw_without, "ops/s");
    report.add("raw SQLite: review + outbox rows, 64 tasks, group commit, FULL", raw_group, "ops/s");
    report.add("raw group commit, 64 tasks: CPU", group_cores, "cores");
    report.add("raw group commit, 64 tasks: CPU per review", group_cores * 1e6 / raw_group, "us");
    for events in [true, false] {
        let dir = scratch()?;
        let env: Env = if events { vec![] } else { vec![("REELAY_FAILPOINTS".into(), "skip_events".into())] };
        let db = dir.path().join("reelay.db");
        let mut reelay = start(b, &db, &["write"], &env).await;
        let mut c = reelay.clients().await;
        let (users, movie) = fixtures(&mut c, &db, 8).await;
        let pid = reelay.pid().to_string();
        // On 2 cores the benchmark's own gRPC clients share the machine with the service.
        let measure_cpu = |report: &mut Report, label: &str, (server, client): (f64, f64), rate: f64| {
            report.add(format!("{label}: CPU, write service"), server, "cores");
            report.add(format!("{label}: CPU, the benchmark's clients"), client, "cores");
            report.add(format!("{label}: CPU per call, service + clients"), (server + client) * 1e6 / rate, "us");
        };
        let cores_since = |(server, client): (f64, f64), started: Instant| {
            let elapsed = started.elapsed().as_secs_f64();
            ((cpu_seconds(&pid) - server) / elapsed, (cpu_seconds("self") - client) / elapsed)
        };
        for clients in [1, 8, 64] {
            let (before, started) = (WriterSample::read(&reelay).await, Instant::now());
            let cpu = (cpu_seconds(&pid), cpu_seconds("self"));
            let rate = throughput(b, &c, &users, &movie, clients, false).await;
            let cores = cores_since(cpu, started);
            let elapsed = started.elapsed().as_secs_f64();
            let after = WriterSample::read(&reelay).await;
            let skipped = if events { "" } else { ", events skipped" };
            let label = format!("LogReview over gRPC, {clients} clients{skipped}");
            report.add(format!("{label}: writer busy"), 100.0 * after.busy_since(&before, elapsed), "%");
            measure_cpu(report, &label, cores, rate);
            report_writer_jobs(report, &label, &before, &after, elapsed);
            let commits = after.batches - before.batches;
            report.add(format!("{label}: calls per commit"), rate * elapsed / commits, "calls");
            if events {
                let line = report.add(format!("LogReview over gRPC, {clients} clients"), rate, "ops/s");
                line.against("raw review+outbox txn", raw_with);
                if clients == 64 {
                    line.ratio_at_least(2.0);
                    report
                        .add("LogReview over gRPC, 64 clients, vs group commit", rate, "ops/s")
                        .against("raw group commit, 64 tasks", raw_group)
                        .ratio_at_least(0.7);
                }
            } else {
                report
                    .add(format!("LogReview over gRPC, {clients} clients, events skipped"), rate, "ops/s")
                    .against("raw review-only txn", raw_without);
            }
        }
        if events {
            // What gRPC alone costs: the same calls from 64 clients, refused before any write.
            let (cpu, started) = ((cpu_seconds(&pid), cpu_seconds("self")), Instant::now());
            let rate = throughput(b, &c, &users, &movie, 64, true).await;
            let cores = cores_since(cpu, started);
            let label = "LogReview over gRPC, 64 clients, refused before any write";
            measure_cpu(report, label, cores, rate);
            report.add(label, rate, "ops/s").against("raw group commit, 64 tasks", raw_group);
        }
        reelay.stop().await;
    }
    Ok(())
}

/// Fills the outbox of a fresh database with `rows` review events, in big write jobs.
pub(crate) async fn backlog(path: &Path, rows: usize) -> anyhow::Result<()> {
    let db = Database::open(&DbConfig::new(path)).await?;
    for chunk in 0..rows.div_ceil(2000) {
        let n = 2000.min(rows - chunk * 2000);
        db.writer
            .transact::<_, BenchError, _>("backlog", move |tx: &mut WriteTx| {
                Box::pin(async move {
                    let events = (0..n)
                        .map(|i| {
                            let event = v1::Event::decode(review_event(i as u64).as_slice()).expect("encoded above");
                            NewEvent::new(&event.aggregate_id, event.payload.expect("payload"))
                        })
                        .collect();
                    enqueue_events(tx, events).await?;
                    Ok(())
                })
            })
            .await?;
    }
    db.close().await;
    Ok(())
}

#[derive(Debug)]
struct BenchError(String);

impl std::fmt::Display for BenchError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for BenchError {}

impl From<sqlx::Error> for BenchError {
    fn from(e: sqlx::Error) -> Self {
        Self(e.to_string())
    }
}

impl From<reelay_outbox::EnqueueError> for BenchError {
    fn from(e: reelay_outbox::EnqueueError) -> Self {
        Self(e.to_string())
    }
}

impl From<reelay_outbox::CommitError> for BenchError {
    fn from(e: reelay_outbox::CommitError) -> Self {
        Self(e.to_string())
    }
}

pub(crate) async fn stats(c: &mut Clients) -> v1::StatsResponse {
    c.outbox.stats(v1::StatsRequest {}).await.expect("outbox stats").into_inner()
}

/// Raw pipelined JetStream publishes from this process: `rows` messages of the relay's size,
/// each with a unique `Nats-Msg-Id`, `in_flight` PubAcks outstanding.
async fn raw_publish(nats: &NatsServer, rows: usize, in_flight: usize) -> anyhow::Result<f64> {
    let client = async_nats::connect(nats.url()).await?;
    let js = async_nats::jetstream::new(client);
    js.create_stream(async_nats::jetstream::stream::Config {
        name: "BASELINE".into(),
        subjects: vec!["baseline.>".into()],
        storage: async_nats::jetstream::stream::StorageType::File,
        duplicate_window: Duration::from_secs(3600),
        ..Default::default()
    })
    .await?;
    let payloads: Vec<Vec<u8>> = (0..1000).map(|i| review_event(i as u64)).collect();
    let started = Instant::now();
    let mut pending = FuturesUnordered::new();
    for i in 0..rows {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("Nats-Msg-Id", uuid::Uuid::now_v7().to_string().as_str());
        let ack = js.publish_with_headers("baseline.ReviewLogged", headers, payloads[i % 1000].clone().into()).await?;
        pending.push(ack.into_future());
        if pending.len() >= in_flight {
            pending.next().await.expect("one in flight")?;
        }
    }
    while let Some(ack) = pending.next().await {
        ack?;
    }
    Ok(rows as f64 / started.elapsed().as_secs_f64())
}

/// Scenario 2: the relay draining a backlog to JetStream, against raw pipelined publishes.
pub async fn relay_drain(b: &Bench, report: &mut Report) -> anyhow::Result<()> {
    eprintln!("relay drain");
    let dir = scratch()?;
    let nats = NatsServer::start(&dir.path().join("nats"));
    let raw = raw_publish(&nats, b.relay_backlog, 256).await?;
    let db = dir.path().join("reelay.db");
    backlog(&db, b.relay_backlog).await?;
    // On nats, as the relay is: a write service on db refuses a relay's claims.
    let mut write_env = nats_env(&nats);
    write_env.push(("RUST_LOG".into(), "warn".into()));
    let mut write = start(b, &db, &["write"], &write_env).await;
    let mut c = write.clients().await;
    let mut env = nats_env(&nats);
    env.push(("REELAY_WRITE_URL".into(), format!("http://{}", write.addr)));
    let js = async_nats::jetstream::new(async_nats::connect(nats.url()).await?);
    let (before, started) = (WriterSample::read(&write).await, Instant::now());
    let mut relay = start(b, &dir.path().join("relay/x.db"), &["relay"], &env).await;
    // Progress is read off the broker while the backlog drains: the outbox's stats count every
    // row, and asked every 20 ms they slowed the drain they measured (see BENCHMARKS.md).
    loop {
        let stored = match js.get_stream(STREAM).await {
            Ok(mut stream) => stream.info().await?.state.messages,
            Err(_) => 0, // the relay has not made the stream yet
        };
        if stored >= b.relay_backlog as u64 && stats(&mut c).await.done >= b.relay_backlog as u64 {
            break;
        }
        anyhow::ensure!(
            started.elapsed() < Duration::from_secs(300),
            "the relay did not drain the backlog in 5 minutes ({stored} rows published)"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let elapsed = started.elapsed().as_secs_f64();
    let rate = b.relay_backlog as f64 / elapsed;
    let after = WriterSample::read(&write).await;
    report.add("relay drain: write service's writer busy", 100.0 * after.busy_since(&before, elapsed), "%");
    report_writer_jobs(report, "relay drain", &before, &after, elapsed);
    report
        .add(format!("relay drain of {} outbox rows to JetStream", b.relay_backlog), rate, "ev/s")
        .against("raw pipelined JetStream publish", raw)
        .ratio_at_least(0.8);
    relay.stop().await;
    write.stop().await;
    Ok(())
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

/// Scenario 3: commit-to-handler-start latency at steady rates on both backends, with 1 and 8
/// handlers, in milliseconds and in raw commit-times of the same run.
pub async fn latency(b: &Bench, report: &mut Report) -> anyhow::Result<()> {
    // The unit of latency: one raw review+outbox commit on this disk, measured now (the disk's
    // speed moves 2.5x between runs, so milliseconds alone compare nothing).
    let commit_ms = 1000.0 / raw_sqlite(b, true).await?;
    report.add("raw SQLite: one review + outbox commit, FULL", commit_ms, "ms");
    // The db backend also runs with synchronous=normal (no fsync per commit) to show how much of
    // its latency is the disk's fsync; 8 handlers at the target rate show what each added
    // handler costs.
    let configs = [("db", "full", 1), ("db", "normal", 1), ("nats", "full", 1), ("db", "full", 8), ("nats", "full", 8)];
    for (backend, sync, handlers) in configs {
        eprintln!("delivery latency, {backend} backend, synchronous={sync}, {handlers} handler(s)");
        let dir = scratch()?;
        let effects = dir.path().join("effects.db");
        let nats = (backend == "nats").then(|| NatsServer::start(&dir.path().join("nats")));
        let mut env: Env = match &nats {
            Some(nats) => nats_env(nats),
            None => vec![("RUST_LOG".into(), "warn".into())],
        };
        // Only the probes: the real handlers would each add their own ledger work per event.
        let probes = reelay_probe::PROBES[..handlers].join(",");
        env.push(("REELAY_PROBE_HANDLERS".into(), probes.clone()));
        env.push(("REELAY_HANDLERS".into(), probes));
        env.push(("REELAY_PROBE_DB".into(), effects.to_string_lossy().into_owned()));
        env.push(("REELAY_SQLITE_SYNCHRONOUS".into(), sync.into()));
        let mut label = backend.to_owned();
        if sync != "full" {
            label.push_str(&format!(" (synchronous={sync})"));
        }
        if handlers > 1 {
            label.push_str(&format!(", {handlers} handlers"));
        }
        let db = dir.path().join("reelay.db");
        let mut reelay = start(b, &db, &[], &env).await;
        let mut c = reelay.clients().await;
        let (users, movie) = fixtures(&mut c, &db, 8).await;
        let rates: &[usize] = if handlers == 1 { &[200, 2000] } else { &[200] };
        for &rate in rates {
            let (sent, achieved) = paced(b, &c, &users, &movie, rate).await;
            let expected = sent.len() * handlers;
            let waited = Instant::now();
            let latencies = loop {
                let handled = handler_starts(&db, &effects, &sent).await;
                if handled.len() == expected || waited.elapsed() > Duration::from_secs(60) {
                    break handled;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            };
            anyhow::ensure!(
                latencies.len() == expected,
                "only {} of {expected} (event, handler) pairs started",
                latencies.len()
            );
            let mut ms: Vec<f64> = latencies;
            ms.sort_by(f64::total_cmp);
            let name = format!("{label}: send-to-handler-start at {rate}/s");
            report.add(format!("{label}: achieved write rate (target {rate}/s)"), achieved, "ev/s");
            let targeted = rate == 200 && sync == "full";
            let p50 = report.add(format!("{name}, p50"), percentile(&ms, 0.5), "ms");
            if targeted {
                p50.against("one raw commit", commit_ms).ratio_at_most(5.0);
            }
            let p99 = report.add(format!("{name}, p99"), percentile(&ms, 0.99), "ms");
            if targeted {
                p99.against("one raw commit", commit_ms).ratio_at_most(25.0);
            }
            report.add(format!("{name}, max"), *ms.last().expect("some latencies"), "ms");
            for (stage, median) in stages(&db, &effects, &sent).await {
                report.add(format!("{label} at {rate}/s, median {stage}"), median, "ms");
            }
        }
        reelay.stop().await;
    }
    Ok(())
}

/// Sends LogReview at `rate` per second for the measured duration; returns review id → send
/// time (µs) and the achieved rate.
async fn paced(b: &Bench, c: &Clients, users: &[String], movie: &str, rate: usize) -> (HashMap<String, i64>, f64) {
    let total = (rate as f64 * b.measure.as_secs_f64()) as usize;
    let next = Arc::new(AtomicUsize::new(0));
    let start = tokio::time::Instant::now() + Duration::from_millis(50);
    let mut tasks = Vec::new();
    for w in 0..32 {
        let (mut c, next) = (c.clone(), next.clone());
        let (user, movie) = (users[w % users.len()].clone(), movie.to_owned());
        tasks.push(tokio::spawn(async move {
            let mut sent = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= total {
                    return sent;
                }
                tokio::time::sleep_until(start + Duration::from_secs_f64(i as f64 / rate as f64)).await;
                let at = now_us();
                let review = c.reviews.log_review(log_review(&user, &movie, i as u64)).await.expect("LogReview");
                sent.push((review.into_inner().review.expect("review").review_id, at));
            }
        }));
    }
    let mut sent = HashMap::new();
    for task in tasks {
        sent.extend(task.await.expect("pacer"));
    }
    let elapsed = (tokio::time::Instant::now() - start).as_secs_f64();
    (sent, total as f64 / elapsed)
}

/// Where the time goes, per event (medians, ms). On nats: from the write job's start to the
/// relay's outbox claim, from there to the handler's ledger claim, and from that to the handler.
/// On db there is no outbox claim: the handler's delivery claim (its cursor moving past the row
/// and its ledger row created, one write job) follows the write directly.
async fn stages(db: &Path, effects: &Path, sent: &HashMap<String, i64>) -> Vec<(&'static str, f64)> {
    let rows = query_strings(
        db,
        "SELECT q.event_id, q.aggregate_id, CAST(q.created_at AS TEXT), CAST(q.claimed_at AS TEXT), CAST(p.started_at AS TEXT) \
         FROM event_queue q JOIN processed_events p ON p.event_id = q.event_id AND p.handler = 'probe-a' \
         WHERE q.event_type = 'ReviewLogged'",
    )
    .await;
    let starts: HashMap<String, i64> =
        query_strings(effects, "SELECT event_id, CAST(MIN(at_us) AS TEXT) FROM attempts GROUP BY event_id")
            .await
            .into_iter()
            .filter_map(|r| Some((r[0].clone(), r[1].parse().ok()?)))
            .collect();
    let mut spans: [Vec<f64>; 4] = Default::default();
    for r in rows.iter().filter(|r| sent.contains_key(&r[1])) {
        let (Ok(created), Ok(ledger), Some(start)) = (r[2].parse::<f64>(), r[4].parse::<f64>(), starts.get(&r[0]))
        else {
            continue;
        };
        match r[3].parse::<f64>() {
            Ok(claimed) => {
                spans[0].push(claimed - created);
                spans[1].push(ledger - claimed);
            }
            Err(_) => spans[2].push(ledger - created),
        }
        spans[3].push(*start as f64 / 1000.0 - ledger);
    }
    let names = [
        "write start to outbox claim",
        "outbox claim to ledger claim",
        "write start to delivery claim",
        "ledger claim to handler start",
    ];
    names
        .into_iter()
        .zip(spans)
        .filter(|(_, s)| !s.is_empty())
        .map(|(name, mut s)| {
            s.sort_by(f64::total_cmp);
            (name, percentile(&s, 0.5))
        })
        .collect()
}

/// Latency (ms) from each review's send to its ReviewLogged's first handler start.
async fn handler_starts(db: &Path, effects: &Path, sent: &HashMap<String, i64>) -> Vec<f64> {
    let events: HashMap<String, String> =
        query_strings(db, "SELECT event_id, aggregate_id FROM event_queue WHERE event_type = 'ReviewLogged'")
            .await
            .into_iter()
            .map(|r| (r[0].clone(), r[1].clone()))
            .collect();
    if !effects.exists() {
        return Vec::new();
    }
    // One start per (event, handler): its first attempt.
    let starts =
        query_strings(effects, "SELECT event_id, CAST(MIN(at_us) AS TEXT) FROM attempts GROUP BY event_id, handler")
            .await;
    starts
        .into_iter()
        .filter_map(|r| {
            let review = events.get(&r[0])?;
            let sent_at = sent.get(review)?;
            Some((r[1].parse::<i64>().ok()? - sent_at) as f64 / 1000.0)
        })
        .collect()
}

/// Scenario 4: ledger claims + completes through the Ledger API, against the same SQL
/// in-process with one pair per transaction.
pub async fn ledger(b: &Bench, report: &mut Report) -> anyhow::Result<()> {
    eprintln!("ledger");
    // Baseline: claim + complete of one pair per transaction.
    let dir = scratch()?;
    let mut conn = raw_connection(&dir.path().join("raw.db")).await?;
    let start = Instant::now();
    let (from, until) = (start + b.warmup, start + b.warmup + b.measure);
    let mut counted = 0u64;
    while Instant::now() < until {
        let id = uuid::Uuid::now_v7().to_string();
        let mut tx = conn.begin_with("BEGIN IMMEDIATE").await?;
        sqlx::query("INSERT INTO processed_events (event_id, handler, status, started_at) VALUES (?, 'bench', 'in_progress', 1) ON CONFLICT DO NOTHING")
            .bind(id.clone())
            .execute(&mut *tx)
            .await?;
        sqlx::query("UPDATE processed_events SET status = 'done', processed_at = 2 WHERE event_id = ? AND handler = 'bench' AND started_at = 1")
            .bind(id)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        let done = Instant::now();
        if done >= from && done <= until {
            counted += 1;
        }
    }
    let raw = counted as f64 / b.measure.as_secs_f64();

    let mut write = start_quiet_write(b, dir.path()).await;
    let c = write.clients().await;
    let clients = 4;
    let batch = 256;
    let start = Instant::now();
    let (from, until) = (start + b.warmup, start + b.warmup + b.measure);
    let mut tasks = Vec::new();
    for _ in 0..clients {
        let mut c = c.clone();
        tasks.push(tokio::spawn(async move {
            let mut counted = 0u64;
            while Instant::now() < until {
                let keys: Vec<v1::LedgerKey> = (0..batch)
                    .map(|_| v1::LedgerKey { event_id: uuid::Uuid::now_v7().to_string(), handler: "bench".into() })
                    .collect();
                let claims = c
                    .ledger
                    .claim(v1::LedgerClaimRequest { keys, owner: "bench#1".into(), ..Default::default() })
                    .await
                    .expect("claim")
                    .into_inner()
                    .claims;
                let owned = claims
                    .into_iter()
                    .map(|claim| match claim.outcome {
                        Some(v1::ledger_claim::Outcome::AcquiredToken(token)) => v1::OwnedKey { key: claim.key, token },
                        other => panic!("fresh keys are acquired, got {other:?}"),
                    })
                    .collect();
                let settled = c.ledger.complete(v1::LedgerSettleRequest { keys: owned }).await.expect("complete");
                assert!(settled.into_inner().owned.iter().all(|o| *o));
                let done = Instant::now();
                if done >= from && done <= until {
                    counted += batch as u64;
                }
            }
            counted
        }));
    }
    let mut total = 0;
    for task in tasks {
        total += task.await?;
    }
    let rate = total as f64 / b.measure.as_secs_f64();
    report.add("raw SQLite: ledger claim + done, 1 pair per txn", raw, "pairs/s");
    report
        .add(format!("Ledger API claim + complete, {batch} pairs per call, {clients} clients"), rate, "pairs/s")
        .against("1 pair per txn in-process", raw)
        .ratio_at_least(5.0);
    write.stop().await;
    Ok(())
}

/// A process that logs warnings only, with `env` added.
pub(crate) async fn start_quiet(b: &Bench, db: &Path, services: &[&'static str], env: &[(String, String)]) -> Reelay {
    let mut all: Env = vec![("RUST_LOG".into(), "warn".into())];
    all.extend_from_slice(env);
    start(b, db, services, &all).await
}

async fn start_quiet_write(b: &Bench, dir: &Path) -> Reelay {
    start(b, &dir.join("reelay.db"), &["write"], &vec![("RUST_LOG".into(), "warn".into())]).await
}

/// The write service's single writer, from one reading of its metrics. Two samples bracket a
/// window: their difference, divided by the window, is how the writer spent it.
#[derive(Debug, Clone, Default)]
pub(crate) struct WriterSample {
    /// Seconds in write batches, BEGIN to COMMIT.
    pub(crate) busy: f64,
    /// Batches run (one commit each).
    pub(crate) batches: f64,
    /// Seconds in `COMMIT` (its fsync).
    pub(crate) committing: f64,
    /// Seconds per kind of write job (`reelay_writer_job_seconds`, by job).
    pub(crate) jobs: HashMap<String, f64>,
    /// Jobs run, by kind.
    pub(crate) job_counts: HashMap<String, f64>,
    /// Requests answered by merged jobs, by kind (`reelay_writer_merged_requests`).
    pub(crate) merged: HashMap<String, f64>,
}

impl WriterSample {
    pub(crate) async fn read(write: &Reelay) -> Self {
        let metrics = write.metrics().await;
        let by_job = |prefix: &str| -> HashMap<String, f64> {
            metrics
                .0
                .lines()
                .filter_map(|line| {
                    let (job, value) = line.strip_prefix(prefix)?.strip_prefix("{job=\"")?.split_once("\"} ")?;
                    Some((job.to_owned(), value.trim().parse().ok()?))
                })
                .collect()
        };
        Self {
            busy: metrics.sum("reelay_writer_batch_seconds_sum", &[]),
            batches: metrics.sum("reelay_writer_batch_seconds_count", &[]),
            committing: metrics.sum("reelay_writer_commit_seconds_sum", &[]),
            jobs: by_job("reelay_writer_job_seconds_sum"),
            job_counts: by_job("reelay_writer_job_seconds_count"),
            merged: by_job("reelay_writer_merged_requests_sum"),
        }
    }

    /// The share of `elapsed` the writer was busy since `before`.
    pub(crate) fn busy_since(&self, before: &Self, elapsed: f64) -> f64 {
        (self.busy - before.busy) / elapsed
    }
}

/// What the writer spent its time on between two samples: its time in `COMMIT` and the four
/// largest kinds of job, each as a share of `elapsed` (the rest of its busy time is BEGIN and
/// savepoints), with each kind's time per job and, for merged jobs, the requests each answered.
pub(crate) fn report_writer_jobs(
    report: &mut Report,
    label: &str,
    before: &WriterSample,
    after: &WriterSample,
    elapsed: f64,
) {
    let committing = (after.committing - before.committing) / elapsed;
    report.add(format!("{label}: writer time in COMMIT"), 100.0 * committing, "%");
    let since = |now: &HashMap<String, f64>, then: &HashMap<String, f64>, job: &str| {
        now.get(job).copied().unwrap_or(0.0) - then.get(job).copied().unwrap_or(0.0)
    };
    let mut spent: Vec<(&String, f64)> =
        after.jobs.keys().map(|job| (job, since(&after.jobs, &before.jobs, job))).filter(|(_, s)| *s > 0.0).collect();
    spent.sort_by(|a, b| b.1.total_cmp(&a.1));
    for (job, seconds) in spent.into_iter().take(4) {
        report.add(format!("{label}: writer time in {job} jobs"), 100.0 * seconds / elapsed, "%");
        let count = since(&after.job_counts, &before.job_counts, job);
        if count > 0.0 {
            report.add(format!("{label}: {job} job, writer time each"), 1000.0 * seconds / count, "ms");
            let merged = since(&after.merged, &before.merged, job);
            if merged > 0.0 {
                report.add(format!("{label}: {job} job, requests each"), merged / count, "calls");
            }
        }
    }
}

/// The JetStream stream every handler consumes (the default `REELAY_STREAM`).
const STREAM: &str = "REELAY_EVENTS";

/// Where the handlers stand: `None` when every handler that runs is done with every event
/// written so far, else who is behind (for the progress and time-out messages).
///
/// db: the Outbox API's per-handler stats: each handler's cursor at the newest outbox row (it
/// has looked at every row) and none of its deliveries claimed or waiting for a retry. One read,
/// so one snapshot: a follow-up event a handler writes is in the outbox before its delivery is
/// settled.
///
/// nats: every outbox row published (the relay marks a row done on its PubAck), every handler's
/// JetStream consumer with nothing pending and nothing unacknowledged (a message waiting out a nak
/// delay counts as unacknowledged), and the outbox unchanged meanwhile (a follow-up event relayed
/// between the two looks would otherwise go unseen).
async fn handlers_behind(
    c: &mut Clients,
    js: Option<&async_nats::jetstream::Context>,
) -> anyhow::Result<Option<String>> {
    let before = stats(c).await;
    let Some(js) = js else {
        let behind: Vec<String> = before
            .handlers
            .iter()
            .filter(|h| h.behind + h.in_progress + h.retrying > 0)
            .map(|h| {
                format!(
                    "{} ({} rows behind, {} in progress, {} retrying)",
                    h.handler, h.behind, h.in_progress, h.retrying
                )
            })
            .collect();
        return Ok((!behind.is_empty()).then(|| behind.join(", ")));
    };
    if before.pending + before.processing > 0 {
        return Ok(Some(format!("the relay ({} outbox rows not yet published)", before.pending + before.processing)));
    }
    let stream = js.get_stream(STREAM).await?;
    let mut consumers = stream.consumers();
    let mut behind = Vec::new();
    while let Some(info) = consumers.next().await {
        let info = info?;
        if info.num_pending > 0 || info.num_ack_pending > 0 {
            behind
                .push(format!("{} ({} pending, {} unacknowledged)", info.name, info.num_pending, info.num_ack_pending));
        }
    }
    if !behind.is_empty() {
        return Ok(Some(behind.join(", ")));
    }
    let after = stats(c).await;
    if after.done != before.done || after.pending + after.processing > 0 {
        return Ok(Some("the relay (new outbox rows)".into()));
    }
    Ok(None)
}

/// Waits until every handler is done ([`handlers_behind`]), for at most 300 s.
async fn wait_for_handlers(
    c: &mut Clients,
    js: Option<&async_nats::jetstream::Context>,
    since: Instant,
) -> anyhow::Result<()> {
    loop {
        let Some(behind) = handlers_behind(c, js).await? else { return Ok(()) };
        anyhow::ensure!(
            since.elapsed() < Duration::from_secs(300),
            "the handlers did not catch up in 5 minutes; still behind: {behind}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Scenarios 5 and 6: sustained end to end with every real handler of the default set, services
/// as separate processes (write, on nats the relay, handlers), and the memory each uses idle and
/// under that load. 64 clients call LogReview for `b.measure` (after `b.warmup`); events/s are
/// the reviews written over the time from the first call until every handler is done with every
/// event (see [`handlers_behind`]). Baseline: the raw one-transaction-per-row rate.
pub async fn sustained(b: &Bench, report: &mut Report) -> anyhow::Result<()> {
    let raw = raw_sqlite(b, true).await?;
    for backend in ["db", "nats"] {
        eprintln!("sustained end to end, {backend} backend");
        let mut run = Deployment::start(b, backend, Vec::new(), 0).await?;
        run.add_handlers(b, "handlers", &[]).await;
        let (db, write) = (run.db.clone(), &run.write);
        let js = match &run.nats {
            Some(nats) => Some(async_nats::jetstream::new(async_nats::connect(nats.url()).await?)),
            None => None,
        };
        let mut c = write.clients().await;
        let (users, movie) = fixtures(&mut c, &db, 8).await;
        // The fixtures' events (users, the movie, its enrichment and what follows) are handled
        // before the load starts.
        wait_for_handlers(&mut c, js.as_ref(), Instant::now()).await?;
        tokio::time::sleep(Duration::from_millis(500)).await;
        let mut processes: Vec<(&str, u32)> = vec![("write", write.pid())];
        processes.extend(run.others.iter().map(|(name, p)| (name.as_str(), p.pid())));
        let idle: Vec<(&str, f64)> = processes.iter().map(|(name, pid)| (*name, rss_mb(*pid).0)).collect();

        let cpu = |processes: &[(&str, u32)]| -> Vec<f64> {
            processes.iter().map(|(_, pid)| cpu_seconds(&pid.to_string())).chain([cpu_seconds("self")]).collect()
        };
        let (before, started) = (WriterSample::read(write).await, Instant::now());
        let cpu_before = cpu(&processes);
        let written = throughput(b, &c, &users, &movie, 64, false).await * b.measure.as_secs_f64();
        let wanted = query_strings(&db, "SELECT COUNT(*) || '' FROM event_queue WHERE event_type = 'ReviewLogged'")
            .await[0][0]
            .parse::<u64>()?;
        wait_for_handlers(&mut c, js.as_ref(), started).await?;
        let elapsed = started.elapsed().as_secs_f64();
        let cpu_after = cpu(&processes);
        let after = WriterSample::read(write).await;
        let dead = query_strings(
            &db,
            "SELECT handler || ': ' || COUNT(*) FROM processed_events WHERE status = 'dead_lettered' GROUP BY handler",
        )
        .await;
        if !dead.is_empty() {
            eprintln!("  warning: dead letters after the load: {}", dead.concat().join(", "));
        }
        let line = report
            .add(
                format!("{backend}: LogReview (64 clients) to every handler done, sustained"),
                wanted as f64 / elapsed,
                "ev/s",
            )
            .against("raw review+outbox txn", raw);
        if backend == "db" {
            line.ratio_at_least(3.0);
        }
        report.add(format!("{backend}: reviews written during the load"), written, "ev");
        report.add(
            format!("{backend}: write service's writer busy until then"),
            100.0 * after.busy_since(&before, elapsed),
            "%",
        );
        report_writer_jobs(report, backend, &before, &after, elapsed);
        // Where the 2 cores went until every handler was done (the benchmark: its 64 clients).
        let names = processes.iter().map(|(name, _)| *name).chain(["benchmark"]);
        for (name, (then, now)) in names.zip(cpu_before.iter().zip(&cpu_after)) {
            report.add(format!("{backend}: CPU until then, {name}"), (now - then) / elapsed, "cores");
        }
        for ((name, pid), (_, idle_mb)) in processes.iter().zip(idle) {
            report.add(format!("{backend}: {name} RSS idle"), idle_mb, "MB").at_most(64.0);
            report.add(format!("{backend}: {name} peak RSS under load"), rss_mb(*pid).1, "MB").at_most(64.0);
        }
        run.stop().await;
    }
    Ok(())
}
