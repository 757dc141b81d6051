//! Messages JetStream gave up, recorded as dead letters when nothing else recorded them.
//!
//! JetStream stops delivering a message to a consumer after `max_deliver` deliveries, or when it
//! is terminated, and keeps no record a Reelay operator could act on. The dispatcher records the
//! last failure of a claim it holds as a dead letter before it settles the message, but the last
//! delivery can end with no outcome: its worker was killed while the handler ran, it was deferred
//! to a claim held elsewhere that then never finished (a claim whose answer was lost, a worker
//! that stopped), or the dead letter could not be written (the ledger refused it, the process was
//! stopping). The server then says so once, in an advisory published to whoever listens at that
//! moment.
//!
//! A stream beside the event stream keeps those advisories (see
//! [`crate::jetstream::ensure_stream`]), and each hosted handler reads its own through a durable
//! consumer shared by its replicas. For each, the message is read back from the event stream by
//! its sequence and the ledger is told (`GivenUp`): a pair with no outcome becomes a dead letter
//! (an operator can list and replay it, as any other); a pair that finished is left alone; a pair
//! still under a live claim is asked about again when that claim's lease ends.

use std::time::Duration;

use async_nats::jetstream::consumer::PullConsumer;
use async_nats::jetstream::stream::{RawMessageErrorKind, Stream};
use async_nats::jetstream::{AckKind, Message};
use reelay_contracts::v1::{self, ledger_client::LedgerClient, ledger_given_up_outcome::Outcome};
use reelay_domain::EventId;
use reelay_kit::Shutdown;
use reelay_kit::client::{ServiceChannel, is_transport_failure};

use crate::consumer::event_from_parts;
use crate::pause::Pause;

/// Advisories read per pull.
const BATCH: usize = 64;
/// How long a pull waits for an advisory.
const PULL_WAIT: Duration = Duration::from_secs(2);
/// An advisory the ledger refused (or that could not be read) is looked at again after this.
const RETRY: Duration = Duration::from_secs(30);

/// What an advisory says: which message, and why the server stopped delivering it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Advisory {
    /// The message's sequence in the event stream.
    pub stream_seq: u64,
    pub deliveries: u32,
    /// `None` for max deliveries; the reason given (possibly empty) for a termination.
    pub terminated: Option<String>,
}

impl Advisory {
    /// Reads a max-deliveries or terminated advisory (JSON) published on `subject`.
    pub fn parse(subject: &str, payload: &[u8]) -> Result<Self, String> {
        let json: serde_json::Value =
            serde_json::from_slice(payload).map_err(|e| format!("not a JSON advisory: {e}"))?;
        let stream_seq = json["stream_seq"].as_u64().filter(|s| *s > 0).ok_or("no stream_seq")?;
        let deliveries = json["deliveries"].as_u64().unwrap_or(1).clamp(1, u64::from(u32::MAX)) as u32;
        let terminated =
            subject.contains(".MSG_TERMINATED.").then(|| json["reason"].as_str().unwrap_or_default().to_owned());
        Ok(Self { stream_seq, deliveries, terminated })
    }

    /// The dead letter's error.
    fn error(&self) -> String {
        match &self.terminated {
            None => format!(
                "JetStream stopped delivering the event after {} deliveries with no outcome recorded (the last run \
                 was stopped, or deferred to a claim that never finished)",
                self.deliveries
            ),
            Some(reason) if !reason.is_empty() => {
                format!("JetStream terminated the delivery with no outcome recorded: {reason}")
            }
            Some(_) => "JetStream terminated the delivery with no outcome recorded".to_owned(),
        }
    }
}

/// Reads the advisories of `handler`'s given-up messages until shutdown and tells the ledger.
pub struct GivenUpWatch {
    pub handler: String,
    pub advisories: PullConsumer,
    pub events: Stream,
    pub ledger: LedgerClient<ServiceChannel>,
    pub shutdown: Shutdown,
}

/// What to do with an advisory read.
enum Step {
    /// Ask the ledger about its pair.
    Ask(v1::LedgerGivenUp),
    /// Nothing to ask (logged): acknowledge it.
    Skip,
    /// Look at it again later.
    Later,
}

struct Pending {
    message: Message,
    step: Step,
}

impl GivenUpWatch {
    pub async fn run(mut self) {
        let shutdown = self.shutdown.clone();
        shutdown.unless_requested(self.watch()).await;
    }

