//! The operator's view and hands, end to end on both backends: an event made to fail for one
//! handler is dead-lettered (its attempts spent) and shows in `reelay status`,
//! `reelay dead-letters list` and `reelay events explain`; after the fault is fixed, two
//! operators replay it at the same moment, it is enqueued once, recorded once, and handled
//! exactly once, while the other handler was never held back. Bad requests name their field.

use std::time::Duration;

use reelay_contracts::v1::{self, admin_client::AdminClient};
use reelay_harness::{Backend, Cluster, eventually, outbox_rows, probe_records, query_strings, temp_dir};

const BIN: &str = env!("CARGO_BIN_EXE_reelay");

/// (attempts, effects) of `handler` on `event_id`, from the probes' own records.
async fn probe_counts(cluster: &Cluster, event_id: &str, handler: &str) -> (usize, usize) {
    let key = (event_id.to_owned(), handler.to_owned());
    let (attempts, _) = probe_records(&cluster.effects, "attempts").await;
    let (effects, _) = probe_records(&cluster.effects, "effects").await;
    (attempts.get(&key).copied().unwrap_or(0), effects.get(&key).copied().unwrap_or(0))
}

async fn ledger_state(cluster: &Cluster, event_id: &str, handler: &str) -> Option<String> {
    query_strings(
        &cluster.db,
        &format!("SELECT status FROM processed_events WHERE event_id = '{event_id}' AND handler = '{handler}'"),
    )
    .await
    .first()
    .map(|r| r[0].clone())
}

