//! Per-handler delivery on the db backend (part of the Outbox service): claim the deliveries
//! of one handler or of several handlers of a process in one call (long-polling like `Claim`),
//! settle, renew, and take back a dead predecessor's claims. The storage side is
//! `reelay_outbox::deliveries`.

use std::sync::LazyLock;
use std::time::Duration;

use reelay_contracts::v1::{self, delivery_settlement::Outcome};
use reelay_kit::metrics::{self, Counter};
use reelay_kit::{ServiceError, now_ms};
use reelay_outbox::deliveries::{
    self, ClaimError, ClaimedDelivery, DeliveryOutcome, HandlerClaim, HandlerPolicy, Settlement, SharedAnswer,
};
use reelay_outbox::{Database, Durability, WriteTx};
use tokio::time::Instant;

use super::internal::{MAX_BATCH_KEYS, event_type, handler_name};
use super::outbox::{FALLBACK_POLL, MAX_CLAIM_ROWS, MAX_CLAIM_WAIT_MS, OutboxApi};
use super::unanswered::check_unanswered;
use super::waiting::{WaitingClaims, to_the_end};
use crate::WriteError;

static RESUMED: LazyLock<Counter> = LazyLock::new(|| {
    metrics::counter(
        "reelay_deliveries_resumed_total",
        "Deliveries handed back to the owner they were claimed for, because the claim answer that handed them never reached it (db backend).",
        &[],
    )
});

