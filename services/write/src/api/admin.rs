//! The Admin service (internal): status, explaining an event, and listing, replaying and
//! discarding dead letters. The storage side is `reelay_outbox::{inspect, dead_letters}`; this
//! file validates requests (naming the field) and maps the answers, and samples the same status
//! into the write service's gauges when Prometheus scrapes.

use std::sync::{Arc, LazyLock, Mutex, PoisonError};
use std::time::{Duration, Instant};

use futures_util::future::BoxFuture;

use reelay_contracts::v1;
use reelay_domain::EventId;
use reelay_kit::metrics::{self, Gauge};
use reelay_kit::{ErrorCode, ServiceError, now_ms};
use reelay_outbox::dead_letters::{self, Action, Filter, Target};
use reelay_outbox::{Database, WriteTx, deliveries, inspect};
use sqlx::SqliteConnection;
use tonic::{Request, Response, Status};

use super::internal::{MAX_BATCH_KEYS, event_type, handler_name};
use crate::WriteError;

/// Which event bus the write service delivers through.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Bus {
    /// Handlers claim per-handler deliveries from the outbox (cursors).
    #[default]
    Db,
    /// The relay publishes the outbox to JetStream.
    Nats,
}

impl Bus {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Db => "db",
            Self::Nats => "nats",
        }
    }
}

#[derive(Clone)]
pub(super) struct AdminApi {
    pub(super) db: Database,
    pub(super) bus: Bus,
    /// The claim lease (a handler heard from within a few of them is still run somewhere).
    pub(super) lease: std::time::Duration,
    /// Whether federation leaves unavailable servers out of fan-outs (the setting not 0).
    pub(super) leaves_servers_out: bool,
}

/// The federation's failing servers: (failing, unavailable). With leaving servers out turned
/// off, a server recorded unavailable before is only failing.
async fn federation_servers(conn: &mut SqliteConnection, leaves_out: bool) -> Result<(u64, u64), sqlx::Error> {
    let (failing, unavailable): (i64, i64) =
        sqlx::query_as("SELECT COUNT(*), COUNT(unavailable_since) FROM federation_failing_hosts")
            .fetch_one(conn)
            .await?;
    let unavailable = if leaves_out { unavailable } else { 0 };
    Ok(((failing - unavailable) as u64, unavailable as u64))
}

/// An event id as the ledger keys it: a UUID (in the form events carry, whatever form it was
/// typed in), or `row:<id>` for a foreign row without one.
fn event_key(field: &str, value: &str) -> Result<String, ServiceError> {
    if let Some(id) = value.strip_prefix("row:") {
        let id = id
            .parse::<i64>()
            .map_err(|_| ServiceError::invalid(field, format!("row:<id> needs a number, got {value:?}")))?;
        return Ok(format!("row:{id}"));
    }
    Ok(EventId::parse(field, value.trim())?.to_string())
}

/// Who asks for an action (recorded with it).
fn operator(operator: &str) -> Result<String, ServiceError> {
    let operator = operator.trim();
    if operator.is_empty() || operator.len() > 64 {
        return Err(ServiceError::invalid("operator", "is required (who asks, 1-64 characters; it is recorded)"));
    }
    Ok(operator.to_owned())
}

fn row_state(r: inspect::RowState) -> v1::OutboxRowState {
    v1::OutboxRowState {
        id: r.id,
        event_id: r.event_id,
        event_type: r.event_type,
        aggregate_id: r.aggregate_id,
        status: r.status,
        attempts: r.attempts,
        created_at_ms: r.created_at,
        available_at_ms: r.available_at,
        claimed_at_ms: r.claimed_at,
        claimed_by: r.claimed_by,
        last_error: r.last_error,
        stream_sequence: r.stream_sequence,
        replay_handler: r.replay_handler,
    }
}

/// The most pairs an action's answer names of each kind (changed, unchanged): 10,000 pairs are
/// about 0.8 MB, well inside a gRPC message; the totals count the rest.
const MAX_LISTED_PAIRS: usize = 10_000;

fn keys(pairs: Vec<(String, String)>) -> Vec<v1::DeadLetterKey> {
    pairs
        .into_iter()
        .take(MAX_LISTED_PAIRS)
        .map(|(event_id, handler)| v1::DeadLetterKey { event_id, handler })
        .collect()
}

