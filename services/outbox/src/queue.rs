//! The consumer side of the outbox: claiming due rows and settling them.
//!
//! Every function here runs inside a writer job and takes the clock as an argument, so the
//! schedule can be tested with injected time. A claim's `claimed_at` (ms) is the claimer's
//! token; settling a row is conditioned on it, so a claimer whose lease expired and whose row
//! was claimed again cannot change it.

use std::time::Duration;

use reelay_domain::RetryPolicy;
use sqlx::sqlite::SqliteRow;
use sqlx::{AssertSqlSafe, Row};

use crate::WriteTx;

/// How the outbox hands out and retries rows.
#[derive(Debug, Clone, Copy)]
pub struct QueuePolicy {
    /// A claim older than this is presumed dead and the row is claimable again.
    pub lease: Duration,
    /// Deliveries before a row is dead-lettered (`EVENT_QUEUE_MAX_ATTEMPTS`).
    pub max_attempts: u32,
    /// When a failed row is due again.
    pub retry: RetryPolicy,
}

impl Default for QueuePolicy {
    fn default() -> Self {
        Self { lease: Duration::from_secs(30), max_attempts: 8, retry: RetryPolicy::default() }
    }
}

/// A row handed to a claimer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimedRow {
    pub id: i64,
    pub event_id: Option<String>,
    pub event_type: String,
    pub aggregate_id: String,
    pub payload: Vec<u8>,
    pub attempts: u32,
    pub claimed_at: i64,
    /// A replay row (nats backend): the event it republishes, and to which handler alone.
    pub replay: Option<(String, String)>,
}

/// A claimed row named by id and claim token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowClaim {
    pub id: i64,
    pub claimed_at: i64,
}

/// A row the relay published: where JetStream stored it (0 when not published to JetStream).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Published {
    pub row: RowClaim,
    pub stream_sequence: u64,
}

/// What a settle call did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Settled {
    pub settled: usize,
    /// Rows no longer held under the given token; left untouched.
    pub lost: Vec<i64>,
    pub dead_lettered: Vec<i64>,
}

/// Rows per multi-row statement.
const CHUNK: usize = 200;

fn claims_sql(head: &str, n: usize, tail: &str) -> AssertSqlSafe<String> {
    let tuples = vec!["(?, ?)"; n].join(", ");
    AssertSqlSafe(format!("{head} WHERE (id, claimed_at) IN (VALUES {tuples}) {tail}"))
}

/// What one claim may hand out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimLimits {
    /// Who claims (`<instance>#<incarnation>`): a restarted instance takes back its dead
    /// predecessor's rows at once (see [`crate::deliveries::release_instance`]).
    pub owner: String,
    pub max_rows: u32,
    /// The largest answer the claimer can read: rows are claimed until the next would not fit.
    pub max_bytes: usize,
    /// The claimer's id of the call claiming (0: none), written on the rows it claims so that,
    /// should the answer be lost, the claimer's next call can name it (see [`resume`]).
    pub call: u64,
}

/// A claim call's id as it is stored in `claim_call` (the bits of the u64; none for 0).
pub(crate) fn claim_call(call: u64) -> Option<i64> {
    (call != 0).then_some(call as i64)
}

/// The calls `unanswered` as stored (those with an id), and a `?` for each, to bind in `IN (…)`.
pub(crate) fn claim_calls(unanswered: &[u64]) -> (Vec<i64>, String) {
    let calls: Vec<i64> = unanswered.iter().filter_map(|call| claim_call(*call)).collect();
    let placeholders = vec!["?"; calls.len()].join(", ");
    (calls, placeholders)
}

/// What a claim answer costs per row beyond its payload (ids, type, token, framing), rounded up.
pub const CLAIM_ROW_OVERHEAD: usize = 256;

