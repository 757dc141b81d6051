//! The nats backend with a real nats-server: the relay's dedup after a crash, broker outages,
//! stream and consumer reconciliation, max-deliver exhaustion, and replicas sharing a consumer.

use std::collections::HashSet;
use std::path::Path;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, consumer, stream};
use futures_util::StreamExt;
use reelay_contracts::v1;
use reelay_harness::{Clients, NatsServer, Reelay, event_ids, eventually, probe_records, query_strings, temp_dir};

const BIN: &str = env!("CARGO_BIN_EXE_reelay");
const STREAM: &str = "REELAY_EVENTS";

fn nats_env(nats: &NatsServer) -> Vec<(String, String)> {
    vec![
        ("EVENT_BUS_BACKEND".into(), "nats".into()),
        ("NATS_URL".into(), nats.url()),
        ("REELAY_NATS_MONITOR_URL".into(), nats.monitor_url()),
    ]
}

fn with<'a>(base: &'a [(String, String)], extra: &[(&'a str, &'a str)]) -> Vec<(&'a str, &'a str)> {
    base.iter().map(|(k, v)| (k.as_str(), v.as_str())).chain(extra.iter().copied()).collect()
}

async fn start(binary: &str, db: &Path, services: &[&'static str], env: &[(&str, &str)]) -> Reelay {
    Reelay::start(Reelay::spec(binary, db, services, env)).await
}

async fn drained(c: &Clients) -> bool {
    let s = c.clone().outbox.stats(v1::StatsRequest {}).await.unwrap().into_inner();
    s.pending == 0 && s.processing == 0
}

/// Every message in the stream: (sequence, Nats-Msg-Id).
async fn stream_messages(url: &str) -> Vec<(u64, String)> {
    let js = jetstream::new(async_nats::connect(url).await.unwrap());
    let mut stream = js.get_stream(STREAM).await.unwrap();
    let last = stream.info().await.unwrap().state.last_sequence;
    let mut out = Vec::new();
    for seq in 1..=last {
        if let Ok(message) = stream.get_raw_message(seq).await {
            let id = message.headers.get("Nats-Msg-Id").map(|v| v.as_str().to_owned()).unwrap_or_default();
            out.push((seq, id));
        }
    }
    out
}

#[tokio::test]
async fn a_relay_killed_between_puback_and_mark_done_republishes_into_one_message_per_event() {
    let dir = temp_dir();
    let nats = NatsServer::start(&dir.path().join("nats"));
    let env = nats_env(&nats);
    let db = dir.path().join("reelay.db");
    let mut write = Reelay::start_write(BIN, &db, &with(&env, &[("REELAY_OUTBOX_LEASE_MS", "1000")])).await;
    let mut c = write.clients().await;
    for i in 0..25 {
        c.user(&format!("user{i}")).await;
    }
    let ids: HashSet<String> = event_ids(&db).await.into_iter().collect();

    // The first relay publishes everything, gets the PubAcks, and dies before marking done.
    let mut relay_env = with(&env, &[("REELAY_FAILPOINTS", "relay_after_puback")]);
    let write_url = format!("http://{}", write.addr);
    relay_env.push(("REELAY_WRITE_URL", &write_url));
    let mut crashing = start(BIN, &dir.path().join("r1/x.db"), &["relay"], &relay_env).await;
    eventually("the first relay crashes after its PubAcks", Duration::from_secs(20), || {
        let log = crashing.log_text();
        async move { log.contains("failpoint relay_after_puback") }
    })
    .await;
    crashing.kill();
    assert_eq!(stream_messages(&nats.url()).await.len(), ids.len(), "everything reached the stream once");
    let stats = c.outbox.stats(v1::StatsRequest {}).await.unwrap().into_inner();
    assert_eq!(stats.done, 0, "nothing was marked done");

    // A new relay reclaims the rows after the lease and publishes them again.
    let relay_env: Vec<(&str, &str)> = with(&env, &[("REELAY_WRITE_URL", &write_url)]);
    let mut relay = start(BIN, &dir.path().join("r2/x.db"), &["relay"], &relay_env).await;
    eventually("the republished rows are marked done", Duration::from_secs(30), || drained(&c)).await;
    let messages = stream_messages(&nats.url()).await;
    let distinct: HashSet<String> = messages.iter().map(|(_, id)| id.clone()).collect();
    assert_eq!(messages.len(), ids.len(), "the broker dropped every duplicate");
    assert_eq!(distinct, ids, "one message per event id");
    assert!(relay.log_text().contains("duplicate PubAck"), "{}", relay.log_text());

    // The write service goes away: the relay's pauses grow (0.2 s, doubling). Stopped during
    // a 25.6 s one (its 8th), it stops at once, not when the pause ends.
    write.stop().await;
    eventually("the relay's pauses have grown", Duration::from_secs(60), || {
        let log = relay.log_text();
        async move { log.matches("cannot claim outbox rows; pausing").count() >= 8 }
    })
    .await;
    let stopping = std::time::Instant::now();
    relay.stop().await;
    assert!(stopping.elapsed() < Duration::from_secs(10), "stopped after {:?}", stopping.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_outage_loses_nothing_and_spends_no_attempt() {
    let dir = temp_dir();
    let mut nats = NatsServer::start(&dir.path().join("nats"));
    let env = nats_env(&nats);
    let db = dir.path().join("reelay.db");
    let effects_db = dir.path().join("effects.db");
    let effects_path = effects_db.to_str().unwrap().to_owned();
    let all_env = with(&env, &[("REELAY_PROBE_DB", &effects_path), ("REELAY_PROBE_HANDLERS", "probe-a,probe-b")]);
    let mut reelay = Reelay::start_all(BIN, &db, &all_env).await;
    let c = reelay.clients().await;

    // Steady writes for the whole test; every one must succeed.
    let writer = {
        let mut c = c.clone();
        tokio::spawn(async move {
            let started = Instant::now();
            let mut n = 0;
            while started.elapsed() < Duration::from_secs(12) {
                c.users
                    .create_user(v1::CreateUserRequest {
                        handle: format!("u{n}"),
                        display_name: "U".into(),
                        ..Default::default()
                    })
                    .await
                    .expect("writes succeed while the broker is down");
                n += 1;
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            n
        })
    };
    tokio::time::sleep(Duration::from_secs(1)).await;
    // Down for longer than the relay's 5 s wait for a PubAck: publishes made early in the outage
    // time out whatever the client buffers, so the deferral path is taken in every run (a shorter
    // outage can end with every buffered publish acknowledged and nothing deferred).
    nats.kill();
    tokio::time::sleep(Duration::from_secs(6)).await;
    nats.restart();
    tokio::time::sleep(Duration::from_secs(1)).await;
    nats.pause();
    tokio::time::sleep(Duration::from_secs(3)).await;
    nats.resume();
    let written = writer.await.unwrap();
    assert!(written > 100, "{written} writes");

    let ids = event_ids(&db).await;
    assert_eq!(ids.len(), written);
    eventually("every event reaches both probes after the outages", Duration::from_secs(90), || {
        let (effects_db, expected) = (effects_db.clone(), ids.len() * 2);
        async move { probe_records(&effects_db, "effects").await.0.len() == expected }
    })
    .await;
    eventually("the outbox is drained", Duration::from_secs(30), || drained(&c)).await;
    let (counts, _) = probe_records(&effects_db, "effects").await;
    assert!(counts.values().all(|n| *n == 1), "an effect happened twice");
    let outbox = query_strings(
        &db,
        "SELECT CAST(SUM(attempts) AS TEXT), CAST(SUM(status = 'dead_lettered') AS TEXT) FROM event_queue",
    )
    .await;
    assert_eq!(outbox[0], ["0", "0"], "no attempt spent, nothing dead-lettered");
    let deferred = reelay.metrics().await.value("reelay_relay_deferred_total").unwrap_or(0.0);
    assert!(deferred > 0.0, "the outage was felt: rows were deferred ({deferred})");
    reelay.stop().await;
}

/// The ledger (the write service) goes down while probe-a's process holds an event it fetched (its
/// claim held on the way, until the kill): every claim after fails at once (connection refused),
/// and the batch waits in pauses of at most 5 s, for longer than the 16 s ack wait. Its progress is
/// reported every third of the ack wait across those calls (before, each call started its own
/// schedule and none lasted a third, so JetStream delivered the event again at each ack wait,
/// spending its deliveries through an outage). Once the ledger is back the event is handled,
/// delivered once.
#[tokio::test]
async fn a_ledger_outage_spends_no_delivery_of_the_events_held() {
    let dir = temp_dir();
    let mut cluster = reelay_harness::Cluster::builder(BIN, reelay_harness::Backend::Nats)
        .probes("probe-a")
        .env("REELAY_ACK_WAIT_MS", "16000")
        .env("REELAY_LEDGER_LEASE_MS", "600000")
        .start(dir.path())
        .await;
    // Ten-minute leases: the idle worker tells its build only every 150 s, so its pulls stay
    // out through the outage (the broker redelivers only to a pull).
    let extra = [("REELAY_ACK_WAIT_MS", "16000"), ("REELAY_LEDGER_LEASE_MS", "600000")];
    let (proxy, mut handlers, mut c, warm) = probe_a_behind_a_proxy(&cluster, dir.path(), &extra).await;
    // The next event's claim is held on its way, then the write service dies under it.
    proxy.partition();
    c.user("ana").await;
    let event_id = event_ids(&cluster.db).await.into_iter().find(|id| *id != warm).unwrap();
    let js = jetstream::new(async_nats::connect(cluster.nats.as_ref().unwrap().url()).await.unwrap());
    let consumer = || async {
        let stream = js.get_stream(STREAM).await.unwrap();
        stream.consumer_info("handler-probe-a").await.unwrap().clone()
    };
    eventually("probe-a's process fetched the event", Duration::from_secs(20), || async {
        consumer().await.num_ack_pending == 1
    })
    .await;
    cluster.write.kill();
    tokio::time::sleep(Duration::from_secs(20)).await;
    cluster.write.restart().await;
    proxy.heal();
    eventually("the event is handled once the ledger is back", Duration::from_secs(30), || async {
        ledger_row(&cluster.db, &event_id, "probe-a").await.is_some_and(|r| r[0] == "done")
    })
    .await;
    let delivered = consumer().await.delivered.consumer_sequence;
    assert_eq!(delivered, 2, "each event delivered once");
    let key = (event_id, "probe-a".to_owned());
    assert_eq!(probe_records(&cluster.effects, "effects").await.0.get(&key), Some(&1));
    handlers.stop().await;
    cluster.stop().await;
}

/// An event stream made with another retention than limits (interest: a message goes once the
/// consumers there acked it, so a handler that starts later, or a given-up message's dead letter,
/// finds nothing) cannot be changed in place: the relay refuses to start and says what to do.
#[tokio::test]
async fn an_event_stream_without_limits_retention_is_refused_at_start() {
    let dir = temp_dir();
    let nats = NatsServer::start(&dir.path().join("nats"));
    let js = jetstream::new(async_nats::connect(nats.url()).await.unwrap());
    js.create_stream(stream::Config {
        name: STREAM.into(),
        subjects: vec!["reelay.events.>".into()],
        retention: stream::RetentionPolicy::Interest,
        ..Default::default()
    })
    .await
    .unwrap();
    let env = nats_env(&nats);
    let mut env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    env.push(("REELAY_WRITE_URL", "http://127.0.0.1:9"));
    let data = dir.path().join("relay");
    let (code, stderr) =
        reelay_harness::refused_at_start(Path::new(BIN), "relay", &data.join("x.db"), &data, &env).await;
    assert_ne!(code, Some(0), "{stderr}");
    assert!(stderr.contains("its retention is Interest; Reelay needs limits retention"), "{stderr}");
}

#[tokio::test]
async fn an_existing_stream_and_consumer_are_updated_in_place() {
    let dir = temp_dir();
    let nats = NatsServer::start(&dir.path().join("nats"));
    let js = jetstream::new(async_nats::connect(nats.url()).await.unwrap());
    // As an older deployment left them: the 2-minute default window, old consumer limits, and
    // fields an operator set by hand.
    js.create_stream(stream::Config {
        name: STREAM.into(),
        // Narrower than every subject the relay publishes (a replay's has more tokens), with one
        // of the operator's own.
        subjects: vec!["reelay.events.*".into(), "ops.audit".into()],
        storage: stream::StorageType::File,
        duplicate_window: Duration::from_secs(120),
        max_messages: 1_000_000,
        max_messages_per_subject: 100_000,
        description: Some("set by ops".into()),
        ..Default::default()
    })
    .await
    .unwrap();
    let stream = js.get_stream(STREAM).await.unwrap();
    stream
        .create_consumer(consumer::pull::Config {
            durable_name: Some("handler-probe-a".into()),
            description: Some("ops consumer".into()),
            filter_subjects: vec!["reelay.events.UserRegistered".into()],
            ack_policy: consumer::AckPolicy::Explicit,
            max_deliver: 3,
            ack_wait: Duration::from_secs(10),
            max_waiting: 77,
            max_ack_pending: 5,
            ..Default::default()
        })
        .await
        .unwrap();

    let db = dir.path().join("reelay.db");
    let mut write = Reelay::start_write(BIN, &db, &[]).await;
    let env = nats_env(&nats);
    let write_url = format!("http://{}", write.addr);
    let effects = dir.path().join("effects.db");
    let effects = effects.to_str().unwrap();
    let handler_env = with(
        &env,
        &[
            ("REELAY_WRITE_URL", &write_url),
            ("REELAY_HANDLERS", "probe-a"),
            ("REELAY_PROBE_HANDLERS", "probe-a"),
            ("REELAY_PROBE_DB", effects),
            ("EVENT_QUEUE_MAX_ATTEMPTS", "5"),
            ("REELAY_ACK_WAIT_MS", "20000"),
        ],
    );
    let mut handlers = start(BIN, &dir.path().join("h/x.db"), &["handlers"], &handler_env).await;

    let mut stream = js.get_stream(STREAM).await.unwrap();
    let config = stream.info().await.unwrap().config.clone();
    assert_eq!(config.subjects, ["ops.audit", "reelay.events.>"], "every event subject, the operator's kept");
    assert_eq!(config.duplicate_window, Duration::from_secs(3600));
    assert_eq!(
        (config.max_messages, config.description.as_deref()),
        (1_000_000, Some("set by ops")),
        "operator fields kept"
    );
    assert_eq!(config.discard, stream::DiscardPolicy::New, "at its limit the stream refuses, it does not drop");
    assert_eq!(config.max_messages_per_subject, 100_000, "operator's limit kept");
    assert!(config.discard_new_per_subject, "at a subject's limit too (else the broker drops its oldest)");
    let mut consumer: consumer::PullConsumer = stream.get_consumer("handler-probe-a").await.unwrap();
    let config = consumer.info().await.unwrap().config.clone();
    assert_eq!((config.max_deliver, config.ack_wait), (5, Duration::from_secs(20)));
    assert_eq!(config.max_ack_pending, 10_000, "REELAY_MAX_ACK_PENDING's default");
    assert_eq!((config.max_waiting, config.description.as_deref()), (77, Some("ops consumer")), "operator fields kept");
    // The operator's subject is kept, and what this build's handler takes is added: the event
    // types the old filter lacked (they would never reach it) and its replay subject.
    let subjects = &config.filter_subjects;
    assert_eq!(subjects[0], "reelay.events.UserRegistered", "{subjects:?}");
    for wanted in ["reelay.events.ReviewLogged", "reelay.events.MovieEnriched", "reelay.events.replay.probe-a.*"] {
        assert_eq!(subjects.iter().filter(|s| *s == wanted).count(), 1, "{wanted} in {subjects:?}");
    }
    assert_eq!(subjects.iter().filter(|s| *s == "reelay.events.UserRegistered").count(), 1, "{subjects:?}");
    let log = handlers.log_text();
    assert!(
        log.contains("updated the existing stream's duplicate_window, replicas, discard policy and subjects in place"),
        "{log}"
    );
    assert!(
        log.contains("updated the existing consumer's max_deliver, ack_wait, max_ack_pending and subjects in place"),
        "{log}"
    );
    handlers.stop().await;
    write.stop().await;
}

#[tokio::test]
async fn a_handler_that_always_fails_stops_after_max_deliver_on_the_backoff_schedule() {
    let dir = temp_dir();
    let nats = NatsServer::start(&dir.path().join("nats"));
    let client = async_nats::connect(nats.url()).await.unwrap();
    let mut advisories =
        client.subscribe(format!("$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{STREAM}.handler-probe-a")).await.unwrap();
    let env = nats_env(&nats);
    let effects_db = dir.path().join("effects.db");
    let effects = effects_db.to_str().unwrap();
    let all_env = with(
        &env,
        &[
            ("REELAY_PROBE_HANDLERS", "probe-a"),
            ("REELAY_PROBE_DB", effects),
            ("REELAY_PROBE_FAIL", "1"),
            ("EVENT_QUEUE_MAX_ATTEMPTS", "3"),
            ("REELAY_RETRY_BASE_MS", "400"),
        ],
    );
    let db = dir.path().join("reelay.db");
    let mut reelay = Reelay::start_all(BIN, &db, &all_env).await;
    let mut c = reelay.clients().await;
    c.user("ana").await;
    let event_id = event_ids(&db).await.remove(0);

    let advisory =
        tokio::time::timeout(Duration::from_secs(30), advisories.next()).await.expect("the max-deliveries advisory");
    let advisory = String::from_utf8_lossy(&advisory.unwrap().payload).into_owned();
    assert!(advisory.contains("handler-probe-a") && advisory.contains("\"deliveries\":3"), "{advisory}");
    let when = query_strings(
        &db.with_file_name("effects.db"),
        &format!("SELECT CAST(at AS TEXT) FROM attempts WHERE event_id = '{event_id}' ORDER BY at"),
    )
    .await;
    let at: Vec<i64> = when.iter().map(|r| r[0].parse().unwrap()).collect();
    assert_eq!(at.len(), 3, "three deliveries: {at:?}");
    assert!(at[1] - at[0] >= 400, "the second delivery waited retry_backoff(1): {at:?}");
    assert!(at[2] - at[1] >= 800, "the third waited retry_backoff(2): {at:?}");
    let log = reelay.log_text();
    let exhausted =
        log.lines().find(|l| l.contains("event exhausted max deliveries")).expect("the exhaustion is logged");
    assert!(exhausted.contains("ERROR") && exhausted.contains(&event_id), "{exhausted}");
    // No fourth delivery.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(probe_records(&effects_db, "attempts").await.0.values().sum::<usize>(), 3);
    assert!(probe_records(&effects_db, "effects").await.0.is_empty());
    reelay.stop().await;
}

/// probe-a's dependency is down (it says so while a file exists) for four ack waits, long past
/// the two deliveries the event has: the event is held (its progress reported, so JetStream
/// does not deliver it again), tried again with a backoff, and once the dependency is back it is
/// handled: delivered once, nothing dead-lettered.
#[tokio::test]
async fn a_handler_dependency_outage_spends_no_delivery() {
    let dir = temp_dir();
    let nats = NatsServer::start(&dir.path().join("nats"));
    let env = nats_env(&nats);
    let effects_db = dir.path().join("effects.db");
    let down = dir.path().join("probe-a-dependency-down");
    std::fs::write(&down, b"").unwrap();
    let rule = format!("probe-a=unavailable:{}", down.display());
    let all_env = with(
        &env,
        &[
            ("REELAY_PROBE_HANDLERS", "probe-a"),
            ("REELAY_PROBE_DB", effects_db.to_str().unwrap()),
            ("REELAY_PROBE_FAIL", &rule),
            ("REELAY_ACK_WAIT_MS", "2000"),
            ("EVENT_QUEUE_MAX_ATTEMPTS", "2"),
            ("REELAY_RETRY_BASE_MS", "100"),
        ],
    );
    let db = dir.path().join("reelay.db");
    let mut reelay = Reelay::start_all(BIN, &db, &all_env).await;
    let mut c = reelay.clients().await;
    c.user("ana").await;
    let event_id = event_ids(&db).await.remove(0);
    let key = (event_id.clone(), "probe-a".to_owned());
    eventually("probe-a is told its dependency is down, twice", Duration::from_secs(20), || async {
        probe_records(&effects_db, "attempts").await.0.get(&key).is_some_and(|n| *n >= 2)
    })
    .await;
    let held = reelay.metrics().await.value(r#"reelay_handler_events_held_for_dependency{handler="probe-a"}"#);
    assert_eq!(held, Some(1.0));
    tokio::time::sleep(Duration::from_secs(8)).await;
    assert!(probe_records(&effects_db, "effects").await.0.is_empty());
    std::fs::remove_file(&down).unwrap();
    eventually("the event is handled once the dependency is back", Duration::from_secs(60), || async {
        probe_records(&effects_db, "effects").await.0.get(&key) == Some(&1)
    })
    .await;
    let js = jetstream::new(async_nats::connect(nats.url()).await.unwrap());
    let stream = js.get_stream(STREAM).await.unwrap();
    let consumer = stream.consumer_info("handler-probe-a").await.unwrap().clone();
    let events = event_ids(&db).await.len() as u64;
    assert_eq!(consumer.delivered.consumer_sequence, events, "each event delivered once");
    assert_eq!(reelay_harness::dead_letters(&db, true).await, 0);
    let held = reelay.metrics().await.value(r#"reelay_handler_events_held_for_dependency{handler="probe-a"}"#);
    assert_eq!(held, Some(0.0));
    reelay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_of_a_handler_share_its_consumer_and_apply_each_effect_once() {
    let dir = temp_dir();
    let nats = NatsServer::start(&dir.path().join("nats"));
    let env = nats_env(&nats);
    let db = dir.path().join("reelay.db");
    let mut write = Reelay::start_write(BIN, &db, &with(&env, &[])).await;
    let write_url = format!("http://{}", write.addr);
    let effects_db = dir.path().join("effects.db");
    let effects = effects_db.to_str().unwrap();
    let relay_env = with(&env, &[("REELAY_WRITE_URL", &write_url)]);
    let mut relay = start(BIN, &dir.path().join("relay/x.db"), &["relay"], &relay_env).await;
    let replica_env = with(
        &env,
        &[
            ("REELAY_WRITE_URL", &write_url),
            ("REELAY_HANDLERS", "probe-a"),
            ("REELAY_PROBE_HANDLERS", "probe-a"),
            ("REELAY_PROBE_DB", effects),
            ("REELAY_CONSUMER_BATCH", "8"),
        ],
    );
    let mut one = start(BIN, &dir.path().join("one/x.db"), &["handlers"], &replica_env).await;
    let mut two = start(BIN, &dir.path().join("two/x.db"), &["handlers"], &replica_env).await;

    let c = write.clients().await;
    let mut tasks = Vec::new();
    for w in 0..4 {
        let mut c = c.clone();
        tasks.push(tokio::spawn(async move {
            for i in 0..150 {
                c.users
                    .create_user(v1::CreateUserRequest {
                        handle: format!("w{w}_{i}"),
                        display_name: "W".into(),
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
    eventually("every event is handled", Duration::from_secs(60), || {
        let (effects_db, expected) = (effects_db.clone(), ids.len());
        async move { probe_records(&effects_db, "effects").await.0.len() == expected }
    })
    .await;
    // Every message settled: nothing is left to run again.
    let url = nats.url();
    eventually("the consumer has every message acked", Duration::from_secs(30), || consumers_idle(&url)).await;
    let (counts, pids) = probe_records(&effects_db, "effects").await;
    assert_eq!(counts.len(), ids.len());
    assert!(counts.values().all(|n| *n == 1), "an effect happened twice");
    assert_eq!(pids.len(), 2, "both replicas took part");
    one.stop().await;
    two.stop().await;
    relay.stop().await;
    write.stop().await;
}

#[tokio::test]
async fn core_nats_mode_delivers_to_live_subscribers() {
    let dir = temp_dir();
    let nats = NatsServer::start(&dir.path().join("nats"));
    let env = nats_env(&nats);
    let effects_db = dir.path().join("effects.db");
    let effects = effects_db.to_str().unwrap();
    let all_env =
        with(&env, &[("NATS_MODE", "core"), ("REELAY_PROBE_HANDLERS", "probe-a"), ("REELAY_PROBE_DB", effects)]);
    let db = dir.path().join("reelay.db");
    let mut reelay = Reelay::start_all(BIN, &db, &all_env).await;
    let c = reelay.clients().await;
    let mut writer = c.clone();
    for i in 0..20 {
        writer.user(&format!("user{i}")).await;
    }
    let ids = event_ids(&db).await;
    eventually("live subscribers get every event", Duration::from_secs(30), || {
        let (effects_db, expected) = (effects_db.clone(), ids.len());
        async move { probe_records(&effects_db, "effects").await.0.len() == expected }
    })
    .await;
    eventually("rows are marked done after the flush", Duration::from_secs(10), || drained(&c)).await;
    reelay.stop().await;
}

/// Many handlers' consumers claim through the Ledger at once: of concurrent requests naming a
/// key, from either owner, exactly one acquires it, completing settles each key once, and a
/// later claim finds every key done.
#[tokio::test]
async fn concurrent_ledger_claims_acquire_each_key_once() {
    let dir = temp_dir();
    let mut write = Reelay::start_write(BIN, &dir.path().join("reelay.db"), &[]).await;
    let c = write.clients().await;
    let events: Vec<String> = (0..6).map(|i| format!("00000000-0000-4000-8000-{i:012}")).collect();
    let key = |i: usize| v1::LedgerKey { event_id: events[i % 6].clone(), handler: format!("h{}", i % 4) };
    for round in 0..3 {
        // 48 requests at once, each naming 3 of 24 keys, from two owners.
        let calls = (0..48).map(|r| {
            let mut c = c.clone();
            let keys: Vec<v1::LedgerKey> = (0..3).map(|k| key((r * 7 + k * 5) % 24)).collect();
            let owner = format!("owner{}#1", r % 2);
            async move {
                c.ledger
                    .claim(v1::LedgerClaimRequest { keys, owner, ..Default::default() })
                    .await
                    .unwrap()
                    .into_inner()
                    .claims
            }
        });
        let answers = futures_util::future::join_all(calls).await;
        let mut acquired: Vec<v1::OwnedKey> = Vec::new();
        let mut named = HashSet::new();
        for claim in answers.into_iter().flatten() {
            let k = claim.key.clone().unwrap();
            named.insert((k.event_id.clone(), k.handler.clone()));
            match claim.outcome.unwrap() {
                v1::ledger_claim::Outcome::AcquiredToken(token) => {
                    acquired.push(v1::OwnedKey { key: claim.key, token })
                }
                v1::ledger_claim::Outcome::Done(_) => assert!(round > 0, "nothing is done before the first completion"),
                v1::ledger_claim::Outcome::HeldUntilMs(_) => assert_eq!(round, 0, "held only while claimed"),
            }
        }
        let distinct: HashSet<(String, String)> =
            acquired.iter().map(|o| (o.key.clone().unwrap().event_id, o.key.clone().unwrap().handler)).collect();
        assert_eq!(distinct.len(), acquired.len(), "a key was acquired twice at once: {acquired:?}");
        if round == 0 {
            assert_eq!(distinct, named, "every key named is acquired by one request");
            // Complete them in concurrent calls of one key each.
            let calls = acquired.into_iter().map(|owned| {
                let mut c = c.clone();
                async move {
                    c.ledger.complete(v1::LedgerSettleRequest { keys: vec![owned] }).await.unwrap().into_inner().owned
                }
            });
            let owned: Vec<bool> = futures_util::future::join_all(calls).await.into_iter().flatten().collect();
            assert!(owned.iter().all(|o| *o), "{owned:?}");
        } else {
            assert!(acquired.is_empty(), "done keys are not acquired again: {acquired:?}");
        }
    }
    write.stop().await;
}

/// A relay waiting for outbox rows has its claim written in the same commit as the event it is
/// handed: one batch for the write and the claim, no claim job of its own, and the row is
/// claimed by the relay that waited.
#[tokio::test]
async fn a_waiting_relay_claim_is_written_with_the_event_it_is_handed() {
    let dir = temp_dir();
    let db = dir.path().join("reelay.db");
    // The write service alone: the test is the relay. No purge while batches are counted.
    let env = [("EVENT_BUS_BACKEND", "nats"), ("REELAY_LEDGER_PURGE_INTERVAL_MS", "3600000")];
    let mut write = Reelay::start_write(BIN, &db, &env).await;
    let mut c = write.clients().await;
    let ana = c.user("ana").await;
    crate::key_pairs_stored(&db, 1).await;
    let claim =
        |wait_ms: u32| v1::ClaimRequest { consumer: "relay#1".into(), max_rows: 100, wait_ms, ..Default::default() };
    // Take what is due (ana's registration), so the next claim waits.
    let before = c.outbox.claim(claim(0)).await.unwrap().into_inner().rows;
    assert!(!before.is_empty(), "ana's registration is due");
    let mut outbox = c.outbox.clone();
    let waiting = tokio::spawn(async move { outbox.claim(claim(20_000)).await });
    crate::claims_waiting(&write, 1.0).await;
    let (batches, claim_jobs) = crate::batches_and_jobs(&write, "outbox_claim").await;

    c.review(&ana, reelay_harness::movie_ref("Heat", 1995), 9).await;
    let rows = waiting.await.unwrap().expect("the waiting claim is answered").into_inner().rows;
    let types: Vec<&str> = rows.iter().map(|r| r.event_type.as_str()).collect();
    assert!(types.contains(&"ReviewLogged"), "the review's event is handed over: {types:?}");
    for row in &rows {
        let held = query_strings(
            &db,
            &format!("SELECT status, claimed_by, claimed_at || '' FROM event_queue WHERE id = {}", row.id),
        )
        .await;
        assert_eq!(held, [["processing", "relay#1", &row.claimed_at_ms.to_string()]], "row {}", row.id);
    }
    assert_eq!(
        crate::batches_and_jobs(&write, "outbox_claim").await,
        (batches + 1.0, claim_jobs),
        "the write and the claim: one batch, no claim job of its own"
    );
    crate::claims_waiting(&write, 0.0).await;
    write.stop().await;
}

/// The dispatchers of one process claim in the ledger together: claims asked at the same time
/// go out as one Ledger call, and each asker hears the answers for its own keys, in its order.
#[tokio::test]
async fn ledger_claims_asked_together_go_out_as_one_call() {
    let dir = temp_dir();
    let mut write = Reelay::start_write(BIN, &dir.path().join("reelay.db"), &[]).await;
    let mut c = write.clients().await;
    let url = format!("http://{}", write.addr);
    let channel = reelay_kit::client::connect_lazy(&url, Some(reelay_harness::TEST_TOKEN), Duration::from_secs(10))
        .expect("a valid URL");
    let claims = reelay_delivery::dispatch::LedgerClaims::start(channel, "test#1".into());
    let events = ["00000000-0000-4000-8000-000000000001", "00000000-0000-4000-8000-000000000002"];
    let handlers: Vec<String> = (0..8).map(|h| format!("h{h}")).collect();
    let keys_of = |handler: &str| -> Vec<v1::LedgerKey> {
        events.iter().map(|e| v1::LedgerKey { event_id: (*e).into(), handler: handler.into() }).collect()
    };
    let calls =
        |m: &reelay_harness::Metrics| m.sum("reelay_grpc_requests_total", &[r#"method="/reelay.v1.Ledger/Claim""#]);
    // Each asker takes its pairs in the process's hand, then asks for those it has alone.
    let ask = |handler: &str| {
        let taken = claims.take(keys_of(handler));
        let claims = claims.clone();
        async move { (claims.claim(&taken, Vec::new()).await.expect("the ledger answers"), taken) }
    };
    let before = calls(&write.metrics().await);
    let answers = futures_util::future::join_all(handlers.iter().map(|h| ask(h))).await;
    assert_eq!(calls(&write.metrics().await) - before, 1.0, "eight asks, one call");
    let (mut held, mut in_hand) = (Vec::new(), Vec::new());
    for (handler, ((answer, granted), taken)) in handlers.iter().zip(answers) {
        in_hand.push(taken);
        assert_eq!(granted, Some(Duration::from_secs(30)), "the answer's lease (the default), for the claims it made");
        let keys: Vec<v1::LedgerKey> = answer.claims.iter().map(|c| c.key.clone().unwrap()).collect();
        assert_eq!(keys, keys_of(handler), "each asker gets its own keys back, in order");
        for claim in answer.claims {
            match claim.outcome.unwrap() {
                v1::ledger_claim::Outcome::AcquiredToken(token) => held.push(v1::OwnedKey { key: claim.key, token }),
                other => panic!("{handler}: expected a fresh claim, got {other:?}"),
            }
        }
    }
    // h0's claims are completed and leave the hand; asked again together, h0's keys are done,
    // and the others, still in the first asks' hand, are not asked of the ledger at all.
    let h0: Vec<v1::OwnedKey> = held.iter().take(2).cloned().collect();
    c.ledger.complete(v1::LedgerSettleRequest { keys: h0 }).await.unwrap();
    drop(in_hand.remove(0));
    let before = calls(&write.metrics().await);
    let again = futures_util::future::join_all(handlers.iter().map(|h| ask(h))).await;
    assert_eq!(calls(&write.metrics().await) - before, 1.0, "only h0 asks");
    for (handler, ((answer, _), taken)) in handlers.iter().zip(again) {
        let alone = handler == "h0";
        assert_eq!(taken.alone(), [alone, alone], "{handler}");
        assert_eq!(answer.claims.len(), if alone { 2 } else { 0 }, "{handler}: {answer:?}");
        for claim in answer.claims {
            assert!(matches!(claim.outcome.unwrap(), v1::ledger_claim::Outcome::Done(_)), "{handler}");
        }
    }
    // Once no ask of this process has them in hand (their answers as good as lost), its own
    // live claims are handed back with their first tokens.
    drop(in_hand);
    let resumed = futures_util::future::join_all(handlers.iter().map(|h| ask(h))).await;
    let tokens: Vec<v1::OwnedKey> = resumed
        .into_iter()
        .flat_map(|((answer, _), _)| answer.claims)
        .filter_map(|claim| match claim.outcome.unwrap() {
            v1::ledger_claim::Outcome::AcquiredToken(token) => Some(v1::OwnedKey { key: claim.key, token }),
            _ => None,
        })
        .collect();
    assert_eq!(tokens, held[2..], "h1..h7 handed back, h0 done");
    // What was taken is asked for once.
    let taken = claims.take(keys_of("h8"));
    claims.claim(&taken, Vec::new()).await.expect("the first ask");
    let again = claims.claim(&taken, Vec::new()).await.expect_err("a second ask of the same pairs");
    assert_eq!(again.code(), tonic::Code::FailedPrecondition, "{again:?}");
    write.stop().await;
}

/// The broker's store fills up (its disk, a 2 MB tmpfs, holds what JetStream reserves from it):
/// JetStream refuses publishes with 503 "insufficient resources". That is the broker's outage,
/// not the events' fault: the relay defers the rows and pauses, spending no attempt (two attempts
/// and 100 ms retries here would dead-letter them in a second), and once the stream is purged
/// (what the handler already took) every event is published and handled.
#[tokio::test]
async fn a_broker_out_of_storage_spends_no_attempt() {
    let dir = temp_dir();
    let _broker_disk = reelay_harness::Tmpfs::mount(&dir.path().join("nats"), "2m");
    out_of_storage(&dir, "").await;
}

/// The same with the account's JetStream storage limit reached (a hosted or shared NATS), which
/// JetStream answers with 400 "resource limits exceeded for account".
#[tokio::test]
async fn an_account_out_of_storage_spends_no_attempt() {
    let dir = temp_dir();
    let account = "accounts {\n  APP {\n    jetstream { max_file: 2M, max_mem: 1M }\n    \
                   users [ { user: app, password: app } ]\n  }\n}\nno_auth_user: app\n";
    out_of_storage(&dir, account).await;
}

async fn out_of_storage(dir: &tempfile::TempDir, nats_config: &str) {
    let cluster = reelay_harness::Cluster::builder(BIN, reelay_harness::Backend::Nats)
        .nats_config(nats_config)
        .probes("probe-a")
        .env("EVENT_QUEUE_MAX_ATTEMPTS", "2")
        .env("REELAY_RETRY_BASE_MS", "100")
        .env("REELAY_RETRY_CAP_MS", "200")
        .handlers(&[])
        .start(dir.path())
        .await;
    let mut c = cluster.write.clients().await;
    let ana = c.user("ana").await;
    let body = "a long review of a long film ".repeat(300);
    for _ in 0..300 {
        c.review_with_text(&ana, reelay_harness::movie_ref("Heat", 1995), 8, &body).await;
    }
    let relay = cluster.relay.as_ref().expect("a relay on nats");
    eventually("the broker refuses and the relay defers", Duration::from_secs(30), || async {
        relay.metrics().await.value("reelay_relay_deferred_total") > Some(0.0)
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let spent = query_strings(
        &cluster.db,
        "SELECT COUNT(*) || '', COALESCE(SUM(attempts), 0) || '', \
             (SELECT COUNT(*) FROM event_queue WHERE status = 'dead_lettered') || '' \
         FROM event_queue WHERE status <> 'done'",
    )
    .await;
    assert_ne!(spent[0][0], "0", "some rows wait for the broker");
    assert_eq!(spent[0][1..], ["0", "0"], "no attempt spent, nothing dead-lettered: {spent:?}");

    // Make room: drop what the handler already took, then everything goes through.
    let url = cluster.nats.as_ref().unwrap().url();
    eventually("probe-a took everything published", Duration::from_secs(30), || consumers_idle(&url)).await;
    let js = jetstream::new(async_nats::connect(url).await.unwrap());
    js.get_stream(STREAM).await.unwrap().purge().await.unwrap();
    let events: HashSet<String> = event_ids(&cluster.db).await.into_iter().collect();
    eventually("every event is published and handled once the broker has room", Duration::from_secs(60), || {
        let (effects, events) = (cluster.effects.clone(), events.clone());
        async move {
            let handled: HashSet<String> =
                probe_records(&effects, "effects").await.0.into_keys().map(|(e, _)| e).collect();
            handled == events
        }
    })
    .await;
    let dead =
        query_strings(&cluster.db, "SELECT COUNT(*) || '' FROM event_queue WHERE status = 'dead_lettered'").await;
    assert_eq!(dead[0][0], "0");
    cluster.stop().await;
}

/// On nats the handlers' ledger claims go to the write service. probe-a's process reaches it
/// through a proxy (the broker directly), and the network to it is cut while probe-a is in an
/// 8 s call: once the ledger lease (3 s) has run out, another worker's ledger claim takes the
/// event over. The cut-off worker could not renew for five sixths of the lease and has dropped
/// its run by then: it leaves no effect.
#[tokio::test]
async fn a_worker_cut_off_from_the_ledger_drops_its_work_before_its_lease_ends() {
    let dir = temp_dir();
    let cluster = probe_a_with_a_3s_ledger_lease().start(dir.path()).await;
    let proxy = reelay_harness::CuttingProxy::start(cluster.write.addr).await;
    let broker = nats_env(cluster.nats.as_ref().unwrap());
    let mut handlers = crate::slow_probe_behind(&proxy, dir.path(), &cluster.effects, &with(&broker, &[])).await;
    let mut c = cluster.write.clients().await;
    c.user("ana").await;
    let event_id = event_ids(&cluster.db).await.remove(0);
    eventually("probe-a is inside its handler call", Duration::from_secs(20), || async {
        !probe_records(&cluster.effects, "attempts").await.0.is_empty()
    })
    .await;
    proxy.partition();
    let cut_at = Instant::now();
    // The lease runs out: another worker takes the event over.
    taken_over_by_another_worker(&c, &event_id).await;
    // The first run would have recorded its effect 8 s after it started.
    tokio::time::sleep(Duration::from_secs(9).saturating_sub(cut_at.elapsed())).await;
    let (effects, _) = probe_records(&cluster.effects, "effects").await;
    assert_eq!(effects.get(&(event_id, "probe-a".to_owned())), None, "the cut-off run was dropped");
    proxy.heal();
    handlers.stop().await;
    cluster.stop().await;
}

/// probe-a's ledger claim answer reaches its worker 2.4 s after the write service made the
/// claim (the proxy holds every answer back, then every request: no renewal gets through; the
/// broker is reached directly). Once the ledger lease (3 s) has run out another worker's claim
/// takes the event over; the worker counts its lease from when it asked, not from when the answer
/// came, so the run it starts then is dropped before that point: it leaves no effect.
#[tokio::test]
async fn a_ledger_claim_answered_late_is_not_worked_on_past_its_lease() {
    let dir = temp_dir();
    let cluster = probe_a_with_a_3s_ledger_lease().start(dir.path()).await;
    let broker = nats_env(cluster.nats.as_ref().unwrap());
    let mut c = cluster.write.clients().await;
    let (event_id, claimed_at, proxy, mut handlers) =
        crate::a_claim_heard_late(&cluster, &mut c, dir.path(), &with(&broker, &[])).await;
    taken_over_by_another_worker(&c, &event_id).await;
    // A run started on the late answer would have ended 3.9 s after the claim.
    tokio::time::sleep(Duration::from_secs(6).saturating_sub(claimed_at.elapsed())).await;
    crate::dropped_without_effect(&cluster.effects, &event_id, &handlers, "the late run").await;
    proxy.heal();
    handlers.stop().await;
    cluster.stop().await;
}

/// probe-a's process is frozen (SIGSTOP) inside a 3 s call, for longer than the ledger lease
/// (3 s): another worker's ledger claim takes the event over meanwhile. When the process runs
/// again its call's time is up as well as its lease: the lease comes first, and the run is
/// dropped without recording its effect.
#[tokio::test]
async fn a_worker_frozen_past_its_ledger_lease_does_not_finish_its_run_when_it_wakes() {
    let dir = temp_dir();
    let cluster =
        probe_a_with_a_3s_ledger_lease().handlers(&[("REELAY_PROBE_DELAY_MS", "3000")]).start(dir.path()).await;
    let mut c = cluster.write.clients().await;
    c.user("ana").await;
    let event_id = event_ids(&cluster.db).await.remove(0);
    eventually("probe-a is inside its handler call", Duration::from_secs(20), || async {
        !probe_records(&cluster.effects, "attempts").await.0.is_empty()
    })
    .await;
    let taken_over = taken_over_by_another_worker(&c, &event_id);
    crate::frozen_until_taken_over(&cluster.handlers[0], &cluster.effects, &event_id, taken_over).await;
    cluster.stop().await;
}

/// probe-a's ledger claim is made, but its answer never reaches the worker: the proxy between
/// probe-a's process and the write service cuts the connection as the answer starts back. The
/// worker holds the batch (the ledger unreachable), asks again, and is handed its own claim back
/// (no batch of its process has the pair in hand): the event is handled once, at once, instead
/// of waiting out that claim's 30 s lease with a delivery spent.
#[tokio::test]
async fn a_ledger_claim_whose_answer_was_lost_is_handed_back_to_its_owner() {
    let dir = temp_dir();
    let cluster =
        reelay_harness::Cluster::builder(BIN, reelay_harness::Backend::Nats).probes("probe-a").start(dir.path()).await;
    let (proxy, mut handlers, _, _) = probe_a_behind_a_proxy(&cluster, dir.path(), &[]).await;

    // The answer cut is usually the next event's claim's; now and then it is the idle worker's
    // telling of its build (every quarter lease), and the round is tried again.
    let resumed = r#"reelay_ledger_claims_total{outcome="resumed"}"#;
    let event_id = crate::cut_claim_answers_until_one_is_handed_back(&cluster.write, &proxy, resumed, |event_id| {
        let db = cluster.db.clone();
        async move { ledger_row(&db, &event_id, "probe-a").await.is_some_and(|row| row[0] == "done") }
    })
    .await;
    let resumed = cluster.write.metrics().await.value(resumed);
    assert_eq!(resumed, Some(1.0), "the cut answer was a claim's, and that claim was handed back");
    let (attempts, _) = probe_records(&cluster.effects, "attempts").await;
    assert_eq!(attempts.get(&(event_id.clone(), "probe-a".to_owned())), Some(&1), "one run: {attempts:?}");
    let deferred =
        handlers.metrics().await.value(r#"reelay_handler_deliveries_total{handler="probe-a",outcome="deferred"}"#);
    assert_eq!(deferred.unwrap_or(0.0), 0.0, "no delivery spent waiting for the worker's own claim");
    handlers.stop().await;
    cluster.stop().await;
}

/// Waits until another worker's ledger claim on probe-a's part of `event_id` is granted (the
/// claim before it has run out).
async fn taken_over_by_another_worker(c: &Clients, event_id: &str) {
    let key = v1::LedgerKey { event_id: event_id.to_owned(), handler: "probe-a".into() };
    eventually("another worker takes the event over", Duration::from_secs(20), || {
        let (mut c, key) = (c.clone(), key.clone());
        async move {
            let claim =
                v1::LedgerClaimRequest { keys: vec![key], owner: "another-worker#1".into(), ..Default::default() };
            let reply = c.ledger.claim(claim).await.unwrap().into_inner();
            matches!(reply.claims[0].outcome, Some(v1::ledger_claim::Outcome::AcquiredToken(_)))
        }
    })
    .await;
}

/// A nats cluster of probe-a whose ledger lease is 3 s.
fn probe_a_with_a_3s_ledger_lease() -> reelay_harness::ClusterBuilder {
    reelay_harness::Cluster::builder(BIN, reelay_harness::Backend::Nats)
        .probes("probe-a")
        .env("REELAY_LEDGER_LEASE_MS", "3000")
}

/// A probe-a process (no delay; `extra` on top) that reaches the write service through a proxy
/// and the broker directly, with a first event through it (its connection up, nothing else to
/// say): the proxy, the process, clients and that event's id.
async fn probe_a_behind_a_proxy(
    cluster: &reelay_harness::Cluster,
    dir: &Path,
    extra: &[(&str, &str)],
) -> (reelay_harness::CuttingProxy, Reelay, Clients, String) {
    let proxy = reelay_harness::CuttingProxy::start(cluster.write.addr).await;
    let broker = nats_env(cluster.nats.as_ref().unwrap());
    let mut env = with(&broker, &[("REELAY_PROBE_DELAY_MS", "0")]);
    env.extend_from_slice(extra);
    let handlers = crate::slow_probe_behind(&proxy, dir, &cluster.effects, &env).await;
    let mut c = cluster.write.clients().await;
    c.user("warm").await;
    let warm = event_ids(&cluster.db).await.remove(0);
    eventually("the first event is handled and settled", Duration::from_secs(20), || async {
        ledger_row(&cluster.db, &warm, "probe-a").await.is_some_and(|row| row[0] == "done")
    })
    .await;
    (proxy, handlers, c, warm)
}

/// Whether every consumer of the event stream has nothing pending and nothing awaiting an ack.
async fn consumers_idle(url: &str) -> bool {
    let js = jetstream::new(async_nats::connect(url).await.unwrap());
    let mut consumers = js.get_stream(STREAM).await.unwrap().consumers();
    let mut idle = true;
    while let Some(info) = consumers.next().await {
        let info = info.unwrap();
        idle &= info.num_pending == 0 && info.num_ack_pending == 0;
    }
    idle
}

/// The status, attempts and last error of a pair's ledger row.
async fn ledger_row(db: &Path, event_id: &str, handler: &str) -> Option<Vec<String>> {
    let sql = format!(
        "SELECT status, attempts || '', COALESCE(last_error, ''), COALESCE(processed_at - started_at, -1) || '' \
         FROM processed_events WHERE event_id = '{event_id}' AND handler = '{handler}'"
    );
    query_strings(db, &sql).await.pop()
}

async fn dead_lettered(db: &Path, event_id: &str, handler: &str) -> Vec<String> {
    eventually("the given-up delivery is a dead letter", Duration::from_secs(40), || async {
        ledger_row(db, event_id, handler).await.is_some_and(|r| r[0] == "dead_lettered")
    })
    .await;
    ledger_row(db, event_id, handler).await.unwrap()
}

/// A nats cluster of probe-a (with `set_up`'s settings) that has one event, a user's: the
/// cluster, its clients and the event's id.
async fn probe_a_with_one_event(
    dir: &Path,
    set_up: impl FnOnce(reelay_harness::ClusterBuilder) -> reelay_harness::ClusterBuilder,
) -> (reelay_harness::Cluster, Clients, String) {
    let builder = reelay_harness::Cluster::builder(BIN, reelay_harness::Backend::Nats).probes("probe-a");
    let cluster = set_up(builder).start(dir).await;
    let mut c = cluster.write.clients().await;
    c.user("ana").await;
    let event_id = event_ids(&cluster.db).await.remove(0);
    (cluster, c, event_id)
}

/// The worker of an event's last delivery is killed while the handler runs: JetStream will not
/// deliver it again, and the ledger holds only the dead worker's claim. The server's
/// max-deliveries advisory, kept in a stream, makes it a dead letter once a worker is back, and
/// a replay runs it once. Before, nothing recorded it: the event was lost for that handler.
#[tokio::test]
async fn a_worker_killed_on_the_last_delivery_leaves_a_dead_letter() {
    let dir = temp_dir();
    let (mut cluster, _, event_id) = probe_a_with_one_event(dir.path(), |b| {
        b.env("EVENT_QUEUE_MAX_ATTEMPTS", "1")
            .env("REELAY_ACK_WAIT_MS", "2000")
            .env("REELAY_LEDGER_LEASE_MS", "3000")
            .handlers(&[("REELAY_PROBE_DELAY_MS", "8000")])
    })
    .await;
    eventually("probe-a is inside its handler call", Duration::from_secs(20), || async {
        !probe_records(&cluster.effects, "attempts").await.0.is_empty()
    })
    .await;
    cluster.handlers[0].kill();
    cluster.handlers[0].restart_with(&[("REELAY_PROBE_DELAY_MS", "0")]).await;
    let row = dead_lettered(&cluster.db, &event_id, "probe-a").await;
    assert_eq!(row[1], "1", "one delivery was made: {row:?}");
    assert!(row[2].starts_with("JetStream stopped delivering the event after 1 deliveries"), "{row:?}");
    let key = (event_id.clone(), "probe-a".to_owned());
    assert_eq!(probe_records(&cluster.effects, "effects").await.0.get(&key), None);

    let replayed = cluster.cli(&["dead-letters", "replay", &event_id]).await;
    assert!(replayed.ok().contains("1 replayed"), "{}", replayed.stdout);
    eventually("the replay is handled", Duration::from_secs(30), || async {
        ledger_row(&cluster.db, &event_id, "probe-a").await.is_some_and(|r| r[0] == "done")
    })
    .await;
    assert_eq!(probe_records(&cluster.effects, "effects").await.0.get(&key), Some(&1));
    cluster.stop().await;
}

/// An event's last delivery finds it held by a claim whose owner never finishes it (a worker
/// gone, or a claim whose answer was lost): the delivery is deferred, and JetStream gives the
/// event up. Once that claim's lease has run out (not before: its owner could still settle it),
/// the pair is a dead letter; the handler never ran it.
#[tokio::test]
async fn a_last_delivery_deferred_to_a_claim_that_never_finishes_leaves_a_dead_letter() {
    let dir = temp_dir();
    let (cluster, mut c, event_id) = probe_a_with_one_event(dir.path(), |b| {
        b.env("EVENT_QUEUE_MAX_ATTEMPTS", "1").env("REELAY_LEDGER_LEASE_MS", "3000")
    })
    .await;
    let key = v1::LedgerKey { event_id: event_id.clone(), handler: "probe-a".into() };
    let claim = v1::LedgerClaimRequest { keys: vec![key], owner: "gone-worker#1".into(), ..Default::default() };
    let reply = c.ledger.claim(claim).await.unwrap().into_inner();
    assert!(matches!(reply.claims[0].outcome, Some(v1::ledger_claim::Outcome::AcquiredToken(_))), "{reply:?}");

    let broker = nats_env(cluster.nats.as_ref().unwrap());
    let effects = cluster.effects.to_str().unwrap();
    let env = with(
        &broker,
        &[
            ("REELAY_PROBE_HANDLERS", "probe-a"),
            ("REELAY_PROBE_DB", effects),
            ("EVENT_QUEUE_MAX_ATTEMPTS", "1"),
            ("REELAY_LEDGER_LEASE_MS", "3000"),
        ],
    );
    let mut handlers = Reelay::start_handlers(BIN, &cluster.write, &dir.path().join("late"), &env).await;
    let row = dead_lettered(&cluster.db, &event_id, "probe-a").await;
    assert!(row[2].starts_with("JetStream stopped delivering"), "{row:?}");
    let waited: i64 = row[3].parse().unwrap();
    assert!(waited >= 3000, "recorded only after the holder's lease ran out ({waited} ms after its claim)");
    assert!(probe_records(&cluster.effects, "attempts").await.0.is_empty(), "the handler never ran the event");
    handlers.stop().await;
    cluster.stop().await;
}

/// A replay whose first delivery fails releases its claim (on nats the ledger row goes with it,
/// and its count of replays); dead-lettered again and replayed a second time, the second copy
/// still gets a number of its own. Before, it got the first one's again, whose copy already
/// holds that id in the outbox: the replay command failed, and the event could not be replayed.
#[tokio::test]
async fn a_second_replay_is_delivered_after_the_first_failed() {
    let dir = temp_dir();
    let (cluster, _, event_id) = probe_a_with_one_event(dir.path(), |b| {
        b.env("REELAY_PROBE_FAIL", "1")
            .env("EVENT_QUEUE_MAX_ATTEMPTS", "2")
            .env("REELAY_RETRY_BASE_MS", "100")
            .handlers(&[])
    })
    .await;
    let key = (event_id.clone(), "probe-a".to_owned());
    for (round, attempts) in [(0, 2), (1, 4), (2, 6)] {
        if round > 0 {
            let replayed = cluster.cli(&["dead-letters", "replay", &event_id]).await;
            assert!(replayed.ok().contains("1 replayed"), "replay {round}: {}", replayed.stdout);
        }
        eventually(&format!("{attempts} attempts, then a dead letter"), Duration::from_secs(30), || async {
            let tried = probe_records(&cluster.effects, "attempts").await.0.get(&key).copied();
            let row = ledger_row(&cluster.db, &event_id, "probe-a").await;
            tried == Some(attempts) && row.is_some_and(|r| r[0] == "dead_lettered")
        })
        .await;
    }
    let copies =
        query_strings(&cluster.db, "SELECT event_id FROM event_queue WHERE replay_of IS NOT NULL ORDER BY id").await;
    let copies: Vec<&str> = copies.iter().map(|r| r[0].as_str()).collect();
    assert_eq!(copies, [format!("{event_id}:replay:1:probe-a"), format!("{event_id}:replay:2:probe-a")]);
    cluster.stop().await;
}

/// A delivery terminated with no outcome recorded (here by hand, as a dispatcher does after a
/// permanent failure whose dead letter the ledger could not take) is recorded from the server's
/// terminated advisory once the handler runs again: the advisory waits in the given-up stream,
/// and the handler's consumer of it takes that subject again even if it had lost it.
#[tokio::test]
async fn a_terminated_delivery_without_an_outcome_becomes_a_dead_letter() {
    let dir = temp_dir();
    let builder = reelay_harness::Cluster::builder(BIN, reelay_harness::Backend::Nats).probes("probe-a");
    // The handlers process made probe-a's consumers; it is down when the event comes.
    let mut cluster = builder.handlers(&[]).start(dir.path()).await;
    cluster.handlers[0].stop().await;
    let js = jetstream::new(async_nats::connect(cluster.nats.as_ref().unwrap().url()).await.unwrap());
    // Its consumer of given-up advisories lost the terminated ones (an older build's, or one
    // edited by hand): the handlers' next start adds the subject back.
    let given_up = js.get_stream(format!("{STREAM}_GIVEN_UP")).await.unwrap();
    let mut edited = given_up.consumer_info("given-up-probe-a").await.unwrap().config.clone();
    edited.filter_subjects.retain(|subject| !subject.contains(".MSG_TERMINATED."));
    assert_eq!(edited.filter_subjects.len(), 1, "{edited:?}");
    given_up.update_consumer(edited).await.unwrap();
    cluster.write.clients().await.user("ana").await;
    let event_id = event_ids(&cluster.db).await.remove(0);
    let consumer: consumer::PullConsumer =
        js.get_stream(STREAM).await.unwrap().get_consumer("handler-probe-a").await.unwrap();
    // The relay publishes the event soon after the write; a pull waits for it.
    let mut pull = consumer.batch().max_messages(1).expires(Duration::from_secs(20)).messages().await.unwrap();
    let message = pull.next().await;
    message.expect("the event reaches probe-a's consumer").unwrap().ack_with(jetstream::AckKind::Term).await.unwrap();
    cluster.handlers[0].restart_with(&[]).await;
    let row = dead_lettered(&cluster.db, &event_id, "probe-a").await;
    assert!(row[2].starts_with("JetStream terminated the delivery with no outcome recorded"), "{row:?}");
    assert!(probe_records(&cluster.effects, "attempts").await.0.is_empty(), "the handler never ran the event");
    cluster.stop().await;
}

/// The relay's claim answer cut on its way back (the connection dropped as the rows came): the
/// relay's next claim names the call, and the write service hands the rows back to it at once
/// instead of holding them for the 30 s lease. The event is published once, no attempt spent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_claim_answer_that_never_arrived_is_handed_back_to_the_relay() {
    let dir = temp_dir();
    let nats = NatsServer::start(&dir.path().join("nats"));
    let env = nats_env(&nats);
    let db = dir.path().join("reelay.db");
    let mut write = Reelay::start_write(BIN, &db, &with(&env, &[])).await;
    let proxy = reelay_harness::CuttingProxy::start(write.addr).await;
    let proxy_url = format!("http://{}", proxy.addr);
    let mut relay =
        start(BIN, &dir.path().join("relay/x.db"), &["relay"], &with(&env, &[("REELAY_WRITE_URL", &proxy_url)])).await;
    let status = |event_id: String| {
        let db = db.clone();
        async move {
            let sql = format!("SELECT status, attempts || '' FROM event_queue WHERE event_id = '{event_id}'");
            query_strings(&db, &sql).await.remove(0)
        }
    };
    let resumed = "reelay_outbox_rows_resumed_total";
    let event_id = crate::cut_claim_answers_until_one_is_handed_back(&write, &proxy, resumed, |event_id| {
        let status = status(event_id);
        async move { status.await[0] == "done" }
    })
    .await;
    assert_eq!(write.metrics().await.value(resumed), Some(1.0), "one row handed back");
    assert_eq!(status(event_id.clone()).await, ["done", "0"], "no attempt spent");
    let copies = stream_messages(&nats.url()).await.into_iter().filter(|(_, id)| *id == event_id).count();
    assert_eq!(copies, 1, "published once");
    assert!(write.log_text().contains("handed outbox rows back to their claimer"));
    relay.stop().await;
    write.stop().await;
}

/// A deployment that moves to a cluster and asks for three copies of its streams
/// (`REELAY_STREAM_REPLICAS=3`) has both brought to it in place at its next start: the event
/// stream and the stream of given-up advisories beside it. That start also gives back to the
/// given-up stream what an operator (or an older build) took from it: an advisory subject, and
/// its 30 days.
#[tokio::test]
async fn both_streams_are_brought_to_a_new_replica_count_and_what_handlers_need_in_place() {
    let dir = temp_dir();
    let cluster = NatsServer::start_cluster(&dir.path().join("nats"), 3);
    let env = nats_env(&cluster[0]);
    let db = dir.path().join("reelay.db");
    let mut write = Reelay::start_write(BIN, &db, &with(&env, &[])).await;
    let write_url = format!("http://{}", write.addr);
    let relay_env = with(&env, &[("REELAY_WRITE_URL", &write_url)]);
    let mut relay = start(BIN, &dir.path().join("relay/x.db"), &["relay"], &relay_env).await;
    let js = jetstream::new(async_nats::connect(cluster[0].url()).await.unwrap());
    let replicas = || async {
        let mut copies = Vec::new();
        for name in [STREAM.to_owned(), format!("{STREAM}_GIVEN_UP")] {
            let info = match js.get_stream(&name).await {
                Ok(mut stream) => stream.info().await.ok().map(|info| info.config.num_replicas),
                Err(_) => None,
            };
            copies.push(info.unwrap_or(0));
        }
        copies
    };
    eventually("both streams are made, in one copy", Duration::from_secs(30), || async { replicas().await == [1, 1] })
        .await;
    let given_up = format!("{STREAM}_GIVEN_UP");
    let given_up_config = || async { js.get_stream(&given_up).await.unwrap().info().await.unwrap().config.clone() };
    let made = given_up_config().await;
    let mut edited = made.clone();
    edited.subjects.retain(|subject| subject.contains(".MSG_TERMINATED."));
    edited.max_age = Duration::from_secs(3600);
    assert_eq!(edited.subjects.len(), 1, "{:?}", made.subjects);
    js.update_stream(&edited).await.unwrap();
    relay.restart_with(&[("REELAY_STREAM_REPLICAS", "3")]).await;
    eventually("both streams are kept in three copies", Duration::from_secs(30), || async {
        replicas().await == [3, 3]
    })
    .await;
    let restored = given_up_config().await;
    assert_eq!((restored.subjects.len(), restored.max_age), (2, made.max_age), "{restored:?}");
    assert!(made.subjects.iter().all(|subject| restored.subjects.contains(subject)), "{restored:?}");
    assert_eq!(made.max_age, Duration::from_secs(30 * 86_400));
    // The relay logs each update once the broker has answered it, which can be after the
    // streams show three copies.
    let said = |line: &'static str| {
        let relay = &relay;
        eventually(line, Duration::from_secs(10), move || async move { relay.log_text().contains(line) })
    };
    said("updated the existing stream's duplicate_window, replicas, discard policy and subjects in place").await;
    said("updated the existing stream's replicas, subjects and max age in place").await;
    relay.stop().await;
    write.stop().await;
}

/// The outbox rows claimed for a relay whose call went away while the claim's commit was on its
/// way to a slow disk (its deadline passed first) are handed back to its next call naming that
/// call, whether a claim job of its own wrote them or the batch that wrote them, and after the
/// write service was killed and restarted too; before, they waited out the 30 s lease. (The
/// write service alone: the test claims as the relay does.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outbox_rows_claimed_for_a_call_that_went_away_are_handed_back() {
    let dir = temp_dir();
    let db = dir.path().join("reelay.db");
    // A lease longer than the test: the rows handed back stay held by the claimer.
    let env = [("EVENT_BUS_BACKEND", "nats"), ("REELAY_OUTBOX_LEASE_MS", "300000")];
    let mut write = Reelay::start_write(BIN, &db, &env).await;
    let c = write.clients().await;
    let new_event = |n: usize| {
        let (mut c, db) = (c.clone(), db.clone());
        async move {
            let before = event_ids(&db).await;
            c.user(&format!("user{n}")).await;
            let new: Vec<String> = event_ids(&db).await.into_iter().filter(|e| !before.contains(e)).collect();
            assert_eq!(new.len(), 1, "one event per user: {new:?}");
            // The user's key pair is a write of its own: not one left to hold the writer later.
            crate::key_pairs_stored(&db, n + 1).await;
            new[0].clone()
        }
    };
    let claim = |mut outbox: crate::Outbox, call_id: u64, unanswered: Vec<u64>, wait_ms: u32, deadline: Duration| {
        let mut request = tonic::Request::new(v1::ClaimRequest {
            consumer: "relay-test#1".into(),
            max_rows: 10,
            wait_ms,
            call_id,
            unanswered,
            ..Default::default()
        });
        request.set_timeout(deadline);
        async move { Ok(outbox.claim(request).await?.into_inner().rows.into_iter().map(|r| r.event_id).collect()) }
    };
    let counts = (
        "reelay_outbox_rows_resumed_total",
        "SELECT COUNT(*) || '' FROM event_queue WHERE claimed_by = 'relay-test#1' AND status = 'processing'",
    );
    let paths = (dir.path(), db.as_path());
    crate::claims_for_a_caller_that_went_away_are_handed_back(&mut write, paths, counts, new_event, claim).await;
    write.stop().await;
}

/// Two builds of a handler at once on nats (see the db test's text).
#[tokio::test]
async fn an_older_build_of_a_handler_stands_by_while_a_newer_one_claims_on_nats() {
    crate::delivery_db::older_build_stands_by(reelay_harness::Backend::Nats).await;
}

#[tokio::test]
async fn a_handler_stopped_mid_batch_on_nats_keeps_what_it_finished_and_hands_back_the_rest() {
    crate::delivery_db::a_handler_stopped_mid_batch_keeps_what_it_finished_and_hands_back_the_rest(
        reelay_harness::Backend::Nats,
    )
    .await;
}