fn action_answer(acted: dead_letters::Acted) -> v1::DeadLetterActionResponse {
    v1::DeadLetterActionResponse {
        changed_total: acted.changed.len() as u64,
        unchanged_total: acted.unchanged.len() as u64,
        changed: keys(acted.changed),
        unchanged: keys(acted.unchanged),
    }
}

impl AdminApi {
    /// Refuses `handler` when the database knows no handler by that name (see
    /// [`inspect::unknown_handler`]): asked after an answer came back empty, so a typo is not
    /// answered "nothing there".
    async fn known_handler(&self, field: &str, handler: &str) -> Result<(), WriteError> {
        let mut conn = self.db.reads.acquire().await?;
        match inspect::unknown_handler(&mut conn, handler).await? {
            None => Ok(()),
            Some(registered) => Err(ServiceError::new(
                ErrorCode::NotFound,
                format!(
                    "{field}: no handler named {handler:?} is registered here or has open or dead-lettered deliveries \
                 (registered: {})",
                    if registered.is_empty() { "none".to_owned() } else { registered.join(", ") }
                ),
            )
            .into()),
        }
    }

    async fn act(
        &self,
        r: v1::DeadLetterActionRequest,
        action: Action,
    ) -> Result<v1::DeadLetterActionResponse, WriteError> {
        let operator = operator(&r.operator)?;
        let handler = if r.handler.is_empty() { None } else { Some(handler_name("handler", &r.handler)?) };
        let target = match (r.all, handler) {
            (true, _) if !r.event_ids.is_empty() => {
                return Err(ServiceError::invalid("event_ids", "must be empty when `all` is set").into());
            }
            (true, None) => return Err(ServiceError::invalid("handler", "is required with `all`").into()),
            (true, Some(handler)) => Target::AllOf { handler, after: String::new() },
            (false, handler) => {
                if r.event_ids.is_empty() || r.event_ids.len() > MAX_BATCH_KEYS {
                    return Err(ServiceError::invalid(
                        "event_ids",
                        format!(
                            "must name 1..={MAX_BATCH_KEYS} events (or set `all` with a handler), got {}",
                            r.event_ids.len()
                        ),
                    )
                    .into());
                }
                let event_ids =
                    r.event_ids.iter().map(|id| event_key("event_ids", id)).collect::<Result<Vec<_>, _>>()?;
                Target::Events { event_ids, handler }
            }
        };
        let job = match action {
            Action::Replay { .. } => "admin_replay_dead_letters",
            Action::Discard => "admin_discard_dead_letters",
        };
        // Every dead letter of a handler is acted on a batch per job (by event id), so writes,
        // claims and lease renewals go on between them however many there are.
        let mut target = target;
        let mut acted = dead_letters::Acted::default();
        loop {
            let (batch, operator) = (target.clone(), operator.clone());
            let done = self
                .db
                .writer
                .transact::<_, WriteError, _>(job, move |tx: &mut WriteTx| {
                    Box::pin(async move { Ok(dead_letters::act(tx, &batch, action, &operator, tx.now_ms()).await?) })
                })
                .await?;
            let Target::AllOf { handler, .. } = &target else {
                acted = done;
                break;
            };
            let last = done.changed.iter().chain(&done.unchanged).map(|(event_id, _)| event_id).max().cloned();
            let full = done.changed.len() + done.unchanged.len() >= dead_letters::ALL_OF_BATCH;
            acted.changed.extend(done.changed);
            acted.unchanged.extend(done.unchanged);
            match last {
                Some(after) if full => target = Target::AllOf { handler: handler.clone(), after },
                _ => break,
            }
        }
        if acted.changed.is_empty() && !r.handler.is_empty() {
            self.known_handler("handler", &r.handler).await?;
        }
        Ok(action_answer(acted))
    }
}

/// A refused retire as the service answers it.
fn retire_error(error: deliveries::RetireError) -> WriteError {
    match error {
        deliveries::RetireError::Delivered(_) => ServiceError::failed_precondition(error.to_string()).into(),
        deliveries::RetireError::Unknown(_) => ServiceError::new(ErrorCode::NotFound, error.to_string()).into(),
        deliveries::RetireError::Live(_) => ServiceError::failed_precondition(error.to_string()).into(),
        deliveries::RetireError::Sql(error) => error.into(),
    }
}