/// Claims due rows, oldest first, within `limits`: pending rows whose `available_at` has come,
/// and processing rows whose claim is older than the lease, counted from the writer's
/// [`WriteTx::lease_counted_from`] at the earliest (after a restart or a storage fault, the relay
/// that holds a claim gets a whole lease to complete it before it is handed to another, whose
/// republish may be past the broker's duplicate window). A row whose payload alone cannot fit
/// an answer is dead-lettered with the reason instead of being handed out (it would fail every
/// claim, forever).
pub async fn claim_due(
    tx: &mut WriteTx,
    now: i64,
    policy: QueuePolicy,
    limits: &ClaimLimits,
) -> Result<Vec<ClaimedRow>, sqlx::Error> {
    let stale_before = crate::stale_before(tx.lease_counted_from(), now, policy.lease);
    let reclaimed =
        sqlx::query("UPDATE event_queue SET status = 'pending' WHERE status = 'processing' AND claimed_at < ?")
            .bind(stale_before)
            .execute(tx.conn())
            .await?
            .rows_affected();
    if reclaimed > 0 {
        tracing::warn!(rows = reclaimed, "reclaiming outbox rows whose claimer's lease expired");
    }
    // Sizes first (length() of a blob reads no content), so the answer stays within its bytes.
    let candidates: Vec<(i64, i64)> = sqlx::query_as(
        "SELECT id, length(payload) FROM event_queue WHERE status = 'pending' AND available_at <= ? ORDER BY id LIMIT ?",
    )
    .bind(now)
    .bind(i64::from(limits.max_rows))
    .fetch_all(tx.conn())
    .await?;
    let (mut last, mut bytes) = (None, 0usize);
    let mut oversized = Vec::new();
    for (id, length) in candidates {
        let cost = length as usize + CLAIM_ROW_OVERHEAD;
        if cost > limits.max_bytes {
            oversized.push((id, length));
            continue;
        }
        if bytes + cost > limits.max_bytes {
            break;
        }
        bytes += cost;
        last = Some(id);
    }
    // Oversized rows among those examined; any after the last claimed row wait for their turn.
    for (id, length) in oversized.iter().filter(|(id, _)| last.is_none_or(|last| *id < last)) {
        dead_letter_oversized(tx, *id, *length, limits.max_bytes).await?;
    }
    // Nothing fits: every candidate was oversized (and is dead-lettered now), or none was due.
    let Some(last) = last else { return Ok(Vec::new()) };
    let sql = format!(
        "UPDATE event_queue SET status = 'processing', claimed_at = ?1, claimed_by = ?3, claim_call = ?4 \
         WHERE status = 'pending' AND available_at <= ?1 AND id <= ?2 RETURNING {CLAIMED_COLUMNS}"
    );
    let rows = sqlx::query(AssertSqlSafe(sql))
        .bind(now)
        .bind(last)
        .bind(&limits.owner)
        .bind(claim_call(limits.call))
        .fetch_all(tx.conn())
        .await?;
    let mut claimed: Vec<ClaimedRow> = rows.iter().map(claimed_row).collect();
    claimed.sort_by_key(|r| r.id);
    Ok(claimed)
}

/// What a claim reads back of each row it hands out.
const CLAIMED_COLUMNS: &str =
    "id, event_id, event_type, aggregate_id, payload, attempts, claimed_at, replay_of, replay_handler";

fn claimed_row(r: &SqliteRow) -> ClaimedRow {
    ClaimedRow {
        id: r.get("id"),
        event_id: r.get("event_id"),
        event_type: r.get("event_type"),
        aggregate_id: r.get("aggregate_id"),
        payload: r.get("payload"),
        attempts: r.get::<i64, _>("attempts") as u32,
        claimed_at: r.get("claimed_at"),
        replay: r.get::<Option<String>, _>("replay_of").zip(r.get::<Option<String>, _>("replay_handler")),
    }
}

