//! `NATS_MODE=core`: one handler's queue-group subscription on core NATS. No acks and no
//! redelivery exist here: a delivery that fails is lost for that handler (the README says what
//! this mode gives up). The ledger still stops two workers handling one event at once.

use std::time::Duration;

use futures_util::StreamExt;

use crate::consumer::event_from_nats;
use crate::source::{AckHandle, Delivery, EventSource, SettleKind, Settlement, Settler, SourceError};

pub struct CoreSource {
    client: async_nats::Client,
    subject: String,
    subscriber: async_nats::Subscriber,
    name: String,
    wait: Duration,
}

impl CoreSource {
    /// Subscribes to every event subject in the queue group `handler-<name>`, so replicas of a
    /// handler share the messages.
    pub async fn subscribe(
        client: &async_nats::Client,
        subject_prefix: &str,
        handler: &str,
    ) -> Result<Self, SourceError> {
        let name = crate::jetstream::JetStreamConfig::consumer_name(handler);
        let subject = format!("{subject_prefix}.>");
        let subscriber = subscribe(client, &subject, &name).await?;
        Ok(Self { client: client.clone(), subject, subscriber, name, wait: Duration::from_secs(5) })
    }
}

async fn subscribe(
    client: &async_nats::Client,
    subject: &str,
    group: &str,
) -> Result<async_nats::Subscriber, SourceError> {
    client
        .queue_subscribe(subject.to_owned(), group.to_owned())
        .await
        .map_err(|e| SourceError::Unavailable(e.to_string()))
}

#[async_trait::async_trait]
impl EventSource for CoreSource {
    type Token = ();
    type Settler = CoreSettler;

    fn settler(&self) -> CoreSettler {
        CoreSettler { name: self.name.clone() }
    }

    async fn fetch(&mut self, max: usize) -> Result<Vec<Delivery<()>>, SourceError> {
        let mut deliveries = Vec::new();
        let first = match tokio::time::timeout(self.wait, self.subscriber.next()).await {
            Ok(Some(first)) => first,
            Err(_) => return Ok(deliveries),
            // The subscription ended (the server or the client closed it): subscribed again,
            // or the consumer pauses on the error (an empty batch at once, every time, spun).
            Ok(None) => {
                tracing::warn!(consumer = %self.name, "the core NATS subscription ended; subscribing again");
                self.subscriber = subscribe(&self.client, &self.subject, &self.name).await?;
                return Ok(deliveries);
            }
        };
        let mut next = Some(first);
        while let Some(message) = next.take() {
            let (event, event_id) = event_from_nats(&message);
            deliveries.push(Delivery { event, event_id, attempt: 1, claimed: None, ack: AckHandle::new(()) });
            if deliveries.len() < max {
                next = futures_util::FutureExt::now_or_never(self.subscriber.next()).flatten();
            }
        }
        Ok(deliveries)
    }
}

/// Core NATS has nothing to settle; failures are only logged.
#[derive(Clone)]
pub struct CoreSettler {
    name: String,
}

#[async_trait::async_trait]
impl Settler<()> for CoreSettler {
    async fn settle(&mut self, settlements: &[Settlement<()>]) -> Result<(), SourceError> {
        let dropped = settlements.iter().filter(|s| !matches!(s.kind, SettleKind::Ack)).count();
        if dropped > 0 {
            tracing::warn!(consumer = %self.name, dropped,
                "core NATS cannot redeliver: these deliveries are lost for this handler (use NATS_MODE=jetstream)");
        }
        Ok(())
    }
}
