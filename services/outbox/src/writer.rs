//! The single writer: one task owns the write connection and runs every write transaction.
//!
//! SQLite admits one writer at a time, so instead of letting request tasks fight over the file
//! lock, each write is sent here as a job. The writer takes whatever jobs are waiting, opens one
//! `BEGIN IMMEDIATE` transaction for all of them and commits once (group commit), so concurrent
//! requests share the fsync. Each job runs inside its own savepoint: a job that fails is rolled
//! back alone and its batch-mates still commit. A job's result reaches its caller only after the
//! commit that made it durable.
//!
//! Storage faults. SQLite rolls a whole transaction back by itself on some errors (an I/O error,
//! a full disk, out of memory); the statements after that would run in autocommit mode and
//! commit one by one, splitting a write from its events. Two hooks on the write connection keep
//! that from ever happening: a rollback hook tells the writer its transaction is gone (it then
//! fails every job of the batch and runs nothing more), and a commit hook refuses every commit
//! the writer did not ask for. A failed `COMMIT` may still have reached the disk, so its jobs
//! are told the outcome is unknown; after any storage fault the writer stops trusting the
//! connection and opens a fresh one.
//!
//! After a commit that wrote outbox rows the writer bumps a counter that claimers can wait on,
//! so a waiting consumer learns about new events without polling. Work can also ride in the
//! batch that writes them ([`Writer::set_rider`]): the write service claims new events there
//! for whoever is waiting for them (the handlers on db, the relay on nats), under the same fsync
//! as the events.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Duration;

use futures_util::FutureExt;
use futures_util::future::BoxFuture;
use reelay_kit::failpoint_armed;
use reelay_kit::metrics::{self, Histogram};
use reelay_kit::telemetry::current_traceparent;
use sqlx::{Connection, Executor, SqliteConnection};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;

static BATCH_JOBS: LazyLock<Histogram> = LazyLock::new(|| {
    metrics::histogram(
        "reelay_writer_batch_jobs",
        "Write jobs committed together in one transaction (group commit).",
        &[],
        metrics::BATCH_SIZES,
    )
});
static BATCH_SECONDS: LazyLock<Histogram> = LazyLock::new(|| {
    metrics::histogram(
        "reelay_writer_batch_seconds",
        "How long one write batch held the database's write lock, BEGIN to COMMIT.",
        &[],
        metrics::SECONDS,
    )
});
static COMMIT_SECONDS: LazyLock<Histogram> = LazyLock::new(|| {
    metrics::histogram("reelay_writer_commit_seconds", "Time of one batch's COMMIT (its fsync).", &[], metrics::SECONDS)
});

static JOB_SECONDS: LazyLock<Histogram> = LazyLock::new(|| {
    metrics::histogram(
        "reelay_writer_job_seconds",
        "Time one write job's statements took inside its batch, by job (what the single writer spends its time on).",
        &["job"],
        metrics::SECONDS,
    )
});

/// Declares the writer's metrics, so they are scraped before the first write.
pub fn register_metrics() {
    for metric in [&BATCH_JOBS, &BATCH_SECONDS, &COMMIT_SECONDS, &JOB_SECONDS] {
        LazyLock::force(metric);
    }
}

/// Since when the writer has been on the batch in hand (`None` while it waits for jobs): from
/// taking its jobs until every one of them is answered (reopening the database, running,
/// committing) and, after a storage fault, the connection is closed. Read by the metrics, so a
/// writer stuck in one batch (a stalled disk) shows even when no call is waiting on it.
#[derive(Debug, Default)]
struct BusySince(Mutex<Option<std::time::Instant>>);

impl BusySince {
    fn set(&self, since: Option<std::time::Instant>) {
        *self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = since;
    }

    fn start(&self) {
        self.set(Some(std::time::Instant::now()));
    }

    fn end(&self) {
        self.set(None);
    }

    fn elapsed(&self) -> Duration {
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner).map_or(Duration::ZERO, |since| since.elapsed())
    }
}

/// Most jobs committed together. Bounds the time a batch holds the write lock.
const MAX_BATCH: usize = 256;
/// The rider's name in the writer's job metrics.
const RIDER_JOB: &str = "rider";
const QUEUE_DEPTH: usize = 4096;
/// How soon, and at most how rarely, the writer tries to reopen a connection it stopped trusting.
const REOPEN_FIRST_DELAY: Duration = Duration::from_millis(100);
const REOPEN_MAX_DELAY: Duration = Duration::from_secs(5);

/// How often the lease clock looks whether this process ran, and the gap that says it did not.
const LEASE_TICK: Duration = Duration::from_millis(250);
const STALL_MS: i64 = 2_000;

/// Since when claims' leases count. A claim is taken over when its owner has not renewed it
/// for a lease; but an owner can renew only while this service takes writes. After the service
/// starts, reopens its database after a storage fault, runs again after not running at all
/// (stopped, starved, or the clock jumped ahead), or ends a batch that ran for a third of the
/// shortest lease (its storage stalled), a claim renewed before counts as renewed then: every
/// live owner gets a whole lease to renew before anything of it is taken over.
struct LeaseClock {
    since: AtomicI64,
    last_tick: AtomicI64,
    /// How long a batch may run before it counts as a stall: a third of the shortest lease
    /// claims are held under (an owner renews every third of its lease, so a batch that long
    /// may have held back a renewal it needed), [`STALL_MS`] until the leases are told.
    batch_stall_ms: AtomicI64,
}

impl LeaseClock {
    fn new() -> Self {
        let now = reelay_kit::now_ms();
        Self { since: AtomicI64::new(now), last_tick: AtomicI64::new(now), batch_stall_ms: AtomicI64::new(STALL_MS) }
    }

    /// Leases count from now on.
    fn restart(&self) {
        self.since.fetch_max(reelay_kit::now_ms(), Ordering::SeqCst);
    }

    /// Notes that the process runs; a gap since the last note restarts the leases.
    fn tick(&self) {
        let now = reelay_kit::now_ms();
        self.restart_after_gap(now, self.last_tick.swap(now, Ordering::SeqCst));
    }

    /// Since when leases count (a gap not yet noted by the ticker counts already).
    fn counted_from(&self) -> i64 {
        self.restart_after_gap(reelay_kit::now_ms(), self.last_tick.load(Ordering::SeqCst));
        self.since.load(Ordering::SeqCst)
    }

    fn restart_after_gap(&self, now: i64, last_tick: i64) {
        if now - last_tick > STALL_MS {
            self.since.fetch_max(now, Ordering::SeqCst);
        }
    }
}

/// The renewal time before which a claim counts as abandoned at `now`: a lease before it, once
/// leases have counted that long (see [`Writer::lease_counted_from`]); before then, none.
pub fn stale_before(counted_from: i64, now: i64, lease: Duration) -> i64 {
    let cutoff = now - lease.as_millis() as i64;
    if counted_from <= cutoff { cutoff } else { i64::MIN }
}

/// How durable a job's commit must be before its caller hears of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    /// On disk (fsynced at the configured `synchronous` level, FULL by default) before the
    /// caller hears: every domain write, every claim.
    Synced,
    /// Bookkeeping whose loss in a power failure only repeats work, never loses it or runs it
    /// twice at once: a handler's settled deliveries (lost, the delivery comes back after its
    /// lease and the idempotent handler skips or redoes it). A batch of only such jobs commits
    /// without its own fsync (`synchronous=NORMAL`); the WAL is appended in order, so the next
    /// synced commit makes it durable along with itself. A process crash loses nothing either
    /// way: the commit is in the operating system's cache.
    Deferred,
}

