//! The ledger-guarded dispatch of a batch of deliveries to the hosted handlers.
//!
//! For every (event, subscribed handler) pair the ledger is asked first, in one batched call
//! (which goes out with the claims other dispatchers of the process ask at the same time, see
//! [`LedgerClaims`]):
//! `done` → skip; held by a fresh claim elsewhere (or by another batch of this process, which
//! then is not asked of the ledger at all) → defer the delivery to the lease expiry;
//! acquired → run the handler, then complete the claim (success) or release it (failure). A
//! delivery is acked when all its handlers are done or skipped. Handlers run batched: each gets
//! all its acquired events of the batch in one `handle_batch` call.
//!
//! When the ledger cannot be reached nothing runs and the caller pauses (no attempt is spent);
//! a ledger that answers with an error skips the handlers and naks the deliveries. While the
//! handlers run, the claims are renewed, so a live worker keeps them however long it takes and a
//! dead one's are taken over once their lease runs out; a worker that cannot renew them for most
//! of the lease, or learns they were taken over, drops the batch's work unsettled.
//!
//! A delivery whose source already holds its claim (the db backend's per-handler deliveries)
//! skips the ledger here: settling the delivery settles the claim.
//!
//! Where the source keeps no dead letters of its own (JetStream stops delivering an exhausted
//! message but records nothing), the last failed delivery of a claim this dispatcher holds (its
//! attempts spent, or a permanent failure) becomes a dead letter in the ledger instead of being
//! released, so operators find dead letters in one place on every backend. A last delivery that
//! ends with no outcome here (deferred, dropped, or its dead letter refused) is recorded from the
//! server's advisory instead ([`crate::given_up`]).
//!
//! Shutdown stops a handler that takes its events one at a time between two events: the events
//! of the batch it has not started are handed back (their ledger claims released before their
//! deliveries are deferred), so a stop within the grace period keeps what finished instead of
//! losing it with the batch. How depends on the source ([`HandBack`]): on db at once, no
//! attempt spent; on JetStream, where a deferral spends a delivery, only while two are left,
//! and a few seconds later, past the stopping process's last pull; on core NATS, which cannot
//! deliver again, never (the whole batch runs).
//!
//! Each event's handling is logged in a span carrying the trace id the write stamped on the
//! event, so a handler's lines join the write's trace.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::hash::{Hash, Hasher};
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::{Duration, Instant};

use futures_util::FutureExt;

use reelay_contracts::v1::{self, ledger_claim::Outcome, ledger_client::LedgerClient};
use reelay_domain::{EventId, RetryPolicy};
use reelay_kit::client::{ServiceChannel, is_transport_failure};
use reelay_kit::metrics::{self, Counter, Gauge, Histogram};
use reelay_kit::{Backoff, Shutdown};
use tokio::sync::{mpsc, oneshot};

use crate::gather::gather;
use crate::pause::Pause;
use crate::source::{Delivery, Granted, LeaseWatch, Leased, Renewal, ServerLease, while_renewing};
use crate::{Handler, HandlerError, handle_in_span};

/// Keys per Ledger call (the server's limit).
const LEDGER_BATCH: usize = 1000;
/// Dead letters per ledger call: each carries its error (2,000 characters, up to 8,000 bytes),
/// so 250 stay within 2 MiB, well inside a message.
const DEAD_LETTER_BATCH: usize = 250;

static DELIVERIES: LazyLock<Counter> = LazyLock::new(|| {
    metrics::counter(
        "reelay_handler_deliveries_total",
        "Deliveries of an event to a handler, by outcome: done, skipped (already done), deferred (held elsewhere, \
         or handed back unstarted at shutdown), failed (retried later) or dead_lettered (given up).",
        &["handler", "outcome"],
    )
});
static HANDLER_SECONDS: LazyLock<Histogram> = LazyLock::new(|| {
    metrics::histogram(
        "reelay_handler_batch_duration_seconds",
        "Time of one handler call over a batch of events.",
        &["handler"],
        metrics::SECONDS,
    )
});
static HANDLER_BATCH: LazyLock<Histogram> = LazyLock::new(|| {
    metrics::histogram("reelay_handler_batch_events", "Events per handler call.", &["handler"], metrics::BATCH_SIZES)
});
static HELD_FOR_DEPENDENCY: LazyLock<Gauge> = LazyLock::new(|| {
    metrics::gauge(
        "reelay_handler_events_held_for_dependency",
        "Events a handler holds, spending no attempt, while it says a dependency is unavailable \
         (non-zero for long: its provider, object store or disk is down).",
        &["handler"],
    )
});
/// A handler said a dependency was unavailable: first wait, doubling to the most.
const UNAVAILABLE_BACKOFF: Backoff = Backoff::new(Duration::from_secs(1), Duration::from_secs(30));

/// What to do with one delivery after dispatch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    Ack,
    Nak { delay: Duration, error: String },
    Defer { until_ms: i64 },
    Term { reason: String },
}

/// What a dispatch decided: one verdict per delivery, and the ledger claims to settle.
pub struct Dispatched {
    pub verdicts: Vec<Verdict>,
    pub ledger: LedgerSettlement,
}

/// Ledger claims to mark done (their handler succeeded), give up (it failed and will be
/// retried) or turn into dead letters (it failed for the last time).
#[derive(Debug, Default)]
pub struct LedgerSettlement {
    complete: Vec<v1::OwnedKey>,
    release: Vec<v1::OwnedKey>,
    dead: Vec<v1::LedgerDeadLetter>,
    /// The batch's pairs stay in the process's hand until they are settled.
    in_hand: Vec<Taken>,
    /// Some of the batch's deliveries are handed back unstarted.
    handed_back: bool,
}

impl LedgerSettlement {
    /// Whether the ledger must be settled before the deliveries. Dead letters must be recorded
    /// first: once the source stops delivering them, the ledger is the only record. The claims
    /// of handed-back deliveries must be released first: a delivery back before its claim is
    /// would find it held, and be deferred again (on JetStream, a delivery more spent).
    pub fn goes_first(&self) -> bool {
        !self.dead.is_empty() || self.handed_back
    }
}

/// The ledger could not be reached: nothing ran; pause and dispatch the same batch again.
#[derive(Debug, Clone, thiserror::Error)]
#[error("ledger unavailable: {0}")]
pub struct LedgerUnavailable(pub String);

/// Outcome of one (delivery, handler) pair.
#[derive(Debug, Clone)]
enum PairState {
    Skip,
    HeldUntil(i64),
    Run {
        token: Option<i64>,
    },
    Ran {
        token: Option<i64>,
        result: Result<(), HandlerError>,
    },
    /// Not started before shutdown: handed back (due again at `until_ms`), its claim released.
    HandedBack {
        token: Option<i64>,
        until_ms: i64,
    },
    LedgerError(String),
}

#[derive(Clone)]
pub struct Dispatcher {
    handlers: Vec<Arc<dyn Handler>>,
    ledger: LedgerClient<ServiceChannel>,
    claims: LedgerClaims,
    config: DispatchConfig,
    shutdown: Shutdown,
    /// What the ledger last said of this dispatcher's builds (shared by its clones).
    told: Arc<Mutex<Told>>,
}

/// What the ledger last said of a dispatcher's builds of its handlers.
#[derive(Debug, Default)]
struct Told {
    /// Why they stand by (another build of them claims), when they do.
    standing_by: Option<String>,
    /// When it was last told of them.
    at: Option<tokio::time::Instant>,
}

/// This process's build of `handler`: its name and the event types it takes.
pub fn build_of(handler: &dyn Handler) -> v1::HandlerBuild {
    v1::HandlerBuild {
        handler: handler.name().to_owned(),
        event_types: handler.event_types().iter().map(|t| t.to_string()).collect(),
    }
}

/// How long a handler standing by (another build of it claims) waits before asking again.
pub const STAND_BY_POLL: Duration = Duration::from_secs(2);

/// One ledger claim request of a dispatcher, waiting to go out with the others'.
struct ClaimAsk {
    keys: Vec<v1::LedgerKey>,
    /// The asker's builds of its handlers (see `LedgerClaimRequest.builds`).
    builds: Vec<v1::HandlerBuild>,
    /// The answers for its keys, and the lease the call's answer gave.
    reply: oneshot::Sender<Result<Leased<Answered>, tonic::Status>>,
}

