//! The Ledger service: claim and settle (event, handler) pairs.

use std::sync::LazyLock;

use reelay_contracts::v1;
use reelay_domain::EventId;
use reelay_kit::ServiceError;
use reelay_kit::metrics::{self, Counter};
use reelay_outbox::ledger::{
    self, ClaimOutcome, DeadLetter, GivenUp, GivenUpOutcome, LedgerKey, LedgerPolicy, OwnedKey,
};
use reelay_outbox::{Database, WriteTx, deliveries};
use tonic::{Request, Response, Status};

use super::Bus;
use super::internal::{MAX_BATCH_KEYS, handler_name};
use crate::WriteError;

static LEDGER_CLAIMS: LazyLock<Counter> = LazyLock::new(|| {
    metrics::counter(
        "reelay_ledger_claims_total",
        "Ledger claims of (event, handler) pairs by outcome: acquired (run the handler), resumed (the claimer's own live claim handed back: the answer that made it was lost, or the work it was for is gone), done (skip), held (another worker has it), standing_by (answered held: another build of the handler claims).",
        &["outcome"],
    )
});
static LEDGER_DEAD_LETTERS: LazyLock<Counter> = LazyLock::new(|| {
    metrics::counter(
        "reelay_ledger_dead_letters_total",
        "Deliveries a handler gave up that the ledger recorded as dead letters (nats backend).",
        &[],
    )
});

/// Declares the ledger's metrics, so they are scraped before the first claim.
pub(crate) fn register_metrics() {
    for outcome in ["acquired", "resumed", "done", "held", "standing_by"] {
        LEDGER_CLAIMS.declare(&[outcome]);
    }
    LazyLock::force(&LEDGER_DEAD_LETTERS);
}

#[derive(Clone)]
pub(super) struct LedgerApi {
    pub(super) db: Database,
    pub(super) policy: LedgerPolicy,
    pub(super) bus: Bus,
}

fn ledger_key(field: &str, key: Option<v1::LedgerKey>) -> Result<LedgerKey, ServiceError> {
    let key = key.ok_or_else(|| ServiceError::invalid(field, "is required"))?;
    // Only the form events carry: one event written two ways would be two ledger keys, and two
    // workers could then run it at once.
    let id = EventId::parse(&format!("{field}.event_id"), &key.event_id)?;
    if id.to_string() != key.event_id {
        return Err(ServiceError::invalid(
            &format!("{field}.event_id"),
            format!("must be written as events carry it ({id}), got {:?}", key.event_id),
        ));
    }
    let handler = handler_name(&format!("{field}.handler"), &key.handler)?;
    Ok(LedgerKey { event_id: key.event_id, handler })
}

/// Refuses an empty batch, or one over the server's limit, naming `field`.
fn batch_size(field: &str, what: &str, len: usize) -> Result<(), ServiceError> {
    if len == 0 || len > MAX_BATCH_KEYS {
        return Err(ServiceError::invalid(field, format!("must hold 1..={MAX_BATCH_KEYS} {what}, got {len}")));
    }
    Ok(())
}

/// How long a standing-by build's keys are answered held: it asks again after as long.
const STAND_BY_MS: i64 = 2_000;

/// The claimer's builds of its handlers: (name, event types), each handler once.
fn builds(builds: Vec<v1::HandlerBuild>) -> Result<Vec<(String, Vec<String>)>, ServiceError> {
    if builds.len() > MAX_BATCH_KEYS {
        return Err(ServiceError::invalid(
            "builds",
            format!("must hold at most {MAX_BATCH_KEYS} builds, got {}", builds.len()),
        ));
    }
    let mut checked: Vec<(String, Vec<String>)> = Vec::with_capacity(builds.len());
    for build in builds {
        let handler = handler_name("builds.handler", &build.handler)?;
        if checked.iter().any(|(h, _)| *h == handler) {
            return Err(ServiceError::invalid("builds.handler", format!("{handler:?} is named twice")));
        }
        let types = build_types(build.event_types, &handler)?;
        checked.push((handler, types));
    }
    Ok(checked)
}

/// The event types a build's handler takes, as a key only: a newer handlers build may take a
/// type this write service does not know (its ledger claims must not be refused for that), so
/// only their form is checked.
fn build_types(types: Vec<String>, handler: &str) -> Result<Vec<String>, ServiceError> {
    const FIELD: &str = "builds.event_types";
    if types.is_empty() || types.len() > MAX_BUILD_TYPES {
        return Err(ServiceError::invalid(
            FIELD,
            format!("must name 1..={MAX_BUILD_TYPES} event types (handler {handler:?}), got {}", types.len()),
        ));
    }
    if let Some(bad) = types.iter().find(|t| {
        t.is_empty() || t.len() > 64 || !t.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'.')
    }) {
        return Err(ServiceError::invalid(
            FIELD,
            format!("{bad:?} is not an event type name (1-64 letters, digits, '_' or '.'; handler {handler:?})"),
        ));
    }
    let mut types = types;
    types.sort_unstable();
    types.dedup();
    Ok(types)
}

