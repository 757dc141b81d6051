//! Many handlers and many replicas: what more handlers cost per event, and what more
//! processes of one handler buy.

use std::path::Path;
use std::time::{Duration, Instant};

use reelay_harness::{NatsServer, Reelay, query_strings};

use crate::Bench;
use crate::report::Report;
use crate::scenarios::{
    Env, WriterSample, backlog, fixtures, nats_env, report_writer_jobs, scratch, start, stats, throughput,
};

/// One number from a query that returns one.
async fn count(db: &Path, sql: &str) -> anyhow::Result<u64> {
    Ok(query_strings(db, sql).await[0][0].parse()?)
}

/// The processes of one run: the write service, on nats the relay and the server, and handlers.
/// (Fields drop in this order: the processes before the server, the directory last.)
pub(crate) struct Deployment {
    pub(crate) write: Reelay,
    /// The relay (on nats) and the handlers processes, each with its name, in the order they
    /// were started.
    pub(crate) others: Vec<(String, Reelay)>,
    pub(crate) nats: Option<NatsServer>,
    pub(crate) db: std::path::PathBuf,
    /// Every process's environment (the write service's URL included).
    env: Env,
    /// The run's directory (databases, logs), removed when the run is dropped.
    dir: tempfile::TempDir,
}

impl Deployment {
    /// A write service on a fresh database (with `rows` review events already in its outbox) and
    /// on nats a server and the relay, each process with `env` added. The probes' effects file
    /// is `effects.db` in the run's directory unless a process's own environment says otherwise.
    pub(crate) async fn start(b: &Bench, backend: &str, env: Env, rows: usize) -> anyhow::Result<Self> {
        let dir = scratch()?;
        let db = dir.path().join("reelay.db");
        if rows > 0 {
            backlog(&db, rows).await?;
        }
        let nats = (backend == "nats").then(|| NatsServer::start(&dir.path().join("nats")));
        let mut all: Env = match &nats {
            Some(nats) => nats_env(nats),
            None => vec![("RUST_LOG".into(), "warn".into())],
        };
        all.push(("REELAY_PROBE_DB".into(), dir.path().join("effects.db").to_string_lossy().into_owned()));
        all.extend(env);
        let write = start(b, &db, &["write"], &all).await;
        all.push(("REELAY_WRITE_URL".into(), format!("http://{}", write.addr)));
        let mut others = Vec::new();
        if nats.is_some() {
            others.push(("relay".to_owned(), start(b, &dir.path().join("relay/x.db"), &["relay"], &all).await));
        }
        Ok(Self { write, others, nats, db, env: all, dir })
    }

    /// Starts a handlers process in its own data dir, `extra` added to the environment.
    pub(crate) async fn add_handlers(&mut self, b: &Bench, name: &str, extra: &[(String, String)]) {
        let mut env = self.env.clone();
        env.extend_from_slice(extra);
        let data = self.dir.path().join(name);
        self.others.push((name.to_owned(), start(b, &data.join("x.db"), &["handlers"], &env).await));
    }

    /// Stops the handlers and the relay together (an idle one may be in a long poll), then the
    /// write service.
    pub(crate) async fn stop(mut self) {
        futures_util::future::join_all(self.others.iter_mut().map(|(_, process)| process.stop())).await;
        self.write.stop().await;
        drop(self.nats);
    }
}

/// Scenario 9, many handlers: the sustained load of scenario 5 (64 clients calling LogReview for
/// `b.measure` after `b.warmup`) delivered to 1 and then to 8 probe handlers (probe-a..probe-h,
/// each takes every event type; nothing else runs), write, (relay,) and handlers as separate
/// processes, on each backend. Measured: reviews per second from the first call until every
/// (event, handler) pair is done, and for 8 handlers the pairs per second. Baseline: the
/// 1-handler events/s of the same run; 8 handlers may cost at most twice the 1-handler time per
/// event, so their pairs/s must be at least 4x it.
pub async fn many_handlers(b: &Bench, report: &mut Report) -> anyhow::Result<()> {
    for backend in ["db", "nats"] {
        let mut one = 0.0;
        for handlers in [1, 8] {
            eprintln!("many handlers, {backend} backend, {handlers} probe handler(s)");
            let (reviews, elapsed, (before, after)) = probes_sustained(b, backend, handlers).await?;
            let rate = reviews as f64 / elapsed;
            let label =
                if handlers == 1 { format!("{backend}, 1 handler") } else { format!("{backend}, {handlers} handlers") };
            let line = report.add(format!("{label}: LogReview to every handler done, sustained"), rate, "ev/s");
            if handlers == 1 {
                one = rate;
            } else {
                line.against("1 handler", one);
                report
                    .add(format!("{label}: (event, handler) pairs/s"), rate * handlers as f64, "pairs/s")
                    .against("1 handler, events/s", one)
                    .ratio_at_least(4.0);
            }
            report.add(
                format!("{label}: write service's writer busy"),
                100.0 * after.busy_since(&before, elapsed),
                "%",
            );
            report_writer_jobs(report, &label, &before, &after, elapsed);
        }
    }
    Ok(())
}

