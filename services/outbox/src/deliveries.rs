//! Per-handler delivery on the db backend: each (event, handler) has its own attempts, retry
//! schedule and fate, so a failing, slow or stopped handler never holds back another.
//!
//! A write adds one outbox row per event, whatever the number of handlers. Each handler has a
//! cursor into `event_queue`; claiming for a handler hands it the rows after its cursor (those of
//! the types it takes) by creating its `processed_events` row in `in_progress`, and claims its
//! due retries and the claims whose owner stopped renewing them. That row is both the ledger
//! claim (its millisecond `started_at` is the owner's token) and the delivery state; settling
//! it (done, retry, dead-lettered) is conditioned on the token, so a stale owner changes nothing.
//!
//! Every function runs inside a writer job and takes the clock as an argument.

use std::collections::HashMap;
use std::time::Duration;

use reelay_domain::RetryPolicy;
use sqlx::{AssertSqlSafe, Row};

use crate::WriteTx;
use crate::queue::CLAIM_ROW_OVERHEAD;

/// How per-handler deliveries are leased and retried.
#[derive(Debug, Clone, Copy)]
pub struct HandlerPolicy {
    /// A claim not renewed for this long is presumed dead and may be taken over.
    pub lease: Duration,
    /// Failed deliveries of one event to one handler before it is dead-lettered for that handler.
    pub max_attempts: u32,
    pub retry: RetryPolicy,
}

impl Default for HandlerPolicy {
    fn default() -> Self {
        Self { lease: Duration::from_secs(30), max_attempts: 8, retry: RetryPolicy::default() }
    }
}

/// One handler's claim request.
#[derive(Debug, Clone)]
pub struct HandlerClaim {
    pub handler: String,
    /// The event types the handler takes; other rows are passed over.
    pub event_types: Vec<String>,
    /// `<instance>#<incarnation>` of the claimer.
    pub owner: String,
    pub max_rows: u32,
    /// The largest answer the claimer can read.
    pub max_bytes: usize,
}

/// An event handed to a handler.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimedDelivery {
    pub row_id: i64,
    /// The ledger key: the event id, or `row:<id>` for a foreign writer's row without one.
    pub key: String,
    pub event_type: String,
    pub aggregate_id: String,
    pub payload: Vec<u8>,
    /// 1 for the first delivery to this handler.
    pub attempt: u32,
    /// The owner's token: settle with it.
    pub token: i64,
}

/// What became of one delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeliveryOutcome {
    Done,
    /// Spends an attempt: retried after the backoff, or dead-lettered when none are left (or at
    /// once when `terminal`).
    Failed {
        error: String,
        terminal: bool,
    },
    /// Handed back without spending an attempt, due again at `until_ms`.
    Deferred {
        until_ms: i64,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settlement {
    pub key: String,
    pub token: i64,
    pub outcome: DeliveryOutcome,
}

/// What a settle did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Settled {
    pub settled: usize,
    /// Keys no longer held under the given token; nothing changed for them.
    pub lost: Vec<String>,
    pub dead_lettered: Vec<String>,
}

/// Why a claim was refused.
#[derive(Debug, thiserror::Error)]
pub enum ClaimError {
    #[error(
        "handler {0:?} is not registered with the write service; run the write service with a build (and \
         --handler list) that has it, so no event written meanwhile is missed"
    )]
    UnknownHandler(String),
    #[error(transparent)]
    Sql(#[from] sqlx::Error),
}

/// The key of a row in `processed_events`.
pub fn delivery_key(row_id: i64, event_id: Option<&str>) -> String {
    event_id.map_or_else(|| format!("row:{row_id}"), str::to_owned)
}

