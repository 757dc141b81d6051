//! `federation-delivery`: one queued activity, POSTed signed to one inbox.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use bytes::Bytes;
use reelay_activitypub::documents::server_of;
use reelay_contracts::v1::{self, event::Payload};
use reelay_delivery::{Handler, HandlerError};

use crate::Remote;
use crate::remote::{fetch_error, write_error};

/// The most servers [`DeliveryHandler`] remembers; past it, it forgets them all and starts over.
const MAX_SERVERS_REMEMBERED: usize = 10_000;

/// How long recording a delivery's outcome may take: it must not hold up the next delivery.
const RECORD_TIMEOUT: Duration = Duration::from_secs(5);

/// How long an answer this process recorded for a server stands for the deliveries queued
/// while it was failing: theirs are not reported again within it (after a short outage at a
/// large server, thousands would each be a write that changes nothing).
const ANSWER_STANDS: Duration = Duration::from_secs(60);

/// What this process last saw of a server.
#[derive(Clone, Copy)]
enum Seen {
    /// A delivery failed there, and no answer was recorded since.
    Failing,
    /// Its answer was recorded then.
    Answered(Instant),
}

pub struct DeliveryHandler {
    remote: Remote,
    /// Servers by what this process last saw of them: an answer from one it saw failing is
    /// reported even for an event queued before its failures were recorded.
    servers: Mutex<HashMap<String, Seen>>,
}

impl DeliveryHandler {
    pub fn new(remote: Remote) -> Self {
        Self { remote, servers: Mutex::default() }
    }

    fn servers(&self) -> std::sync::MutexGuard<'_, HashMap<String, Seen>> {
        self.servers.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
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

    /// Tells the write service what the delivery met at `inbox`'s server: every failure, and an
    /// answer when the server is known to be failing. Best effort, and quick: the delivery's own
    /// outcome stands whether or not this is recorded, and a server left marked failing is
    /// cleared by its next answer.
    async fn record(&self, queued: &v1::ActivityQueued, answered: bool) {
        let Some(server) = server_of(&queued.inbox) else { return };
        {
            let mut servers = self.servers();
            let seen = servers.get(&server).copied();
            if answered {
                let report = match seen {
                    Some(Seen::Failing) => true,
                    Some(Seen::Answered(at)) => queued.inbox_failing && at.elapsed() > ANSWER_STANDS,
                    None => queued.inbox_failing,
                };
                if !report {
                    return;
                }
            } else {
                // Known failing from now, before the report: an answer meanwhile is reported.
                if servers.len() >= MAX_SERVERS_REMEMBERED && seen.is_none() {
                    servers.clear();
                }
                servers.insert(server.clone(), Seen::Failing);
            }
        }
        let request = v1::RecordInboxOutcomeRequest { inbox: queued.inbox.clone(), answered };
        let recorded = tokio::time::timeout(RECORD_TIMEOUT, self.remote.write().record_inbox_outcome(request))
            .await
            .unwrap_or_else(|_| Err(tonic::Status::deadline_exceeded(format!("not answered in {RECORD_TIMEOUT:?}"))));
        match recorded {
            Ok(_) if answered => {
                self.servers().insert(server, Seen::Answered(Instant::now()));
            }
            Ok(_) => {}
            // A write service of an older build: nothing to record with.
            Err(status) if status.code() == tonic::Code::Unimplemented => {
                tracing::debug!(inbox = %queued.inbox, "the write service records no delivery outcomes");
            }
            Err(status) => {
                if answered {
                    // Still known failing: the next answer is reported.
                    self.servers().insert(server, Seen::Failing);
                }
                tracing::warn!(inbox = %queued.inbox, answered, error = %status.message(),
                    "could not record what the delivery met at the inbox's server");
            }
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
        let status = answer.status;
        match status {
            // The server works (a 410 says only the inbox is gone).
            200..=299 | 410 => self.record(queued, true).await,
            // Our key could not be fetched just then, too slow, or too many requests: nothing
            // against the server, and a probe so answered finds it up (the delivery is retried
            // as any other, below).
            401 | 408 | 429 if queued.probe => self.record(queued, true).await,
            401 | 429 => {}
            _ => {
                self.record(queued, false).await;
                if queued.probe {
                    return self.unless_probe(queued, HandlerError::retryable(format!("answered {status}")));
                }
            }
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
