//! Schema migrations, forward-only, embedded from `migrations/`.
//!
//! Several processes may start on one fresh file at once (the all-in-one binary, or services
//! started together). SQLite has no migration lock, so the loser of a race fails on a table the
//! winner just created; it then waits and runs again, re-reading `_sqlx_migrations` and skipping
//! what the winner applied. Only an error that persists through every retry is returned.

use std::time::Duration;

use reelay_kit::Backoff;
use sqlx::SqliteConnection;
use sqlx::migrate::{MigrateError, Migrator};

pub static MIGRATOR: Migrator = sqlx::migrate!("../../migrations");

/// The bounded retry of start-up work that races other processes on one file: up to 5 retries,
/// 100 ms doubling to 1 s.
pub(crate) fn startup_retry() -> Backoff {
    Backoff::bounded(Duration::from_millis(100), Duration::from_secs(1), 5)
}

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
    let mut backoff = startup_retry();
    loop {
        let result = match target {
            Some(version) => MIGRATOR.run_to(version, &mut *conn).await,
            None => MIGRATOR.run(&mut *conn).await,
        };
        match result {
            Err(error) if is_retryable(&error) && backoff.wait("migration", &error).await => {}
            result => return result,
        }
    }
}

/// A checksum mismatch or a migration missing from this build will not heal by waiting.
fn is_retryable(error: &MigrateError) -> bool {
    !matches!(
        error,
        MigrateError::VersionMismatch(_) | MigrateError::VersionMissing(_) | MigrateError::VersionTooNew(..)
    )
}
