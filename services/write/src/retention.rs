//! Retention: rows that only matter for a while are deleted once past it, in small batches
//! (each its own short write job, so writes never wait long behind a purge): outbox rows every
//! handler is finished with, finished ledger rows, handlers' builds long gone, client request
//! ids and the federation's dedup records. Dead-lettered work stays until an operator replays
//! or discards it.

use std::time::Duration;

use futures_util::future::BoxFuture;
use reelay_kit::{Shutdown, now_ms};
use reelay_outbox::ledger::{self, LedgerPolicy};
use reelay_outbox::{Database, WriteTx, queue};

use crate::{Bus, WriteError, request_ids, store};

/// Rows deleted per write job: each job holds the writer for a few milliseconds at most.
const BATCH: u32 = 500;

/// How long each kind of row is kept.
#[derive(Debug, Clone, Copy)]
pub struct Retention {
    pub ledger: LedgerPolicy,
    /// How long a request id answers a retry (`REELAY_REQUEST_ID_RETENTION_HOURS`).
    pub request_ids: Duration,
    /// How long outbox rows every handler is finished with are kept
    /// (`REELAY_OUTBOX_RETENTION_SECS`).
    pub outbox: Duration,
    /// Finished means past every cursor on db, published on nats.
    pub bus: Bus,
    /// How long the federation's records of activities taken in and queued out, and of deleted
    /// remote reviews, are kept (`REELAY_FEDERATION_RETENTION_DAYS`).
    pub federation: Duration,
    /// How long a remote server's failures are kept with no new one: the federation's
    /// retention, or the unavailable-after time when longer (a server's count must not be
    /// forgotten before it could turn unavailable).
    pub failing_servers: Duration,
}

/// Purges what is past retention every `interval`, until shutdown.
pub async fn purge_expired(db: Database, retention: Retention, interval: Duration, shutdown: Shutdown) {
    loop {
        tokio::select! {
            () = shutdown.requested() => return,
            () = tokio::time::sleep(interval) => {}
        }
        let (cutoff, cursors) = (now_ms() - retention.outbox.as_millis() as i64, retention.bus == Bus::Db);
        purge(&db, &shutdown, "outbox_purge", "outbox rows", move |tx| {
            Box::pin(async move { queue::purge_finished(tx, cutoff, cursors, BATCH).await })
        })
        .await;
        let (policy, abandoned_claims) = (retention.ledger, retention.bus == Bus::Nats);
        // Ledger rows, and handlers' builds long gone, in one job.
        purge(&db, &shutdown, "ledger_purge", "ledger rows", move |tx| {
            Box::pin(async move { ledger::purge(tx, now_ms(), policy, BATCH, abandoned_claims).await })
        })
        .await;
        let cutoff = now_ms() - retention.request_ids.as_millis() as i64;
        purge(&db, &shutdown, "request_id_purge", "request ids", move |tx| {
            Box::pin(async move { request_ids::purge(tx, cutoff, BATCH).await })
        })
        .await;
        let now = now_ms();
        let servers_cutoff = now - retention.failing_servers.as_millis() as i64;
        purge_federation(&db, &shutdown, now - retention.federation.as_millis() as i64, servers_cutoff, BATCH).await;
    }
}

/// Deletes the federation's dedup records from before `cutoff_ms`, `batch` rows of each table
/// per job.
async fn purge_federation(db: &Database, shutdown: &Shutdown, cutoff_ms: i64, servers_cutoff_ms: i64, batch: u32) {
    purge(db, shutdown, "federation_purge", "federation dedup records", move |tx| {
        Box::pin(async move { store::purge_federation_records(tx, cutoff_ms, servers_cutoff_ms, batch).await })
    })
    .await;
}