/// Why a write did not commit, for reasons outside the job itself.
#[derive(Debug, Clone, thiserror::Error)]
pub enum CommitError {
    /// The batch failed before its commit and was rolled back: nothing was written.
    #[error("database write failed: {0}")]
    Storage(Arc<sqlx::Error>),
    /// SQLite rolled the transaction back by itself after an error inside it (an I/O error, a
    /// full disk, out of memory): nothing was written.
    #[error("the database rolled the write transaction back after a storage error")]
    RolledBack,
    /// `COMMIT` failed. After a failed write or fsync the transaction may or may not be on disk:
    /// the caller must treat the outcome as unknown (and may retry with its idempotency key).
    #[error("the commit failed and its outcome is unknown: {0}")]
    OutcomeUnknown(Arc<sqlx::Error>),
    /// The writer is reopening the database after a storage fault and took no jobs.
    #[error("the database is reopening after a storage fault: {0}")]
    Recovering(Arc<str>),
    #[error("the database writer has stopped")]
    Closed,
    #[error("the write job panicked")]
    Panicked,
    #[error("failpoint `{0}` fired before commit")]
    Failpoint(&'static str),
}

impl CommitError {
    fn storage(error: sqlx::Error) -> Self {
        Self::Storage(Arc::new(error))
    }

    /// Whether the connection that produced this error can still be trusted with writes.
    fn distrusts_connection(&self) -> bool {
        match self {
            Self::Storage(error) => !is_lock_contention(error),
            Self::RolledBack | Self::OutcomeUnknown(_) => true,
            Self::Recovering(_) | Self::Closed | Self::Panicked | Self::Failpoint(_) => false,
        }
    }
}

/// SQLite's primary result code of `error`, if it came from SQLite.
pub fn sqlite_primary_code(error: &sqlx::Error) -> Option<i32> {
    let code = error.as_database_error()?.code()?;
    code.parse::<i32>().ok().map(|n| n & 0xff)
}

const SQLITE_BUSY: i32 = 5;
const SQLITE_LOCKED: i32 = 6;
const SQLITE_FULL: i32 = 13;

fn is_lock_contention(error: &sqlx::Error) -> bool {
    matches!(sqlite_primary_code(error), Some(SQLITE_BUSY | SQLITE_LOCKED))
}

/// Opens a fresh write connection (the writer's own after it stopped trusting the old one).
pub type Opener = Arc<dyn Fn() -> BoxFuture<'static, Result<SqliteConnection, sqlx::Error>> + Send + Sync>;

/// Told a batch's fate once it is known (after its `COMMIT`, or its failure).
pub type AfterCommit = Box<dyn FnOnce(Result<(), CommitError>) + Send>;

/// Work that rides in the synced batches that enqueue events, after the events are inserted
/// and before the commit (see [`Writer::set_rider`]).
pub trait Rider: Send + Sync {
    /// Whether it has work now. Asked before anything runs for it, so it must be cheap.
    fn wants(&self) -> bool;
    /// Runs its statements in the batch's transaction (it must not enqueue events) and returns
    /// what to do once the batch's fate is known. On an error its statements are rolled back,
    /// the batch goes on, and it must have put its own affairs back in order.
    fn ride<'t>(&'t self, tx: &'t mut WriteTx) -> BoxFuture<'t, Result<AfterCommit, sqlx::Error>>;
}

/// What the hooks installed on the write connection observed.
#[derive(Default)]
struct Hooks {
    /// Whole-transaction rollbacks: the writer's own and those SQLite does by itself.
    rollbacks: AtomicU64,
    /// True only while the writer's own `COMMIT` runs; every other commit is refused.
    commit_allowed: AtomicBool,
    /// Commits refused because the writer did not ask for them.
    stray_commits: AtomicU64,
}

impl Hooks {
    async fn install(self: &Arc<Self>, conn: &mut SqliteConnection) -> Result<(), sqlx::Error> {
        let mut handle = conn.lock_handle().await?;
        let hooks = Arc::clone(self);
        handle.set_rollback_hook(move || {
            hooks.rollbacks.fetch_add(1, Ordering::SeqCst);
        });
        let hooks = Arc::clone(self);
        handle.set_commit_hook(move || {
            let allowed = hooks.commit_allowed.load(Ordering::SeqCst);
            if !allowed {
                hooks.stray_commits.fetch_add(1, Ordering::SeqCst);
            }
            allowed
        });
        Ok(())
    }
}

/// The transaction a write job runs in. Jobs run statements on [`WriteTx::conn`] and insert
/// events with [`crate::enqueue_events`]; they never begin, commit or roll back themselves.
pub struct WriteTx {
    conn: SqliteConnection,
    pub(crate) traceparent: String,
    /// Outbox rows the running job enqueued; they join `batch_rows` if the job succeeds.
    pub(crate) job_rows: Vec<crate::enqueue::OutboxInsert>,
    /// Outbox rows of the batch's successful jobs, inserted together just before the commit.
    batch_rows: Vec<crate::enqueue::OutboxInsert>,
    now_ms: i64,
    /// The job's clock in microseconds (`now_ms` is it in milliseconds).
    now_us: i64,
    /// The last event's `occurred_at_us`, over every connection this writer opens.
    last_event_us: Arc<AtomicI64>,
    /// The largest encoded event `enqueue_events` accepts.
    pub(crate) max_event_bytes: usize,
    leases: Arc<LeaseClock>,
}

impl WriteTx {
    /// Since when claims' leases count (see [`Writer::lease_counted_from`]).
    pub fn lease_counted_from(&self) -> i64 {
        self.leases.counted_from()
    }

    /// Leases count from `at` at the earliest: no claim is taken over before `at` plus a lease.
    pub fn count_leases_from(&self, at: i64) {
        self.leases.since.fetch_max(at, Ordering::SeqCst);
    }

    pub fn conn(&mut self) -> &mut SqliteConnection {
        &mut self.conn
    }

    /// The job's clock: one timestamp for everything the job writes.
    pub fn now_ms(&self) -> i64 {
        self.now_ms
    }

    /// The next event's `occurred_at_us`: the job's clock, or a microsecond past the previous
    /// event's, whichever is later. So every event this writer writes is stamped later than
    /// the one before (a millisecond's events too, and those of one job in the order written),
    /// which orders two changes to one thing however close together they commit.
    pub(crate) fn next_event_us(&mut self) -> i64 {
        let next = self.now_us.max(self.last_event_us.load(Ordering::Relaxed) + 1);
        self.last_event_us.store(next, Ordering::Relaxed);
        next
    }

    /// Sets the trace context that the events enqueued from now on carry. A job that answers
    /// several callers' requests sets each caller's before enqueueing that caller's events.
    pub fn set_traceparent(&mut self, traceparent: String) {
        self.traceparent = traceparent;
    }

    fn begin_job(&mut self, traceparent: String) {
        self.traceparent = traceparent;
        self.job_rows.clear();
        self.now_us =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_micros() as i64);
        self.now_ms = self.now_us / 1000;
    }
}

trait Job: Send {
    fn name(&self) -> &'static str;
    /// The writer took it from the queue.
    fn taken(&mut self);
    fn durability(&self) -> Durability;
    fn take_traceparent(&mut self) -> String;
    /// Runs the job's statements; true when it succeeded.
    fn run<'t>(&'t mut self, tx: &'t mut WriteTx) -> BoxFuture<'t, bool>;
    /// Replaces the job's outcome with a failure (the job was rolled back, or never ran).
    fn abort(&mut self, error: CommitError);
    /// Delivers the outcome once the batch's fate is known.
    fn finish(self: Box<Self>, committed: Result<(), CommitError>);
}

