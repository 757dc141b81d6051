//! Test-only probe handlers. Always compiled, but constructible only with the feature
//! `test-handlers`, which release builds never enable; without it, asking for a probe is a
//! start-up error, and the crate links no database.
//!
//! A probe records every execution as one row in its own SQLite table (not the write service's
//! database), so an end-to-end test can count attempts and effects per (event, handler).
//! Settings (environment, hidden from `--help`):
//! - `REELAY_PROBE_HANDLERS=probe-a,probe-b` — which probes exist in this process (none when
//!   unset); `probe-a` to `probe-h` take every event type (eight, for the many-handler
//!   benchmark).
//! - `REELAY_PROBE_DB` — the effects file.
//! - `REELAY_PROBE_FAIL` — `1`: every execution fails (retryable) after recording its attempt;
//!   or per probe, `probe-a=permanent:<text>` (a permanent failure for events whose encoded
//!   payload contains `<text>`), `probe-a=panic:<text>` (the probe panics on such events),
//!   `probe-a=abort:<text>` (the whole process aborts on such events, as an out-of-memory kill
//!   would end it), `probe-b=times:<n>` (each event fails its first `n` attempts, then
//!   succeeds) and `probe-a=unavailable:<path>` (while the file `<path>` exists, the probe says
//!   its dependency is unavailable), comma-separated.
//! - `REELAY_PROBE_DELAY_MS` — `500`: every probe sleeps that long before its effect (to be
//!   killed there); or per probe, `probe-c=2000`.
//! - `REELAY_PROBE_ONE_BY_ONE` — `1`: the probes do not batch, so the runtime gives them one
//!   event at a time (as most handlers); or per probe, `probe-a=1`.
//! - `REELAY_PROBE_TYPES` — per probe, the event types it takes instead of all of them,
//!   separated by `+`: `probe-a=UserRegistered+MovieDeleted` (an older build of a handler that
//!   took fewer types).

use reelay_delivery::{BuiltHandler, HandlerContext};

/// The probe names a build may have.
pub const PROBES: &[&str] = &["probe-a", "probe-b", "probe-c", "probe-d", "probe-e", "probe-f", "probe-g", "probe-h"];

#[derive(Debug, Clone, Default, clap::Args)]
pub struct ProbeSettings {
    #[arg(
        id = "probe_handlers",
        long = "probe-handlers",
        env = "REELAY_PROBE_HANDLERS",
        hide = true,
        value_delimiter = ','
    )]
    pub handlers: Vec<String>,
    #[arg(id = "probe_db", long = "probe-db", env = "REELAY_PROBE_DB", hide = true)]
    pub db: Option<std::path::PathBuf>,
    #[arg(id = "probe_fail", long = "probe-fail", env = "REELAY_PROBE_FAIL", hide = true, default_value = "")]
    pub fail: String,
    #[arg(
        id = "probe_delay_ms",
        long = "probe-delay-ms",
        env = "REELAY_PROBE_DELAY_MS",
        hide = true,
        default_value = ""
    )]
    pub delay_ms: String,
    #[arg(
        id = "probe_one_by_one",
        long = "probe-one-by-one",
        env = "REELAY_PROBE_ONE_BY_ONE",
        hide = true,
        default_value = ""
    )]
    pub one_by_one: String,
    #[arg(id = "probe_types", long = "probe-types", env = "REELAY_PROBE_TYPES", hide = true, default_value = "")]
    pub types: String,
}

impl ProbeSettings {
    /// The probes these settings ask for.
    pub fn names(&self) -> Vec<&'static str> {
        PROBES.iter().copied().filter(|p| self.handlers.iter().any(|h| h.trim() == *p)).collect()
    }

    /// The value of a per-probe setting (`probe-a=...,probe-b=...`) for `probe`, or the setting
    /// itself when it names no probe.
    #[cfg_attr(not(feature = "test-handlers"), allow(dead_code, reason = "only probes read their settings"))]
    fn for_probe<'s>(setting: &'s str, probe: &str) -> Option<&'s str> {
        if setting.is_empty() {
            return None;
        }
        if !setting.contains('=') {
            return Some(setting);
        }
        setting
            .split(',')
            .filter_map(|part| part.trim().split_once('='))
            .find(|(name, _)| *name == probe)
            .map(|(_, v)| v)
    }
}

