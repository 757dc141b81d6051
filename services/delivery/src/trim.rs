//! Trimming the event stream: the relay deletes the messages every delivered handler is done
//! with, so the stream holds what some handler still needs and not every event ever written.
//!
//! The stream keeps its limits retention (a message stays whatever its consumers did, so a
//! handler whose consumer does not exist yet loses nothing, and a message the server gave up
//! stays readable for its advisory). The trim deletes below the lowest ack floor of the
//! delivered handlers' consumers: every message there was acknowledged, or given up, by every
//! handler that takes it. It holds off while
//!
//! - a delivered handler has no consumer yet (its processes have not started: it will read the
//!   stream from the start), or
//! - a given-up advisory is not yet recorded by its handler (recording one reads the message it
//!   names back from the stream); the advisories are looked at a while after the floors, so one
//!   the server sent as it gave a message up below the floor has reached its stream by then.
//!
//! An operator's own consumer of the stream does not hold it back; `REELAY_STREAM_TRIM_INTERVAL_MS=0`
//! turns trimming off.

use std::time::Duration;

use async_nats::jetstream::{self, context::ConsumerInfoErrorKind};
use reelay_kit::Shutdown;

use crate::jetstream::{JetStreamConfig, SetupError, filters_with};

/// How long after reading the floors the given-up advisories are looked at.
const ADVISORY_SETTLE: Duration = Duration::from_secs(2);

/// What one pass did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Trimmed {
    /// Deleted the messages below `below` (`purged` of them were left).
    Below { below: u64, purged: u64 },
    /// Nothing every handler is done with is left in the stream.
    Nothing,
    /// Held off, and why.
    Held(String),
}

pub struct StreamTrim {
    js: jetstream::Context,
    config: JetStreamConfig,
    /// The handlers the deployment delivers to.
    handlers: Vec<String>,
    interval: Duration,
    settle: Duration,
}

impl StreamTrim {
    pub fn new(js: jetstream::Context, config: JetStreamConfig, handlers: Vec<String>, interval: Duration) -> Self {
        Self { js, config, handlers, interval, settle: ADVISORY_SETTLE.min(interval) }
    }

    /// Trims every `interval` until shutdown; a failed pass is logged and tried again next time.
    pub async fn run(self, shutdown: Shutdown) {
        let mut last_held = None;
        loop {
            tokio::select! {
                () = shutdown.requested() => return,
                () = tokio::time::sleep(self.interval) => {}
            }
            match self.trim_once().await {
                Ok(Trimmed::Below { below, purged }) => {
                    last_held = None;
                    if purged > 0 {
                        tracing::info!(stream = %self.config.stream, below, purged, "trimmed the event stream of messages every handler is done with");
                    }
                }
                Ok(Trimmed::Nothing) => last_held = None,
                Ok(Trimmed::Held(why)) => {
                    if last_held.as_ref() != Some(&why) {
                        tracing::info!(stream = %self.config.stream, reason = %why, "not trimming the event stream for now");
                    }
                    last_held = Some(why);
                }
                Err(error) => tracing::warn!(stream = %self.config.stream, %error, "could not trim the event stream"),
            }
        }
    }

    /// One pass: reads the floors, waits for advisories to settle, then deletes below the floor.
    pub async fn trim_once(&self) -> Result<Trimmed, SetupError> {
        let js_error =
            |what: String, error: &dyn std::fmt::Display| SetupError::JetStream { what, message: error.to_string() };
        let stream_name = &self.config.stream;
        let stream = self
            .js
            .get_stream(stream_name)
            .await
            .map_err(|e| js_error(format!("looking up stream {stream_name}"), &e))?;
        // Read before the consumers: each message up to `last` is in their counts below.
        let state = stream.get_info().await.map_err(|e| js_error(format!("reading stream {stream_name}"), &e))?.state;
        let mut floor = state.last_sequence;
        for handler in &self.handlers {
            let name = JetStreamConfig::consumer_name(handler);
            let info = match stream.consumer_info(&name).await {
                Ok(info) => info,
                Err(error) if error.kind() == ConsumerInfoErrorKind::NotFound => {
                    return Ok(Trimmed::Held(format!("handler {handler} has no consumer yet")));
                }
                Err(error) => return Err(js_error(format!("reading consumer {name}"), &error)),
            };
            // A consumer with nothing undelivered and nothing unacknowledged needs no message up
            // to `last`. Otherwise its ack floor: the ack floor of a consumer that was never
            // handed a message of its types stays 0, however far the stream went.
            if info.num_pending > 0 || info.num_ack_pending > 0 {
                floor = floor.min(info.ack_floor.stream_sequence);
            }
        }
        if floor < state.first_sequence {
            return Ok(Trimmed::Nothing);
        }
        tokio::time::sleep(self.settle).await;
        let given_up_name = self.config.given_up_stream();
        let given_up = self
            .js
            .get_stream(&given_up_name)
            .await
            .map_err(|e| js_error(format!("looking up stream {given_up_name}"), &e))?;
        for handler in &self.handlers {
            let name = JetStreamConfig::given_up_consumer_name(handler);
            let info = match given_up.consumer_info(&name).await {
                Ok(info) => info,
                Err(error) if error.kind() == ConsumerInfoErrorKind::NotFound => {
                    return Ok(Trimmed::Held(format!("handler {handler} has no consumer of given-up advisories yet")));
                }
                Err(error) => return Err(js_error(format!("reading consumer {name}"), &error)),
            };
            // One that lacks an advisory subject (an older build's, or edited by hand) does not
            // count the advisories it would take once its handler's next start adds it.
            let subjects = self.config.given_up_subjects(&JetStreamConfig::consumer_name(handler));
            if filters_with(&info.config, subjects).is_some() {
                return Ok(Trimmed::Held(format!(
                    "handler {handler}'s consumer of given-up advisories lacks a subject"
                )));
            }
            if info.num_pending > 0 || info.num_ack_pending > 0 {
                return Ok(Trimmed::Held(format!("handler {handler} has given-up advisories to record")));
            }
        }
        let purged = stream
            .purge()
            .sequence(floor + 1)
            .await
            .map_err(|e| js_error(format!("purging stream {stream_name} below {}", floor + 1), &e))?
            .purged;
        Ok(Trimmed::Below { below: floor + 1, purged })
    }
}