/// The ledger's answer to one ask: a claim per key, and which of the asker's handlers stand by
/// (another build of them claims), with why.
#[derive(Debug, Default)]
pub struct Answered {
    pub claims: Vec<v1::LedgerClaim>,
    pub standing_by: Vec<v1::HandlerStandingBy>,
}

/// The (event, handler) pairs this process's batches have in hand (being asked of the ledger,
/// worked on, or settled), with how many batches have each. A pair is asked of the ledger only
/// by a batch that has it alone; another batch that has it too treats it as held (as the ledger
/// would: the claim is this process's own). So when a pair is asked, nothing in the process
/// runs it, and a live claim of the process's own on it can only have been made by a call whose
/// answer never came (its connection cut, the write service killed before it answered) or by
/// a batch that is gone (its work dropped, its settlement refused): the ledger hands such a
/// claim back (`resume_own`) instead of holding it against its own owner until its lease ends
/// (a delivery spent waiting, a dead letter if it was the last).
///
/// Pairs are counted by a 64-bit hash of the pair (no copies of their strings on this path):
/// two pairs that shared one would only make the later of them wait as held.
#[derive(Clone, Default)]
struct InHand(Arc<Mutex<HashMap<u64, usize>>>);

impl InHand {
    fn pair(key: &v1::LedgerKey) -> u64 {
        let mut hasher = std::hash::DefaultHasher::new();
        (&key.event_id, &key.handler).hash(&mut hasher);
        hasher.finish()
    }
}

/// One batch's pairs in the process's hand; they leave it when this is dropped (its claims
/// settled or their settling given up, its work dropped, or its claim call failed).
pub struct Taken {
    in_hand: InHand,
    keys: Vec<v1::LedgerKey>,
    /// Whether the batch has each of `keys` alone (no other batch had it when it was taken).
    alone: Vec<bool>,
    /// Whether they were asked of the ledger: once only, or two asks could be out for a pair.
    asked: AtomicBool,
}

impl Taken {
    /// For each key, whether this batch has it alone and may ask the ledger for it.
    pub fn alone(&self) -> &[bool] {
        &self.alone
    }
}

impl Drop for Taken {
    fn drop(&mut self) {
        let mut held = self.in_hand.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        for key in &self.keys {
            if let Entry::Occupied(mut batches) = held.entry(InHand::pair(key)) {
                *batches.get_mut() -= 1;
                if *batches.get() == 0 {
                    batches.remove();
                }
            }
        }
    }
}

impl std::fmt::Debug for Taken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Taken").field("keys", &self.keys.len()).finish()
    }
}

/// The ledger claims of every dispatcher of this process: those asked at the same time (the
/// handlers one message reaches, each through its own consumer) go out as one `Claim` call of
/// at most the server's limit of keys, one write job and one answer in the write service
/// instead of one per handler. Cheap to clone.
#[derive(Clone)]
pub struct LedgerClaims {
    asks: mpsc::UnboundedSender<ClaimAsk>,
    /// The lease the ledger's answers give the claims.
    lease: ServerLease,
    in_hand: InHand,
}

impl LedgerClaims {
    /// Claims as `owner` (`<instance>#<incarnation>` of this process).
    pub fn start(channel: ServiceChannel, owner: String) -> Self {
        let client = LedgerClient::new(channel);
        let split = |asks: Vec<ClaimAsk>| {
            let mut calls: Vec<(usize, Vec<ClaimAsk>)> = Vec::new();
            for ask in asks {
                match calls.last_mut() {
                    Some((keys, call)) if *keys + ask.keys.len() <= LEDGER_BATCH => {
                        *keys += ask.keys.len();
                        call.push(ask);
                    }
                    _ => calls.push((ask.keys.len(), vec![ask])),
                }
            }
            calls.into_iter().map(|(_, call)| call).collect()
        };
        let lease = ServerLease::default();
        let heard = lease.clone();
        let asks = gather(split, move |asks| claim_call(client.clone(), owner.clone(), heard.clone(), asks));
        Self { asks, lease, in_hand: InHand::default() }
    }

    /// Takes `keys` in the process's hand for one batch (see [`InHand`]): keep the result until
    /// their claims are settled or their work is dropped, and ask the ledger for the keys the
    /// batch has alone with [`LedgerClaims::claim`].
    pub fn take(&self, keys: Vec<v1::LedgerKey>) -> Taken {
        let mut held = self.in_hand.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let alone = keys
            .iter()
            .map(|key| {
                let batches = held.entry(InHand::pair(key)).or_default();
                *batches += 1;
                *batches == 1
            })
            .collect();
        Taken { in_hand: self.in_hand.clone(), keys, alone, asked: AtomicBool::new(false) }
    }

    /// The ledger's answer for each key `taken` has alone (at most the server's limit), in
    /// order, and the lease it gave the claims; `builds` are the asker's builds of the keys'
    /// handlers. No call when it has none alone. Once per `taken` (FailedPrecondition after).
    pub async fn claim(&self, taken: &Taken, builds: Vec<v1::HandlerBuild>) -> Result<Leased<Answered>, tonic::Status> {
        if taken.asked.swap(true, Ordering::SeqCst) {
            return Err(tonic::Status::failed_precondition("these pairs were asked for already; take them again"));
        }
        let keys: Vec<v1::LedgerKey> =
            taken.keys.iter().zip(&taken.alone).filter(|(_, alone)| **alone).map(|(key, _)| key.clone()).collect();
        if keys.is_empty() {
            return Ok((Answered::default(), None));
        }
        self.ask(keys, builds).await
    }

    /// Whether the `builds` stand by (a claim of no key).
    pub async fn standing_by(
        &self,
        builds: Vec<v1::HandlerBuild>,
    ) -> Result<Vec<v1::HandlerStandingBy>, tonic::Status> {
        Ok(self.ask(Vec::new(), builds).await?.0.standing_by)
    }

    async fn ask(
        &self,
        keys: Vec<v1::LedgerKey>,
        builds: Vec<v1::HandlerBuild>,
    ) -> Result<Leased<Answered>, tonic::Status> {
        let stopped = || tonic::Status::unavailable("the ledger claimer stopped");
        let (reply, answer) = oneshot::channel();
        self.asks.send(ClaimAsk { keys, builds, reply }).map_err(|_| stopped())?;
        answer.await.map_err(|_| stopped())?
    }
}

/// One `Claim` call for several asks; each hears the answers for its own keys.
async fn claim_call(
    mut client: LedgerClient<ServiceChannel>,
    owner: String,
    lease: ServerLease,
    mut asks: Vec<ClaimAsk>,
) {
    // An asker that stopped waiting (its batch dropped) has let its pairs go: asking for them
    // anyway could hold them against a batch that has taken them since, in this same call.
    asks.retain(|ask| !ask.reply.is_closed());
    if asks.is_empty() {
        return;
    }
    let keys = asks.iter().flat_map(|ask| ask.keys.iter().cloned()).collect();
    let mut builds: Vec<v1::HandlerBuild> = Vec::new();
    for build in asks.iter().flat_map(|ask| &ask.builds) {
        if !builds.iter().any(|b| b.handler == build.handler) {
            builds.push(build.clone());
        }
    }
    // Every key asked is one its batch has alone (see `InHand`).
    match client.claim(v1::LedgerClaimRequest { keys, owner, resume_own: true, builds }).await {
        Ok(answer) => {
            let answer = answer.into_inner();
            let granted = lease.heard(answer.lease_ms);
            let mut claims = answer.claims.into_iter();
            for ask in asks {
                let claims = claims.by_ref().take(ask.keys.len()).collect();
                let standing_by = answer
                    .standing_by
                    .iter()
                    .filter(|s| ask.builds.iter().any(|b| b.handler == s.handler))
                    .cloned()
                    .collect();
                let _ = ask.reply.send(Ok((Answered { claims, standing_by }, granted)));
            }
        }
        Err(status) => {
            for ask in asks {
                let _ = ask.reply.send(Err(status.clone()));
            }
        }
    }
}

