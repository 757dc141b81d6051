//! `federation-delivery`: one queued activity, POSTed signed to one inbox.

use bytes::Bytes;
use reelay_contracts::v1::{self, event::Payload};
use reelay_delivery::{Handler, HandlerError};

use crate::Remote;
use crate::remote::write_error;

pub struct DeliveryHandler {
    remote: Remote,
}

impl DeliveryHandler {
    pub fn new(remote: Remote) -> Self {
        Self { remote }
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
        let answer = self.remote.post(&queued.sender_user_id, &queued.inbox, body).await?;
        let status = answer.status;
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
