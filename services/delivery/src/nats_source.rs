//! The `nats` event source: one handler's durable JetStream pull consumer.
//!
//! Settlements map onto JetStream acks: ack → ack; nak → nak with the retry delay; defer →
//! nak with the delay to the given time (JetStream has no nak that spares an attempt); term →
//! term. The last allowed delivery is naked without delay so the server's max-deliveries
//! advisory fires while a pull is waiting, and the event is logged as exhausted; the advisory
//! turns a last delivery that ended with no outcome into a dead letter (see [`crate::given_up`]).

use std::time::Duration;

use async_nats::jetstream::consumer::PullConsumer;
use async_nats::jetstream::{AckKind, Message};
use futures_util::StreamExt;

use crate::consumer::event_from_nats;
use crate::source::{AckHandle, Delivery, EventSource, Renewal, SettleKind, Settlement, Settler, SourceError};

pub struct JetStreamSource {
    client: async_nats::Client,
    consumer: PullConsumer,
    name: String,
    max_deliver: u32,
    ack_wait: Duration,
}

/// How long one pull waits for messages.
const PULL_EXPIRES: Duration = Duration::from_secs(2);

/// How long after a shutdown's hand-back a message is due again: past the expiry of the
/// stopping process's last pull, so that pull cannot take it again (and spend a delivery more
/// handing it back once more).
pub const HAND_BACK_AFTER: Duration = PULL_EXPIRES.saturating_add(Duration::from_secs(1));

impl JetStreamSource {
    pub fn new(
        client: async_nats::Client,
        consumer: PullConsumer,
        name: String,
        max_deliver: u32,
        ack_wait: Duration,
    ) -> Self {
        Self { client, consumer, name, max_deliver, ack_wait }
    }
}

/// How long past its expiry a pull may go unanswered before it is presumed lost with its
/// connection (a reconnect drops pull requests without a word).
const PULL_GRACE: Duration = Duration::from_secs(3);

/// Collects a pull's messages into `into`, giving up once `limit` has passed.
pub(crate) async fn collect<S>(mut batch: S, into: &mut Vec<Message>, limit: Duration) -> Result<(), SourceError>
where
    S: futures_util::Stream<Item = Result<Message, async_nats::Error>> + Unpin,
{
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        match tokio::time::timeout_at(deadline, batch.next()).await {
            Ok(Some(message)) => into.push(message.map_err(unavailable)?),
            Ok(None) => return Ok(()),
            Err(_) => return Err(SourceError::Unavailable("a pull request got no answer (connection lost?)".into())),
        }
    }
}

/// A JetStream message in hand.
pub struct MessageToken(pub Message);

impl std::fmt::Debug for MessageToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MessageToken").field("subject", &self.0.subject).finish()
    }
}

fn unavailable(error: impl std::fmt::Display) -> SourceError {
    SourceError::Unavailable(error.to_string())
}

#[async_trait::async_trait]
impl EventSource for JetStreamSource {
    type Token = MessageToken;
    type Settler = JetStreamSettler;

    fn settler(&self) -> JetStreamSettler {
        JetStreamSettler {
            client: self.client.clone(),
            name: self.name.clone(),
            max_deliver: self.max_deliver,
            ack_wait: self.ack_wait,
        }
    }

    /// Long-polls for one message (so a new event is handled as soon as it arrives, with no
    /// timer), then takes whatever else is already waiting without waiting again. No pull is
    /// left outstanding, so no message is delivered to this consumer that it is not holding.
    /// The first message says how many more the consumer held when it was sent; when none, the
    /// second pull (a round trip to the broker on the way to the handler) is skipped.
    async fn fetch(&mut self, max: usize) -> Result<Vec<Delivery<MessageToken>>, SourceError> {
        let mut messages = Vec::new();
        let first =
            self.consumer.batch().max_messages(1).expires(PULL_EXPIRES).messages().await.map_err(unavailable)?;
        collect(first, &mut messages, PULL_EXPIRES + PULL_GRACE).await?;
        let more_waiting = messages.first().is_some_and(|m| m.info().map_or(true, |info| info.pending > 0));
        if more_waiting && max > 1 {
            let rest = self.consumer.fetch().max_messages(max - 1).messages().await.map_err(unavailable)?;
            // What already arrived is ours to settle, whatever happens to the rest.
            if let Err(error) = collect(rest, &mut messages, PULL_GRACE).await {
                tracing::warn!(%error, "a follow-up pull failed; settling what arrived");
            }
        }
        let mut deliveries = Vec::with_capacity(messages.len());
        for message in messages {
            let delivered = message.info().map(|i| i.delivered).unwrap_or(1).max(1) as u32;
            let (event, event_id) = event_from_nats(&message);
            deliveries.push(Delivery {
                event,
                event_id,
                attempt: delivered,
                claimed: None,
                ack: AckHandle::new(MessageToken(message)),
            });
        }
        Ok(deliveries)
    }
}

/// Acks, naks and terms JetStream messages.
#[derive(Clone)]
pub struct JetStreamSettler {
    client: async_nats::Client,
    name: String,
    max_deliver: u32,
    ack_wait: Duration,
}

#[async_trait::async_trait]
impl Settler<MessageToken> for JetStreamSettler {
    async fn settle(&mut self, settlements: &[Settlement<MessageToken>]) -> Result<(), SourceError> {
        for settlement in settlements {
            let message = &settlement.ack.token().0;
            let delivered = message.info().map(|i| i.delivered).unwrap_or(1).max(1) as u32;
            let last = delivered >= self.max_deliver;
            let kind = match &settlement.kind {
                SettleKind::Ack => AckKind::Ack,
                SettleKind::Term { .. } => AckKind::Term,
                SettleKind::Nak { delay, .. } if !last => AckKind::Nak(Some(*delay)),
                SettleKind::Defer { until_ms } if !last => {
                    let wait = (*until_ms - reelay_kit::now_ms()).max(0) as u64;
                    AckKind::Nak(Some(Duration::from_millis(wait)))
                }
                SettleKind::Nak { .. } | SettleKind::Defer { .. } => {
                    let event_id =
                        message.headers.as_ref().and_then(|h| h.get("Nats-Msg-Id")).map(|v| v.as_str().to_owned());
                    tracing::error!(event_id = event_id.as_deref().unwrap_or(""), consumer = %self.name, deliveries = delivered,
                        "event exhausted max deliveries");
                    AckKind::Nak(None)
                }
            };
            message.ack_with(kind).await.map_err(unavailable)?;
        }
        self.client.flush().await.map_err(unavailable)
    }

    fn progress_interval(&self) -> Option<Duration> {
        Some(self.ack_wait / 3)
    }

    async fn in_progress(&mut self, deliveries: &[Delivery<MessageToken>]) -> Result<Renewal, SourceError> {
        for delivery in deliveries {
            delivery.ack.token().0.ack_with(AckKind::Progress).await.map_err(unavailable)?;
        }
        self.client.flush().await.map_err(unavailable)?;
        Ok(Renewal::Held(None))
    }
}