/// One run of [`many_handlers`]: the reviews written, the seconds from the first call until
/// every pair was done, and the write service's writer sampled at both ends of that time.
async fn probes_sustained(
    b: &Bench,
    backend: &str,
    handlers: usize,
) -> anyhow::Result<(u64, f64, (WriterSample, WriterSample))> {
    // Only the probes (the default set's real handlers would add their own work per event), and
    // the write service must know them too: it delivers to the handlers it lists.
    let probes = reelay_probe::PROBES[..handlers].join(",");
    let env: Env = vec![("REELAY_PROBE_HANDLERS".into(), probes.clone()), ("REELAY_HANDLERS".into(), probes)];
    let mut run = Deployment::start(b, backend, env, 0).await?;
    run.add_handlers(b, "handlers", &[]).await;
    let mut c = run.write.clients().await;
    let (users, movie) = fixtures(&mut c, &run.db, 8).await;
    // Only probes run, and they take every event type: every outbox row is `handlers` pairs,
    // and every `done` row of the ledger is a probe's. (The cheap count, through the index of
    // done rows, is what is polled; the exact count per review follows.)
    let all_done = |db: std::path::PathBuf, since: Instant| async move {
        loop {
            let events = count(&db, "SELECT COUNT(*) || '' FROM event_queue").await?;
            let done = count(&db, "SELECT COUNT(*) || '' FROM processed_events WHERE status = 'done'").await?;
            if done >= events * handlers as u64 {
                return anyhow::Ok(());
            }
            if since.elapsed() > Duration::from_secs(300) {
                let each = query_strings(
                    &db,
                    "SELECT handler || ': ' || COUNT(*) FROM processed_events WHERE status = 'done' GROUP BY handler",
                )
                .await;
                anyhow::bail!(
                    "the probes did not finish in 5 minutes: {done} of {} pairs done (done per handler: {})",
                    events * handlers as u64,
                    each.concat().join(", ")
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    // The fixtures' events (the users, the movie) are handled before the load.
    all_done(run.db.clone(), Instant::now()).await?;
    let (before, started) = (WriterSample::read(&run.write).await, Instant::now());
    throughput(b, &c, &users, &movie, 64, false).await;
    all_done(run.db.clone(), started).await?;
    let elapsed = started.elapsed().as_secs_f64();
    let after = WriterSample::read(&run.write).await;
    let reviews = count(&run.db, "SELECT COUNT(*) || '' FROM event_queue WHERE event_type = 'ReviewLogged'").await?;
    let pairs = count(
        &run.db,
        "SELECT COUNT(*) || '' FROM processed_events p JOIN event_queue q ON q.event_id = p.event_id \
         WHERE q.event_type = 'ReviewLogged' AND p.handler LIKE 'probe-%' AND p.status = 'done'",
    )
    .await?;
    anyhow::ensure!(
        pairs == reviews * handlers as u64,
        "{pairs} (ReviewLogged, probe) pairs done, expected {reviews} reviews x {handlers} handlers"
    );
    run.stop().await;
    Ok((reviews, elapsed, (before, after)))
}

/// Per-event wait of the replicas scenario's handler.
const HANDLER_WAIT_MS: u64 = 10;

/// Scenario 10, scale-out by replicas: one handler that spends 10 ms per event waiting (probe-a
/// with `REELAY_PROBE_DELAY_MS=10`) run as 1, 2 and 4 replicas (separate handlers processes, each
/// its own instance name), beside the write service (and on nats the relay), on each backend. A
/// backlog of review events larger than 4 replicas can finish is in the outbox (on nats already
/// published) before the replicas start; once all of them run, events done per second over
/// `b.measure` after `b.warmup`. Baseline: the 1-replica rate of the same run.
///
/// What bounds one replica: it takes one event at a time (`REELAY_CONSUMER_BATCH=1`, and the
/// probe waits once per batch, so 10 ms per event; `REELAY_CONSUMER_IN_FLIGHT=1`), so it does at
/// most 100 events/s, less the claim, ledger and settle round trips of each event (each a write
/// service transaction with its commit). Waiting, not CPU, bounds it: the processes are mostly
/// idle. More replicas scale as long as what they share (the write service's single writer, on
/// nats also the broker) keeps up; the writer's busy share is reported beside each figure.
pub async fn replicas(b: &Bench, report: &mut Report) -> anyhow::Result<()> {
    for backend in ["db", "nats"] {
        let mut one = 0.0;
        for n in [1usize, 2, 4] {
            eprintln!("replicas, {backend} backend, {n} replica(s) of a {HANDLER_WAIT_MS} ms handler");
            let (rate, busy) = replica_rate(b, backend, n).await?;
            let label = if n == 1 {
                format!("{backend}: {HANDLER_WAIT_MS} ms handler, 1 replica")
            } else {
                format!("{backend}: {HANDLER_WAIT_MS} ms handler, {n} replicas")
            };
            let line = report.add(label.clone(), rate, "ev/s");
            if n == 1 {
                one = rate;
            } else {
                // Twice the replicas at least 1.8 times the rate; four at least 3.5 times.
                line.against("1 replica", one).ratio_at_least(if n == 2 { 1.8 } else { 3.5 });
            }
            report.add(format!("{label}, writer busy"), 100.0 * busy, "%");
        }
    }
    Ok(())
}

/// Events done per second by `n` replicas of the waiting handler, and the share of that time
/// the write service's writer was busy (it claims and settles every delivery on db, and keeps
/// the ledger on nats).
async fn replica_rate(b: &Bench, backend: &str, n: usize) -> anyhow::Result<(f64, f64)> {
    let per_replica = 1000 / HANDLER_WAIT_MS as usize;
    // More than n replicas can do while they start (a second each at most), warm up and measure.
    let window = b.warmup + b.measure + Duration::from_secs(n as u64 + 2);
    let rows = per_replica * n * window.as_secs() as usize;
    let env: Env = vec![
        ("REELAY_PROBE_HANDLERS".into(), "probe-a".into()),
        ("REELAY_HANDLERS".into(), "probe-a".into()),
        ("REELAY_PROBE_DELAY_MS".into(), HANDLER_WAIT_MS.to_string()),
        ("REELAY_CONSUMER_BATCH".into(), "1".into()),
        ("REELAY_CONSUMER_IN_FLIGHT".into(), "1".into()),
    ];
    let mut run = Deployment::start(b, backend, env, rows).await?;
    if run.nats.is_some() {
        // The backlog is published before the replicas start, so only they are measured.
        let mut c = run.write.clients().await;
        let since = Instant::now();
        while stats(&mut c).await.done < rows as u64 {
            anyhow::ensure!(since.elapsed() < Duration::from_secs(120), "the relay did not publish the backlog");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    for i in 0..n {
        // Each replica its own instance name: one starting under another's name would take back
        // that one's claims as a dead predecessor's.
        let name = format!("replica-{i}");
        let effects = run.dir.path().join(format!("{name}-effects.db"));
        let extra = [
            ("REELAY_INSTANCE".to_owned(), format!("bench-{name}")),
            ("REELAY_PROBE_DB".to_owned(), effects.to_string_lossy().into_owned()),
        ];
        run.add_handlers(b, &name, &extra).await;
    }
    let done = "SELECT COUNT(*) || '' FROM processed_events WHERE status = 'done'";
    tokio::time::sleep(b.warmup).await;
    let before = WriterSample::read(&run.write).await;
    let (from, at) = (count(&run.db, done).await?, Instant::now());
    tokio::time::sleep(b.measure).await;
    let (to, elapsed) = (count(&run.db, done).await?, at.elapsed().as_secs_f64());
    let busy = WriterSample::read(&run.write).await.busy_since(&before, elapsed);
    anyhow::ensure!(
        to < rows as u64,
        "the replicas finished the backlog of {rows} events within the measured time; make it larger"
    );
    run.stop().await;
    Ok(((to - from) as f64 / elapsed, busy))
}