#[tonic::async_trait]
impl v1::admin_server::Admin for AdminApi {
    async fn status(&self, _request: Request<v1::StatusRequest>) -> Result<Response<v1::StatusResponse>, Status> {
        let mut conn = self.db.reads.acquire().await.map_err(WriteError::from)?;
        let now = now_ms();
        let s = inspect::status(&mut conn, now, self.bus == Bus::Db).await.map_err(WriteError::from)?;
        let (servers_failing, servers_unavailable) =
            federation_servers(&mut conn, self.leaves_servers_out).await.map_err(WriteError::from)?;
        let builds = deliveries::builds(&mut conn, now, self.db.writer.lease_counted_from(), self.lease)
            .await
            .map_err(WriteError::from)?;
        let builds_of = |handler: &str| {
            builds
                .iter()
                .filter(|b| b.handler == handler)
                .map(|b| v1::HandlerBuildStatus {
                    event_types: b.event_types.clone(),
                    first_seen_ms: b.first_seen,
                    last_seen_ms: b.last_seen,
                    last_seen_age_ms: (now - b.last_seen).max(0),
                    live: b.live,
                    handed: b.handed,
                })
                .collect()
        };
        Ok(Response::new(v1::StatusResponse {
            backend: self.bus.as_str().into(),
            outbox_pending: s.outbox.pending,
            outbox_processing: s.outbox.processing,
            outbox_done: s.outbox.done,
            outbox_dead_lettered: s.outbox.dead_lettered,
            oldest_due_age_ms: s.outbox.oldest_due_age_ms,
            federation_servers_failing: servers_failing,
            federation_servers_unavailable: servers_unavailable,
            handlers: s
                .handlers
                .into_iter()
                .map(|h| v1::HandlerStatus {
                    builds: builds_of(&h.handler),
                    handler: h.handler,
                    pending: h.pending,
                    oldest_age_ms: h.oldest_age_ms,
                    in_progress: h.in_progress,
                    retrying: h.retrying,
                    dead_lettered: h.dead_lettered,
                    delivered: h.delivered,
                })
                .collect(),
        }))
    }

    async fn retire_handler(
        &self,
        request: Request<v1::RetireHandlerRequest>,
    ) -> Result<Response<v1::RetireHandlerResponse>, Status> {
        let r = request.into_inner();
        let handler = handler_name("handler", &r.handler)?;
        let operator = operator(&r.operator)?;
        // The check, the dead letters' discard and the rest are one job: a refused retire (a
        // process heard from, say) changes nothing. Its two statements took about 5 µs per dead
        // letter (0.95 s for 200,000, run by Python's sqlite3 on the migrated schema, not
        // through the writer), once per retired handler.
        let lease = self.lease;
        let retired = self
            .db
            .writer
            .transact::<_, WriteError, _>("admin_retire_handler", move |tx: &mut WriteTx| {
                Box::pin(async move {
                    deliveries::retire(tx, &handler, &operator, tx.now_ms(), lease).await.map_err(retire_error)
                })
            })
            .await?;
        Ok(Response::new(v1::RetireHandlerResponse {
            dead_letters_discarded: retired.dead_letters,
            open_discarded: retired.open,
        }))
    }

    async fn explain_event(
        &self,
        request: Request<v1::ExplainEventRequest>,
    ) -> Result<Response<v1::ExplainEventResponse>, Status> {
        let key = event_key("event_id", &request.into_inner().event_id)?;
        let mut conn = self.db.reads.acquire().await.map_err(WriteError::from)?;
        let explained = inspect::explain(&mut conn, &key, self.bus == Bus::Db).await.map_err(WriteError::from)?;
        if explained.is_empty() {
            return Err(ServiceError::not_found(format!("event {key}")).into());
        }
        Ok(Response::new(v1::ExplainEventResponse {
            backend: self.bus.as_str().into(),
            outbox: explained.outbox.map(row_state),
            handlers: explained
                .handlers
                .into_iter()
                .map(|h| v1::HandlerDelivery {
                    handler: h.handler,
                    state: h.state,
                    attempts: h.attempts,
                    last_error: h.last_error,
                    started_at_ms: h.started_at,
                    renewed_at_ms: h.renewed_at,
                    processed_at_ms: h.processed_at,
                    available_at_ms: h.available_at,
                    owner: h.owner,
                    replays: h.replays,
                })
                .collect(),
            replays: explained.replays.into_iter().map(row_state).collect(),
            actions: explained
                .actions
                .into_iter()
                .map(|a| v1::DeadLetterAction {
                    at_ms: a.at,
                    action: a.action,
                    handler: a.handler,
                    operator: a.operator,
                    attempts: a.attempts,
                    last_error: a.last_error,
                })
                .collect(),
        }))
    }

