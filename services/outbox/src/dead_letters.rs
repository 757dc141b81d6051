//! Dead letters: the (event, handler) deliveries that were given up, and what an operator can
//! do about them. A dead letter is the handler's `processed_events` row in `dead_lettered`, on
//! both backends (see [`crate::ledger::dead_letter`] for nats). On nats an event the relay gave
//! up (refused by the broker `EVENT_QUEUE_MAX_ATTEMPTS` times, or too large for it) reached no
//! handler at all: it is listed and acted on as a dead letter of [`RELAY`], and a replay makes
//! its outbox row pending again with a fresh set of attempts. A replay copy the relay gives up
//! makes its handler's delivery a dead letter again.
//!
//! Replaying and discarding change only rows still dead-lettered, inside one writer job, so two
//! operators acting on the same dead letter at once change it once; each change is recorded in
//! `dead_letter_actions` with who asked. A replay gives the delivery a fresh set of attempts:
//! on db it becomes a retry due now (the handler's claimer takes it); on nats a replay row is
//! added to the outbox for the relay to republish to that handler alone.

use sqlx::{AssertSqlSafe, Row, SqliteConnection};

use crate::WriteTx;
use crate::enqueue::enqueue_replay;

/// The handler name under which the events the relay gave up are listed and acted on (no
/// handler of Reelay's is named so).
pub const RELAY: &str = "relay";

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
    // The handlers' dead letters, then the relay's: outbox rows it gave up, but not the replay
    // copies (a copy given up makes its handler's delivery a dead letter again).
    let from = format!(
        "FROM (SELECT p.event_id, p.handler, COALESCE(q.event_type, '') AS event_type, \
             COALESCE(q.aggregate_id, '') AS aggregate_id, p.attempts, COALESCE(p.last_error, '') AS last_error, \
             COALESCE(p.processed_at, p.renewed_at, p.started_at) AS at, p.replays \
           FROM processed_events p LEFT JOIN event_queue q ON q.event_id = p.event_id \
           WHERE p.status = 'dead_lettered' AND (?1 IS NULL OR p.handler = ?1) \
         UNION ALL \
         SELECT COALESCE(q.event_id, 'row:' || q.id), '{RELAY}', q.event_type, q.aggregate_id, q.attempts, \
             COALESCE(q.last_error, ''), COALESCE(q.claimed_at, q.available_at), \
             (SELECT COUNT(*) FROM dead_letter_actions a WHERE a.event_id = COALESCE(q.event_id, 'row:' || q.id) \
                AND a.handler = '{RELAY}' AND a.action = 'replay') \
           FROM event_queue q WHERE q.status = 'dead_lettered' AND q.replay_of IS NULL \
             AND (?1 IS NULL OR ?1 = '{RELAY}')) \
         WHERE (?2 IS NULL OR event_type = ?2) AND (?3 IS NULL OR at >= ?3)"
    );
    let total: i64 = sqlx::query_scalar(AssertSqlSafe(format!("SELECT COUNT(*) {from}")))
        .bind(&filter.handler)
        .bind(&filter.event_type)
        .bind(filter.since_ms)
        .fetch_one(&mut *conn)
        .await?;
    let rows = sqlx::query(AssertSqlSafe(format!(
        "SELECT event_id, handler, event_type, aggregate_id, attempts, last_error, at, replays {from} \
         ORDER BY at DESC, event_id, handler LIMIT ?4"
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
        Target::AllOf { handler, after } if handler == RELAY => {
            let keys: Vec<String> = sqlx::query_scalar(
                "SELECT COALESCE(event_id, 'row:' || id) AS key FROM event_queue \
                 WHERE status = 'dead_lettered' AND replay_of IS NULL AND key > ? ORDER BY key LIMIT ?",
            )
            .bind(after)
            .bind(ALL_OF_BATCH as i64)
            .fetch_all(tx.conn())
            .await?;
            keys.into_iter().map(|key| (key, RELAY.to_owned())).collect()
        }
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
                let relay =
                    handler.as_deref().is_none_or(|h| h == RELAY) && relay_dead_letter(tx, event_id).await?.is_some();
                if pairs.is_empty() && !relay {
                    acted.unchanged.push((event_id.clone(), handler.clone().unwrap_or_default()));
                }
                found.extend(pairs);
                if relay {
                    found.push((event_id.clone(), RELAY.to_owned()));
                }
            }
            found
        }
    };
    for (event_id, handler) in candidates {
        if handler == RELAY {
            match act_on_relays(tx, &event_id, action, now).await? {
                Some((attempts, last_error)) => {
                    record(tx, action, &event_id, &handler, operator, attempts, last_error, now).await?;
                    acted.changed.push((event_id, handler));
                }
                None => acted.unchanged.push((event_id, handler)),
            }
            continue;
        }
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
        record(tx, action, &event_id, &handler, operator, attempts, last_error, now).await?;
        acted.changed.push((event_id, handler));
    }
    Ok(acted)
}

