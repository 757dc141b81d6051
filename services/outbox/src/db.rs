//! Opening the SQLite file: a read pool for queries and one connection for the writer.

use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous};
use sqlx::{ConnectOptions, Connection};

use crate::Writer;
use crate::writer::{Opener, WriterConfig};

/// How hard a commit waits for the disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Synchronous {
    /// fsync on every commit: an acknowledged write survives power loss. The default.
    #[default]
    Full,
    /// WAL with fsync only at checkpoints: survives a crash of the process, not of the machine.
    Normal,
}

impl FromStr for Synchronous {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "full" => Ok(Self::Full),
            "normal" => Ok(Self::Normal),
            other => Err(format!("expected `full` or `normal`, got {other:?}")),
        }
    }
}

#[derive(Debug, Clone)]
pub struct DbConfig {
    pub path: PathBuf,
    pub synchronous: Synchronous,
    /// Read connections; the writer always has exactly one.
    pub read_connections: u32,
    /// How long a statement waits for a lock held by another process before failing.
    pub busy_timeout: Duration,
    /// The largest encoded event a write may raise (`REELAY_MAX_EVENT_BYTES`): every event must
    /// fit a claim answer and a broker message, or it could never be delivered.
    pub max_event_bytes: usize,
}

/// The default [`DbConfig::max_event_bytes`]: NATS's default `max_payload`.
pub const DEFAULT_MAX_EVENT_BYTES: usize = 1024 * 1024;

impl DbConfig {
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self {
            path: path.into(),
            synchronous: Synchronous::Full,
            read_connections: 4,
            busy_timeout: Duration::from_secs(5),
            max_event_bytes: DEFAULT_MAX_EVENT_BYTES,
        }
    }

    /// Opens (creating if needed) the file and applies migrations, up to `to` when given.
    pub async fn connect_and_migrate(&self, to: Option<i64>) -> Result<sqlx::SqliteConnection, sqlx::Error> {
        if let Some(parent) = self.path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent)?;
        }
        // Switching a fresh file to WAL needs a moment alone with it; another process migrating
        // the same file can hold it, and that lock does not wait on the busy timeout.
        let options = self.writer_options().create_if_missing(true);
        let mut backoff = crate::migrate::startup_retry();
        let mut conn = loop {
            match options.connect().await {
                Err(error) if is_busy(&error) && backoff.wait("opening the database", &error).await => {}
                result => break result?,
            }
        };
        let migrated = match to {
            Some(version) => crate::migrate_to(&mut conn, version).await,
            None => crate::migrate(&mut conn).await,
        };
        migrated.map_err(|e| sqlx::Error::Migrate(Box::new(e)))?;
        Ok(conn)
    }

    /// The writer's connection. Its statements hand their rows to the writer task through a
    /// channel; with sqlx's default of 50 rows, a claim or settlement returning a few hundred
    /// could stop SQLite every 50 rows until the writer task was next scheduled, inside the
    /// transaction every other write waits on. Its inserts, settlements and payload reads are
    /// chunked to at most 500 rows, so the channel holds all of such a statement's rows; a
    /// claim's read of candidates can return more (its budget plus a shared read's span), and
    /// waits past 512 as before.
    ///
    /// It also keeps its temporary structures in memory (`temp_store = MEMORY`). Inside a
    /// transaction SQLite journals the pages a many-row statement changes, so a failing one can
    /// be undone alone, and by default it moved that journal to a temporary file past 64 KiB.
    /// The writer's merged statements crossed that dozens of times a second, and where no
    /// temporary directory is writable (a read-only root filesystem, as in `k8s/`) each one
    /// failed with an I/O error. The writer's large statements are chunked, so their journals
    /// stay small. The read connections keep the default: an operator's query over a large ledger
    /// may need more temporary space than memory should hold, and spills to `/tmp` (the write
    /// Deployment mounts a writable one).
    fn writer_options(&self) -> SqliteConnectOptions {
        self.options().row_buffer_size(WRITER_ROW_BUFFER).pragma("temp_store", "memory")
    }

    fn options(&self) -> SqliteConnectOptions {
        SqliteConnectOptions::new()
            .filename(&self.path)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(match self.synchronous {
                Synchronous::Full => SqliteSynchronous::Full,
                Synchronous::Normal => SqliteSynchronous::Normal,
            })
            .busy_timeout(self.busy_timeout)
            .foreign_keys(true)
    }
}

/// Rows a writer statement may return before SQLite waits for the writer task to take them.
const WRITER_ROW_BUFFER: usize = 512;

fn is_busy(error: &sqlx::Error) -> bool {
    error.as_database_error().and_then(|e| e.code()).is_some_and(|code| {
        let primary = code.parse::<i32>().map_or(0, |n| n & 0xff);
        primary == 5 || primary == 6 // SQLITE_BUSY, SQLITE_LOCKED
    })
}

/// An open, migrated database: the read pool and the writer.
#[derive(Clone)]
pub struct Database {
    pub reads: SqlitePool,
    pub writer: Writer,
}

impl Database {
    /// Creates the file if needed, migrates it (with the bounded retry of [`crate::migrate`]),
    /// and starts the writer task.
    pub async fn open(config: &DbConfig) -> Result<Self, sqlx::Error> {
        let mut conn = config.connect_and_migrate(None).await?;
        // Readers are read-only: every write must go through the writer.
        let reads = SqlitePoolOptions::new()
            .max_connections(config.read_connections.max(1))
            .connect_with(config.options().read_only(true))
            .await?;
        conn.ping().await?;
        let options = config.writer_options();
        let reopen: Opener = std::sync::Arc::new(move || {
            let options = options.clone();
            Box::pin(async move { options.connect().await })
        });
        let writer = Writer::start(
            conn,
            WriterConfig { reopen, max_event_bytes: config.max_event_bytes, synchronous: config.synchronous },
        );
        Ok(Self { reads, writer })
    }

    /// Stops the writer after the jobs already queued, then closes the read pool.
    pub async fn close(self) {
        self.writer.shutdown().await;
        self.reads.close().await;
    }
}

/// The steps of `sql`'s plan as the bundled SQLite's `EXPLAIN QUERY PLAN` names them (`SEARCH t
/// USING INDEX i (a=?)`), for tests that hold a statement to its index.
pub async fn query_plan(conn: &mut sqlx::SqliteConnection, sql: &str) -> Result<Vec<String>, sqlx::Error> {
    use sqlx::Row;
    let rows = sqlx::query(sqlx::AssertSqlSafe(format!("EXPLAIN QUERY PLAN {sql}"))).fetch_all(conn).await?;
    Ok(rows.iter().map(|row| row.get::<String, _>(3)).collect())
}