/// Makes sure each handler has a cursor. The first cursors ever created start at the delivery
/// floor (the oldest row not yet settled when the schema was upgraded, or the start of a fresh
/// database); a handler added later starts after the newest row, with the events written from
/// now on (the write service registers its handlers before it takes writes, so none is missed).
/// Returns the handlers that were new.
pub async fn register(tx: &mut WriteTx, handlers: &[String], now: i64) -> Result<Vec<String>, sqlx::Error> {
    let existing: Vec<String> = sqlx::query_scalar("SELECT handler FROM handler_cursors").fetch_all(tx.conn()).await?;
    let start: i64 = if existing.is_empty() {
        sqlx::query_scalar("SELECT value FROM outbox_meta WHERE key = 'delivery_floor'").fetch_one(tx.conn()).await?
    } else {
        sqlx::query_scalar("SELECT COALESCE(MAX(id), 0) FROM event_queue").fetch_one(tx.conn()).await?
    };
    let mut added = Vec::new();
    for handler in handlers.iter().filter(|h| !existing.contains(h)) {
        sqlx::query("INSERT INTO handler_cursors (handler, position, created_at, updated_at) VALUES (?, ?, ?, ?)")
            .bind(handler)
            .bind(start)
            .bind(now)
            .bind(now)
            .execute(tx.conn())
            .await?;
        added.push(handler.clone());
    }
    Ok(added)
}

/// An outbox row as the claim sees it before deciding.
struct Candidate {
    id: i64,
    event_id: Option<String>,
    event_type: String,
    status: String,
    length: i64,
}

/// Claims deliveries for one handler within its limits: first its due retries and the claims
/// whose owner stopped renewing them, then rows after its cursor.
pub async fn claim(
    tx: &mut WriteTx,
    now: i64,
    policy: HandlerPolicy,
    request: &HandlerClaim,
) -> Result<Vec<ClaimedDelivery>, ClaimError> {
    let position: Option<i64> = sqlx::query_scalar("SELECT position FROM handler_cursors WHERE handler = ?")
        .bind(&request.handler)
        .fetch_optional(tx.conn())
        .await?;
    let Some(position) = position else { return Err(ClaimError::UnknownHandler(request.handler.clone())) };
    let mut budget = Budget { rows: request.max_rows as usize, bytes: request.max_bytes };
    let mut claimed = claim_open(tx, now, policy, request, &mut budget).await?;
    if budget.rows > 0 {
        claimed.extend(claim_new(tx, now, position, request, &mut budget).await?);
    }
    Ok(claimed)
}

struct Budget {
    rows: usize,
    bytes: usize,
}

impl Budget {
    /// Takes a row of `length` bytes if it fits; an empty claim always takes one that fits an
    /// answer at all.
    fn take(&mut self, length: i64, max_bytes: usize, first: bool) -> bool {
        let cost = length as usize + CLAIM_ROW_OVERHEAD;
        if self.rows == 0 || cost > self.bytes && !(first && cost <= max_bytes) {
            return false;
        }
        self.rows -= 1;
        self.bytes = self.bytes.saturating_sub(cost);
        true
    }
}

/// Due retries and expired claims of the handler, taken over under a new token.
async fn claim_open(
    tx: &mut WriteTx,
    now: i64,
    policy: HandlerPolicy,
    request: &HandlerClaim,
    budget: &mut Budget,
) -> Result<Vec<ClaimedDelivery>, sqlx::Error> {
    let stale = now - policy.lease.as_millis() as i64;
    let open: Vec<(String, i64, i64, String, Option<String>)> = sqlx::query_as(
        "SELECT event_id, attempts, started_at, status, owner FROM processed_events \
         WHERE handler = ?1 AND ((status = 'retry' AND available_at <= ?2) OR (status = 'in_progress' AND renewed_at < ?3)) \
         ORDER BY started_at LIMIT ?4",
    )
    .bind(&request.handler)
    .bind(now)
    .bind(stale)
    .bind(budget.rows as i64)
    .fetch_all(tx.conn())
    .await?;
    if open.is_empty() {
        return Ok(Vec::new());
    }
    let rows = outbox_rows_of(tx, open.iter().map(|o| o.0.as_str())).await?;
    let mut taken = Vec::new();
    for (key, attempts, started_at, status, owner) in open {
        let Some(&(row_id, length)) = rows.get(&key) else {
            // The outbox row is gone (deleted by hand or by retention): nothing left to deliver.
            sqlx::query(
                "UPDATE processed_events SET status = 'dead_lettered', last_error = ?, processed_at = ?, owner = NULL \
                 WHERE event_id = ? AND handler = ?",
            )
            .bind("the event is no longer in the outbox")
            .bind(now)
            .bind(&key)
            .bind(&request.handler)
            .execute(tx.conn())
            .await?;
            continue;
        };
        if !budget.take(length, request.max_bytes, taken.is_empty()) {
            break;
        }
        if status == "in_progress" {
            tracing::warn!(event_id = %key, handler = %request.handler, stale_owner = owner.unwrap_or_default(),
                "taking over a delivery whose owner stopped renewing its claim");
        }
        let token = now.max(started_at + 1);
        sqlx::query(
            "UPDATE processed_events SET status = 'in_progress', started_at = ?, renewed_at = ?, owner = ? \
             WHERE event_id = ? AND handler = ? AND started_at = ?",
        )
        .bind(token)
        .bind(now)
        .bind(&request.owner)
        .bind(&key)
        .bind(&request.handler)
        .bind(started_at)
        .execute(tx.conn())
        .await?;
        taken.push((row_id, key, attempts as u32 + 1, token));
    }
    load(tx, taken).await
}

