//! Chaos: several clients write while the services are killed and paused, the broker is killed
//! and paused, the database's disk fills up and its I/O fails. Once the faults end and the
//! system settles, a checker holds the database and the handlers' effects against what every
//! client was told (Jepsen's sets: lost, duplicated and phantom writes), and looks for writes
//! split from their events, stuck outbox rows and events no handler got.
//!
//! The test suite runs a short form: every fault once, in a fixed order. `scripts/chaos` runs
//! it for longer with random faults (`REELAY_CHAOS_SECONDS`, `REELAY_CHAOS_SEED`).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use reelay_contracts::v1;
use reelay_harness::{
    Clients, NatsServer, Reelay, ReviewLedger, Strace, Tmpfs, dead_letters, movie_id_ref, outbox_rows, probe_records,
    temp_dir, unsettled,
};
use tonic::Code;

const BIN: &str = env!("CARGO_BIN_EXE_reelay");
const CLIENTS: usize = 6;
const PROBES: [&str; 2] = ["probe-a", "probe-b"];
/// How long a fault lasts.
const HOLD: Duration = Duration::from_millis(1500);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Backend {
    Db,
    Nats,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    KillWrite,
    PauseWrite,
    KillHandlers,
    PauseHandlers,
    KillRelay,
    PauseRelay,
    KillBroker,
    PauseBroker,
    DiskFull,
    FsyncEio,
    PwriteEio,
}

impl Fault {
    fn all(backend: Backend) -> Vec<Fault> {
        use Fault::*;
        let mut faults = vec![KillWrite, PauseHandlers, DiskFull, KillHandlers, FsyncEio, PauseWrite, PwriteEio];
        if backend == Backend::Nats {
            faults.extend([KillRelay, KillBroker, PauseRelay, PauseBroker]);
        }
        faults
    }
}

/// What a client finally learned about one write, after its retries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Ok,
    /// Every attempt was told nothing was written.
    Failed,
    /// Some attempt's outcome could not be known, and none succeeded.
    Unknown,
}

struct Cluster {
    dir: PathBuf,
    db: PathBuf,
    disk: Tmpfs,
    effects: PathBuf,
    write: Reelay,
    handlers: Reelay,
    relay: Option<Reelay>,
    nats: Option<NatsServer>,
}

impl Cluster {
    async fn start(backend: Backend, dir: &Path, seconds: u64) -> Self {
        // The database lives on a small tmpfs, so the disk can really fill up. It holds what the
        // clients write in `seconds` of faults with room to spare (about 2 KB an event on nats,
        // with every handler's ledger row; some 1,100 events a second here): a database that
        // filled its disk for good could not settle, and would say nothing about the faults.
        let disk = Tmpfs::mount(&dir.join("disk"), &format!("{}m", 256.max(seconds * 5)));
        let db = disk.path.join("reelay.db");
        let effects = dir.join("effects.db");
        let nats = (backend == Backend::Nats).then(|| NatsServer::start(&dir.join("nats")));
        let mut env: Vec<(String, String)> = vec![
            // Short leases and retries, so recovery from a kill fits the test.
            ("REELAY_OUTBOX_LEASE_MS".into(), "8000".into()),
            ("REELAY_LEDGER_LEASE_MS".into(), "15000".into()),
            ("REELAY_ACK_WAIT_MS".into(), "5000".into()),
            ("REELAY_RETRY_BASE_MS".into(), "200".into()),
            ("REELAY_RETRY_CAP_MS".into(), "2000".into()),
            ("REELAY_PROBE_DB".into(), effects.to_str().unwrap().into()),
            ("REELAY_PROBE_HANDLERS".into(), "probe-a,probe-b".into()),
        ];
        if let Some(nats) = &nats {
            env.push(("EVENT_BUS_BACKEND".into(), "nats".into()));
            env.push(("NATS_URL".into(), nats.url()));
        }
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let mut spec = Reelay::spec(BIN, &db, &["write"], &env);
        // Logs stay off the disk that fills up.
        spec.log = dir.join("write.log");
        let write = Reelay::start(spec).await;
        let handlers = Reelay::start_handlers(BIN, &write, &dir.join("handlers"), &env).await;
        let relay = match backend {
            Backend::Db => None,
            Backend::Nats => {
                let mut spec = Reelay::spec(BIN, &dir.join("relay").join("unused.db"), &["relay"], &env);
                spec.env.push(("REELAY_WRITE_URL".into(), format!("http://{}", write.addr)));
                Some(Reelay::start(spec).await)
            }
        };
        Self { dir: dir.to_owned(), db, disk, effects, write, handlers, relay, nats }
    }