    async fn list_dead_letters(
        &self,
        request: Request<v1::ListDeadLettersRequest>,
    ) -> Result<Response<v1::ListDeadLettersResponse>, Status> {
        let r = request.into_inner();
        let handler = if r.handler.is_empty() { None } else { Some(handler_name("handler", &r.handler)?) };
        let event_type = match r.event_type.as_str() {
            "" => None,
            t => Some(event_type("event_type", t)?),
        };
        if r.since_ms < 0 {
            return Err(ServiceError::invalid(
                "since_ms",
                format!("must be a time in ms since the epoch, got {}", r.since_ms),
            )
            .into());
        }
        let limit = match r.limit {
            0 => 100,
            l if l <= 1000 => l,
            l => return Err(ServiceError::invalid("limit", format!("must be 1..=1000 (0 means 100), got {l}")).into()),
        };
        let filter = Filter { handler, event_type, since_ms: (r.since_ms > 0).then_some(r.since_ms), limit };
        let mut conn = self.db.reads.acquire().await.map_err(WriteError::from)?;
        let (listed, total) = dead_letters::list(&mut conn, &filter).await.map_err(WriteError::from)?;
        drop(conn);
        if let (true, Some(handler)) = (listed.is_empty(), &filter.handler) {
            self.known_handler("handler", handler).await?;
        }
        Ok(Response::new(v1::ListDeadLettersResponse {
            dead_letters: listed
                .into_iter()
                .map(|d| v1::DeadLetter {
                    event_id: d.event_id,
                    handler: d.handler,
                    event_type: d.event_type,
                    aggregate_id: d.aggregate_id,
                    attempts: d.attempts,
                    last_error: d.last_error,
                    dead_lettered_at_ms: d.dead_lettered_at,
                    replays: d.replays,
                })
                .collect(),
            total,
        }))
    }

    async fn replay_dead_letters(
        &self,
        request: Request<v1::DeadLetterActionRequest>,
    ) -> Result<Response<v1::DeadLetterActionResponse>, Status> {
        let action = Action::Replay { republish: self.bus == Bus::Nats };
        Ok(Response::new(self.act(request.into_inner(), action).await?))
    }

    async fn discard_dead_letters(
        &self,
        request: Request<v1::DeadLetterActionRequest>,
    ) -> Result<Response<v1::DeadLetterActionResponse>, Status> {
        Ok(Response::new(self.act(request.into_inner(), Action::Discard).await?))
    }
}

static OUTBOX_ROWS: LazyLock<Gauge> =
    LazyLock::new(|| metrics::gauge("reelay_outbox_rows", "Outbox rows by status (sampled at scrape).", &["status"]));
static OLDEST_DUE: LazyLock<Gauge> = LazyLock::new(|| {
    metrics::gauge(
        "reelay_outbox_oldest_due_age_seconds",
        "Age of the oldest outbox row still waiting (nats: not yet published; db: not yet handed to every handler, or a due retry).",
        &[],
    )
});
static HANDLER_PENDING: LazyLock<Gauge> = LazyLock::new(|| {
    metrics::gauge(
        "reelay_handler_pending",
        "Deliveries waiting per handler (db: after its cursor, retrying or claimed; nats: claimed or replayed, the rest is the consumer's lag).",
        &["handler"],
    )
});
static HANDLER_OLDEST: LazyLock<Gauge> = LazyLock::new(|| {
    metrics::gauge(
        "reelay_handler_oldest_pending_age_seconds",
        "Age of a handler's oldest pending delivery (db backend).",
        &["handler"],
    )
});
static DEAD_LETTERS: LazyLock<Gauge> = LazyLock::new(|| {
    metrics::gauge(
        "reelay_dead_letters",
        "Dead-lettered deliveries per handler, waiting for an operator.",
        &["handler"],
    )
});

