//! `enqueue_events`: the one code path that inserts outbox rows.

use prost::Message;
use reelay_contracts::v1;
use reelay_domain::{EventId, NewEvent};
use sqlx::AssertSqlSafe;

use crate::WriteTx;

/// Rows per INSERT statement: one round trip for a typical write's events.
const ROWS_PER_STATEMENT: usize = 64;

/// What was written for one event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnqueuedEvent {
    pub event_id: EventId,
    pub event_type: &'static str,
}

/// Inserts `events` into the outbox (`event_queue`) inside the caller's write transaction, so
/// they commit or roll back with the change that caused them. Every row gets a fresh random
/// `event_id`, the job's timestamp and the request's trace context, and is due at once.
pub async fn enqueue_events(tx: &mut WriteTx, events: Vec<NewEvent>) -> Result<Vec<EnqueuedEvent>, sqlx::Error> {
    // Benchmark builds only: measure what the write path costs without its events.
    if crate::failpoint_armed("skip_events") {
        return Ok(Vec::new());
    }
    let now = tx.now_ms();
    let traceparent = tx.traceparent.clone();
    let mut enqueued = Vec::with_capacity(events.len());
    let mut rows = Vec::with_capacity(events.len());
    for event in events {
        let event_id = EventId::random();
        let event_type = event.event_type();
        let envelope = v1::Event {
            event_id: event_id.to_string(),
            event_type: event_type.to_owned(),
            aggregate_id: event.aggregate_id.clone(),
            occurred_at_ms: now,
            traceparent: traceparent.clone(),
            payload: Some(event.payload),
        };
        rows.push((event_id, event_type, event.aggregate_id, envelope.encode_to_vec()));
        enqueued.push(EnqueuedEvent { event_id, event_type });
    }
    for chunk in rows.chunks(ROWS_PER_STATEMENT) {
        let mut sql = String::from(
            "INSERT INTO event_queue (event_id, event_type, aggregate_id, payload, status, attempts, available_at, created_at) VALUES ",
        );
        for i in 0..chunk.len() {
            sql.push_str(if i == 0 {
                "(?, ?, ?, ?, 'pending', 0, ?, ?)"
            } else {
                ", (?, ?, ?, ?, 'pending', 0, ?, ?)"
            });
        }
        let mut query = sqlx::query(AssertSqlSafe(sql));
        for (event_id, event_type, aggregate_id, payload) in chunk {
            query = query
                .bind(event_id.to_string())
                .bind(*event_type)
                .bind(aggregate_id.clone())
                .bind(payload.clone())
                .bind(now)
                .bind(now);
        }
        query.execute(tx.conn()).await?;
    }
    tx.events += enqueued.len();
    Ok(enqueued)
}