/// Counts a synced job from when it is made until the writer takes it (or it is dropped unsent).
struct Queued(Arc<AtomicUsize>);

impl Queued {
    fn new(count: &Arc<AtomicUsize>) -> Self {
        count.fetch_add(1, Ordering::SeqCst);
        Self(count.clone())
    }
}

impl Drop for Queued {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

struct TypedJob<T, E, F> {
    name: &'static str,
    durability: Durability,
    queued: Option<Queued>,
    traceparent: String,
    work: Option<F>,
    outcome: Option<Result<T, E>>,
    reply: oneshot::Sender<Result<T, E>>,
}

impl<T, E, F> Job for TypedJob<T, E, F>
where
    T: Send + 'static,
    E: From<CommitError> + Send + 'static,
    F: for<'t> FnOnce(&'t mut WriteTx) -> BoxFuture<'t, Result<T, E>> + Send + 'static,
{
    fn name(&self) -> &'static str {
        self.name
    }

    fn taken(&mut self) {
        self.queued = None;
    }

    fn take_traceparent(&mut self) -> String {
        std::mem::take(&mut self.traceparent)
    }

    fn durability(&self) -> Durability {
        self.durability
    }

    fn run<'t>(&'t mut self, tx: &'t mut WriteTx) -> BoxFuture<'t, bool> {
        let work = self.work.take().expect("a write job runs once");
        Box::pin(async move {
            let outcome = work(tx).await;
            let ok = outcome.is_ok();
            self.outcome = Some(outcome);
            ok
        })
    }

    fn abort(&mut self, error: CommitError) {
        self.outcome = Some(Err(error.into()));
    }

    fn finish(self: Box<Self>, committed: Result<(), CommitError>) {
        let result = match (self.outcome, committed) {
            (Some(Err(job_error)), _) => Err(job_error),
            (Some(Ok(value)), Ok(())) => Ok(value),
            (Some(Ok(_)), Err(error)) => Err(error.into()),
            (None, Err(error)) => Err(error.into()),
            (None, Ok(())) => Err(CommitError::Panicked.into()),
        };
        // The caller may have gone away (a cancelled request); the write stands regardless.
        let _ = self.reply.send(result);
    }
}

/// A handle to the writer task. Cheap to clone.
#[derive(Clone)]
pub struct Writer {
    jobs: mpsc::Sender<Box<dyn Job>>,
    commits: watch::Receiver<u64>,
    stop: watch::Sender<bool>,
    task: Arc<Mutex<Option<JoinHandle<()>>>>,
    rider: Arc<std::sync::OnceLock<Arc<dyn Rider>>>,
    /// Synced jobs made and not yet taken by the writer.
    synced_queued: Arc<AtomicUsize>,
    leases: Arc<LeaseClock>,
    busy: Arc<BusySince>,
    /// The largest encoded event it takes ([`WriterConfig::max_event_bytes`]).
    max_event_bytes: usize,
}

/// How the writer task is set up.
pub struct WriterConfig {
    /// Opens a fresh write connection when the current one is no longer trusted.
    pub reopen: Opener,
    /// The largest encoded event `enqueue_events` accepts.
    pub max_event_bytes: usize,
    /// The configured `synchronous` level: batches of [`Durability::Deferred`] jobs commit at
    /// NORMAL, the others at this.
    pub synchronous: crate::Synchronous,
}

impl Writer {
    /// Starts the writer task on `conn`, which must be the only connection that writes.
    pub fn start(conn: SqliteConnection, config: WriterConfig) -> Self {
        let (jobs, rx) = mpsc::channel(QUEUE_DEPTH);
        let (commits_tx, commits) = watch::channel(0);
        let (stop, stop_rx) = watch::channel(false);
        let rider = Arc::new(std::sync::OnceLock::new());
        let synced_queued = Arc::new(AtomicUsize::new(0));
        let leases = Arc::new(LeaseClock::new());
        let ticking = Arc::downgrade(&leases);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(LEASE_TICK).await;
                let Some(leases) = ticking.upgrade() else { return };
                leases.tick();
            }
        });
        let busy = Arc::new(BusySince::default());
        let shared = Shared {
            rider: rider.clone(),
            synced_queued: synced_queued.clone(),
            leases: leases.clone(),
            busy: busy.clone(),
        };
        let max_event_bytes = config.max_event_bytes;
        let task = tokio::spawn(run(conn, config, rx, commits_tx, stop_rx, shared));
        let task = Arc::new(Mutex::new(Some(task)));
        Self { jobs, commits, stop, task, rider, synced_queued, leases, busy, max_event_bytes }
    }

    /// How long the writer has been on the batch in hand; zero while it waits for jobs.
    pub fn busy_for(&self) -> Duration {
        self.busy.elapsed()
    }

    /// The largest encoded event this writer takes: what a claim answer must be able to hold.
    pub fn max_event_bytes(&self) -> usize {
        self.max_event_bytes
    }

    /// Since when claims' leases count (ms): when this writer started, last reopened its
    /// database after a storage fault, last ran again after not running for a while, or last
    /// ended a batch that ran for a third of the shortest lease (see
    /// [`Writer::set_shortest_lease`]). A claim whose owner renewed it before counts as renewed
    /// then, so it is taken over only once its owner has had a whole lease to renew it here (see
    /// [`stale_before`]).
    pub fn lease_counted_from(&self) -> i64 {
        self.leases.counted_from()
    }

    /// The shortest lease any claim here is held under: a batch running for a third of it
    /// restarts the leases (a stalled disk held the renewals back).
    pub fn set_shortest_lease(&self, lease: Duration) {
        self.leases.batch_stall_ms.store((lease.as_millis() / 3).max(1) as i64, Ordering::SeqCst);
    }

    /// Sets the work that rides in a batch that enqueues events, committed at the configured
    /// `synchronous` level, when no other synced job is waiting: after the batch's outbox rows
    /// are inserted, inside a savepoint of its own, in the same transaction and under the same
    /// fsync. The write service uses it to hand new events to the claimers waiting for them
    /// (their claims are written with the events instead of in a batch and a commit of their
    /// own). One rider per writer; false if one was set already.
    pub fn set_rider(&self, rider: Arc<dyn Rider>) -> bool {
        self.rider.set(rider).is_ok()
    }

    /// Runs `work` in a write transaction and returns its result once it is committed.
    ///
    /// `name` identifies the job in logs (and, in test builds, to failpoints). If `work` returns
    /// an error, everything it wrote is rolled back and the error is returned; other jobs in the
    /// same batch are not affected.
    pub fn transact<T, E, F>(&self, name: &'static str, work: F) -> impl Future<Output = Result<T, E>> + Send + 'static
    where
        T: Send + 'static,
        E: From<CommitError> + Send + 'static,
        F: for<'t> FnOnce(&'t mut WriteTx) -> BoxFuture<'t, Result<T, E>> + Send + 'static,
    {
        self.transact_as(name, Durability::Synced, work)
    }

    /// Like [`Writer::transact`], committed with the given durability.
    pub fn transact_as<T, E, F>(
        &self,
        name: &'static str,
        durability: Durability,
        work: F,
    ) -> impl Future<Output = Result<T, E>> + Send + 'static
    where
        T: Send + 'static,
        E: From<CommitError> + Send + 'static,
        F: for<'t> FnOnce(&'t mut WriteTx) -> BoxFuture<'t, Result<T, E>> + Send + 'static,
    {
        let (reply, receive) = oneshot::channel();
        let queued = (durability == Durability::Synced).then(|| Queued::new(&self.synced_queued));
        let traceparent = current_traceparent();
        let job: Box<dyn Job> =
            Box::new(TypedJob { name, durability, queued, traceparent, work: Some(work), outcome: None, reply });
        let jobs = self.jobs.clone();
        async move {
            jobs.send(job).await.map_err(|_| CommitError::Closed)?;
            receive.await.unwrap_or_else(|_| Err(CommitError::Closed.into()))
        }
    }

    /// A counter of committed outbox rows; it changes after every commit that enqueued events.
    pub fn subscribe_commits(&self) -> watch::Receiver<u64> {
        self.commits.clone()
    }

    /// Finishes the jobs already queued, then stops the task. Later `transact` calls fail with
    /// [`CommitError::Closed`].
    pub async fn shutdown(&self) {
        let _ = self.stop.send(true);
        let task = self.task.lock().expect("writer task lock").take();
        if let Some(task) = task {
            let _ = task.await;
        }
    }
}

