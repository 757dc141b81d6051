//! What an operator looks at: where the outbox and each handler stand ([`status`]), and where
//! one event is ([`explain`]). Read-only; both backends.
//!
//! On the db backend every handler's progress is in the database (its cursor and its
//! deliveries); on the nats backend the database knows the outbox, the live ledger claims and
//! the dead letters, and the rest of a handler's backlog is its JetStream consumer's.

use sqlx::{Row, SqliteConnection};

use crate::deliveries;
use crate::queue;

/// Where the outbox and each handler stand.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Status {
    pub outbox: queue::QueueStats,
    pub handlers: Vec<HandlerStatus>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HandlerStatus {
    pub handler: String,
    /// db: rows after its cursor plus its retries and live claims; nats: its live claims and
    /// replays not yet taken.
    pub pending: u64,
    /// db: age of the oldest of those (ms); nats: 0.
    pub oldest_age_ms: i64,
    pub in_progress: u64,
    pub retrying: u64,
    pub dead_lettered: u64,
    /// False for a handler the write service no longer delivers to that keeps a cursor.
    pub delivered: bool,
}

/// The outbox by status and every registered handler's standing. `cursors`: the db backend
/// (handlers progress by cursor), else nats.
pub async fn status(conn: &mut SqliteConnection, now: i64, cursors: bool) -> Result<Status, sqlx::Error> {
    let outbox = queue::stats(conn, now, cursors).await?;
    let mut handlers = Vec::new();
    for h in deliveries::stats(conn, cursors).await? {
        let (pending, oldest) = if cursors {
            // The first row after the cursor, or the oldest event among its open deliveries
            // (through the ledger's index of them, then each event's row by its key).
            let open: Option<i64> = sqlx::query_scalar(
                "SELECT MIN(q.created_at) FROM processed_events p JOIN event_queue q ON q.event_id = p.event_id \
                     WHERE p.handler = ?1 AND p.status IN ('in_progress', 'retry')",
            )
            .bind(&h.handler)
            .fetch_one(&mut *conn)
            .await?;
            let oldest = h.first_behind_at.into_iter().chain(open).min();
            (h.behind + h.in_progress + h.retrying, oldest.map_or(0, |t| (now - t).max(0)))
        } else {
            (h.in_progress + h.retrying, 0)
        };
        handlers.push(HandlerStatus {
            handler: h.handler,
            pending,
            oldest_age_ms: oldest,
            in_progress: h.in_progress,
            retrying: h.retrying,
            dead_lettered: h.dead_lettered,
            delivered: h.delivered,
        });
    }
    Ok(Status { outbox, handlers })
}

/// `None` when the database knows a handler named `name`: it is registered (it has a cursor),
/// or it has an open or dead-lettered delivery (a ledger client on nats need not be registered).
/// Otherwise the registered names, for an error that lists them: an operator's typo.
pub async fn unknown_handler(conn: &mut SqliteConnection, name: &str) -> Result<Option<Vec<String>>, sqlx::Error> {
    if name == crate::dead_letters::RELAY {
        return Ok(None);
    }
    // Each look goes through an index that starts with the handler (the cursors' key, the
    // open deliveries' and the dead letters' partial indexes).
    let known: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM handler_cursors WHERE handler = ?1) \
             OR EXISTS (SELECT 1 FROM processed_events WHERE handler = ?1 AND status IN ('in_progress', 'retry')) \
             OR EXISTS (SELECT 1 FROM processed_events WHERE handler = ?1 AND status = 'dead_lettered')",
    )
    .bind(name)
    .fetch_one(&mut *conn)
    .await?;
    if known {
        return Ok(None);
    }
    let registered = sqlx::query_scalar("SELECT handler FROM handler_cursors ORDER BY handler").fetch_all(conn).await?;
    Ok(Some(registered))
}

/// An outbox row as an operator sees it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RowState {
    pub id: i64,
    pub event_id: String,
    pub event_type: String,
    pub aggregate_id: String,
    pub status: String,
    pub attempts: u32,
    pub created_at: i64,
    pub available_at: i64,
    pub claimed_at: i64,
    pub claimed_by: String,
    pub last_error: String,
    pub stream_sequence: u64,
    pub replay_handler: String,
}

/// One handler's part in an event.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HandlerDelivery {
    pub handler: String,
    /// A ledger status, or `waiting` / `not_delivered` (db) / `no_record` (nats) without a row.
    pub state: String,
    pub attempts: u32,
    pub last_error: String,
    pub started_at: i64,
    pub renewed_at: i64,
    pub processed_at: i64,
    pub available_at: i64,
    pub owner: String,
    pub replays: u32,
}