/// Runs `batch` (which deletes up to `BATCH` rows and says how many) until nothing is left, or
/// until shutdown is asked for (a backlog of millions, after retention was lowered, would
/// otherwise hold the stop past its grace period; the next start goes on with it).
async fn purge<F>(db: &Database, shutdown: &Shutdown, job: &'static str, what: &str, batch: F)
where
    F: for<'t> Fn(&'t mut WriteTx) -> BoxFuture<'t, Result<u64, sqlx::Error>> + Clone + Send + 'static,
{
    let mut total = 0;
    while !shutdown.is_requested() {
        let batch = batch.clone();
        let purged = db
            .writer
            .transact::<_, WriteError, _>(job, move |tx: &mut WriteTx| Box::pin(async move { Ok(batch(tx).await?) }))
            .await;
        match purged {
            Ok(0) => break,
            Ok(n) => total += n,
            Err(error) => {
                tracing::warn!(%error, "purging {what} failed; will try again");
                break;
            }
        }
        tokio::task::yield_now().await;
    }
    if total > 0 {
        tracing::info!(rows = total, "purged {what} past retention");
    }
}

#[cfg(test)]
mod tests {
    use reelay_outbox::DbConfig;

    use super::*;

    async fn count(db: &Database, table: &str) -> i64 {
        sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SELECT COUNT(*) FROM {table}")))
            .fetch_one(&db.reads)
            .await
            .unwrap()
    }

    /// Records older than the cutoff go, however many (more than one job's batch), and newer
    /// ones stay, in each of the three tables, and the servers by their own cutoff.
    #[tokio::test]
    async fn the_federation_records_past_retention_are_purged() {
        let dir = tempfile::tempdir().unwrap();
        let db = Database::open(&DbConfig::new(dir.path().join("reelay.db"))).await.unwrap();
        let (old, new, cutoff) = (1_000, 3_000, 2_000);
        db.writer
            .transact::<_, WriteError, _>("fixtures", move |tx: &mut WriteTx| {
                Box::pin(async move {
                    for n in 0..7 {
                        let at = if n < 5 { old + n } else { new + n };
                        let id = format!("https://peer.example/activities/{n}");
                        for sql in [
                            "INSERT INTO federation_inbox (activity_id, actor_uri, received_at) \
                             VALUES (?1, 'https://peer.example/users/a', ?2)",
                            "INSERT INTO federation_outbox (activity_id, queued, created_at) VALUES (?1, 1, ?2)",
                            "INSERT INTO remote_review_tombstones (object_uri, actor_uri, deleted_at) \
                             VALUES (?1, 'https://peer.example/users/a', ?2)",
                            // A server that last failed 500 ms after it.
                            "INSERT INTO federation_failing_hosts (host, failing_since, last_failure_at, failures) \
                             VALUES (?1, ?2 + 500, ?2 + 500, 1)",
                        ] {
                            sqlx::query(sql).bind(&id).bind(at).execute(tx.conn()).await?;
                        }
                    }
                    Ok(())
                })
            })
            .await
            .unwrap();
        // Asked to stop, it deletes nothing more (the next start goes on).
        let stopping = Shutdown::new();
        stopping.request();
        purge_federation(&db, &stopping, cutoff, old + 502, 2).await;
        assert_eq!(count(&db, "federation_inbox").await, 7, "nothing purged once shutdown is asked for");
        purge_federation(&db, &Shutdown::new(), cutoff, old + 502, 2).await;
        for table in ["federation_inbox", "federation_outbox", "remote_review_tombstones"] {
            assert_eq!(count(&db, table).await, 2, "{table}: the two newer records stay");
            let oldest: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
                "SELECT MIN({}) FROM {table}",
                match table {
                    "federation_inbox" => "received_at",
                    "federation_outbox" => "created_at",
                    _ => "deleted_at",
                }
            )))
            .fetch_one(&db.reads)
            .await
            .unwrap();
            assert!(oldest >= cutoff, "{table}: {oldest}");
        }
        // The servers by their own cutoff.
        let servers: Vec<i64> =
            sqlx::query_scalar("SELECT last_failure_at FROM federation_failing_hosts ORDER BY last_failure_at")
                .fetch_all(&db.reads)
                .await
                .unwrap();
        assert_eq!(servers, [old + 502, old + 503, old + 504, new + 505, new + 506]);
    }
}