/// What the writer task shares with its handles.
struct Shared {
    rider: Arc<std::sync::OnceLock<Arc<dyn Rider>>>,
    /// Synced jobs made and not yet taken by the writer.
    synced_queued: Arc<AtomicUsize>,
    leases: Arc<LeaseClock>,
    busy: Arc<BusySince>,
}

/// The write connection and what the writer knows about it.
struct OpenConn {
    tx: WriteTx,
    hooks: Arc<Hooks>,
    /// The level synced batches commit at (the configured one).
    synced: crate::Synchronous,
    /// The connection's `synchronous` level now; `None` after a failed change.
    level: Option<crate::Synchronous>,
}

/// The writer's hold on the database: a trusted connection, or none while it reopens one.
struct Session {
    config: WriterConfig,
    leases: Arc<LeaseClock>,
    /// The last event's `occurred_at_us` (kept across the connections it opens).
    last_event_us: Arc<AtomicI64>,
    current: Option<OpenConn>,
    /// When to try reopening next, and how long to wait after that one fails.
    next_reopen: Instant,
    reopen_delay: Duration,
    last_fault: Arc<str>,
}

impl Session {
    async fn adopt(&mut self, mut conn: SqliteConnection) -> Result<(), sqlx::Error> {
        let hooks = Arc::new(Hooks::default());
        if let Err(error) = hooks.install(&mut conn).await {
            let _ = conn.close().await;
            return Err(error);
        }
        match last_event_stamp(&mut conn).await {
            Ok(stamp) => {
                self.last_event_us.fetch_max(stamp, Ordering::Relaxed);
            }
            Err(error) => {
                let _ = conn.close().await;
                return Err(error);
            }
        }
        let tx = WriteTx {
            conn,
            traceparent: String::new(),
            job_rows: Vec::new(),
            batch_rows: Vec::new(),
            now_ms: 0,
            now_us: 0,
            last_event_us: self.last_event_us.clone(),
            max_event_bytes: self.config.max_event_bytes,
            leases: self.leases.clone(),
        };
        let synced = self.config.synchronous;
        self.current = Some(OpenConn { tx, hooks, synced, level: Some(synced) });
        Ok(())
    }

    /// Drops the connection after a storage fault; the next batch reopens one.
    async fn distrust(&mut self, why: &CommitError) {
        tracing::error!(error = %why, "closing the write connection after a storage fault; a fresh one will be opened");
        if let Some(old) = self.current.take() {
            // Whatever it still holds is rolled back; a broken connection may fail to close.
            let _ = old.tx.conn.close().await;
        }
        self.last_fault = Arc::from(why.to_string());
        self.next_reopen = Instant::now();
        self.reopen_delay = REOPEN_FIRST_DELAY;
    }

    /// The trusted connection, reopening one if it is time to try.
    async fn connection(&mut self) -> Option<&mut OpenConn> {
        if self.current.is_none() && Instant::now() >= self.next_reopen {
            let opened = (self.config.reopen)().await;
            let adopted = match opened {
                Ok(conn) => self.adopt(conn).await,
                Err(error) => Err(error),
            };
            match adopted {
                Ok(()) => {
                    // Renewals failed while it could not write: owners get a whole lease again.
                    self.leases.restart();
                    tracing::warn!("write connection reopened; taking writes again");
                }
                Err(error) => {
                    tracing::error!(%error, retry_in = ?self.reopen_delay, "cannot reopen the database");
                    self.last_fault = Arc::from(format!("reopening failed: {error}"));
                    self.next_reopen = Instant::now() + self.reopen_delay;
                    self.reopen_delay = (self.reopen_delay * 2).min(REOPEN_MAX_DELAY);
                }
            }
        }
        self.current.as_mut()
    }
}

/// The latest `occurred_at_us` an event in the outbox may carry: events are stamped strictly
/// after it, so one written after a restart orders after every one before it even when this
/// machine's clock is behind the last run's (handlers keep the newest version of a thing by
/// it). The last row's own stamp, or a millisecond's worth past the newest row's time (a row of
/// another writer, or one not decoded).
async fn last_event_stamp(conn: &mut SqliteConnection) -> Result<i64, sqlx::Error> {
    use prost::Message;
    let newest: Option<i64> =
        sqlx::query_scalar("SELECT MAX(created_at) FROM event_queue").fetch_one(&mut *conn).await?;
    let last: Option<Vec<u8>> = sqlx::query_scalar("SELECT payload FROM event_queue ORDER BY id DESC LIMIT 1")
        .fetch_optional(&mut *conn)
        .await?;
    let decoded = last.and_then(|payload| reelay_contracts::v1::Event::decode(payload.as_slice()).ok());
    let by_time = newest.map_or(0, |ms| ms.saturating_add(1).saturating_mul(1000) - 1);
    Ok(by_time.max(decoded.map_or(0, |e| e.occurred_at_us)))
}

async fn run(
    conn: SqliteConnection,
    config: WriterConfig,
    mut jobs: mpsc::Receiver<Box<dyn Job>>,
    commits: watch::Sender<u64>,
    mut stop: watch::Receiver<bool>,
    shared: Shared,
) {
    let Shared { rider, synced_queued, leases, busy } = shared;
    let mut session = Session {
        config,
        leases,
        last_event_us: Arc::default(),
        current: None,
        next_reopen: Instant::now(),
        reopen_delay: REOPEN_FIRST_DELAY,
        last_fault: Arc::from(""),
    };
    if let Err(error) = session.adopt(conn).await {
        session.distrust(&CommitError::storage(error)).await;
    }
    let mut batch = Vec::with_capacity(MAX_BATCH);
    loop {
        tokio::select! {
            biased;
            received = jobs.recv_many(&mut batch, MAX_BATCH) => {
                if received == 0 {
                    break;
                }
                busy.start();
                for job in &mut batch {
                    job.taken();
                }
            }
            _ = stop.wait_for(|stopped| *stopped) => {
                jobs.close();
                continue;
            }
        }
        let batch_started = Instant::now();
        let Some(connection) = session.connection().await else {
            let error = CommitError::Recovering(session.last_fault.clone());
            for mut job in batch.drain(..) {
                job.abort(error.clone());
                job.finish(Err(error.clone()));
            }
            busy.end();
            continue;
        };
        match commit_batch(connection, &mut batch, rider.get(), &synced_queued).await {
            Ok(events) if events > 0 => commits.send_modify(|count| *count += events as u64),
            Ok(_) => {}
            Err(error) if error.distrusts_connection() => session.distrust(&error).await,
            Err(_) => {}
        }
        // A batch this slow (a stalled fsync) held every renewal back while it ran, though the
        // process ran and its ticker ticked: the next batch's claims must not count that time
        // against their owners, whose renewals are queued behind them. (Only a batch as long as
        // a third of the shortest lease: restarting on shorter ones, a disk slow for good would
        // put every take-over off for ever.)
        let stall = Duration::from_millis(session.leases.batch_stall_ms.load(Ordering::SeqCst) as u64);
        if batch_started.elapsed() > stall {
            session.leases.restart();
        }
        busy.end();
    }
    if let Some(current) = session.current.take() {
        let _ = current.tx.conn.close().await;
    }
    tracing::debug!("database writer stopped");
}

