//! Delivery on the db backend with real processes: per-handler deliveries through the write
//! service's Outbox API, handler subsets and replicas in separate processes, crashes and
//! take-overs, retries, outages, the upgrade of a database with work in flight, and recovery of
//! a killed `reelay run`. Effects are counted by probe handlers (test builds only) in their own
//! SQLite file.

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::time::Duration;

use prost::Message;
use reelay_contracts::v1::{self, search_client::SearchClient};
use reelay_harness::{
    Backend, Clients, Cluster, Reelay, event_ids, eventually, probe_records, query_strings, temp_dir,
};
use reelay_kit::now_ms;

const BIN: &str = env!("CARGO_BIN_EXE_reelay");

async fn effects(path: &Path) -> HashMap<(String, String), usize> {
    probe_records(path, "effects").await.0
}

/// The delivery state of (event, handler): status, attempts, available_at.
async fn delivery(db: &Path, event_id: &str, handler: &str) -> Option<(String, i64, i64)> {
    let rows = query_strings(
        db,
        &format!(
            "SELECT status, CAST(attempts AS TEXT), CAST(COALESCE(available_at, 0) AS TEXT) FROM processed_events \
             WHERE event_id = '{event_id}' AND handler = '{handler}'"
        ),
    )
    .await;
    rows.first().map(|r| (r[0].clone(), r[1].parse().unwrap(), r[2].parse().unwrap()))
}

/// Waits (up to `within`, failing with `what`) until the delivery of (event, handler) has
/// `status`.
async fn delivery_reaches(db: &Path, event_id: &str, handler: &str, status: &str, what: &str, within: Duration) {
    eventually(what, within, || async move { delivery(db, event_id, handler).await.is_some_and(|d| d.0 == status) })
        .await;
}

/// True when the probe handlers have looked at every row and have nothing in flight (the write
/// service also registers `search`, which these tests do not run).
async fn settled(c: &mut reelay_harness::Clients) -> bool {
    let s = c.outbox.stats(v1::StatsRequest {}).await.unwrap().into_inner();
    s.handlers
        .iter()
        .filter(|h| h.handler.starts_with("probe-"))
        .all(|h| h.behind == 0 && h.in_progress == 0 && h.retrying == 0)
}

/// probe-a in one process, probe-b in two replicas of another; one probe-b replica is killed
/// mid-batch. Every (event, handler) effect happens, each once, apart from the one duplicate
/// the ADR accepts (a replica killed after an effect and before its settle): those, if any,
/// must be the killed replica's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handler_subsets_and_replicas_in_separate_processes_apply_each_effect_once() {
    let dir = temp_dir();
    let mut cluster = Cluster::builder(BIN, Backend::Db)
        .probes("probe-a,probe-b")
        .env("REELAY_CONSUMER_BATCH", "16")
        // The killed replica's claims come back after 6 s without renewal (a lease long enough
        // that the live replicas' renewals, slowed by the load, do not lapse).
        .env("REELAY_LEDGER_LEASE_MS", "6000")
        .handlers(&[("REELAY_HANDLERS", "probe-a")])
        .handlers(&[("REELAY_HANDLERS", "probe-b")])
        .handlers(&[("REELAY_HANDLERS", "probe-b"), ("REELAY_PROBE_DELAY_MS", "probe-b=200")])
        .start(dir.path())
        .await;
    let c = cluster.write.clients().await;
    let killed_pid = cluster.handlers[2].pid().to_string();
    let writers: Vec<_> = (0..6)
        .map(|u| {
            let mut c = c.clone();
            tokio::spawn(async move {
                let user = c.user(&format!("user{u}")).await;
                for i in 0..150 {
                    let movie = reelay_harness::movie_ref(&format!("Film {}", i % 40), 2000 + (i % 10));
                    c.review(&user, movie, 7).await;
                }
            })
        })
        .collect();
    // Kill the slow replica while it works.
    let effects_file = cluster.effects.clone();
    let killed = killed_pid.clone();
    eventually("the slow replica is working", Duration::from_secs(30), || {
        let (effects_file, killed) = (effects_file.clone(), killed.clone());
        async move { probe_records(&effects_file, "attempts").await.1.contains(&killed) }
    })
    .await;
    cluster.handlers[2].kill();
    for writer in writers {
        writer.await.unwrap();
    }
    let ids = event_ids(&cluster.db).await;
    assert!(ids.len() >= 900, "{} events", ids.len());
    eventually("every event reaches both handlers", Duration::from_secs(120), || {
        let (effects_file, expected) = (cluster.effects.clone(), ids.len() * 2);
        async move { effects(&effects_file).await.len() == expected }
    })
    .await;
    eventually("nothing is left in flight", Duration::from_secs(30), || {
        let mut c = c.clone();
        async move { settled(&mut c).await }
    })
    .await;
    let counts = effects(&cluster.effects).await;
    let rerun_by: HashMap<(String, String), HashSet<String>> = {
        let rows = query_strings(&cluster.effects, "SELECT event_id, handler, CAST(pid AS TEXT) FROM effects").await;
        rows.into_iter().fold(HashMap::new(), |mut m, r| {
            m.entry((r[0].clone(), r[1].clone())).or_default().insert(r[2].clone());
            m
        })
    };
    for id in &ids {
        assert_eq!(counts.get(&(id.clone(), "probe-a".to_owned())), Some(&1), "probe-a on {id}");
        let b = (id.clone(), "probe-b".to_owned());
        match counts.get(&b) {
            Some(1) => {}
            Some(_) => assert!(rerun_by[&b].contains(&killed_pid), "{id} ran twice, not because of the kill"),
            None => panic!("probe-b never handled {id}"),
        }
    }
    let (_, pids) = probe_records(&cluster.effects, "effects").await;
    for live in &cluster.handlers[..2] {
        assert!(pids.contains(&live.pid().to_string()), "process {} took part: {pids:?}", live.pid());
    }
    // The only attempts spent are the killed replica's claims, taken over (some it had not
    // begun): one each, all probe-b's.
    let spent = query_strings(
        &cluster.db,
        "SELECT handler, CAST(attempts AS TEXT) FROM processed_events WHERE attempts > 0 GROUP BY handler, attempts",
    )
    .await;
    assert!(spent.iter().all(|row| row == &["probe-b", "1"]), "{spent:?}");
    cluster.handlers.truncate(2);
    cluster.stop().await;
}

/// An event that kills the process running it (as an out-of-memory kill would) is given up
/// for that handler after EVENT_QUEUE_MAX_ATTEMPTS runs, each restart of the process having
/// taken its claim back as one: it does not take down every restart for ever, and the handler
/// goes on with the events after it.
#[tokio::test]
async fn an_event_that_kills_its_process_is_given_up_after_its_attempts() {
    let dir = temp_dir();
    let cluster = Cluster::builder(BIN, Backend::Db)
        .probes("probe-a")
        .env("EVENT_QUEUE_MAX_ATTEMPTS", "3")
        .start(dir.path())
        .await;
    let mut c = cluster.write.clients().await;
    let poison = c.user("poison").await;
    let poison = query_strings(
        &cluster.db,
        &format!("SELECT event_id FROM event_queue WHERE aggregate_id = '{poison}' AND event_type = 'UserRegistered'"),
    )
    .await[0][0]
        .clone();
    let env = [
        ("REELAY_PROBE_HANDLERS", "probe-a"),
        ("REELAY_PROBE_DB", cluster.effects.to_str().unwrap()),
        ("REELAY_PROBE_FAIL", "probe-a=abort:poison"),
        // Each run is up and serving before it takes the event and aborts.
        ("REELAY_PROBE_DELAY_MS", "5000"),
    ];
    // The same data dir each time: the same instance, restarted (as a pod's container is).
    let data = dir.path().join("h");
    let mut runs = 0;
    while delivery(&cluster.db, &poison, "probe-a").await.is_none_or(|d| d.0 != "dead_lettered") {
        runs += 1;
        assert!(
            runs <= 4,
            "still not given up after {runs} runs: {:?}",
            delivery(&cluster.db, &poison, "probe-a").await
        );
        let mut handlers = Reelay::start_handlers(BIN, &cluster.write, &data, &env).await;
        // Either this run aborts on the event, or it gave the event up as it took its
        // predecessor's claim back (which it does beside serving, so after its start).
        let given_up =
            reelay_harness::eventually_some("the run aborts or gives the event up", Duration::from_secs(40), || {
                let running = handlers.is_running();
                let db = cluster.db.clone();
                let poison = poison.clone();
                async move {
                    let dead = delivery(&db, &poison, "probe-a").await.is_some_and(|d| d.0 == "dead_lettered");
                    (dead || !running).then_some(dead)
                }
            })
            .await;
        if given_up {
            assert!(handlers.is_running(), "the run that gave the event up lives on");
            // Given up when this run took its claim back: it lives on.
            c.user("after").await;
            let after = event_ids(&cluster.db).await.pop().unwrap();
            delivery_reaches(
                &cluster.db,
                &after,
                "probe-a",
                "done",
                "the next event is handled",
                Duration::from_secs(30),
            )
            .await;
            handlers.stop().await;
            break;
        }
    }
    let (status, attempts, _) = delivery(&cluster.db, &poison, "probe-a").await.unwrap();
    assert_eq!((status.as_str(), attempts), ("dead_lettered", 3));
    let reason = query_strings(
        &cluster.db,
        &format!("SELECT last_error FROM processed_events WHERE event_id = '{poison}' AND handler = 'probe-a'"),
    )
    .await;
    assert!(reason[0][0].contains("stopped while running it"), "{reason:?}");
    cluster.stop().await;
}

