//! The ledger-guarded dispatch of a batch of deliveries to the hosted handlers.
//!
//! For every (event, subscribed handler) pair the ledger is asked first, in one batched call:
//! `done` → skip; held by a fresh claim elsewhere → defer the delivery to the lease expiry;
//! acquired → run the handler, then complete the claim (success) or release it (failure). A
//! delivery is acked when all its handlers are done or skipped. Handlers run batched: each gets
//! all its acquired events of the batch in one `handle_batch` call.
//!
//! When the ledger cannot be reached nothing runs and the caller pauses (no attempt is spent);
//! a ledger that answers with an error skips the handlers and naks the deliveries. While the
//! handlers run, the claims are renewed, so a live worker keeps them however long it takes and a
//! dead one's are taken over once their lease runs out.
//!
//! A delivery whose source already holds its claim (the db backend's per-handler deliveries)
//! skips the ledger here: settling the delivery settles the claim.
//!
//! Each event's handling is logged in a span carrying the trace id the write stamped on the
//! event, so a handler's lines join the write's trace.

use std::sync::Arc;
use std::time::Duration;

use reelay_contracts::v1::{self, ledger_claim::Outcome, ledger_client::LedgerClient};
use reelay_domain::{EventId, RetryPolicy};
use reelay_kit::Shutdown;
use reelay_kit::client::{ServiceChannel, is_transport_failure};

use crate::pause::Pause;
use crate::source::Delivery;
use crate::{Handler, HandlerError};

/// Keys per Ledger call (the server's limit).
const LEDGER_BATCH: usize = 1000;

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

/// Ledger claims to mark done (their handler succeeded) or give up (it failed).
#[derive(Debug, Default)]
pub struct LedgerSettlement {
    complete: Vec<v1::OwnedKey>,
    release: Vec<v1::OwnedKey>,
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
    Run { token: Option<i64> },
    Ran { token: Option<i64>, result: Result<(), HandlerError> },
    LedgerError(String),
}

#[derive(Clone)]
pub struct Dispatcher {
    handlers: Vec<Arc<dyn Handler>>,
    ledger: LedgerClient<ServiceChannel>,
    config: DispatchConfig,
    shutdown: Shutdown,
}

/// How a dispatcher runs handlers and holds their claims.
#[derive(Debug, Clone)]
pub struct DispatchConfig {
    /// A handler call that takes longer fails (retryable).
    pub handler_timeout: Duration,
    pub retry_policy: RetryPolicy,
    /// `<instance>#<incarnation>` of this process, the owner of its ledger claims.
    pub owner: String,
    /// Claims are renewed every third of this while handlers run.
    pub ledger_lease: Duration,
}

impl Dispatcher {
    pub fn new(
        handlers: Vec<Arc<dyn Handler>>,
        ledger: ServiceChannel,
        config: DispatchConfig,
        shutdown: Shutdown,
    ) -> Self {
        Self { handlers, ledger: LedgerClient::new(ledger), config, shutdown }
    }