static WRITER_BUSY: LazyLock<Gauge> = LazyLock::new(|| {
    metrics::gauge(
        "reelay_writer_busy_seconds",
        "How long the database writer has been on its batch in hand (0 while it waits for work): it grows only while \
         one batch hangs.",
        &[],
    )
});

static FEDERATION_SERVERS: LazyLock<Gauge> = LazyLock::new(|| {
    metrics::gauge(
        "reelay_federation_servers",
        "Remote servers deliveries failed at with no answer since, by state: failing, or unavailable (left out of \
         fan-outs to followers).",
        &["state"],
    )
});

/// How many times its own cost apart two samples of the outbox are taken, at the least, once
/// one costs [`SPACED_FROM`] or more (a cheaper one is taken at every scrape).
const SAMPLE_SPACING: u32 = 20;
const SPACED_FROM: Duration = Duration::from_secs(1);

/// Whether a sample is due after the last one, taken at `.0` in `.1` (see [`sample_status`]).
fn sample_due(last: Option<(Instant, Duration)>) -> bool {
    last.is_none_or(|(at, cost)| cost < SPACED_FROM || at.elapsed() >= cost * SAMPLE_SPACING)
}

/// Samples the outbox and every handler's standing into gauges whenever Prometheus scrapes, by
/// the same query `Admin.Status` answers with (so the two always agree), how long the writer
/// has been on its batch in hand, and the federation's failing servers (`leaves_servers_out`:
/// whether unavailable ones are left out of fan-outs, REELAY_FEDERATION_UNAVAILABLE_AFTER_SECS
/// not 0).
///
/// The read by status goes through every retained outbox row (0.32 s for 3 million, Python's
/// sqlite3 on the same index; on db the handlers' backlog is walked too, docs/operations.md), so
/// a sample that took `t` of [`SPACED_FROM`] or more is
/// taken again only [`SAMPLE_SPACING`] × `t` later, the last values served in between: with
/// millions of rows the gauges lag by seconds rather than the scrapes costing a core.
pub fn sample_status(db: Database, bus: Bus, leaves_servers_out: bool) {
    for gauge in
        [&OUTBOX_ROWS, &OLDEST_DUE, &HANDLER_PENDING, &HANDLER_OLDEST, &DEAD_LETTERS, &WRITER_BUSY, &FEDERATION_SERVERS]
    {
        LazyLock::force(gauge);
    }
    let state: Arc<Mutex<Sampling>> = Arc::default();
    metrics::add_sampler(Arc::new(move || -> BoxFuture<'static, ()> {
        let (db, state) = (db.clone(), state.clone());
        Box::pin(async move {
            // First, and read from memory: it must show even when the database cannot be read.
            WRITER_BUSY.set(&[], db.writer.busy_for().as_secs_f64());
            // A task of its own: a sample cut by the scrape's 5 s bound still ends and notes its
            // cost and values (a cut one left no cost, and every scrape read again).
            if let Some(running) = Running::start(&state) {
                let sample = tokio::spawn(sample_outbox(db, bus, leaves_servers_out, running));
                if let Err(error) = sample.await {
                    tracing::warn!(%error, "the outbox sample failed");
                }
            }
            // Shown here, within the scrape (one scrape renders at a time), not by the task,
            // whose clearing and setting of gauges could land in another scrape's rendering; a
            // sample that ended after its scrape was cut is shown by the next.
            let sampled = state.lock().unwrap_or_else(PoisonError::into_inner).sampled.take();
            if let Some(sampled) = sampled {
                show(sampled, bus);
            }
        })
    }));
}

/// Whether a sample is running, the last one's start and cost, and what it read, until shown.
#[derive(Default)]
struct Sampling {
    running: bool,
    last: Option<(Instant, Duration)>,
    sampled: Option<Sampled>,
}

/// Where the outbox and the handlers stand, and the failing and unavailable servers.
type Sampled = (inspect::Status, (u64, u64));

/// A sample running: its cost noted (and the next one let run) when it is dropped.
struct Running {
    state: Arc<Mutex<Sampling>>,
    /// When its reads began.
    started: Option<Instant>,
}