/// Builds probe `name` with `settings`.
pub async fn build(
    name: &'static str,
    settings: &ProbeSettings,
    _context: &HandlerContext,
) -> anyhow::Result<BuiltHandler> {
    #[cfg(feature = "test-handlers")]
    return enabled::build(name, settings).await;
    #[cfg(not(feature = "test-handlers"))]
    {
        let _ = settings;
        anyhow::bail!(
            "REELAY_PROBE_HANDLERS asks for {name}, but this build has no probe handlers (they exist only in test builds)"
        )
    }
}

#[cfg(feature = "test-handlers")]
mod enabled {
    use std::sync::Arc;
    use std::time::Duration;

    use anyhow::{Context, bail};
    use prost::Message;
    use reelay_contracts::v1;
    use reelay_delivery::{BuiltHandler, Handler, HandlerError};
    use reelay_domain::EVENT_TYPES;
    use sqlx::Row;
    use sqlx::sqlite::{SqliteConnectOptions, SqlitePool, SqlitePoolOptions};
    use tokio::sync::{OnceCell, mpsc, oneshot};

    use super::ProbeSettings;

    #[derive(Debug, Clone, PartialEq, Eq)]
    enum Failure {
        None,
        Always,
        /// Permanent for events whose encoded payload contains this text.
        PermanentIf(String),
        /// A panic on events whose encoded payload contains this text.
        PanicIf(String),
        /// The process aborts on events whose encoded payload contains this text.
        AbortIf(String),
        /// Each event fails its first n attempts.
        Times(u32),
        /// The probe's dependency is down while this file exists.
        UnavailableWhile(std::path::PathBuf),
    }

