//! Dead letters: the (event, handler) deliveries that were given up, and what an operator can
//! do about them. A dead letter is the handler's `processed_events` row in `dead_lettered`, on
//! both backends (see [`crate::ledger::dead_letter`] for nats).
//!
//! Replaying and discarding change only rows still dead-lettered, inside one writer job, so two
//! operators acting on the same dead letter at once change it once; each change is recorded in
//! `dead_letter_actions` with who asked. A replay gives the delivery a fresh set of attempts:
//! on db it becomes a retry due now (the handler's claimer takes it); on nats a replay row is
//! added to the outbox for the relay to republish to that handler alone.

use sqlx::{AssertSqlSafe, Row, SqliteConnection};

use crate::WriteTx;
use crate::enqueue::enqueue_replay;

/// One dead letter.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeadLetter {
    pub event_id: String,
    pub handler: String,
    /// Empty when the event is no longer in the outbox.
    pub event_type: String,
    pub aggregate_id: String,
    pub attempts: u32,
    pub last_error: String,
    pub dead_lettered_at: i64,
    pub replays: u32,
}

/// Which dead letters to list.
#[derive(Debug, Clone, Default)]
pub struct Filter {
    pub handler: Option<String>,
    pub event_type: Option<String>,
    pub since_ms: Option<i64>,
    pub limit: u32,
}

/// Dead letters matching `filter`, newest first, and how many match in all.
pub async fn list(conn: &mut SqliteConnection, filter: &Filter) -> Result<(Vec<DeadLetter>, u64), sqlx::Error> {
    let from = "FROM processed_events p LEFT JOIN event_queue q ON q.event_id = p.event_id \
        WHERE p.status = 'dead_lettered' AND (?1 IS NULL OR p.handler = ?1) AND (?2 IS NULL OR q.event_type = ?2) \
        AND (?3 IS NULL OR COALESCE(p.processed_at, p.renewed_at, p.started_at) >= ?3)";
    let total: i64 = sqlx::query_scalar(AssertSqlSafe(format!("SELECT COUNT(*) {from}")))
        .bind(&filter.handler)
        .bind(&filter.event_type)
        .bind(filter.since_ms)
        .fetch_one(&mut *conn)
        .await?;
    let rows = sqlx::query(AssertSqlSafe(format!(
        "SELECT p.event_id, p.handler, COALESCE(q.event_type, ''), COALESCE(q.aggregate_id, ''), p.attempts, \
         COALESCE(p.last_error, ''), COALESCE(p.processed_at, p.renewed_at, p.started_at) AS at, p.replays {from} \
         ORDER BY at DESC, p.event_id LIMIT ?4"
    )))
    .bind(&filter.handler)
    .bind(&filter.event_type)
    .bind(filter.since_ms)
    .bind(i64::from(filter.limit))
    .fetch_all(&mut *conn)
    .await?;
    let listed = rows
        .into_iter()
        .map(|r| DeadLetter {
            event_id: r.get(0),
            handler: r.get(1),
            event_type: r.get(2),
            aggregate_id: r.get(3),
            attempts: r.get::<i64, _>(4) as u32,
            last_error: r.get(5),
            dead_lettered_at: r.get(6),
            replays: r.get::<i64, _>(7) as u32,
        })
        .collect();
    Ok((listed, total as u64))
}

/// Which dead letters an action is for.
#[derive(Debug, Clone)]
pub enum Target {
    /// These events' dead letters: for one handler, or for every handler.
    Events { event_ids: Vec<String>, handler: Option<String> },
    /// The dead letters of one handler after the event id `after` ("": from the first), at
    /// most [`ALL_OF_BATCH`] by event id: one job's share of "every dead letter of a handler",
    /// which the caller asks for batch by batch so no one job holds the writer for long.
    AllOf { handler: String, after: String },
}

/// Most dead letters one job acts on for [`Target::AllOf`]: each costs the writer a few
/// statements, so a batch holds it some tens of milliseconds.
pub const ALL_OF_BATCH: usize = 500;

/// What an action did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Acted {
    /// (event, handler) pairs changed.
    pub changed: Vec<(String, String)>,
    /// Pairs (or events, with an empty handler) named that were not dead letters: nothing
    /// changed for them.
    pub unchanged: Vec<(String, String)>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Deliver again with a fresh set of attempts. `republish`: the nats backend (a replay row
    /// for the relay), else the db backend (a retry due now).
    Replay { republish: bool },
    /// Never deliver again.
    Discard,
}

