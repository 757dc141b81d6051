//! Test-only probe handlers. Built only with the feature `test-handlers`, which release builds
//! never enable; without it, asking for a probe is a start-up error.
//!
//! A probe records every execution as one row in its own SQLite table, so an end-to-end test
//! can count effects per (event, handler). Configured by environment:
//! `REELAY_PROBE_HANDLERS=probe-a,probe-b` (which probes to host; none when unset),
//! `REELAY_PROBE_DB` (the effects file), `REELAY_PROBE_FAIL=1` (every execution fails, after
//! recording nothing), `REELAY_PROBE_DELAY_MS` (sleep before the effect, to be killed there).

use std::sync::Arc;

use crate::Handler;

/// The probes named in `REELAY_PROBE_HANDLERS`, recording into `REELAY_PROBE_DB`.
pub async fn probes() -> Result<Vec<Arc<dyn Handler>>, String> {
    let names = std::env::var("REELAY_PROBE_HANDLERS").unwrap_or_default();
    if names.trim().is_empty() {
        return Ok(Vec::new());
    }
    #[cfg(feature = "test-handlers")]
    return enabled::probes(&names).await;
    #[cfg(not(feature = "test-handlers"))]
    Err(format!(
        "REELAY_PROBE_HANDLERS={names:?}, but this build has no probe handlers (they exist only in test builds)"
    ))
}

#[cfg(feature = "test-handlers")]
mod enabled {
    use std::sync::Arc;
    use std::time::Duration;

    use reelay_contracts::v1;
    use reelay_domain::EVENT_TYPES;
    use sqlx::sqlite::{SqliteConnectOptions, SqlitePool, SqlitePoolOptions};

    use crate::{Handler, HandlerError};

    struct Probe {
        name: &'static str,
        effects: SqlitePool,
        fail: bool,
        delay: Duration,
    }

    pub(super) async fn probes(names: &str) -> Result<Vec<Arc<dyn Handler>>, String> {
        let path = std::env::var("REELAY_PROBE_DB")
            .map_err(|_| "REELAY_PROBE_DB must name the probes' effects file".to_owned())?;
        let options = SqliteConnectOptions::new()
            .filename(&path)
            .create_if_missing(true)
            .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
            // Test bookkeeping, not the system under test: no fsync.
            .synchronous(sqlx::sqlite::SqliteSynchronous::Off)
            .busy_timeout(Duration::from_secs(30));
        let effects =
            SqlitePoolOptions::new().max_connections(1).connect_with(options).await.map_err(|e| e.to_string())?;
        for table in ["effects", "attempts"] {
            let sql = format!(
                "CREATE TABLE IF NOT EXISTS {table} (event_id TEXT NOT NULL, handler TEXT NOT NULL, pid INTEGER NOT NULL, \
                 at INTEGER NOT NULL, at_us INTEGER NOT NULL)"
            );
            sqlx::query(sqlx::AssertSqlSafe(sql)).execute(&effects).await.map_err(|e| e.to_string())?;
        }
        let fail = std::env::var("REELAY_PROBE_FAIL").is_ok_and(|v| v == "1");
        let delay = Duration::from_millis(
            std::env::var("REELAY_PROBE_DELAY_MS").ok().and_then(|v| v.parse().ok()).unwrap_or(0),
        );
        let mut handlers: Vec<Arc<dyn Handler>> = Vec::new();
        for name in names.split(',').map(str::trim) {
            let name: &'static str = match name {
                "probe-a" => "probe-a",
                "probe-b" => "probe-b",
                other => return Err(format!("unknown probe {other:?}; expected probe-a or probe-b")),
            };
            handlers.push(Arc::new(Probe { name, effects: effects.clone(), fail, delay }));
        }
        tracing::warn!(probes = %names, %path, fail, ?delay, "test probe handlers enabled");
        Ok(handlers)
    }

    impl Probe {
        /// One row per event and call: `attempts` for every run, `effects` for every effect.
        /// One transaction per batch, so the probe is never what limits a benchmark.
        async fn record(&self, table: &str, events: &[&v1::Event]) -> Result<(), HandlerError> {
            let failed = |e: sqlx::Error| HandlerError::retryable(format!("probe could not record into {table}: {e}"));
            let now_us =
                std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_micros() as i64);
            let mut tx = self.effects.begin().await.map_err(failed)?;
            for event in events {
                let sql = format!("INSERT INTO {table} (event_id, handler, pid, at, at_us) VALUES (?, ?, ?, ?, ?)");
                sqlx::query(sqlx::AssertSqlSafe(sql))
                    .bind(event.event_id.clone())
                    .bind(self.name)
                    .bind(i64::from(std::process::id()))
                    .bind(now_us / 1000)
                    .bind(now_us)
                    .execute(&mut *tx)
                    .await
                    .map_err(failed)?;
            }
            tx.commit().await.map_err(failed)
        }
    }

    #[async_trait::async_trait]
    impl Handler for Probe {
        fn name(&self) -> &'static str {
            self.name
        }

        fn event_types(&self) -> &'static [&'static str] {
            EVENT_TYPES
        }

        async fn handle(&self, event: &v1::Event) -> Result<(), HandlerError> {
            self.handle_batch(&[event]).await.pop().unwrap_or(Ok(()))
        }

        async fn handle_batch(&self, events: &[&v1::Event]) -> Vec<Result<(), HandlerError>> {
            let outcome = async {
                self.record("attempts", events).await?;
                tokio::time::sleep(self.delay).await;
                if self.fail {
                    return Err(HandlerError::retryable(format!("probe {} fails on purpose", self.name)));
                }
                self.record("effects", events).await
            }
            .await;
            vec![outcome; events.len()]
        }
    }
}
