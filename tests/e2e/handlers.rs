//! Handlers are delivered independently, on both backends: each (event, handler) has its own
//! attempts, retry schedule and fate, so a handler that fails for good, one that fails and
//! recovers, and a slow one never hold back, retry or dead-letter each other. The same
//! scenarios run unchanged on the db backend and on JetStream.

use std::collections::HashMap;
use std::time::Duration;

use reelay_harness::{Backend, Cluster, eventually, outbox_rows, probe_records, query_strings, temp_dir};

const BIN: &str = env!("CARGO_BIN_EXE_reelay");

/// probe-a fails for good on the events of users whose handle has `fail_a` in it; probe-b fails
/// every event twice, then succeeds. probe-b's effects all happen exactly once; probe-a's
/// failures are dead-lettered for probe-a alone, with their error.
async fn failures_stay_with_their_handler(backend: Backend) {
    let dir = temp_dir();
    let cluster = Cluster::builder(BIN, backend)
        .probes("probe-a,probe-b")
        .env("REELAY_PROBE_FAIL", "probe-a=permanent:fail_a,probe-b=times:2")
        .env("EVENT_QUEUE_MAX_ATTEMPTS", "5")
        .env("REELAY_RETRY_BASE_MS", "200")
        .env("REELAY_RETRY_CAP_MS", "1000")
        .handlers(&[])
        .start(dir.path())
        .await;
    let mut c = cluster.write.clients().await;
    let mut refused = Vec::new();
    for i in 0..12 {
        let handle = if i % 4 == 0 { format!("fail_a_{i}") } else { format!("fine_{i}") };
        let user = c.user(&handle).await;
        if i % 4 == 0 {
            refused.push(user);
        }
    }
    let events: Vec<(String, String)> =
        outbox_rows(&cluster.db).await.into_iter().map(|r| (r.event_id.unwrap(), r.aggregate_id)).collect();
    assert_eq!(events.len(), 12);
    eventually("probe-b handles every event after two failures each", Duration::from_secs(60), || {
        let effects = cluster.effects.clone();
        async move { probe_records(&effects, "effects").await.0.keys().filter(|(_, h)| h == "probe-b").count() == 12 }
    })
    .await;
    eventually("probe-a is done with the rest", Duration::from_secs(30), || {
        let effects = cluster.effects.clone();
        async move { probe_records(&effects, "effects").await.0.keys().filter(|(_, h)| h == "probe-a").count() == 9 }
    })
    .await;
    let (effects, _) = probe_records(&cluster.effects, "effects").await;
    let (attempts, _) = probe_records(&cluster.effects, "attempts").await;
    for (event_id, user) in &events {
        let b = (event_id.clone(), "probe-b".to_owned());
        assert_eq!(effects.get(&b), Some(&1), "probe-b's effect on {event_id} exactly once");
        assert_eq!(attempts.get(&b), Some(&3), "two failures, then the success");
        let a = (event_id.clone(), "probe-a".to_owned());
        if refused.contains(user) {
            assert_eq!(effects.get(&a), None, "probe-a refused {event_id}");
            assert_eq!(attempts.get(&a), Some(&1), "a permanent failure is not retried");
        } else {
            assert_eq!(effects.get(&a), Some(&1), "probe-a's effect on {event_id} exactly once");
        }
    }
    // The refusals are dead-lettered for probe-a alone, each with its error, in the ledger on
    // both backends (on nats the consumer terminates them too).
    let refused_events: Vec<&String> = events.iter().filter(|(_, u)| refused.contains(u)).map(|(e, _)| e).collect();
    // The ledger is settled after each effect is recorded.
    eventually("every delivery is settled in the ledger", Duration::from_secs(20), || async {
        let sql = "SELECT COUNT(*) || '' FROM processed_events WHERE status IN ('done', 'dead_lettered')";
        query_strings(&cluster.db, sql).await[0][0] == (21 + refused_events.len()).to_string()
    })
    .await;
    let dead = query_strings(
        &cluster.db,
        "SELECT event_id, handler, last_error FROM processed_events WHERE status = 'dead_lettered' ORDER BY event_id",
    )
    .await;
    assert_eq!(dead.len(), refused_events.len(), "{backend:?}: {dead:?}");
    for row in &dead {
        assert!(refused_events.contains(&&row[0]) && row[1] == "probe-a", "{row:?}");
        assert!(row[2].contains("refuses events"), "the error is kept: {row:?}");
    }
    let done = query_strings(&cluster.db, "SELECT COUNT(*) || '' FROM processed_events WHERE status = 'done'").await;
    assert_eq!(done[0][0], "21", "9 done for probe-a, 12 for probe-b");
    cluster.stop().await;
}