impl Action {
    fn name(self) -> &'static str {
        match self {
            Self::Replay { .. } => "replay",
            Self::Discard => "discard",
        }
    }
}

/// Replays or discards the dead letters `target` names, each only if still dead-lettered, and
/// records every change with `operator`.
pub async fn act(
    tx: &mut WriteTx,
    target: &Target,
    action: Action,
    operator: &str,
    now: i64,
) -> Result<Acted, sqlx::Error> {
    let mut acted = Acted::default();
    let candidates: Vec<(String, String)> = match target {
        Target::AllOf { handler, after } => {
            sqlx::query_as(
                "SELECT event_id, handler FROM processed_events \
                 WHERE handler = ? AND status = 'dead_lettered' AND event_id > ? ORDER BY event_id LIMIT ?",
            )
            .bind(handler)
            .bind(after)
            .bind(ALL_OF_BATCH as i64)
            .fetch_all(tx.conn())
            .await?
        }
        Target::Events { event_ids, handler } => {
            let mut found = Vec::new();
            for event_id in event_ids {
                let pairs: Vec<(String, String)> = sqlx::query_as(
                    "SELECT event_id, handler FROM processed_events \
                     WHERE event_id = ? AND (? IS NULL OR handler = ?) AND status = 'dead_lettered' ORDER BY handler",
                )
                .bind(event_id)
                .bind(handler)
                .bind(handler)
                .fetch_all(tx.conn())
                .await?;
                if pairs.is_empty() {
                    acted.unchanged.push((event_id.clone(), handler.clone().unwrap_or_default()));
                }
                found.extend(pairs);
            }
            found
        }
    };
    for (event_id, handler) in candidates {
        let current: Option<(i64, Option<String>)> = sqlx::query_as(
            "SELECT attempts, last_error FROM processed_events \
             WHERE event_id = ? AND handler = ? AND status = 'dead_lettered'",
        )
        .bind(&event_id)
        .bind(&handler)
        .fetch_optional(tx.conn())
        .await?;
        let Some((attempts, last_error)) = current else {
            acted.unchanged.push((event_id, handler));
            continue;
        };
        match action {
            Action::Replay { republish } => {
                // Numbered by the audit trail, which is never purged: the ledger row's count
                // starts again when a failed replay releases its claim (the row is deleted on
                // nats), and a number used again names a copy the outbox already has (and the
                // broker would drop it as a duplicate).
                let replay = replays(tx, &event_id, &handler).await? as u32 + 1;
                // nats: the relay republishes a copy of the event to this handler alone.
                if republish && !enqueue_replay(tx, &event_id, &handler, replay).await? {
                    tracing::warn!(%event_id, %handler, "cannot replay: the event is no longer in the outbox");
                    acted.unchanged.push((event_id, handler));
                    continue;
                }
                sqlx::query(
                    "UPDATE processed_events SET status = 'retry', available_at = ?, attempts = 0, replays = ?, \
                     owner = NULL WHERE event_id = ? AND handler = ? AND status = 'dead_lettered'",
                )
                .bind(now)
                .bind(i64::from(replay))
                .bind(&event_id)
                .bind(&handler)
                .execute(tx.conn())
                .await?;
            }
            Action::Discard => {
                sqlx::query(
                    "UPDATE processed_events SET status = 'discarded', processed_at = ?, owner = NULL \
                     WHERE event_id = ? AND handler = ? AND status = 'dead_lettered'",
                )
                .bind(now)
                .bind(&event_id)
                .bind(&handler)
                .execute(tx.conn())
                .await?;
            }
        }
        sqlx::query(
            "INSERT INTO dead_letter_actions (at, action, event_id, handler, operator, attempts, last_error) \
             VALUES (?, ?, ?, ?, ?, ?, ?)",
        )
        .bind(now)
        .bind(action.name())
        .bind(&event_id)
        .bind(&handler)
        .bind(operator)
        .bind(attempts)
        .bind(last_error)
        .execute(tx.conn())
        .await?;
        tracing::warn!(%event_id, %handler, operator, action = action.name(), "dead letter acted on");
        acted.changed.push((event_id, handler));
    }
    Ok(acted)
}

/// How often an operator replayed `handler`'s dead letter of `event_id`, by the audit trail
/// (never purged; the ledger row's own count goes when a failed replay's claim is released).
pub(crate) async fn replays(tx: &mut WriteTx, event_id: &str, handler: &str) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT COUNT(*) FROM dead_letter_actions WHERE event_id = ? AND handler = ? AND action = 'replay'",
    )
    .bind(event_id)
    .bind(handler)
    .fetch_one(tx.conn())
    .await
}