/// Runs one batch in one transaction. Returns how many outbox rows it committed, or why the
/// whole batch failed (every job of it has been told).
async fn commit_batch(
    connection: &mut OpenConn,
    batch: &mut Vec<Box<dyn Job>>,
    rider: Option<&Arc<dyn Rider>>,
    synced_queued: &AtomicUsize,
) -> Result<usize, CommitError> {
    let started = Instant::now();
    let mut after_commit = None;
    let outcome = run_batch(connection, batch, rider, synced_queued, &mut after_commit).await;
    BATCH_JOBS.observe(&[], batch.len() as f64);
    BATCH_SECONDS.observe_duration(&[], started.elapsed());
    let stray = connection.hooks.stray_commits.swap(0, Ordering::SeqCst);
    if stray > 0 {
        tracing::error!(
            commits = stray,
            "refused commits the writer did not ask for (statements run after SQLite ended the transaction)"
        );
    }
    let committed = match &outcome {
        Ok(_) => Ok(()),
        Err(error) => {
            if matches!(error, CommitError::OutcomeUnknown(_)) {
                tracing::error!(%error, jobs = batch.len(), "commit failed; the outcome of this batch is unknown");
            } else {
                tracing::error!(%error, jobs = batch.len(), "write batch failed; rolling back, nothing of it was written");
            }
            // Harmless when SQLite already ended the transaction.
            let _ = connection.tx.conn.execute("ROLLBACK").await;
            Err(error.clone())
        }
    };
    if let Some(after_commit) = after_commit {
        after_commit(committed.clone());
    }
    for mut job in batch.drain(..) {
        if let Err(error) = &committed {
            // A job's own error may have been caused by the same fault: the batch's error is
            // what the caller must act on.
            job.abort(error.clone());
        }
        job.finish(committed.clone());
    }
    outcome
}

/// Whether a test failpoint fails the write job `name`: armed by name, or by `*` for every job
/// but the start-up ones (`startup_*`), without which the service could not start at all.
fn failpoint_fires(name: &str) -> bool {
    failpoint_armed(name) || (!name.starts_with("startup_") && failpoint_armed("*"))
}

async fn run_batch(
    connection: &mut OpenConn,
    batch: &mut [Box<dyn Job>],
    rider: Option<&Arc<dyn Rider>>,
    synced_queued: &AtomicUsize,
    after_commit: &mut Option<AfterCommit>,
) -> Result<usize, CommitError> {
    let OpenConn { tx, hooks, synced, level } = connection;
    // Any whole-transaction rollback from here on that the writer did not issue means SQLite
    // ended the transaction after an error: nothing more may run in this batch.
    let rollbacks = hooks.rollbacks.load(Ordering::SeqCst);
    let still_open = || {
        if hooks.rollbacks.load(Ordering::SeqCst) == rollbacks { Ok(()) } else { Err(CommitError::RolledBack) }
    };
    // Each job runs in its own savepoint, so a failing job is rolled back alone. Savepoint
    // moves ride along with the statement before them (one round trip); a lone job needs none
    // (if it fails, the whole transaction is rolled back).
    let savepoints = batch.len() > 1;
    tx.batch_rows.clear();
    let begin = if savepoints { "BEGIN IMMEDIATE; SAVEPOINT job" } else { "BEGIN IMMEDIATE" };
    // A batch of deferred bookkeeping alone commits without its own fsync (set before the
    // transaction begins, in the same round trip).
    let wanted = if batch.iter().all(|job| job.durability() == Durability::Deferred) {
        crate::Synchronous::Normal
    } else {
        *synced
    };
    if *level != Some(wanted) {
        let switch_and_begin = match (wanted, savepoints) {
            (crate::Synchronous::Full, true) => "PRAGMA synchronous = FULL; BEGIN IMMEDIATE; SAVEPOINT job",
            (crate::Synchronous::Full, false) => "PRAGMA synchronous = FULL; BEGIN IMMEDIATE",
            (crate::Synchronous::Normal, true) => "PRAGMA synchronous = NORMAL; BEGIN IMMEDIATE; SAVEPOINT job",
            (crate::Synchronous::Normal, false) => "PRAGMA synchronous = NORMAL; BEGIN IMMEDIATE",
        };
        *level = None;
        tx.conn.execute(switch_and_begin).await.map_err(CommitError::storage)?;
        *level = Some(wanted);
    } else {
        tx.conn.execute(begin).await.map_err(CommitError::storage)?;
    }
    let mut succeeded = 0;
    let last = batch.len() - 1;
    for (index, job) in batch.iter_mut().enumerate() {
        tx.begin_job(job.take_traceparent());
        let started = Instant::now();
        let mut ok = AssertUnwindSafe(job.run(tx)).catch_unwind().await.unwrap_or_else(|_| {
            tracing::error!(job = job.name(), "write job panicked; rolled back");
            false
        });
        JOB_SECONDS.observe_duration(&[job.name()], started.elapsed());
        still_open()?;
        // `*` arms every write job (not the other, named hooks).
        if ok && failpoint_fires(job.name()) {
            job.abort(CommitError::Failpoint(job.name()));
            ok = false;
        }
        if ok {
            succeeded += 1;
            let rows = std::mem::take(&mut tx.job_rows);
            tx.batch_rows.extend(rows);
        }
        let step = match (savepoints, ok, index < last) {
            (false, _, _) => "",
            (true, true, true) => "RELEASE job; SAVEPOINT job",
            (true, true, false) => "RELEASE job",
            (true, false, true) => "ROLLBACK TO job; RELEASE job; SAVEPOINT job",
            (true, false, false) => "ROLLBACK TO job; RELEASE job",
        };
        if !step.is_empty() {
            let stepped = tx.conn.execute(step).await;
            still_open()?;
            stepped.map_err(CommitError::storage)?;
        }
    }
    if succeeded == 0 {
        tx.conn.execute("ROLLBACK").await.map_err(CommitError::storage)?;
        return Ok(0);
    }
    // The successful jobs' events, in the same transaction as their changes.
    let rows = std::mem::take(&mut tx.batch_rows);
    let inserted = crate::enqueue::insert_rows(&mut tx.conn, &rows).await;
    still_open()?;
    inserted.map_err(CommitError::storage)?;
    // Only while no synced job waits (deferred settlements do not count): a busy writer would
    // lengthen this batch for work that can as well wait for the next one, and claims made
    // later take more events at once.
    if let Some(rider) = rider.filter(|rider| {
        !rows.is_empty() && wanted == *synced && synced_queued.load(Ordering::SeqCst) == 0 && rider.wants()
    }) {
        tx.conn.execute("SAVEPOINT rider").await.map_err(CommitError::storage)?;
        tx.begin_job(String::new());
        let started = Instant::now();
        let ridden = AssertUnwindSafe(rider.ride(tx)).catch_unwind().await;
        JOB_SECONDS.observe_duration(&[RIDER_JOB], started.elapsed());
        still_open()?;
        let step = match ridden {
            Ok(Ok(done)) => {
                *after_commit = Some(done);
                "RELEASE rider"
            }
            Ok(Err(error)) => {
                tracing::warn!(%error, "the work riding on this batch failed and was rolled back; the batch goes on");
                "ROLLBACK TO rider; RELEASE rider"
            }
            Err(_) => {
                tracing::error!("the work riding on this batch panicked and was rolled back; the batch goes on");
                "ROLLBACK TO rider; RELEASE rider"
            }
        };
        let stepped = tx.conn.execute(step).await;
        still_open()?;
        stepped.map_err(CommitError::storage)?;
    }
    if failpoint_armed("commit_fails_after_write") {
        // Test builds: the commit reaches the disk, but its caller hears it failed.
        hooks.commit_allowed.store(true, Ordering::SeqCst);
        let _ = tx.conn.execute("COMMIT").await;
        hooks.commit_allowed.store(false, Ordering::SeqCst);
        return Err(CommitError::OutcomeUnknown(Arc::new(sqlx::Error::Protocol("failpoint".into()))));
    }
    hooks.commit_allowed.store(true, Ordering::SeqCst);
    let committing = Instant::now();
    let committed = tx.conn.execute("COMMIT").await;
    COMMIT_SECONDS.observe_duration(&[], committing.elapsed());
    hooks.commit_allowed.store(false, Ordering::SeqCst);
    match committed {
        Ok(_) => Ok(rows.len()),
        // A write that ran out of space wrote no commit record: the transaction is not on disk.
        Err(error) if sqlite_primary_code(&error) == Some(SQLITE_FULL) => Err(CommitError::storage(error)),
        Err(error) => Err(CommitError::OutcomeUnknown(Arc::new(error))),
    }
}

