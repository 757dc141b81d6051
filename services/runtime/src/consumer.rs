//! The consumer loop every handler service runs: fetch a batch, dispatch it through the
//! ledger, settle it, repeat. An unreachable event source or ledger pauses the loop (nothing
//! is settled, so no attempt is spent); shutdown lets the batch in hand finish first.

use prost::Message;

use crate::Shutdown;
use crate::dispatch::{Dispatcher, Verdict};
use crate::pause::Pause;
use crate::source::{Delivery, EventSource, Settlement, SourceError};

pub async fn run_consumer<S: EventSource>(
    mut source: S,
    mut dispatcher: Dispatcher,
    batch_size: usize,
    shutdown: Shutdown,
) {
    tracing::info!(handlers = ?dispatcher.handler_names(), batch_size, "consumer started");
    let mut source_pause = Pause::new("event source");
    let mut ledger_pause = Pause::new("ledger");
    while !shutdown.is_requested() {
        // The fetch is not raced against shutdown: dropping a claim in flight could strand rows
        // until their lease ends. Fetches wait only a few seconds, so shutdown is still prompt.
        let deliveries = match source.fetch(batch_size).await {
            Ok(deliveries) => {
                source_pause.resumed();
                deliveries
            }
            Err(SourceError::Unavailable(error)) => {
                source_pause.wait(&error).await;
                continue;
            }
            Err(SourceError::Rejected(error)) => {
                tracing::error!(%error, "fetching events failed");
                source_pause.wait(&error).await;
                continue;
            }
        };
        if deliveries.is_empty() {
            continue;
        }
        let verdicts = loop {
            let dispatched = with_progress(&mut source, &deliveries, dispatcher.dispatch(&deliveries)).await;
            match dispatched {
                Ok(verdicts) => {
                    ledger_pause.resumed();
                    break Some(verdicts);
                }
                Err(_) if shutdown.is_requested() => break None,
                Err(unavailable) => {
                    // Hold on to the deliveries (reporting progress) rather than failing them:
                    // an outage of any length must not use up their attempts.
                    with_progress(&mut source, &deliveries, ledger_pause.wait(&unavailable.0)).await;
                }
            }
        };
        let settlements: Vec<Settlement<S::Token>> = match verdicts {
            Some(verdicts) => deliveries.into_iter().zip(verdicts).map(|(d, v)| settlement(d, v)).collect(),
            // Stopping while the ledger is down: hand the deliveries back for someone else now.
            None => deliveries.into_iter().map(|d| d.ack.defer(reelay_outbox::now_ms())).collect(),
        };
        loop {
            match source.settle(&settlements).await {
                Ok(()) => {
                    source_pause.resumed();
                    break;
                }
                Err(SourceError::Unavailable(error)) if !shutdown.is_requested() => source_pause.wait(&error).await,
                Err(error) => {
                    // The claims expire and the events come back; the ledger skips what finished.
                    tracing::error!(%error, deliveries = settlements.len(), "could not settle deliveries; they will be redelivered");
                    break;
                }
            }
        }
    }
    tracing::info!("consumer stopped");
}

/// Runs `work` while telling the source, as often as it needs, that `deliveries` are in hand.
async fn with_progress<S: EventSource, F: Future>(
    source: &mut S,
    deliveries: &[Delivery<S::Token>],
    work: F,
) -> F::Output {
    let Some(interval) = source.progress_interval() else { return work.await };
    tokio::pin!(work);
    let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + interval, interval);
    loop {
        tokio::select! {
            output = &mut work => return output,
            _ = ticks.tick() => {
                if let Err(error) = source.in_progress(deliveries).await {
                    tracing::warn!(%error, "could not report deliveries in progress");
                }
            }
        }
    }
}

fn settlement<T>(delivery: Delivery<T>, verdict: Verdict) -> Settlement<T> {
    match verdict {
        Verdict::Ack => delivery.ack.ack(),
        Verdict::Nak { delay, error } => delivery.ack.nak(delay, error),
        Verdict::Defer { until_ms } => delivery.ack.defer(until_ms),
        Verdict::Term { reason } => {
            tracing::error!(event_id = delivery.event_id.as_deref().unwrap_or(""), %reason, "handler gave up on the event for good");
            delivery.ack.term(reason)
        }
    }
}

/// Decodes an envelope; a payload that is not one (a foreign writer's row) becomes an event
/// with the row's metadata and no payload, which handlers treat as nothing to do.
pub fn decode_envelope(
    payload: &[u8],
    event_id: &str,
    event_type: &str,
    aggregate_id: &str,
) -> reelay_contracts::v1::Event {
    match reelay_contracts::v1::Event::decode(payload) {
        Ok(event) if event.event_type == event_type => event,
        _ => reelay_contracts::v1::Event {
            event_id: event_id.to_owned(),
            event_type: event_type.to_owned(),
            aggregate_id: aggregate_id.to_owned(),
            ..Default::default()
        },
    }
}