/// How a dispatcher runs handlers and holds their claims.
#[derive(Debug, Clone)]
pub struct DispatchConfig {
    /// A handler's run of one event (of a batch, for a handler that batches) that takes longer
    /// fails (retryable).
    pub handler_timeout: Duration,
    pub retry_policy: RetryPolicy,
    /// Claims are renewed every third of this while handlers run (or of the write service's
    /// lease, when its claim answers say it is shorter).
    pub ledger_lease: Duration,
    /// Deliveries of one event before it is given up (`EVENT_QUEUE_MAX_ATTEMPTS`).
    pub max_attempts: u32,
    /// The source keeps no dead letters (JetStream): record the last failed delivery of a
    /// claim this dispatcher holds as a dead letter in the ledger.
    pub record_dead_letters: bool,
    /// What handing a delivery back costs on the source.
    pub hand_back: HandBack,
    /// How long a batch's events are held, spending no attempt, while their handler says a
    /// dependency is unavailable (`REELAY_HANDLER_UNAVAILABLE_WAIT_MS`); past it they fail as
    /// any retryable failure does.
    pub unavailable_wait: Duration,
}

/// What handing a delivery back (deferring it) costs on a source, and so whether the
/// dispatcher does it: at shutdown for the events a handler has not started, and while another
/// build of its handlers claims (it then stands by instead of fetching).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HandBack {
    /// The source cannot deliver again what is handed back (core NATS): never.
    Never,
    /// A deferral spends no attempt (db): at once.
    Free,
    /// A deferral spends a delivery (JetStream): at shutdown only while at least two are left
    /// (one more deferral, should the claim still be held then, cannot use up the last), and
    /// due `after` from then, past the stopping process's last pull.
    SpendsDelivery { after: Duration },
}

impl DispatchConfig {
    /// Whether a failed run of this delivery is its last.
    fn is_last(&self, attempt: u32, error: &HandlerError) -> bool {
        matches!(error, HandlerError::Permanent(_)) || attempt >= self.max_attempts
    }

    /// Whether the source delivers again what is handed back: only then does the dispatcher
    /// tell the ledger this process's builds of its handlers and stand by while another build
    /// of them claims.
    fn redelivers(&self) -> bool {
        self.hand_back != HandBack::Never
    }

    /// Whether a delivery on its `attempt` may be handed back unstarted at shutdown.
    fn may_hand_back(&self, attempt: u32) -> bool {
        match self.hand_back {
            HandBack::Never => false,
            HandBack::Free => true,
            HandBack::SpendsDelivery { .. } => attempt.saturating_add(2) <= self.max_attempts,
        }
    }

    /// When a delivery handed back now is due again (ms).
    fn handed_back_due(&self) -> i64 {
        match self.hand_back {
            HandBack::SpendsDelivery { after } => reelay_kit::now_ms() + after.as_millis() as i64,
            HandBack::Never | HandBack::Free => reelay_kit::now_ms(),
        }
    }
}

/// Declares the dispatch metrics, so they are scraped before the first delivery.
pub fn register_metrics() {
    for metric in [&HANDLER_SECONDS, &HANDLER_BATCH] {
        LazyLock::force(metric);
    }
    LazyLock::force(&DELIVERIES);
}

impl Dispatcher {
    /// `claims` is shared by the dispatchers of this process (see [`LedgerClaims`]).
    pub fn new(
        handlers: Vec<Arc<dyn Handler>>,
        ledger: ServiceChannel,
        claims: LedgerClaims,
        config: DispatchConfig,
        shutdown: Shutdown,
    ) -> Self {
        for handler in &handlers {
            for outcome in Self::OUTCOMES {
                DELIVERIES.declare(&[handler.name(), outcome]);
            }
            HELD_FOR_DEPENDENCY.add(&[handler.name()], 0.0);
        }
        Self { handlers, ledger: LedgerClient::new(ledger), claims, config, shutdown, told: Arc::default() }
    }

    fn told(&self) -> std::sync::MutexGuard<'_, Told> {
        self.told.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Why this dispatcher's handlers stand by, if the ledger's last word was that they do: the
    /// consumer then fetches nothing (it would only hand the messages back, spending a delivery
    /// of each) and asks again with [`Dispatcher::ask_standing_by`].
    pub fn standing_by(&self) -> Option<String> {
        self.told().standing_by.clone()
    }

    /// Whether the ledger should hear of this dispatcher's builds again: a build not heard from
    /// for a few leases counts as gone, so an idle one (no claim, no ledger claim) tells it
    /// every quarter lease. Never, for a source that does not tell builds.
    pub fn due_to_tell(&self) -> bool {
        let every = self.claims.lease.bound(self.config.ledger_lease) / 4;
        self.config.redelivers() && self.told().at.is_none_or(|at| at.elapsed() >= every)
    }

    /// Asks the ledger whether this dispatcher's handlers still stand by (telling it of their
    /// builds).
    pub async fn ask_standing_by(&self) -> Result<Option<String>, LedgerUnavailable> {
        if !self.config.redelivers() {
            return Ok(None);
        }
        match self.claims.standing_by(self.builds()).await {
            Ok(standing_by) => Ok(self.heard(&standing_by)),
            Err(status) if is_transport_failure(&status) => Err(LedgerUnavailable(status.message().to_owned())),
            // An older write service (it refuses a claim of no key): nothing stands by there.
            Err(status) if matches!(status.code(), tonic::Code::InvalidArgument | tonic::Code::Unimplemented) => {
                Ok(self.heard(&[]))
            }
            // Any other refusal (an internal error, a token being rotated) says nothing of who
            // stands by; taken as "nobody", the messages of types only another build takes
            // would be acked here unhandled. Wait and ask again, as for an unreachable ledger.
            Err(status) => {
                Err(LedgerUnavailable(format!("asking who stands by: {:?}: {}", status.code(), status.message())))
            }
        }
    }

    /// This dispatcher's builds of its handlers: the event types each takes.
    fn builds(&self) -> Vec<v1::HandlerBuild> {
        if !self.config.redelivers() {
            return Vec::new();
        }
        self.handlers.iter().map(|h| build_of(h.as_ref())).collect()
    }

    /// Notes what the ledger said of this dispatcher's handlers standing by; returns why.
    fn heard(&self, standing_by: &[v1::HandlerStandingBy]) -> Option<String> {
        let why = (!standing_by.is_empty())
            .then(|| standing_by.iter().map(|s| s.why.as_str()).collect::<Vec<_>>().join("; "));
        let mut told = self.told();
        told.standing_by.clone_from(&why);
        told.at = Some(tokio::time::Instant::now());
        why
    }

