//! The relay: claims outbox rows through the write service's Outbox API and publishes each to
//! `<prefix>.<event type>` with `Nats-Msg-Id` = its event id, then marks them done.
//!
//! It owns nothing durable. It never spends an attempt on a transport failure: rows it could
//! not publish are deferred (no attempt spent) with growing backoff, and the relay pauses. A
//! relay that dies between the PubAck and the mark-done republishes after the claim lease; the
//! broker drops the duplicate inside its duplicate window and answers with a duplicate PubAck,
//! which counts as success.
//!
//! An operator's replay (nats backend) is an outbox row of its own: it is published to
//! `<prefix>.replay.<handler>.<event type>`, which only that handler's consumer takes, with its
//! own message id and a `Reelay-Replay-Of` header naming the event (the ledger's key).

use std::sync::LazyLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::context::PublishErrorKind;
use futures_util::future::join_all;
use reelay_contracts::v1::{self, outbox_client::OutboxClient};
use reelay_kit::client::{ServiceChannel, is_transport_failure};
use reelay_kit::metrics::{self, Counter};
use reelay_kit::{Backoff, Shutdown};

static PUBLISHED: LazyLock<Counter> = LazyLock::new(|| {
    metrics::counter(
        "reelay_relay_published_total",
        "Outbox rows the relay published and marked done, by outcome: stored, or duplicate (the broker had it already).",
        &["outcome"],
    )
});
static DEFERRED: LazyLock<Counter> = LazyLock::new(|| {
    metrics::counter(
        "reelay_relay_deferred_total",
        "Outbox rows the relay could not publish (broker unreachable) and deferred without spending an attempt.",
        &[],
    )
});
static REFUSED: LazyLock<Counter> = LazyLock::new(|| {
    metrics::counter("reelay_relay_refused_total", "Outbox rows the broker refused (an attempt spent).", &[])
});

/// Declares the relay's metrics, so they are scraped before the first publish.
pub fn register_metrics() {
    for metric in [&PUBLISHED, &DEFERRED, &REFUSED] {
        LazyLock::force(metric);
    }
}

/// How the relay publishes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Publish to the stream and wait for every PubAck (durable, deduplicated).
    JetStream,
    /// Publish and flush: no broker dedup, no redelivery; a subscriber that is down misses it.
    Core,
}

#[derive(Debug, Clone)]
pub struct RelayConfig {
    pub subject_prefix: String,
    pub mode: Mode,
    /// Rows claimed, and publishes in flight, at once.
    pub batch: u32,
    pub long_poll: Duration,
    /// The largest gRPC message this relay reads: it bounds the claim answers it asks for.
    pub max_message_bytes: usize,
    /// `<instance>#<incarnation>`: whose claims these are (a restarted instance takes back its
    /// dead predecessor's at once).
    pub owner: String,
}

/// How the relay backs off while the broker or the write service is unreachable.
fn relay_backoff() -> Backoff {
    Backoff::new(Duration::from_millis(200), Duration::from_secs(30))
}
/// Published batches whose PubAcks and mark-done are still under way while the next is sent.
const MAX_SETTLING: usize = 3;
/// Numbers this process's claim calls: unique with its owner name (which carries the
/// incarnation), however many times a relay runs in the process.
static CALLS: AtomicU64 = AtomicU64::new(1);

/// Most unanswered claim calls named in the next one (the newest: an older one's rows have
/// most likely waited out their lease by then).
const UNANSWERED_NAMED: usize = 8;

pub struct Relay {
    outbox: OutboxClient<ServiceChannel>,
    nats: async_nats::Client,
    jetstream: async_nats::jetstream::Context,
    config: RelayConfig,
    /// Test builds only: abort between the PubAcks and the mark-done, to test republishing.
    crash_after_puback: bool,
}

/// What became of a batch of publishes.
struct Published {
    done: Vec<v1::RowClaim>,
    /// The broker could not be reached: try again later without spending an attempt.
    retry: Vec<v1::RowClaim>,
    /// The broker refused the message itself: spend an attempt.
    refused: Vec<v1::FailedRow>,
    duplicates: usize,
}

/// How long a stopping relay waits for its batches' settles (Kubernetes gives it 45 s).
const SETTLE_AT_STOP: Duration = Duration::from_secs(15);