    pub fn handler_names(&self) -> Vec<&'static str> {
        self.handlers.iter().map(|h| h.name()).collect()
    }

    /// Claims, runs the handlers, and returns each delivery's verdict together with the ledger
    /// claims still to settle (see [`Dispatcher::settle_ledger`]), so the caller can settle the
    /// ledger and the deliveries at the same time (the write service commits them together).
    pub async fn dispatch<T>(&mut self, deliveries: &[Delivery<T>]) -> Result<Dispatched, LedgerUnavailable> {
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

        self.claim(deliveries, &mut pairs).await?;
        let held = self.held_claims(deliveries, &pairs);
        let renewing = self.clone();
        with_renewals(renewing, held, self.run_handlers(deliveries, &mut pairs)).await;
        let ledger = self.ledger_settlement(deliveries, &pairs);
        let verdicts = deliveries.iter().zip(&pairs).map(|(d, p)| verdict(d, p, self.config.retry_policy)).collect();
        Ok(Dispatched { verdicts, ledger })
    }

    /// Asks the ledger about every pair of a delivery that has an event id.
    async fn claim<T>(
        &mut self,
        deliveries: &[Delivery<T>],
        pairs: &mut [Vec<(usize, PairState)>],
    ) -> Result<(), LedgerUnavailable> {
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
        for (chunk_index, chunk_keys) in index.chunks(LEDGER_BATCH).zip(keys.chunks(LEDGER_BATCH)) {
            let request = v1::LedgerClaimRequest { keys: chunk_keys.to_vec(), owner: self.config.owner.clone() };
            let claims = match self.ledger.claim(request).await {
                Ok(response) => response.into_inner().claims,
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
            for (&(d, p), claim) in chunk_index.iter().zip(claims) {
                pairs[d][p].1 = match claim.outcome {
                    Some(Outcome::AcquiredToken(token)) => PairState::Run { token: Some(token) },
                    Some(Outcome::Done(_)) => PairState::Skip,
                    Some(Outcome::HeldUntilMs(until)) => PairState::HeldUntil(until),
                    None => PairState::LedgerError("the ledger answered without an outcome".into()),
                };
            }
        }
        Ok(())
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
                    return (work, Vec::new());
                }
                let events: Vec<&v1::Event> = work.iter().map(|&(d, _)| &deliveries[d].event).collect();
                let results = match tokio::time::timeout(timeout, handler.handle_batch(&events)).await {
                    Ok(results) if results.len() == events.len() => results,
                    Ok(results) => {
                        let error = format!("handler returned {} results for {} events", results.len(), events.len());
                        vec![Err(HandlerError::Retryable(error)); events.len()]
                    }
                    Err(_) => {
                        vec![Err(HandlerError::Retryable(format!("handler timed out after {timeout:?}"))); events.len()]
                    }
                };
                (work, results)
            }
        });
        for (work, results) in futures_util::future::join_all(runs).await {
            for ((d, p), result) in work.into_iter().zip(results) {
                let handler = self.handlers[pairs[d][p].0].name();
                let delivery = &deliveries[d];
                let span = event_span(&delivery.event, handler);
                let _entered = span.enter();
                match &result {
                    Ok(()) => tracing::debug!(attempt = delivery.attempt, "event handled"),
                    Err(error) => tracing::warn!(attempt = delivery.attempt, %error, "handler failed"),
                }
                let PairState::Run { token } = pairs[d][p].1 else { unreachable!("only runnable pairs were run") };
                pairs[d][p].1 = PairState::Ran { token, result };
            }
        }
    }

    /// The ledger claims this dispatcher acquired for the batch (not those its source holds).
    fn held_claims<T>(&self, deliveries: &[Delivery<T>], pairs: &[Vec<(usize, PairState)>]) -> Vec<v1::OwnedKey> {
        let mut held = Vec::new();
        for (d, ps) in pairs.iter().enumerate() {
            for (h, state) in ps {
                if let PairState::Run { token: Some(token) } = state {
                    let key = v1::LedgerKey {
                        event_id: deliveries[d].event_id.clone().unwrap_or_default(),
                        handler: self.handlers[*h].name().to_owned(),
                    };
                    held.push(v1::OwnedKey { key: Some(key), token: *token });
                }
            }
        }
        held
    }

    /// Renews claims that are still being worked on. Best effort: a failure is logged, and
    /// the next tick tries again.
    async fn renew(&mut self, held: &[v1::OwnedKey]) {
        for chunk in held.chunks(LEDGER_BATCH) {
            match self.ledger.renew(v1::LedgerSettleRequest { keys: chunk.to_vec() }).await {
                Ok(reply) => {
                    let lost = reply.into_inner().owned.iter().filter(|owned| !**owned).count();
                    if lost > 0 {
                        tracing::warn!(claims = lost, "ledger claims lost while their handlers were still running");
                    }
                }
                Err(status) => tracing::warn!(error = status.message(), "could not renew ledger claims"),
            }
        }
    }

    /// The claims to complete (handler succeeded) and to release (it failed).
    fn ledger_settlement<T>(&self, deliveries: &[Delivery<T>], pairs: &[Vec<(usize, PairState)>]) -> LedgerSettlement {
        let (mut complete, mut release) = (Vec::new(), Vec::new());
        for (d, ps) in pairs.iter().enumerate() {
            for (h, state) in ps {
                if let PairState::Ran { token: Some(token), result } = state {
                    let key = v1::LedgerKey {
                        event_id: deliveries[d].event_id.clone().unwrap_or_default(),
                        handler: self.handlers[*h].name().to_owned(),
                    };
                    let owned = v1::OwnedKey { key: Some(key), token: *token };
                    if result.is_ok() { complete.push(owned) } else { release.push(owned) }
                }
            }
        }
        LedgerSettlement { complete, release }
    }

    /// Completes the claims of handlers that succeeded and releases the others. The effects
    /// happened, so this is retried until the ledger answers (or the process stops; the claims
    /// then expire and the idempotent handlers run again).
    pub async fn settle_ledger(&mut self, settlement: LedgerSettlement) {
        let LedgerSettlement { complete, release } = settlement;
        for (keys, completing) in [(complete, true), (release, false)] {
            for chunk in keys.chunks(LEDGER_BATCH) {
                let mut pause = Pause::new("ledger");
                loop {
                    let request = v1::LedgerSettleRequest { keys: chunk.to_vec() };
                    let reply = if completing {
                        self.ledger.complete(request).await
                    } else {
                        self.ledger.release(request).await
                    };
                    match reply {
                        Ok(reply) => {
                            for (key, owned) in chunk.iter().zip(reply.into_inner().owned) {
                                if !owned {
                                    let key = key.key.as_ref().expect("built above");
                                    tracing::warn!(event_id = %key.event_id, handler = %key.handler,
                                        "claim lost: a newer claim took this event over; leaving it to its owner");
                                }
                            }
                            pause.resumed();
                            break;
                        }
                        Err(status) if is_transport_failure(&status) && !self.shutdown.is_requested() => {
                            pause.wait(status.message()).await;
                        }
                        Err(status) => {
                            tracing::error!(code = ?status.code(), error = status.message(), completing,
                                "could not settle ledger claims; they will expire and be taken over");
                            break;
                        }
                    }
                }
            }
        }
    }
}