/// Records an action in the audit trail.
#[allow(clippy::too_many_arguments)]
async fn record(
    tx: &mut WriteTx,
    action: Action,
    event_id: &str,
    handler: &str,
    operator: &str,
    attempts: i64,
    last_error: Option<String>,
    now: i64,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO dead_letter_actions (at, action, event_id, handler, operator, attempts, last_error) \
         VALUES (?, ?, ?, ?, ?, ?, ?)",
    )
    .bind(now)
    .bind(action.name())
    .bind(event_id)
    .bind(handler)
    .bind(operator)
    .bind(attempts)
    .bind(last_error)
    .execute(tx.conn())
    .await?;
    tracing::warn!(%event_id, %handler, operator, action = action.name(), "dead letter acted on");
    Ok(())
}

/// The outbox row the relay gave up for the event `key` (an event id, or `row:<id>` for a row
/// without one): (row id, attempts, last error).
async fn relay_dead_letter(tx: &mut WriteTx, key: &str) -> Result<Option<(i64, i64, Option<String>)>, sqlx::Error> {
    let by_row = key.strip_prefix("row:").and_then(|id| id.parse::<i64>().ok());
    let sql = if by_row.is_some() {
        "SELECT id, attempts, last_error FROM event_queue WHERE id = ? AND event_id IS NULL \
         AND status = 'dead_lettered' AND replay_of IS NULL"
    } else {
        "SELECT id, attempts, last_error FROM event_queue WHERE event_id = ? \
         AND status = 'dead_lettered' AND replay_of IS NULL"
    };
    let query = sqlx::query_as(sql);
    let query = match by_row {
        Some(id) => query.bind(id),
        None => query.bind(key),
    };
    query.fetch_optional(tx.conn()).await
}