    /// Applies `fault` for `HOLD`, then heals it. Returns how many system calls failed, for an
    /// injected I/O error (else `None`).
    async fn apply(&mut self, fault: Fault) -> Option<usize> {
        match fault {
            Fault::KillWrite => {
                self.write.kill();
                tokio::time::sleep(HOLD).await;
                self.write.restart().await;
            }
            Fault::KillHandlers => {
                self.handlers.kill();
                tokio::time::sleep(HOLD).await;
                self.handlers.restart().await;
            }
            Fault::KillRelay => {
                let relay = self.relay.as_mut().expect("nats backend");
                relay.kill();
                tokio::time::sleep(HOLD).await;
                relay.restart().await;
            }
            Fault::KillBroker => {
                let nats = self.nats.as_mut().expect("nats backend");
                nats.kill();
                tokio::time::sleep(HOLD).await;
                nats.restart();
            }
            Fault::PauseWrite => pause(&self.write).await,
            Fault::PauseHandlers => pause(&self.handlers).await,
            Fault::PauseRelay => pause(self.relay.as_ref().expect("nats backend")).await,
            Fault::PauseBroker => {
                let nats = self.nats.as_ref().expect("nats backend");
                nats.pause();
                tokio::time::sleep(HOLD).await;
                nats.resume();
            }
            Fault::DiskFull => {
                self.disk.fill();
                tokio::time::sleep(HOLD).await;
                self.disk.drain();
            }
            Fault::FsyncEio => return Some(self.inject("fsync,fdatasync", "2+3").await),
            Fault::PwriteEio => return Some(self.inject("pwrite64", "5+23").await),
        }
        None
    }

    async fn inject(&self, syscalls: &str, when: &str) -> usize {
        let strace = Strace::inject(self.write.pid(), syscalls, "EIO", when, &self.dir).await;
        tokio::time::sleep(HOLD).await;
        strace.stop().await
    }

