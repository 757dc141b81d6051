//! The `db` event source: rows claimed from the outbox through the write service's Outbox API.
//! One row carries its event to every hosted handler.

use std::collections::BTreeMap;
use std::time::Duration;

use reelay_contracts::v1::{self, outbox_client::OutboxClient};

use crate::client::{ServiceChannel, is_transport_failure};
use crate::consumer::decode_envelope;
use crate::source::{AckHandle, Delivery, EventSource, SettleKind, Settlement, Settler, SourceError};

/// A claimed outbox row: its id and claim token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowToken {
    pub id: i64,
    pub claimed_at_ms: i64,
}

pub struct OutboxSource {
    client: OutboxClient<ServiceChannel>,
    consumer: String,
    /// How long one claim waits for rows before returning empty.
    long_poll: Duration,
    /// The largest claim answer this process reads (its gRPC message limit).
    max_message_bytes: usize,
}

impl OutboxSource {
    pub fn new(
        channel: ServiceChannel,
        consumer: impl Into<String>,
        long_poll: Duration,
        max_message_bytes: usize,
    ) -> Self {
        let client = OutboxClient::new(channel).max_decoding_message_size(max_message_bytes);
        Self { client, consumer: consumer.into(), long_poll, max_message_bytes }
    }
}

fn source_error(status: tonic::Status) -> SourceError {
    if is_transport_failure(&status) {
        SourceError::Unavailable(format!("{:?}: {}", status.code(), status.message()))
    } else {
        SourceError::Rejected(format!("{:?}: {}", status.code(), status.message()))
    }
}

fn claim(token: &RowToken) -> v1::RowClaim {
    v1::RowClaim { id: token.id, claimed_at_ms: token.claimed_at_ms }
}

#[async_trait::async_trait]
impl EventSource for OutboxSource {
    type Token = RowToken;
    type Settler = OutboxSettler;

    fn settler(&self) -> OutboxSettler {
        OutboxSettler { client: self.client.clone() }
    }

    async fn fetch(&mut self, max: usize) -> Result<Vec<Delivery<RowToken>>, SourceError> {
        let wait_ms = self.long_poll.as_millis() as u32;
        let mut request = tonic::Request::new(v1::ClaimRequest {
            consumer: self.consumer.clone(),
            max_rows: max as u32,
            wait_ms,
            max_bytes: self.max_message_bytes as u32,
        });
        request.set_timeout(self.long_poll + Duration::from_secs(10));
        let rows = self.client.claim(request).await.map_err(source_error)?.into_inner().rows;
        Ok(rows
            .into_iter()
            .map(|row| Delivery {
                event: decode_envelope(&row.payload, &row.event_id, &row.event_type, &row.aggregate_id),
                event_id: (!row.event_id.is_empty()).then_some(row.event_id),
                attempt: row.attempts + 1,
                ack: AckHandle::new(RowToken { id: row.id, claimed_at_ms: row.claimed_at_ms }),
            })
            .collect())
    }
}

/// Settles claimed rows through the Outbox API.
#[derive(Clone)]
pub struct OutboxSettler {
    client: OutboxClient<ServiceChannel>,
}

#[async_trait::async_trait]
impl Settler<RowToken> for OutboxSettler {
    async fn settle(&mut self, settlements: &[Settlement<RowToken>]) -> Result<(), SourceError> {
        let mut done = Vec::new();
        let mut failed = Vec::new();
        let mut deferred: BTreeMap<i64, Vec<v1::RowClaim>> = BTreeMap::new();
        for s in settlements {
            let row = claim(s.ack.token());
            match &s.kind {
                SettleKind::Ack => done.push(row),
                // The write service applies retry_backoff itself from the row's attempts, which
                // is the same schedule the runtime asked for.
                SettleKind::Nak { error, .. } => {
                    failed.push(v1::FailedRow { row: Some(row), error: error.clone(), terminal: false })
                }
                SettleKind::Term { reason } => {
                    failed.push(v1::FailedRow { row: Some(row), error: reason.clone(), terminal: true })
                }
                SettleKind::Defer { until_ms } => deferred.entry(*until_ms).or_default().push(row),
            }
        }
        let mut lost = Vec::new();
        if !done.is_empty() {
            let reply = self.client.complete(v1::CompleteRequest { rows: done }).await.map_err(source_error)?;
            lost.extend(reply.into_inner().lost);
        }
        if !failed.is_empty() {
            let reply = self.client.fail(v1::FailRequest { rows: failed }).await.map_err(source_error)?;
            lost.extend(reply.into_inner().lost);
        }
        for (until_ms, rows) in deferred {
            let reply = self.client.defer(v1::DeferRequest { rows, until_ms }).await.map_err(source_error)?;
            lost.extend(reply.into_inner().lost);
        }
        if !lost.is_empty() {
            tracing::warn!(rows = ?lost, "outbox rows were reclaimed by another consumer before this one settled them");
        }
        Ok(())
    }
}
