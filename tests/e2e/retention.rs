//! Retention of the outbox: under a long steady load the table stays bounded (rows every
//! handler is finished with are deleted once past REELAY_OUTBOX_RETENTION_SECS, in small
//! batches), while a dead-lettered event stays until an operator acts on it, and goes after.

use std::time::{Duration, Instant};

use reelay_harness::{Backend, Cluster, eventually, query_strings, temp_dir};
use reelay_kit::now_ms;

const BIN: &str = env!("CARGO_BIN_EXE_reelay");

/// The claim lease of the retire test: a handler not heard from for four of them (16 s) counts as
/// no longer run anywhere.
const LEASE_MS: i64 = 4_000;

async fn rows(cluster: &Cluster) -> usize {
    query_strings(&cluster.db, "SELECT COUNT(*) || '' FROM event_queue").await[0][0].parse().unwrap()
}

async fn the_outbox_stays_bounded(backend: Backend) {
    let dir = temp_dir();
    let cluster = Cluster::builder(BIN, backend)
        .probes("probe-a")
        .env("REELAY_PROBE_FAIL", "probe-a=permanent:kept_for_the_operator")
        .env("REELAY_OUTBOX_RETENTION_SECS", "1")
        .env("REELAY_LEDGER_PURGE_INTERVAL_MS", "250")
        .handlers(&[])
        .start(dir.path())
        .await;
    let mut c = cluster.write.clients().await;
    c.user("kept_for_the_operator").await;
    let kept = query_strings(&cluster.db, "SELECT event_id FROM event_queue").await[0][0].clone();

    // Sixteen seconds of steady writes. Bounded means old rows go: the oldest row left (the dead
    // letter's aside) is never much older than retention (1 s) plus the handlers' and purge's lag,
    // while without a purge it would be as old as the load. An age rather than a row count, so a
    // slow machine (fewer writes, longer lag) does not make a working purge look broken.
    let oldest_age = || {
        let (db, kept) = (cluster.db.clone(), kept.clone());
        async move {
            let sql =
                format!("SELECT COALESCE(MIN(created_at), 0) || '' FROM event_queue WHERE event_id IS NOT '{kept}'");
            let min: i64 = query_strings(&db, &sql).await[0][0].parse().unwrap();
            if min == 0 { 0 } else { now_ms() - min }
        }
    };
    let (mut written, mut oldest) = (1, 0);
    let started = Instant::now();
    let mut next_look = Instant::now();
    while started.elapsed() < Duration::from_secs(16) {
        c.user(&format!("user_{written}")).await;
        written += 1;
        if Instant::now() >= next_look {
            oldest = oldest.max(oldest_age().await);
            next_look = Instant::now() + Duration::from_millis(500);
        }
        tokio::time::sleep(Duration::from_millis(4)).await;
    }
    oldest = oldest.max(oldest_age().await);
    eprintln!("{backend:?}: {written} events written in 16 s, the oldest row left at most {oldest} ms old");
    assert!(written > 100, "a steady load: {written} events");
    assert!(oldest < 8_000, "the outbox stayed bounded: a row {oldest} ms old was still there");

    eventually("only the dead-lettered event is left", Duration::from_secs(20), || {
        let cluster = &cluster;
        async move { rows(cluster).await == 1 }
    })
    .await;
    let left = query_strings(&cluster.db, "SELECT event_id FROM event_queue").await;
    assert_eq!(left[0][0], kept, "a dead letter keeps its event until it is replayed or discarded");
    assert!(cluster.cli(&["dead-letters", "discard", &kept]).await.ok().contains("1 discarded"));
    eventually("a discarded dead letter's event goes too", Duration::from_secs(20), || {
        let cluster = &cluster;
        async move { rows(cluster).await == 0 }
    })
    .await;
    cluster.stop().await;
}

#[tokio::test]
async fn the_outbox_stays_bounded_on_the_db_backend() {
    the_outbox_stays_bounded(Backend::Db).await;
}

#[tokio::test]
async fn the_outbox_stays_bounded_on_the_nats_backend() {
    the_outbox_stays_bounded(Backend::Nats).await;
}