/// The outbox row id and payload length of each delivery key.
async fn outbox_rows_of<'k>(
    tx: &mut WriteTx,
    keys: impl Iterator<Item = &'k str>,
) -> Result<HashMap<String, (i64, i64)>, sqlx::Error> {
    let (mut by_row, mut by_event): (Vec<i64>, Vec<&str>) = (Vec::new(), Vec::new());
    for key in keys {
        match key.strip_prefix("row:").and_then(|id| id.parse().ok()) {
            Some(row_id) => by_row.push(row_id),
            None => by_event.push(key),
        }
    }
    let mut found = HashMap::new();
    for chunk in by_event.chunks(500) {
        let sql = format!(
            "SELECT event_id, id, length(payload) FROM event_queue WHERE event_id IN ({})",
            vec!["?"; chunk.len()].join(", ")
        );
        let mut query = sqlx::query(AssertSqlSafe(sql));
        for key in chunk {
            query = query.bind(*key);
        }
        for r in query.fetch_all(tx.conn()).await? {
            found.insert(r.get::<String, _>(0), (r.get(1), r.get(2)));
        }
    }
    for chunk in by_row.chunks(500) {
        let sql =
            format!("SELECT id, length(payload) FROM event_queue WHERE id IN ({})", vec!["?"; chunk.len()].join(", "));
        let mut query = sqlx::query(AssertSqlSafe(sql));
        for row_id in chunk {
            query = query.bind(row_id);
        }
        for r in query.fetch_all(tx.conn()).await? {
            let row_id: i64 = r.get(0);
            found.insert(format!("row:{row_id}"), (row_id, r.get(1)));
        }
    }
    Ok(found)
}