impl Relay {
    pub fn new(outbox: ServiceChannel, nats: async_nats::Client, config: RelayConfig) -> Self {
        let jetstream = async_nats::jetstream::new(nats.clone());
        let crash_after_puback = reelay_kit::failpoint_armed("relay_after_puback");
        let outbox = OutboxClient::new(outbox).max_decoding_message_size(config.max_message_bytes);
        Self { outbox, nats, jetstream, config, crash_after_puback }
    }

    pub async fn run(mut self, shutdown: Shutdown) {
        tracing::info!(mode = ?self.config.mode, prefix = %self.config.subject_prefix, batch = self.config.batch, "relay started");
        // The broker's pauses and the write service's grow apart: an answered claim says the
        // write service is back, not the broker.
        let (mut backoff, mut claim_backoff) = (relay_backoff(), relay_backoff());
        let mut settling = tokio::task::JoinSet::new();
        // Claim calls since the last answer: if one was answered with rows that never arrived
        // (the connection cut, the deadline passed), the write service hands them back to the
        // next call that names it instead of holding them for their lease.
        let mut unanswered = Vec::new();
        while !shutdown.is_requested() {
            let call_id = CALLS.fetch_add(1, Ordering::Relaxed);
            let mut request = tonic::Request::new(v1::ClaimRequest {
                consumer: self.config.owner.clone(),
                max_rows: self.config.batch,
                wait_ms: self.config.long_poll.as_millis() as u32,
                max_bytes: self.config.max_message_bytes as u32,
                call_id,
                unanswered: unanswered.clone(),
            });
            request.set_timeout(self.config.long_poll + Duration::from_secs(10));
            // A claim answered after the relay stopped waiting is held until its lease runs out.
            let Some(claimed) = shutdown.unless_requested(self.outbox.claim(request)).await else { break };
            let rows = match claimed {
                Ok(reply) => {
                    unanswered.clear();
                    claim_backoff.reset();
                    reply.into_inner().rows
                }
                Err(status) => {
                    if unanswered.len() == UNANSWERED_NAMED {
                        unanswered.remove(0);
                    }
                    unanswered.push(call_id);
                    let transport = is_transport_failure(&status);
                    tracing::warn!(code = ?status.code(), error = status.message(), transport, "cannot claim outbox rows; pausing");
                    shutdown.unless_requested(claim_backoff.sleep()).await;
                    continue;
                }
            };
            if rows.is_empty() {
                continue;
            }
            // Publish the batch now; its PubAcks are awaited (and the rows marked done) in the
            // background while the next batch is claimed and published.
            let acks = match self.config.mode {
                Mode::JetStream => Acks::JetStream(self.send_jetstream(&rows).await),
                Mode::Core => Acks::Core(self.publish_core(&rows).await),
            };
            let mut paused = false;
            while settling.len() >= MAX_SETTLING {
                // Stopping: this batch is settled with the others, within their deadline.
                let Some(finished) = shutdown.unless_requested(settling.join_next()).await else { break };
                paused |= matches!(finished, Some(Ok(true)));
            }
            let (outbox, crash, delay) = (self.outbox.clone(), self.crash_after_puback, backoff.delay());
            settling.spawn(async move {
                let published = match acks {
                    Acks::JetStream(sent) => await_acks(&rows, sent).await,
                    Acks::Core(published) => published,
                };
                if crash && !published.done.is_empty() {
                    tracing::error!("failpoint relay_after_puback: aborting before marking rows done");
                    std::process::abort();
                }
                let unreachable = !published.retry.is_empty();
                settle(outbox, published, delay).await;
                unreachable
            });
            while let Some(finished) = settling.try_join_next() {
                paused |= matches!(finished, Ok(true));
            }
            if paused {
                tracing::warn!(delay = ?backoff.delay(), "the broker is unreachable; deferring rows without spending attempts and pausing");
                shutdown.unless_requested(backoff.sleep()).await;
            } else {
                backoff.reset();
            }
        }
        // Settles keep trying while the write service is unreachable; stopping, they have a
        // while. A row left unsettled stays claimed and comes back after its lease: one already
        // published is published again, and the broker drops the copy (its duplicate window).
        let settled = tokio::time::timeout(SETTLE_AT_STOP, async { while settling.join_next().await.is_some() {} });
        if settled.await.is_err() {
            tracing::warn!(batches = settling.len(), timeout = ?SETTLE_AT_STOP,
                "stopping with batches not settled: the write service did not answer; their rows come back after the lease");
            settling.abort_all();
        }
        tracing::info!("relay stopped");
    }