    pub fn handler_names(&self) -> Vec<&'static str> {
        self.handlers.iter().map(|h| h.name()).collect()
    }

    /// Claims, runs the handlers, and returns each delivery's verdict together with the ledger
    /// claims still to settle (see [`Dispatcher::settle_ledger`]), so the caller can settle the
    /// ledger and the deliveries at the same time (the write service commits them together).
    pub async fn dispatch<T>(&mut self, deliveries: &[Delivery<T>]) -> Result<Option<Dispatched>, LedgerUnavailable> {
        // pairs[d] lists (handler index, state) for delivery d.
        let mut pairs: Vec<Vec<(usize, PairState)>> = deliveries
            .iter()
            .map(|d| {
                let event_type = d.event.event_type.as_str();
                self.handlers
                    .iter()
                    .enumerate()
                    .filter(|(_, h)| h.subscribes_to(event_type))
                    .map(|(i, _)| (i, PairState::Run { token: None }))
                    .collect()
            })
            .collect();

        let asked = tokio::time::Instant::now();
        let (granted, in_hand, heard) = self.claim(deliveries, &mut pairs).await?;
        // A message none of the handlers takes came on their consumer because another build
        // of them takes its type (it added the subject): while that build claims, it is its,
        // not to be acked here. The claim's answer says whether they stand by; without one
        // (nothing else in the batch) the ledger is asked, no claim being held then.
        let not_taken: Vec<usize> =
            (0..deliveries.len()).filter(|&d| deliveries[d].claimed.is_none() && pairs[d].is_empty()).collect();
        let mut left = None;
        if !not_taken.is_empty() {
            let standing_by = if heard { self.standing_by() } else { self.ask_standing_by().await? };
            left = standing_by.map(|_| reelay_kit::now_ms() + STAND_BY_POLL.as_millis() as i64);
        }
        let held = self.held_claims(deliveries, &pairs);
        let work = self.run_handlers(deliveries, &mut pairs);
        if with_renewals(self, &held, asked, granted, work).await.is_none() {
            return Ok(None);
        }
        let ledger = LedgerSettlement { in_hand, ..self.ledger_settlement(deliveries, &pairs) };
        self.count_outcomes(deliveries, &pairs);
        let mut verdicts: Vec<Verdict> =
            deliveries.iter().zip(&pairs).map(|(d, p)| verdict(d, p, self.config.retry_policy)).collect();
        if let Some(until_ms) = left {
            for d in not_taken {
                verdicts[d] = Verdict::Defer { until_ms };
            }
        }
        Ok(Some(Dispatched { verdicts, ledger }))
    }

    /// Every outcome [`Self::count_outcomes`] counts (`deferred` includes events handed back
    /// unstarted at shutdown).
    const OUTCOMES: [&str; 5] = ["done", "skipped", "deferred", "failed", "dead_lettered"];

    /// Counts each (delivery, handler) pair by what became of it.
    fn count_outcomes<T>(&self, deliveries: &[Delivery<T>], pairs: &[Vec<(usize, PairState)>]) {
        for (delivery, ps) in deliveries.iter().zip(pairs) {
            for (h, state) in ps {
                let outcome = match state {
                    PairState::Skip => "skipped",
                    PairState::HeldUntil(_) | PairState::HandedBack { .. } => "deferred",
                    PairState::Ran { result: Ok(()), .. } => "done",
                    PairState::Ran { result: Err(error), .. } if self.config.is_last(delivery.attempt, error) => {
                        "dead_lettered"
                    }
                    PairState::Ran { .. } | PairState::LedgerError(_) | PairState::Run { .. } => "failed",
                };
                DELIVERIES.inc(&[self.handlers[*h].name(), outcome]);
            }
        }
    }

    /// Asks the ledger about every pair of a delivery that has an event id; returns the lease
    /// its answers gave the claims, and the pairs' place in the process's hand.
    async fn claim<T>(
        &mut self,
        deliveries: &[Delivery<T>],
        pairs: &mut [Vec<(usize, PairState)>],
    ) -> Result<(Option<Duration>, Vec<Taken>, bool), LedgerUnavailable> {
        let mut index = Vec::new();
        let mut keys = Vec::new();
        for (d, delivery) in deliveries.iter().enumerate() {
            if delivery.claimed.is_some() {
                continue;
            }
            let Some(event_id) = deduplicable(delivery) else { continue };
            for (p, (h, _)) in pairs[d].iter().enumerate() {
                index.push((d, p));
                keys.push(v1::LedgerKey {
                    event_id: event_id.to_owned(),
                    handler: self.handlers[*h].name().to_owned(),
                });
            }
        }
        let (mut granted, mut in_hand, mut heard) = (Granted::default(), Vec::new(), false);
        for (chunk_index, chunk_keys) in index.chunks(LEDGER_BATCH).zip(keys.chunks(LEDGER_BATCH)) {
            let taken = self.claims.take(chunk_keys.to_vec());
            let claims = match self.claims.claim(&taken, self.builds()).await {
                Ok((answered, lease)) => {
                    granted.add(lease);
                    // Keys of a handler standing by come back held for a short while. (The
                    // ledger was asked when the batch had any of them alone.)
                    if taken.alone().contains(&true) {
                        self.heard(&answered.standing_by);
                        heard = true;
                    }
                    answered.claims
                }
                Err(status) if is_transport_failure(&status) => {
                    return Err(LedgerUnavailable(status.message().to_owned()));
                }
                Err(status) => {
                    tracing::error!(code = ?status.code(), error = status.message(), "ledger refused a claim; skipping the handlers");
                    for &(d, p) in chunk_index {
                        pairs[d][p].1 = PairState::LedgerError(status.message().to_owned());
                    }
                    continue;
                }
            };
            // A pair another batch of this process has is held by this process's claim.
            let held_until =
                reelay_kit::now_ms() + self.claims.lease.bound(self.config.ledger_lease).as_millis() as i64;
            let mut claims = claims.into_iter();
            for (&(d, p), &alone) in chunk_index.iter().zip(taken.alone()) {
                if !alone {
                    pairs[d][p].1 = PairState::HeldUntil(held_until);
                    continue;
                }
                pairs[d][p].1 = match claims.next().and_then(|claim| claim.outcome) {
                    Some(Outcome::AcquiredToken(token)) => PairState::Run { token: Some(token) },
                    Some(Outcome::Done(_)) => PairState::Skip,
                    Some(Outcome::HeldUntilMs(until)) => PairState::HeldUntil(until),
                    None => PairState::LedgerError("the ledger answered without an outcome".into()),
                };
            }
            in_hand.push(taken);
        }
        Ok((granted.lease(), in_hand, heard))
    }

    /// Runs each handler once over all its runnable events, handlers concurrently.
    async fn run_handlers<T>(&self, deliveries: &[Delivery<T>], pairs: &mut [Vec<(usize, PairState)>]) {
        let runs = self.handlers.iter().enumerate().map(|(h, handler)| {
            let work: Vec<(usize, usize)> = pairs
                .iter()
                .enumerate()
                .flat_map(|(d, ps)| {
                    ps.iter()
                        .enumerate()
                        .filter(move |(_, (hi, s))| *hi == h && matches!(s, PairState::Run { .. }))
                        .map(move |(p, _)| (d, p))
                })
                .collect();
            let handler = handler.clone();
            let timeout = self.config.handler_timeout;
            async move {
                if work.is_empty() {
                    return (h, work, Vec::new());
                }
                let events: Vec<&v1::Event> = work.iter().map(|&(d, _)| &deliveries[d].event).collect();
                let stop = Stop {
                    shutdown: &self.shutdown,
                    may_hand_back: work
                        .iter()
                        .map(|&(d, _)| self.config.may_hand_back(deliveries[d].attempt))
                        .collect(),
                };
                let started = Instant::now();
                let mut results = run_handler(&*handler, &events, timeout, &stop).await;
                HANDLER_SECONDS.observe_duration(&[handler.name()], started.elapsed());
                let ran = results.iter().filter(|result| result.is_some()).count();
                HANDLER_BATCH.observe(&[handler.name()], ran as f64);
                let wait = self.config.unavailable_wait;
                wait_out_unavailable(&*handler, &events, &mut results, timeout, &stop, wait).await;
                (h, work, results)
            }
        });
        for (h, work, results) in futures_util::future::join_all(runs).await {
            let name = self.handlers[h].name();
            let mut handed_back = 0;
            for ((d, p), result) in work.into_iter().zip(results) {
                let PairState::Run { token } = pairs[d][p].1 else { unreachable!("only runnable pairs were run") };
                let delivery = &deliveries[d];
                let Some(result) = result else {
                    handed_back += 1;
                    pairs[d][p].1 = PairState::HandedBack { token, until_ms: self.config.handed_back_due() };
                    continue;
                };
                let span = event_span(&delivery.event, name);
                let _entered = span.enter();
                match &result {
                    Ok(()) => tracing::debug!(attempt = delivery.attempt, "event handled"),
                    Err(error) => tracing::warn!(attempt = delivery.attempt, %error, "handler failed"),
                }
                pairs[d][p].1 = PairState::Ran { token, result };
            }
            if handed_back > 0 {
                tracing::info!(
                    handler = name,
                    events = handed_back,
                    "stopping: handed back the events not yet started (their claims released); they are delivered again"
                );
            }
        }
    }

    /// The ledger claims this dispatcher acquired for the batch (not those its source holds).
    fn held_claims<T>(&self, deliveries: &[Delivery<T>], pairs: &[Vec<(usize, PairState)>]) -> Vec<v1::OwnedKey> {
        let mut held = Vec::new();
        for (d, ps) in pairs.iter().enumerate() {
            for (h, state) in ps {
                if let PairState::Run { token: Some(token) } = state {
                    held.push(self.claim_of(&deliveries[d], *h, *token));
                }
            }
        }
        held
    }

    /// The ledger claim, under `token`, of `delivery`'s event for handler `h`.
    fn claim_of<T>(&self, delivery: &Delivery<T>, h: usize, token: i64) -> v1::OwnedKey {
        let key = v1::LedgerKey {
            event_id: delivery.event_id.clone().unwrap_or_default(),
            handler: self.handlers[h].name().to_owned(),
        };
        v1::OwnedKey { key: Some(key), token }
    }

    /// Renews claims that are still being worked on.
    async fn renew(&self, held: &[v1::OwnedKey]) -> Renewal {
        let (mut lost_any, mut granted) = (false, Granted::default());
        for chunk in held.chunks(LEDGER_BATCH) {
            match self.ledger.clone().renew(v1::LedgerSettleRequest { keys: chunk.to_vec() }).await {
                Ok(reply) => {
                    let reply = reply.into_inner();
                    granted.add(self.claims.lease.heard(reply.lease_ms));
                    let lost = reply.owned.iter().filter(|owned| !**owned).count();
                    if lost > 0 {
                        tracing::warn!(claims = lost, "ledger claims lost while their handlers were still running");
                        lost_any = true;
                    }
                }
                Err(status) => {
                    tracing::warn!(error = status.message(), "could not renew ledger claims");
                    return Renewal::Unanswered;
                }
            }
        }
        if lost_any { Renewal::Lost } else { Renewal::Held(granted.lease()) }
    }

    /// The claims to complete (handler succeeded), to release (it failed) and to dead-letter
    /// (it failed for the last time, where the source keeps no dead letters).
    fn ledger_settlement<T>(&self, deliveries: &[Delivery<T>], pairs: &[Vec<(usize, PairState)>]) -> LedgerSettlement {
        let (mut complete, mut release, mut dead) = (Vec::new(), Vec::new(), Vec::new());
        let mut handed_back = false;
        for (d, ps) in pairs.iter().enumerate() {
            for (h, state) in ps {
                if let PairState::HandedBack { token, .. } = state {
                    handed_back = true;
                    release.extend(token.map(|token| self.claim_of(&deliveries[d], *h, token)));
                }
                if let PairState::Ran { token: Some(token), result } = state {
                    let owned = self.claim_of(&deliveries[d], *h, *token);
                    match result {
                        Ok(()) => complete.push(owned),
                        Err(error)
                            if self.config.record_dead_letters && self.config.is_last(deliveries[d].attempt, error) =>
                        {
                            dead.push(v1::LedgerDeadLetter {
                                key: Some(owned),
                                attempts: deliveries[d].attempt,
                                error: reelay_domain::clip_error(&error.to_string()),
                            });
                        }
                        Err(_) => release.push(owned),
                    }
                }
            }
        }
        LedgerSettlement { complete, release, dead, in_hand: Vec::new(), handed_back }
    }

    /// Completes the claims of handlers that succeeded, records the dead letters and releases
    /// the others. The effects happened, so this is retried until the ledger answers (or the
    /// process stops; the claims then expire and the idempotent handlers run again).
    pub async fn settle_ledger(&mut self, settlement: LedgerSettlement) {
        let LedgerSettlement { complete, release, dead, in_hand, .. } = settlement;
        let mut given_up = false;
        for chunk in dead.chunks(DEAD_LETTER_BATCH) {
            let owned = self
                .until_answered("dead-letter", |mut ledger| {
                    let dead_letters = chunk.to_vec();
                    async move { ledger.dead_letter(v1::LedgerDeadLetterRequest { dead_letters }).await }
                })
                .await;
            let keys: Vec<&v1::OwnedKey> = chunk.iter().filter_map(|d| d.key.as_ref()).collect();
            given_up |= owned.is_none();
            warn_lost(&keys, owned);
        }
        for (keys, completing) in [(complete, true), (release, false)] {
            for chunk in keys.chunks(LEDGER_BATCH) {
                let owned = self
                    .until_answered(if completing { "complete" } else { "release" }, |mut ledger| {
                        let request = v1::LedgerSettleRequest { keys: chunk.to_vec() };
                        async move {
                            if completing { ledger.complete(request).await } else { ledger.release(request).await }
                        }
                    })
                    .await;
                given_up |= owned.is_none();
                warn_lost(&chunk.iter().collect::<Vec<_>>(), owned);
            }
        }
        // The pairs leave the process's hand once settled. A settlement given up may still
        // reach the ledger later (a call cut off by shutdown): its pairs stay in hand until
        // their claims have run out, so none of them is handed back to this process under the
        // token that late call names (a late release would free a claim a new run holds).
        if given_up {
            let lease = self.claims.lease.bound(self.config.ledger_lease);
            tokio::spawn(async move {
                tokio::time::sleep(lease).await;
                drop(in_hand);
            });
        }
    }

    /// Calls the ledger until it answers (pausing while it is unreachable) or refuses; `None`
    /// when it refused or the process is stopping.
    async fn until_answered<F, Fut>(&self, what: &'static str, mut call: F) -> Option<Vec<bool>>
    where
        F: FnMut(LedgerClient<ServiceChannel>) -> Fut,
        Fut: Future<Output = Result<tonic::Response<v1::LedgerSettleResponse>, tonic::Status>>,
    {
        let mut pause = Pause::new("ledger");
        loop {
            match call(self.ledger.clone()).await {
                Ok(reply) => {
                    pause.resumed();
                    return Some(reply.into_inner().owned);
                }
                Err(status) if is_transport_failure(&status) && !self.shutdown.is_requested() => {
                    pause.wait(status.message()).await;
                }
                Err(status) => {
                    tracing::error!(code = ?status.code(), error = status.message(), what,
                        "could not settle ledger claims; they will expire and be taken over");
                    return None;
                }
            }
        }
    }
}

