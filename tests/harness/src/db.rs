//! Direct, read-only looks at a Reelay SQLite file.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;

use prost::Message;
use reelay_contracts::v1;
use sqlx::sqlite::SqliteConnectOptions;
use sqlx::{AssertSqlSafe, ConnectOptions, Connection, Row, SqliteConnection};

async fn open(path: &Path) -> SqliteConnection {
    SqliteConnectOptions::new().filename(path).read_only(true).connect().await.expect("open the test database")
}

/// Every row of every table but `actor_keys` (sqlx's bookkeeping included), rendered as text in
/// rowid order: two snapshots are equal exactly when those tables hold the same data.
pub type Snapshot = BTreeMap<String, Vec<String>>;

pub async fn table_snapshot(path: &Path) -> Snapshot {
    let mut conn = open(path).await;
    let tables: Vec<String> =
        // Not `actor_keys`: the write service makes each new user's key pair in the background,
        // at a moment no call controls, so it would land between two snapshots by chance.
        sqlx::query(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%' \
             AND name != 'actor_keys' ORDER BY name",
        )
            .fetch_all(&mut conn)
            .await
            .unwrap()
            .into_iter()
            .map(|r| r.get(0))
            .collect();
    let mut snapshot = Snapshot::new();
    for table in tables {
        let columns: Vec<String> = sqlx::query(AssertSqlSafe(format!("SELECT name FROM pragma_table_info('{table}')")))
            .fetch_all(&mut conn)
            .await
            .unwrap()
            .into_iter()
            .map(|r| r.get(0))
            .collect();
        let rendered = columns.iter().map(|c| format!("quote(\"{c}\")")).collect::<Vec<_>>().join(" || '|' || ");
        let rows = sqlx::query(AssertSqlSafe(format!("SELECT {rendered} FROM \"{table}\" ORDER BY 1")))
            .fetch_all(&mut conn)
            .await
            .unwrap()
            .into_iter()
            .map(|r| r.get::<String, _>(0))
            .collect();
        snapshot.insert(table, rows);
    }
    conn.close().await.unwrap();
    snapshot
}

/// Runs a query whose columns are all text-like and returns its rows.
pub async fn query_strings(path: &Path, sql: &str) -> Vec<Vec<String>> {
    let mut conn = open(path).await;
    let rows = sqlx::query(AssertSqlSafe(sql.to_owned())).fetch_all(&mut conn).await.unwrap();
    let out = rows
        .iter()
        .map(|row| {
            (0..row.len()).map(|i| row.try_get::<Option<String>, _>(i).ok().flatten().unwrap_or_default()).collect()
        })
        .collect();
    conn.close().await.unwrap();
    out
}

/// One outbox row with its decoded envelope.
#[derive(Debug, Clone)]
pub struct OutboxRow {
    pub id: i64,
    pub event_id: Option<String>,
    pub event_type: String,
    pub aggregate_id: String,
    pub status: String,
    pub attempts: i64,
    pub envelope: Option<v1::Event>,
}

/// The events of one type in the outbox, in insertion order.
pub async fn events_of(path: &Path, event_type: &str) -> Vec<v1::Event> {
    outbox_rows(path).await.into_iter().filter(|r| r.event_type == event_type).filter_map(|r| r.envelope).collect()
}

/// The outbox in insertion order.
pub async fn outbox_rows(path: &Path) -> Vec<OutboxRow> {
    let mut conn = open(path).await;
    let rows = sqlx::query(
        "SELECT id, event_id, event_type, aggregate_id, status, attempts, payload FROM event_queue ORDER BY id",
    )
    .fetch_all(&mut conn)
    .await
    .unwrap();
    let out = rows
        .into_iter()
        .map(|r| OutboxRow {
            id: r.get("id"),
            event_id: r.get("event_id"),
            event_type: r.get("event_type"),
            aggregate_id: r.get("aggregate_id"),
            status: r.get("status"),
            attempts: r.get("attempts"),
            envelope: v1::Event::decode(r.get::<Vec<u8>, _>("payload").as_slice()).ok(),
        })
        .collect();
    conn.close().await.unwrap();
    out
}

/// Every event id in the outbox, in order.
pub async fn event_ids(path: &Path) -> Vec<String> {
    outbox_rows(path).await.into_iter().filter_map(|r| r.event_id).collect()
}

/// What the probe handlers recorded in `table` (`effects` or `attempts`): (event_id, handler)
/// → how many rows, and the pids that wrote them.
pub async fn probe_records(path: &Path, table: &str) -> (HashMap<(String, String), usize>, HashSet<String>) {
    let mut counts = HashMap::new();
    let mut pids = HashSet::new();
    if !path.exists() {
        return (counts, pids);
    }
    for row in query_strings(path, &format!("SELECT event_id, handler, CAST(pid AS TEXT) FROM {table}")).await {
        *counts.entry((row[0].clone(), row[1].clone())).or_insert(0) += 1;
        pids.insert(row[2].clone());
    }
    (counts, pids)
}