/// Declares the metrics of per-handler delivery, so they are scraped before the first claim.
pub(super) fn register_metrics() {
    LazyLock::force(&RESUMED);
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

/// Records this run's claim lease at start-up; a longer one of the last run is kept for the
/// claims made under it (see [`ledger::note_lease`]).
pub async fn note_lease(db: &Database, lease: std::time::Duration) -> Result<(), WriteError> {
    db.writer
        .transact::<_, WriteError, _>("startup_note_lease", move |tx: &mut WriteTx| {
            Box::pin(async move { Ok(reelay_outbox::ledger::note_lease(tx, lease, tx.now_ms()).await.map(|_| ())?) })
        })
        .await
}

/// The handlers' claims waiting for new events (the writer's rider on the db backend).
pub(super) type WaitingDeliveries = WaitingClaims<ClaimGroup, HandlerAnswer>;

/// The claims of one call: one handler's (`ClaimDeliveries`) or those of several handlers of
/// one process (`ClaimDeliveriesForHandlers`), never none, all with the call's owner and answer
/// size, answered together within that size.
pub(super) type ClaimGroup = Vec<HandlerClaim>;

/// What one handler of a group was handed (by its index in the group), or why it was refused.
/// An answer lists only the handlers with something in it, so an empty one means nothing for
/// any of them (and a long poll goes on waiting).
#[derive(Debug)]
pub(super) struct HandlerAnswer {
    index: usize,
    claimed: Result<Vec<ClaimedDelivery>, Refused>,
}

/// Why a handler of a claim was handed nothing.
#[derive(Debug)]
pub(super) enum Refused {
    /// Not registered with the write service.
    Unknown(String),
    /// Another build of the handler claims (see [`deliveries::ClaimError::StandingBy`]).
    StandingBy(String),
}

impl From<ClaimError> for Refused {
    fn from(error: ClaimError) -> Self {
        match error {
            ClaimError::StandingBy(why) => Self::StandingBy(why),
            error => Self::Unknown(error.to_string()),
        }
    }
}

/// The claims of `group`, drawing on one answer's bytes.
fn sharing_one_answer(group: &[HandlerClaim]) -> Vec<HandlerClaim> {
    let answer = SharedAnswer::new(group.first().map_or(0, |claim| claim.max_bytes));
    group.iter().map(|claim| HandlerClaim { shared: Some(answer.clone()), ..claim.clone() }).collect()
}

/// Claims for every group in one `claim_many` (the statements shared between all their
/// handlers); the handlers of a group share its answer's bytes.
async fn claim_groups(
    tx: &mut WriteTx,
    policy: HandlerPolicy,
    groups: Vec<ClaimGroup>,
) -> Result<Vec<Result<Vec<HandlerAnswer>, WriteError>>, sqlx::Error> {
    let mut requests = Vec::new();
    for group in &groups {
        // A fresh answer for each attempt: bytes taken by a claim that was rolled back or
        // answered nothing are not lost.
        requests.extend(sharing_one_answer(group));
    }
    let mut answers = deliveries::claim_many(tx, tx.now_ms(), policy, &requests).await?.into_iter();
    Ok(groups
        .iter()
        .map(|group| {
            let answered = (0..group.len()).filter_map(|index| {
                let claimed = answers.next().expect("one answer per claim").map_err(Refused::from);
                let nothing = matches!(&claimed, Ok(handed) if handed.is_empty());
                (!nothing).then_some(HandlerAnswer { index, claimed })
            });
            Ok(answered.collect())
        })
        .collect())
}

/// Claims for the handlers waiting when a batch enqueues events, in that batch; also for those
/// that take none of its event types (their cursors move past the new rows there, not in a
/// claim job later).
pub(super) fn waiting_deliveries(policy: HandlerPolicy) -> WaitingDeliveries {
    WaitingClaims::new(move |tx: &mut WriteTx, groups: Vec<ClaimGroup>| Box::pin(claim_groups(tx, policy, groups)))
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

/// How long an answer saying only that its handlers stand by is held (at most the call's wait).
const STANDING_BY_HOLD: Duration = Duration::from_secs(2);

/// Most handlers one `ClaimDeliveriesForHandlers` call claims for.
const MAX_HANDLERS_PER_CLAIM: usize = 64;

fn max_rows(field: &str, max_rows: u32) -> Result<u32, ServiceError> {
    if !(1..=MAX_CLAIM_ROWS).contains(&max_rows) {
        return Err(ServiceError::invalid(field, format!("must be 1..={MAX_CLAIM_ROWS}, got {max_rows}")));
    }
    Ok(max_rows)
}

/// The event types a handler claims: at least one, each of the catalogue (so a claim's reads of
/// the outbox stay within what SQLite binds, whatever a caller sends), each once.
fn event_types(field: &str, types: Vec<String>, handler: &str) -> Result<Vec<String>, ServiceError> {
    if types.is_empty() {
        return Err(ServiceError::invalid(field, format!("must name at least one event type (handler {handler:?})")));
    }
    let mut types = types.iter().map(|t| event_type(field, t)).collect::<Result<Vec<_>, _>>()?;
    types.sort_unstable();
    types.dedup();
    Ok(types)
}

fn check_wait_and_owner(wait_ms: u32, owner: &str) -> Result<(), ServiceError> {
    if wait_ms > MAX_CLAIM_WAIT_MS {
        return Err(ServiceError::invalid("wait_ms", format!("must be at most {MAX_CLAIM_WAIT_MS}, got {wait_ms}")));
    }
    check_owner("owner", owner)
}

/// A claimer's name (in request field `field`): required (claims without one would be everyone's, so a resuming caller
/// would take another's live claims) and short.
pub(super) fn check_owner(field: &str, owner: &str) -> Result<(), ServiceError> {
    use reelay_domain::MAX_OWNER_BYTES;
    if owner.is_empty() || owner.len() > MAX_OWNER_BYTES {
        return Err(ServiceError::invalid(
            field,
            format!(
                "is required, at most {MAX_OWNER_BYTES} bytes (<instance>#<incarnation>), got {} bytes",
                owner.len()
            ),
        ));
    }
    Ok(())
}

fn delivery(d: ClaimedDelivery) -> v1::Delivery {
    v1::Delivery {
        row_id: d.row_id,
        key: d.key,
        event_type: d.event_type,
        aggregate_id: d.aggregate_id,
        payload: d.payload,
        attempt: d.attempt,
        token: d.token,
    }
}

impl OutboxApi {
    pub(super) async fn claim_deliveries(
        &self,
        r: v1::ClaimDeliveriesRequest,
    ) -> Result<v1::ClaimDeliveriesResponse, WriteError> {
        let handler = handler_name("handler", &r.handler)?;
        let max_rows = max_rows("max_rows", r.max_rows)?;
        let event_types = event_types("event_types", r.event_types, &handler)?;
        check_wait_and_owner(r.wait_ms, &r.owner)?;
        let wants = v1::HandlerWants { handler, event_types, max_rows };
        let group = self.group(vec![wants], &r.owner, 0, r.max_bytes)?;
        let mut answered = self.claim_group(group, r.wait_ms, self.shutdown.requested()).await?;
        let deliveries = match answered.pop() {
            None => Vec::new(),
            Some(HandlerAnswer { claimed: Ok(claimed), .. }) => claimed.into_iter().map(delivery).collect(),
            Some(HandlerAnswer { claimed: Err(Refused::Unknown(why) | Refused::StandingBy(why)), .. }) => {
                return Err(ServiceError::failed_precondition(why).into());
            }
        };
        Ok(v1::ClaimDeliveriesResponse { deliveries, lease_ms: self.deliveries.lease.as_millis() as i64 })
    }

    pub(super) async fn claim_deliveries_for_handlers(
        &self,
        mut r: v1::ClaimDeliveriesForHandlersRequest,
    ) -> Result<v1::ClaimDeliveriesForHandlersResponse, WriteError> {
        if r.handlers.is_empty() || r.handlers.len() > MAX_HANDLERS_PER_CLAIM {
            return Err(ServiceError::invalid(
                "handlers",
                format!("must hold 1..={MAX_HANDLERS_PER_CLAIM} handlers, got {}", r.handlers.len()),
            )
            .into());
        }
        let mut checked: Vec<v1::HandlerWants> = Vec::with_capacity(r.handlers.len());
        for wants in std::mem::take(&mut r.handlers) {
            let handler = handler_name("handlers.handler", &wants.handler)?;
            if checked.iter().any(|w| w.handler == handler) {
                return Err(ServiceError::invalid("handlers.handler", format!("{handler:?} is named twice")).into());
            }
            let event_types = event_types("handlers.event_types", wants.event_types, &handler)?;
            let max_rows = max_rows("handlers.max_rows", wants.max_rows)?;
            checked.push(v1::HandlerWants { handler, event_types, max_rows });
        }
        check_unanswered(&r.unanswered)?;
        check_wait_and_owner(r.wait_ms, &r.owner)?;
        let this = self.clone();
        to_the_end(&self.shutdown, move |stop| async move { this.claim_for_handlers(r, checked, stop).await }).await
    }

    /// `ClaimDeliveriesForHandlers` for the `checked` handlers: what the call's unanswered calls
    /// claimed for them and the owner still holds, else what is due, waiting up to `wait_ms` or
    /// until `stop`. Either way what it hands out is marked with its call id, for a hand-back
    /// should the answer not arrive.
    async fn claim_for_handlers(
        &self,
        r: v1::ClaimDeliveriesForHandlersRequest,
        checked: Vec<v1::HandlerWants>,
        stop: impl Future<Output = ()>,
    ) -> Result<v1::ClaimDeliveriesForHandlersResponse, WriteError> {
        let mut handlers: Vec<v1::HandlerDeliveries> = checked
            .iter()
            .map(|w| v1::HandlerDeliveries {
                handler: w.handler.clone(),
                deliveries: Vec::new(),
                refused: String::new(),
                standing_by: String::new(),
            })
            .collect();
        let group = self.group(checked, &r.owner, r.call_id, r.max_bytes)?;
        // Ends after this call's claims are written: a call naming this one waits for that.
        let _running = self.running_deliveries.running(&r.owner, r.call_id);
        let mut answers = Vec::new();
        if !r.unanswered.is_empty() {
            self.running_deliveries.named_ended(&r.owner, &r.unanswered, r.call_id).await;
            answers = self.hand_back(&group, r.unanswered.clone()).await?;
        }
        if answers.is_empty() {
            answers = self.claim_group(group, r.wait_ms, stop).await?;
        }
        for answer in answers {
            let entry = &mut handlers[answer.index];
            match answer.claimed {
                Ok(claimed) => entry.deliveries = claimed.into_iter().map(delivery).collect(),
                Err(Refused::Unknown(why)) => entry.refused = why,
                Err(Refused::StandingBy(why)) => entry.standing_by = why,
            }
        }
        // An answer that only says "stand by" is held a little: a claimer from before builds
        // were told apart does not read it, takes it for an empty answer and would ask again
        // at once, a write job each time.
        if handlers.iter().any(|h| !h.standing_by.is_empty())
            && handlers.iter().all(|h| h.deliveries.is_empty() && h.refused.is_empty())
        {
            let hold = Duration::from_millis(u64::from(r.wait_ms)).min(STANDING_BY_HOLD);
            tokio::select! {
                () = tokio::time::sleep(hold) => {}
                () = self.shutdown.requested() => {}
            }
        }
        Ok(v1::ClaimDeliveriesForHandlersResponse { handlers, lease_ms: self.deliveries.lease.as_millis() as i64 })
    }

    /// The claims of one call for `wants` (their names checked; never none), by `owner`'s call
    /// `call`, answered together within `max_bytes` (0: this server's limit).
    fn group(
        &self,
        wants: Vec<v1::HandlerWants>,
        owner: &str,
        call: u64,
        max_bytes: u32,
    ) -> Result<ClaimGroup, ServiceError> {
        let max_bytes = self.answer_bytes(max_bytes)?;
        Ok(wants
            .into_iter()
            .map(|w| HandlerClaim {
                handler: w.handler,
                event_types: w.event_types,
                owner: owner.to_owned(),
                max_rows: w.max_rows,
                max_bytes,
                call,
                shared: None,
            })
            .collect())
    }

    /// Hands the owner of `group` back what its `unanswered` calls claimed for the group's
    /// handlers and it still holds, renewed and marked as claimed by the group's call, within
    /// one answer (each handler's rows, the answer's bytes); nothing else is claimed. (What
    /// does not fit is left to its lease: the process does not know of it.)
    async fn hand_back(&self, group: &[HandlerClaim], unanswered: Vec<u64>) -> Result<Vec<HandlerAnswer>, WriteError> {
        let group = sharing_one_answer(group);
        let names: Vec<String> = group.iter().map(|claim| claim.handler.clone()).collect();
        let owner = group.first().map(|claim| claim.owner.clone()).unwrap_or_default();
        let answers = self
            .db
            .writer
            .transact::<_, WriteError, _>("resume_deliveries", move |tx: &mut WriteTx| {
                Box::pin(async move {
                    let now = tx.now_ms();
                    let mut answers = Vec::new();
                    for (index, claim) in group.iter().enumerate() {
                        let resumed = deliveries::resume(tx, claim, &unanswered, now).await?;
                        if !resumed.is_empty() {
                            answers.push(HandlerAnswer { index, claimed: Ok(resumed) });
                        }
                    }
                    Ok(answers)
                })
            })
            .await?;
        for answer in &answers {
            let count = answer.claimed.as_ref().map_or(0, Vec::len);
            RESUMED.inc_by(&[], count as u64);
            tracing::warn!(handler = %names[answer.index], %owner, deliveries = count,
                "handed deliveries back to their owner: the claim answer that handed them never reached it");
        }
        Ok(answers)
    }

    /// Claims for a group of handlers (their `wait_ms` and owner checked) as soon as any of them
    /// has something, waiting up to `wait_ms` or until `stop` (the long poll both claim calls
    /// share).
    async fn claim_group(
        &self,
        group: ClaimGroup,
        wait_ms: u32,
        stop: impl Future<Output = ()>,
    ) -> Result<Vec<HandlerAnswer>, WriteError> {
        let names: Vec<String> = group.iter().map(|claim| claim.handler.clone()).collect();
        let deadline = Instant::now() + Duration::from_millis(u64::from(wait_ms));
        self.waiting_deliveries
            .long_poll(
                &self.db.writer,
                deadline,
                &group,
                || self.peek_deliveries(&names, deadline),
                || self.claim_deliveries_now(group.clone()),
                stop,
            )
            .await
    }

    async fn claim_deliveries_now(&self, group: ClaimGroup) -> Result<Vec<HandlerAnswer>, WriteError> {
        let policy = self.deliveries;
        self.delivery_claims
            .submit(&self.db, "claim_deliveries", Durability::Synced, group, move |tx: &mut WriteTx, groups| {
                Box::pin(async move { Ok(claim_groups(tx, policy, groups).await?) })
            })
            .await
    }

    /// Whether any of the handlers has anything to claim, and when to look again if not.
    async fn peek_deliveries(&self, handlers: &[String], deadline: Instant) -> Result<(bool, Instant), WriteError> {
        let mut conn = self.db.reads.acquire().await?;
        let now = now_ms();
        let counted_from = self.db.writer.lease_counted_from();
        let (due, next_due) = deliveries::peek(&mut conn, handlers, now, self.deliveries, counted_from).await?;
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
                    Some(Outcome::DeferredUntilMs(until_ms)) => {
                        super::outbox::check_defer("settlements.deferred_until_ms", until_ms)?;
                        DeliveryOutcome::Deferred { until_ms }
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
        Ok(v1::RenewDeliveriesResponse { lost, lease_ms: self.deliveries.lease.as_millis() as i64 })
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
        // The name its claims carry: one the claims would refuse is refused here too (an older
        // build's name within the claims' limit is taken, whatever this build's start-up allows).
        let me = format!("{}#{}", r.instance, r.incarnation);
        if me.len() > reelay_domain::MAX_OWNER_BYTES {
            let most = reelay_domain::MAX_OWNER_BYTES.saturating_sub(1 + r.incarnation.len());
            return Err(ServiceError::invalid(
                "instance",
                format!("at most {most} bytes with this incarnation (a claimer's name), got {}", r.instance.len()),
            )
            .into());
        }
        let instance = r.instance.clone();
        // On db the write service keeps each handler's attempts; on nats JetStream counts them.
        let max_attempts = (self.bus == crate::Bus::Db).then_some(self.deliveries.max_attempts);
        let released = self
            .db
            .writer
            .transact::<_, WriteError, _>("release_instance", move |tx: &mut WriteTx| {
                Box::pin(async move {
                    Ok(deliveries::release_instance(tx, &instance, &me, tx.now_ms(), max_attempts).await?)
                })
            })
            .await?;
        if released > 0 {
            tracing::warn!(instance = %r.instance, claims = released,
                "took back the claims an earlier run of this instance still held (it stopped without settling them)");
        }
        Ok(v1::ReleaseInstanceResponse { released })
    }
}
