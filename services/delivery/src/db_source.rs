//! The `db` event source: one handler's deliveries, claimed from the outbox through the write
//! service's Outbox API (`ClaimDeliveries`). Each (event, handler) has its own attempts, retry
//! schedule and fate in the write service, so one handler never holds back another.
//!
//! A delivery arrives with its ledger claim already held (the same `processed_events` row):
//! settling it (done, failed, deferred) settles the claim too, and while the handler works the
//! source renews the claim's lease, so a live consumer keeps it and a dead one's comes back in
//! seconds.

use std::time::Duration;

use reelay_contracts::v1::{self, delivery_settlement::Outcome, outbox_client::OutboxClient};
use reelay_domain::EventId;
use reelay_kit::client::{ServiceChannel, is_transport_failure};

use crate::consumer::decode_envelope;
use crate::source::{AckHandle, Delivery, EventSource, SettleKind, Settlement, Settler, SourceError};

/// One delivery's claim: its ledger key and token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeliveryClaim {
    pub key: String,
    pub token: i64,
}

/// Where one handler's deliveries come from.
#[derive(Debug, Clone)]
pub struct DeliverySourceConfig {
    pub handler: &'static str,
    pub event_types: Vec<String>,
    /// `<instance>#<incarnation>` of this process.
    pub owner: String,
    /// How long one claim waits for deliveries before returning empty.
    pub long_poll: Duration,
    /// The largest claim answer this process reads (its gRPC message limit).
    pub max_message_bytes: usize,
    /// The write service takes a claim over when it is not renewed for this long.
    pub lease: Duration,
}

pub struct DeliverySource {
    client: OutboxClient<ServiceChannel>,
    config: DeliverySourceConfig,
}

impl DeliverySource {
    pub fn new(channel: ServiceChannel, config: DeliverySourceConfig) -> Self {
        let client = OutboxClient::new(channel).max_decoding_message_size(config.max_message_bytes);
        Self { client, config }
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
        DeliverySettler { client: self.client.clone(), handler: self.config.handler, lease: self.config.lease }
    }

    async fn fetch(&mut self, max: usize) -> Result<Vec<Delivery<DeliveryClaim>>, SourceError> {
        let config = &self.config;
        let mut request = tonic::Request::new(v1::ClaimDeliveriesRequest {
            handler: config.handler.to_owned(),
            event_types: config.event_types.clone(),
            owner: config.owner.clone(),
            max_rows: max as u32,
            wait_ms: config.long_poll.as_millis() as u32,
            max_bytes: config.max_message_bytes as u32,
        });
        request.set_timeout(config.long_poll + Duration::from_secs(10));
        let deliveries = self.client.claim_deliveries(request).await.map_err(source_error)?.into_inner().deliveries;
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

/// Settles and renews one handler's deliveries through the Outbox API.
#[derive(Clone)]
pub struct DeliverySettler {
    client: OutboxClient<ServiceChannel>,
    handler: &'static str,
    lease: Duration,
}

#[async_trait::async_trait]
impl Settler<DeliveryClaim> for DeliverySettler {
    async fn settle(&mut self, settlements: &[Settlement<DeliveryClaim>]) -> Result<(), SourceError> {
        let mut lost = Vec::new();
        for chunk in settlements.chunks(1000) {
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

    fn progress_interval(&self) -> Option<Duration> {
        Some(self.lease / 3)
    }

    async fn in_progress(&mut self, deliveries: &[Delivery<DeliveryClaim>]) -> Result<(), SourceError> {
        for chunk in deliveries.chunks(1000) {
            let claims = chunk.iter().map(|d| claim(d.ack.token())).collect();
            let request = v1::RenewDeliveriesRequest { handler: self.handler.to_owned(), claims };
            let lost = self.client.renew_deliveries(request).await.map_err(source_error)?.into_inner().lost;
            if !lost.is_empty() {
                tracing::warn!(handler = self.handler, keys = ?lost, "claims lost while still working on them");
            }
        }
        Ok(())
    }
}