impl Running {
    /// A sample, unless one is running or the last one's cost says to wait.
    fn start(state: &Arc<Mutex<Sampling>>) -> Option<Self> {
        let mut sampling = state.lock().unwrap_or_else(PoisonError::into_inner);
        if sampling.running || !sample_due(sampling.last) {
            return None;
        }
        sampling.running = true;
        Some(Self { state: state.clone(), started: None })
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let mut sampling = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        sampling.running = false;
        // A sample that never read (no connection to be had) has no cost to space the next by.
        if let Some(started) = self.started {
            sampling.last = Some((started, started.elapsed()));
        }
    }
}

/// Reads the outbox and the handlers' standing, for the next scrape to show.
async fn sample_outbox(db: Database, bus: Bus, leaves_servers_out: bool, mut running: Running) {
    let status = async {
        let mut conn = db.reads.acquire().await?;
        // The cost is the reads', not the wait for a connection.
        running.started = Some(Instant::now());
        let servers = federation_servers(&mut conn, leaves_servers_out).await?;
        Ok::<_, sqlx::Error>((inspect::status(&mut conn, now_ms(), bus == Bus::Db).await?, servers))
    };
    match status.await {
        Ok(sampled) => running.state.lock().unwrap_or_else(PoisonError::into_inner).sampled = Some(sampled),
        Err(error) => {
            // Their last values are served (left out, a firing alert on them would
            // resolve); reelay_metrics_samples_failed_total says they are stale.
            tracing::warn!(%error, "cannot sample the outbox for metrics; serving its last values");
            metrics::sample_failed();
        }
    }
}

/// Sets the gauges to what a sample read.
fn show((s, (failing, unavailable)): Sampled, bus: Bus) {
    for (status, rows) in [
        ("pending", s.outbox.pending),
        ("processing", s.outbox.processing),
        ("done", s.outbox.done),
        ("dead_lettered", s.outbox.dead_lettered),
    ] {
        OUTBOX_ROWS.set(&[status], rows as f64);
    }
    OLDEST_DUE.set(&[], s.outbox.oldest_due_age_ms as f64 / 1000.0);
    FEDERATION_SERVERS.set(&["failing"], failing as f64);
    FEDERATION_SERVERS.set(&["unavailable"], unavailable as f64);
    for gauge in [&HANDLER_PENDING, &HANDLER_OLDEST, &DEAD_LETTERS] {
        gauge.clear();
    }
    if bus == Bus::Nats {
        // Events no handler got: the relay's dead letters, under its name.
        DEAD_LETTERS.set(&[dead_letters::RELAY], s.outbox.relay_dead_letters as f64);
    }
    for h in s.handlers {
        HANDLER_PENDING.set(&[&h.handler], h.pending as f64);
        HANDLER_OLDEST.set(&[&h.handler], h.oldest_age_ms as f64 / 1000.0);
        DEAD_LETTERS.set(&[&h.handler], h.dead_lettered as f64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A cheap sample is taken at every scrape; a costly one only twenty times its cost later.
    #[test]
    fn costly_samples_are_spaced_by_their_cost() {
        let ago = |secs: u64| Instant::now() - Duration::from_secs(secs);
        assert!(sample_due(None));
        assert!(sample_due(Some((Instant::now(), Duration::from_millis(900)))), "under a second: every scrape");
        assert!(!sample_due(Some((ago(30), Duration::from_secs(2)))), "2 s: 40 s apart");
        assert!(sample_due(Some((ago(41), Duration::from_secs(2)))));
    }

    /// However many pairs an action changed, its answer names at most 10,000 of each kind, and
    /// counts them all.
    #[test]
    fn an_action_answer_fits_a_message() {
        let pairs = |n: usize| (0..n).map(|i| (format!("0190{i:028}"), "search".to_owned())).collect::<Vec<_>>();
        let answer = action_answer(dead_letters::Acted { changed: pairs(70_001), unchanged: pairs(3) });
        assert_eq!((answer.changed.len(), answer.changed_total), (MAX_LISTED_PAIRS, 70_001));
        assert_eq!((answer.unchanged.len(), answer.unchanged_total), (3, 3));
        assert!(prost::Message::encoded_len(&answer) < 1024 * 1024, "{}", prost::Message::encoded_len(&answer));
    }
}
