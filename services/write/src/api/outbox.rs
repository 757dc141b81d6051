//! The Outbox service: claim event rows (waiting for due ones up to a deadline) and settle them.

use std::sync::LazyLock;
use std::time::Duration;

use reelay_contracts::v1;
use reelay_kit::metrics::{self, Counter};
use reelay_kit::{ServiceError, Shutdown, now_ms};
use reelay_outbox::deliveries::{self, HandlerPolicy, Settled as DeliveriesSettled, Settlement as DeliverySettlement};
use reelay_outbox::queue::{self, ClaimLimits, FailedRow, Published, QueuePolicy, RowClaim, Settled};
use reelay_outbox::{Database, WriteTx};
use tokio::time::Instant;
use tonic::{Request, Response, Status};

use super::admin::Bus;
use super::internal::MAX_BATCH_KEYS;
use super::unanswered::{RunningCalls, check_unanswered};
use super::waiting::{WaitingClaims, to_the_end};
use crate::WriteError;
use crate::merge::Merged;

static ROWS_RESUMED: LazyLock<Counter> = LazyLock::new(|| {
    metrics::counter(
        "reelay_outbox_rows_resumed_total",
        "Outbox rows handed back to the relay they were claimed for, because the claim answer that handed them never reached it (nats backend).",
        &[],
    )
});

/// Declares the Outbox API's metrics (per-handler delivery's too), so they are scraped before
/// the first claim.
pub(crate) fn register_metrics() {
    LazyLock::force(&ROWS_RESUMED);
    super::deliveries::register_metrics();
}

/// How long an idle claimer sleeps at most before looking again, even without a commit: rows
/// also become due when a retry delay or a claim lease runs out.
pub(super) const FALLBACK_POLL: Duration = Duration::from_secs(1);
pub(super) const MAX_CLAIM_ROWS: u32 = 1000;
pub(super) const MAX_CLAIM_WAIT_MS: u32 = 60_000;

#[derive(Clone)]
pub(super) struct OutboxApi {
    pub(super) db: Database,
    pub(super) policy: QueuePolicy,
    pub(super) deliveries: HandlerPolicy,
    pub(super) shutdown: Shutdown,
    /// The largest message this server sends: no claim answer may be larger.
    pub(super) max_message_bytes: usize,
    /// Handlers' delivery claims and settlements arriving together share a write job.
    pub(super) delivery_claims: Merged<super::deliveries::ClaimGroup, Vec<super::deliveries::HandlerAnswer>>,
    pub(super) delivery_settlements: Merged<(String, Vec<DeliverySettlement>), DeliveriesSettled>,
    /// Handlers' claims waiting for events (db backend), handed them in the batch that commits
    /// them.
    pub(super) waiting_deliveries: super::deliveries::WaitingDeliveries,
    /// The relay's claims waiting for rows (nats backend), likewise.
    pub(super) waiting_rows: WaitingRows,
    /// The handlers' claim calls running: a call naming one of them as unanswered waits for it
    /// before looking for what it claimed.
    pub(super) running_deliveries: RunningCalls,
    /// The relay's claim calls running, likewise.
    pub(super) running_rows: RunningCalls,
    /// The event bus: on db the outbox's rows stay `pending` and handlers progress by cursor.
    pub(super) bus: Bus,
}

/// The relay's claims waiting for outbox rows (the writer's rider on the nats backend).
pub(super) type WaitingRows = WaitingClaims<ClaimLimits, queue::ClaimedRow>;

/// Claims for the relays waiting when a batch enqueues events, in that batch: the rows are
/// handed over claimed by the commit that writes them.
pub(super) fn waiting_rows(policy: QueuePolicy) -> WaitingRows {
    WaitingClaims::new(move |tx: &mut WriteTx, requests: Vec<ClaimLimits>| {
        Box::pin(async move {
            let now = tx.now_ms();
            let mut answers = Vec::with_capacity(requests.len());
            for limits in &requests {
                answers.push(Ok(queue::claim_due(tx, now, policy, limits).await?));
            }
            Ok(answers)
        })
    })
}