#[cfg(test)]
mod tests {
    use reelay_contracts::v1;
    use reelay_domain::NewEvent;
    use sqlx::Row;

    use super::*;
    use crate::test_support::TestError;
    use crate::{Database, DbConfig, enqueue_events};

    fn event(n: i64) -> NewEvent {
        NewEvent::new(n, v1::event::Payload::MovieDeleted(v1::MovieDeleted { movie_id: n.to_string() }))
    }

    /// The level a job's batch commits at, read inside the job.
    async fn level_seen(writer: &Writer, durability: Durability) -> i64 {
        writer
            .transact_as::<_, TestError, _>("test", durability, |tx: &mut WriteTx| {
                Box::pin(async move { Ok(sqlx::query_scalar("PRAGMA synchronous").fetch_one(tx.conn()).await?) })
            })
            .await
            .unwrap()
    }

    /// Leases count from the writer's start, and again from when the process runs after not
    /// running for a while (a tick missed by more than `STALL_MS`); a claim is stale only a
    /// whole lease after that.
    #[test]
    fn leases_count_again_after_the_process_did_not_run() {
        let clock = LeaseClock::new();
        let started = clock.counted_from();
        clock.since.store(started - 60_000, Ordering::SeqCst);
        clock.tick();
        assert_eq!(clock.counted_from(), started - 60_000, "ticking along changes nothing");
        clock.last_tick.store(reelay_kit::now_ms() - STALL_MS - 1_000, Ordering::SeqCst);
        assert!(clock.counted_from() >= started, "a gap restarts the leases before the ticker notes it");
        clock.since.store(started - 60_000, Ordering::SeqCst);
        clock.last_tick.store(reelay_kit::now_ms() - STALL_MS - 1_000, Ordering::SeqCst);
        clock.tick();
        assert!(clock.counted_from() >= started, "and when the ticker notes it");

        let lease = Duration::from_secs(30);
        assert_eq!(stale_before(0, 100_000, lease), 70_000);
        assert_eq!(stale_before(70_000, 100_000, lease), 70_000);
        assert_eq!(stale_before(70_001, 100_000, lease), i64::MIN, "no claim is stale within a lease of the start");
    }

    /// A batch that ran for a third of the shortest lease (a stalled disk) restarts the leases
    /// when it ends: the renewals queued behind it could not be written meanwhile. A shorter one
    /// does not (a slow disk would otherwise put every take-over off for ever).
    #[tokio::test]
    async fn leases_count_again_after_a_stalled_batch() {
        let dir = tempfile::tempdir().unwrap();
        let db = Database::open(&DbConfig::new(dir.path().join("w.db"))).await.unwrap();
        // Batches of a second count as stalls (a third of a 3 s lease), of 0.5 s not.
        db.writer.set_shortest_lease(Duration::from_secs(3));
        let before = db.writer.lease_counted_from();
        let pause = |ms: u64| {
            db.writer.transact::<_, TestError, _>("slow", move |_tx: &mut WriteTx| {
                Box::pin(async move {
                    tokio::time::sleep(Duration::from_millis(ms)).await;
                    Ok(())
                })
            })
        };
        pause(500).await.unwrap();
        assert_eq!(db.writer.lease_counted_from(), before, "a batch shorter than a third of the lease");
        pause(1_300).await.unwrap();
        let ended = reelay_kit::now_ms();
        let counted = db.writer.lease_counted_from();
        assert!(counted >= before + 1_300 && counted <= ended, "counted from {counted}, started {before}");
        db.close().await;
    }

    /// Counts the batches it rode in.
    struct CountingRider(AtomicUsize);

    impl Rider for CountingRider {
        fn wants(&self) -> bool {
            true
        }

        fn ride<'t>(&'t self, _tx: &'t mut WriteTx) -> BoxFuture<'t, Result<AfterCommit, sqlx::Error>> {
            self.0.fetch_add(1, Ordering::SeqCst);
            Box::pin(async { Ok(Box::new(|_| {}) as AfterCommit) })
        }
    }

    /// A job enqueueing event `n` that first waits for `release`, and says when it runs.
    fn held_job(
        writer: &Writer,
        durability: Durability,
        n: i64,
    ) -> (tokio::task::JoinHandle<Result<(), TestError>>, oneshot::Receiver<()>, oneshot::Sender<()>) {
        let (running, started) = oneshot::channel();
        let (release, hold) = oneshot::channel::<()>();
        let job = writer.transact_as::<_, TestError, _>("held", durability, move |tx: &mut WriteTx| {
            Box::pin(async move {
                enqueue_events(tx, vec![event(n)]).await?;
                let _ = running.send(());
                let _ = hold.await;
                Ok(())
            })
        });
        (tokio::spawn(job), started, release)
    }