    /// Waits until every event in the outbox reached both probes and no row is left to
    /// deliver. Returns false if that did not happen within `limit`.
    async fn settled(&self, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            let rows = outbox_rows(&self.db).await;
            let open = !unsettled(&self.db, self.nats.is_some(), &PROBES).await.is_empty();
            let (effects, _) = probe_records(&self.effects, "effects").await;
            let delivered = rows
                .iter()
                .filter_map(|r| r.event_id.as_ref())
                .all(|id| ["probe-a", "probe-b"].iter().all(|h| effects.contains_key(&(id.clone(), (*h).to_owned()))));
            if !open && delivered {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        false
    }

    /// Prints why the system did not settle: each process's last log lines, the database's size,
    /// the probes' ledger rows and, on nats, the state of their JetStream consumers.
    async fn explain_unsettled(&self) {
        let processes =
            [("write", Some(&self.write)), ("relay", self.relay.as_ref()), ("handlers", Some(&self.handlers))];
        for (name, process) in processes.into_iter().filter_map(|(n, p)| p.map(|p| (n, p))) {
            let log = process.log_text();
            let tail: Vec<&str> = log.lines().rev().take(40).collect();
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            eprintln!("--- the {name} process's last log lines\n{}", tail.join("\n"));
        }
        let size = |suffix: &str| {
            let path = format!("{}{suffix}", self.db.display());
            std::fs::metadata(path).map_or(0, |m| m.len() / 1_000_000)
        };
        eprintln!("--- the database: {} MB, its WAL {} MB (on a tmpfs of its own)", size(""), size("-wal"));
        let sql = "SELECT handler || ' ' || status || ' ' || COUNT(*) FROM processed_events \
                   WHERE handler LIKE 'probe-%' GROUP BY handler, status";
        eprintln!("--- the probes' ledger rows: {:?}", reelay_harness::query_strings(&self.db, sql).await);
        let Some(nats) = &self.nats else { return };
        let url = format!("{}/jsz?consumers=true", nats.monitor_url());
        let (_, _, body) = reelay_harness::http_request("GET", &url, &[], b"").await;
        let jsz: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
        let streams = jsz["account_details"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|a| a["stream_detail"].as_array().into_iter().flatten().collect::<Vec<_>>());
        for stream in streams {
            eprintln!("--- stream {}: {}", stream["name"], stream["state"]);
            for consumer in stream["consumer_detail"].as_array().into_iter().flatten() {
                if consumer["name"].as_str().is_some_and(|n| n.contains("probe")) {
                    let fields =
                        ["delivered", "ack_floor", "num_ack_pending", "num_redelivered", "num_waiting", "num_pending"];
                    let state: Vec<String> = fields.iter().map(|f| format!("{f}={}", consumer[*f])).collect();
                    eprintln!("    consumer {}: {}", consumer["name"], state.join(" "));
                }
            }
        }
    }
}

async fn pause(process: &Reelay) {
    process.pause();
    tokio::time::sleep(HOLD).await;
    process.resume();
}

/// What the clients' single attempts are told, as it happens (before retries hide it): the
/// run's checks read it between faults, the report at the end.
#[derive(Default)]
struct Live {
    total: AtomicUsize,
    /// Acknowledged.
    ok: AtomicUsize,
    /// Told nothing was written.
    refused: AtomicUsize,
    /// Whose outcome could not be known (a call cut, a service unreachable).
    unknown: AtomicUsize,
}

impl Live {
    fn attempts(&self) -> Attempts {
        let read = |n: &AtomicUsize| n.load(Ordering::SeqCst);
        Attempts { total: read(&self.total), refused: read(&self.refused), unknown: read(&self.unknown) }
    }
}

/// Answers to single attempts, before retries hid them.
#[derive(Debug, Default, Clone, Copy)]
struct Attempts {
    total: usize,
    refused: usize,
    unknown: usize,
}

/// One client: writes until told to stop, retrying each write with its request_id as a careful
/// client would, telling `live` what each attempt was told. Returns marker → outcome.
async fn client(
    mut c: Clients,
    id: usize,
    user: String,
    movie: String,
    stop: Arc<AtomicBool>,
    live: Arc<Live>,
) -> Vec<(String, Outcome)> {
    let mut calls = Vec::new();
    let mut n = 0;
    while !stop.load(Ordering::SeqCst) {
        n += 1;
        let marker = format!("<c{id}-{n:05}>");
        let request = v1::LogReviewRequest {
            actor_user_id: user.clone(),
            movie: movie_id_ref(&movie),
            rating: 6,
            body: format!("{marker} chaos"),
            request_id: format!("chaos-c{id}-{n}"),
            ..Default::default()
        };
        let (mut any_unknown, mut outcome) = (false, None);
        for attempt in 0..8u32 {
            let mut call = tonic::Request::new(request.clone());
            call.set_timeout(Duration::from_secs(4));
            live.total.fetch_add(1, Ordering::SeqCst);
            let unknown = match c.reviews.log_review(call).await {
                Ok(_) => {
                    outcome = Some(Outcome::Ok);
                    live.ok.fetch_add(1, Ordering::SeqCst);
                    break;
                }
                Err(status) => match status.code() {
                    Code::Unavailable if status.message().starts_with("outcome unknown") => true,
                    Code::Unavailable if status.message().contains("nothing was written") => false,
                    Code::ResourceExhausted => false,
                    Code::Unavailable | Code::Unknown | Code::Cancelled | Code::DeadlineExceeded => true,
                    code => panic!("{marker}: a fault must never answer {code:?}: {}", status.message()),
                },
            };
            any_unknown |= unknown;
            let told = if unknown { &live.unknown } else { &live.refused };
            told.fetch_add(1, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(100 << attempt.min(4))).await;
        }
        let outcome = outcome.unwrap_or(if any_unknown { Outcome::Unknown } else { Outcome::Failed });
        calls.push((marker, outcome));
    }
    calls
}

async fn run(backend: Backend) {
    let dir = temp_dir();
    let seconds: u64 = std::env::var("REELAY_CHAOS_SECONDS").ok().and_then(|s| s.parse().ok()).unwrap_or(0);
    let mut cluster = Cluster::start(backend, dir.path(), seconds).await;
    let mut c = cluster.write.clients().await;
    let user = c.user("chaos").await;
    let movie = c.movie(&user, "Chaos", 2001).await;

    let seed: u64 = std::env::var("REELAY_CHAOS_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(1);
    let schedule: Vec<Fault> = if seconds == 0 {
        Fault::all(backend)
    } else {
        // A simple LCG: a run is repeatable from its seed.
        let faults = Fault::all(backend);
        let mut state = seed;
        let steps = (seconds as f64 / (HOLD.as_secs_f64() + 1.0)).ceil() as usize;
        (0..steps)
            .map(|_| {
                state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                faults[(state >> 33) as usize % faults.len()]
            })
            .collect()
    };
    eprintln!("chaos on {backend:?}: {} faults (seed {seed}): {schedule:?}", schedule.len());

    let stop = Arc::new(AtomicBool::new(false));
    let live = Arc::new(Live::default());
    let clients: Vec<_> = (0..CLIENTS)
        .map(|id| {
            let (stop, live) = (Arc::clone(&stop), Arc::clone(&live));
            tokio::spawn(client(c.clone(), id, user.clone(), movie.clone(), stop, live))
        })
        .collect();
    tokio::time::sleep(Duration::from_secs(1)).await;
    // I/O errors that failed no call of the write service (the clients write throughout, so
    // every commit meets its syscalls): the run would not have tested them.
    // And each kill of the write service cut calls (answered while it was down), and writes
    // were acknowledged in the seconds after the faults healed.
    let (mut missed, mut unfelt, mut acked_between) = (Vec::new(), Vec::new(), 0);
    for (n, fault) in schedule.iter().enumerate() {
        let cut_before = live.unknown.load(Ordering::SeqCst);
        if cluster.apply(*fault).await == Some(0) {
            missed.push(*fault);
        }
        if *fault == Fault::KillWrite && live.unknown.load(Ordering::SeqCst) == cut_before {
            unfelt.push(n);
        }
        let healed = live.ok.load(Ordering::SeqCst);
        tokio::time::sleep(Duration::from_secs(1)).await;
        acked_between += live.ok.load(Ordering::SeqCst) - healed;
    }
    stop.store(true, Ordering::SeqCst);
    let mut calls = BTreeMap::new();
    for task in clients {
        calls.extend(task.await.expect("a client panicked"));
    }
    let settled = cluster.settled(Duration::from_secs(120)).await;
    if !settled {
        cluster.explain_unsettled().await;
    }
    let mut report = check(&cluster, &calls).await;
    report.attempts = live.attempts();
    eprintln!("{report}");
    assert!(settled, "the system did not settle within 120 s after the faults\n{report}");
    assert!(report.ok(), "chaos on {backend:?} broke the promise\n{report}");
    // The faults reached the clients, and writes went through between them.
    assert!(missed.is_empty(), "injected I/O errors that failed no system call: {missed:?}");
    assert!(unfelt.is_empty(), "the write service was killed under load, yet no call was cut (faults {unfelt:?})");
    assert!(acked_between > 0, "no write was acknowledged after any fault healed\n{report}");
    cluster.handlers.stop().await;
    if let Some(relay) = cluster.relay.as_mut() {
        relay.stop().await;
    }
    cluster.write.stop().await;
}

/// The checker's findings.
#[derive(Debug, Default)]
struct Report {
    attempts: Attempts,
    calls: usize,
    ok: usize,
    failed: usize,
    unknown: usize,
    unknown_written: usize,
    /// Acknowledged, not stored.
    lost: Vec<String>,
    /// Stored more than once.
    duplicated: Vec<String>,
    /// Stored although every attempt was told nothing was written.
    phantom: Vec<String>,
    split: Vec<String>,
    /// Work not settled once the system is quiet: rows no handler looked at, deliveries in
    /// flight or waiting for a retry (db), rows the relay did not publish (nats).
    stuck: Vec<String>,
    dead_lettered: usize,
    /// Events a probe handler never got.
    undelivered: Vec<String>,
    /// (event, handler) effects that ran more than once (the ADR's accepted crash window).
    rerun_effects: usize,
}

impl Report {
    fn ok(&self) -> bool {
        self.lost.is_empty()
            && self.duplicated.is_empty()
            && self.phantom.is_empty()
            && self.split.is_empty()
            && self.stuck.is_empty()
            && self.dead_lettered == 0
            && self.undelivered.is_empty()
    }
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "attempts {}: {} refused (nothing written), {} outcome unknown",
            self.attempts.total, self.attempts.refused, self.attempts.unknown
        )?;
        writeln!(
            f,
            "calls {}: ok {}, failed {}, unknown {} ({} of them written)",
            self.calls, self.ok, self.failed, self.unknown, self.unknown_written
        )?;
        let show = |v: &Vec<String>| v.iter().take(5).cloned().collect::<Vec<_>>().join(", ");
        writeln!(f, "lost {} [{}]", self.lost.len(), show(&self.lost))?;
        writeln!(f, "duplicated {} [{}]", self.duplicated.len(), show(&self.duplicated))?;
        writeln!(f, "phantom {} [{}]", self.phantom.len(), show(&self.phantom))?;
        writeln!(f, "split writes {} [{}]", self.split.len(), show(&self.split))?;
        writeln!(f, "stuck {} [{}], dead-lettered {}", self.stuck.len(), show(&self.stuck), self.dead_lettered)?;
        writeln!(f, "undelivered {} [{}]", self.undelivered.len(), show(&self.undelivered))?;
        write!(f, "handler effects re-run after a crash: {}", self.rerun_effects)
    }
}

