//! The internal APIs of the write service: Outbox (claim and settle event rows) and Ledger
//! (claim and settle (event, handler) pairs). Both are used by the relay and the handler
//! services; neither is part of the public domain API.

use std::time::Duration;

use reelay_contracts::v1::{self, ledger_server::LedgerServer, outbox_server::OutboxServer};
use reelay_domain::EventId;
use reelay_outbox::ledger::{self, ClaimOutcome, LedgerKey, LedgerPolicy, OwnedKey};
use reelay_outbox::queue::{self, FailedRow, QueuePolicy, RowClaim, Settled};
use reelay_outbox::{Database, WriteTx, now_ms};
use reelay_runtime::{GrpcServer, ServiceError, Shutdown};
use tokio::time::Instant;
use tonic::{Request, Response, Status};

/// How long an idle claimer sleeps at most before looking again, even without a commit: rows
/// also become due when a retry delay or a claim lease runs out.
const FALLBACK_POLL: Duration = Duration::from_secs(1);
const MAX_CLAIM_ROWS: u32 = 1000;
const MAX_CLAIM_WAIT_MS: u32 = 60_000;
const MAX_BATCH_KEYS: usize = 1000;

/// The outbox and ledger settings the write service enforces.
#[derive(Debug, Clone, Copy, Default)]
pub struct DeliveryPolicy {
    pub queue: QueuePolicy,
    pub ledger: LedgerPolicy,
}

/// Mounts Outbox and Ledger on `server`.
pub fn mount_internal(server: GrpcServer, db: Database, policy: DeliveryPolicy, shutdown: Shutdown) -> GrpcServer {
    let limit = server.config().max_message_bytes;
    let outbox = OutboxApi { db: db.clone(), policy: policy.queue, shutdown };
    let ledger = LedgerApi { db, policy: policy.ledger };
    server
        .add_service(OutboxServer::new(outbox).max_decoding_message_size(limit).max_encoding_message_size(limit))
        .add_service(LedgerServer::new(ledger).max_decoding_message_size(limit).max_encoding_message_size(limit))
}

/// Deletes ledger rows past retention, in small batches (each its own short write job, so
/// writers never wait long behind it), every `interval` until shutdown.
pub async fn purge_ledger(db: Database, policy: LedgerPolicy, interval: Duration, shutdown: Shutdown) {
    const BATCH: u32 = 500;
    loop {
        tokio::select! {
            () = shutdown.requested() => return,
            () = tokio::time::sleep(interval) => {}
        }
        let mut total = 0;
        loop {
            let purged = db
                .writer
                .transact::<_, ServiceError, _>("ledger_purge", move |tx: &mut WriteTx| {
                    Box::pin(async move { Ok(ledger::purge(tx, now_ms(), policy, BATCH).await?) })
                })
                .await;
            match purged {
                Ok(0) => break,
                Ok(n) => total += n,
                Err(error) => {
                    tracing::warn!(%error, "ledger purge failed; will try again");
                    break;
                }
            }
            tokio::task::yield_now().await;
        }
        if total > 0 {
            tracing::info!(rows = total, "purged ledger rows past retention");
        }
    }
}

#[derive(Clone)]
struct OutboxApi {
    db: Database,
    policy: QueuePolicy,
    shutdown: Shutdown,
}

fn row_claims(rows: Vec<v1::RowClaim>) -> Result<Vec<RowClaim>, ServiceError> {
    if rows.is_empty() || rows.len() > MAX_BATCH_KEYS {
        return Err(ServiceError::invalid("rows", format!("must hold 1..={MAX_BATCH_KEYS} rows, got {}", rows.len())));
    }
    Ok(rows.into_iter().map(|r| RowClaim { id: r.id, claimed_at: r.claimed_at_ms }).collect())
}

fn settle_response(settled: Settled) -> v1::SettleResponse {
    v1::SettleResponse { settled: settled.settled as u32, lost: settled.lost, dead_lettered: settled.dead_lettered }
}

impl OutboxApi {
    async fn claim_now(&self, max_rows: u32) -> Result<Vec<queue::ClaimedRow>, ServiceError> {
        let policy = self.policy;
        self.db
            .writer
            .transact::<_, ServiceError, _>("outbox_claim", move |tx: &mut WriteTx| {
                Box::pin(async move { Ok(queue::claim_due(tx, tx.now_ms(), policy, max_rows).await?) })
            })
            .await
    }

    /// Whether anything is claimable now, and when to look again if not: the next row's due
    /// time, bounded by the fallback poll and the deadline.
    async fn peek(&self, deadline: Instant) -> Result<(bool, Instant), ServiceError> {
        let mut conn = self.db.reads.acquire().await?;
        let now = now_ms();
        let (due, next_due) = queue::peek(&mut conn, now, self.policy).await?;
        let fallback = Instant::now() + FALLBACK_POLL;
        let next = next_due.map_or(fallback, |at| Instant::now() + Duration::from_millis((at - now).max(0) as u64));
        Ok((due, next.min(fallback).min(deadline)))
    }
}