/// Most event types one build may name.
const MAX_BUILD_TYPES: usize = 256;

fn owned_keys(keys: Vec<v1::OwnedKey>) -> Result<Vec<OwnedKey>, ServiceError> {
    batch_size("keys", "keys", keys.len())?;
    keys.into_iter().map(|k| Ok(OwnedKey { key: ledger_key("keys.key", k.key)?, token: k.token })).collect()
}

#[tonic::async_trait]
impl v1::ledger_server::Ledger for LedgerApi {
    async fn claim(
        &self,
        request: Request<v1::LedgerClaimRequest>,
    ) -> Result<Response<v1::LedgerClaimResponse>, Status> {
        let request = request.into_inner();
        let (keys, owner) = (request.keys, request.owner);
        super::deliveries::check_owner("owner", &owner)?;
        let builds = builds(request.builds)?;
        // No key is a check whether the builds stand by.
        if !keys.is_empty() || builds.is_empty() {
            batch_size("keys", "keys", keys.len())?;
        }
        let keys = keys.into_iter().map(|k| ledger_key("keys", Some(k))).collect::<Result<Vec<_>, _>>()?;
        let resume_own = request.resume_own;
        let policy = self.policy;
        let claims = keys.clone();
        let (outcomes, standing_by) = self
            .db
            .writer
            .transact::<_, WriteError, _>("ledger_claim", move |tx: &mut WriteTx| {
                Box::pin(async move {
                    let now = tx.now_ms();
                    let standing_by = deliveries::builds_standing_by(tx, now, policy.lease, &builds).await?;
                    // A standing-by build's keys are not claimed: held for as long as it waits
                    // before asking again.
                    let claimed: Vec<LedgerKey> =
                        claims.iter().filter(|k| !standing_by.contains_key(&k.handler)).cloned().collect();
                    let mut outcomes = ledger::claim(tx, &claimed, resume_own, &owner, now, policy).await?.into_iter();
                    let outcomes = claims
                        .iter()
                        .map(|k| {
                            if standing_by.contains_key(&k.handler) {
                                ClaimOutcome::HeldUntil(now + STAND_BY_MS)
                            } else {
                                outcomes.next().expect("one outcome per key claimed")
                            }
                        })
                        .collect::<Vec<_>>();
                    Ok((outcomes, standing_by))
                })
            })
            .await?;
        for (key, outcome) in keys.iter().zip(&outcomes) {
            LEDGER_CLAIMS.inc(&[match outcome {
                _ if standing_by.contains_key(&key.handler) => "standing_by",
                ClaimOutcome::Acquired(_) => "acquired",
                ClaimOutcome::Resumed(_) => "resumed",
                ClaimOutcome::Done => "done",
                ClaimOutcome::HeldUntil(_) => "held",
            }]);
        }
        let claims = keys
            .into_iter()
            .zip(outcomes)
            .map(|(key, outcome)| v1::LedgerClaim {
                key: Some(v1::LedgerKey { event_id: key.event_id, handler: key.handler }),
                outcome: Some(match outcome {
                    ClaimOutcome::Acquired(token) | ClaimOutcome::Resumed(token) => {
                        v1::ledger_claim::Outcome::AcquiredToken(token)
                    }
                    ClaimOutcome::Done => v1::ledger_claim::Outcome::Done(true),
                    ClaimOutcome::HeldUntil(until) => v1::ledger_claim::Outcome::HeldUntilMs(until),
                }),
            })
            .collect();
        let standing_by =
            standing_by.into_iter().map(|(handler, why)| v1::HandlerStandingBy { handler, why }).collect();
        Ok(Response::new(v1::LedgerClaimResponse { claims, lease_ms: policy.lease.as_millis() as i64, standing_by }))
    }

    async fn complete(
        &self,
        request: Request<v1::LedgerSettleRequest>,
    ) -> Result<Response<v1::LedgerSettleResponse>, Status> {
        self.settle(request.into_inner(), Settle::Complete).await
    }

    async fn release(
        &self,
        request: Request<v1::LedgerSettleRequest>,
    ) -> Result<Response<v1::LedgerSettleResponse>, Status> {
        self.settle(request.into_inner(), Settle::Release).await
    }

    async fn renew(
        &self,
        request: Request<v1::LedgerSettleRequest>,
    ) -> Result<Response<v1::LedgerSettleResponse>, Status> {
        self.settle(request.into_inner(), Settle::Renew).await
    }