/// Hands the claimer of `limits` back the rows its calls `unanswered` claimed (their answers
/// never reached it) and it still holds: oldest first within `limits`, claimed anew by
/// `limits.call` (a new token, the lease counted from `now`; no attempt spent). The others
/// (settled, deferred, reclaimed since, or over the budget) are left as they are. The caller must
/// know that the claimer publishes none of them (it never heard of them) and that none of those
/// calls is still claiming.
pub async fn resume(
    tx: &mut WriteTx,
    limits: &ClaimLimits,
    unanswered: &[u64],
    now: i64,
) -> Result<Vec<ClaimedRow>, sqlx::Error> {
    let (calls, placeholders) = claim_calls(unanswered);
    if calls.is_empty() {
        return Ok(Vec::new());
    }
    let owner = limits.owner.as_str();
    let sql = format!(
        "SELECT id, length(payload) FROM event_queue WHERE status = 'processing' AND claimed_by = ? \
         AND claim_call IN ({placeholders}) ORDER BY id LIMIT ?"
    );
    let mut query = sqlx::query_as::<_, (i64, i64)>(AssertSqlSafe(sql)).bind(owner);
    for call in &calls {
        query = query.bind(call);
    }
    let held = query.bind(i64::from(limits.max_rows)).fetch_all(tx.conn()).await?;
    let (mut ids, mut bytes) = (Vec::with_capacity(held.len()), 0usize);
    for (id, length) in held {
        let cost = length as usize + CLAIM_ROW_OVERHEAD;
        if bytes + cost > limits.max_bytes {
            break;
        }
        bytes += cost;
        ids.push(id);
    }
    // Claimed anew in the same transaction as the look above: nothing settles them in between.
    let mut resumed = Vec::with_capacity(ids.len());
    for chunk in ids.chunks(CHUNK) {
        let sql = format!(
            "UPDATE event_queue SET claimed_at = ?, claim_call = ? WHERE id IN ({}) AND status = 'processing' \
             AND claimed_by = ? RETURNING {CLAIMED_COLUMNS}",
            vec!["?"; chunk.len()].join(", ")
        );
        let mut query = sqlx::query(AssertSqlSafe(sql)).bind(now).bind(claim_call(limits.call));
        for id in chunk {
            query = query.bind(id);
        }
        resumed.extend(query.bind(owner).fetch_all(tx.conn()).await?.iter().map(claimed_row));
    }
    resumed.sort_by_key(|r| r.id);
    Ok(resumed)
}

async fn dead_letter_oversized(tx: &mut WriteTx, id: i64, length: i64, max_bytes: usize) -> Result<(), sqlx::Error> {
    let reason = format!(
        "undeliverable: the event is {length} bytes and a claim answer holds at most {} bytes of event \
         (REELAY_GRPC_MAX_MESSAGE_BYTES); it was written before the size limit or by a foreign writer",
        max_bytes.saturating_sub(CLAIM_ROW_OVERHEAD)
    );
    let event_id: Option<Option<String>> = sqlx::query_scalar(
        "UPDATE event_queue SET status = 'dead_lettered', last_error = ? WHERE id = ? AND status = 'pending' RETURNING event_id",
    )
    .bind(reason.clone())
    .bind(id)
    .fetch_optional(tx.conn())
    .await?;
    if event_id.is_some() {
        tracing::error!(row = id, event_id = event_id.flatten().as_deref().unwrap_or(""), %reason, "outbox row dead-lettered");
        replay_given_up(tx, id, &reason).await?;
    }
    Ok(())
}

/// The relay gave up the outbox row `id`: when it is a replay copy (one handler's delivery an
/// operator replayed), that delivery is a dead letter again, where the operator finds it (else
/// it would wait in `retry` for a copy that never comes, and no replay could reach it again).
async fn replay_given_up(tx: &mut WriteTx, id: i64, error: &str) -> Result<(), sqlx::Error> {
    let now = tx.now_ms();
    sqlx::query(
        "UPDATE processed_events SET status = 'dead_lettered', last_error = ?, processed_at = ?, owner = NULL \
         WHERE status = 'retry' AND (event_id, handler) = \
             (SELECT replay_of, replay_handler FROM event_queue WHERE id = ? AND replay_of IS NOT NULL)",
    )
    .bind(format!("the relay gave up the replay: {error}"))
    .bind(now)
    .bind(id)
    .execute(tx.conn())
    .await?;
    Ok(())
}