    /// The rider runs in a synced batch that enqueued events only when no synced job waits
    /// behind it; a deferred one waiting does not hold it back.
    #[tokio::test]
    async fn the_rider_gives_way_to_waiting_synced_jobs() {
        let dir = tempfile::tempdir().unwrap();
        let db = Database::open(&DbConfig::new(dir.path().join("w.db"))).await.unwrap();
        let rider = Arc::new(CountingRider(AtomicUsize::new(0)));
        assert!(db.writer.set_rider(rider.clone()));
        let rides = || rider.0.load(Ordering::SeqCst);
        // (the job behind, rides in the first batch, rides in the second: a batch of deferred
        // jobs alone commits without an fsync of its own and carries no rider)
        for (behind, rides_in_first, rides_in_second) in [(Durability::Synced, 0, 1), (Durability::Deferred, 1, 0)] {
            let before = rides();
            let (first, started, release) = held_job(&db.writer, Durability::Synced, 1);
            started.await.unwrap();
            // Held too, so its batch cannot ride before the first batch's rides are counted.
            let (second, _, release_second) = held_job(&db.writer, behind, 2);
            let deadline = Instant::now() + Duration::from_secs(10);
            // The second job is made (and counted, if synced) before it is sent; wait until the
            // writer's queue holds it.
            while db.writer.jobs.capacity() == QUEUE_DEPTH {
                assert!(Instant::now() < deadline, "the second job never reached the queue");
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            release.send(()).unwrap();
            first.await.unwrap().unwrap();
            assert_eq!(rides() - before, rides_in_first, "{behind:?} job waiting");
            release_second.send(()).unwrap();
            second.await.unwrap().unwrap();
            assert_eq!(rides() - before, rides_in_first + rides_in_second, "the second batch, nothing behind it");
        }
        assert!(!db.writer.set_rider(rider.clone()), "one rider per writer");
    }

    /// A batch of deferred bookkeeping alone commits at NORMAL (no fsync of its own); a batch
    /// with any synced job commits at the configured FULL, also right after a deferred one; a
    /// database configured NORMAL stays NORMAL.
    #[tokio::test]
    async fn deferred_batches_skip_the_fsync_and_synced_ones_keep_it() {
        const NORMAL: i64 = 1;
        const FULL: i64 = 2;
        let dir = tempfile::tempdir().unwrap();
        let db = Database::open(&DbConfig::new(dir.path().join("w.db"))).await.unwrap();
        assert_eq!(level_seen(&db.writer, Durability::Synced).await, FULL);
        assert_eq!(level_seen(&db.writer, Durability::Deferred).await, NORMAL);
        assert_eq!(level_seen(&db.writer, Durability::Deferred).await, NORMAL);
        assert_eq!(level_seen(&db.writer, Durability::Synced).await, FULL);
        // Both kinds in one batch: the synced job decides.
        let (deferred, synced) =
            tokio::join!(level_seen(&db.writer, Durability::Deferred), level_seen(&db.writer, Durability::Synced));
        assert!(deferred == synced || deferred == NORMAL && synced == FULL, "{deferred} {synced}");
        assert_eq!(synced, FULL);
        db.close().await;

        let mut config = DbConfig::new(dir.path().join("n.db"));
        config.synchronous = crate::Synchronous::Normal;
        let db = Database::open(&config).await.unwrap();
        assert_eq!(level_seen(&db.writer, Durability::Synced).await, NORMAL);
        assert_eq!(level_seen(&db.writer, Durability::Deferred).await, NORMAL);
        db.close().await;
    }

    /// Every event is stamped a microsecond or more after the one written before it, in the
    /// outbox's order: the events of one job, and those of concurrent jobs sharing a
    /// millisecond; and its microseconds fall in (or after) its job's millisecond.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn events_are_stamped_later_than_every_event_before_them() {
        use prost::Message;
        let dir = tempfile::tempdir().unwrap();
        let db = Database::open(&DbConfig::new(dir.path().join("w.db"))).await.unwrap();
        let mut tasks = Vec::new();
        for n in 0..200i64 {
            let writer = db.writer.clone();
            tasks.push(tokio::spawn(async move {
                writer
                    .transact::<_, TestError, _>("test", move |tx: &mut WriteTx| {
                        Box::pin(async move { Ok(enqueue_events(tx, vec![event(n), event(n), event(n)]).await?.len()) })
                    })
                    .await
            }));
        }
        for task in tasks {
            assert_eq!(task.await.unwrap().unwrap(), 3);
        }
        let payloads: Vec<Vec<u8>> =
            sqlx::query_scalar("SELECT payload FROM event_queue ORDER BY id").fetch_all(&db.reads).await.unwrap();
        let events: Vec<v1::Event> = payloads.iter().map(|p| v1::Event::decode(p.as_slice()).unwrap()).collect();
        assert_eq!(events.len(), 600);
        for pair in events.windows(2) {
            assert!(pair[1].occurred_at_us > pair[0].occurred_at_us, "{pair:?}");
        }
        for event in &events {
            assert!(event.occurred_at_us >= event.occurred_at_ms * 1000, "{event:?}");
        }
        let shared_ms = events.windows(2).filter(|p| p[0].occurred_at_ms == p[1].occurred_at_ms).count();
        assert!(shared_ms > 0, "some events shared a millisecond (else this test tests nothing)");
        db.close().await;
    }

    /// A writer opened on an outbox whose newest event was stamped ahead of this clock (the last
    /// run's machine was ahead, or the clock was stepped back since) stamps its events after
    /// it: a later change always orders after an earlier one.
    #[tokio::test]
    async fn a_restarted_writer_stamps_after_the_last_run_whatever_the_clock() {
        use prost::Message;
        let dir = tempfile::tempdir().unwrap();
        let config = DbConfig::new(dir.path().join("w.db"));
        let db = Database::open(&config).await.unwrap();
        let write = |db: &Database| {
            let writer = db.writer.clone();
            async move {
                writer
                    .transact::<_, TestError, _>("test", |tx: &mut WriteTx| {
                        Box::pin(async move { Ok(enqueue_events(tx, vec![event(1)]).await?.len()) })
                    })
                    .await
            }
        };
        write(&db).await.unwrap();
        // The last run's event, stamped an hour ahead of this clock.
        let ahead_us = (reelay_kit::now_ms() + 3_600_000) * 1000;
        let payload: Vec<u8> =
            sqlx::query_scalar("SELECT payload FROM event_queue").fetch_one(&db.reads).await.unwrap();
        let mut last = v1::Event::decode(payload.as_slice()).unwrap();
        last.occurred_at_us = ahead_us;
        db.writer
            .transact::<_, TestError, _>("test", move |tx: &mut WriteTx| {
                Box::pin(async move {
                    sqlx::query("UPDATE event_queue SET payload = ?")
                        .bind(last.encode_to_vec())
                        .execute(tx.conn())
                        .await?;
                    Ok(())
                })
            })
            .await
            .unwrap();
        db.close().await;

        let db = Database::open(&config).await.unwrap();
        write(&db).await.unwrap();
        let payload: Vec<u8> = sqlx::query_scalar("SELECT payload FROM event_queue ORDER BY id DESC LIMIT 1")
            .fetch_one(&db.reads)
            .await
            .unwrap();
        let next = v1::Event::decode(payload.as_slice()).unwrap();
        assert!(next.occurred_at_us > ahead_us, "{} after {ahead_us}", next.occurred_at_us);
        db.close().await;
    }