/// Reviews and their `ReviewLogged` events, read back from the database: the pairs a storage
/// fault must never split.
#[derive(Debug, Default)]
pub struct ReviewLedger {
    /// review id → its body.
    pub reviews: HashMap<String, String>,
    /// review id → how many `ReviewLogged` events name it.
    pub logged: HashMap<String, usize>,
}

impl ReviewLedger {
    pub async fn read(path: &Path) -> Self {
        let mut ledger = Self::default();
        for row in query_strings(path, "SELECT id, body FROM reviews").await {
            ledger.reviews.insert(row[0].clone(), row[1].clone());
        }
        for row in outbox_rows(path).await {
            if let Some(v1::event::Payload::ReviewLogged(logged)) = row.envelope.and_then(|e| e.payload) {
                *ledger.logged.entry(logged.review_id).or_insert(0) += 1;
            }
        }
        ledger
    }

    /// Reviews with no `ReviewLogged`, reviews with more than one, and events of reviews that do
    /// not exist. All three must be empty.
    pub fn split_writes(&self) -> Vec<String> {
        let mut problems = Vec::new();
        for id in self.reviews.keys() {
            match self.logged.get(id).copied().unwrap_or(0) {
                1 => {}
                0 => problems.push(format!("review {id} has no ReviewLogged event")),
                n => problems.push(format!("review {id} has {n} ReviewLogged events")),
            }
        }
        for id in self.logged.keys().filter(|id| !self.reviews.contains_key(*id)) {
            problems.push(format!("ReviewLogged names review {id}, which does not exist"));
        }
        problems.sort();
        problems
    }

    /// How many reviews have a body starting with `marker`.
    pub fn count_marked(&self, marker: &str) -> usize {
        self.reviews.values().filter(|body| body.starts_with(marker)).count()
    }
}

/// Inserts an outbox row as a foreign writer would (no event id, any payload), due at once.
pub async fn insert_foreign_event(path: &Path, event_type: &str, payload: &[u8]) {
    let mut conn = SqliteConnectOptions::new()
        .filename(path)
        .busy_timeout(std::time::Duration::from_secs(10))
        .connect()
        .await
        .expect("open the test database for writing");
    sqlx::query(
        "INSERT INTO event_queue (event_type, aggregate_id, payload, status, attempts, available_at, created_at) \
         VALUES (?, 'foreign', ?, 'pending', 0, 0, 0)",
    )
    .bind(event_type.to_owned())
    .bind(payload.to_vec())
    .execute(&mut conn)
    .await
    .expect("insert a foreign outbox row");
    conn.close().await.unwrap();
}

/// What is not yet settled for `handlers`: on the db backend, rows a handler's cursor has not
/// passed and its deliveries in flight or waiting to be retried; on nats, outbox rows the relay
/// has not published. Empty when everything is settled.
pub async fn unsettled(path: &Path, nats: bool, handlers: &[&str]) -> Vec<String> {
    if nats {
        return query_strings(
            path,
            "SELECT 'outbox row ' || id || ' is ' || status FROM event_queue WHERE status IN ('pending', 'processing')",
        )
        .await
        .into_iter()
        .map(|r| r[0].clone())
        .collect();
    }
    let mut open = Vec::new();
    for handler in handlers {
        let rows = query_strings(
            path,
            &format!(
                "SELECT (SELECT COUNT(*) FROM event_queue WHERE id > c.position) || '', \
                    (SELECT COUNT(*) FROM processed_events p WHERE p.handler = c.handler AND p.status IN ('in_progress', 'retry')) || '' \
                 FROM handler_cursors c WHERE c.handler = '{handler}'"
            ),
        )
        .await;
        match rows.first() {
            None => open.push(format!("{handler} has no cursor")),
            Some(r) if r[0] != "0" || r[1] != "0" => {
                open.push(format!("{handler}: {} rows not looked at, {} deliveries open", r[0], r[1]))
            }
            Some(_) => {}
        }
    }
    open
}

/// Dead letters: per (event, handler) on the db backend, per outbox row on nats.
pub async fn dead_letters(path: &Path, nats: bool) -> usize {
    let sql = if nats {
        "SELECT COUNT(*) || '' FROM event_queue WHERE status = 'dead_lettered'"
    } else {
        "SELECT COUNT(*) || '' FROM processed_events WHERE status = 'dead_lettered'"
    };
    query_strings(path, sql).await[0][0].parse().unwrap()
}
