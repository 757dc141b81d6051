//! Per-handler delivery on the db backend (part of the Outbox service): claim one handler's
//! deliveries (long-polling like `Claim`), settle, renew, and take back a dead predecessor's
//! claims. The storage side is `reelay_outbox::deliveries`.

use std::sync::{Arc, LazyLock, Mutex};
use std::time::Duration;

use futures_util::future::BoxFuture;
use reelay_contracts::v1::{self, delivery_settlement::Outcome};
use reelay_kit::metrics::{self, Gauge};
use reelay_kit::{ServiceError, now_ms};
use reelay_outbox::deliveries::{
    self, ClaimError, ClaimedDelivery, DeliveryOutcome, HandlerClaim, HandlerPolicy, Settlement,
};
use reelay_outbox::{AfterCommit, Database, Durability, Rider, WriteTx};
use tokio::sync::oneshot;
use tokio::time::Instant;

use super::internal::{MAX_BATCH_KEYS, handler_name};
use super::outbox::{FALLBACK_POLL, MAX_CLAIM_ROWS, MAX_CLAIM_WAIT_MS, OutboxApi};
use crate::WriteError;

impl From<ClaimError> for WriteError {
    fn from(error: ClaimError) -> Self {
        match error {
            ClaimError::UnknownHandler(_) => ServiceError::failed_precondition(error.to_string()).into(),
            ClaimError::Sql(error) => error.into(),
        }
    }
}

/// Registers the handlers this deployment delivers to (cursors for the new ones), before the
/// write service takes writes, so no event written from now on is missed by any of them.
pub async fn register_handlers(db: &Database, handlers: Vec<String>) -> Result<Vec<String>, WriteError> {
    db.writer
        .transact::<_, WriteError, _>("startup_register_handlers", move |tx: &mut WriteTx| {
            Box::pin(async move { Ok(deliveries::register(tx, &handlers, tx.now_ms()).await?) })
        })
        .await
}

type ClaimAnswer = Result<Vec<ClaimedDelivery>, WriteError>;

static WAITING: LazyLock<Gauge> = LazyLock::new(|| {
    metrics::gauge(
        "reelay_delivery_claims_waiting",
        "Handlers' delivery claims waiting with the writer for new events (db backend).",
        &[],
    )
});

/// A handler's claim waiting for new events.
struct Parked {
    id: u64,
    request: HandlerClaim,
    reply: oneshot::Sender<ClaimAnswer>,
}

/// Handlers' claims waiting for new events. The writer hands them the events in the batch that
/// commits them when no synced job is waiting (this is its [`Rider`]): the claims are written
/// after the batch's events, in the same transaction and under the same fsync, and answered
/// once that commits. A busy writer leaves them to the commit signal, as before. Without it a
/// waiting claim learned of the commit, looked, and claimed in a batch and a commit of its own:
/// a second fsync between a write and its handlers, and a claim job for every handler that
/// takes none of the new events (only to move its cursor past them).
///
/// A claim the writer took is always answered: with what it claimed, with the batch's failure,
/// or with nothing (none of its types, another replica was first, or the claim's statements
/// failed), and the claimer then looks again the ordinary way.
#[derive(Clone)]
pub(super) struct WaitingClaims {
    parked: Arc<Mutex<(u64, Vec<Parked>)>>,
    policy: HandlerPolicy,
}

impl WaitingClaims {
    pub(super) fn new(policy: HandlerPolicy) -> Self {
        WAITING.set(&[], 0.0);
        Self { parked: Arc::default(), policy }
    }

    fn park(&self, request: HandlerClaim) -> WaitingClaim {
        let (reply, answer) = oneshot::channel();
        let mut parked = self.parked.lock().expect("never poisoned: no panics while held");
        parked.0 += 1;
        let id = parked.0;
        parked.1.push(Parked { id, request, reply });
        WAITING.set(&[], parked.1.len() as f64);
        WaitingClaim { waiting: self.clone(), id, answer }
    }