    async fn watch(&mut self) {
        let mut broker = Pause::new("event source");
        loop {
            let mut messages = Vec::new();
            let pulled = match self.advisories.batch().max_messages(BATCH).expires(PULL_WAIT).messages().await {
                Ok(batch) => crate::nats_source::collect(batch, &mut messages, PULL_WAIT * 2).await,
                Err(error) => Err(crate::source::SourceError::Unavailable(error.to_string())),
            };
            if let Err(error) = pulled {
                // What arrived is still handled; the rest comes back after its ack wait.
                if messages.is_empty() {
                    broker.wait(&error.to_string()).await;
                    continue;
                }
            }
            broker.resumed();
            if messages.is_empty() {
                continue;
            }
            let mut pending = Vec::with_capacity(messages.len());
            for message in messages {
                let step = self.step_for(&message).await;
                pending.push(Pending { message, step });
            }
            self.record(pending).await;
        }
    }

    /// The ledger question an advisory raises, if the advisory and the message it names are usable.
    async fn step_for(&self, message: &Message) -> Step {
        let advisory = match Advisory::parse(&message.subject, &message.payload) {
            Ok(advisory) => advisory,
            Err(error) => {
                tracing::warn!(handler = %self.handler, subject = %message.subject, %error, "skipping an unreadable advisory");
                return Step::Skip;
            }
        };
        let event = match self.events.get_raw_message(advisory.stream_seq).await {
            Ok(event) => event,
            Err(error) if matches!(error.kind(), RawMessageErrorKind::NoMessageFound) => {
                tracing::error!(handler = %self.handler, stream_seq = advisory.stream_seq,
                    "JetStream gave up a message that is no longer in the stream: its event cannot be named, \
                     so it is not recorded as a dead letter");
                return Step::Skip;
            }
            Err(error) => {
                tracing::warn!(handler = %self.handler, stream_seq = advisory.stream_seq, %error,
                    "could not read a given-up message back from the stream; trying again later");
                return Step::Later;
            }
        };
        // When the advisory was stored: the moment the server gave the message up.
        let given_up_at = message.info().ok().map(|info| info.published);
        if given_up_at.is_some_and(|at| event.time > at) {
            tracing::warn!(handler = %self.handler, stream_seq = advisory.stream_seq,
                "an advisory older than the message now at its sequence (the event stream was made again): skipped");
            return Step::Skip;
        }
        let (_, event_id) = event_from_parts(Some(&event.headers), &event.subject, &event.payload);
        // Only events with an outbox id have ledger rows (others are delivered without dedup).
        let Some(event_id) = event_id.filter(|id| EventId::parse("event_id", id).is_ok()) else {
            tracing::warn!(handler = %self.handler, stream_seq = advisory.stream_seq,
                "JetStream gave up a message without an outbox event id (delivered without the ledger, so no dead letter)");
            return Step::Skip;
        };
        Step::Ask(v1::LedgerGivenUp {
            key: Some(v1::LedgerKey { event_id, handler: self.handler.clone() }),
            attempts: advisory.deliveries,
            error: advisory.error(),
            replay: replay_number(event.headers.get("Nats-Msg-Id").map(|v| v.as_str())),
            given_up_at_ms: given_up_at.map_or(0, |at| (at.unix_timestamp_nanos() / 1_000_000) as i64),
        })
    }