/// A handler call that did not return.
#[derive(Debug, thiserror::Error)]
enum Unfinished {
    /// It panicked, with this message.
    #[error("it panicked: {0}")]
    Panicked(String),
    #[error("it timed out after {0:?}")]
    TimedOut(Duration),
}

/// Either is a failed attempt, to be retried: it spends an attempt, so an event that always
/// panics ends as a dead letter instead of coming back after every lease.
impl From<Unfinished> for HandlerError {
    fn from(unfinished: Unfinished) -> Self {
        match unfinished {
            Unfinished::Panicked(message) => HandlerError::Retryable(format!("handler panicked: {message}")),
            Unfinished::TimedOut(timeout) => HandlerError::Retryable(format!("handler timed out after {timeout:?}")),
        }
    }
}

/// When a handler taking events one at a time stops between two of them.
struct Stop<'a> {
    shutdown: &'a Shutdown,
    /// For each event, whether it may be handed back unstarted once shutdown is asked.
    may_hand_back: Vec<bool>,
}

/// Runs `handler` over `events`, one result per event in order (`None`: not started, handed
/// back). A handler that batches gets them in one call within `timeout`; should that call
/// panic or time out, which event it was is not known, so each runs again alone (handlers are
/// idempotent), and only the one at fault spends an attempt: its batch-mates are neither failed
/// with it nor brought back with it as the same batch, again and again, until all are dead
/// letters. Any other handler gets one event at a time, each within `timeout`; once shutdown
/// is asked, the events left that `stop` lets go are handed back instead of run.
async fn run_handler(
    handler: &dyn Handler,
    events: &[&v1::Event],
    timeout: Duration,
    stop: &Stop<'_>,
) -> Vec<Option<Result<(), HandlerError>>> {
    let all = |results: Vec<Result<(), HandlerError>>| results.into_iter().map(Some).collect();
    if handler.batches() {
        let unfinished = match guarded(timeout, handler.handle_batch(events)).await {
            Ok(results) if results.len() == events.len() => return all(results),
            Ok(results) => {
                let error = format!("handler returned {} results for {} events", results.len(), events.len());
                return all(vec![Err(HandlerError::Retryable(error)); events.len()]);
            }
            Err(unfinished) if events.len() == 1 => return vec![Some(Err(unfinished.into()))],
            Err(unfinished) => unfinished,
        };
        tracing::error!(handler = handler.name(), events = events.len(), %unfinished,
            "a handler's batch did not finish; running its events one by one");
    }
    let mut results = Vec::with_capacity(events.len());
    for (event, may_hand_back) in events.iter().zip(&stop.may_hand_back) {
        if *may_hand_back && stop.shutdown.is_requested() {
            results.push(None);
            continue;
        }
        results.push(Some(guarded(timeout, handle_in_span(handler, event)).await.unwrap_or_else(|u| Err(u.into()))));
    }
    results
}

/// Counts events as held for a dependency, in the handler's gauge, until dropped (with the
/// wait, or with the work when its claims cannot be held).
struct Held {
    handler: &'static str,
    events: usize,
}

impl Held {
    fn new(handler: &'static str, events: usize) -> Self {
        HELD_FOR_DEPENDENCY.add(&[handler], events as f64);
        Self { handler, events }
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        HELD_FOR_DEPENDENCY.add(&[self.handler], -(self.events as f64));
    }
}

/// Whether a result says the handler's dependency is unavailable.
fn unavailable(result: &Option<Result<(), HandlerError>>) -> Option<&str> {
    match result {
        Some(Err(HandlerError::Unavailable(error))) => Some(error),
        _ => None,
    }
}