/// A recorded operator action on a dead letter.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Action {
    pub at: i64,
    pub action: String,
    pub handler: String,
    pub operator: String,
    pub attempts: u32,
    pub last_error: String,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Explained {
    pub outbox: Option<RowState>,
    pub handlers: Vec<HandlerDelivery>,
    pub replays: Vec<RowState>,
    pub actions: Vec<Action>,
}

impl Explained {
    /// True when the database knows nothing of the event.
    pub fn is_empty(&self) -> bool {
        self.outbox.is_none() && self.handlers.iter().all(|h| h.started_at == 0) && self.actions.is_empty()
    }
}

const ROW_COLUMNS: &str = "id, COALESCE(event_id, ''), event_type, aggregate_id, status, attempts, created_at, \
    available_at, COALESCE(claimed_at, 0), COALESCE(claimed_by, ''), COALESCE(last_error, ''), \
    COALESCE(stream_sequence, 0), COALESCE(replay_handler, '')";

fn row_state(r: &sqlx::sqlite::SqliteRow) -> RowState {
    RowState {
        id: r.get(0),
        event_id: r.get(1),
        event_type: r.get(2),
        aggregate_id: r.get(3),
        status: r.get(4),
        attempts: r.get::<i64, _>(5) as u32,
        created_at: r.get(6),
        available_at: r.get(7),
        claimed_at: r.get(8),
        claimed_by: r.get(9),
        last_error: r.get(10),
        stream_sequence: r.get::<i64, _>(11) as u64,
        replay_handler: r.get(12),
    }
}

/// Where the event `key` (an event id, or `row:<id>`) is.
pub async fn explain(conn: &mut SqliteConnection, key: &str, cursors: bool) -> Result<Explained, sqlx::Error> {
    let row = match key.strip_prefix("row:").and_then(|id| id.parse::<i64>().ok()) {
        Some(id) => {
            sqlx::query(sqlx::AssertSqlSafe(format!("SELECT {ROW_COLUMNS} FROM event_queue WHERE id = ?")))
                .bind(id)
                .fetch_optional(&mut *conn)
                .await?
        }
        None => {
            sqlx::query(sqlx::AssertSqlSafe(format!("SELECT {ROW_COLUMNS} FROM event_queue WHERE event_id = ?")))
                .bind(key)
                .fetch_optional(&mut *conn)
                .await?
        }
    }
    .map(|r| row_state(&r));
    let replays = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT {ROW_COLUMNS} FROM event_queue WHERE replay_of = ? ORDER BY id"
    )))
    .bind(key)
    .fetch_all(&mut *conn)
    .await?
    .iter()
    .map(row_state)
    .collect();

    let ledger = sqlx::query(
        "SELECT handler, status, attempts, COALESCE(last_error, ''), started_at, COALESCE(renewed_at, 0), \
         COALESCE(processed_at, 0), COALESCE(available_at, 0), COALESCE(owner, ''), replays \
         FROM processed_events WHERE event_id = ? ORDER BY handler",
    )
    .bind(key)
    .fetch_all(&mut *conn)
    .await?;
    let mut handlers: Vec<HandlerDelivery> = ledger
        .iter()
        .map(|r| HandlerDelivery {
            handler: r.get(0),
            state: r.get(1),
            attempts: r.get::<i64, _>(2) as u32,
            last_error: r.get(3),
            started_at: r.get(4),
            renewed_at: r.get(5),
            processed_at: r.get(6),
            available_at: r.get(7),
            owner: r.get(8),
            replays: r.get::<i64, _>(9) as u32,
        })
        .collect();
    // Registered handlers without a row: where is the event for them?
    let cursors_now: Vec<(String, i64)> =
        sqlx::query_as("SELECT handler, position FROM handler_cursors ORDER BY handler").fetch_all(&mut *conn).await?;
    for (handler, position) in cursors_now {
        if handlers.iter().any(|h| h.handler == handler) {
            continue;
        }
        let state = match (&row, cursors) {
            (_, false) => "no_record",
            (Some(row), true) if row.id > position => "waiting",
            (_, true) => "not_delivered",
        };
        handlers.push(HandlerDelivery { handler, state: state.into(), ..Default::default() });
    }
    handlers.sort_by(|a, b| a.handler.cmp(&b.handler));

    let actions = sqlx::query(
        "SELECT at, action, handler, operator, attempts, COALESCE(last_error, '') FROM dead_letter_actions \
         WHERE event_id = ? ORDER BY id",
    )
    .bind(key)
    .fetch_all(&mut *conn)
    .await?
    .iter()
    .map(|r| Action {
        at: r.get(0),
        action: r.get(1),
        handler: r.get(2),
        operator: r.get(3),
        attempts: r.get::<i64, _>(4) as u32,
        last_error: r.get(5),
    })
    .collect();
    Ok(Explained { outbox: row, handlers, replays, actions })
}