/// Runs `work` while renewing `held` claims every third of the lease.
async fn with_renewals<F: Future>(mut dispatcher: Dispatcher, held: Vec<v1::OwnedKey>, work: F) -> F::Output {
    if held.is_empty() {
        return work.await;
    }
    let every = dispatcher.config.ledger_lease / 3;
    tokio::pin!(work);
    let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    loop {
        tokio::select! {
            output = &mut work => return output,
            _ = ticks.tick() => dispatcher.renew(&held).await,
        }
    }
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
    if EventId::parse("event_id", id).is_err() {
        tracing::warn!(event_id = id, "event id is not a UUID; delivering without dedup");
        return None;
    }
    Some(id)
}

fn verdict<T>(delivery: &Delivery<T>, pairs: &[(usize, PairState)], policy: RetryPolicy) -> Verdict {
    let mut held: Option<i64> = None;
    let mut retry: Option<String> = None;
    for (_, state) in pairs {
        match state {
            PairState::Ran { result: Err(HandlerError::Permanent(reason)), .. } => {
                return Verdict::Term { reason: reason.clone() };
            }
            PairState::Ran { result: Err(HandlerError::Retryable(error)), .. } => retry = Some(error.clone()),
            PairState::LedgerError(error) => retry = Some(format!("ledger error: {error}")),
            PairState::HeldUntil(until) => held = Some(held.map_or(*until, |h| h.min(*until))),
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