    async fn dead_letter(
        &self,
        request: Request<v1::LedgerDeadLetterRequest>,
    ) -> Result<Response<v1::LedgerSettleResponse>, Status> {
        let dead = request.into_inner().dead_letters;
        batch_size("dead_letters", "dead letters", dead.len())?;
        let dead = dead
            .into_iter()
            .map(|d| {
                let owned = d.key.ok_or_else(|| ServiceError::invalid("dead_letters.key", "is required"))?;
                let key = ledger_key("dead_letters.key.key", owned.key)?;
                if d.attempts == 0 {
                    return Err(ServiceError::invalid("dead_letters.attempts", "must count the last delivery (≥ 1)"));
                }
                Ok(DeadLetter { owned: OwnedKey { key, token: owned.token }, attempts: d.attempts, error: d.error })
            })
            .collect::<Result<Vec<_>, ServiceError>>()?;
        let owned = self
            .db
            .writer
            .transact::<_, WriteError, _>("ledger_dead_letter", move |tx: &mut WriteTx| {
                Box::pin(async move { Ok(ledger::dead_letter(tx, &dead, tx.now_ms()).await?) })
            })
            .await?;
        LEDGER_DEAD_LETTERS.inc_by(&[], owned.iter().filter(|o| **o).count() as u64);
        Ok(Response::new(v1::LedgerSettleResponse { owned, lease_ms: self.policy.lease.as_millis() as i64 }))
    }

    async fn given_up(
        &self,
        request: Request<v1::LedgerGivenUpRequest>,
    ) -> Result<Response<v1::LedgerGivenUpResponse>, Status> {
        let given_up = request.into_inner().given_up;
        batch_size("given_up", "pairs", given_up.len())?;
        let pairs = given_up
            .into_iter()
            .map(|g| {
                let key = ledger_key("given_up.key", g.key)?;
                if g.attempts == 0 {
                    return Err(ServiceError::invalid("given_up.attempts", "must count the deliveries made (≥ 1)"));
                }
                Ok(GivenUp {
                    key,
                    attempts: g.attempts,
                    error: g.error,
                    replay: g.replay,
                    given_up_at: g.given_up_at_ms.max(0),
                })
            })
            .collect::<Result<Vec<_>, ServiceError>>()?;
        if self.bus == Bus::Db {
            // There the write service keeps each handler's deliveries itself: a `retry` row or
            // an expired claim is a delivery still to come, not one given up.
            return Err(ServiceError::failed_precondition(
                "GivenUp is for the nats backend; on db the write service keeps the deliveries",
            )
            .into());
        }
        let policy = self.policy;
        let outcomes = self
            .db
            .writer
            .transact::<_, WriteError, _>("ledger_given_up", move |tx: &mut WriteTx| {
                Box::pin(async move { Ok(ledger::given_up(tx, &pairs, tx.now_ms(), policy).await?) })
            })
            .await?;
        LEDGER_DEAD_LETTERS.inc_by(&[], outcomes.iter().filter(|o| **o == GivenUpOutcome::DeadLettered).count() as u64);
        let outcomes = outcomes
            .into_iter()
            .map(|outcome| v1::LedgerGivenUpOutcome {
                outcome: Some(match outcome {
                    GivenUpOutcome::DeadLettered => v1::ledger_given_up_outcome::Outcome::DeadLettered(true),
                    GivenUpOutcome::Finished => v1::ledger_given_up_outcome::Outcome::Finished(true),
                    GivenUpOutcome::HeldUntil(until) => v1::ledger_given_up_outcome::Outcome::HeldUntilMs(until),
                }),
            })
            .collect();
        Ok(Response::new(v1::LedgerGivenUpResponse { outcomes }))
    }
}

#[derive(Clone, Copy)]
enum Settle {
    Complete,
    Release,
    Renew,
}

impl LedgerApi {
    /// Completes, releases or renews owned claims in one write job; `owned` says, per key,
    /// whether the caller still owned it.
    async fn settle(
        &self,
        request: v1::LedgerSettleRequest,
        how: Settle,
    ) -> Result<Response<v1::LedgerSettleResponse>, Status> {
        let keys = owned_keys(request.keys)?;
        let job = match how {
            Settle::Complete => "ledger_complete",
            Settle::Release => "ledger_release",
            Settle::Renew => "ledger_renew",
        };
        let owned = self
            .db
            .writer
            .transact::<_, WriteError, _>(job, move |tx: &mut WriteTx| {
                Box::pin(async move {
                    Ok(match how {
                        Settle::Complete => ledger::complete(tx, &keys, tx.now_ms()).await?,
                        Settle::Release => ledger::release(tx, &keys).await?,
                        Settle::Renew => ledger::renew(tx, &keys, tx.now_ms()).await?,
                    })
                })
            })
            .await?;
        Ok(Response::new(v1::LedgerSettleResponse { owned, lease_ms: self.policy.lease.as_millis() as i64 }))
    }
}