/// Marks published rows done, with the JetStream sequence each was stored at.
pub async fn complete(tx: &mut WriteTx, rows: &[Published]) -> Result<Settled, sqlx::Error> {
    let mut done = Vec::with_capacity(rows.len());
    for chunk in rows.chunks(CHUNK) {
        let sql = format!(
            "UPDATE event_queue SET status = 'done', stream_sequence = NULLIF(v.column3, 0) \
             FROM (VALUES {}) AS v WHERE event_queue.id = v.column1 AND event_queue.claimed_at = v.column2 \
             AND event_queue.status = 'processing' RETURNING event_queue.id",
            vec!["(?, ?, ?)"; chunk.len()].join(", ")
        );
        let mut query = sqlx::query(AssertSqlSafe(sql));
        for p in chunk {
            query = query.bind(p.row.id).bind(p.row.claimed_at).bind(p.stream_sequence as i64);
        }
        done.extend(query.fetch_all(tx.conn()).await?.into_iter().map(|r| r.get::<i64, _>(0)));
    }
    let claims: Vec<RowClaim> = rows.iter().map(|p| p.row).collect();
    Ok(settled(&claims, done, Vec::new()))
}

/// Reschedules rows to `until` without spending an attempt.
pub async fn defer(tx: &mut WriteTx, rows: &[RowClaim], until: i64) -> Result<Settled, sqlx::Error> {
    let mut deferred = Vec::with_capacity(rows.len());
    for chunk in rows.chunks(CHUNK) {
        let mut query = sqlx::query(claims_sql(
            "UPDATE event_queue SET status = 'pending', available_at = ?",
            chunk.len(),
            "AND status = 'processing' RETURNING id",
        ))
        .bind(until);
        for row in chunk {
            query = query.bind(row.id).bind(row.claimed_at);
        }
        deferred.extend(query.fetch_all(tx.conn()).await?.into_iter().map(|r| r.get::<i64, _>(0)));
    }
    Ok(settled(rows, deferred, Vec::new()))
}

/// A failed delivery of one row.
#[derive(Debug, Clone)]
pub struct FailedRow {
    pub row: RowClaim,
    pub error: String,
    /// Retrying cannot help: dead-letter now.
    pub terminal: bool,
}

/// Spends an attempt on each row: the next delivery is due after `policy.retry.delay(attempts)`
/// (`retry_backoff` unless shortened by configuration), or
/// the row is dead-lettered once `max_attempts` deliveries have failed.
pub async fn fail(tx: &mut WriteTx, rows: &[FailedRow], now: i64, policy: QueuePolicy) -> Result<Settled, sqlx::Error> {
    let (mut failed, mut dead) = (Vec::new(), Vec::new());
    for failure in rows {
        let held = sqlx::query(
            "SELECT attempts, event_id FROM event_queue WHERE id = ? AND status = 'processing' AND claimed_at = ?",
        )
        .bind(failure.row.id)
        .bind(failure.row.claimed_at)
        .fetch_optional(tx.conn())
        .await?;
        let Some(held) = held else { continue };
        let attempts = held.get::<i64, _>(0) as u32 + 1;
        let event_id: Option<String> = held.get(1);
        let error = reelay_domain::clip_error(&failure.error);
        if failure.terminal || attempts >= policy.max_attempts {
            sqlx::query("UPDATE event_queue SET status = 'dead_lettered', attempts = ?, last_error = ? WHERE id = ?")
                .bind(i64::from(attempts))
                .bind(error.clone())
                .bind(failure.row.id)
                .execute(tx.conn())
                .await?;
            tracing::error!(row = failure.row.id, event_id = event_id.as_deref().unwrap_or(""), attempts, %error,
                "outbox row dead-lettered");
            replay_given_up(tx, failure.row.id, &error).await?;
            dead.push(failure.row.id);
        } else {
            let next = now + policy.retry.delay(attempts).as_millis() as i64;
            sqlx::query("UPDATE event_queue SET status = 'pending', attempts = ?, available_at = ?, last_error = ? WHERE id = ?")
                .bind(i64::from(attempts))
                .bind(next)
                .bind(error)
                .bind(failure.row.id)
                .execute(tx.conn())
                .await?;
        }
        failed.push(failure.row.id);
    }
    let claims: Vec<RowClaim> = rows.iter().map(|f| f.row).collect();
    Ok(settled(&claims, failed, dead))
}