    /// Takes a claim back; false when the writer has it (its answer is coming).
    fn unpark(&self, id: u64) -> bool {
        let mut parked = self.parked.lock().expect("never poisoned");
        let before = parked.1.len();
        parked.1.retain(|p| p.id != id);
        WAITING.set(&[], parked.1.len() as f64);
        parked.1.len() < before
    }
}

/// One parked claim, from the claimer's side. Dropped (its call cancelled, say), it takes the
/// claim back: nothing is claimed for a claimer that went away, which would hold those
/// deliveries until their lease ran out.
struct WaitingClaim {
    waiting: WaitingClaims,
    id: u64,
    answer: oneshot::Receiver<ClaimAnswer>,
}

impl WaitingClaim {
    /// Takes the claim back; false when the writer has it (its answer is coming).
    fn take_back(&self) -> bool {
        self.waiting.unpark(self.id)
    }
}

impl Drop for WaitingClaim {
    fn drop(&mut self) {
        self.take_back();
    }
}

impl Rider for WaitingClaims {
    fn wants(&self) -> bool {
        !self.parked.lock().expect("never poisoned").1.is_empty()
    }

    /// Claims for every waiting handler, also those that take none of the batch's event types:
    /// their cursors move past the new rows here, not in a claim job after the commit.
    fn ride<'t>(&'t self, tx: &'t mut WriteTx) -> BoxFuture<'t, Result<AfterCommit, sqlx::Error>> {
        Box::pin(async move {
            let taken = {
                let mut parked = self.parked.lock().expect("never poisoned");
                WAITING.set(&[], 0.0);
                std::mem::take(&mut parked.1)
            };
            let requests: Vec<HandlerClaim> = taken.iter().map(|p| p.request.clone()).collect();
            match deliveries::claim_many(tx, tx.now_ms(), self.policy, &requests).await {
                Ok(answers) => {
                    let replies: Vec<_> = taken.into_iter().map(|p| p.reply).zip(answers).collect();
                    Ok(Box::new(move |committed: Result<(), reelay_outbox::CommitError>| {
                        for (reply, answer) in replies {
                            let answer = match (&committed, answer) {
                                (_, Ok(claimed)) if claimed.is_empty() => Ok(claimed),
                                (Err(error), _) => Err(error.clone().into()),
                                (Ok(()), answer) => answer.map_err(WriteError::from),
                            };
                            let _ = reply.send(answer);
                        }
                    }) as AfterCommit)
                }
                Err(error) => {
                    // Rolled back: nothing was claimed; the claimers look again.
                    for p in taken {
                        let _ = p.reply.send(Ok(Vec::new()));
                    }
                    Err(error)
                }
            }
        })
    }
}

fn claims(claims: Vec<v1::DeliveryClaim>) -> Result<Vec<(String, i64)>, ServiceError> {
    if claims.is_empty() || claims.len() > MAX_BATCH_KEYS {
        return Err(ServiceError::invalid(
            "claims",
            format!("must hold 1..={MAX_BATCH_KEYS} claims, got {}", claims.len()),
        ));
    }
    Ok(claims.into_iter().map(|c| (c.key, c.token)).collect())
}

impl OutboxApi {
    pub(super) async fn claim_deliveries(
        &self,
        r: v1::ClaimDeliveriesRequest,
    ) -> Result<v1::ClaimDeliveriesResponse, WriteError> {
        let handler = handler_name("handler", &r.handler)?;
        if !(1..=MAX_CLAIM_ROWS).contains(&r.max_rows) {
            return Err(
                ServiceError::invalid("max_rows", format!("must be 1..={MAX_CLAIM_ROWS}, got {}", r.max_rows)).into()
            );
        }
        if r.wait_ms > MAX_CLAIM_WAIT_MS {
            return Err(ServiceError::invalid(
                "wait_ms",
                format!("must be at most {MAX_CLAIM_WAIT_MS}, got {}", r.wait_ms),
            )
            .into());
        }
        if r.event_types.is_empty() {
            return Err(ServiceError::invalid("event_types", "must name at least one event type").into());
        }
        if r.owner.is_empty() {
            return Err(ServiceError::invalid("owner", "is required (<instance>#<incarnation>)").into());
        }
        let request = HandlerClaim {
            handler,
            event_types: r.event_types,
            owner: r.owner,
            max_rows: r.max_rows,
            max_bytes: self.answer_bytes(r.max_bytes),
        };
        let deadline = Instant::now() + Duration::from_millis(u64::from(r.wait_ms));
        let claimed = self.wait_for_deliveries(deadline, request).await?;
        let deliveries = claimed
            .into_iter()
            .map(|d: ClaimedDelivery| v1::Delivery {
                row_id: d.row_id,
                key: d.key,
                event_type: d.event_type,
                aggregate_id: d.aggregate_id,
                payload: d.payload,
                attempt: d.attempt,
                token: d.token,
            })
            .collect();
        Ok(v1::ClaimDeliveriesResponse { deliveries })
    }

