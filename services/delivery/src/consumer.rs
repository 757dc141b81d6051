//! The consumer loop every handler service runs: fetch a batch, dispatch it through the
//! ledger, settle it, repeat. An unreachable event source or ledger pauses the loop (nothing
//! is settled, so no attempt is spent). Shutdown fetches nothing more and settles the batches in
//! hand: what their handlers finished, and the events a handler taking one at a time had not
//! started, handed back (see [`crate::dispatch`]).

use std::sync::Arc;

use prost::Message;
use reelay_kit::Shutdown;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use crate::dispatch::{Dispatched, Dispatcher, STAND_BY_POLL, Verdict};
use crate::pause::Pause;
use crate::source::{Delivery, EventSource, LeaseWatch, Renewal, Settlement, Settler, SourceError, while_renewing};

pub async fn run_consumer<S: EventSource>(
    mut source: S,
    dispatcher: Dispatcher,
    batch_size: usize,
    in_flight: usize,
    shutdown: Shutdown,
) {
    if reelay_kit::failpoint_armed("consumer_task_panics") {
        panic!("failpoint consumer_task_panics");
    }
    tracing::info!(handlers = ?dispatcher.handler_names(), batch_size, in_flight, "consumer started");
    // Up to `in_flight` batches are worked on while the next is fetched, so one slow handler
    // call (an index commit) does not hold back the start of the next event.
    let permits = Arc::new(Semaphore::new(in_flight.max(1)));
    let mut batches = JoinSet::new();
    let mut source_pause = Pause::new("event source");
    let mut standing_by = false;
    while !shutdown.is_requested() {
        // Its builds are told to the ledger at least every quarter lease, idle or not: a build
        // not heard from for a few leases counts as gone.
        if dispatcher.due_to_tell()
            && let Err(unavailable) = dispatcher.ask_standing_by().await
        {
            source_pause.wait(&unavailable.0).await;
            continue;
        }
        // A handler standing by (another build of it claims) fetches nothing: on nats each
        // message it fetched it could only hand back, spending a delivery of it.
        if let Some(why) = dispatcher.standing_by() {
            stand_by(&mut standing_by, &why, &shutdown).await;
            if let Err(unavailable) = dispatcher.ask_standing_by().await {
                source_pause.wait(&unavailable.0).await;
            }
            continue;
        }
        // Waiting for a batch in hand to end can take as long as that batch: a shutdown asked
        // meanwhile fetches nothing more (what it fetched, it could only hand back or run past
        // the grace period).
        let acquired = permits.clone().acquire_owned();
        let Some(permit) = shutdown.unless_requested(acquired).await else { break };
        let permit = permit.expect("the semaphore is never closed");
        while batches.try_join_next().is_some() {}
        // The fetch is not raced against shutdown: dropping a claim in flight could strand rows
        // until their lease ends. Fetches wait only briefly, so shutdown is still prompt.
        // A lease on what it claims counts from no later than now (see `LeaseWatch`).
        let asked = tokio::time::Instant::now();
        let deliveries = match source.fetch(batch_size).await {
            Ok(deliveries) => {
                source_pause.resumed();
                if !deliveries.is_empty() && std::mem::take(&mut standing_by) {
                    tracing::info!("handed deliveries again: no longer standing by");
                }
                deliveries
            }
            Err(SourceError::StandingBy(why)) => {
                stand_by(&mut standing_by, &why, &shutdown).await;
                continue;
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
        let (settler, dispatcher, shutdown) = (source.settler(), dispatcher.clone(), shutdown.clone());
        batches.spawn(async move {
            process_batch(deliveries, asked, dispatcher, settler, shutdown).await;
            drop(permit);
        });
    }
    while batches.join_next().await.is_some() {}
    tracing::info!("consumer stopped");
}

/// Waits before asking again while another build of the handler claims, saying so once when
/// it starts (`standing_by` records that it did).
async fn stand_by(standing_by: &mut bool, why: &str, shutdown: &Shutdown) {
    if !std::mem::replace(standing_by, true) {
        tracing::warn!(%why, "standing by: another build of this handler claims its deliveries");
    }
    shutdown.unless_requested(tokio::time::sleep(STAND_BY_POLL)).await;
}

/// Dispatches one batch, fetched by a call sent at `asked`, through the ledger and settles it.
async fn process_batch<T, X>(
    deliveries: Vec<Delivery<T>>,
    asked: tokio::time::Instant,
    mut dispatcher: Dispatcher,
    mut settler: X,
    shutdown: Shutdown,
) where
    T: Send + Sync + 'static,
    X: Settler<T>,
{
    let mut ledger_pause = Pause::new("ledger");
    let mut lease = settler.lease(asked);
    // Without a lease (JetStream's ack wait), progress is due a period after the fetch, then
    // after each report, however many calls (dispatches failing fast, pauses) the wait spans.
    let mut reported = asked;
    let dispatched = loop {
        let dispatch = dispatcher.dispatch(&deliveries);
        let dispatched = with_progress(&settler, &deliveries, &mut lease, &mut reported, dispatch).await;
        match dispatched {
            Some(Ok(Some(dispatched))) => {
                ledger_pause.resumed();
                break Some(dispatched);
            }
            None | Some(Ok(None)) => return abandon(deliveries.len()),
            Some(Err(_)) if shutdown.is_requested() => break None,
            Some(Err(unavailable)) => {
                // Hold on to the deliveries (reporting progress) rather than failing them:
                // an outage of any length must not use up their attempts.
                let pause = ledger_pause.wait(&unavailable.0);
                let waited = with_progress(&settler, &deliveries, &mut lease, &mut reported, pause);
                if waited.await.is_none() {
                    return abandon(deliveries.len());
                }
            }
        }
    };
    let (verdicts, ledger) = match dispatched {
        Some(Dispatched { verdicts, ledger }) => (Some(verdicts), ledger),
        None => (None, Default::default()),
    };
    // The ledger and the deliveries are settled at the same time, so the write service can
    // commit both in one transaction; either order is safe (a redelivery meets a done ledger
    // row, or an idempotent handler). Dead letters and the releases of handed-back claims go
    // first (see `LedgerSettlement::goes_first`); the deliveries, waiting for them through a
    // ledger outage, are reported in progress meanwhile (no lease: the claims the ledger
    // settles are what the wait is for, and a renewal only ever says `Lost` on db, whose
    // ledger settlement is empty).
    let ledger = if ledger.goes_first() {
        let settled = dispatcher.settle_ledger(ledger);
        if with_progress(&settler, &deliveries, &mut None, &mut reported, settled).await.is_none() {
            tracing::warn!("deliveries taken over while their ledger claims were settled");
        }
        None
    } else {
        Some(ledger)
    };
    let settlements: Vec<Settlement<T>> = match verdicts {
        Some(verdicts) => deliveries.into_iter().zip(verdicts).map(|(d, v)| settlement(d, v)).collect(),
        // Stopping while the ledger is down: hand the deliveries back for someone else now.
        None => deliveries.into_iter().map(|d| d.ack.defer(reelay_kit::now_ms())).collect(),
    };
    match ledger {
        None => settle(&mut settler, &settlements, &shutdown).await,
        Some(ledger) => {
            tokio::join!(dispatcher.settle_ledger(ledger), settle(&mut settler, &settlements, &shutdown));
        }
    }
}

/// Settles deliveries, pausing while the source is unreachable.
async fn settle<T, X>(settler: &mut X, settlements: &[Settlement<T>], shutdown: &Shutdown)
where
    T: Send + Sync + 'static,
    X: Settler<T>,
{
    let mut settle_pause = Pause::new("event source");
    loop {
        match settler.settle(settlements).await {
            Ok(()) => {
                settle_pause.resumed();
                break;
            }
            Err(SourceError::Unavailable(error)) if !shutdown.is_requested() => settle_pause.wait(&error).await,
            Err(error) => {
                // The claims expire and the events come back; the ledger skips what finished.
                tracing::error!(%error, deliveries = settlements.len(), "could not settle deliveries; they will be redelivered");
                break;
            }
        }
    }
}

/// Gives up a batch whose claims can no longer be held (see [`LeaseWatch`]): nothing of it is
/// settled, and its deliveries come back once their lease ends.
fn abandon(deliveries: usize) {
    tracing::warn!(
        deliveries,
        "the batch's claims were not confirmed for five sixths of their lease (renewals unanswered, or the claim's own answer that late), or were taken over: its work is dropped unsettled and comes back"
    );
}

/// Runs `work` while telling the source, as often as it needs, that `deliveries` are in hand.
/// With a lease (`lease`), the work is dropped (`None`) when it can no longer be held: a
/// renewal says another consumer has the deliveries, or none succeeded for most of the lease.
async fn with_progress<T, X, F>(
    source: &X,
    deliveries: &[Delivery<T>],
    lease: &mut Option<LeaseWatch>,
    reported: &mut tokio::time::Instant,
    work: F,
) -> Option<F::Output>
where
    T: Send + Sync + 'static,
    X: Settler<T>,
    F: Future,
{
    let Some(interval) = source.progress_interval() else { return Some(work.await) };
    let report = || {
        let mut source = source.clone();
        async move {
            match source.in_progress(deliveries).await {
                Ok(renewal) => renewal,
                Err(error) => {
                    tracing::warn!(%error, "could not report deliveries in progress");
                    Renewal::Unanswered
                }
            }
        }
    };
    while_renewing(work, interval, lease, reported, report).await
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

/// The header a replay carries: the id of the event it republishes (its `Nats-Msg-Id` is the
/// replay's own, `<event id>:replay:<n>:<handler>`).
pub const REPLAY_OF_HEADER: &str = "Reelay-Replay-Of";

/// The event a NATS message carries, and its dedup id (the `Nats-Msg-Id` header, or for a
/// replay the event it republishes, or the envelope's id when a publisher set no header). The
/// event type is the subject's last token.
pub fn event_from_nats(message: &async_nats::Message) -> (reelay_contracts::v1::Event, Option<String>) {
    event_from_parts(message.headers.as_ref(), &message.subject, &message.payload)
}

/// [`event_from_nats`] for a message's parts (a message read back from the stream by sequence
/// comes in another type).
pub fn event_from_parts(
    headers: Option<&async_nats::HeaderMap>,
    subject: &str,
    payload: &[u8],
) -> (reelay_contracts::v1::Event, Option<String>) {
    let header = |name: &str| headers.and_then(|h| h.get(name)).map(|v| v.as_str().to_owned());
    let header_id = header(REPLAY_OF_HEADER).or_else(|| header("Nats-Msg-Id")).unwrap_or_default();
    let event_type = subject.rsplit('.').next().unwrap_or_default();
    let event = decode_envelope(payload, &header_id, event_type, "");
    let event_id = if header_id.is_empty() { event.event_id.clone() } else { header_id };
    (event, (!event_id.is_empty()).then_some(event_id))
}
