//! `federation-delivery`: one queued activity, POSTed signed to one inbox.

use std::collections::HashSet;
use std::sync::Mutex;
use std::time::Duration;

use bytes::Bytes;
use reelay_activitypub::documents::server_of;
use reelay_contracts::v1::{self, event::Payload};
use reelay_delivery::{Handler, HandlerError};

use crate::Remote;
use crate::remote::{fetch_error, write_error};

/// The most servers [`DeliveryHandler`] remembers seeing fail.
const MAX_FAILING_REMEMBERED: usize = 10_000;

/// How long recording a delivery's outcome may take: it must not hold up the next delivery.
const RECORD_TIMEOUT: Duration = Duration::from_secs(5);

pub struct DeliveryHandler {
    remote: Remote,
    /// Servers a delivery from this process failed at, not seen answering since: an answer from
    /// one is reported even for an event queued before its failures were recorded.
    failing: Mutex<HashSet<String>>,
}

impl DeliveryHandler {
    pub fn new(remote: Remote) -> Self {
        Self { remote, failing: Mutex::default() }
    }

    /// `failure`, unless this delivery is a probe of an unavailable server: that one is dropped
    /// (the server stays unavailable; the next probe goes with a later activity).
    fn unless_probe(&self, queued: &v1::ActivityQueued, failure: HandlerError) -> Result<(), HandlerError> {
        if !queued.probe {
            return Err(failure);
        }
        tracing::info!(activity = %queued.activity_id, inbox = %queued.inbox, %failure,
            "the probe of an unavailable server failed; dropped");
        Ok(())
    }

    /// Tells the write service what the delivery met at `inbox`'s server (an answer only when
    /// the server is known to be failing). Best effort, and quick: the delivery's own outcome
    /// stands whether or not this is recorded, and a server left marked failing is cleared by
    /// its next answer.
    async fn record(&self, queued: &v1::ActivityQueued, answered: bool) {
        let Some(server) = server_of(&queued.inbox) else { return };
        {
            let failing = self.failing.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            if answered && !failing.contains(&server) && !queued.inbox_failing {
                return;
            }
        }
        let request = v1::RecordInboxOutcomeRequest { inbox: queued.inbox.clone(), answered };
        let recorded = tokio::time::timeout(RECORD_TIMEOUT, self.remote.write().record_inbox_outcome(request))
            .await
            .unwrap_or_else(|_| Err(tonic::Status::deadline_exceeded(format!("not answered in {RECORD_TIMEOUT:?}"))));
        {
            // Known failing until an answer is recorded.
            let mut failing = self.failing.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            if answered && recorded.is_ok() {
                failing.remove(&server);
            } else if !answered && failing.len() < MAX_FAILING_REMEMBERED {
                failing.insert(server);
            }
        }
        match recorded {
            Ok(_) => {}
            // A write service of an older build: nothing to record with.
            Err(status) if status.code() == tonic::Code::Unimplemented => {
                tracing::debug!(inbox = %queued.inbox, "the write service records no delivery outcomes");
            }
            Err(status) => tracing::warn!(inbox = %queued.inbox, answered, error = %status.message(),
                "could not record what the delivery met at the inbox's server"),
        }
    }
}

#[async_trait::async_trait]
impl Handler for DeliveryHandler {
    fn name(&self) -> &'static str {
        "federation-delivery"
    }

    fn event_types(&self) -> &'static [&'static str] {
        &["ActivityQueued"]
    }

    async fn handle(&self, event: &v1::Event) -> Result<(), HandlerError> {
        let Some(Payload::ActivityQueued(queued)) = &event.payload else { return Ok(()) };
        // The same bytes every time: a redelivery is a replay of the same activity.
        let body = Bytes::from(queued.activity_json.clone());
        let answer = match self.remote.post(&queued.sender_user_id, &queued.inbox, body).await? {
            Ok(answer) => answer,
            Err(error) => {
                self.record(queued, false).await;
                return self.unless_probe(queued, fetch_error(error));
            }
        };
        match answer.status {
            // The server works (a 410 says only the inbox is gone).
            200..=299 | 410 => self.record(queued, true).await,
            // Our key could not be fetched just then, or too many requests: nothing against it.
            401 | 429 => {}
            _ => self.record(queued, false).await,
        }
        let status = answer.status;
        if queued.probe && !matches!(status, 200..=299 | 410) {
            return self.unless_probe(queued, HandlerError::retryable(format!("answered {status}")));
        }
        match status {
            200..=299 => {
                tracing::info!(activity = %queued.activity_id, inbox = %queued.inbox, status, "activity delivered");
                Ok(())
            }
            410 => {
                // The inbox is gone for good: so are the followers who received there.
                let request = v1::RemoveFollowersAtRequest {
                    user_id: queued.sender_user_id.clone(),
                    inbox: queued.inbox.clone(),
                };
                let removed = self.remote.write().remove_followers_at(request).await.map_err(write_error)?;
                tracing::info!(inbox = %queued.inbox, removed = removed.into_inner().changed,
                    "inbox gone (410): its followers are removed");
                Ok(())
            }
            // Refused for good: any other 4xx. Not 401, which a server answers when it could not
            // fetch the signer's key just then (this gateway briefly down, say), nor 408 or 429.
            400..=499 if !matches!(status, 401 | 408 | 429) => Err(HandlerError::permanent(format!(
                "{} refused {} with {status}: {}",
                queued.inbox,
                queued.activity_id,
                String::from_utf8_lossy(&answer.body).chars().take(200).collect::<String>()
            ))),
            // 5xx, those three, and what an inbox should not answer a POST with (a redirect: a
            // domain moving, a proxy misconfigured) are retried on the usual schedule, as
            // Mastodon's deliveries do.
            _ => Err(HandlerError::retryable(format!("{} answered {status}", queued.inbox))),
        }
    }
}