/// A handler removed from the build keeps its cursor, which on db holds outbox retention back
/// for ever: `reelay status` says so, and `reelay handlers retire` forgets it (its dead
/// letters discarded and recorded), after which retention goes on. A handler the write
/// service delivers to, or one it never knew, is refused, and nothing changes.
#[tokio::test]
async fn a_handler_removed_from_the_build_is_retired_and_retention_goes_on() {
    let dir = temp_dir();
    let mut cluster = Cluster::builder(BIN, Backend::Db)
        .probes("probe-a,probe-b")
        .env("REELAY_PROBE_FAIL", "probe-b=permanent:doomed")
        .env("REELAY_OUTBOX_RETENTION_SECS", "1")
        .env("REELAY_LEDGER_PURGE_INTERVAL_MS", "250")
        // Long enough that the two restarts below fit inside four leases on a slow machine.
        .env("REELAY_LEDGER_LEASE_MS", &LEASE_MS.to_string())
        .handlers(&[])
        .start(dir.path())
        .await;
    let mut c = cluster.write.clients().await;
    c.user("doomed").await;
    let doomed = query_strings(&cluster.db, "SELECT event_id FROM event_queue").await[0][0].clone();
    eventually("probe-b dead-letters the event", Duration::from_secs(20), || {
        let db = cluster.db.clone();
        async move {
            query_strings(&db, "SELECT status FROM processed_events WHERE handler = 'probe-b'").await
                == vec![vec!["dead_lettered".to_owned()]]
        }
    })
    .await;

    // probe-b leaves the build: the write service (and the handlers) run without it. Its cursor
    // stays, and holds back every row after it.
    cluster.handlers[0].restart_with(&[("REELAY_PROBE_HANDLERS", "probe-a")]).await;
    cluster.write.restart_with(&[("REELAY_PROBE_HANDLERS", "probe-a")]).await;
    // The handlers process ran probe-b a moment ago: it may still hold some of its work.
    let live = cluster.cli(&["handlers", "retire", "probe-b"]).await;
    assert!(!live.success && live.stderr.contains("is still run by a process"), "{live:?}");
    let mut c = cluster.write.clients().await;
    for i in 0..5 {
        c.user(&format!("user{i}")).await;
    }
    let status = cluster.cli(&["status"]).await;
    assert!(status.ok().contains("not delivered by this write service (not in its build or --handler list): probe-b"));
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(rows(&cluster).await >= 6, "probe-b's cursor holds retention back");

    let delivered = cluster.cli(&["handlers", "retire", "probe-a"]).await;
    assert!(!delivered.success && delivered.stderr.contains("is delivered to by the write service"), "{delivered:?}");
    let unknown = cluster.cli(&["handlers", "retire", "probe-z"]).await;
    assert!(!unknown.success && unknown.stderr.contains("no handler named \"probe-z\""), "{unknown:?}");
    assert!(rows(&cluster).await >= 6, "a refused retire changes nothing");
    let dead = "SELECT handler, status FROM processed_events WHERE status = 'dead_lettered'";
    assert_eq!(query_strings(&cluster.db, dead).await, vec![vec!["probe-b".to_owned(), "dead_lettered".to_owned()]]);
    let cursors = query_strings(&cluster.db, "SELECT handler FROM handler_cursors WHERE handler LIKE 'probe-%'").await;
    assert_eq!(cursors.len(), 2, "{cursors:?}");
    // Refused until probe-b has not been heard from for four leases, then done.
    let heard = "SELECT MAX(last_seen) || '' FROM handler_builds WHERE handler = 'probe-b'";
    let last_heard: i64 = query_strings(&cluster.db, heard).await[0][0].parse().unwrap();
    let retired = reelay_harness::eventually_some("probe-b can be retired", Duration::from_secs(60), || async {
        let out = cluster.cli(&["handlers", "retire", "probe-b"]).await;
        if out.success {
            return Some(out);
        }
        assert!(out.stderr.contains("is still run by a process"), "{out:?}");
        tokio::time::sleep(Duration::from_secs(1)).await;
        None
    })
    .await;
    assert!(
        now_ms() >= last_heard + 4 * LEASE_MS,
        "retired only four leases after it was last heard from ({last_heard})"
    );
    assert!(retired.ok().contains("retired probe-b: 1 dead letter(s)"), "{retired:?}");
    let actions =
        query_strings(&cluster.db, "SELECT action, event_id FROM dead_letter_actions WHERE handler = 'probe-b'").await;
    assert_eq!(actions, vec![vec!["discard".to_owned(), doomed]], "the discard is recorded");
    assert!(query_strings(&cluster.db, "SELECT 1 FROM handler_cursors WHERE handler = 'probe-b'").await.is_empty());
    eventually("retention goes on: every row probe-a finished is deleted", Duration::from_secs(20), || {
        let cluster = &cluster;
        async move { rows(cluster).await == 0 }
    })
    .await;
    assert!(!cluster.cli(&["status"]).await.ok().contains("not delivered"));
    cluster.stop().await;
}
