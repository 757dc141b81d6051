//! Delivery on the db backend with real processes: the write service's Outbox and Ledger APIs,
//! handler processes consuming through them, crashes, outages and retries. Effects are counted
//! by probe handlers (test builds only) in their own SQLite table.

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::time::Duration;

use reelay_contracts::v1;
use reelay_harness::{Clients, Reelay, event_ids, eventually, probe_records, query_strings, temp_dir};

const BIN: &str = env!("CARGO_BIN_EXE_reelay");

fn probe_env<'a>(effects: &'a str, probes: &'a str) -> Vec<(&'a str, &'a str)> {
    vec![("REELAY_PROBE_DB", effects), ("REELAY_PROBE_HANDLERS", probes)]
}

async fn effects(path: &Path) -> (HashMap<(String, String), usize>, HashSet<String>) {
    probe_records(path, "effects").await
}

async fn stats(c: &mut Clients) -> v1::StatsResponse {
    c.outbox.stats(v1::StatsRequest {}).await.unwrap().into_inner()
}

async fn row(db: &Path, event_id: &str) -> (String, i64, i64) {
    let r = query_strings(
        db,
        &format!("SELECT status, CAST(attempts AS TEXT), CAST(available_at AS TEXT) FROM event_queue WHERE event_id = '{event_id}'"),
    )
    .await;
    (r[0][0].clone(), r[0][1].parse().unwrap(), r[0][2].parse().unwrap())
}

fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as i64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_handler_processes_apply_every_effect_exactly_once() {
    let dir = temp_dir();
    let db = dir.path().join("reelay.db");
    let effects_db = dir.path().join("effects.db");
    let effects_path = effects_db.to_str().unwrap();
    let mut write = Reelay::start_write(BIN, &db, &[]).await;
    let mut env = probe_env(effects_path, "probe-a,probe-b");
    env.push(("REELAY_CONSUMER_BATCH", "16"));
    let (dir_a, dir_b) = (dir.path().join("a"), dir.path().join("b"));
    let mut one = Reelay::start_handlers(BIN, &write, &dir_a, &env).await;
    let mut two = Reelay::start_handlers(BIN, &write, &dir_b, &env).await;

    // A few thousand events from concurrent writers while both consumers run.
    let c = write.clients().await;
    let users = 8;
    let reviews_per_user = 300;
    let mut tasks = Vec::new();
    for u in 0..users {
        let mut c = c.clone();
        tasks.push(tokio::spawn(async move {
            let user = c.user(&format!("user{u}")).await;
            for i in 0..reviews_per_user {
                let movie = reelay_harness::movie_ref(&format!("Film {}", i % 50), 2000 + (i % 20));
                c.reviews
                    .log_review(v1::LogReviewRequest {
                        actor_user_id: user.clone(),
                        movie,
                        rating: 7,
                        ..Default::default()
                    })
                    .await
                    .unwrap();
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    let ids = event_ids(&db).await;
    assert!(ids.len() >= 2_000, "{} events", ids.len());
    let mut c = c;
    eventually("every event is handled by both probes", Duration::from_secs(120), || {
        let (effects_db, expected) = (effects_db.clone(), ids.len() * 2);
        async move { effects(&effects_db).await.0.len() == expected }
    })
    .await;
    eventually("the outbox is drained", Duration::from_secs(30), || {
        let mut c = c.clone();
        async move {
            let s = stats(&mut c).await;
            s.pending == 0 && s.processing == 0
        }
    })
    .await;
    let (counts, pids) = effects(&effects_db).await;
    let duplicated: Vec<_> = counts.iter().filter(|(_, n)| **n > 1).collect();
    assert!(duplicated.is_empty(), "effects applied more than once: {duplicated:?}");
    for id in &ids {
        for probe in ["probe-a", "probe-b"] {
            assert_eq!(counts.get(&(id.clone(), probe.to_owned())), Some(&1), "{probe} on {id}");
        }
    }
    assert_eq!(pids.len(), 2, "both handler processes took part");
    let s = stats(&mut c).await;
    assert_eq!((s.done as usize, s.dead_lettered), (ids.len(), 0));
    let spent = query_strings(&db, "SELECT CAST(SUM(attempts) AS TEXT) FROM event_queue").await;
    assert_eq!(spent[0][0], "0", "no attempt was spent");
    one.stop().await;
    two.stop().await;
    write.stop().await;
}

#[tokio::test]
async fn a_killed_handler_process_is_taken_over_and_its_late_complete_rejected() {
    let dir = temp_dir();
    let db = dir.path().join("reelay.db");
    let effects_db = dir.path().join("effects.db");
    let leases = [("REELAY_OUTBOX_LEASE_MS", "1500"), ("REELAY_LEDGER_LEASE_MS", "1500")];
    let mut write = Reelay::start_write(BIN, &db, &leases).await;
    let mut c = write.clients().await;

    // The first consumer claims the event, then hangs inside the handler until it is killed.
    let mut env = probe_env(effects_db.to_str().unwrap(), "probe-a");
    env.push(("REELAY_PROBE_DELAY_MS", "600000"));
    let mut doomed = Reelay::start_handlers(BIN, &write, &dir.path().join("doomed"), &env).await;
    c.user("ana").await;
    let event_id = event_ids(&db).await.remove(0);
    let claim_sql =
        format!("SELECT status, CAST(started_at AS TEXT) FROM processed_events WHERE event_id = '{event_id}'");
    eventually("the first consumer holds the ledger claim", Duration::from_secs(20), || {
        let (db, sql) = (db.clone(), claim_sql.clone());
        async move { !query_strings(&db, &sql).await.is_empty() }
    })
    .await;
    let stale_token: i64 = query_strings(&db, &claim_sql).await[0][1].parse().unwrap();
    doomed.kill();

    // A second consumer takes over the row and the claim once the leases run out.
    let survivor = Reelay::start_handlers(
        BIN,
        &write,
        &dir.path().join("survivor"),
        &probe_env(effects_db.to_str().unwrap(), "probe-a"),
    )
    .await;
    eventually("the survivor handles the event", Duration::from_secs(30), || {
        let db = db.clone();
        let id = event_id.clone();
        async move { row(&db, &id).await.0 == "done" }
    })
    .await;
    let (counts, _) = effects(&effects_db).await;
    assert_eq!(counts.get(&(event_id.clone(), "probe-a".to_owned())), Some(&1));
    assert_eq!(counts.len(), 1);
    let ledger = query_strings(&db, &claim_sql).await;
    assert_eq!(ledger[0][0], "done");
    assert!(ledger[0][1].parse::<i64>().unwrap() > stale_token, "the take-over got a newer token");
    assert!(survivor.log_text().contains("taking over") || write.log_text().contains("taking over"));

    // The killed owner's late Complete (and Release) change nothing.
    let late = v1::OwnedKey {
        key: Some(v1::LedgerKey { event_id: event_id.clone(), handler: "probe-a".into() }),
        token: stale_token,
    };
    let reply = c.ledger.complete(v1::LedgerSettleRequest { keys: vec![late.clone()] }).await.unwrap().into_inner();
    assert_eq!(reply.owned, vec![false], "claim lost");
    let reply = c.ledger.release(v1::LedgerSettleRequest { keys: vec![late] }).await.unwrap().into_inner();
    assert_eq!(reply.owned, vec![false]);
    assert_eq!(query_strings(&db, &claim_sql).await[0][0], "done");
    write.stop().await;
}

#[tokio::test]
async fn a_claim_held_elsewhere_defers_without_spending_an_attempt() {
    let dir = temp_dir();
    let db = dir.path().join("reelay.db");
    let effects_db = dir.path().join("effects.db");
    let mut write = Reelay::start_write(BIN, &db, &[("REELAY_LEDGER_LEASE_MS", "120000")]).await;
    let mut c = write.clients().await;
    c.user("ana").await;
    let event_id = event_ids(&db).await.remove(0);
    // Someone else holds (event, probe-a).
    let claim =
        v1::LedgerClaimRequest { keys: vec![v1::LedgerKey { event_id: event_id.clone(), handler: "probe-a".into() }] };
    let reply = c.ledger.claim(claim.clone()).await.unwrap().into_inner();
    let Some(v1::ledger_claim::Outcome::AcquiredToken(token)) = reply.claims[0].outcome else { panic!("{reply:?}") };
    let again = c.ledger.claim(claim).await.unwrap().into_inner();
    assert_eq!(again.claims[0].outcome, Some(v1::ledger_claim::Outcome::HeldUntilMs(token + 120_000)));

    let handlers =
        Reelay::start_handlers(BIN, &write, &dir.path().join("h"), &probe_env(effects_db.to_str().unwrap(), "probe-a"))
            .await;
    eventually("the delivery is deferred to the lease expiry", Duration::from_secs(20), || {
        let (db, id) = (db.clone(), event_id.clone());
        async move { row(&db, &id).await == ("pending".to_owned(), 0, token + 120_000) }
    })
    .await;
    assert!(effects(&effects_db).await.0.is_empty(), "the handler did not run");
    drop(handlers);
    write.stop().await;
}

#[tokio::test]
async fn a_failing_handler_retries_on_the_backoff_schedule_and_dead_letters() {
    let dir = temp_dir();
    let db = dir.path().join("reelay.db");
    let effects_db = dir.path().join("effects.db");
    let mut env = probe_env(effects_db.to_str().unwrap(), "probe-a");
    env.push(("REELAY_PROBE_FAIL", "1"));

    // With 3 attempts allowed, the first failure schedules the next delivery 5 s later.
    let mut write = Reelay::start_write(BIN, &db, &[("EVENT_QUEUE_MAX_ATTEMPTS", "3")]).await;
    let mut c = write.clients().await;
    let mut handlers = Reelay::start_handlers(BIN, &write, &dir.path().join("h"), &env).await;
    let before = now_ms();
    c.user("ana").await;
    let event_id = event_ids(&db).await.remove(0);
    eventually("the first delivery fails", Duration::from_secs(20), || {
        let (db, id) = (db.clone(), event_id.clone());
        async move { row(&db, &id).await.1 == 1 }
    })
    .await;
    let after = now_ms();
    let (status, attempts, available_at) = row(&db, &event_id).await;
    assert_eq!((status.as_str(), attempts), ("pending", 1));
    assert!(
        (before + 5_000..=after + 5_000).contains(&available_at),
        "next try 5 s after the failure: {available_at} in [{before}+5s, {after}+5s]"
    );
    let error = query_strings(&db, &format!("SELECT last_error FROM event_queue WHERE event_id = '{event_id}'")).await;
    assert!(error[0][0].contains("fails on purpose"), "{error:?}");
    // The ledger claim was released, so the retry can claim at once.
    let ledger =
        query_strings(&db, &format!("SELECT COUNT(*) || '' FROM processed_events WHERE event_id = '{event_id}'")).await;
    assert_eq!(ledger[0][0], "0");
    handlers.stop().await;
    write.stop().await;

    // With one attempt allowed, the first failure dead-letters the row.
    let dir = temp_dir();
    let db = dir.path().join("reelay.db");
    let mut write = Reelay::start_write(BIN, &db, &[("EVENT_QUEUE_MAX_ATTEMPTS", "1")]).await;
    let mut c = write.clients().await;
    let mut handlers = Reelay::start_handlers(BIN, &write, &dir.path().join("h"), &env).await;
    c.user("ana").await;
    let event_id = event_ids(&db).await.remove(0);
    eventually("the row is dead-lettered", Duration::from_secs(20), || {
        let (db, id) = (db.clone(), event_id.clone());
        async move { row(&db, &id).await.0 == "dead_lettered" }
    })
    .await;
    assert_eq!(stats(&mut c).await.dead_lettered, 1);
    assert!(write.log_text().contains("outbox row dead-lettered"));
    handlers.stop().await;
    write.stop().await;
}

#[tokio::test]
async fn a_write_service_outage_pauses_consumers_without_spending_attempts() {
    let dir = temp_dir();
    let db = dir.path().join("reelay.db");
    let effects_db = dir.path().join("effects.db");
    // A claim the write service committed just before it was killed never reaches its claimer;
    // the row (or ledger key) comes back when the lease runs out. Leases shorter than the
    // defaults keep that wait inside the test's patience, and longer than the 4 s outage, so a
    // live claim is never taken over (which would legitimately run a handler twice).
    let leases = [("REELAY_OUTBOX_LEASE_MS", "12000"), ("REELAY_LEDGER_LEASE_MS", "12000")];
    let mut write = Reelay::start_write(BIN, &db, &leases).await;
    let mut c = write.clients().await;
    let mut env = probe_env(effects_db.to_str().unwrap(), "probe-a");
    // Long enough for the write service to go down while the handler runs.
    env.push(("REELAY_PROBE_DELAY_MS", "1000"));
    let mut handlers = Reelay::start_handlers(BIN, &write, &dir.path().join("h"), &env).await;
    for i in 0..6 {
        c.user(&format!("user{i}")).await;
    }
    let ids = event_ids(&db).await;
    eventually("the consumer is inside the handlers", Duration::from_secs(20), || {
        let db = db.clone();
        async move { !query_strings(&db, "SELECT 1 FROM processed_events WHERE status = 'in_progress'").await.is_empty() }
    })
    .await;
    // The ledger and the outbox go away while handlers run and consumers poll.
    write.kill();
    tokio::time::sleep(Duration::from_secs(4)).await;
    write.restart().await;
    let mut c = write.clients().await;
    eventually("everything is delivered after the outage", Duration::from_secs(60), || {
        let mut c = c.clone();
        async move {
            let s = stats(&mut c).await;
            s.pending == 0 && s.processing == 0
        }
    })
    .await;
    let s = stats(&mut c).await;
    assert_eq!((s.done as usize, s.dead_lettered), (ids.len(), 0));
    let spent = query_strings(&db, "SELECT CAST(SUM(attempts) AS TEXT) FROM event_queue").await;
    assert_eq!(spent[0][0], "0", "the outage spent no attempt");
    let (counts, _) = effects(&effects_db).await;
    for id in &ids {
        assert_eq!(counts.get(&(id.clone(), "probe-a".to_owned())), Some(&1), "{id}");
    }
    assert!(handlers.log_text().contains("pausing consumption"), "the consumer paused");
    handlers.stop().await;
    write.stop().await;
}

#[tokio::test]
async fn a_done_handler_is_skipped_while_its_sibling_still_runs() {
    let dir = temp_dir();
    let db = dir.path().join("reelay.db");
    let effects_db = dir.path().join("effects.db");
    let mut write = Reelay::start_write(BIN, &db, &[]).await;
    let mut c = write.clients().await;
    c.user("ana").await;
    let event_id = event_ids(&db).await.remove(0);
    // probe-a already finished this event (an earlier delivery); probe-b has not.
    let key = v1::LedgerKey { event_id: event_id.clone(), handler: "probe-a".into() };
    let reply = c.ledger.claim(v1::LedgerClaimRequest { keys: vec![key.clone()] }).await.unwrap().into_inner();
    let Some(v1::ledger_claim::Outcome::AcquiredToken(token)) = reply.claims[0].outcome else { panic!("{reply:?}") };
    let done = c
        .ledger
        .complete(v1::LedgerSettleRequest { keys: vec![v1::OwnedKey { key: Some(key), token }] })
        .await
        .unwrap();
    assert_eq!(done.into_inner().owned, vec![true]);

    let mut handlers = Reelay::start_handlers(
        BIN,
        &write,
        &dir.path().join("h"),
        &probe_env(effects_db.to_str().unwrap(), "probe-a,probe-b"),
    )
    .await;
    eventually("the redelivery completes", Duration::from_secs(20), || {
        let (db, id) = (db.clone(), event_id.clone());
        async move { row(&db, &id).await.0 == "done" }
    })
    .await;
    let (counts, _) = effects(&effects_db).await;
    assert_eq!(counts.get(&(event_id.clone(), "probe-a".to_owned())), None, "the done handler was skipped");
    assert_eq!(counts.get(&(event_id.clone(), "probe-b".to_owned())), Some(&1), "its sibling ran");
    handlers.stop().await;
    write.stop().await;
}