#[tonic::async_trait]
impl v1::outbox_server::Outbox for OutboxApi {
    async fn claim(&self, request: Request<v1::ClaimRequest>) -> Result<Response<v1::ClaimResponse>, Status> {
        let r = request.into_inner();
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
        let deadline = Instant::now() + Duration::from_millis(u64::from(r.wait_ms));
        let mut commits = self.db.writer.subscribe_commits();
        let rows = loop {
            // Mark the commits seen before looking, so one landing after the look wakes us.
            commits.borrow_and_update();
            // Look before claiming: an empty claim would still cost a write job.
            let (due, wake) = self.peek(deadline).await?;
            let rows = if due { self.claim_now(r.max_rows).await? } else { Vec::new() };
            if !rows.is_empty() || Instant::now() >= deadline || self.shutdown.is_requested() {
                break rows;
            }
            tokio::select! {
                changed = commits.changed() => {
                    if changed.is_err() {
                        break Vec::new();
                    }
                }
                () = tokio::time::sleep_until(wake) => {}
                () = self.shutdown.requested() => break Vec::new(),
            }
        };
        if !rows.is_empty() {
            tracing::debug!(consumer = %r.consumer, rows = rows.len(), "outbox rows claimed");
        }
        let rows = rows
            .into_iter()
            .map(|row| v1::OutboxRow {
                id: row.id,
                event_id: row.event_id.unwrap_or_default(),
                event_type: row.event_type,
                aggregate_id: row.aggregate_id,
                payload: row.payload,
                attempts: row.attempts,
                claimed_at_ms: row.claimed_at,
            })
            .collect();
        Ok(Response::new(v1::ClaimResponse { rows }))
    }

    async fn complete(&self, request: Request<v1::CompleteRequest>) -> Result<Response<v1::SettleResponse>, Status> {
        let rows = row_claims(request.into_inner().rows)?;
        let settled = self
            .db
            .writer
            .transact::<_, ServiceError, _>("outbox_complete", move |tx: &mut WriteTx| {
                Box::pin(async move { Ok(queue::complete(tx, &rows).await?) })
            })
            .await?;
        Ok(Response::new(settle_response(settled)))
    }

    async fn fail(&self, request: Request<v1::FailRequest>) -> Result<Response<v1::SettleResponse>, Status> {
        let failed = request.into_inner().rows;
        if failed.is_empty() || failed.len() > MAX_BATCH_KEYS {
            return Err(ServiceError::invalid("rows", format!("must hold 1..={MAX_BATCH_KEYS} rows")).into());
        }
        let rows = failed
            .into_iter()
            .map(|f| {
                let row = f.row.ok_or_else(|| ServiceError::invalid("rows.row", "is required"))?;
                Ok(FailedRow {
                    row: RowClaim { id: row.id, claimed_at: row.claimed_at_ms },
                    error: f.error,
                    terminal: f.terminal,
                })
            })
            .collect::<Result<Vec<_>, ServiceError>>()?;
        let policy = self.policy;
        let settled = self
            .db
            .writer
            .transact::<_, ServiceError, _>("outbox_fail", move |tx: &mut WriteTx| {
                Box::pin(async move { Ok(queue::fail(tx, &rows, tx.now_ms(), policy).await?) })
            })
            .await?;
        Ok(Response::new(settle_response(settled)))
    }

    async fn defer(&self, request: Request<v1::DeferRequest>) -> Result<Response<v1::SettleResponse>, Status> {
        let r = request.into_inner();
        let rows = row_claims(r.rows)?;
        if r.until_ms <= 0 {
            return Err(ServiceError::invalid("until_ms", "must be a time in milliseconds since the epoch").into());
        }
        let settled = self
            .db
            .writer
            .transact::<_, ServiceError, _>("outbox_defer", move |tx: &mut WriteTx| {
                Box::pin(async move { Ok(queue::defer(tx, &rows, r.until_ms).await?) })
            })
            .await?;
        Ok(Response::new(settle_response(settled)))
    }

    async fn stats(&self, _request: Request<v1::StatsRequest>) -> Result<Response<v1::StatsResponse>, Status> {
        let mut conn = self.db.reads.acquire().await.map_err(ServiceError::from)?;
        let s = queue::stats(&mut conn, now_ms()).await.map_err(ServiceError::from)?;
        Ok(Response::new(v1::StatsResponse {
            pending: s.pending,
            processing: s.processing,
            done: s.done,
            dead_lettered: s.dead_lettered,
            oldest_due_age_ms: s.oldest_due_age_ms,
        }))
    }
}

#[derive(Clone)]
struct LedgerApi {
    db: Database,
    policy: LedgerPolicy,
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
