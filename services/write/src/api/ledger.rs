//! The Ledger service: claim and settle (event, handler) pairs.

use std::collections::HashSet;
use std::sync::LazyLock;

use reelay_contracts::v1;
use reelay_domain::EventId;
use reelay_kit::ServiceError;
use reelay_kit::metrics::{self, Counter};
use reelay_outbox::ledger::{self, ClaimOutcome, DeadLetter, LedgerKey, LedgerPolicy, OwnedKey};
use reelay_outbox::{Database, Durability, WriteTx};
use tonic::{Request, Response, Status};

use super::internal::{MAX_BATCH_KEYS, handler_name};
use super::merge::Merged;
use crate::WriteError;

static LEDGER_CLAIMS: LazyLock<Counter> = LazyLock::new(|| {
    metrics::counter(
        "reelay_ledger_claims_total",
        "Ledger claims of (event, handler) pairs by outcome: acquired (run the handler), done (skip), held (another worker has it).",
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
pub fn register_metrics() {
    LazyLock::force(&LEDGER_CLAIMS);
    LazyLock::force(&LEDGER_DEAD_LETTERS);
}

#[derive(Clone)]
pub(super) struct LedgerApi {
    pub(super) db: Database,
    pub(super) policy: LedgerPolicy,
    /// Claims and completions of many handlers arriving together share a write job.
    pub(super) claims: Merged<(Vec<LedgerKey>, String), Vec<ClaimOutcome>>,
    pub(super) completions: Merged<Vec<OwnedKey>, Vec<bool>>,
}

/// Claims several requests' keys in one job: the requests of one owner whose keys do not
/// overlap go in one `ledger::claim` (one insert for all their keys); a request that names a
/// key another request of the job already names is claimed after it, so of two requests for
/// the same key exactly one acquires it, as when they come one at a time.
async fn claim_merged(
    tx: &mut WriteTx,
    requests: &[(Vec<LedgerKey>, String)],
    policy: LedgerPolicy,
) -> Result<Vec<Vec<ClaimOutcome>>, sqlx::Error> {
    // (owner, its requests, the keys they name)
    let mut groups: Vec<(&str, Vec<usize>, HashSet<&LedgerKey>)> = Vec::new();
    for (index, (keys, owner)) in requests.iter().enumerate() {
        let joins = groups.iter_mut().find(|(o, _, named)| *o == owner && keys.iter().all(|k| !named.contains(k)));
        match joins {
            Some((_, members, named)) => {
                members.push(index);
                named.extend(keys);
            }
            None => groups.push((owner, vec![index], keys.iter().collect())),
        }
    }
    let mut answers: Vec<Vec<ClaimOutcome>> = vec![Vec::new(); requests.len()];
    for (owner, members, _) in groups {
        let keys: Vec<LedgerKey> = members.iter().flat_map(|&i| requests[i].0.iter().cloned()).collect();
        let mut outcomes = ledger::claim(tx, &keys, owner, tx.now_ms(), policy).await?.into_iter();
        for i in members {
            answers[i] = outcomes.by_ref().take(requests[i].0.len()).collect();
        }
    }
    Ok(answers)
}

fn ledger_key(field: &str, key: Option<v1::LedgerKey>) -> Result<LedgerKey, ServiceError> {
    let key = key.ok_or_else(|| ServiceError::invalid(field, "is required"))?;
    EventId::parse(&format!("{field}.event_id"), &key.event_id)?;
    let handler = handler_name(&format!("{field}.handler"), &key.handler)?;
    Ok(LedgerKey { event_id: key.event_id, handler })
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
        let request = request.into_inner();
        let (keys, owner) = (request.keys, request.owner);
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
            .claims
            .submit(
                &self.db,
                ("ledger_claim", Durability::Synced),
                (claims, owner),
                move |tx: &mut WriteTx, requests| {
                    Box::pin(
                        async move { Ok(claim_merged(tx, &requests, policy).await?.into_iter().map(Ok).collect()) },
                    )
                },
            )
            .await?;
        for outcome in &outcomes {
            LEDGER_CLAIMS.inc(&[match outcome {
                ClaimOutcome::Acquired(_) => "acquired",
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
        if dead.is_empty() || dead.len() > MAX_BATCH_KEYS {
            return Err(ServiceError::invalid(
                "dead_letters",
                format!("must hold 1..={MAX_BATCH_KEYS} dead letters, got {}", dead.len()),
            )
            .into());
        }
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
        Ok(Response::new(v1::LedgerSettleResponse { owned }))
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
        if let Settle::Complete = how {
            let owned = self
                .completions
                .submit(&self.db, (job, Durability::Synced), keys, |tx: &mut WriteTx, requests| {
                    Box::pin(async move {
                        let all: Vec<OwnedKey> = requests.iter().flatten().cloned().collect();
                        let mut owned = ledger::complete(tx, &all, tx.now_ms()).await?.into_iter();
                        Ok(requests.iter().map(|keys| Ok(owned.by_ref().take(keys.len()).collect())).collect())
                    })
                })
                .await?;
            return Ok(Response::new(v1::LedgerSettleResponse { owned }));
        }
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
        Ok(Response::new(v1::LedgerSettleResponse { owned }))
    }
}
