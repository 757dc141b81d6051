//! The Ledger service: claim and settle (event, handler) pairs.

use reelay_contracts::v1;
use reelay_domain::EventId;
use reelay_outbox::ledger::{self, ClaimOutcome, LedgerKey, LedgerPolicy, OwnedKey};
use reelay_outbox::{Database, WriteTx};
use reelay_runtime::ServiceError;
use tonic::{Request, Response, Status};

use super::internal::MAX_BATCH_KEYS;

#[derive(Clone)]
pub(super) struct LedgerApi {
    pub(super) db: Database,
    pub(super) policy: LedgerPolicy,
}

fn ledger_key(field: &str, key: Option<v1::LedgerKey>) -> Result<LedgerKey, ServiceError> {
    let key = key.ok_or_else(|| ServiceError::invalid(field, "is required"))?;
    EventId::parse(&format!("{field}.event_id"), &key.event_id)?;
    let valid_name = !key.handler.is_empty()
        && key.handler.len() <= 64
        && key.handler.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
    if !valid_name {
        return Err(ServiceError::invalid(
            &format!("{field}.handler"),
            format!("must be 1-64 of a-z, 0-9, '-', got {:?}", key.handler),
        ));
    }
    Ok(LedgerKey { event_id: key.event_id, handler: key.handler })
}

fn owned_keys(keys: Vec<v1::OwnedKey>) -> Result<Vec<OwnedKey>, ServiceError> {
    if keys.is_empty() || keys.len() > MAX_BATCH_KEYS {
        return Err(ServiceError::invalid("keys", format!("must hold 1..={MAX_BATCH_KEYS} keys, got {}", keys.len())));
    }
    keys.into_iter().map(|k| Ok(OwnedKey { key: ledger_key("keys.key", k.key)?, token: k.token })).collect()
}

#[tonic::async_trait]
impl v1::ledger_server::Ledger for LedgerApi {
    async fn claim(
        &self,
        request: Request<v1::LedgerClaimRequest>,
    ) -> Result<Response<v1::LedgerClaimResponse>, Status> {
        let keys = request.into_inner().keys;
        if keys.is_empty() || keys.len() > MAX_BATCH_KEYS {
            return Err(ServiceError::invalid(
                "keys",
                format!("must hold 1..={MAX_BATCH_KEYS} keys, got {}", keys.len()),
            )
            .into());
        }
        let keys = keys.into_iter().map(|k| ledger_key("keys", Some(k))).collect::<Result<Vec<_>, _>>()?;
        let policy = self.policy;
        let claims = keys.clone();
        let outcomes = self
            .db
            .writer
            .transact::<_, ServiceError, _>("ledger_claim", move |tx: &mut WriteTx| {
                Box::pin(async move { Ok(ledger::claim(tx, &claims, tx.now_ms(), policy).await?) })
            })
            .await?;
        let claims = keys
            .into_iter()
            .zip(outcomes)
            .map(|(key, outcome)| v1::LedgerClaim {
                key: Some(v1::LedgerKey { event_id: key.event_id, handler: key.handler }),
                outcome: Some(match outcome {
                    ClaimOutcome::Acquired(token) => v1::ledger_claim::Outcome::AcquiredToken(token),
                    ClaimOutcome::Done => v1::ledger_claim::Outcome::Done(true),
                    ClaimOutcome::HeldUntil(until) => v1::ledger_claim::Outcome::HeldUntilMs(until),
                }),
            })
            .collect();
        Ok(Response::new(v1::LedgerClaimResponse { claims }))
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
}

#[derive(Clone, Copy)]
enum Settle {
    Complete,
    Release,
}

impl LedgerApi {
    /// Completes or releases owned claims in one write job; `owned` says, per key, whether the
    /// caller still owned it.
    async fn settle(
        &self,
        request: v1::LedgerSettleRequest,
        how: Settle,
    ) -> Result<Response<v1::LedgerSettleResponse>, Status> {
        let keys = owned_keys(request.keys)?;
        let job = match how {
            Settle::Complete => "ledger_complete",
            Settle::Release => "ledger_release",
        };
        let owned = self
            .db
            .writer
            .transact::<_, ServiceError, _>(job, move |tx: &mut WriteTx| {
                Box::pin(async move {
                    Ok(match how {
                        Settle::Complete => ledger::complete(tx, &keys, tx.now_ms()).await?,
                        Settle::Release => ledger::release(tx, &keys).await?,
                    })
                })
            })
            .await?;
        Ok(Response::new(v1::LedgerSettleResponse { owned }))
    }
}