/// During a rolling update two builds of a handler claim at once, the newer also taking an
/// event type the older does not: the older stands by while the newer claims (on db it would
/// move the handler's cursor past that type's rows; on nats it would ack that type's messages,
/// which its consumer brings it once the newer build added their subject), so every event is
/// handled, once, by the newer.
#[tokio::test]
async fn an_older_build_of_a_handler_stands_by_while_a_newer_one_claims() {
    older_build_stands_by(Backend::Db).await;
}

pub async fn older_build_stands_by(backend: Backend) {
    let dir = temp_dir();
    let mut cluster = Cluster::builder(BIN, backend)
        .probes("probe-a")
        .handlers(&[("REELAY_PROBE_TYPES", "probe-a=UserRegistered")])
        .start(dir.path())
        .await;
    let mut c = cluster.write.clients().await;
    let ana = c.user("ana").await;
    let first = event_ids(&cluster.db).await;
    eventually("the older build handles the first event", Duration::from_secs(20), || {
        let (effects, first) = (cluster.effects.clone(), first.clone());
        async move { self::effects(&effects).await.contains_key(&(first[0].clone(), "probe-a".into())) }
    })
    .await;

    cluster.add_handlers(&dir.path().join("newer"), &[]).await;
    // A build is noted when its process tells it (as it starts, then every quarter lease) or
    // claims; the events written meanwhile are the older build's or the newer's.
    let builds = "SELECT event_types FROM handler_builds WHERE handler = 'probe-a'";
    eventually("the newer build claims", Duration::from_secs(20), || {
        let (db, mut c) = (cluster.db.clone(), c.clone());
        async move {
            c.user(&format!("waiting{}", now_ms())).await;
            query_strings(&db, builds).await.len() == 2
        }
    })
    .await;
    let before = event_ids(&cluster.db).await.len();
    for i in 0..20 {
        c.user(&format!("user{i}")).await;
        c.movie(&ana, &format!("Film {i}"), 1990 + i).await;
    }
    let written: Vec<String> = event_ids(&cluster.db).await.split_off(before);
    let types = query_strings(&cluster.db, "SELECT DISTINCT event_type FROM event_queue ORDER BY event_type").await;
    assert!(
        types.iter().any(|t| t[0] == "MovieDiscovered") && types.iter().any(|t| t[0] == "UserRegistered"),
        "events of a type only the newer build takes were written: {types:?}"
    );
    eventually("every event written since is handled by probe-a", Duration::from_secs(30), || {
        let (effects, written) = (cluster.effects.clone(), written.clone());
        async move {
            let done = self::effects(&effects).await;
            written.iter().all(|id| done.contains_key(&(id.clone(), "probe-a".to_owned())))
        }
    })
    .await;
    let rows =
        query_strings(&cluster.effects, "SELECT event_id, CAST(pid AS TEXT) FROM effects WHERE handler = 'probe-a'")
            .await;
    let (older, newer) = (cluster.handlers[0].pid().to_string(), cluster.handlers[1].pid().to_string());
    for id in &written {
        let by: Vec<&String> = rows.iter().filter(|r| &r[0] == id).map(|r| &r[1]).collect();
        assert_eq!(by, vec![&newer], "event {id}: once, by the newer build");
    }
    assert!(rows.iter().any(|r| r[1] == older), "the older build ran before the newer came");
    eventually("the older build says it stands by", Duration::from_secs(10), || {
        let log = cluster.handlers[0].log_text();
        async move { log.contains("standing by: another build of this handler claims") }
    })
    .await;
    if backend == Backend::Nats {
        // Keys a standing-by build asked for are counted as such, not as held by another
        // worker: no key was ever held here.
        let claims = cluster.write.metrics().await;
        assert_eq!(claims.sum("reelay_ledger_claims_total", &[r#"outcome="held""#]), 0.0);
    }
    // The operator sees it too.
    let status = cluster.cli(&["status"]).await;
    let status = status.ok();
    let line = status.lines().find(|l| l.starts_with("probe-a: 2 builds live")).unwrap_or_else(|| panic!("{status}"));
    let (handed, standing_by) = line.split_once("; ").unwrap_or_else(|| panic!("{line}"));
    assert!(handed.contains("handed work [") && handed.contains(" types] (heard"), "{line}");
    assert!(standing_by.starts_with("standing by [UserRegistered] (heard"), "{line}");
    cluster.stop().await;
}

/// A consumer dies inside the handler; another takes the delivery over once its lease runs out
/// (it is no longer renewed), under a newer token; the dead owner's late settle changes nothing.
#[tokio::test]
async fn a_killed_consumers_delivery_is_taken_over_and_its_late_settle_refused() {
    let dir = temp_dir();
    let mut cluster = Cluster::builder(BIN, Backend::Db)
        .probes("probe-a")
        // Long enough that a renewal slowed by a loaded machine does not lapse it.
        .env("REELAY_LEDGER_LEASE_MS", "4000")
        .handlers(&[("REELAY_PROBE_DELAY_MS", "600000")])
        .start(dir.path())
        .await;
    let mut c = cluster.write.clients().await;
    c.user("ana").await;
    let event_id = event_ids(&cluster.db).await.remove(0);
    let claim_sql = format!(
        "SELECT status, CAST(started_at AS TEXT) FROM processed_events WHERE event_id = '{event_id}' AND handler = 'probe-a'"
    );
    eventually("the first consumer holds the delivery", Duration::from_secs(20), || {
        let (db, sql) = (cluster.db.clone(), claim_sql.clone());
        async move { query_strings(&db, &sql).await.first().is_some_and(|r| r[0] == "in_progress") }
    })
    .await;
    let stale_token: i64 = query_strings(&cluster.db, &claim_sql).await[0][1].parse().unwrap();
    // A second consumer asks for the delivery all along (and would take it over once a lease
    // ran out), so the first's renewals are what keep it: still its own after twice the lease.
    let mut survivor = Reelay::start_handlers(
        BIN,
        &cluster.write,
        &dir.path().join("survivor"),
        &[("REELAY_PROBE_HANDLERS", "probe-a"), ("REELAY_PROBE_DB", cluster.effects.to_str().unwrap())],
    )
    .await;
    tokio::time::sleep(Duration::from_secs(8)).await;
    assert_eq!(query_strings(&cluster.db, &claim_sql).await[0][1].parse::<i64>().unwrap(), stale_token);
    assert!(effects(&cluster.effects).await.is_empty(), "the second consumer ran nothing");
    cluster.handlers[0].kill();

    delivery_reaches(
        &cluster.db,
        &event_id,
        "probe-a",
        "done",
        "the survivor handles the event",
        Duration::from_secs(30),
    )
    .await;
    assert_eq!(effects(&cluster.effects).await.get(&(event_id.clone(), "probe-a".to_owned())), Some(&1));
    let taken: i64 = query_strings(&cluster.db, &claim_sql).await[0][1].parse().unwrap();
    assert!(taken > stale_token, "the take-over got a newer token");
    assert!(cluster.write.log_text().contains("taking over a delivery"), "the take-over is logged");
    assert_eq!(delivery(&cluster.db, &event_id, "probe-a").await.unwrap().1, 1, "the dead owner's attempt counts");

    // The dead owner's late settle and renewal are refused and change nothing.
    let claim = v1::DeliveryClaim { key: event_id.clone(), token: stale_token };
    let late = c
        .outbox
        .settle_deliveries(v1::SettleDeliveriesRequest {
            handler: "probe-a".into(),
            settlements: vec![v1::DeliverySettlement {
                claim: Some(claim.clone()),
                outcome: Some(v1::delivery_settlement::Outcome::Failed(v1::DeliveryFailure {
                    error: "late".into(),
                    terminal: true,
                })),
            }],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(late.lost, vec![event_id.clone()]);
    let renewed = c
        .outbox
        .renew_deliveries(v1::RenewDeliveriesRequest { handler: "probe-a".into(), claims: vec![claim] })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(renewed.lost, vec![event_id.clone()]);
    assert_eq!(delivery(&cluster.db, &event_id, "probe-a").await.unwrap().0, "done");
    survivor.stop().await;
    cluster.handlers.clear();
    cluster.stop().await;
}

/// Someone else holds (event, probe-a) and stops renewing it: the consumer waits for the lease
/// to run out, then runs the handler: the wait spends no attempt, the lapsed claim's one.
#[tokio::test]
async fn a_claim_held_elsewhere_waits_out_its_lease_and_counts_as_an_attempt_only_once_lapsed() {
    let dir = temp_dir();
    let cluster = probe_a_with_a_3s_lease().start(dir.path()).await;
    let mut c = cluster.write.clients().await;
    c.user("ana").await;
    let event_id = event_ids(&cluster.db).await.remove(0);
    let claim = v1::LedgerClaimRequest {
        keys: vec![v1::LedgerKey { event_id: event_id.clone(), handler: "probe-a".into() }],
        owner: "elsewhere#1".into(),
        ..Default::default()
    };
    let reply = c.ledger.claim(claim.clone()).await.unwrap().into_inner();
    let Some(v1::ledger_claim::Outcome::AcquiredToken(token)) = reply.claims[0].outcome else { panic!("{reply:?}") };
    let again = c.ledger.claim(claim).await.unwrap().into_inner();
    assert_eq!(again.claims[0].outcome, Some(v1::ledger_claim::Outcome::HeldUntilMs(token + 3_000)));

    let started = now_ms();
    let mut handlers = Reelay::start_handlers(
        BIN,
        &cluster.write,
        &dir.path().join("h"),
        &[("REELAY_PROBE_HANDLERS", "probe-a"), ("REELAY_PROBE_DB", cluster.effects.to_str().unwrap())],
    )
    .await;
    delivery_reaches(
        &cluster.db,
        &event_id,
        "probe-a",
        "done",
        "the delivery runs once the other claim lapses",
        Duration::from_secs(20),
    )
    .await;
    let (attempts, _) = probe_records(&cluster.effects, "attempts").await;
    let attempt_at: i64 =
        query_strings(&cluster.effects, "SELECT CAST(MIN(at) AS TEXT) FROM attempts").await[0][0].parse().unwrap();
    assert!(attempt_at >= token + 3_000, "not before the lease ran out ({} ms after start)", attempt_at - started);
    assert_eq!(attempts.len(), 1);
    assert_eq!(delivery(&cluster.db, &event_id, "probe-a").await.unwrap().1, 1, "the lapsed claim's attempt");
    handlers.stop().await;
    cluster.stop().await;
}

#[tokio::test]
async fn a_failing_handler_retries_on_the_backoff_schedule_and_dead_letters() {
    // With 3 attempts allowed, the first failure schedules the next delivery 5 s later.
    let dir = temp_dir();
    let cluster = Cluster::builder(BIN, Backend::Db)
        .probes("probe-a")
        .env("REELAY_PROBE_FAIL", "1")
        .env("EVENT_QUEUE_MAX_ATTEMPTS", "3")
        .handlers(&[])
        .start(dir.path())
        .await;
    let mut c = cluster.write.clients().await;
    let before = now_ms();
    c.user("ana").await;
    let event_id = event_ids(&cluster.db).await.remove(0);
    eventually("the first delivery fails", Duration::from_secs(20), || {
        let (db, id) = (cluster.db.clone(), event_id.clone());
        async move { delivery(&db, &id, "probe-a").await.is_some_and(|d| d.1 == 1) }
    })
    .await;
    let after = now_ms();
    let (status, _, available_at) = delivery(&cluster.db, &event_id, "probe-a").await.unwrap();
    assert_eq!(status, "retry");
    assert!(
        (before + 5_000..=after + 5_000).contains(&available_at),
        "next try 5 s after the failure: {available_at} in [{before}+5s, {after}+5s]"
    );
    let error =
        query_strings(&cluster.db, &format!("SELECT last_error FROM processed_events WHERE event_id = '{event_id}'"))
            .await;
    assert!(error[0][0].contains("fails on purpose"), "{error:?}");
    cluster.stop().await;

    // With one attempt allowed, the first failure dead-letters it for that handler.
    let dir = temp_dir();
    let cluster = Cluster::builder(BIN, Backend::Db)
        .probes("probe-a")
        .env("REELAY_PROBE_FAIL", "1")
        .env("EVENT_QUEUE_MAX_ATTEMPTS", "1")
        .handlers(&[])
        .start(dir.path())
        .await;
    let mut c = cluster.write.clients().await;
    c.user("ana").await;
    let event_id = event_ids(&cluster.db).await.remove(0);
    delivery_reaches(
        &cluster.db,
        &event_id,
        "probe-a",
        "dead_lettered",
        "the delivery is dead-lettered",
        Duration::from_secs(20),
    )
    .await;
    let stats = c.outbox.stats(v1::StatsRequest {}).await.unwrap().into_inner();
    let probe = stats.handlers.iter().find(|h| h.handler == "probe-a").unwrap();
    assert_eq!(probe.dead_lettered, 1);
    assert!(cluster.write.log_text().contains("delivery dead-lettered for this handler"));
    cluster.stop().await;
}

#[tokio::test]
async fn a_write_service_outage_pauses_consumers_without_spending_attempts() {
    let dir = temp_dir();
    // Leases longer than the 4 s outage: a live claim is never taken over.
    let mut cluster = Cluster::builder(BIN, Backend::Db)
        .probes("probe-a")
        .env("REELAY_LEDGER_LEASE_MS", "12000")
        .handlers(&[("REELAY_PROBE_DELAY_MS", "1000")])
        .start(dir.path())
        .await;
    let mut c = cluster.write.clients().await;
    for i in 0..6 {
        c.user(&format!("user{i}")).await;
    }
    let ids = event_ids(&cluster.db).await;
    eventually("the consumer is inside the handler", Duration::from_secs(20), || {
        let db = cluster.db.clone();
        async move { !query_strings(&db, "SELECT 1 FROM processed_events WHERE status = 'in_progress'").await.is_empty() }
    })
    .await;
    cluster.write.kill();
    tokio::time::sleep(Duration::from_secs(4)).await;
    cluster.write.restart().await;
    let mut c = cluster.write.clients().await;
    eventually("everything is delivered after the outage", Duration::from_secs(60), || {
        let mut c = c.clone();
        async move { settled(&mut c).await }
    })
    .await;
    let counts = effects(&cluster.effects).await;
    for id in &ids {
        assert_eq!(counts.get(&(id.clone(), "probe-a".to_owned())), Some(&1), "{id}");
        assert_eq!(delivery(&cluster.db, id, "probe-a").await.unwrap().0, "done");
    }
    let spent = query_strings(&cluster.db, "SELECT CAST(SUM(attempts) AS TEXT) FROM processed_events").await;
    assert_eq!(spent[0][0], "0", "the outage spent no attempt");
    let stats = c.outbox.stats(v1::StatsRequest {}).await.unwrap().into_inner();
    assert_eq!(stats.handlers.iter().map(|h| h.dead_lettered).sum::<u64>(), 0);
    assert!(cluster.handlers[0].log_text().contains("pausing consumption"), "the consumer paused");
    cluster.stop().await;
}

/// A db cluster with probe-a and a 3 s lease (renewed every second).
fn probe_a_with_a_3s_lease() -> reelay_harness::ClusterBuilder {
    Cluster::builder(BIN, Backend::Db).probes("probe-a").env("REELAY_LEDGER_LEASE_MS", "3000")
}

/// Creates a user and waits until probe-a is inside its handler call for the user's event.
async fn a_user_inside_probe_a(cluster: &Cluster, c: &mut reelay_harness::Clients) -> String {
    c.user("ana").await;
    let event_id = event_ids(&cluster.db).await.remove(0);
    delivery_reaches(
        &cluster.db,
        &event_id,
        "probe-a",
        "in_progress",
        "probe-a's claim is written",
        Duration::from_secs(20),
    )
    .await;
    // The claim written is not yet the claim answered: a test that cut the process off now could
    // keep the answer from it, and the run would never start.
    let key = (event_id.clone(), "probe-a".to_owned());
    eventually("probe-a is inside its handler call", Duration::from_secs(20), || async {
        probe_records(&cluster.effects, "attempts").await.0.contains_key(&key)
    })
    .await;
    event_id
}

/// What a claim for probe-a by another replica (no waiting) is handed.
async fn claimed_by_another_replica(c: &mut reelay_harness::Clients) -> Vec<v1::Delivery> {
    let request = v1::ClaimDeliveriesRequest {
        handler: "probe-a".into(),
        event_types: vec!["UserRegistered".into()],
        owner: "another-replica#1".into(),
        max_rows: 10,
        wait_ms: 0,
        max_bytes: 0,
    };
    c.outbox.claim_deliveries(request).await.unwrap().into_inner().deliveries
}

/// What a claim for probe-a by another replica is handed once there is something (the lease of
/// the claim before has run out).
async fn handed_to_another_replica(c: &reelay_harness::Clients) -> Vec<v1::Delivery> {
    reelay_harness::eventually_some("another replica is handed the event", Duration::from_secs(20), || {
        let mut c = c.clone();
        async move { Some(claimed_by_another_replica(&mut c).await).filter(|taken| !taken.is_empty()) }
    })
    .await
}

/// The write service is down for longer than the lease (3 s) while probe-a is inside an 8 s
/// handler call: its renewals fail meanwhile. Once the service is back, a claim that arrives
/// before the worker's next renewal does not take the event over: leases count again from the
/// restart, so every owner gets a whole lease to renew. (The worker itself, unable to renew for
/// five sixths of the lease, has dropped that run by then: it cannot tell the outage from a
/// partition. It takes the event up again once the claim comes back, so the event runs to its
/// end once, never twice at the same time.)
#[tokio::test]
async fn a_claim_is_not_taken_over_because_the_write_service_was_down_for_a_lease() {
    let dir = temp_dir();
    let mut cluster = probe_a_with_a_3s_lease().handlers(&[("REELAY_PROBE_DELAY_MS", "8000")]).start(dir.path()).await;
    let event_id = a_user_inside_probe_a(&cluster, &mut cluster.write.clients().await).await;
    cluster.write.kill();
    tokio::time::sleep(Duration::from_millis(4_500)).await;
    let restarting = now_ms();
    cluster.write.restart().await;
    let mut c = cluster.write.clients().await;
    assert!(claimed_by_another_replica(&mut c).await.is_empty(), "no claim is taken over at the restart");
    // How long the claim is held, as the write service sees it: a whole lease from the restart
    // at least (a slow start-up eats into that lease, so the check below asks before it ends).
    let claim = v1::LedgerClaimRequest {
        keys: vec![v1::LedgerKey { event_id: event_id.clone(), handler: "probe-a".into() }],
        owner: "another-replica#1".into(),
        ..Default::default()
    };
    let reply = c.ledger.claim(claim).await.unwrap().into_inner();
    let Some(v1::ledger_claim::Outcome::HeldUntilMs(until)) = reply.claims[0].outcome else { panic!("{reply:?}") };
    assert!(until >= restarting + 3_000, "held until {until}: a lease from the restart ({restarting}) at least");
    tokio::time::sleep(Duration::from_millis(u64::try_from(until - 1_000 - now_ms()).unwrap_or(0))).await;
    if now_ms() < until - 300 {
        assert!(claimed_by_another_replica(&mut c).await.is_empty(), "nor later within that lease");
    }
    delivery_reaches(&cluster.db, &event_id, "probe-a", "done", "probe-a finishes", Duration::from_secs(30)).await;
    let attempts = query_strings(&cluster.effects, "SELECT COUNT(*) || '' FROM attempts").await;
    assert_eq!(attempts[0][0], "2", "the run dropped in the outage, and the one that finished");
    assert_eq!(effects(&cluster.effects).await.get(&(event_id, "probe-a".to_owned())), Some(&1));
    cluster.stop().await;
}

/// The write service restarts with a shorter lease (18 s, then 3 s) while probe-a is inside a
/// 12 s call. Its worker renews every 6 s, at the pace of the lease it heard: with the new lease
/// counting at once, its claim would look abandoned 3 s after the restart and be handed to
/// another replica while it still runs. The claims made under the longer lease keep it (nothing
/// is taken over before 18 s), and the worker hears the new lease in its next renewal's answer
/// and renews at its pace from then on: the event runs once, to its end.
#[tokio::test]
async fn a_shorter_lease_after_a_restart_takes_no_live_claim_over() {
    let dir = temp_dir();
    let mut cluster = Cluster::builder(BIN, Backend::Db)
        .probes("probe-a")
        .env("REELAY_LEDGER_LEASE_MS", "18000")
        .handlers(&[("REELAY_PROBE_DELAY_MS", "12000")])
        .start(dir.path())
        .await;
    let event_id = a_user_inside_probe_a(&cluster, &mut cluster.write.clients().await).await;
    cluster.write.restart_with(&[("REELAY_LEDGER_LEASE_MS", "3000")]).await;
    let mut c = cluster.write.clients().await;
    let key = (event_id.clone(), "probe-a".to_owned());
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while !effects(&cluster.effects).await.contains_key(&key) {
        assert!(claimed_by_another_replica(&mut c).await.is_empty(), "a live worker's claim was taken over");
        assert!(std::time::Instant::now() < deadline, "probe-a's 12 s run left no effect within a minute");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    delivery_reaches(&cluster.db, &event_id, "probe-a", "done", "probe-a's delivery is done", Duration::from_secs(10))
        .await;
    let attempts = query_strings(&cluster.effects, "SELECT COUNT(*) || '' FROM attempts").await;
    let log = cluster.handlers[0].log_text();
    assert_eq!(attempts[0][0], "1", "one run, not dropped: {log}");
    assert!(log.lines().any(|l| l.contains("the write service's claim lease") && l.contains("3000")), "{log}");
    cluster.stop().await;
}

/// probe-a's process reaches the write service through a proxy, and the network between them
/// is cut while probe-a is in an 8 s call. The write service cannot tell a cut-off worker from a
/// dead one: once the lease (3 s) has run out it hands the event to whoever asks. The cut-off
/// worker, unable to renew for five sixths of the lease, has dropped that work before then, so
/// the event is never run by two at once: the first run leaves no effect.
#[tokio::test]
async fn a_worker_cut_off_from_the_write_service_drops_its_work_before_its_lease_ends() {
    let dir = temp_dir();
    let cluster = probe_a_with_a_3s_lease().start(dir.path()).await;
    let proxy = reelay_harness::CuttingProxy::start(cluster.write.addr).await;
    let mut handlers = crate::slow_probe_behind(&proxy, dir.path(), &cluster.effects, &[]).await;
    let mut c = cluster.write.clients().await;
    let event_id = a_user_inside_probe_a(&cluster, &mut c).await;
    proxy.partition();
    let cut_at = std::time::Instant::now();
    let taken = handed_to_another_replica(&c).await;
    assert_eq!(taken.len(), 1, "the lease ran out: the event is handed to another claimer");
    // The first run would have recorded its effect 8 s after it started.
    tokio::time::sleep(Duration::from_secs(9).saturating_sub(cut_at.elapsed())).await;
    let effects = effects(&cluster.effects).await;
    assert_eq!(effects.get(&(event_id.clone(), "probe-a".to_owned())), None, "the cut-off run was dropped");
    assert!(handlers.log_text().contains("its work is dropped unsettled"), "{}", handlers.log_text());
    let claim = v1::DeliveryClaim { key: taken[0].key.clone(), token: taken[0].token };
    let settled = c
        .outbox
        .settle_deliveries(v1::SettleDeliveriesRequest {
            handler: "probe-a".into(),
            settlements: vec![v1::DeliverySettlement {
                claim: Some(claim),
                outcome: Some(v1::delivery_settlement::Outcome::Done(true)),
            }],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(settled.settled, 1);
    proxy.heal();
    handlers.stop().await;
    cluster.stop().await;
}

/// probe-a's claim answer reaches its worker 2.4 s after the write service made the claim (the
/// proxy holds every answer back, then every request: no renewal gets through). The lease (3 s)
/// counts from the claim, so the write service hands the event to another claimer 3 s after it;
/// the worker counts its own lease from when it asked, not from when the answer came, so the
/// run it starts then is dropped before that point instead of running on (1.5 s) beside the
/// other claimer's: it leaves no effect. (Counted from the answer, it recorded its effect.)
#[tokio::test]
async fn a_claim_answered_late_is_not_worked_on_past_its_lease() {
    let dir = temp_dir();
    let cluster = probe_a_with_a_3s_lease().start(dir.path()).await;
    let mut c = cluster.write.clients().await;
    let (event_id, claimed_at, proxy, mut handlers) =
        crate::a_claim_heard_late(&cluster, &mut c, dir.path(), &[]).await;
    let taken = handed_to_another_replica(&c).await;
    assert_eq!(taken[0].key, event_id);
    // A run started on the late answer would have ended 3.9 s after the claim.
    tokio::time::sleep(Duration::from_secs(6).saturating_sub(claimed_at.elapsed())).await;
    crate::dropped_without_effect(&cluster.effects, &event_id, &handlers, "the late run").await;
    proxy.heal();
    handlers.stop().await;
    cluster.stop().await;
}

/// probe-a's process is frozen (SIGSTOP) inside a 3 s call, for longer than the lease (3 s):
/// another replica is handed the event meanwhile. When the process runs again its call's time
/// is up as well as its lease: the lease comes first, so the run is dropped without taking
/// another step (it would otherwise record its effect beside the other replica's claim).
#[tokio::test]
async fn a_worker_frozen_past_its_lease_does_not_finish_its_run_when_it_wakes() {
    let dir = temp_dir();
    let cluster = probe_a_with_a_3s_lease().handlers(&[("REELAY_PROBE_DELAY_MS", "3000")]).start(dir.path()).await;
    let mut c = cluster.write.clients().await;
    let event_id = a_user_inside_probe_a(&cluster, &mut c).await;
    let taken_over = async { assert_eq!(handed_to_another_replica(&c).await[0].key, event_id) };
    crate::frozen_until_taken_over(&cluster.handlers[0], &cluster.effects, &event_id, taken_over).await;
    cluster.stop().await;
}

#[tokio::test]
async fn a_done_handler_is_skipped_while_its_sibling_still_runs() {
    let dir = temp_dir();
    let cluster = Cluster::builder(BIN, Backend::Db).probes("probe-a,probe-b").start(dir.path()).await;
    let mut c = cluster.write.clients().await;
    c.user("ana").await;
    let event_id = event_ids(&cluster.db).await.remove(0);
    // probe-a already finished this event (through the ledger); probe-b has not.
    let key = v1::LedgerKey { event_id: event_id.clone(), handler: "probe-a".into() };
    let reply = c
        .ledger
        .claim(v1::LedgerClaimRequest { keys: vec![key.clone()], owner: "test#1".into(), ..Default::default() })
        .await
        .unwrap();
    let Some(v1::ledger_claim::Outcome::AcquiredToken(token)) = reply.into_inner().claims[0].outcome else { panic!() };
    let done = c.ledger.complete(v1::LedgerSettleRequest { keys: vec![v1::OwnedKey { key: Some(key), token }] }).await;
    assert_eq!(done.unwrap().into_inner().owned, vec![true]);

    let mut handlers = Reelay::start_handlers(
        BIN,
        &cluster.write,
        &dir.path().join("h"),
        &[("REELAY_PROBE_HANDLERS", "probe-a,probe-b"), ("REELAY_PROBE_DB", cluster.effects.to_str().unwrap())],
    )
    .await;
    delivery_reaches(&cluster.db, &event_id, "probe-b", "done", "probe-b runs", Duration::from_secs(20)).await;
    eventually("nothing is left", Duration::from_secs(10), || {
        let mut c = c.clone();
        async move { settled(&mut c).await }
    })
    .await;
    let counts = effects(&cluster.effects).await;
    assert_eq!(counts.get(&(event_id.clone(), "probe-a".to_owned())), None, "the done handler was skipped");
    assert_eq!(counts.get(&(event_id.clone(), "probe-b".to_owned())), Some(&1), "its sibling ran");
    handlers.stop().await;
    cluster.stop().await;
}

/// A handler that takes events one at a time (as most do), stopped with SIGTERM while it works
/// through a fetched batch of twelve half-second events: it finishes the event it is in, hands
/// the others back and exits, instead of running the whole batch (which may outlast a pod's
/// grace period and be lost with it). What it finished stays done; a new process runs each of
/// the others once. On db the hand-back spends no attempt (JetStream counts a delivery for it).
pub(crate) async fn a_handler_stopped_mid_batch_keeps_what_it_finished_and_hands_back_the_rest(backend: Backend) {
    let dir = temp_dir();
    // The events are all written before the handlers process starts, so one fetch takes them.
    let mut cluster = Cluster::builder(BIN, backend).probes("probe-a").start(dir.path()).await;
    let mut c = cluster.write.clients().await;
    for i in 0..12 {
        c.user(&format!("user{i}")).await;
    }
    let ids = event_ids(&cluster.db).await;
    assert_eq!(ids.len(), 12);
    let one_by_one = [("REELAY_PROBE_ONE_BY_ONE", "1"), ("REELAY_PROBE_DELAY_MS", "500")];
    cluster.add_handlers(&dir.path().join("handlers"), &one_by_one).await;
    eventually("probe-a has started its second event", Duration::from_secs(30), || async {
        probe_records(&cluster.effects, "attempts").await.0.len() >= 2
    })
    .await;
    cluster.handlers[0].stop().await;

    let started = probe_records(&cluster.effects, "attempts").await.0;
    let finished = effects(&cluster.effects).await;
    assert_eq!(started, finished, "every event started before the stop finished");
    assert!(
        finished.len() < ids.len(),
        "the stop did not wait for the whole batch: {} of {} ran",
        finished.len(),
        ids.len()
    );
    assert!(cluster.handlers[0].log_text().contains("handed back the events not yet started"));
    if backend == Backend::Db {
        let now = now_ms();
        for id in ids.iter().filter(|id| !finished.contains_key(&((*id).clone(), "probe-a".to_owned()))) {
            let (status, attempts, available_at) = delivery(&cluster.db, id, "probe-a").await.unwrap();
            assert_eq!((status.as_str(), attempts), ("retry", 0), "{id} is handed back with no attempt spent");
            assert!(available_at <= now, "{id} is due at once, not after a lease");
        }
    }

    cluster.handlers[0].restart().await;
    eventually("every event is handled", Duration::from_secs(60), || async {
        effects(&cluster.effects).await.len() == ids.len()
    })
    .await;
    let (started, finished) = (probe_records(&cluster.effects, "attempts").await.0, effects(&cluster.effects).await);
    for id in &ids {
        let key = (id.clone(), "probe-a".to_owned());
        assert_eq!((started.get(&key), finished.get(&key)), (Some(&1), Some(&1)), "{id} ran once");
    }
    if backend == Backend::Db {
        eventually("every delivery is settled", Duration::from_secs(10), || {
            let mut c = c.clone();
            async move { settled(&mut c).await }
        })
        .await;
        let spent = query_strings(&cluster.db, "SELECT CAST(SUM(attempts) AS TEXT) FROM processed_events").await;
        assert_eq!(spent[0][0], "0", "the stop spent no attempt");
    }
    cluster.stop().await;
}

#[tokio::test]
async fn a_handler_stopped_mid_batch_on_db_keeps_what_it_finished_and_hands_back_the_rest() {
    a_handler_stopped_mid_batch_keeps_what_it_finished_and_hands_back_the_rest(Backend::Db).await;
}

/// A database at the previous schema (migration 0102), its outbox holding rows in every
/// status and a ledger with some work done: after the upgrade, pending and processing work is
/// delivered to every handler once, done work is not redone, dead letters stay dead.
#[tokio::test]
async fn an_upgraded_database_delivers_its_pending_work_to_every_handler_once() {
    let dir = temp_dir();
    let db = dir.path().join("reelay.db");
    let out =
        std::process::Command::new(BIN).args(["migrate", "--to", "102"]).env("REELAY_DATABASE", &db).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let mut rows = Vec::new(); // (event id, status)
    {
        use sqlx::{ConnectOptions, Connection};
        let mut conn = sqlx::sqlite::SqliteConnectOptions::new().filename(&db).connect().await.unwrap();
        for i in 0..40 {
            let status = ["pending", "processing", "done", "dead_lettered"][i % 4];
            let event_id = uuid_v4(i);
            let event = v1::Event {
                event_id: event_id.clone(),
                event_type: "MovieDeleted".into(),
                aggregate_id: format!("m{i}"),
                occurred_at_ms: 1,
                occurred_at_us: 1_000,
                traceparent: String::new(),
                payload: Some(v1::event::Payload::MovieDeleted(v1::MovieDeleted { movie_id: format!("m{i}") })),
            };
            sqlx::query(
                "INSERT INTO event_queue (event_id, event_type, aggregate_id, payload, status, attempts, available_at, created_at, claimed_at) \
                 VALUES (?, 'MovieDeleted', ?, ?, ?, 0, 0, 0, ?)",
            )
            .bind(&event_id)
            .bind(format!("m{i}"))
            .bind(event.encode_to_vec())
            .bind(status)
            .bind((status == "processing").then_some(1i64))
            .execute(&mut conn)
            .await
            .unwrap();
            rows.push((event_id, status));
        }
        // probe-a already finished the first pending row under the old model.
        sqlx::query("INSERT INTO processed_events (event_id, handler, status, started_at, processed_at) VALUES (?, 'probe-a', 'done', 1, 2)")
            .bind(&rows[0].0)
            .execute(&mut conn)
            .await
            .unwrap();
        conn.close().await.unwrap();
    }
    let cluster = Cluster::builder(BIN, Backend::Db)
        .database(&db)
        .probes("probe-a,probe-b")
        .handlers(&[])
        .start(dir.path())
        .await;
    let open: Vec<&(String, &str)> = rows.iter().filter(|(_, s)| matches!(*s, "pending" | "processing")).collect();
    eventually("the pending work reaches both handlers", Duration::from_secs(30), || {
        let (effects_file, expected) = (cluster.effects.clone(), open.len() * 2 - 1);
        async move { effects(&effects_file).await.len() == expected }
    })
    .await;
    let c = cluster.write.clients().await;
    eventually("nothing is left", Duration::from_secs(10), || {
        let mut c = c.clone();
        async move { settled(&mut c).await }
    })
    .await;
    let counts = effects(&cluster.effects).await;
    for (event_id, status) in &rows {
        for handler in ["probe-a", "probe-b"] {
            let n = counts.get(&(event_id.clone(), handler.to_owned())).copied().unwrap_or(0);
            let expected = match *status {
                "pending" | "processing" if event_id == &rows[0].0 && handler == "probe-a" => 0,
                "pending" | "processing" => 1,
                _ => 0,
            };
            assert_eq!(n, expected, "{handler} on a {status} row");
        }
    }
    cluster.stop().await;
}

fn uuid_v4(i: usize) -> String {
    format!("{:08x}-0000-4000-8000-{:012x}", 0x1000 + i, i)
}

/// `reelay run` (default settings, but ten-minute leases) is SIGKILLed during steady writes and
/// restarted at once: every acknowledged review is searchable within seconds of the restart,
/// each once. The restarted process recognises its dead predecessor's claims and takes them back
/// at once: waited out, they would hold the reviews back for ten minutes, past every wait here.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_reelay_run_is_searchable_again_within_seconds_of_its_restart() {
    let dir = temp_dir();
    let db = dir.path().join("reelay.db");
    let mut reelay = Reelay::start_all(BIN, &db, &[("REELAY_LEDGER_LEASE_MS", "600000")]).await;
    let mut c = reelay.clients().await;
    let user = c.user("ana").await;
    let movie = c.review(&user, reelay_harness::movie_ref("Heat", 1995), 8).await.movie_id;
    let acked = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let writer = {
        let (c, acked) = (c.clone(), acked.clone());
        let (user, movie) = (user.clone(), movie.clone());
        tokio::spawn(async move {
            let mut acknowledged = Vec::new();
            for i in 0.. {
                let marker = format!("crashmark{i:04}");
                let request = v1::LogReviewRequest {
                    actor_user_id: user.clone(),
                    movie: reelay_harness::movie_id_ref(&movie),
                    rating: 6,
                    body: format!("{marker} steady"),
                    ..Default::default()
                };
                match c.clone().reviews.log_review(request).await {
                    Ok(_) => {
                        acknowledged.push(marker);
                        acked.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    }
                    Err(_) => return acknowledged,
                }
            }
            acknowledged
        })
    };
    // Killed in the middle of the writes, once a few dozen are acknowledged (however long a
    // slow disk takes to get there).
    eventually("30 reviews are acknowledged", Duration::from_secs(30), || {
        let n = acked.load(std::sync::atomic::Ordering::SeqCst);
        async move { n >= 30 }
    })
    .await;
    reelay.kill();
    let acknowledged = writer.await.unwrap();
    assert!(acknowledged.len() > 20, "{} reviews before the crash", acknowledged.len());
    reelay.restart().await;
    let restarted = std::time::Instant::now();
    let search = SearchClient::new(reelay.handlers_channel().await);
    for marker in &acknowledged {
        eventually(&format!("{marker} is searchable"), Duration::from_secs(15), || {
            let (mut search, marker) = (search.clone(), marker.clone());
            async move {
                let hits = search
                    .search_reviews(v1::SearchReviewsRequest { query: marker.clone(), ..Default::default() })
                    .await
                    .map(|r| r.into_inner().hits)
                    .unwrap_or_default();
                hits.len() == 1
            }
        })
        .await;
    }
    eprintln!("{} acknowledged reviews searchable {:?} after the restart", acknowledged.len(), restarted.elapsed());
    reelay.stop().await;
}

/// Two handlers processes started in one data dir, neither given an instance name: the second
/// runs under a name of its own, so it takes back none of the first's live claims. (Both used to
/// be named after the host and the dir: the second, starting, released the claim of an event the
/// first was still running, the first lost it at its next renewal, and the event ran again.) A
/// process started in the dir after one of them was SIGKILLed takes the dead one's name, and
/// its claims, at once. A second write service on the cluster's database is refused.
#[tokio::test]
async fn processes_sharing_a_data_dir_take_no_claims_from_each_other() {
    let dir = temp_dir();
    // Ten-minute leases: a claim taken over within the waits below was taken back, not waited out.
    let cluster = Cluster::builder(BIN, Backend::Db)
        .probes("probe-a,probe-b")
        .env("REELAY_LEDGER_LEASE_MS", "600000")
        .start(dir.path())
        .await;
    let mut c = cluster.write.clients().await;
    let shared = dir.path().join("shared");
    let effects_db = cluster.effects.to_str().unwrap();
    let env = |handler| {
        [
            ("REELAY_PROBE_HANDLERS", "probe-a,probe-b"),
            ("REELAY_HANDLERS", handler),
            ("REELAY_PROBE_DB", effects_db),
            ("REELAY_PROBE_DELAY_MS", "probe-a=6000"),
        ]
    };
    let mut first = Reelay::start_handlers(BIN, &cluster.write, &shared, &env("probe-a")).await;
    let event_id = a_user_inside_probe_a(&cluster, &mut c).await;
    // The claim's token; the run may end (6 s) before the checks below, so the status may be
    // done, but a release or a take-over would have changed the status or the token.
    let claimed = format!(
        "SELECT status, CAST(started_at AS TEXT) FROM processed_events WHERE event_id = '{event_id}' AND handler = 'probe-a'"
    );
    let token = query_strings(&cluster.db, &claimed).await[0][1].clone();
    let still_claimed = || async {
        let row = query_strings(&cluster.db, &claimed).await.remove(0);
        (row[0] == "in_progress" || row[0] == "done") && row[1] == token
    };

    let mut second = Reelay::start_handlers(BIN, &cluster.write, &shared, &env("probe-b")).await;
    delivery_reaches(
        &cluster.db,
        &event_id,
        "probe-b",
        "done",
        "the second process handled probe-b",
        Duration::from_secs(20),
    )
    .await;
    assert!(still_claimed().await, "the first process's claim is still its own");
    assert!(!second.log_text().contains("took back the claims"), "{}", second.log_text());
    let owner = |process: &Reelay| {
        let log = process.log_text();
        let line = log.lines().find(|l| l.contains("handlers service starting")).map(str::to_owned);
        line.and_then(|l| l.split("owner=").nth(1).and_then(|o| o.split('#').next()).map(str::to_owned)).unwrap()
    };
    assert_eq!(owner(&first).replacen(':', "/2:", 1), owner(&second), "the second runs under the next free name");
    delivery_reaches(&cluster.db, &event_id, "probe-a", "done", "probe-a's run ends", Duration::from_secs(20)).await;
    let (attempts, _) = probe_records(&cluster.effects, "attempts").await;
    assert_eq!(attempts.get(&(event_id.clone(), "probe-a".into())), Some(&1), "probe-a ran the event once");

    // The first is killed inside its run of bob's event; a process started in the dir takes its
    // name (the second still holds the other) and its claim at once, not after the lease.
    c.user("bob").await;
    let bobs = event_ids(&cluster.db).await.into_iter().find(|id| *id != event_id).unwrap();
    delivery_reaches(
        &cluster.db,
        &bobs,
        "probe-a",
        "in_progress",
        "probe-a is inside its run of bob's event",
        Duration::from_secs(20),
    )
    .await;
    let first_name = owner(&first);
    let bobs_claim = claimed.replace(&event_id, &bobs);
    let killed_token = query_strings(&cluster.db, &bobs_claim).await[0][1].clone();
    first.kill();
    let mut third = Reelay::start_handlers(BIN, &cluster.write, &shared, &env("probe-a")).await;
    assert_eq!(owner(&third), first_name);
    // Taken back (claimed anew) at once: the killed claim's ten-minute lease is far off.
    eventually("bob's event is claimed anew", Duration::from_secs(20), || async {
        query_strings(&cluster.db, &bobs_claim).await[0][1] != killed_token
    })
    .await;
    delivery_reaches(&cluster.db, &bobs, "probe-a", "done", "bob's event is handled again", Duration::from_secs(20))
        .await;
    assert!(third.log_text().contains("took back the claims"), "{}", third.log_text());

    let second_dir = dir.path().join("second-writer");
    let (code, stderr) = reelay_harness::refused_at_start(Path::new(BIN), "write", &cluster.db, &second_dir, &[]).await;
    assert_eq!(code, Some(2), "{stderr}");
    let holder = format!("pid {}", cluster.write.pid());
    assert!(stderr.contains("in use by another write service") && stderr.contains(&holder), "{stderr}");
    for process in [&mut second, &mut third] {
        process.stop().await;
    }
    cluster.stop().await;
}

/// An instance name whose lock file another user made (a process of that name ran as root; its
/// successors run as `nobody`, who cannot write the file) is still kept to one live process: the
/// lock is taken on the file opened for reading, a second live process of the name is refused,
/// saying that the run the file names (root's, long gone) may not be the holder, and the name
/// is free again once the first stops. (Were the file opened for writing
/// only, both would run unchecked, with a warning, and each could take back the other's claims.)
#[tokio::test]
async fn an_instance_name_locked_in_another_users_file_is_still_kept_to_one_process() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let dir = temp_dir();
    let mode = |path: &Path, mode: u32| std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
    // What `nobody` needs: the binary (its build dir may be closed to other users) and the dir.
    mode(dir.path(), 0o755);
    let bin = dir.path().join("reelay");
    std::fs::hard_link(BIN, &bin).or_else(|_| std::fs::copy(BIN, &bin).map(drop)).unwrap();
    let as_nobody = dir.path().join("as-nobody");
    let script =
        format!("#!/bin/sh\nexec setpriv --reuid=65534 --regid=65534 --clear-groups -- {} \"$@\"\n", bin.display());
    std::fs::write(&as_nobody, script).unwrap();
    mode(&as_nobody, 0o755);
    let data = dir.path().join("data");
    std::fs::create_dir(&data).unwrap();
    mode(&data, 0o777);
    let env = [("REELAY_INSTANCE", "gateway-1"), ("REELAY_WRITE_URL", "http://127.0.0.1:9")];
    let gateway = |binary: &Path| Reelay::spec(binary.to_str().unwrap(), &data.join("unused.db"), &["gateway"], &env);

    // A gateway alone takes an instance name, as the relay and the handlers do, and starts
    // with nothing else running.
    let mut as_root = Reelay::start(gateway(Path::new(BIN))).await;
    as_root.stop().await;
    let lock = std::fs::read_dir(&data)
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .find(|path| path.file_name().unwrap().to_string_lossy().starts_with(".instance-"))
        .expect("the root run left its instance lock file");
    let meta = std::fs::metadata(&lock).unwrap();
    assert_eq!((meta.uid(), meta.mode() & 0o022), (0, 0), "root's, not writable by others");

    let mut first = Reelay::start(gateway(&as_nobody)).await;
    let uid = std::fs::read_to_string(format!("/proc/{}/status", first.pid())).unwrap();
    assert!(uid.lines().any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(1) == Some("65534")), "{uid}");
    assert!(!first.log_text().contains("cannot lock the instance name"), "{}", first.log_text());

    let (code, stderr) =
        reelay_harness::refused_at_start(&as_nobody, "gateway", &data.join("unused.db"), &data, &env).await;
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("\"gateway-1\" (REELAY_INSTANCE) is in use by a live process"), "{stderr}");
    assert!(stderr.contains("if that run still holds it: the file is another user's"), "{stderr}");

    first.stop().await;
    let mut again = Reelay::start(gateway(&as_nobody)).await;
    assert!(!again.log_text().contains("cannot lock the instance name"), "{}", again.log_text());
    again.stop().await;
}

/// probe-a's claim answer never reaches its process: the proxy between the process and the
/// write service cuts the connection as the answer starts back. The process's next claim names
/// the call it never heard back from, and the write service hands what that call claimed back
/// to it: the event is handled at once, once, instead of after the claim's 30 s lease.
#[tokio::test]
async fn a_claim_answer_that_never_arrived_is_handed_back_to_its_owner() {
    let dir = temp_dir();
    let cluster = Cluster::builder(BIN, Backend::Db).probes("probe-a").start(dir.path()).await;
    let proxy = reelay_harness::CuttingProxy::start(cluster.write.addr).await;
    let mut handlers =
        crate::slow_probe_behind(&proxy, dir.path(), &cluster.effects, &[("REELAY_PROBE_DELAY_MS", "0")]).await;
    let resumed = "reelay_deliveries_resumed_total";
    let event_id = crate::cut_claim_answers_until_one_is_handed_back(&cluster.write, &proxy, resumed, |event_id| {
        let db = cluster.db.clone();
        async move { delivery(&db, &event_id, "probe-a").await.is_some_and(|d| d.0 == "done") }
    })
    .await;
    assert_eq!(cluster.write.metrics().await.value(resumed), Some(1.0));
    let (attempts, _) = probe_records(&cluster.effects, "attempts").await;
    assert_eq!(attempts.get(&(event_id.clone(), "probe-a".to_owned())), Some(&1), "one run: {attempts:?}");
    assert_eq!(delivery(&cluster.db, &event_id, "probe-a").await.unwrap().1, 0, "no attempt spent");
    assert!(cluster.write.log_text().contains("handed deliveries back to their owner"));
    handlers.stop().await;
    cluster.stop().await;
}

/// A claim of up to 10 deliveries of `event_type` for `handler` by `owner`, waiting up to
/// `wait_ms`.
fn claim_of(handler: &str, event_type: &str, owner: &str, wait_ms: u32) -> v1::ClaimDeliveriesRequest {
    v1::ClaimDeliveriesRequest {
        handler: handler.into(),
        event_types: vec![event_type.into()],
        owner: owner.into(),
        max_rows: 10,
        wait_ms,
        max_bytes: 0,
    }
}

/// Checks that `handed` is exactly the ReviewLogged of `review_id`.
fn assert_review_event(handed: &[v1::Delivery], review_id: &str) {
    assert_eq!(handed.len(), 1, "{handed:?}");
    match v1::Event::decode(handed[0].payload.as_slice()).unwrap().payload {
        Some(v1::event::Payload::ReviewLogged(logged)) => assert_eq!(logged.review_id, review_id),
        other => panic!("expected the review's event, got {other:?}"),
    }
}

/// A write service on `db` delivering to probe-a and probe-b, with no ledger purge while a test
/// counts the writer's batches, its clients, and a user whose key pair is stored (so that no
/// background write lands in the batches counted).
async fn write_for_two_probes(db: &Path, extra_env: &[(&str, &str)]) -> (Reelay, Clients, String) {
    let mut env = vec![("REELAY_PROBE_HANDLERS", "probe-a,probe-b"), ("REELAY_LEDGER_PURGE_INTERVAL_MS", "3600000")];
    env.extend_from_slice(extra_env);
    let write = Reelay::start_write(BIN, db, &env).await;
    let mut c = write.clients().await;
    let ana = c.user("ana").await;
    crate::key_pairs_stored(db, 1).await;
    (write, c, ana)
}

/// A handler waiting for events has its claim written in the same commit as the event it is
/// handed: one batch for the write and the claim, no claim job of its own. A waiting claim for
/// other event types is answered with nothing by the same batch (its cursor moves past the
/// review there) and waits on until its deadline.
#[tokio::test]
async fn a_waiting_claim_is_written_with_the_event_it_is_handed() {
    let dir = temp_dir();
    let db = dir.path().join("reelay.db");
    let (mut write, mut c, ana) = write_for_two_probes(&db, &[]).await;
    let claim = |handler: &str, event_type: &str, wait_ms: u32| claim_of(handler, event_type, "test#1", wait_ms);
    // Nothing of either type is waiting to be claimed (ana's UserCreated is neither).
    for handler in ["probe-a", "probe-b"] {
        let due = c.outbox.claim_deliveries(claim(handler, "ReviewLogged", 0)).await.unwrap().into_inner();
        assert!(due.deliveries.is_empty(), "{due:?}");
    }
    let mut outbox = c.outbox.clone();
    let reviews = tokio::spawn(async move { outbox.claim_deliveries(claim("probe-a", "ReviewLogged", 20_000)).await });
    let mut outbox = c.outbox.clone();
    let deletions = tokio::spawn(async move { outbox.claim_deliveries(claim("probe-b", "MovieDeleted", 6_000)).await });
    crate::claims_waiting(&write, 2.0).await;
    let (batches, claim_jobs) = crate::batches_and_jobs(&write, "claim_deliveries").await;

    let review = c.review(&ana, reelay_harness::movie_ref("Heat", 1995), 9).await;
    let handed = reviews.await.unwrap().expect("the waiting claim is answered").into_inner().deliveries;
    assert_review_event(&handed, &review.review_id);
    let (status, _, _) = delivery(&db, &handed[0].key, "probe-a").await.expect("its claim is written");
    assert_eq!(status, "in_progress");
    assert_eq!(
        crate::batches_and_jobs(&write, "claim_deliveries").await,
        (batches + 1.0, claim_jobs),
        "the write and the claim: one batch, no claim job of its own"
    );
    // The claim for MovieDeleted was not handed the review, and waited out its deadline.
    let nothing = deletions.await.unwrap().unwrap().into_inner().deliveries;
    assert!(nothing.is_empty(), "{nothing:?}");
    crate::claims_waiting(&write, 0.0).await;
    write.stop().await;
}

/// A waiting claim whose caller goes away (its call cancelled, as when a handler is killed) is
/// forgotten: the next event is not claimed for it, so nothing waits out a lease, and the next
/// claimer gets the event at once.
#[tokio::test]
async fn a_waiting_claim_whose_caller_went_away_claims_nothing() {
    let dir = temp_dir();
    let db = dir.path().join("reelay.db");
    let mut write = Reelay::start_write(BIN, &db, &[("REELAY_PROBE_HANDLERS", "probe-a")]).await;
    let mut c = write.clients().await;
    let ana = c.user("ana").await;
    let claim = |owner: &str, wait_ms: u32| claim_of("probe-a", "ReviewLogged", owner, wait_ms);
    let mut outbox = c.outbox.clone();
    let gone = tokio::spawn(async move { outbox.claim_deliveries(claim("gone#1", 20_000)).await });
    crate::claims_waiting(&write, 1.0).await;
    gone.abort();
    assert!(gone.await.unwrap_err().is_cancelled());
    // The server drops the cancelled call, and its claim with it.
    crate::claims_waiting(&write, 0.0).await;

    let review = c.review(&ana, reelay_harness::movie_ref("Heat", 1995), 9).await;
    let handed = c.outbox.claim_deliveries(claim("here#1", 5_000)).await.unwrap().into_inner().deliveries;
    // Not held for the claimer that went away.
    assert_review_event(&handed, &review.review_id);
    let owners = query_strings(&db, "SELECT owner FROM processed_events WHERE handler = 'probe-a'").await;
    assert_eq!(owners, vec![vec!["here#1".to_owned()]]);
    write.stop().await;
}

/// What several handlers of one process take, for one ClaimDeliveriesForHandlers call.
fn wants(handlers: &[&str]) -> Vec<v1::HandlerWants> {
    handlers
        .iter()
        .map(|h| v1::HandlerWants { handler: (*h).into(), event_types: vec!["ReviewLogged".into()], max_rows: 10 })
        .collect()
}

/// One call claims for several handlers: bad input is refused naming the field and writes
/// nothing, a handler the write service does not know is refused alone, and a call waiting for
/// events is answered, with every handler's delivery of the new event, by the batch that writes
/// it (one parked claim for the whole call, no claim job of its own).
#[tokio::test]
async fn one_claim_call_serves_several_handlers() {
    let dir = temp_dir();
    let db = dir.path().join("reelay.db");
    let (mut write, mut c, ana) = write_for_two_probes(&db, &[]).await;
    let call = |handlers: Vec<v1::HandlerWants>, wait_ms: u32| v1::ClaimDeliveriesForHandlersRequest {
        handlers,
        owner: "test#1".into(),
        wait_ms,
        ..Default::default()
    };
    let review = c.review(&ana, reelay_harness::movie_ref("Heat", 1995), 8).await;
    let mut twice = wants(&["probe-a", "probe-a"]);
    twice[1].event_types = vec!["MovieDeleted".into()];
    let mut no_rows = wants(&["probe-a"]);
    no_rows[0].max_rows = 0;
    let mut no_types = wants(&["probe-b"]);
    no_types[0].event_types.clear();
    let bad = [
        (call(Vec::new(), 0), "handlers"),
        (call(twice, 0), "handlers.handler"),
        (call(wants(&["Probe A"]), 0), "handlers.handler"),
        (call(no_rows, 0), "handlers.max_rows"),
        (call(no_types, 0), "handlers.event_types"),
        (call(wants(&["probe-a"]), 60_001), "wait_ms"),
        (v1::ClaimDeliveriesForHandlersRequest { owner: String::new(), ..call(wants(&["probe-a"]), 0) }, "owner"),
        (
            v1::ClaimDeliveriesForHandlersRequest { unanswered: (1..=65).collect(), ..call(wants(&["probe-a"]), 0) },
            "unanswered",
        ),
    ];
    for (request, field) in bad {
        let refused = c.outbox.claim_deliveries_for_handlers(request).await.unwrap_err();
        assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused:?}");
        assert!(refused.message().starts_with(&format!("{field}: ")), "{field}: {}", refused.message());
    }
    let claimed = query_strings(&db, "SELECT COUNT(*) || '' FROM processed_events").await;
    assert_eq!(claimed, vec![vec!["0".to_owned()]], "bad calls claimed nothing");
    // An instance name whose claims it would refuse (too long for an owner) is refused too.
    // ("1-2" is the incarnation: with '#', 4 bytes of the owner.)
    for instance in [String::new(), "n".repeat(reelay_domain::MAX_OWNER_BYTES - 3), "a#b".into()] {
        let release = v1::ReleaseInstanceRequest { instance, incarnation: "1-2".into() };
        let refused = c.outbox.release_instance(release).await.unwrap_err();
        assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused:?}");
        assert!(refused.message().starts_with("instance: "), "{}", refused.message());
    }
    // As long as its claims' owner fits, an instance name is taken, whatever start-up allows
    // (an older build's name, during a rolling update).
    let longest = v1::ReleaseInstanceRequest {
        instance: "n".repeat(reelay_domain::MAX_OWNER_BYTES - 4),
        incarnation: "1-2".into(),
    };
    c.outbox.release_instance(longest).await.expect("a name whose owner fits");

    // An unknown handler is refused on its own; the others are served in the same answer.
    let answer =
        c.outbox.claim_deliveries_for_handlers(call(wants(&["probe-a", "nobody"]), 0)).await.unwrap().into_inner();
    let names: Vec<&str> = answer.handlers.iter().map(|h| h.handler.as_str()).collect();
    assert_eq!(names, ["probe-a", "nobody"], "one part per handler, in the order asked");
    assert_review_event(&answer.handlers[0].deliveries, &review.review_id);
    assert!(answer.handlers[0].refused.is_empty(), "{answer:?}");
    assert!(
        answer.handlers[1].deliveries.is_empty() && answer.handlers[1].refused.contains("not registered"),
        "{answer:?}"
    );

    // probe-b has the first review still to claim; once it has, both wait together.
    let answer = c.outbox.claim_deliveries_for_handlers(call(wants(&["probe-b"]), 0)).await.unwrap().into_inner();
    assert_review_event(&answer.handlers[0].deliveries, &review.review_id);
    let mut outbox = c.outbox.clone();
    let waiting = tokio::spawn(async move {
        outbox.claim_deliveries_for_handlers(call(wants(&["probe-b", "probe-a"]), 20_000)).await
    });
    crate::claims_waiting(&write, 1.0).await;
    let (batches, claim_jobs) = crate::batches_and_jobs(&write, "claim_deliveries").await;
    let second = c.review(&ana, reelay_harness::movie_ref("Heat", 1995), 9).await;
    let answer = waiting.await.unwrap().expect("the waiting call is answered").into_inner();
    assert_eq!(answer.handlers.len(), 2, "{answer:?}");
    for (part, handler) in answer.handlers.iter().zip(["probe-b", "probe-a"]) {
        assert_eq!(part.handler, handler);
        assert_review_event(&part.deliveries, &second.review_id);
        let (status, _, _) = delivery(&db, &part.deliveries[0].key, handler).await.expect("its claim is written");
        assert_eq!(status, "in_progress");
    }
    assert_eq!(
        crate::batches_and_jobs(&write, "claim_deliveries").await,
        (batches + 1.0, claim_jobs),
        "the write and both handlers' claims: one batch, no claim job of its own"
    );
    write.stop().await;
}

/// The deliveries claimed for a handlers process whose call went away while the claim's commit
/// was on its way to a slow disk (its deadline passed first) are handed back to its next call
/// naming that call, whether a claim job of its own wrote them or the batch of the event they
/// are for, and after the write service was killed and restarted too; before, they waited out
/// the 30 s lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deliveries_claimed_for_a_call_that_went_away_are_handed_back() {
    let dir = temp_dir();
    let db = dir.path().join("reelay.db");
    // Leases longer than the test: the deliveries handed back stay held by the claimer.
    let (mut write, c, ana) = write_for_two_probes(&db, &[("REELAY_LEDGER_LEASE_MS", "300000")]).await;
    let new_event = |n: usize| {
        let (mut c, ana, db) = (c.clone(), ana.clone(), db.clone());
        async move {
            c.review(&ana, reelay_harness::movie_ref("Heat", 1995), 5 + n as u32).await;
            let reviews = reelay_harness::events_of(&db, "ReviewLogged").await;
            reviews.last().expect("the review's event").event_id.clone()
        }
    };
    let claim = |mut outbox: crate::Outbox, call_id: u64, unanswered: Vec<u64>, wait_ms: u32, deadline: Duration| {
        let mut request = tonic::Request::new(v1::ClaimDeliveriesForHandlersRequest {
            handlers: wants(&["probe-a"]),
            owner: "test#1".into(),
            wait_ms,
            call_id,
            unanswered,
            ..Default::default()
        });
        request.set_timeout(deadline);
        async move {
            let answer = outbox.claim_deliveries_for_handlers(request).await?.into_inner();
            Ok(answer.handlers.into_iter().flat_map(|h| h.deliveries).map(|d| d.key).collect())
        }
    };
    let counts = (
        "reelay_deliveries_resumed_total",
        "SELECT COUNT(*) || '' FROM processed_events WHERE owner = 'test#1' AND status = 'in_progress'",
    );
    let paths = (dir.path(), db.as_path());
    crate::claims_for_a_caller_that_went_away_are_handed_back(&mut write, paths, counts, new_event, claim).await;
    write.stop().await;
}