/// Rows after the handler's cursor: each of its types is handed over (its `processed_events`
/// row created), others are passed; the cursor then moves past everything decided.
async fn claim_new(
    tx: &mut WriteTx,
    now: i64,
    position: i64,
    request: &HandlerClaim,
    budget: &mut Budget,
) -> Result<Vec<ClaimedDelivery>, sqlx::Error> {
    // Look at more rows than can be claimed: most may be of types this handler does not take. A
    // window with nothing for this handler moves the cursor and looks at the next one at once
    // (a few per claim), so a handler far behind on rows it does not take catches up in one call.
    let scan = (budget.rows * 4).max(512) as i64;
    let mut moved_to = position;
    let mut handed: Vec<Candidate> = Vec::new();
    let mut oversized: Vec<Candidate> = Vec::new();
    for _ in 0..SCAN_WINDOWS {
        let candidates: Vec<Candidate> = sqlx::query(
            "SELECT id, event_id, event_type, status, length(payload) FROM event_queue WHERE id > ? ORDER BY id LIMIT ?",
        )
        .bind(moved_to)
        .bind(scan)
        .fetch_all(tx.conn())
        .await?
        .into_iter()
        .map(|r| Candidate { id: r.get(0), event_id: r.get(1), event_type: r.get(2), status: r.get(3), length: r.get(4) })
        .collect();
        let full = candidates.len() as i64 == scan;
        let mut budget_spent = false;
        for candidate in candidates {
            // Settled before per-handler delivery (upgraded databases), or not this handler's.
            let passed = matches!(candidate.status.as_str(), "done" | "dead_lettered")
                || !request.event_types.contains(&candidate.event_type);
            let id = candidate.id;
            if !passed {
                let cost = candidate.length as usize + CLAIM_ROW_OVERHEAD;
                if cost > request.max_bytes {
                    oversized.push(candidate);
                } else if !budget.take(candidate.length, request.max_bytes, handed.is_empty()) {
                    budget_spent = true;
                    break;
                } else {
                    handed.push(candidate);
                }
            }
            moved_to = id;
        }
        if budget_spent || !full || !handed.is_empty() || !oversized.is_empty() {
            break;
        }
    }
    for candidate in oversized {
        let reason = format!(
            "undeliverable: the event is {} bytes and a claim answer holds at most {} bytes of event \
             (REELAY_GRPC_MAX_MESSAGE_BYTES)",
            candidate.length,
            request.max_bytes.saturating_sub(CLAIM_ROW_OVERHEAD)
        );
        let key = delivery_key(candidate.id, candidate.event_id.as_deref());
        tracing::error!(event_id = %key, handler = %request.handler, %reason, "delivery dead-lettered");
        sqlx::query(
            "INSERT INTO processed_events (event_id, handler, status, started_at, renewed_at, processed_at, attempts, \
             last_error) VALUES (?, ?, 'dead_lettered', ?, ?, ?, 0, ?) ON CONFLICT DO NOTHING",
        )
        .bind(key)
        .bind(&request.handler)
        .bind(now)
        .bind(now)
        .bind(now)
        .bind(reason)
        .execute(tx.conn())
        .await?;
    }
    let mut taken = Vec::new();
    for chunk in handed.chunks(200) {
        let sql = format!(
            "INSERT INTO processed_events (event_id, handler, status, started_at, renewed_at, owner, attempts) VALUES {} \
             ON CONFLICT DO NOTHING RETURNING event_id",
            vec!["(?, ?, 'in_progress', ?, ?, ?, 0)"; chunk.len()].join(", ")
        );
        let mut insert = sqlx::query(AssertSqlSafe(sql));
        for candidate in chunk {
            insert = insert
                .bind(delivery_key(candidate.id, candidate.event_id.as_deref()))
                .bind(&request.handler)
                .bind(now)
                .bind(now)
                .bind(&request.owner);
        }
        let inserted: Vec<String> = insert.fetch_all(tx.conn()).await?.into_iter().map(|r| r.get(0)).collect();
        // A key that already had a row was handled before (or is claimed elsewhere, and comes
        // back through its lease): it is passed.
        for candidate in chunk {
            let key = delivery_key(candidate.id, candidate.event_id.as_deref());
            if inserted.contains(&key) {
                taken.push((candidate.id, key, 1, now));
            }
        }
    }
    if moved_to != position {
        sqlx::query("UPDATE handler_cursors SET position = ?, updated_at = ? WHERE handler = ?")
            .bind(moved_to)
            .bind(now)
            .bind(&request.handler)
            .execute(tx.conn())
            .await?;
    }
    load(tx, taken).await
}

/// Windows of rows one claim looks through while it finds nothing for the handler.
const SCAN_WINDOWS: usize = 16;

/// Reads the claimed rows' contents, in outbox order.
async fn load(tx: &mut WriteTx, taken: Vec<(i64, String, u32, i64)>) -> Result<Vec<ClaimedDelivery>, sqlx::Error> {
    if taken.is_empty() {
        return Ok(Vec::new());
    }
    let mut claimed = Vec::with_capacity(taken.len());
    for chunk in taken.chunks(500) {
        let sql = format!(
            "SELECT id, event_type, aggregate_id, payload FROM event_queue WHERE id IN ({})",
            vec!["?"; chunk.len()].join(", ")
        );
        let mut query = sqlx::query(AssertSqlSafe(sql));
        for (row_id, ..) in chunk {
            query = query.bind(row_id);
        }
        let mut rows: HashMap<i64, (String, String, Vec<u8>)> =
            query.fetch_all(tx.conn()).await?.into_iter().map(|r| (r.get(0), (r.get(1), r.get(2), r.get(3)))).collect();
        for (row_id, key, attempt, token) in chunk {
            if let Some((event_type, aggregate_id, payload)) = rows.remove(row_id) {
                claimed.push(ClaimedDelivery {
                    row_id: *row_id,
                    key: key.clone(),
                    event_type,
                    aggregate_id,
                    payload,
                    attempt: *attempt,
                    token: *token,
                });
            }
        }
    }
    claimed.sort_by_key(|d| d.row_id);
    Ok(claimed)
}

