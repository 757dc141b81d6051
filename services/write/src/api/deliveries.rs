//! Per-handler delivery on the db backend (part of the Outbox service): claim one handler's
//! deliveries (long-polling like `Claim`), settle, renew, and take back a dead predecessor's
//! claims. The storage side is `reelay_outbox::deliveries`.

use std::time::Duration;

use reelay_contracts::v1::{self, delivery_settlement::Outcome};
use reelay_kit::{ServiceError, now_ms};
use reelay_outbox::deliveries::{
    self, ClaimError, ClaimedDelivery, DeliveryOutcome, HandlerClaim, HandlerPolicy, Settlement,
};
use reelay_outbox::{Database, Durability, WriteTx};
use tokio::time::Instant;

use super::internal::{MAX_BATCH_KEYS, handler_name};
use super::outbox::{FALLBACK_POLL, MAX_CLAIM_ROWS, MAX_CLAIM_WAIT_MS, OutboxApi};
use super::waiting::WaitingClaims;
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

/// The handlers' claims waiting for new events (the writer's rider on the db backend).
pub(super) type WaitingDeliveries = WaitingClaims<HandlerClaim, ClaimedDelivery>;

/// Claims for the handlers waiting when a batch enqueues events, in that batch; also for those
/// that take none of its event types (their cursors move past the new rows there, not in a
/// claim job later).
pub(super) fn waiting_deliveries(policy: HandlerPolicy) -> WaitingDeliveries {
    WaitingClaims::new(move |tx: &mut WriteTx, requests: Vec<HandlerClaim>| {
        Box::pin(async move {
            let answers = deliveries::claim_many(tx, tx.now_ms(), policy, &requests).await?;
            Ok(answers.into_iter().map(|answer| answer.map_err(WriteError::from)).collect())
        })
    })
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
        let claimed = self
            .waiting_deliveries
            .long_poll(
                &self.db.writer,
                &self.shutdown,
                deadline,
                &request,
                || self.peek_deliveries(&request.handler, deadline),
                || self.claim_deliveries_now(request.clone()),
            )
            .await?;
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
