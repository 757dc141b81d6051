//! The `db` event source: one handler's deliveries, claimed from the outbox through the write
//! service's Outbox API. Each (event, handler) has its own attempts, retry schedule and fate in
//! the write service, so one handler never holds back another.
//!
//! The handlers of one process claim through one [`DeliveryClaimer`]: the fetches of handlers
//! that ask at the same time go out as one `ClaimDeliveriesForHandlers` call, whose one answer
//! carries each handler's deliveries. One event for eight handlers is then one write job, one
//! answer to send and one to read, not eight of each.
//!
//! A delivery arrives with its ledger claim already held (the same `processed_events` row):
//! settling it (done, failed, deferred) settles the claim too, and while the handler works the
//! source renews the claim's lease, so a live consumer keeps it and a dead one's comes back in
//! seconds.
//!
//! A claim call that ends without an answer (the connection cut as the answer came back) may
//! still have claimed deliveries for this process, which it never heard of. The handler's
//! next call names it (`Unanswered`), and the write service hands back what it claimed and
//! this process still holds under the same tokens: only this process's own unheard answers,
//! so nothing it runs comes to it twice.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use reelay_contracts::v1::{self, delivery_settlement::Outcome, outbox_client::OutboxClient};
use reelay_domain::EventId;
use reelay_kit::client::{ServiceChannel, is_transport_failure};
use tokio::sync::{mpsc, oneshot};

use crate::consumer::decode_envelope;
use crate::gather::gather;
use crate::source::{
    AckHandle, Delivery, EventSource, Granted, LeaseWatch, Leased, Renewal, ServerLease, SettleKind, Settlement,
    Settler, SourceError,
};

/// One delivery's claim: its ledger key and token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeliveryClaim {
    pub key: String,
    pub token: i64,
}

/// How this process claims deliveries, for all its handlers.
#[derive(Debug, Clone)]
pub struct ClaimerConfig {
    /// `<instance>#<incarnation>` of this process.
    pub owner: String,
    /// How long one claim waits for deliveries before returning empty; at most a sixth of the
    /// lease (see [`claim_call`]).
    pub long_poll: Duration,
    /// This process's lease setting (claims wait for the write service's, when its answers say
    /// it is shorter).
    pub lease: Duration,
    /// The largest claim answer this process reads (its gRPC message limit).
    pub max_message_bytes: usize,
}

/// One handler's fetch, waiting to go out in the next claim call.
struct Want {
    handler: &'static str,
    event_types: Vec<String>,
    max_rows: u32,
    /// The handler's deliveries, and the lease the answer gave them.
    reply: oneshot::Sender<Result<Leased<Vec<v1::Delivery>>, SourceError>>,
}

/// Claims deliveries for the handlers of this process (see the module's comment). Cheap to
/// clone; the calls stop when every clone is gone.
#[derive(Clone)]
pub struct DeliveryClaimer {
    wants: mpsc::UnboundedSender<Want>,
    /// The lease the write service's answers last gave.
    lease: ServerLease,
}

impl DeliveryClaimer {
    pub fn start(channel: ServiceChannel, config: ClaimerConfig) -> Self {
        let client = OutboxClient::new(channel).max_decoding_message_size(config.max_message_bytes);
        let mut turn = 0;
        let split = move |mut wants: Vec<Want>| {
            // Who goes first in a shared answer changes from call to call, so no handler's
            // large rows keep waiting behind the others' (a row that does not fit waits).
            turn += 1;
            let first = turn % wants.len();
            wants.rotate_left(first);
            // A handler asking twice (never, with one consumer per handler) goes in a call of
            // its own.
            let mut calls: Vec<Vec<Want>> = Vec::new();
            for want in wants {
                match calls.iter_mut().find(|call| call.iter().all(|w| w.handler != want.handler)) {
                    Some(call) => call.push(want),
                    None => calls.push(vec![want]),
                }
            }
            calls
        };
        // A call waits (long poll) until one of its handlers has deliveries; handlers asking
        // meanwhile go out in the next call.
        let lease = ServerLease::default();
        let heard = lease.clone();
        let unanswered = Unanswered::default();
        let wants = gather(split, move |wants| {
            claim_call(client.clone(), config.clone(), heard.clone(), unanswered.clone(), wants)
        });
        Self { wants, lease }
    }