/// Settles deliveries of one handler, each conditioned on its token.
pub async fn settle(
    tx: &mut WriteTx,
    handler: &str,
    settlements: &[Settlement],
    now: i64,
    policy: HandlerPolicy,
) -> Result<Settled, sqlx::Error> {
    let mut settled = Settled::default();
    for s in settlements {
        let changed = match &s.outcome {
            DeliveryOutcome::Done => sqlx::query(
                "UPDATE processed_events SET status = 'done', processed_at = ?, owner = NULL \
                     WHERE event_id = ? AND handler = ? AND started_at = ? AND status = 'in_progress'",
            )
            .bind(now)
            .bind(&s.key)
            .bind(handler)
            .bind(s.token)
            .execute(tx.conn())
            .await?
            .rows_affected(),
            DeliveryOutcome::Deferred { until_ms } => sqlx::query(
                "UPDATE processed_events SET status = 'retry', available_at = ?, owner = NULL \
                     WHERE event_id = ? AND handler = ? AND started_at = ? AND status = 'in_progress'",
            )
            .bind(until_ms)
            .bind(&s.key)
            .bind(handler)
            .bind(s.token)
            .execute(tx.conn())
            .await?
            .rows_affected(),
            DeliveryOutcome::Failed { error, terminal } => {
                let held: Option<i64> = sqlx::query_scalar(
                    "SELECT attempts FROM processed_events \
                     WHERE event_id = ? AND handler = ? AND started_at = ? AND status = 'in_progress'",
                )
                .bind(&s.key)
                .bind(handler)
                .bind(s.token)
                .fetch_optional(tx.conn())
                .await?;
                match held {
                    None => 0,
                    Some(attempts) => {
                        let attempts = attempts as u32 + 1;
                        let error: String = error.chars().take(2000).collect();
                        let dead = *terminal || attempts >= policy.max_attempts;
                        let (status, due) = if dead {
                            tracing::error!(event_id = %s.key, handler, attempts, %error, "delivery dead-lettered for this handler");
                            settled.dead_lettered.push(s.key.clone());
                            ("dead_lettered", None)
                        } else {
                            ("retry", Some(now + policy.retry.delay(attempts).as_millis() as i64))
                        };
                        sqlx::query(
                            "UPDATE processed_events SET status = ?, attempts = ?, available_at = ?, last_error = ?, owner = NULL, \
                             processed_at = COALESCE(?, processed_at) WHERE event_id = ? AND handler = ?",
                        )
                        .bind(status)
                        .bind(i64::from(attempts))
                        .bind(due)
                        .bind(error)
                        .bind(dead.then_some(now))
                        .bind(&s.key)
                        .bind(handler)
                        .execute(tx.conn())
                        .await?
                        .rows_affected()
                    }
                }
            }
        };
        if changed == 0 {
            settled.lost.push(s.key.clone());
        } else {
            settled.settled += 1;
        }
    }
    Ok(settled)
}

/// The owner is still at work on these claims: pushes their leases out. Returns the keys no
/// longer held under the given tokens.
pub async fn renew(
    tx: &mut WriteTx,
    handler: &str,
    keys: &[(String, i64)],
    now: i64,
) -> Result<Vec<String>, sqlx::Error> {
    let mut lost = Vec::new();
    for chunk in keys.chunks(200) {
        let sql = format!(
            "UPDATE processed_events SET renewed_at = ? WHERE handler = ? AND status = 'in_progress' \
             AND (event_id, started_at) IN (VALUES {}) RETURNING event_id",
            vec!["(?, ?)"; chunk.len()].join(", ")
        );
        let mut query = sqlx::query(AssertSqlSafe(sql)).bind(now).bind(handler);
        for (key, token) in chunk {
            query = query.bind(key).bind(token);
        }
        let renewed: Vec<String> = query.fetch_all(tx.conn()).await?.into_iter().map(|r| r.get(0)).collect();
        lost.extend(chunk.iter().filter(|(key, _)| !renewed.contains(key)).map(|(key, _)| key.clone()));
    }
    Ok(lost)
}

