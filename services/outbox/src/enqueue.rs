//! `enqueue_events`: the one code path that inserts outbox rows.

use prost::Message;
use reelay_contracts::v1;
use reelay_domain::{EventId, NewEvent};
use sqlx::AssertSqlSafe;

use crate::WriteTx;

/// Rows per INSERT statement (8 parameters each).
const ROWS_PER_STATEMENT: usize = 100;

/// Why events could not be enqueued.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EnqueueError {
    /// Delivering it would exceed a claim answer or a broker message: refused before anything is
    /// written, since it could never reach its handlers.
    #[error(
        "the {event_type} event this write raises would be {bytes} bytes, over the {limit}-byte limit for one event (REELAY_MAX_EVENT_BYTES)"
    )]
    TooLarge { event_type: &'static str, bytes: usize, limit: usize },
}

/// What was written for one event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnqueuedEvent {
    pub event_id: EventId,
    pub event_type: &'static str,
}

/// An outbox row waiting for its batch's commit.
#[derive(Debug, Clone)]
pub(crate) struct OutboxInsert {
    event_id: String,
    event_type: String,
    aggregate_id: String,
    payload: Vec<u8>,
    at: i64,
    /// A replay: the event it republishes, and the one handler it is for.
    replay: Option<(String, String)>,
}

/// Adds `events` to the outbox (`event_queue`) inside the caller's write transaction, so they
/// commit or roll back with the change that caused them. Every row gets a fresh random
/// `event_id`, the job's timestamp and the request's trace context, and is due at once.
///
/// The rows are written by the writer just before the commit, together with those of the other
/// jobs of the batch (one multi-row insert instead of one per job); a job that fails takes its
/// rows with it. An event larger than the configured limit fails the job: it could never be
/// delivered.
pub async fn enqueue_events(tx: &mut WriteTx, events: Vec<NewEvent>) -> Result<Vec<EnqueuedEvent>, EnqueueError> {
    // Benchmark builds only: measure what the write path costs without its events.
    if reelay_kit::failpoint_armed("skip_events") {
        return Ok(Vec::new());
    }
    let at = tx.now_ms();
    let mut enqueued = Vec::with_capacity(events.len());
    for event in events {
        let event_id = EventId::new();
        let event_type = event.event_type();
        let envelope = v1::Event {
            event_id: event_id.to_string(),
            event_type: event_type.to_owned(),
            aggregate_id: event.aggregate_id.clone(),
            occurred_at_ms: at,
            occurred_at_us: tx.next_event_us(),
            traceparent: tx.traceparent.clone(),
            payload: Some(event.payload),
        };
        let payload = envelope.encode_to_vec();
        if payload.len() > tx.max_event_bytes {
            return Err(EnqueueError::TooLarge { event_type, bytes: payload.len(), limit: tx.max_event_bytes });
        }
        tx.job_rows.push(OutboxInsert {
            event_id: event_id.to_string(),
            event_type: event_type.to_owned(),
            aggregate_id: event.aggregate_id,
            payload,
            at,
            replay: None,
        });
        enqueued.push(EnqueuedEvent { event_id, event_type });
    }
    Ok(enqueued)
}

/// Adds a replay of the event `key` (an event id, or `row:<id>`) for `handler` alone to the
/// outbox, inside the caller's write transaction: a copy of the event's row that the relay
/// republishes to that handler's replay subject with the message id
/// `<event id>:replay:<replay>:<handler>` (nats backend). False when the event is no longer in
/// the outbox (nothing is written).
pub async fn enqueue_replay(tx: &mut WriteTx, key: &str, handler: &str, replay: u32) -> Result<bool, sqlx::Error> {
    let row: Option<(Option<String>, String, String, Vec<u8>)> = match key.strip_prefix("row:").and_then(|id| id.parse::<i64>().ok()) {
        Some(id) => sqlx::query_as("SELECT event_id, event_type, aggregate_id, payload FROM event_queue WHERE id = ?")
            .bind(id)
            .fetch_optional(tx.conn())
            .await?,
        None => sqlx::query_as(
            "SELECT event_id, event_type, aggregate_id, payload FROM event_queue WHERE event_id = ? AND replay_of IS NULL",
        )
        .bind(key)
        .fetch_optional(tx.conn())
        .await?,
    };
    let Some((_, event_type, aggregate_id, payload)) = row else { return Ok(false) };
    let at = tx.now_ms();
    tx.job_rows.push(OutboxInsert {
        event_id: format!("{key}:replay:{replay}:{handler}"),
        event_type,
        aggregate_id,
        payload,
        at,
        replay: Some((key.to_owned(), handler.to_owned())),
    });
    Ok(true)
}

/// Writes buffered outbox rows, many per statement.
pub(crate) async fn insert_rows(conn: &mut sqlx::SqliteConnection, rows: &[OutboxInsert]) -> Result<(), sqlx::Error> {
    for chunk in rows.chunks(ROWS_PER_STATEMENT) {
        let mut sql = String::from(
            "INSERT INTO event_queue (event_id, event_type, aggregate_id, payload, status, attempts, available_at, created_at, \
             replay_of, replay_handler) VALUES ",
        );
        sql.push_str(&vec!["(?, ?, ?, ?, 'pending', 0, ?, ?, ?, ?)"; chunk.len()].join(", "));
        let mut query = sqlx::query(AssertSqlSafe(sql));
        for row in chunk {
            let (replay_of, replay_handler) = row.replay.clone().unzip();
            query = query
                .bind(row.event_id.clone())
                .bind(row.event_type.clone())
                .bind(row.aggregate_id.clone())
                .bind(row.payload.clone())
                .bind(row.at)
                .bind(row.at)
                .bind(replay_of)
                .bind(replay_handler);
        }
        query.execute(&mut *conn).await?;
    }
    Ok(())
}