    /// Up to `max_rows` deliveries for `handler`, waiting up to the long poll for some.
    async fn claim(
        &self,
        handler: &'static str,
        event_types: &[String],
        max_rows: u32,
    ) -> Result<Leased<Vec<v1::Delivery>>, SourceError> {
        let stopped = || SourceError::Unavailable("the delivery claimer stopped".into());
        let (reply, answer) = oneshot::channel();
        let want = Want { handler, event_types: event_types.to_vec(), max_rows, reply };
        self.wants.send(want).map_err(|_| stopped())?;
        answer.await.map_err(|_| stopped())?
    }
}

/// Numbers this process's claim calls (with its owner, unique).
static CALLS: AtomicU64 = AtomicU64::new(1);

/// Most unanswered calls remembered per handler.
const UNANSWERED_KEPT: usize = 8;

/// Most unanswered calls one claim may name (the write service refuses more).
const UNANSWERED_NAMED: usize = 64;

/// The claim calls of each handler that ended without an answer since its last answered one:
/// the next call names them, and the write service hands back what they claimed (the process
/// never heard of it, so runs none of it) instead of holding it against this process until its
/// lease runs out.
#[derive(Clone, Default)]
struct Unanswered(Arc<Mutex<HashMap<&'static str, Vec<u64>>>>);

impl Unanswered {
    /// The unanswered calls of `handlers`, to name in the next call.
    fn of(&self, handlers: &[&'static str]) -> Vec<u64> {
        let calls = self.0.lock().expect("unanswered lock");
        let of_handlers = || handlers.iter().filter_map(|h| calls.get(h));
        // Each handler's newest first (the likeliest to hold claims still), then the others,
        // newest first, up to what a call may name.
        let mut ids: Vec<u64> = of_handlers().filter_map(|ids| ids.last().copied()).collect();
        let mut older: Vec<u64> = of_handlers().flat_map(|ids| ids.iter().rev().skip(1).copied()).collect();
        older.sort_unstable_by(|a, b| b.cmp(a));
        ids.extend(older);
        let mut seen = std::collections::HashSet::new();
        ids.retain(|id| seen.insert(*id));
        ids.truncate(UNANSWERED_NAMED);
        ids
    }

    /// The call `call_id` for `handlers` was answered (forget their unanswered calls: the write
    /// service has seen them named) or not (remember it).
    fn settle(&self, handlers: &[&'static str], call_id: u64, answered: bool) {
        let mut calls = self.0.lock().expect("unanswered lock");
        for handler in handlers {
            if answered {
                calls.remove(handler);
            } else {
                let ids = calls.entry(handler).or_default();
                ids.push(call_id);
                if ids.len() > UNANSWERED_KEPT {
                    ids.remove(0);
                }
            }
        }
    }
}

/// One `ClaimDeliveriesForHandlers` call; each handler hears its part of the answer.
async fn claim_call(
    mut client: OutboxClient<ServiceChannel>,
    config: ClaimerConfig,
    lease: ServerLease,
    unanswered: Unanswered,
    wants: Vec<Want>,
) {
    let (handlers, replies): (Vec<v1::HandlerWants>, Vec<_>) = wants
        .into_iter()
        .map(|w| {
            let asked =
                v1::HandlerWants { handler: w.handler.to_owned(), event_types: w.event_types, max_rows: w.max_rows };
            (asked, (w.handler, w.reply))
        })
        .unzip();
    // A worker counts its claims' lease from when it asked (see `LeaseWatch`), and the write
    // service makes a claim when an event comes, up to the long poll later: waiting at most a
    // sixth of the lease leaves the worker at least two thirds of it from the claim, and half
    // of it for its first renewal to be answered, however long the claim waited.
    let long_poll = config.long_poll.min(lease.bound(config.lease) / 6);
    let names: Vec<&'static str> = replies.iter().map(|(handler, _)| *handler).collect();
    let call_id = CALLS.fetch_add(1, Ordering::Relaxed);
    let mut request = tonic::Request::new(v1::ClaimDeliveriesForHandlersRequest {
        handlers,
        owner: config.owner.clone(),
        wait_ms: long_poll.as_millis() as u32,
        max_bytes: config.max_message_bytes as u32,
        call_id,
        unanswered: unanswered.of(&names),
    });
    request.set_timeout(long_poll + Duration::from_secs(10));
    let result = client.claim_deliveries_for_handlers(request).await;
    unanswered.settle(&names, call_id, result.is_ok());
    match result {
        Ok(answer) => {
            let answer = answer.into_inner();
            let granted = lease.heard(answer.lease_ms);
            let mut answers = answer.handlers;
            for (handler, reply) in replies {
                let result = match answers.iter_mut().find(|a| a.handler == handler) {
                    Some(part) if !part.refused.is_empty() => {
                        Err(SourceError::Rejected(format!("FailedPrecondition: {}", part.refused)))
                    }
                    Some(part) if !part.standing_by.is_empty() => {
                        Err(SourceError::StandingBy(std::mem::take(&mut part.standing_by)))
                    }
                    Some(part) => Ok((std::mem::take(&mut part.deliveries), granted)),
                    None => Err(SourceError::Rejected(format!("the claim's answer left out handler {handler:?}"))),
                };
                let _ = reply.send(result);
            }
        }
        Err(status) => {
            for (_, reply) in replies {
                let _ = reply.send(Err(source_error(status.clone())));
            }
        }
    }
}

/// Where one handler's deliveries come from.
#[derive(Debug, Clone)]
pub struct DeliverySourceConfig {
    pub handler: &'static str,
    pub event_types: Vec<String>,
    /// The largest message this process reads (its gRPC message limit).
    pub max_message_bytes: usize,
    /// The write service takes a claim over when it is not renewed for this long.
    pub lease: Duration,
}

pub struct DeliverySource {
    claimer: DeliveryClaimer,
    client: OutboxClient<ServiceChannel>,
    config: DeliverySourceConfig,
    /// The lease the last claim answer gave (for the batch it fetched).
    granted: Option<Duration>,
}

impl DeliverySource {
    pub fn new(claimer: DeliveryClaimer, channel: ServiceChannel, config: DeliverySourceConfig) -> Self {
        let client = OutboxClient::new(channel).max_decoding_message_size(config.max_message_bytes);
        Self { claimer, client, config, granted: None }
    }
}

fn source_error(status: tonic::Status) -> SourceError {
    if is_transport_failure(&status) {
        SourceError::Unavailable(format!("{:?}: {}", status.code(), status.message()))
    } else {
        SourceError::Rejected(format!("{:?}: {}", status.code(), status.message()))
    }
}

fn claim(token: &DeliveryClaim) -> v1::DeliveryClaim {
    v1::DeliveryClaim { key: token.key.clone(), token: token.token }
}

#[async_trait::async_trait]
impl EventSource for DeliverySource {
    type Token = DeliveryClaim;
    type Settler = DeliverySettler;

    fn settler(&self) -> DeliverySettler {
        DeliverySettler {
            client: self.client.clone(),
            handler: self.config.handler,
            lease: self.config.lease,
            server_lease: self.claimer.lease.clone(),
            granted: self.granted,
        }
    }

    async fn fetch(&mut self, max: usize) -> Result<Vec<Delivery<DeliveryClaim>>, SourceError> {
        let config = &self.config;
        let (deliveries, granted) = self.claimer.claim(config.handler, &config.event_types, max as u32).await?;
        self.granted = granted;
        Ok(deliveries
            .into_iter()
            .map(|d| {
                // A foreign writer's row has no event id; its key is `row:<id>`.
                let event_id = EventId::parse("key", &d.key).is_ok().then(|| d.key.clone());
                let event =
                    decode_envelope(&d.payload, event_id.as_deref().unwrap_or(""), &d.event_type, &d.aggregate_id);
                Delivery {
                    event,
                    event_id: Some(d.key.clone()),
                    attempt: d.attempt,
                    claimed: Some(d.token),
                    ack: AckHandle::new(DeliveryClaim { key: d.key, token: d.token }),
                }
            })
            .collect())
    }
}

/// The settlements of one SettleDeliveries call, in order: at most 1,000 (the API's limit) and
/// about 2 MiB of failure texts (2,000 characters each at most, up to four bytes each), so a
/// call fits a message whatever its errors say.
fn settle_chunks<T>(settlements: &[Settlement<T>]) -> Vec<&[Settlement<T>]> {
    const MOST: usize = 1000;
    const TEXT_BYTES: usize = 2 << 20;
    let text = |s: &Settlement<T>| match &s.kind {
        SettleKind::Nak { error, .. } => error.len(),
        SettleKind::Term { reason } => reason.len(),
        SettleKind::Ack | SettleKind::Defer { .. } => 0,
    };
    let (mut chunks, mut start, mut bytes) = (Vec::new(), 0, 0);
    for (i, settlement) in settlements.iter().enumerate() {
        let size = text(settlement);
        if i > start && (i - start == MOST || bytes + size > TEXT_BYTES) {
            chunks.push(&settlements[start..i]);
            (start, bytes) = (i, 0);
        }
        bytes += size;
    }
    if start < settlements.len() {
        chunks.push(&settlements[start..]);
    }
    chunks
}

/// Settles and renews one handler's deliveries through the Outbox API.
#[derive(Clone)]
pub struct DeliverySettler {
    client: OutboxClient<ServiceChannel>,
    handler: &'static str,
    /// This process's lease, bounded by the write service's.
    lease: Duration,
    server_lease: ServerLease,
    /// The lease the claim answer of this settler's batch gave.
    granted: Option<Duration>,
}

#[async_trait::async_trait]
impl Settler<DeliveryClaim> for DeliverySettler {
    async fn settle(&mut self, settlements: &[Settlement<DeliveryClaim>]) -> Result<(), SourceError> {
        let mut lost = Vec::new();
        for chunk in settle_chunks(settlements) {
            let settlements = chunk
                .iter()
                .map(|s| v1::DeliverySettlement {
                    claim: Some(claim(s.ack.token())),
                    outcome: Some(match &s.kind {
                        SettleKind::Ack => Outcome::Done(true),
                        // The write service applies retry_backoff itself from the delivery's
                        // attempts: the same schedule the runtime asked for.
                        SettleKind::Nak { error, .. } => {
                            Outcome::Failed(v1::DeliveryFailure { error: error.clone(), terminal: false })
                        }
                        SettleKind::Term { reason } => {
                            Outcome::Failed(v1::DeliveryFailure { error: reason.clone(), terminal: true })
                        }
                        SettleKind::Defer { until_ms } => Outcome::DeferredUntilMs(*until_ms),
                    }),
                })
                .collect();
            let request = v1::SettleDeliveriesRequest { handler: self.handler.to_owned(), settlements };
            let reply = self.client.settle_deliveries(request).await.map_err(source_error)?.into_inner();
            lost.extend(reply.lost);
        }
        if !lost.is_empty() {
            tracing::warn!(handler = self.handler, keys = ?lost,
                "deliveries were taken over by another consumer before this one settled them");
        }
        Ok(())
    }

    /// At most a third of this process's lease; `while_renewing` goes faster when the write
    /// service's is shorter.
    fn progress_interval(&self) -> Option<Duration> {
        Some(self.lease / 3)
    }

    fn lease(&self, asked: tokio::time::Instant) -> Option<LeaseWatch> {
        Some(LeaseWatch::start(self.lease, self.server_lease.clone(), asked, self.granted))
    }

    async fn in_progress(&mut self, deliveries: &[Delivery<DeliveryClaim>]) -> Result<Renewal, SourceError> {
        let (mut lost, mut granted) = (false, Granted::default());
        for chunk in deliveries.chunks(1000) {
            let claims = chunk.iter().map(|d| claim(d.ack.token())).collect();
            let request = v1::RenewDeliveriesRequest { handler: self.handler.to_owned(), claims };
            let reply = self.client.renew_deliveries(request).await.map_err(source_error)?.into_inner();
            granted.add(self.server_lease.heard(reply.lease_ms));
            if !reply.lost.is_empty() {
                tracing::warn!(handler = self.handler, keys = ?reply.lost, "claims lost while still working on them");
                lost = true;
            }
        }
        Ok(if lost { Renewal::Lost } else { Renewal::Held(granted.lease()) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::AckHandle;

    /// A call holds at most 1,000 settlements and about 2 MiB of failure texts, in order, and
    /// every settlement is in one call.
    #[test]
    fn settle_calls_are_bounded_in_count_and_bytes() {
        let acks = |n: usize| (0..n).map(AckHandle::new).map(|a| a.ack()).collect::<Vec<_>>();
        let sizes = |chunks: Vec<&[Settlement<usize>]>| chunks.iter().map(|c| c.len()).collect::<Vec<_>>();
        assert_eq!(sizes(settle_chunks(&acks(2500))), [1000, 1000, 500]);
        assert!(settle_chunks(&acks(0)).is_empty());
        // 2,000 four-byte characters each: 8,000 bytes, so 262 to a call.
        let long = "🎬".repeat(2000);
        let failed: Vec<_> = (0..600).map(|n| AckHandle::new(n).nak(Duration::ZERO, &long)).collect();
        let chunks = settle_chunks(&failed);
        assert_eq!(sizes(chunks.clone()), [262, 262, 76]);
        let order: Vec<usize> = chunks.iter().flat_map(|c| c.iter().map(|s| *s.ack.token())).collect();
        assert_eq!(order, (0..600).collect::<Vec<_>>());
    }
}