    /// Many concurrent jobs, every third failing after it wrote: the failures roll back alone,
    /// everything else commits with its events.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn failing_jobs_roll_back_alone_and_batch_mates_commit() {
        let dir = tempfile::tempdir().unwrap();
        let db = Database::open(&DbConfig::new(dir.path().join("w.db"))).await.unwrap();
        let commits = db.writer.subscribe_commits();
        let mut tasks = Vec::new();
        for n in 0..300i64 {
            let writer = db.writer.clone();
            tasks.push(tokio::spawn(async move {
                writer
                    .transact("test", move |tx: &mut WriteTx| {
                        Box::pin(async move {
                            sqlx::query(
                                "INSERT INTO users (id, handle, display_name, created_at) VALUES (?, ?, 'x', 0)",
                            )
                            .bind(n.to_string())
                            .bind(format!("u{n}"))
                            .execute(tx.conn())
                            .await?;
                            enqueue_events(tx, vec![event(n)]).await?;
                            if n % 3 == 0 { Err(TestError::Refused) } else { Ok(n) }
                        })
                    })
                    .await
            }));
        }
        let mut ok = 0;
        for (n, task) in tasks.into_iter().enumerate() {
            match task.await.unwrap() {
                Ok(value) => {
                    assert_eq!(value, n as i64);
                    ok += 1;
                }
                Err(TestError::Refused) => assert_eq!(n % 3, 0),
                Err(other) => panic!("job {n}: {other:?}"),
            }
        }
        assert_eq!(ok, 200);
        let users: i64 = sqlx::query("SELECT COUNT(*) FROM users").fetch_one(&db.reads).await.unwrap().get(0);
        let events: i64 = sqlx::query("SELECT COUNT(*) FROM event_queue").fetch_one(&db.reads).await.unwrap().get(0);
        let refused: i64 = sqlx::query("SELECT COUNT(*) FROM users WHERE CAST(id AS INTEGER) % 3 = 0")
            .fetch_one(&db.reads)
            .await
            .unwrap()
            .get(0);
        assert_eq!((users, events, refused), (200, 200, 0));
        assert_eq!(*commits.borrow(), 200, "the commit counter counts committed outbox rows");
        db.close().await;
    }

    fn insert_user(
        n: i64,
        handle: String,
    ) -> impl for<'t> FnOnce(&'t mut WriteTx) -> BoxFuture<'t, Result<i64, TestError>> + Send + 'static {
        move |tx| {
            Box::pin(async move {
                sqlx::query("INSERT INTO users (id, handle, display_name, created_at) VALUES (?, ?, 'x', 0)")
                    .bind(n.to_string())
                    .bind(handle)
                    .execute(tx.conn())
                    .await?;
                enqueue_events(tx, vec![event(n)]).await?;
                Ok(n)
            })
        }
    }

    /// SQLite ends a transaction by itself after some errors (an I/O error, a full disk); here a
    /// job does the same with a bare ROLLBACK and then keeps writing, as code that swallowed the
    /// error would. Nothing of its batch may commit, its later statements must not autocommit,
    /// and every job that was told OK has its row and its event.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_transaction_sqlite_ended_fails_its_whole_batch() {
        let dir = tempfile::tempdir().unwrap();
        let db = Database::open(&DbConfig::new(dir.path().join("r.db"))).await.unwrap();
        // Ten waves of 40 concurrent jobs, each wave done before the next starts: a batch never
        // spans two waves, so the waves without a saboteur must commit whole, however the
        // machine's load groups the jobs inside a wave.
        let saboteurs = [87i64, 250];
        let mut told_ok = Vec::new();
        for wave in 0..10i64 {
            let dirty = saboteurs.iter().any(|s| s / 40 == wave);
            let mut tasks = Vec::new();
            for n in wave * 40..wave * 40 + 40 {
                let writer = db.writer.clone();
                let saboteur = saboteurs.contains(&n);
                tasks.push(tokio::spawn(async move {
                    let insert = insert_user(n, format!("u{n}"));
                    let result = if saboteur {
                        writer
                            .transact("saboteur", move |tx: &mut WriteTx| {
                                Box::pin(async move {
                                    let value = insert(tx).await?;
                                    tx.conn().execute("ROLLBACK").await?;
                                    // Would autocommit now; the commit hook refuses it.
                                    let late = sqlx::query(
                                        "INSERT INTO users (id, handle, display_name, created_at) VALUES (?, ?, 'x', 0)",
                                    )
                                    .bind(format!("late{n}"))
                                    .bind(format!("late{n}"))
                                    .execute(tx.conn())
                                    .await;
                                    assert!(late.is_err(), "a statement after the rollback must not commit");
                                    Ok(value)
                                })
                            })
                            .await
                    } else {
                        writer.transact("job", insert).await
                    };
                    (n, saboteur, result)
                }));
            }
            for task in tasks {
                let (n, saboteur, result) = task.await.unwrap();
                match result {
                    Ok(value) => {
                        assert!(!saboteur, "job {n} ended its transaction yet was told OK");
                        assert_eq!(value, n);
                        told_ok.push(n.to_string());
                    }
                    Err(TestError::Commit(CommitError::RolledBack | CommitError::Recovering(_))) => {
                        assert!(dirty, "job {n} failed in a wave without a saboteur: {result:?}");
                    }
                    Err(other) => panic!("job {n}: {other:?}"),
                }
            }
            if dirty {
                // The writer reopens its connection after the fault; the next wave comes after.
                for _ in 0..100 {
                    let ready =
                        db.writer.transact("ready", |_: &mut WriteTx| Box::pin(async { Ok::<_, TestError>(0) }));
                    if ready.await.is_ok() {
                        break;
                    }
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
            }
        }
        let users: Vec<String> =
            sqlx::query_scalar("SELECT id FROM users ORDER BY CAST(id AS INTEGER)").fetch_all(&db.reads).await.unwrap();
        let events: Vec<String> =
            sqlx::query_scalar("SELECT aggregate_id FROM event_queue ORDER BY CAST(aggregate_id AS INTEGER)")
                .fetch_all(&db.reads)
                .await
                .unwrap();
        told_ok.sort_by_key(|id| id.parse::<i64>().unwrap());
        assert_eq!(users, told_ok, "exactly the jobs told OK wrote their rows");
        assert_eq!(events, told_ok, "and each of them its event");
        assert!(told_ok.len() >= 320, "the eight waves without a saboteur commit: {}", told_ok.len());
        // The writer reopened its connection and serves again.
        db.writer.transact("after", insert_user(10_000, "after".into())).await.unwrap();
        db.close().await;
    }

    /// A job that panics is rolled back and reported; the writer keeps serving.
    #[tokio::test]
    async fn a_panicking_job_is_contained() {
        let dir = tempfile::tempdir().unwrap();
        let db = Database::open(&DbConfig::new(dir.path().join("p.db"))).await.unwrap();
        let result: Result<(), TestError> = db
            .writer
            .transact("boom", |tx: &mut WriteTx| {
                Box::pin(async move {
                    sqlx::query("INSERT INTO users (id, handle, display_name, created_at) VALUES ('1', 'a', 'x', 0)")
                        .execute(tx.conn())
                        .await?;
                    panic!("bug in a job");
                })
            })
            .await;
        assert!(matches!(result, Err(TestError::Commit(CommitError::Panicked))));
        let after: Result<i64, TestError> = db
            .writer
            .transact("after", |tx: &mut WriteTx| {
                Box::pin(async move {
                    Ok(sqlx::query("SELECT COUNT(*) FROM users").fetch_one(tx.conn()).await?.get::<i64, _>(0))
                })
            })
            .await;
        assert_eq!(after.unwrap(), 0);
        let writer = db.writer.clone();
        db.close().await;
        let closed: Result<(), TestError> =
            writer.transact("late", |_tx: &mut WriteTx| Box::pin(async { Ok(()) })).await;
        assert!(matches!(closed, Err(TestError::Commit(CommitError::Closed))));
    }
}
