//! Retention: rows that only matter for a while are deleted once past it, in small batches
//! (each its own short write job, so writes never wait long behind a purge): outbox rows every
//! handler is finished with, finished ledger rows and client request ids. Dead-lettered work
//! stays until an operator replays or discards it.

use std::time::Duration;

use futures_util::future::BoxFuture;
use reelay_kit::{Shutdown, now_ms};
use reelay_outbox::ledger::{self, LedgerPolicy};
use reelay_outbox::{Database, WriteTx, queue};

use crate::{Bus, WriteError, request_ids};

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
}

/// Purges what is past retention every `interval`, until shutdown.
pub async fn purge_expired(db: Database, retention: Retention, interval: Duration, shutdown: Shutdown) {
    loop {
        tokio::select! {
            () = shutdown.requested() => return,
            () = tokio::time::sleep(interval) => {}
        }
        let (cutoff, cursors) = (now_ms() - retention.outbox.as_millis() as i64, retention.bus == Bus::Db);
        purge(&db, "outbox_purge", "outbox rows", move |tx| {
            Box::pin(async move { queue::purge_finished(tx, cutoff, cursors, BATCH).await })
        })
        .await;
        let (policy, abandoned_claims) = (retention.ledger, retention.bus == Bus::Nats);
        purge(&db, "ledger_purge", "ledger rows", move |tx| {
            Box::pin(async move { ledger::purge(tx, now_ms(), policy, BATCH, abandoned_claims).await })
        })
        .await;
        let cutoff = now_ms() - retention.request_ids.as_millis() as i64;
        purge(&db, "request_id_purge", "request ids", move |tx| {
            Box::pin(async move { request_ids::purge(tx, cutoff, BATCH).await })
        })
        .await;
    }
}

/// Runs `batch` (which deletes up to `BATCH` rows and says how many) until nothing is left.
async fn purge<F>(db: &Database, job: &'static str, what: &str, batch: F)
where
    F: for<'t> Fn(&'t mut WriteTx) -> BoxFuture<'t, Result<u64, sqlx::Error>> + Clone + Send + 'static,
{
    let mut total = 0;
    loop {
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