    /// Claims as soon as there is something to claim, waiting up to `deadline`: it looks first
    /// (an empty claim would still cost a write job), claims what is due, and otherwise waits
    /// with the writer for the next batch with events (see [`WaitingClaims`]), for the next due
    /// time, or for any commit that adds events.
    async fn wait_for_deliveries(
        &self,
        deadline: Instant,
        request: HandlerClaim,
    ) -> Result<Vec<ClaimedDelivery>, WriteError> {
        let mut commits = self.db.writer.subscribe_commits();
        loop {
            // Mark the commits seen before looking, so one landing after the look wakes us.
            commits.borrow_and_update();
            let (due, wake) = self.peek_deliveries(&request.handler, deadline).await?;
            if due {
                let claimed = self.claim_deliveries_now(request.clone()).await?;
                if !claimed.is_empty() {
                    return Ok(claimed);
                }
            }
            if Instant::now() >= deadline || self.shutdown.is_requested() {
                return Ok(Vec::new());
            }
            let mut parked = self.waiting.park(request.clone());
            let mut closed = false;
            tokio::select! {
                biased;
                answered = &mut parked.answer => match answered {
                    Ok(Ok(claimed)) if claimed.is_empty() => continue,
                    Ok(answered) => return answered,
                    Err(_) => continue,
                },
                changed = commits.changed() => closed = changed.is_err(),
                () = tokio::time::sleep_until(wake) => {}
                () = self.shutdown.requested() => closed = true,
            }
            if !parked.take_back() {
                // The writer has it in a batch: its answer comes with that batch's commit.
                match (&mut parked.answer).await {
                    Ok(Ok(claimed)) if claimed.is_empty() => {}
                    Ok(answered) => return answered,
                    Err(_) => {}
                }
            }
            if closed {
                return Ok(Vec::new());
            }
        }
    }

    async fn claim_deliveries_now(&self, request: HandlerClaim) -> Result<Vec<ClaimedDelivery>, WriteError> {
        let policy = self.deliveries;
        self.delivery_claims
            .submit(&self.db, "claim_deliveries", Durability::Synced, request, move |tx: &mut WriteTx, requests| {
                Box::pin(async move {
                    let answers = deliveries::claim_many(tx, tx.now_ms(), policy, &requests).await?;
                    Ok(answers.into_iter().map(|answer| answer.map_err(WriteError::from)).collect())
                })
            })
            .await
    }

    /// Whether the handler has anything to claim, and when to look again if not.
    async fn peek_deliveries(&self, handler: &str, deadline: Instant) -> Result<(bool, Instant), WriteError> {
        let mut conn = self.db.reads.acquire().await?;
        let now = now_ms();
        let (due, next_due) = deliveries::peek(&mut conn, handler, now, self.deliveries).await?;
        let fallback = Instant::now() + FALLBACK_POLL;
        let next = next_due.map_or(fallback, |at| Instant::now() + Duration::from_millis((at - now).max(0) as u64));
        Ok((due, next.min(fallback).min(deadline)))
    }