fn settled(requested: &[RowClaim], changed: Vec<i64>, dead_lettered: Vec<i64>) -> Settled {
    let lost = requested.iter().map(|r| r.id).filter(|id| !changed.contains(id)).collect();
    Settled { settled: changed.len(), lost, dead_lettered }
}

/// Counts by status, and the age of the oldest due pending row.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct QueueStats {
    pub pending: u64,
    pub processing: u64,
    pub done: u64,
    pub dead_lettered: u64,
    /// Of those, the relay's own dead letters (nats): not the copies replayed to one handler
    /// that it gave up, which are that handler's dead letters again.
    pub relay_dead_letters: u64,
    pub oldest_due_age_ms: i64,
}

/// The oldest due moment on db, where rows stay `pending`: of the outbox rows some handler has
/// not been handed yet (the first after the lowest cursor: rows are numbered in the order they
/// are written, and reading them all would walk the whole backlog at every scrape), and of the
/// due retries (through the ledger's index of open deliveries).
pub(crate) const OLDEST_DUE_DB: &str = "SELECT MIN(t) FROM ( \
         SELECT * FROM (SELECT created_at AS t FROM event_queue \
             WHERE id > (SELECT COALESCE(MIN(position), 0) FROM handler_cursors) AND status = 'pending' \
             ORDER BY id LIMIT 1) \
         UNION ALL \
         SELECT MIN(available_at) FROM processed_events \
             WHERE status IN ('in_progress', 'retry') AND status = 'retry' AND available_at <= ?1)";

/// The outbox by status, and the age of what has waited longest. `cursors`: the db backend,
/// where rows stay `pending` and handlers progress by cursor: the oldest is what some handler
/// has not been handed yet, or a due retry ([`OLDEST_DUE_DB`], which reads from the lowest
/// cursor on). On nats it is the oldest row not yet published, pending or being published, by
/// when it was written: a row the relay deferred (the broker down) is due again later, and
/// counting from when it is due would make an hour's outage look a minute old. The pending and
/// processing rows there are only the unpublished ones, while on db the same read would go
/// through every retained row.
pub async fn stats(conn: &mut sqlx::SqliteConnection, now: i64, cursors: bool) -> Result<QueueStats, sqlx::Error> {
    let mut stats = QueueStats::default();
    for row in sqlx::query("SELECT status, COUNT(*) FROM event_queue GROUP BY status").fetch_all(&mut *conn).await? {
        let count = row.get::<i64, _>(1) as u64;
        match row.get::<String, _>(0).as_str() {
            "pending" => stats.pending = count,
            "processing" => stats.processing = count,
            "done" => stats.done = count,
            "dead_lettered" => stats.dead_lettered = count,
            _ => {}
        }
    }
    if !cursors && stats.dead_lettered > 0 {
        stats.relay_dead_letters = sqlx::query_scalar::<_, i64>(
            "SELECT COUNT(*) FROM event_queue WHERE status = 'dead_lettered' AND replay_of IS NULL",
        )
        .fetch_one(&mut *conn)
        .await? as u64;
    }
    let oldest = if cursors {
        OLDEST_DUE_DB
    } else {
        // By status: walking the `created_at` index from the oldest would go through every
        // published row kept (SQLite may pick that plan once it has statistics).
        "SELECT MIN(created_at) FROM event_queue INDEXED BY event_queue_status_id \
         WHERE status IN ('pending', 'processing') AND created_at <= ?1"
    };
    let oldest: Option<i64> = sqlx::query_scalar(oldest).bind(now).fetch_one(&mut *conn).await?;
    stats.oldest_due_age_ms = oldest.map_or(0, |t| (now - t).max(0));
    Ok(stats)
}