/// probe-a panics on the events of users whose handle has `boom` in it. Its first batch keeps it
/// busy for a second while seven more users are created, so a later batch holds several of them,
/// a panicking one among them: the batch-mates are run again one by one and done, each panicking
/// event spends its own attempts and ends as probe-a's dead letter with the panic's message,
/// probe-b is unaffected, and the handlers process keeps serving. Which events share a batch
/// depends on timing (a slow machine may split the seven), so the batches are read back from the
/// probe's records (one `at_us` per call) rather than assumed.
async fn a_panicking_handler_spends_only_its_events_attempts(backend: Backend) {
    let dir = temp_dir();
    let cluster = Cluster::builder(BIN, backend)
        .probes("probe-a,probe-b")
        .env("REELAY_PROBE_FAIL", "probe-a=panic:boom")
        .env("REELAY_PROBE_DELAY_MS", "probe-a=1000")
        .env("REELAY_CONSUMER_IN_FLIGHT", "1")
        .env("EVENT_QUEUE_MAX_ATTEMPTS", "3")
        .env("REELAY_RETRY_BASE_MS", "200")
        .env("REELAY_RETRY_CAP_MS", "400")
        .handlers(&[])
        .start(dir.path())
        .await;
    let mut callers = Vec::new();
    for i in 0..7 {
        let handle = if i == 2 || i == 5 { format!("boom_{i}") } else { format!("fine_{i}") };
        callers.push((handle, cluster.write.clients().await));
    }
    cluster.write.clients().await.user("first").await;
    futures_util::future::join_all(callers.iter_mut().map(|(handle, c)| c.user(handle))).await;
    let events: Vec<(String, String)> = outbox_rows(&cluster.db)
        .await
        .into_iter()
        .map(|r| (r.event_id.unwrap(), format!("{:?}", r.envelope)))
        .collect();
    assert_eq!(events.len(), 8);
    let booms: Vec<&String> = events.iter().filter(|(_, p)| p.contains("boom")).map(|(e, _)| e).collect();
    assert_eq!(booms.len(), 2);
    let dead_letters = || async {
        query_strings(
            &cluster.db,
            "SELECT event_id, handler, last_error FROM processed_events WHERE status = 'dead_lettered' ORDER BY event_id",
        )
        .await
    };
    eventually("both panicking events end as probe-a's dead letters", Duration::from_secs(60), || async {
        dead_letters().await.len() == 2
    })
    .await;
    for row in dead_letters().await {
        assert!(booms.contains(&&row[0]) && row[1] == "probe-a", "{row:?}");
        assert!(row[2].contains("handler panicked: probe probe-a panics on events with \"boom\""), "{row:?}");
    }
    eventually("probe-a and probe-b are done with the rest", Duration::from_secs(30), || {
        let effects = cluster.effects.clone();
        async move { probe_records(&effects, "effects").await.0.len() == 6 + 8 }
    })
    .await;
    let (effects, _) = probe_records(&cluster.effects, "effects").await;
    let (attempts, _) = probe_records(&cluster.effects, "attempts").await;
    // probe-a's calls: call (its at_us) → the events it held.
    let mut calls: HashMap<String, Vec<String>> = HashMap::new();
    for row in
        query_strings(&cluster.effects, "SELECT event_id, CAST(at_us AS TEXT) FROM attempts WHERE handler = 'probe-a'")
            .await
    {
        calls.entry(row[1].clone()).or_default().push(row[0].clone());
    }
    let panicked_with = |event_id: &String| {
        calls.values().any(|held| held.len() > 1 && held.contains(event_id) && held.iter().any(|e| booms.contains(&e)))
    };
    let mut run_again = 0;
    for (event_id, _) in &events {
        let b = (event_id.clone(), "probe-b".to_owned());
        assert_eq!(effects.get(&b), Some(&1), "probe-b's effect on {event_id} exactly once");
        let a = (event_id.clone(), "probe-a".to_owned());
        if booms.contains(&event_id) {
            assert_eq!(effects.get(&a), None);
            assert!(attempts[&a] >= 3, "every attempt spent on {event_id}: {}", attempts[&a]);
        } else {
            assert_eq!(effects.get(&a), Some(&1), "probe-a's effect on {event_id} exactly once");
            let expected = if panicked_with(event_id) { 2 } else { 1 };
            assert_eq!(attempts[&a], expected, "{event_id} ran in a panicking batch, then alone ({calls:?})");
            if expected == 2 {
                let alone = calls.values().any(|held| held == std::slice::from_ref(event_id));
                assert!(alone, "{event_id} ran again alone ({calls:?})");
                run_again += 1;
            }
        }
    }
    assert!(run_again > 0, "some batch held a panicking event and others ({calls:?})");
    cluster.write.clients().await.user("after").await;
    eventually("the handlers process still handles events", Duration::from_secs(30), || {
        let effects = cluster.effects.clone();
        async move { probe_records(&effects, "effects").await.0.len() == 6 + 8 + 2 }
    })
    .await;
    cluster.stop().await;
}

