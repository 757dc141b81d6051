//! Retention of the outbox: under a long steady load the table stays bounded (rows every
//! handler is finished with are deleted once past REELAY_OUTBOX_RETENTION_SECS, in small
//! batches), while a dead-lettered event stays until an operator acts on it, and goes after.

use std::time::{Duration, Instant};

use reelay_harness::{Backend, Cluster, eventually, query_strings, temp_dir};

const BIN: &str = env!("CARGO_BIN_EXE_reelay");

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

    // Twelve seconds of steady writes: far more rows than the table ever holds.
    let (mut written, mut largest) = (1, 0);
    let started = Instant::now();
    let mut next_look = Instant::now();
    while started.elapsed() < Duration::from_secs(12) {
        c.user(&format!("user_{written}")).await;
        written += 1;
        if Instant::now() >= next_look {
            largest = largest.max(rows(&cluster).await);
            next_look = Instant::now() + Duration::from_millis(500);
        }
        tokio::time::sleep(Duration::from_millis(4)).await;
    }
    largest = largest.max(rows(&cluster).await);
    eprintln!("{backend:?}: {written} events written in 12 s, at most {largest} outbox rows at once");
    assert!(written > 4 * largest, "the outbox stayed bounded: at most {largest} rows while {written} were written");

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