fn published(rows: Vec<v1::RowClaim>) -> Result<Vec<Published>, ServiceError> {
    if rows.is_empty() || rows.len() > MAX_BATCH_KEYS {
        return Err(ServiceError::invalid("rows", format!("must hold 1..={MAX_BATCH_KEYS} rows, got {}", rows.len())));
    }
    Ok(rows
        .into_iter()
        .map(|r| Published {
            row: RowClaim { id: r.id, claimed_at: r.claimed_at_ms },
            stream_sequence: r.stream_sequence,
        })
        .collect())
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

/// The furthest a row or a delivery may be deferred: far beyond any backoff, and short of for
/// ever (a row parked at `i64::MAX` would never show as waiting or dead-lettered).
const MAX_DEFER_MS: i64 = 7 * 24 * 3600 * 1000;

/// A defer time: in milliseconds since the epoch, at most [`MAX_DEFER_MS`] from now.
pub(super) fn check_defer(field: &str, until_ms: i64) -> Result<(), ServiceError> {
    if until_ms <= 0 || until_ms > reelay_kit::now_ms() + MAX_DEFER_MS {
        return Err(ServiceError::invalid(
            field,
            format!("must be a time in milliseconds since the epoch, at most 7 days from now, got {until_ms}"),
        ));
    }
    Ok(())
}

impl OutboxApi {
    /// The most bytes an answer may carry: what the claimer can read (0: no preference) and
    /// this server's limit, less room for the answer's own framing. A claimer that cannot read
    /// an answer holding the largest event this server takes is refused: the rows too large
    /// for its answers would be dead-lettered as too large for any (good events, given up for
    /// a caller's setting).
    pub(super) fn answer_bytes(&self, asked: u32) -> Result<usize, ServiceError> {
        const FRAMING: usize = 1024;
        let least = self.db.writer.max_event_bytes() + queue::CLAIM_ROW_OVERHEAD + FRAMING;
        let max = match asked as usize {
            0 => self.max_message_bytes,
            asked if asked < least => {
                return Err(ServiceError::invalid(
                    "max_bytes",
                    format!(
                        "must be 0 (this server's limit) or at least {least}: an answer must hold the largest                          event this server takes (REELAY_MAX_EVENT_BYTES) and its framing; got {asked}                          (the claimer's REELAY_GRPC_MAX_MESSAGE_BYTES is too small)"
                    ),
                ));
            }
            asked => asked.min(self.max_message_bytes),
        };
        Ok(max.saturating_sub(FRAMING))
    }

    async fn claim_now(&self, limits: ClaimLimits) -> Result<Vec<queue::ClaimedRow>, WriteError> {
        let policy = self.policy;
        self.db
            .writer
            .transact::<_, WriteError, _>("outbox_claim", move |tx: &mut WriteTx| {
                Box::pin(async move { Ok(queue::claim_due(tx, tx.now_ms(), policy, &limits).await?) })
            })
            .await
    }

    /// Hands the claimer back the rows its `unanswered` calls claimed and it still holds,
    /// claimed anew, within one answer's `limits` (what does not fit is left to its lease: the
    /// relay does not know of it).
    async fn hand_back_rows(
        &self,
        limits: ClaimLimits,
        unanswered: Vec<u64>,
    ) -> Result<Vec<queue::ClaimedRow>, WriteError> {
        let owner = limits.owner.clone();
        let rows = self
            .db
            .writer
            .transact::<_, WriteError, _>("outbox_resume", move |tx: &mut WriteTx| {
                Box::pin(async move { Ok(queue::resume(tx, &limits, &unanswered, tx.now_ms()).await?) })
            })
            .await?;
        if !rows.is_empty() {
            ROWS_RESUMED.inc_by(&[], rows.len() as u64);
            tracing::warn!(consumer = %owner, rows = rows.len(),
                "handed outbox rows back to their claimer: the claim answer that handed them never reached it");
        }
        Ok(rows)
    }

    /// The relay's claim (its request checked): what its unanswered calls claimed and it still
    /// holds, else what is due, waiting for it up to `wait_ms` or until `stop`. Either way the
    /// rows it hands out are marked with its call id, for a hand-back should the answer never
    /// arrive.
    async fn claim_rows(
        &self,
        r: v1::ClaimRequest,
        stop: impl Future<Output = ()>,
    ) -> Result<Vec<v1::OutboxRow>, WriteError> {
        // Without a consumer's name there is no telling whose rows are whose.
        let named = !r.consumer.is_empty();
        let call = if named { r.call_id } else { 0 };
        let limits = ClaimLimits {
            owner: r.consumer.clone(),
            max_rows: r.max_rows,
            max_bytes: self.answer_bytes(r.max_bytes)?,
            call,
        };
        self.relay_backend()?;
        // Ends after this call's claims are written: a call naming this one waits for that.
        let _running = self.running_rows.running(&r.consumer, call);
        let mut rows = Vec::new();
        if named && !r.unanswered.is_empty() {
            self.running_rows.named_ended(&r.consumer, &r.unanswered, call).await;
            rows = self.hand_back_rows(limits.clone(), r.unanswered.clone()).await?;
        }
        if rows.is_empty() {
            let deadline = Instant::now() + Duration::from_millis(u64::from(r.wait_ms));
            rows = self
                .waiting_rows
                .long_poll(
                    &self.db.writer,
                    deadline,
                    &limits,
                    || self.peek(deadline),
                    || self.claim_now(limits.clone()),
                    stop,
                )
                .await?;
        }
        if !rows.is_empty() {
            tracing::debug!(consumer = %r.consumer, rows = rows.len(), "outbox rows claimed");
        }
        Ok(rows
            .into_iter()
            .map(|row| v1::OutboxRow {
                id: row.id,
                event_id: row.event_id.unwrap_or_default(),
                event_type: row.event_type,
                aggregate_id: row.aggregate_id,
                payload: row.payload,
                attempts: row.attempts,
                claimed_at_ms: row.claimed_at,
                replay_of: row.replay.as_ref().map(|r| r.0.clone()).unwrap_or_default(),
                replay_handler: row.replay.map(|r| r.1).unwrap_or_default(),
            })
            .collect())
    }

    /// Whether anything is claimable now, and when to look again if not: the next row's due
    /// time, bounded by the fallback poll and the deadline.
    async fn peek(&self, deadline: Instant) -> Result<(bool, Instant), WriteError> {
        let mut conn = self.db.reads.acquire().await?;
        let now = now_ms();
        let counted_from = self.db.writer.lease_counted_from();
        let (due, next_due) = queue::peek(&mut conn, now, self.policy, counted_from).await?;
        let fallback = Instant::now() + FALLBACK_POLL;
        let next = next_due.map_or(fallback, |at| Instant::now() + Duration::from_millis((at - now).max(0) as u64));
        Ok((due, next.min(fallback).min(deadline)))
    }
}

impl OutboxApi {
    /// Refuses the relay's calls (Claim, Complete, Fail, Defer) on the db backend: there the
    /// handlers take every row through their cursors, and skip rows marked done, so a relay
    /// pointed at this service (a deployment half switched to nats) would take the events from
    /// them for good.
    fn relay_backend(&self) -> Result<(), ServiceError> {
        if self.bus == Bus::Db {
            return Err(ServiceError::failed_precondition(
                "the outbox is delivered by the handlers on this write service (EVENT_BUS_BACKEND=db): \
                 a relay takes rows only from one on nats",
            ));
        }
        Ok(())
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
        check_unanswered(&r.unanswered)?;
        if r.consumer.is_empty() {
            // Calls are told apart by their consumer: without one there is nothing to name.
            if r.call_id != 0 || !r.unanswered.is_empty() {
                return Err(ServiceError::invalid("consumer", "is required with call_id or unanswered").into());
            }
        } else {
            super::deliveries::check_owner("consumer", &r.consumer)?;
        }
        let this = self.clone();
        let rows = to_the_end(&self.shutdown, move |stop| async move { this.claim_rows(r, stop).await }).await?;
        Ok(Response::new(v1::ClaimResponse { rows }))
    }

    async fn complete(&self, request: Request<v1::CompleteRequest>) -> Result<Response<v1::SettleResponse>, Status> {
        let rows = published(request.into_inner().rows)?;
        self.relay_backend()?;
        let settled = self
            .db
            .writer
            .transact::<_, WriteError, _>("outbox_complete", move |tx: &mut WriteTx| {
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
        self.relay_backend()?;
        let policy = self.policy;
        let settled = self
            .db
            .writer
            .transact::<_, WriteError, _>("outbox_fail", move |tx: &mut WriteTx| {
                Box::pin(async move { Ok(queue::fail(tx, &rows, tx.now_ms(), policy).await?) })
            })
            .await?;
        Ok(Response::new(settle_response(settled)))
    }

    async fn defer(&self, request: Request<v1::DeferRequest>) -> Result<Response<v1::SettleResponse>, Status> {
        let r = request.into_inner();
        let rows = row_claims(r.rows)?;
        check_defer("until_ms", r.until_ms)?;
        self.relay_backend()?;
        let settled = self
            .db
            .writer
            .transact::<_, WriteError, _>("outbox_defer", move |tx: &mut WriteTx| {
                Box::pin(async move { Ok(queue::defer(tx, &rows, r.until_ms).await?) })
            })
            .await?;
        Ok(Response::new(settle_response(settled)))
    }

    async fn stats(&self, _request: Request<v1::StatsRequest>) -> Result<Response<v1::StatsResponse>, Status> {
        let mut conn = self.db.reads.acquire().await.map_err(WriteError::from)?;
        let s = queue::stats(&mut conn, now_ms(), self.bus == Bus::Db).await.map_err(WriteError::from)?;
        let handlers = deliveries::stats(&mut conn, self.bus == Bus::Db)
            .await
            .map_err(WriteError::from)?
            .into_iter()
            .map(|h| v1::HandlerStats {
                handler: h.handler,
                behind: h.behind,
                in_progress: h.in_progress,
                retrying: h.retrying,
                dead_lettered: h.dead_lettered,
            })
            .collect();
        Ok(Response::new(v1::StatsResponse {
            pending: s.pending,
            processing: s.processing,
            done: s.done,
            dead_lettered: s.dead_lettered,
            oldest_due_age_ms: s.oldest_due_age_ms,
            handlers,
        }))
    }

    async fn claim_deliveries(
        &self,
        request: Request<v1::ClaimDeliveriesRequest>,
    ) -> Result<Response<v1::ClaimDeliveriesResponse>, Status> {
        Ok(Response::new(OutboxApi::claim_deliveries(self, request.into_inner()).await?))
    }

    async fn claim_deliveries_for_handlers(
        &self,
        request: Request<v1::ClaimDeliveriesForHandlersRequest>,
    ) -> Result<Response<v1::ClaimDeliveriesForHandlersResponse>, Status> {
        Ok(Response::new(OutboxApi::claim_deliveries_for_handlers(self, request.into_inner()).await?))
    }

    async fn settle_deliveries(
        &self,
        request: Request<v1::SettleDeliveriesRequest>,
    ) -> Result<Response<v1::SettleDeliveriesResponse>, Status> {
        Ok(Response::new(OutboxApi::settle_deliveries(self, request.into_inner()).await?))
    }

    async fn renew_deliveries(
        &self,
        request: Request<v1::RenewDeliveriesRequest>,
    ) -> Result<Response<v1::RenewDeliveriesResponse>, Status> {
        Ok(Response::new(OutboxApi::renew_deliveries(self, request.into_inner()).await?))
    }

    async fn release_instance(
        &self,
        request: Request<v1::ReleaseInstanceRequest>,
    ) -> Result<Response<v1::ReleaseInstanceResponse>, Status> {
        Ok(Response::new(OutboxApi::release_instance(self, request.into_inner()).await?))
    }
}