#[tokio::test]
async fn a_panicking_handler_spends_only_its_events_attempts_on_the_db_backend() {
    a_panicking_handler_spends_only_its_events_attempts(Backend::Db).await;
}

#[tokio::test]
async fn a_panicking_handler_spends_only_its_events_attempts_on_the_nats_backend() {
    a_panicking_handler_spends_only_its_events_attempts(Backend::Nats).await;
}

/// probe-c sleeps 3 s per batch; probe-a, on the same events, is done long before.
async fn a_slow_handler_holds_back_no_other(backend: Backend) {
    let dir = temp_dir();
    let cluster = Cluster::builder(BIN, backend)
        .probes("probe-a,probe-c")
        .env("REELAY_PROBE_DELAY_MS", "probe-c=3000")
        .handlers(&[])
        .start(dir.path())
        .await;
    let mut c = cluster.write.clients().await;
    for i in 0..20 {
        c.user(&format!("user{i}")).await;
    }
    eventually("probe-a handles all 20 events", Duration::from_secs(20), || {
        let effects = cluster.effects.clone();
        async move { probe_records(&effects, "effects").await.0.keys().filter(|(_, h)| h == "probe-a").count() == 20 }
    })
    .await;
    // By the times the effects were recorded (not when this test looked): probe-c had not
    // done them all when probe-a's last was done.
    let slow_done = query_strings(
        &cluster.effects,
        "SELECT COUNT(*) || '' FROM effects WHERE handler = 'probe-c' \
         AND at_us <= (SELECT MAX(at_us) FROM effects WHERE handler = 'probe-a')",
    )
    .await[0][0]
        .parse::<usize>()
        .unwrap();
    assert!(slow_done < 20, "probe-a finished while probe-c was still sleeping ({slow_done} of 20 done)");
    eventually("probe-c catches up", Duration::from_secs(60), || {
        let effects = cluster.effects.clone();
        async move { probe_records(&effects, "effects").await.0.keys().filter(|(_, h)| h == "probe-c").count() == 20 }
    })
    .await;
    let (effects, _) = probe_records(&cluster.effects, "effects").await;
    let counts: HashMap<&str, usize> = effects.iter().fold(HashMap::new(), |mut m, ((_, h), n)| {
        *m.entry(h.as_str()).or_default() += n;
        m
    });
    assert_eq!((counts["probe-a"], counts["probe-c"]), (20, 20), "each effect once");
    cluster.stop().await;
}

#[tokio::test]
async fn failures_stay_with_their_handler_on_the_db_backend() {
    failures_stay_with_their_handler(Backend::Db).await;
}

#[tokio::test]
async fn failures_stay_with_their_handler_on_the_nats_backend() {
    failures_stay_with_their_handler(Backend::Nats).await;
}

#[tokio::test]
async fn a_slow_handler_holds_back_no_other_on_the_db_backend() {
    a_slow_handler_holds_back_no_other(Backend::Db).await;
}

#[tokio::test]
async fn a_slow_handler_holds_back_no_other_on_the_nats_backend() {
    a_slow_handler_holds_back_no_other(Backend::Nats).await;
}