    struct Probe {
        name: &'static str,
        effects: Effects,
        failure: Failure,
        delay: Duration,
        /// Whether the runtime gives it a fetched batch's events in one call.
        batches: bool,
        types: &'static [&'static str],
    }

    /// Rows for one table, recorded together with whatever the other probes send meanwhile.
    struct Record {
        table: &'static str,
        handler: &'static str,
        event_ids: Vec<String>,
        at_us: i64,
        recorded: oneshot::Sender<Result<(), String>>,
    }

    /// The process's effects file: one connection, and one task that records the rows every
    /// probe sends in one transaction per wake, so that probes (eight, in the many-handler
    /// benchmark) never queue behind each other's commits and are not what a benchmark measures.
    #[derive(Clone)]
    struct Effects {
        pool: SqlitePool,
        records: mpsc::UnboundedSender<Record>,
    }

    /// One effects file per process, shared by its probes.
    static EFFECTS: OnceCell<Effects> = OnceCell::const_new();

    const TABLES: [&str; 2] = ["attempts", "effects"];

    async fn effects(settings: &ProbeSettings) -> anyhow::Result<Effects> {
        let path = settings.db.clone().context("REELAY_PROBE_DB must name the probes' effects file")?;
        let effects = EFFECTS
            .get_or_try_init(|| async {
                let options = SqliteConnectOptions::new()
                    .filename(&path)
                    .create_if_missing(true)
                    .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
                    // Test bookkeeping, not the system under test: no fsync.
                    .synchronous(sqlx::sqlite::SqliteSynchronous::Off)
                    .busy_timeout(Duration::from_secs(30));
                let pool = SqlitePoolOptions::new().max_connections(1).connect_with(options).await?;
                for table in TABLES {
                    let sql = format!(
                        "CREATE TABLE IF NOT EXISTS {table} (event_id TEXT NOT NULL, handler TEXT NOT NULL, \
                         pid INTEGER NOT NULL, at INTEGER NOT NULL, at_us INTEGER NOT NULL)"
                    );
                    sqlx::query(sqlx::AssertSqlSafe(sql)).execute(&pool).await?;
                }
                let (records, queue) = mpsc::unbounded_channel();
                tokio::spawn(record_all(pool.clone(), queue));
                Ok::<_, sqlx::Error>(Effects { pool, records })
            })
            .await?;
        Ok(effects.clone())
    }

    /// Records what the probes send: everything waiting goes into one transaction, one insert
    /// per table (a few for large batches), and every sender hears the outcome.
    async fn record_all(pool: SqlitePool, mut queue: mpsc::UnboundedReceiver<Record>) {
        while let Some(first) = queue.recv().await {
            let mut records = vec![first];
            while let Ok(record) = queue.try_recv() {
                records.push(record);
            }
            let outcome = insert_all(&pool, &records).await.map_err(|e| e.to_string());
            for record in records {
                let _ = record.recorded.send(outcome.clone());
            }
        }
    }

    async fn insert_all(pool: &SqlitePool, records: &[Record]) -> Result<(), sqlx::Error> {
        let pid = i64::from(std::process::id());
        let mut tx = pool.begin().await?;
        for table in TABLES {
            let rows: Vec<(&str, &str, i64)> = records
                .iter()
                .filter(|r| r.table == table)
                .flat_map(|r| r.event_ids.iter().map(move |id| (id.as_str(), r.handler, r.at_us)))
                .collect();
            for chunk in rows.chunks(500) {
                let sql = format!(
                    "INSERT INTO {table} (event_id, handler, pid, at, at_us) VALUES {}",
                    vec!["(?, ?, ?, ?, ?)"; chunk.len()].join(", ")
                );
                let mut insert = sqlx::query(sqlx::AssertSqlSafe(sql));
                for (event_id, handler, at_us) in chunk {
                    insert = insert.bind(*event_id).bind(*handler).bind(pid).bind(at_us / 1000).bind(at_us);
                }
                insert.execute(&mut *tx).await?;
            }
        }
        tx.commit().await
    }

    pub(super) async fn build(name: &'static str, settings: &ProbeSettings) -> anyhow::Result<BuiltHandler> {
        let failure = match ProbeSettings::for_probe(&settings.fail, name) {
            None | Some("") | Some("0") => Failure::None,
            Some("1") => Failure::Always,
            Some(rule) => match rule.split_once(':') {
                Some(("permanent", text)) => Failure::PermanentIf(text.to_owned()),
                Some(("panic", text)) => Failure::PanicIf(text.to_owned()),
                Some(("abort", text)) => Failure::AbortIf(text.to_owned()),
                Some(("times", n)) => {
                    Failure::Times(n.parse().with_context(|| format!("REELAY_PROBE_FAIL: {rule:?}"))?)
                }
                Some(("unavailable", path)) => Failure::UnavailableWhile(path.into()),
                _ => bail!(
                    "REELAY_PROBE_FAIL: {rule:?} is not 1, permanent:<text>, panic:<text>, abort:<text>, times:<n> \
                     or unavailable:<path>"
                ),
            },
        };
        let delay = match ProbeSettings::for_probe(&settings.delay_ms, name) {
            None => Duration::ZERO,
            Some(ms) => Duration::from_millis(ms.parse().with_context(|| format!("REELAY_PROBE_DELAY_MS: {ms:?}"))?),
        };
        let batches = match ProbeSettings::for_probe(&settings.one_by_one, name) {
            None | Some("") | Some("0") => true,
            Some("1") => false,
            Some(other) => bail!("REELAY_PROBE_ONE_BY_ONE: {other:?} is not 0 or 1"),
        };
        let types: &'static [&'static str] = match ProbeSettings::for_probe(&settings.types, name) {
            None | Some("") => EVENT_TYPES,
            Some(types) => {
                let mut taken = Vec::new();
                for wanted in types.split('+') {
                    let Some(known) = EVENT_TYPES.iter().find(|t| **t == wanted) else {
                        bail!("REELAY_PROBE_TYPES: {wanted:?} is not an event type");
                    };
                    taken.push(*known);
                }
                // Built once per probe per process.
                Vec::leak(taken)
            }
        };
        let effects = effects(settings).await?;
        tracing::warn!(probe = name, ?failure, ?delay, batches, ?types, "test probe handler enabled");
        Ok(BuiltHandler { handler: Arc::new(Probe { name, effects, failure, delay, batches, types }), grpc: None })
    }

    impl Probe {
        /// One row per event and call: `attempts` for every run, `effects` for every effect.
        async fn record(&self, table: &'static str, events: &[&v1::Event]) -> Result<(), HandlerError> {
            if events.is_empty() {
                return Ok(());
            }
            let failed = |e: String| HandlerError::retryable(format!("probe could not record into {table}: {e}"));
            let at_us =
                std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_micros() as i64);
            let (recorded, outcome) = oneshot::channel();
            let event_ids = events.iter().map(|e| e.event_id.clone()).collect();
            let record = Record { table, handler: self.name, event_ids, at_us, recorded };
            self.effects.records.send(record).map_err(|_| failed("the recorder stopped".into()))?;
            outcome.await.map_err(|_| failed("the recorder stopped".into()))?.map_err(failed)
        }

        /// How this probe's failure rule treats `event`, now that its attempt is recorded.
        async fn verdict(&self, event: &v1::Event) -> Result<(), HandlerError> {
            match &self.failure {
                Failure::None => Ok(()),
                Failure::Always => Err(HandlerError::retryable(format!("probe {} fails on purpose", self.name))),
                Failure::PermanentIf(text) => {
                    if mentions(event, text) {
                        Err(HandlerError::permanent(format!("probe {} refuses events with {text:?}", self.name)))
                    } else {
                        Ok(())
                    }
                }
                Failure::PanicIf(text) => {
                    assert!(!mentions(event, text), "probe {} panics on events with {text:?}", self.name);
                    Ok(())
                }
                Failure::AbortIf(text) => {
                    if mentions(event, text) {
                        tracing::error!(probe = self.name, event_id = %event.event_id, "probe aborts the process");
                        std::process::abort();
                    }
                    Ok(())
                }
                Failure::UnavailableWhile(path) => match path.exists() {
                    true => Err(HandlerError::unavailable(format!("probe {}: its dependency is down", self.name))),
                    false => Ok(()),
                },
                Failure::Times(n) => {
                    let attempts: i64 = sqlx::query("SELECT COUNT(*) FROM attempts WHERE event_id = ? AND handler = ?")
                        .bind(event.event_id.clone())
                        .bind(self.name)
                        .fetch_one(&self.effects.pool)
                        .await
                        .map(|r| r.get(0))
                        .map_err(|e| HandlerError::retryable(e.to_string()))?;
                    if attempts <= i64::from(*n) {
                        Err(HandlerError::retryable(format!("probe {} fails attempt {attempts} of {n}", self.name)))
                    } else {
                        Ok(())
                    }
                }
            }
        }
    }

    /// Whether `event`'s encoded payload contains `text`.
    fn mentions(event: &v1::Event, text: &str) -> bool {
        event.encode_to_vec().windows(text.len()).any(|w| w == text.as_bytes())
    }

    #[async_trait::async_trait]
    impl Handler for Probe {
        fn name(&self) -> &'static str {
            self.name
        }

        fn event_types(&self) -> &'static [&'static str] {
            self.types
        }

        async fn handle(&self, event: &v1::Event) -> Result<(), HandlerError> {
            self.handle_batch(&[event]).await.pop().unwrap_or(Ok(()))
        }

        fn batches(&self) -> bool {
            self.batches
        }

        async fn handle_batch(&self, events: &[&v1::Event]) -> Vec<Result<(), HandlerError>> {
            if let Err(error) = self.record("attempts", events).await {
                return vec![Err(error); events.len()];
            }
            tokio::time::sleep(self.delay).await;
            let mut verdicts = Vec::with_capacity(events.len());
            for event in events {
                verdicts.push(self.verdict(event).await);
            }
            let succeeded: Vec<&v1::Event> =
                events.iter().zip(&verdicts).filter(|(_, v)| v.is_ok()).map(|(e, _)| *e).collect();
            if let Err(error) = self.record("effects", &succeeded).await {
                return vec![Err(error); events.len()];
            }
            verdicts
        }
    }
}