/// Calls `handler` again, backing off, on the events whose `results` say a dependency of it is
/// unavailable, until it answers otherwise for each, the wait is over or shutdown is asked. The
/// events stay in hand meanwhile (the caller renews their claims and reports them in
/// progress), so an outage spends none of their attempts. Each round sends one held event
/// first, a different one each round, and the others only once it passes, so a dependency that
/// is down is asked once a round. An event that still says it is down in the round the
/// dependency answered just before is down alone (a failure of its own said wrongly, or a
/// dependency failing again at once): it is let go, so its batch-mates' outcomes are not held
/// up by it until the wait ends. What is still unavailable at the end is a retryable failure,
/// except that at shutdown what `stop` lets go is handed back (`None`). Each call has
/// `timeout`; the wait lasts at most `wait` from the first answer.
async fn wait_out_unavailable(
    handler: &dyn Handler,
    events: &[&v1::Event],
    results: &mut [Option<Result<(), HandlerError>>],
    timeout: Duration,
    stop: &Stop<'_>,
    wait: Duration,
) {
    // Nothing to hold (nearly every call): no allocation.
    let Some(first) = results.iter().position(|result| unavailable(result).is_some()) else { return };
    if wait.is_zero() {
        return;
    }
    let mut left: Vec<usize> = (first..results.len()).filter(|&i| unavailable(&results[i]).is_some()).collect();
    let (name, mut backoff) = (handler.name(), UNAVAILABLE_BACKOFF);
    let deadline = tokio::time::Instant::now() + wait;
    tracing::warn!(
        handler = name,
        events = left.len(),
        error = unavailable(&results[first]).unwrap_or_default(),
        wait_ms = wait.as_millis() as u64,
        "a dependency of the handler is unavailable: holding its events and trying again (no attempt is spent)"
    );
    let _held = Held::new(name, left.len());
    let mut let_go = 0;
    for round in 0.. {
        if left.is_empty() {
            break;
        }
        let slept = tokio::time::timeout_at(deadline, stop.shutdown.unless_requested(backoff.sleep())).await;
        if !matches!(slept, Ok(Some(true))) {
            break;
        }
        let probe = left[round % left.len()];
        run_again(handler, events, results, &[probe], timeout, stop).await;
        // Only a pass says the dependency answers: a probe that timed out or failed otherwise
        // (or was handed back) leaves the hold, and the others wait for the next round.
        // Once it passes, every held event has run again and the hold is over: those still
        // saying "down" are let go.
        if matches!(results[probe], Some(Ok(()))) {
            let others: Vec<usize> = left.iter().copied().filter(|&i| i != probe).collect();
            run_again(handler, events, results, &others, timeout, stop).await;
            let_go = others.into_iter().filter(|&i| unavailable(&results[i]).is_some()).count();
            left.clear();
            break;
        }
        left.retain(|&i| unavailable(&results[i]).is_some());
    }
    if let_go > 0 {
        tracing::warn!(
            handler = name,
            events = let_go,
            "events still said the handler's dependency was down while it answered others: they fail as a retryable failure (an attempt spent)"
        );
    }
    if left.is_empty() {
        if let_go == 0 {
            tracing::info!(
                handler = name,
                tries = backoff.retries(),
                "the handler's dependency answers again; its held events ran"
            );
        }
        return;
    }
    let stopping = stop.shutdown.is_requested();
    if stopping {
        for &i in &left {
            if stop.may_hand_back[i] {
                results[i] = None;
            }
        }
    }
    let failed = left.iter().filter(|&&i| results[i].is_some()).count();
    tracing::warn!(
        handler = name,
        stopping,
        handed_back = left.len() - failed,
        failed,
        "stopped waiting for the handler's dependency (the wait is over, or the process is stopping): the events still held are handed back, or fail as a retryable failure"
    );
}

/// Runs `handler` again on the events at `indices`, putting their results in place.
async fn run_again(
    handler: &dyn Handler,
    events: &[&v1::Event],
    results: &mut [Option<Result<(), HandlerError>>],
    indices: &[usize],
    timeout: Duration,
    stop: &Stop<'_>,
) {
    if indices.is_empty() {
        return;
    }
    let again: Vec<&v1::Event> = indices.iter().map(|&i| events[i]).collect();
    let stop =
        Stop { shutdown: stop.shutdown, may_hand_back: indices.iter().map(|&i| stop.may_hand_back[i]).collect() };
    for (&i, result) in indices.iter().zip(run_handler(handler, &again, timeout, &stop).await) {
        results[i] = result;
    }
}

/// Runs a handler call within `timeout`, a panic in it caught.
async fn guarded<T>(timeout: Duration, call: impl Future<Output = T>) -> Result<T, Unfinished> {
    match tokio::time::timeout(timeout, AssertUnwindSafe(call).catch_unwind()).await {
        Ok(Ok(output)) => Ok(output),
        Ok(Err(panic)) => {
            let message = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic without a message".into());
            Err(Unfinished::Panicked(message))
        }
        Err(_) => Err(Unfinished::TimedOut(timeout)),
    }
}

/// Logs the claims a settle found taken over by a newer claim.
fn warn_lost(keys: &[&v1::OwnedKey], owned: Option<Vec<bool>>) {
    for (key, owned) in keys.iter().zip(owned.unwrap_or_default()) {
        if !owned {
            let key = key.key.as_ref().expect("built by the dispatcher");
            tracing::warn!(event_id = %key.event_id, handler = %key.handler,
                "claim lost: a newer claim took this event over; leaving it to its owner");
        }
    }
}

/// Runs `work` while renewing `held` claims every third of the lease. The work is dropped
/// (`None`) once the claims cannot be held: a renewal says some were taken over, or none
/// succeeded for five sixths of the lease (a worker cut off from the ledger stops before anyone
/// else can be handed its events; see [`LeaseWatch`]).
async fn with_renewals<F: Future>(
    dispatcher: &Dispatcher,
    held: &[v1::OwnedKey],
    asked: tokio::time::Instant,
    granted: Option<Duration>,
    work: F,
) -> Option<F::Output> {
    if held.is_empty() {
        return Some(work.await);
    }
    // The claims were asked for at `asked`: the ledger made them no earlier, under `granted`.
    let own = dispatcher.config.ledger_lease;
    let watch = LeaseWatch::start(own, dispatcher.claims.lease.clone(), asked, granted);
    let mut since = asked;
    while_renewing(work, own / 3, &mut Some(watch), &mut since, || dispatcher.renew(held)).await
}

/// The span one event's handling is logged in: the handler, the event, and the trace id the
/// write stamped on the event (its `traceparent`), so the write's and the handlers' lines for
/// one event share a trace id.
pub fn event_span(event: &v1::Event, handler: &str) -> tracing::Span {
    tracing::info_span!("handle", handler, event_id = %event.event_id, event_type = %event.event_type, trace_id = %trace_id(&event.traceparent))
}

/// The trace id of a W3C `traceparent` (`00-<trace id>-<parent id>-<flags>`), or "".
pub fn trace_id(traceparent: &str) -> &str {
    let mut parts = traceparent.split('-');
    match (parts.next(), parts.next()) {
        (Some("00"), Some(id)) if id.len() == 32 && id.bytes().all(|b| b.is_ascii_hexdigit()) => id,
        _ => "",
    }
}

/// The event id to deduplicate on; `None` for foreign rows, which are delivered without dedup.
fn deduplicable<T>(delivery: &Delivery<T>) -> Option<&str> {
    let id = delivery.event_id.as_deref()?;
    // As the ledger takes keys: a UUID in its one spelling (lowercase, hyphenated). Another
    // spelling (a foreign publisher's) refused there would fail the whole merged claim call,
    // other batches' keys and asks of who stands by with it.
    if !EventId::parse("event_id", id).is_ok_and(|parsed| parsed.to_string() == id) {
        tracing::warn!(event_id = id, "event id is not a UUID in its canonical spelling; delivering without dedup");
        return None;
    }
    Some(id)
}