    pub(super) async fn settle_deliveries(
        &self,
        r: v1::SettleDeliveriesRequest,
    ) -> Result<v1::SettleDeliveriesResponse, WriteError> {
        let handler = handler_name("handler", &r.handler)?;
        if r.settlements.is_empty() || r.settlements.len() > MAX_BATCH_KEYS {
            return Err(ServiceError::invalid(
                "settlements",
                format!("must hold 1..={MAX_BATCH_KEYS} settlements, got {}", r.settlements.len()),
            )
            .into());
        }
        let settlements = r
            .settlements
            .into_iter()
            .map(|s| {
                let claim = s.claim.ok_or_else(|| ServiceError::invalid("settlements.claim", "is required"))?;
                let outcome = match s.outcome {
                    Some(Outcome::Done(_)) => DeliveryOutcome::Done,
                    Some(Outcome::Failed(failure)) => {
                        DeliveryOutcome::Failed { error: failure.error, terminal: failure.terminal }
                    }
                    Some(Outcome::DeferredUntilMs(until_ms)) if until_ms > 0 => DeliveryOutcome::Deferred { until_ms },
                    Some(Outcome::DeferredUntilMs(_)) => {
                        return Err(ServiceError::invalid(
                            "settlements.deferred_until_ms",
                            "must be a time in milliseconds since the epoch",
                        ));
                    }
                    None => return Err(ServiceError::invalid("settlements.outcome", "is required")),
                };
                Ok(Settlement { key: claim.key, token: claim.token, outcome })
            })
            .collect::<Result<Vec<_>, ServiceError>>()?;
        let policy = self.deliveries;
        let settled = self
            .delivery_settlements
            .submit(
                &self.db,
                "settle_deliveries",
                Durability::Deferred,
                (handler, settlements),
                move |tx: &mut WriteTx, requests| {
                    Box::pin(async move {
                        let requests: Vec<(&str, &[Settlement])> = requests
                            .iter()
                            .map(|(handler, settlements)| (handler.as_str(), settlements.as_slice()))
                            .collect();
                        let answers = deliveries::settle_many(tx, &requests, tx.now_ms(), policy).await?;
                        Ok(answers.into_iter().map(Ok).collect())
                    })
                },
            )
            .await?;
        Ok(v1::SettleDeliveriesResponse {
            settled: settled.settled as u32,
            lost: settled.lost,
            dead_lettered: settled.dead_lettered,
        })
    }

    pub(super) async fn renew_deliveries(
        &self,
        r: v1::RenewDeliveriesRequest,
    ) -> Result<v1::RenewDeliveriesResponse, WriteError> {
        let handler = handler_name("handler", &r.handler)?;
        let keys = claims(r.claims)?;
        let lost = self
            .db
            .writer
            .transact::<_, WriteError, _>("renew_deliveries", move |tx: &mut WriteTx| {
                Box::pin(async move { Ok(deliveries::renew(tx, &handler, &keys, tx.now_ms()).await?) })
            })
            .await?;
        Ok(v1::RenewDeliveriesResponse { lost })
    }

    pub(super) async fn release_instance(
        &self,
        r: v1::ReleaseInstanceRequest,
    ) -> Result<v1::ReleaseInstanceResponse, WriteError> {
        if r.instance.is_empty() || r.instance.contains('#') {
            return Err(ServiceError::invalid("instance", "is required and must not contain '#'").into());
        }
        if r.incarnation.is_empty() {
            return Err(ServiceError::invalid("incarnation", "is required").into());
        }
        let me = format!("{}#{}", r.instance, r.incarnation);
        let instance = r.instance.clone();
        let released = self
            .db
            .writer
            .transact::<_, WriteError, _>("release_instance", move |tx: &mut WriteTx| {
                Box::pin(async move { Ok(deliveries::release_instance(tx, &instance, &me, tx.now_ms()).await?) })
            })
            .await?;
        if released > 0 {
            tracing::warn!(instance = %r.instance, claims = released,
                "took back the claims an earlier run of this instance still held (it stopped without settling them)");
        }
        Ok(v1::ReleaseInstanceResponse { released })
    }
}