    /// Tells the ledger, then acknowledges each advisory it settled and hands back, for later,
    /// each whose pair a live claim still holds (or that could not be asked about now).
    async fn record(&mut self, pending: Vec<Pending>) {
        let asks: Vec<v1::LedgerGivenUp> = pending
            .iter()
            .filter_map(|p| match &p.step {
                Step::Ask(ask) => Some(ask.clone()),
                Step::Skip | Step::Later => None,
            })
            .collect();
        let mut answers = Vec::with_capacity(asks.len());
        if !asks.is_empty() {
            match self.ask(&asks).await {
                Ok(outcomes) => answers = outcomes,
                // One pair the ledger refuses must not hold back the others: ask one by one.
                Err(status) if status.code() == tonic::Code::InvalidArgument && asks.len() > 1 => {
                    for ask in &asks {
                        match self.ask(std::slice::from_ref(ask)).await {
                            Ok(mut outcome) => answers.push(outcome.pop().unwrap_or(Answer::Missing)),
                            Err(status) => answers.push(Answer::Refused(status)),
                        }
                    }
                }
                Err(status) => answers.extend(asks.iter().map(|_| Answer::Refused(status.clone()))),
            }
        }
        let mut answers = answers.into_iter();
        for p in pending {
            let kind = match p.step {
                Step::Skip => AckKind::Ack,
                Step::Later => AckKind::Nak(Some(RETRY)),
                Step::Ask(ask) => {
                    let key = ask.key.unwrap_or_default();
                    match answers.next().unwrap_or(Answer::Missing) {
                        Answer::Outcome(Outcome::HeldUntilMs(until)) => {
                            let wait = (until - reelay_kit::now_ms()).max(1_000) as u64;
                            AckKind::Nak(Some(Duration::from_millis(wait)))
                        }
                        Answer::Outcome(Outcome::DeadLettered(_)) => {
                            tracing::error!(handler = %self.handler, event_id = %key.event_id, error = %ask.error,
                                "recorded a message JetStream gave up as a dead letter");
                            AckKind::Ack
                        }
                        Answer::Outcome(Outcome::Finished(_)) => AckKind::Ack,
                        Answer::Refused(status) if status.code() == tonic::Code::InvalidArgument => {
                            tracing::error!(handler = %self.handler, event_id = %key.event_id, error = status.message(),
                                "the ledger refuses this given-up message for good; it is not recorded");
                            AckKind::Ack
                        }
                        Answer::Refused(status) => {
                            tracing::error!(handler = %self.handler, event_id = %key.event_id, code = ?status.code(),
                                error = status.message(), "the ledger refused a given-up message; asking again later");
                            AckKind::Nak(Some(RETRY))
                        }
                        Answer::Missing => AckKind::Nak(Some(RETRY)),
                    }
                }
            };
            if let Err(error) = p.message.ack_with(kind).await {
                tracing::warn!(handler = %self.handler, %error, "could not settle a given-up advisory; it comes back");
            }
        }
    }

    /// One `GivenUp` call, repeated while the ledger is unreachable: an answer per pair, in order.
    async fn ask(&mut self, given_up: &[v1::LedgerGivenUp]) -> Result<Vec<Answer>, tonic::Status> {
        let mut pause = Pause::new("ledger");
        loop {
            match self.ledger.given_up(v1::LedgerGivenUpRequest { given_up: given_up.to_vec() }).await {
                Ok(reply) => {
                    pause.resumed();
                    let outcomes = reply.into_inner().outcomes;
                    let answers = outcomes.into_iter().map(|o| o.outcome.map_or(Answer::Missing, Answer::Outcome));
                    return Ok(answers.collect());
                }
                Err(status) if is_transport_failure(&status) => pause.wait(status.message()).await,
                Err(status) => return Err(status),
            }
        }
    }
}

/// The ledger's word on one given-up pair.
enum Answer {
    Outcome(Outcome),
    Refused(tonic::Status),
    /// The answer left it out.
    Missing,
}

/// Which copy of an event a message is, from its `Nats-Msg-Id`: a replay's is
/// `<event id>:replay:<n>:<handler>`; the event's own (0) is the event id.
fn replay_number(message_id: Option<&str>) -> u32 {
    message_id
        .and_then(|id| id.split(':').nth(2).filter(|_| id.contains(":replay:")))
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::{Advisory, replay_number};

    #[test]
    fn a_replays_number_is_read_from_its_message_id() {
        let id = "0190a000-0000-7000-8000-000000000001";
        assert_eq!(replay_number(Some(id)), 0);
        assert_eq!(replay_number(Some(&format!("{id}:replay:3:search"))), 3);
        assert_eq!(replay_number(Some(&format!("{id}:replay:x:search"))), 0);
        assert_eq!(replay_number(None), 0);
    }

    #[test]
    fn advisories_are_read_or_refused() {
        let max = br#"{"type":"io.nats.jetstream.advisory.v1.max_deliver","stream":"S","consumer":"handler-a","stream_seq":42,"deliveries":5}"#;
        let parsed = Advisory::parse("$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.S.handler-a", max).unwrap();
        assert_eq!(parsed, Advisory { stream_seq: 42, deliveries: 5, terminated: None });
        assert!(parsed.error().contains("after 5 deliveries"), "{}", parsed.error());
        let term = br#"{"stream_seq":7,"deliveries":1,"reason":"bad payload"}"#;
        let parsed = Advisory::parse("$JS.EVENT.ADVISORY.CONSUMER.MSG_TERMINATED.S.handler-a", term).unwrap();
        assert_eq!(parsed.terminated.as_deref(), Some("bad payload"));
        assert!(parsed.error().ends_with("no outcome recorded: bad payload"), "{}", parsed.error());
        for bad in [&b"not json"[..], br#"{"deliveries":1}"#, br#"{"stream_seq":0}"#] {
            assert!(Advisory::parse("$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.S.a", bad).is_err());
        }
    }
}