/// Replays (pending again, due now, a fresh set of attempts: the relay publishes it to every
/// handler) or discards (never published; purged with the published rows) the outbox row the
/// relay gave up for the event `key`. `None` when there is none.
async fn act_on_relays(
    tx: &mut WriteTx,
    key: &str,
    action: Action,
    now: i64,
) -> Result<Option<(i64, Option<String>)>, sqlx::Error> {
    let Some((id, attempts, last_error)) = relay_dead_letter(tx, key).await? else { return Ok(None) };
    let query = match action {
        Action::Replay { .. } => {
            sqlx::query("UPDATE event_queue SET status = 'pending', attempts = 0, available_at = ? WHERE id = ?")
                .bind(now)
        }
        Action::Discard => {
            sqlx::query("UPDATE event_queue SET status = 'discarded', available_at = ? WHERE id = ?").bind(now)
        }
    };
    query.bind(id).execute(tx.conn()).await?;
    Ok(Some((attempts, last_error)))
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::TestError;
    use crate::{Database, DbConfig, queue};

    fn relay_filter() -> Filter {
        Filter { handler: Some(RELAY.into()), limit: 100, ..Default::default() }
    }

    /// Outbox rows the relay gave up are dead letters of `relay` (a replay copy it gave up is
    /// not: its handler's delivery is): a replay makes one pending again with fresh attempts,
    /// a discard takes one out of the list, and retention deletes it.
    #[tokio::test]
    async fn what_the_relay_gave_up_is_listed_replayed_and_discarded() {
        let dir = tempfile::tempdir().unwrap();
        let db = Database::open(&DbConfig::new(dir.path().join("reelay.db"))).await.unwrap();
        db.writer
            .transact::<_, TestError, _>("fixtures", |tx: &mut WriteTx| {
                Box::pin(async move {
                    for (event_id, replay_of) in [("e-a", None), ("e-b", None), ("e-a:replay:1:probe", Some("e-a"))] {
                        sqlx::query(
                            "INSERT INTO event_queue (event_id, event_type, aggregate_id, payload, status, attempts, \
                             available_at, created_at, last_error, replay_of, replay_handler) \
                             VALUES (?, 'ReviewLogged', 'r1', x'00', 'dead_lettered', 8, 5, 1, 'refused', ?, ?)",
                        )
                        .bind(event_id)
                        .bind(replay_of)
                        .bind(replay_of.map(|_| "probe"))
                        .execute(tx.conn())
                        .await?;
                    }
                    Ok(())
                })
            })
            .await
            .unwrap();
        let mut conn = db.reads.acquire().await.unwrap();
        let (listed, total) = list(&mut conn, &relay_filter()).await.unwrap();
        let keys: Vec<(&str, &str, u32, &str)> = listed
            .iter()
            .map(|d| (d.event_id.as_str(), d.handler.as_str(), d.attempts, d.last_error.as_str()))
            .collect();
        assert_eq!(keys, [("e-a", RELAY, 8, "refused"), ("e-b", RELAY, 8, "refused")]);
        assert_eq!(total, 2);
        let probe = Filter { handler: Some("probe".into()), limit: 100, ..Default::default() };
        assert_eq!(list(&mut conn, &probe).await.unwrap().1, 0, "a replay copy is not the relay's");
        drop(conn);

        let acted = db
            .writer
            .transact::<_, TestError, _>("act", |tx: &mut WriteTx| {
                Box::pin(async move {
                    let replay = Target::Events { event_ids: vec!["e-a".into(), "e-x".into()], handler: None };
                    let replayed = act(tx, &replay, Action::Replay { republish: true }, "ops", 10).await?;
                    let discard = Target::AllOf { handler: RELAY.into(), after: String::new() };
                    let discarded = act(tx, &discard, Action::Discard, "ops", 10).await?;
                    let purged = queue::purge_finished(tx, 2, false, 100).await?;
                    Ok((replayed, discarded, purged))
                })
            })
            .await
            .unwrap();
        let pair = |e: &str, h: &str| (e.to_owned(), h.to_owned());
        assert_eq!(acted.0.changed, [pair("e-a", RELAY)]);
        assert_eq!(acted.0.unchanged, [pair("e-x", "")]);
        assert_eq!(acted.1.changed, [pair("e-b", RELAY)], "e-a is pending again, not a dead letter");
        assert_eq!(acted.2, 1, "the discarded row is deleted by retention");
        let mut conn = db.reads.acquire().await.unwrap();
        let rows: Vec<(String, String, i64, i64)> =
            sqlx::query_as("SELECT event_id, status, attempts, available_at FROM event_queue ORDER BY id")
                .fetch_all(&mut *conn)
                .await
                .unwrap();
        assert_eq!(
            rows,
            [("e-a".into(), "pending".into(), 0, 10), ("e-a:replay:1:probe".into(), "dead_lettered".into(), 8, 5)]
        );
        assert_eq!(list(&mut conn, &relay_filter()).await.unwrap().1, 0);
        let actions: Vec<(String, String, String)> =
            sqlx::query_as("SELECT action, event_id, handler FROM dead_letter_actions ORDER BY id")
                .fetch_all(&mut *conn)
                .await
                .unwrap();
        assert_eq!(
            actions,
            [("replay".into(), "e-a".into(), RELAY.into()), ("discard".into(), "e-b".into(), RELAY.into())]
        );
    }
}