/// Claims still held by an earlier run of `instance` (its process died): handed back at once,
/// without spending an attempt, instead of waiting out their leases. Covers per-handler
/// deliveries, ledger claims (nats backend) and the relay's outbox rows. Returns how many.
///
/// Only sound if no two live processes share an instance name.
pub async fn release_instance(tx: &mut WriteTx, instance: &str, me: &str, now: i64) -> Result<u64, sqlx::Error> {
    let pattern = format!("{}#%", escape_like(instance));
    let deliveries = sqlx::query(
        "UPDATE processed_events SET status = 'retry', available_at = ?, owner = NULL \
         WHERE status = 'in_progress' AND owner LIKE ? ESCAPE '\\' AND owner != ?",
    )
    .bind(now)
    .bind(&pattern)
    .bind(me)
    .execute(tx.conn())
    .await?
    .rows_affected();
    let rows = sqlx::query(
        "UPDATE event_queue SET status = 'pending', claimed_by = NULL \
         WHERE status = 'processing' AND claimed_by LIKE ? ESCAPE '\\' AND claimed_by != ?",
    )
    .bind(&pattern)
    .bind(me)
    .execute(tx.conn())
    .await?
    .rows_affected();
    Ok(deliveries + rows)
}

fn escape_like(value: &str) -> String {
    value.replace('\\', "\\\\").replace('%', "\\%").replace('_', "\\_")
}

/// Where one handler stands.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HandlerStats {
    pub handler: String,
    /// Outbox rows after its cursor (of any type): not yet looked at.
    pub behind: u64,
    pub in_progress: u64,
    pub retrying: u64,
    pub dead_lettered: u64,
}

pub async fn stats(conn: &mut sqlx::SqliteConnection) -> Result<Vec<HandlerStats>, sqlx::Error> {
    let rows = sqlx::query(
        "SELECT c.handler, \
            (SELECT COUNT(*) FROM event_queue q WHERE q.id > c.position), \
            (SELECT COUNT(*) FROM processed_events p WHERE p.handler = c.handler AND p.status = 'in_progress'), \
            (SELECT COUNT(*) FROM processed_events p WHERE p.handler = c.handler AND p.status = 'retry'), \
            (SELECT COUNT(*) FROM processed_events p WHERE p.handler = c.handler AND p.status = 'dead_lettered') \
         FROM handler_cursors c ORDER BY c.handler",
    )
    .fetch_all(conn)
    .await?;
    Ok(rows
        .into_iter()
        .map(|r| HandlerStats {
            handler: r.get(0),
            behind: r.get::<i64, _>(1) as u64,
            in_progress: r.get::<i64, _>(2) as u64,
            retrying: r.get::<i64, _>(3) as u64,
            dead_lettered: r.get::<i64, _>(4) as u64,
        })
        .collect())
}

/// A read-only look for an idle claimer: whether the handler has anything to claim now, and
/// when its next retry is due.
pub async fn peek(
    conn: &mut sqlx::SqliteConnection,
    handler: &str,
    now: i64,
    policy: HandlerPolicy,
) -> Result<(bool, Option<i64>), sqlx::Error> {
    let row = sqlx::query(
        "SELECT EXISTS (SELECT 1 FROM event_queue WHERE id > (SELECT position FROM handler_cursors WHERE handler = ?1)) \
             OR EXISTS (SELECT 1 FROM processed_events WHERE handler = ?1 AND \
                 ((status = 'retry' AND available_at <= ?2) OR (status = 'in_progress' AND renewed_at < ?3))), \
                (SELECT MIN(available_at) FROM processed_events WHERE handler = ?1 AND status = 'retry')",
    )
    .bind(handler)
    .bind(now)
    .bind(now - policy.lease.as_millis() as i64)
    .fetch_one(conn)
    .await?;
    Ok((row.get(0), row.get(1)))
}