    fn message(&self, row: &v1::OutboxRow) -> (String, HeaderMap) {
        let mut headers = HeaderMap::new();
        let subject = if row.replay_handler.is_empty() {
            format!("{}.{}", self.config.subject_prefix, row.event_type)
        } else {
            headers.insert(reelay_delivery::consumer::REPLAY_OF_HEADER, row.replay_of.as_str());
            format!("{}.replay.{}.{}", self.config.subject_prefix, row.replay_handler, row.event_type)
        };
        if !row.event_id.is_empty() {
            headers.insert("Nats-Msg-Id", row.event_id.as_str());
        }
        let traceparent =
            reelay_delivery::consumer::decode_envelope(&row.payload, &row.event_id, &row.event_type, &row.aggregate_id)
                .traceparent;
        if !traceparent.is_empty() {
            headers.insert("traceparent", traceparent.as_str());
        }
        (subject, headers)
    }

    /// Sends every publish of the batch; the PubAcks come back later.
    async fn send_jetstream(&self, rows: &[v1::OutboxRow]) -> Vec<Sent> {
        let mut sent = Vec::with_capacity(rows.len());
        for row in rows {
            let (subject, headers) = self.message(row);
            sent.push(self.jetstream.publish_with_headers(subject, headers, row.payload.clone().into()).await);
        }
        sent
    }

    /// Publishes, then one flush: done when the flush returns.
    async fn publish_core(&self, rows: &[v1::OutboxRow]) -> Published {
        let mut published = Published { done: Vec::new(), retry: Vec::new(), refused: Vec::new(), duplicates: 0 };
        let mut sent = Vec::with_capacity(rows.len());
        for row in rows {
            let (subject, headers) = self.message(row);
            let claim = v1::RowClaim { id: row.id, claimed_at_ms: row.claimed_at_ms, stream_sequence: 0 };
            match self.nats.publish_with_headers(subject, headers, row.payload.clone().into()).await {
                Ok(()) => sent.push(claim),
                Err(error) if error.kind() == async_nats::client::PublishErrorKind::MaxPayloadExceeded => {
                    let reason = format!("undeliverable: {error}");
                    tracing::error!(row = row.id, event_id = %row.event_id, %reason, "the broker can never take this event");
                    published.refused.push(v1::FailedRow { row: Some(claim), error: reason, terminal: true });
                }
                Err(_) => published.retry.push(claim),
            }
        }
        match self.nats.flush().await {
            Ok(()) => published.done = sent,
            Err(_) => published.retry.extend(sent),
        }
        published
    }
}

/// A publish sent to JetStream, or the error sending it.
type Sent = Result<async_nats::jetstream::context::PublishAckFuture, async_nats::jetstream::context::PublishError>;

/// What is still to learn about a published batch.
enum Acks {
    JetStream(Vec<Sent>),
    /// Core NATS: the flush already said everything there is to know.
    Core(Published),
}

/// Awaits every PubAck of a batch (a duplicate PubAck is success).
async fn await_acks(rows: &[v1::OutboxRow], sent: Vec<Sent>) -> Published {
    let acks = join_all(sent.into_iter().map(|sent| async move {
        match sent {
            Ok(ack) => ack.await,
            Err(error) => Err(error),
        }
    }))
    .await;
    let mut published = Published { done: Vec::new(), retry: Vec::new(), refused: Vec::new(), duplicates: 0 };
    for (row, ack) in rows.iter().zip(acks) {
        let claim = v1::RowClaim { id: row.id, claimed_at_ms: row.claimed_at_ms, stream_sequence: 0 };
        match ack {
            Ok(ack) => {
                published.duplicates += usize::from(ack.duplicate);
                published.done.push(v1::RowClaim { stream_sequence: ack.sequence, ..claim });
            }
            Err(error)
                if matches!(
                    error.kind(),
                    PublishErrorKind::TimedOut | PublishErrorKind::BrokenPipe | PublishErrorKind::StreamNotFound
                ) || broker_unavailable(&error) =>
            {
                tracing::debug!(row = row.id, %error, "publish failed in transport, or the broker cannot store now");
                published.retry.push(claim);
            }
            Err(error) if error.kind() == PublishErrorKind::MaxPayloadExceeded => {
                // The write service refuses events over REELAY_MAX_EVENT_BYTES, so this row came
                // from before that limit or from a foreign writer: no retry will ever fit it.
                let reason = format!(
                    "undeliverable: the event is {} bytes, over the broker's max_payload ({error})",
                    row.payload.len()
                );
                tracing::error!(row = row.id, event_id = %row.event_id, %reason, "the broker can never take this event");
                published.refused.push(v1::FailedRow { row: Some(claim), error: reason, terminal: true });
            }
            Err(error) => {
                tracing::error!(row = row.id, event_id = %row.event_id, %error, "the broker refused an event");
                published.refused.push(v1::FailedRow { row: Some(claim), error: error.to_string(), terminal: false });
            }
        }
    }
    published
}