/// A read-only look at the queue for an idle claimer: whether any row is claimable now, and
/// if not, when the next pending row becomes due (ms). Lets a claimer skip a write job (and its
/// commit) when there is nothing to claim.
///
/// The next due time reads every pending row (no index has `available_at`), so it is looked up
/// only when nothing is due: a relay draining a backlog peeks before every claim, and reading
/// 100,000 pending rows took 17 ms each time. `lease_counted_from` is the writer's
/// ([`crate::Writer::lease_counted_from`]), so a look finds due what a claim would take over.
pub async fn peek(
    conn: &mut sqlx::SqliteConnection,
    now: i64,
    policy: QueuePolicy,
    lease_counted_from: i64,
) -> Result<(bool, Option<i64>), sqlx::Error> {
    let row = sqlx::query(
        "WITH look(due) AS (\
             SELECT EXISTS (SELECT 1 FROM event_queue WHERE status = 'pending' AND available_at <= ?1) \
                 OR EXISTS (SELECT 1 FROM event_queue WHERE status = 'processing' AND claimed_at < ?2)) \
         SELECT due, \
             CASE WHEN due THEN NULL ELSE (SELECT MIN(available_at) FROM event_queue WHERE status = 'pending') END \
         FROM look",
    )
    .bind(now)
    .bind(crate::stale_before(lease_counted_from, now, policy.lease))
    .fetch_one(conn)
    .await?;
    Ok((row.get(0), row.get(1)))
}

/// Deletes up to `batch` outbox rows that every handler is finished with and that were written
/// before `cutoff` (ms), oldest first; returns how many went (call again until 0).
///
/// Finished means: on the nats backend (`cursors` false) the relay published the row (`done`);
/// on the db backend every handler's cursor is past it (a handler no longer deployed keeps its
/// cursor, and holds retention back until it is retired: [`crate::deliveries::retire`]). On
/// both, no handler's delivery of it is still open (claimed, retrying) or dead-lettered: a dead
/// letter keeps its event until an operator replays or discards it. Rows dead-lettered in the outbox itself stay too.
pub async fn purge_finished(tx: &mut WriteTx, cutoff: i64, cursors: bool, batch: u32) -> Result<u64, sqlx::Error> {
    let sql = purge_finished_sql(cursors);
    let deleted =
        sqlx::query(AssertSqlSafe(sql)).bind(cutoff).bind(i64::from(batch)).execute(tx.conn()).await?.rows_affected();
    Ok(deleted)
}

/// The statement of [`purge_finished`]. It walks the outbox oldest first by `created_at`, so a
/// purge reads the rows it deletes (and the few a dead letter holds back), not every row kept:
/// the `+` keeps SQLite from choosing the status index, through which it read every finished
/// row of the retained week and sorted them, once a minute in the writer. On db the walk also
/// ends at the row of the lowest cursor: the rows after it past the cutoff (a handler stopped
/// for days holds them back) were read through on every purge, to find none to delete (30 ms
/// per 500,000 rows measured, in the writer each minute).
pub(crate) fn purge_finished_sql(cursors: bool) -> String {
    let (until, finished) = if cursors {
        let lowest = "(SELECT COALESCE(MIN(position), 0) FROM handler_cursors)";
        (
            // When the row at (or last before) the lowest cursor was written: a NULL, no row,
            // selects nothing.
            format!("MIN(?1, (SELECT created_at + 1 FROM event_queue WHERE id <= {lowest} ORDER BY id DESC LIMIT 1))"),
            format!("+q.status IN ('pending', 'done') AND q.id <= {lowest}"),
        )
    } else {
        // Published, or given up by the relay and discarded by an operator.
        ("?1".to_owned(), "+q.status IN ('done', 'discarded')".to_owned())
    };
    format!(
        "DELETE FROM event_queue WHERE id IN ( \
             SELECT q.id FROM event_queue q WHERE q.created_at < {until} AND {finished} \
             AND NOT EXISTS (SELECT 1 FROM processed_events p \
                 WHERE p.event_id = COALESCE(q.event_id, 'row:' || q.id) AND p.status IN ('in_progress', 'retry', 'dead_lettered')) \
             ORDER BY q.created_at LIMIT ?2)"
    )
}