async fn check(cluster: &Cluster, calls: &BTreeMap<String, Outcome>) -> Report {
    let ledger = ReviewLedger::read(&cluster.db).await;
    let mut stored: HashMap<&str, usize> = HashMap::new();
    for body in ledger.reviews.values() {
        if let Some(marker) = body.split(' ').next() {
            *stored.entry(marker).or_insert(0) += 1;
        }
    }
    let mut report = Report { calls: calls.len(), split: ledger.split_writes(), ..Report::default() };
    for (marker, outcome) in calls {
        let copies = stored.get(marker.as_str()).copied().unwrap_or(0);
        if copies > 1 {
            report.duplicated.push(marker.clone());
        }
        match outcome {
            Outcome::Ok => {
                report.ok += 1;
                if copies == 0 {
                    report.lost.push(marker.clone());
                }
            }
            Outcome::Failed => {
                report.failed += 1;
                if copies > 0 {
                    report.phantom.push(marker.clone());
                }
            }
            Outcome::Unknown => {
                report.unknown += 1;
                report.unknown_written += usize::from(copies > 0);
            }
        }
    }
    let rows = outbox_rows(&cluster.db).await;
    let nats = cluster.nats.is_some();
    report.stuck = unsettled(&cluster.db, nats, &PROBES).await;
    report.dead_lettered = dead_letters(&cluster.db, nats).await;
    let (effects, _) = probe_records(&cluster.effects, "effects").await;
    for id in rows.iter().filter_map(|r| r.event_id.as_ref()) {
        for handler in ["probe-a", "probe-b"] {
            match effects.get(&(id.clone(), handler.to_owned())) {
                None => report.undelivered.push(format!("{id}/{handler}")),
                Some(n) if *n > 1 => report.rerun_effects += 1,
                Some(_) => {}
            }
        }
    }
    report
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn chaos_on_the_db_backend_loses_duplicates_and_invents_nothing() {
    run(Backend::Db).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn chaos_on_the_nats_backend_loses_duplicates_and_invents_nothing() {
    run(Backend::Nats).await;
}