/// A delivery's verdict from its pairs' states. Every process's dispatchers have one handler
/// each; with several, one's failure would settle the delivery for all (those held or handed
/// back included).
fn verdict<T>(delivery: &Delivery<T>, pairs: &[(usize, PairState)], policy: RetryPolicy) -> Verdict {
    let mut held: Option<i64> = None;
    let mut retry: Option<String> = None;
    for (_, state) in pairs {
        match state {
            PairState::Ran { result: Err(HandlerError::Permanent(reason)), .. } => {
                return Verdict::Term { reason: reason.clone() };
            }
            PairState::Ran {
                result: Err(HandlerError::Retryable(error) | HandlerError::Unavailable(error)), ..
            } => retry = Some(error.clone()),
            PairState::LedgerError(error) => retry = Some(format!("ledger error: {error}")),
            PairState::HeldUntil(until) | PairState::HandedBack { until_ms: until, .. } => {
                held = Some(held.map_or(*until, |h| h.min(*until)));
            }
            PairState::Skip | PairState::Ran { result: Ok(()), .. } => {}
            PairState::Run { .. } => unreachable!("every runnable pair ran"),
        }
    }
    match (retry, held) {
        (Some(error), _) => Verdict::Nak { delay: policy.delay(delivery.attempt), error },
        (None, Some(until_ms)) => Verdict::Defer { until_ms },
        (None, None) => Verdict::Ack,
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;
    use std::sync::atomic::AtomicUsize;

    use super::*;

    /// Only an event id in the ledger's one spelling is claimed by; another spelling would be
    /// refused there, failing the whole merged claim call.
    #[test]
    fn only_canonical_event_ids_are_claimed_by() {
        let id = "01a242f5-6b87-7089-b22a-188c0639a9c6";
        assert_eq!(deduplicable(&delivery(Some(id))), Some(id));
        for other in [id.to_uppercase(), id.replace('-', ""), format!("{{{id}}}"), "not-a-uuid".into()] {
            assert_eq!(deduplicable(&delivery(Some(&other))), None, "{other}");
        }
    }

    /// A first delivery of an empty event under `event_id`.
    fn delivery(event_id: Option<&str>) -> Delivery<()> {
        Delivery {
            event: v1::Event::default(),
            event_id: event_id.map(str::to_owned),
            attempt: 1,
            claimed: None,
            ack: crate::source::AckHandle::new(()),
        }
    }

    /// A handler whose events take as long as their payload-less `event_type` says
    /// (`"<ms>"`, or `"panic"`), and that records what it finished.
    struct Timed {
        batches: bool,
        finished: Mutex<Vec<String>>,
    }

    impl Timed {
        fn new(batches: bool) -> Self {
            Self { batches, finished: Mutex::default() }
        }

        async fn run(&self, event: &v1::Event) -> Result<(), HandlerError> {
            if event.event_type == "panic" {
                panic!("event {} panics", event.event_id);
            }
            let ms: u64 = event.event_type.parse().expect("a duration");
            tokio::time::sleep(Duration::from_millis(ms)).await;
            self.finished.lock().unwrap().push(event.event_id.clone());
            Ok(())
        }
    }

    #[async_trait::async_trait]
    impl Handler for Timed {
        fn name(&self) -> &'static str {
            "timed"
        }

        fn event_types(&self) -> &'static [&'static str] {
            &[]
        }

        fn batches(&self) -> bool {
            self.batches
        }

        async fn handle(&self, event: &v1::Event) -> Result<(), HandlerError> {
            self.run(event).await
        }

        async fn handle_batch(&self, events: &[&v1::Event]) -> Vec<Result<(), HandlerError>> {
            let mut results = Vec::new();
            for event in events {
                results.push(self.run(event).await);
            }
            results
        }
    }

    fn events(kinds: &[&str]) -> Vec<v1::Event> {
        kinds
            .iter()
            .enumerate()
            .map(|(i, kind)| v1::Event { event_id: format!("e{i}"), event_type: (*kind).into(), ..Default::default() })
            .collect()
    }

    fn outcomes(results: &[Option<Result<(), HandlerError>>]) -> Vec<&str> {
        results
            .iter()
            .map(|r| match r {
                None => "handed back",
                Some(Ok(())) => "ok",
                Some(Err(HandlerError::Retryable(m))) if m.contains("timed out") => "timed out",
                Some(Err(HandlerError::Retryable(m))) if m.contains("panicked") => "panicked",
                Some(Err(_)) => "failed",
            })
            .collect()
    }

    /// Runs `handler` over `events` with no shutdown asked.
    async fn run(handler: &Timed, events: &[&v1::Event], timeout: Duration) -> Vec<Option<Result<(), HandlerError>>> {
        let shutdown = Shutdown::new();
        run_handler(handler, events, timeout, &Stop { shutdown: &shutdown, may_hand_back: vec![true; events.len()] })
            .await
    }

    /// A handler whose `"down"` events find its dependency unavailable for its first `down`
    /// calls (of any event); `"ok"` events always pass, `"stuck"` ones always say it is
    /// unavailable (an event-specific failure said wrongly). It records every event it was
    /// called on.
    /// Each test's has a name of its own: the gauge of held events is per name, and tests run
    /// at once.
    struct Flaky {
        name: &'static str,
        batches: bool,
        down: AtomicUsize,
        called: Mutex<Vec<String>>,
    }

    impl Flaky {
        fn new(name: &'static str, batches: bool, down: usize) -> Self {
            Self { name, batches, down: AtomicUsize::new(down), called: Mutex::default() }
        }

        fn held(&self) -> f64 {
            HELD_FOR_DEPENDENCY.get(&[self.name])
        }
    }

    #[async_trait::async_trait]
    impl Handler for Flaky {
        fn name(&self) -> &'static str {
            self.name
        }

        fn event_types(&self) -> &'static [&'static str] {
            &[]
        }

        fn batches(&self) -> bool {
            self.batches
        }

        async fn handle(&self, event: &v1::Event) -> Result<(), HandlerError> {
            self.called.lock().unwrap().push(event.event_id.clone());
            let down = event.event_type == "stuck"
                || event.event_type == "down"
                    && self.down.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1)).is_ok();
            if down { Err(HandlerError::unavailable("the provider: connection refused")) } else { Ok(()) }
        }
    }

    /// Runs `handler` over `events`, then waits out what it said was unavailable (for at most
    /// `wait`), as a dispatch does; `shutdown` is asked after `stop_after`, if given.
    async fn run_waiting(
        handler: &Flaky,
        events: &[&v1::Event],
        wait: Duration,
        may_hand_back: bool,
        stop_after: Option<Duration>,
    ) -> (Vec<Option<Result<(), HandlerError>>>, f64) {
        let shutdown = Shutdown::new();
        if let Some(after) = stop_after {
            let shutdown = shutdown.clone();
            tokio::spawn(async move {
                tokio::time::sleep(after).await;
                shutdown.request();
            });
        }
        let stop = Stop { shutdown: &shutdown, may_hand_back: vec![may_hand_back; events.len()] };
        let timeout = Duration::from_secs(1);
        let mut results = run_handler(handler, events, timeout, &stop).await;
        wait_out_unavailable(handler, events, &mut results, timeout, &stop, wait).await;
        (results, handler.held())
    }

    /// A dependency down for five calls: each round, backing off, one held event is sent (a
    /// different one each round) until one passes, then the others; the event that passed at
    /// first is not run again, and nothing counts as a failure. On either kind of handler.
    #[tokio::test(start_paused = true)]
    async fn events_a_dependency_failed_run_again_once_it_is_back() {
        for batches in [false, true] {
            let handler = Flaky::new(if batches { "flaky-batches" } else { "flaky-alone" }, batches, 5);
            let events = events(&["down", "ok", "down"]);
            let events: Vec<&v1::Event> = events.iter().collect();
            let started = tokio::time::Instant::now();
            let (results, held) = run_waiting(&handler, &events, Duration::from_secs(600), true, None).await;
            assert_eq!(outcomes(&results), ["ok", "ok", "ok"], "batches: {batches}");
            assert_eq!(held, 0.0, "the gauge's count is back to 0");
            let called = handler.called.lock().unwrap().clone();
            assert_eq!(called, ["e0", "e1", "e2", "e0", "e2", "e0", "e2", "e0"], "batches: {batches}");
            // Four waits of 1, 2, 4 and 8 s, each at least half its length.
            assert!(started.elapsed() >= Duration::from_millis(7500), "backed off: {:?}", started.elapsed());
        }
    }

    /// An event that says the dependency is down in the round it answered another is let go, a
    /// failure of its own: its batch-mates' outcomes are not held for the hour. The gauge's
    /// count is back to 0.
    #[tokio::test(start_paused = true)]
    async fn an_event_still_unavailable_once_the_dependency_answers_is_let_go() {
        let handler = Flaky::new("flaky-let-go", false, 1);
        let events = events(&["stuck", "down", "ok"]);
        let events: Vec<&v1::Event> = events.iter().collect();
        let started = tokio::time::Instant::now();
        let (results, held) = run_waiting(&handler, &events, Duration::from_secs(3600), true, None).await;
        assert!(matches!(&results[0], Some(Err(HandlerError::Unavailable(_)))), "{results:?}");
        assert_eq!((&outcomes(&results)[1..], held), (&["ok", "ok"][..], 0.0));
        let called = handler.called.lock().unwrap().clone();
        assert_eq!(called, ["e0", "e1", "e2", "e0", "e1", "e0"], "e0 first alone, then after e1 passed");
        assert!(started.elapsed() < Duration::from_secs(60), "{:?}", started.elapsed());
    }

    /// A wait dropped with its work (its claims could not be held) takes its events off the
    /// gauge: the count is the guard's, not the end of the wait's.
    #[tokio::test(start_paused = true)]
    async fn a_wait_dropped_takes_its_events_off_the_gauge() {
        let handler = Flaky::new("flaky-dropped", false, usize::MAX);
        let events = events(&["down", "down"]);
        let events: Vec<&v1::Event> = events.iter().collect();
        let shutdown = Shutdown::new();
        let stop = Stop { shutdown: &shutdown, may_hand_back: vec![true; 2] };
        let timeout = Duration::from_secs(1);
        let mut results = run_handler(&handler, &events, timeout, &stop).await;
        let hour = Duration::from_secs(3600);
        let mut wait = Box::pin(wait_out_unavailable(&handler, &events, &mut results, timeout, &stop, hour));
        assert!(tokio::time::timeout(Duration::from_secs(10), &mut wait).await.is_err(), "still waiting");
        assert_eq!(handler.held(), 2.0);
        drop(wait);
        assert_eq!(handler.held(), 0.0);
    }

    /// Past the wait, what is still unavailable fails as a retryable failure would; at
    /// shutdown it is handed back when it may be, and fails when it may not.
    #[tokio::test(start_paused = true)]
    async fn the_wait_ends_with_its_limit_or_shutdown() {
        let never = |name| Flaky::new(name, false, usize::MAX);
        let events = events(&["down", "ok"]);
        let events: Vec<&v1::Event> = events.iter().collect();
        let started = tokio::time::Instant::now();
        let (results, held) = run_waiting(&never("flaky-limit"), &events, Duration::from_secs(120), true, None).await;
        assert!(matches!(&results[0], Some(Err(HandlerError::Unavailable(m))) if m.contains("refused")), "{results:?}");
        assert_eq!((outcomes(&results)[1], held), ("ok", 0.0));
        let waited = started.elapsed();
        assert!(waited >= Duration::from_secs(120) && waited < Duration::from_secs(121), "{waited:?}");
        let ran = PairState::Ran { token: None, result: results[0].clone().expect("ran") };
        let verdict = verdict(&delivery(None), &[(0, ran)], RetryPolicy::default());
        assert!(matches!(verdict, Verdict::Nak { .. }), "retried later, as a failure");

        let wait = Duration::from_secs(3600);
        let stop_after = Some(Duration::from_secs(10));
        let (results, held) = run_waiting(&never("flaky-stop"), &events, wait, true, stop_after).await;
        assert_eq!((outcomes(&results), held), (vec!["handed back", "ok"], 0.0));
        let (results, _) = run_waiting(&never("flaky-stop-last"), &events, wait, false, stop_after).await;
        assert_eq!(outcomes(&results), ["failed", "ok"], "it may not be handed back: a failure");
    }

    /// A batch longer than the timeout (40 events of 20 ms against 500 ms) with one event that
    /// hangs: the hanging one fails alone, every other finishes, on either kind of handler.
    #[tokio::test(start_paused = true)]
    async fn one_slow_event_fails_alone_and_its_batch_mates_finish() {
        let mut kinds = vec!["20"; 40];
        kinds[3] = "3600000";
        kinds[30] = "panic";
        let events = events(&kinds);
        let events: Vec<&v1::Event> = events.iter().collect();
        for batches in [false, true] {
            let handler = Timed::new(batches);
            let results = run(&handler, &events, Duration::from_millis(500)).await;
            let mut expected = vec!["ok"; 40];
            expected[3] = "timed out";
            expected[30] = "panicked";
            assert_eq!(outcomes(&results), expected, "batches: {batches}");
            let finished = handler.finished.lock().unwrap().clone();
            // Each ok event finished (a batching handler's first try finished some of them too).
            for (i, outcome) in expected.iter().enumerate() {
                assert_eq!(finished.contains(&format!("e{i}")), *outcome == "ok", "e{i}, batches: {batches}");
            }
        }
    }

    /// A batch that finishes in time is one call, its results as the handler gave them.
    #[tokio::test(start_paused = true)]
    async fn a_batch_in_time_is_one_call() {
        let events = events(&["10", "10", "10"]);
        let events: Vec<&v1::Event> = events.iter().collect();
        let handler = Timed::new(true);
        let started = tokio::time::Instant::now();
        let results = run(&handler, &events, Duration::from_millis(500)).await;
        assert_eq!(outcomes(&results), ["ok", "ok", "ok"]);
        assert_eq!(started.elapsed(), Duration::from_millis(30), "each event ran once");
        // One event alone that times out fails, without a second run.
        let one = events[..1].to_vec();
        let slow = v1::Event { event_id: "slow".into(), event_type: "900".into(), ..Default::default() };
        let started = tokio::time::Instant::now();
        assert_eq!(outcomes(&run(&handler, &[&slow], Duration::from_millis(500)).await), ["timed out"]);
        assert_eq!(started.elapsed(), Duration::from_millis(500));
        assert_eq!(outcomes(&run(&handler, &one, Duration::from_millis(500)).await), ["ok"]);
    }

    /// Shutdown asked while the third of six 100 ms events runs: it finishes, and the events
    /// after it are handed back unstarted, except one that may not be (its last delivery). A
    /// handler that batches finishes its one call.
    #[tokio::test(start_paused = true)]
    async fn shutdown_hands_back_the_events_not_started() {
        let events = events(&["100"; 6]);
        let events: Vec<&v1::Event> = events.iter().collect();
        for batches in [false, true] {
            let handler = Timed::new(batches);
            let shutdown = Shutdown::new();
            let asking = shutdown.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(250)).await;
                asking.request();
            });
            let mut may_hand_back = vec![true; 6];
            may_hand_back[4] = false;
            let stop = Stop { shutdown: &shutdown, may_hand_back };
            let results = run_handler(&handler, &events, Duration::from_secs(1), &stop).await;
            let expected: &[&str] =
                if batches { &["ok"; 6] } else { &["ok", "ok", "ok", "handed back", "ok", "handed back"] };
            assert_eq!(outcomes(&results), expected, "batches: {batches}");
            let finished = handler.finished.lock().unwrap().len();
            assert_eq!(finished, expected.iter().filter(|o| **o == "ok").count(), "batches: {batches}");
        }
    }

    /// Where a deferral spends a delivery, only a delivery with two left is handed back, and
    /// due later; where it is free, any, at once; where nothing comes back, none.
    #[test]
    fn what_a_hand_back_costs_decides_which_are_handed_back() {
        let config = |hand_back| DispatchConfig {
            handler_timeout: Duration::from_secs(1),
            retry_policy: RetryPolicy::default(),
            ledger_lease: Duration::from_secs(30),
            max_attempts: 5,
            record_dead_letters: false,
            hand_back,
            unavailable_wait: Duration::from_secs(60),
        };
        let after = Duration::from_secs(5);
        let now = reelay_kit::now_ms();
        let jetstream = config(HandBack::SpendsDelivery { after });
        assert!(jetstream.may_hand_back(3) && jetstream.handed_back_due() >= now + 5_000);
        assert!(!jetstream.may_hand_back(4), "one delivery left after this one");
        assert!(!jetstream.may_hand_back(5), "the last");
        let db = config(HandBack::Free);
        assert!(db.may_hand_back(5) && (now..now + 5_000).contains(&db.handed_back_due()));
        assert!(!config(HandBack::Never).may_hand_back(1));
        assert!(!config(HandBack::Never).redelivers());
    }
}