/// Whether JetStream refused a publish because it cannot store anything now: an outage of the
/// broker, not something wrong with the event, so it spends no attempt. That is any 5xx (503:
/// its store's disk is full or over its limits, "insufficient resources", JetStream not
/// available; 500: the stream offline) and the account's storage limit reached (400, error code
/// 10002, "resource limits exceeded for account": a hosted or shared NATS).
fn broker_unavailable(error: &async_nats::jetstream::context::PublishError) -> bool {
    use async_nats::jetstream::ErrorCode;
    std::error::Error::source(error)
        .and_then(|source| source.downcast_ref::<async_nats::jetstream::Error>())
        .is_some_and(|refusal| refusal.code() >= 500 || refusal.error_code() == ErrorCode::ACCOUNT_RESOURCES_EXCEEDED)
}

/// Marks published rows done, defers the ones that could not be sent, fails the refused.
/// Retried until the write service answers, so a PubAck is never forgotten by a live relay.
/// Deferred rows come back after `delay`.
async fn settle(outbox: OutboxClient<ServiceChannel>, published: Published, delay: Duration) {
    if published.duplicates > 0 {
        tracing::info!(
            duplicates = published.duplicates,
            "the broker already had some events (duplicate PubAck): treated as published"
        );
    }
    PUBLISHED.inc_by(&["duplicate"], published.duplicates as u64);
    PUBLISHED.inc_by(&["stored"], (published.done.len() - published.duplicates) as u64);
    DEFERRED.inc_by(&[], published.retry.len() as u64);
    REFUSED.inc_by(&[], published.refused.len() as u64);
    let until_ms = reelay_kit::now_ms() + delay.as_millis() as i64;
    for chunk in published.done.chunks(1000) {
        call_until_answered(&outbox, "complete", |mut outbox| {
            let rows = chunk.to_vec();
            async move { outbox.complete(v1::CompleteRequest { rows }).await.map(drop) }
        })
        .await;
    }
    for chunk in published.retry.chunks(1000) {
        call_until_answered(&outbox, "defer", |mut outbox| {
            let rows = chunk.to_vec();
            async move { outbox.defer(v1::DeferRequest { rows, until_ms }).await.map(drop) }
        })
        .await;
    }
    for chunk in published.refused.chunks(1000) {
        call_until_answered(&outbox, "fail", |mut outbox| {
            let rows = chunk.to_vec();
            async move { outbox.fail(v1::FailRequest { rows }).await.map(drop) }
        })
        .await;
    }
}

async fn call_until_answered<F, Fut>(outbox: &OutboxClient<ServiceChannel>, what: &str, mut call: F)
where
    F: FnMut(OutboxClient<ServiceChannel>) -> Fut,
    Fut: Future<Output = Result<(), tonic::Status>>,
{
    let mut backoff = relay_backoff();
    loop {
        match call(outbox.clone()).await {
            Ok(()) => return,
            Err(status) if is_transport_failure(&status) => {
                tracing::warn!(what, error = status.message(), "the write service is unreachable; retrying");
                backoff.sleep().await;
            }
            Err(status) => {
                // The rows stay claimed and come back after the lease; nothing is lost.
                tracing::error!(what, code = ?status.code(), error = status.message(), "the write service refused a settle");
                return;
            }
        }
    }
}