async fn dead_letter_then_replay(backend: Backend) {
    let dir = temp_dir();
    // probe-a fails every attempt until it is fixed; two attempts, 100 ms apart, then it is
    // given up (on nats: JetStream's max_deliver).
    let mut cluster = Cluster::builder(BIN, backend)
        .probes("probe-a,probe-b")
        .env("EVENT_QUEUE_MAX_ATTEMPTS", "2")
        .env("REELAY_RETRY_BASE_MS", "100")
        .env("REELAY_RETRY_CAP_MS", "200")
        .handlers(&[("REELAY_PROBE_FAIL", "probe-a=times:1000")])
        .start(dir.path())
        .await;
    let mut c = cluster.write.clients().await;
    c.user("ana").await;
    let event_id = outbox_rows(&cluster.db).await[0].event_id.clone().unwrap();

    eventually("probe-a gives the event up", Duration::from_secs(30), || {
        let cluster = &cluster;
        let event_id = event_id.clone();
        async move { ledger_state(cluster, &event_id, "probe-a").await.as_deref() == Some("dead_lettered") }
    })
    .await;
    assert_eq!(probe_counts(&cluster, &event_id, "probe-a").await, (2, 0), "two attempts, no effect");
    eventually("probe-b handles the event meanwhile", Duration::from_secs(30), || {
        let (cluster, event_id) = (&cluster, event_id.clone());
        async move { probe_counts(cluster, &event_id, "probe-b").await == (1, 1) }
    })
    .await;

    // What an operator sees.
    let status = cluster.cli(&["status"]).await;
    let status = status.ok();
    let line = status.lines().find(|l| l.starts_with("probe-a ")).unwrap_or_else(|| panic!("{status}"));
    assert!(line.trim_end().ends_with(" 1"), "probe-a has one dead letter: {status}");
    let line = status.lines().find(|l| l.starts_with("probe-b ")).unwrap();
    assert!(line.trim_end().ends_with(" 0"), "probe-b has none: {status}");
    if backend == Backend::Nats {
        assert!(!status.contains("unknown"), "the CLI reads the consumers' backlogs from the broker: {status}");
    }

    let listed = cluster.cli(&["dead-letters", "list", "--handler", "probe-a", "--since", "10m"]).await;
    let listed = listed.ok();
    assert!(listed.contains(&event_id) && listed.contains("UserRegistered"), "{listed}");
    assert!(listed.contains("fails attempt 2"), "the last error is shown: {listed}");
    let none = cluster.cli(&["dead-letters", "list", "--type", "ReviewLogged"]).await;
    assert!(none.ok().contains("no dead letters"), "the type filter applies: {}", none.stdout);

    let explained = cluster.cli(&["events", "explain", &event_id]).await;
    let explained = explained.ok();
    assert!(explained.contains("UserRegistered"), "{explained}");
    let a = explained.lines().find(|l| l.trim_start().starts_with("probe-a")).unwrap();
    assert!(a.contains("dead_lettered") && a.contains("2 failed attempt(s)"), "{explained}");
    let b = explained.lines().find(|l| l.trim_start().starts_with("probe-b")).unwrap();
    assert!(b.contains("done"), "{explained}");
    if backend == Backend::Nats {
        assert!(explained.contains("stream sequence 1"), "the relay recorded where JetStream stored it: {explained}");
    }

    // The metric agrees with the database.
    let metrics = cluster.write.metrics().await;
    assert_eq!(metrics.value(r#"reelay_dead_letters{handler="probe-a"}"#), Some(1.0), "{}", metrics.0);
    assert_eq!(metrics.value(r#"reelay_dead_letters{handler="probe-b"}"#), Some(0.0));

    // Fix the fault, then two operators replay at the same moment: one replay, recorded once.
    cluster.handlers[0].restart_with(&[("REELAY_PROBE_FAIL", "")]).await;
    let by_id = ["dead-letters", "replay", &event_id, "--handler", "probe-a"];
    let all = ["dead-letters", "replay", "--handler", "probe-a", "--all"];
    // With nobody to record it under (no REELAY_OPERATOR, $USER nor $LOGNAME, as in a `kubectl
    // exec`), an action is refused before any call; the one recorded below is the only one.
    let nobody = cluster.write.cli(&by_id, &[("REELAY_OPERATOR", ""), ("USER", ""), ("LOGNAME", "")]).await;
    assert!(!nobody.success && nobody.stderr.contains("set REELAY_OPERATOR"), "{nobody:?}");
    let (first, second) = tokio::join!(cluster.cli(&by_id), cluster.cli(&all));
    // The one by id that finds it replayed by the other says so with exit 1; `--all` finding
    // nothing left is no failure.
    assert_eq!(first.success, first.stdout.contains("1 replayed"), "{first:?}");
    let replayed = [first.stdout.as_str(), second.ok()];
    let summaries: Vec<&str> = replayed.iter().map(|out| out.lines().last().unwrap()).collect();
    assert!(
        summaries.contains(&"1 replayed, 0 unchanged")
            && summaries.iter().filter(|s| s.starts_with("1 replayed")).count() == 1,
        "exactly one of two concurrent replays changes the dead letter: {replayed:?}"
    );
    let actions =
        query_strings(&cluster.db, "SELECT action, event_id, handler, operator FROM dead_letter_actions").await;
    assert_eq!(actions, vec![vec!["replay".into(), event_id.clone(), "probe-a".into(), "test-operator".into()]]);
    if backend == Backend::Nats {
        let replays = query_strings(&cluster.db, "SELECT event_id FROM event_queue WHERE replay_of IS NOT NULL").await;
        assert_eq!(replays, vec![vec![format!("{event_id}:replay:1:probe-a")]], "one replay enqueued");
    }

    eventually("the replayed event is handled", Duration::from_secs(30), || {
        let (cluster, event_id) = (&cluster, event_id.clone());
        async move { ledger_state(cluster, &event_id, "probe-a").await.as_deref() == Some("done") }
    })
    .await;
    // Give a duplicate the time it would need to show.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(probe_counts(&cluster, &event_id, "probe-a").await, (3, 1), "handled exactly once after the replay");
    assert_eq!(probe_counts(&cluster, &event_id, "probe-b").await, (1, 1), "probe-b never saw the replay");

    let explained = cluster.cli(&["events", "explain", &event_id]).await;
    let explained = explained.ok();
    let a = explained.lines().find(|l| l.trim_start().starts_with("probe-a")).unwrap();
    assert!(a.contains("done") && a.contains("replayed 1x"), "{explained}");
    assert!(explained.contains("replay for probe-a by test-operator"), "{explained}");
    let again = cluster.cli(&["dead-letters", "replay", &event_id]).await;
    assert!(again.stdout.contains("0 replayed, 1 unchanged"), "nothing left to replay: {}", again.stdout);
    assert!(!again.success && again.stderr.contains("nothing replayed"), "a script is told: {}", again.stderr);
    cluster.stop().await;
}

#[tokio::test]
async fn explain_and_replay_on_the_db_backend() {
    dead_letter_then_replay(Backend::Db).await;
}

#[tokio::test]
async fn explain_and_replay_on_the_nats_backend() {
    dead_letter_then_replay(Backend::Nats).await;
}

/// The event's outbox row, as the relay left it: (status, attempts).
async fn outbox_state(db: &std::path::Path, event_id: &str) -> (String, String) {
    let rows =
        query_strings(db, &format!("SELECT status, attempts || '' FROM event_queue WHERE event_id = '{event_id}'"))
            .await;
    (rows[0][0].clone(), rows[0][1].clone())
}

/// nats-server again with `max_payload` set to `bytes`.
fn restart_broker(cluster: &mut Cluster, dir: &std::path::Path, bytes: usize) {
    let config = dir.join("nats/nats.conf");
    let text = std::fs::read_to_string(&config).unwrap();
    let start = text.find("max_payload: ").unwrap();
    let end = start + text[start..].find('\n').unwrap();
    std::fs::write(&config, format!("{}max_payload: {bytes}{}", &text[..start], &text[end..])).unwrap();
    cluster.nats.as_mut().unwrap().restart();
}

/// On nats an event the broker can never take (over its `max_payload`) is given up by the relay
/// and reaches no handler: it is a dead letter of `relay`, listed, replayed (given up again while
/// the broker still refuses it) and, once the broker takes larger messages, replayed to every
/// handler. A handler's replayed delivery whose copy the relay gives up is that handler's dead
/// letter again, and can be replayed once more.
#[tokio::test]
async fn what_the_relay_gives_up_is_a_dead_letter_too() {
    let dir = temp_dir();
    let mut cluster = Cluster::builder(BIN, Backend::Nats)
        .nats_config("max_payload: 1048576")
        .probes("probe-a,probe-b")
        .env("EVENT_QUEUE_MAX_ATTEMPTS", "2")
        .env("REELAY_RETRY_BASE_MS", "100")
        .env("REELAY_RETRY_CAP_MS", "200")
        .handlers(&[("REELAY_PROBE_FAIL", "probe-b=times:1000")])
        .start(dir.path())
        .await;
    // The broker's limit lowered under the running relay (it checks the limit when it starts),
    // once the relay is connected to it again: a small event goes through.
    let mut c = cluster.write.clients().await;
    restart_broker(&mut cluster, dir.path(), 2048);
    let ana = c.user("ana").await;
    eventually("the relay publishes again", Duration::from_secs(30), || {
        let db = cluster.db.clone();
        async move {
            query_strings(&db, "SELECT COUNT(*) || '' FROM event_queue WHERE status = 'done'").await[0][0] == "1"
        }
    })
    .await;
    let review = c.review_with_text(&ana, reelay_harness::movie_ref("Heat", 1995), 8, &"long ".repeat(600)).await;
    let event_id = query_strings(
        &cluster.db,
        &format!("SELECT event_id FROM event_queue WHERE aggregate_id = '{}'", review.review_id),
    )
    .await[0][0]
        .clone();
    eventually("the relay gives the event up", Duration::from_secs(30), || {
        let (db, event_id) = (cluster.db.clone(), event_id.clone());
        async move { outbox_state(&db, &event_id).await.0 == "dead_lettered" }
    })
    .await;
    let listed = cluster.cli(&["dead-letters", "list", "--handler", "relay"]).await.ok().to_owned();
    assert!(listed.contains(&event_id) && listed.contains("ReviewLogged"), "{listed}");
    assert!(listed.contains("max_payload"), "the broker's refusal is shown: {listed}");
    let all = cluster.cli(&["dead-letters", "list"]).await.ok().to_owned();
    assert!(all.contains(&event_id), "listed among every dead letter: {all}");
    let metrics = cluster.write.metrics().await;
    assert_eq!(metrics.value(r#"reelay_dead_letters{handler="relay"}"#), Some(1.0), "alerted on: {}", metrics.0);

    // Replayed while the broker still refuses it: given up again, still listed.
    let replayed = cluster.cli(&["dead-letters", "replay", &event_id, "--handler", "relay"]).await.ok().to_owned();
    assert!(replayed.contains("1 replayed, 0 unchanged"), "{replayed}");
    eventually("the relay gives the event up again", Duration::from_secs(30), || {
        let (db, event_id) = (cluster.db.clone(), event_id.clone());
        async move { outbox_state(&db, &event_id).await == ("dead_lettered".to_owned(), "1".to_owned()) }
    })
    .await;

    // The broker takes it now: one more replay reaches both handlers; probe-b fails it.
    restart_broker(&mut cluster, dir.path(), 1024 * 1024);
    let replayed = cluster.cli(&["dead-letters", "replay", "--handler", "relay", "--all"]).await.ok().to_owned();
    assert!(replayed.contains("1 replayed, 0 unchanged"), "{replayed}");
    eventually("probe-a handles the event and probe-b gives it up", Duration::from_secs(30), || {
        let (cluster, event_id) = (&cluster, event_id.clone());
        async move {
            probe_counts(cluster, &event_id, "probe-a").await == (1, 1)
                && ledger_state(cluster, &event_id, "probe-b").await.as_deref() == Some("dead_lettered")
        }
    })
    .await;
    assert_eq!(outbox_state(&cluster.db, &event_id).await.0, "done");
    let listed = cluster.cli(&["dead-letters", "list", "--handler", "relay"]).await.ok().to_owned();
    assert!(listed.contains("no dead letters"), "{listed}");
    let metrics = cluster.write.metrics().await;
    assert_eq!(metrics.value(r#"reelay_dead_letters{handler="relay"}"#), Some(0.0), "{}", metrics.0);

    // probe-b's replay, copied while the broker refuses it again: probe-b's dead letter again.
    restart_broker(&mut cluster, dir.path(), 2048);
    cluster.handlers[0].restart_with(&[("REELAY_PROBE_FAIL", "")]).await;
    let replayed = cluster.cli(&["dead-letters", "replay", &event_id, "--handler", "probe-b"]).await.ok().to_owned();
    assert!(replayed.contains("1 replayed"), "{replayed}");
    eventually("the copy is given up and probe-b's delivery is a dead letter again", Duration::from_secs(30), || {
        let (cluster, event_id) = (&cluster, event_id.clone());
        async move { ledger_state(cluster, &event_id, "probe-b").await.as_deref() == Some("dead_lettered") }
    })
    .await;
    let listed = cluster.cli(&["dead-letters", "list", "--handler", "probe-b"]).await.ok().to_owned();
    assert!(listed.contains(&event_id) && listed.contains("gave up the replay"), "{listed}");
    restart_broker(&mut cluster, dir.path(), 1024 * 1024);
    let replayed = cluster.cli(&["dead-letters", "replay", &event_id, "--handler", "probe-b"]).await.ok().to_owned();
    assert!(replayed.contains("1 replayed"), "{replayed}");
    eventually("probe-b handles the event", Duration::from_secs(30), || {
        let (cluster, event_id) = (&cluster, event_id.clone());
        async move { ledger_state(cluster, &event_id, "probe-b").await.as_deref() == Some("done") }
    })
    .await;
    assert_eq!(probe_counts(&cluster, &event_id, "probe-a").await, (1, 1), "probe-a saw none of the replays");
    assert_eq!(probe_counts(&cluster, &event_id, "probe-b").await.1, 1, "probe-b's effect once");
    // The copy the relay gave up was probe-b's dead letter, not the relay's: none is counted.
    let metrics = cluster.write.metrics().await;
    assert_eq!(metrics.value(r#"reelay_dead_letters{handler="relay"}"#), Some(0.0), "{}", metrics.0);
    cluster.stop().await;
}

/// A discarded dead letter is never delivered again and stops counting; the Admin API refuses
/// bad requests naming the field, and calls without the token.
#[tokio::test]
async fn discard_and_bad_requests() {
    let dir = temp_dir();
    let cluster = Cluster::builder(BIN, Backend::Db)
        .probes("probe-a")
        .env("REELAY_PROBE_FAIL", "probe-a=permanent:doomed")
        .handlers(&[])
        .start(dir.path())
        .await;
    let mut c = cluster.write.clients().await;
    c.user("doomed_user").await;
    let event_id = outbox_rows(&cluster.db).await[0].event_id.clone().unwrap();
    eventually("the permanent failure is dead-lettered at once", Duration::from_secs(30), || {
        let (cluster, event_id) = (&cluster, event_id.clone());
        async move { ledger_state(cluster, &event_id, "probe-a").await.as_deref() == Some("dead_lettered") }
    })
    .await;
    // An event id as an operator may type it (capitals, no hyphens) names the same event.
    let typed = event_id.replace('-', "").to_uppercase();
    let explained = cluster.cli(&["events", "explain", &typed]).await;
    assert!(explained.ok().contains("dead_lettered"), "{}", explained.stdout);
    let discarded = cluster.cli(&["dead-letters", "discard", &event_id]).await;
    assert!(discarded.ok().contains(&format!("discarded {event_id} for probe-a")), "{}", discarded.stdout);
    assert_eq!(ledger_state(&cluster, &event_id, "probe-a").await.as_deref(), Some("discarded"));
    let status = cluster.cli(&["status"]).await;
    assert!(
        status.ok().lines().any(|l| l.starts_with("probe-a ") && l.trim_end().ends_with(" 0")),
        "{}",
        status.stdout
    );
    let replay = cluster.cli(&["dead-letters", "replay", &event_id]).await;
    assert!(replay.stdout.contains("0 replayed, 1 unchanged"), "a discarded letter is not replayed: {}", replay.stdout);
    assert!(!replay.success, "{}", replay.stderr);

    let mut admin = AdminClient::new(cluster.write.channel().await);
    let refused = |r: Result<tonic::Response<v1::DeadLetterActionResponse>, tonic::Status>| r.unwrap_err();
    let bad = refused(
        admin
            .replay_dead_letters(v1::DeadLetterActionRequest {
                event_ids: vec!["not-a-uuid".into()],
                operator: "me".into(),
                ..Default::default()
            })
            .await,
    );
    assert_eq!(bad.code(), tonic::Code::InvalidArgument);
    assert!(bad.message().starts_with("event_ids"), "{}", bad.message());
    let bad = refused(
        admin
            .replay_dead_letters(v1::DeadLetterActionRequest { all: true, operator: "me".into(), ..Default::default() })
            .await,
    );
    assert!(bad.message().starts_with("handler: is required with `all`"), "{}", bad.message());
    let bad = refused(
        admin
            .discard_dead_letters(v1::DeadLetterActionRequest {
                event_ids: vec![event_id.clone()],
                ..Default::default()
            })
            .await,
    );
    assert!(bad.message().starts_with("operator"), "{}", bad.message());
    let bad = admin
        .list_dead_letters(v1::ListDeadLettersRequest { event_type: "Nope".into(), ..Default::default() })
        .await
        .unwrap_err();
    assert!(bad.message().starts_with("event_type: unknown event type"), "{}", bad.message());
    // A handler name nobody registered is refused as such (a typo is not "no dead letters"),
    // naming the registered ones; a registered handler without dead letters is answered empty.
    let typo = cluster.cli(&["dead-letters", "list", "--handler", "probe-b"]).await;
    assert!(
        !typo.success && typo.stderr.contains("NotFound: handler: no handler named \"probe-b\""),
        "{}",
        typo.stderr
    );
    assert!(typo.stderr.contains("probe-a, search, wrap-up)"), "the registered ones: {}", typo.stderr);
    let none = cluster.cli(&["dead-letters", "list", "--handler", "probe-a"]).await;
    assert!(none.ok().contains("no dead letters"), "{}", none.stdout);
    let unknown = refused(
        admin
            .discard_dead_letters(v1::DeadLetterActionRequest {
                handler: "probe-b".into(),
                all: true,
                operator: "me".into(),
                ..Default::default()
            })
            .await,
    );
    assert_eq!(unknown.code(), tonic::Code::NotFound);
    assert!(unknown.message().starts_with("handler: no handler named"), "{}", unknown.message());
    let missing = admin
        .explain_event(v1::ExplainEventRequest { event_id: "01890000-0000-7000-8000-000000000000".into() })
        .await
        .unwrap_err();
    assert_eq!(missing.code(), tonic::Code::NotFound);
    let cli = cluster.cli(&["events", "explain", "nope"]).await;
    assert!(!cli.success && cli.stderr.contains("InvalidArgument: event_id"), "{}", cli.stderr);

    let mut anonymous = AdminClient::new(cluster.write.channel_with_token(None).await);
    let denied = anonymous.status(v1::StatusRequest {}).await.unwrap_err();
    assert_eq!(denied.code(), tonic::Code::Unauthenticated, "the Admin API is token-protected");
    cluster.stop().await;
}
