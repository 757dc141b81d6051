//! Schema migrations, forward-only, embedded from `migrations/`.
//!
//! Several processes may start on one fresh file at once (the all-in-one binary, or services
//! started together). SQLite has no migration lock, so the loser of a race fails on a table the
//! winner just created; it then waits and runs again, re-reading `_sqlx_migrations` and skipping
//! what the winner applied. Only an error that persists through every retry is returned.

use std::time::Duration;

use sqlx::SqliteConnection;
use sqlx::migrate::{MigrateError, Migrator};

pub static MIGRATOR: Migrator = sqlx::migrate!("../../migrations");

const FIRST_RETRY_DELAY: Duration = Duration::from_millis(100);
const MAX_RETRY_DELAY: Duration = Duration::from_secs(1);
const MAX_RETRIES: u32 = 5;

/// Applies every pending migration, retrying a failure up to 5 times (100 ms doubling to 1 s).
pub async fn migrate(conn: &mut SqliteConnection) -> Result<(), MigrateError> {
    run_with_retry(conn, None).await
}

/// Applies migrations up to and including `version` only. Used to build databases at an older
/// schema, e.g. to test the upgrade to the outbox.
pub async fn migrate_to(conn: &mut SqliteConnection, version: i64) -> Result<(), MigrateError> {
    run_with_retry(conn, Some(version)).await
}

async fn run_with_retry(conn: &mut SqliteConnection, target: Option<i64>) -> Result<(), MigrateError> {
    let mut delay = FIRST_RETRY_DELAY;
    let mut retries = 0;
    loop {
        let result = match target {
            Some(version) => MIGRATOR.run_to(version, &mut *conn).await,
            None => MIGRATOR.run(&mut *conn).await,
        };
        match result {
            Ok(()) => return Ok(()),
            Err(error) if retries < MAX_RETRIES && is_retryable(&error) => {
                retries += 1;
                tracing::warn!(%error, retry = retries, delay_ms = delay.as_millis() as u64, "migration failed; retrying");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(MAX_RETRY_DELAY);
            }
            Err(error) => return Err(error),
        }
    }
}

/// A checksum mismatch or a migration missing from this build will not heal by waiting.
fn is_retryable(error: &MigrateError) -> bool {
    !matches!(error, MigrateError::VersionMismatch(_) | MigrateError::VersionMissing(_) | MigrateError::VersionTooNew(..))
}
