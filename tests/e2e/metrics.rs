//! Every service serves Prometheus text, `/healthz` and `/readyz` on its admin port: scraped
//! while load runs, the counters move, and once the load has settled they agree with the
//! database and with what the test did (calls made, events written, dead letters).

use std::time::Duration;

use reelay_harness::{
    Backend, Cluster, Metrics, Reelay, eventually, http_get, outbox_rows, query_strings, temp_dir, unsettled,
};

const BIN: &str = env!("CARGO_BIN_EXE_reelay");
const USERS: usize = 120;

async fn count(cluster: &Cluster, sql: &str) -> f64 {
    query_strings(&cluster.db, &format!("SELECT ({sql}) || ''")).await[0][0].parse().unwrap()
}

fn processes(cluster: &Cluster) -> Vec<(&'static str, &Reelay)> {
    let mut all = vec![("write", &cluster.write)];
    if let Some(relay) = &cluster.relay {
        all.push(("relay", relay));
    }
    all.extend(cluster.handlers.iter().map(|h| ("handlers", h)));
    all
}

async fn counters_agree_with_the_database(backend: Backend) {
    let dir = temp_dir();
    let cluster = Cluster::builder(BIN, backend)
        .probes("probe-a,probe-b")
        .env("REELAY_PROBE_FAIL", "probe-a=permanent:refused")
        .handlers(&[])
        .start(dir.path())
        .await;
    for (service, process) in processes(&cluster) {
        assert_eq!(process.admin_get("/healthz").await.0, 200, "{service} is alive");
        eventually(&format!("{service} is ready"), Duration::from_secs(10), || async {
            process.admin_get("/readyz").await.0 == 200
        })
        .await;
    }

    // Load from four clients, in two waves, while every service is scraped.
    let write = &cluster.write;
    let wave = |users: std::ops::Range<usize>| {
        futures_util::future::join_all((0..4).map(move |client| {
            let users = users.clone();
            async move {
                let mut c = write.clients().await;
                for i in users {
                    let handle =
                        if i % 10 == 0 { format!("refused_{client}_{i}") } else { format!("user_{client}_{i}") };
                    c.user(&handle).await;
                }
            }
        }))
    };
    let scrapes = || async {
        for _ in 0..10 {
            for (_, process) in processes(&cluster) {
                process.metrics().await;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    let created = r#"reelay_grpc_requests_total{method="/reelay.v1.Users/CreateUser",code="0"}"#;
    tokio::join!(wave(0..USERS / 8), scrapes());
    // The counters are the calls answered so far, not a figure kept for later.
    assert_eq!(cluster.write.metrics().await.value(created), Some((USERS / 2) as f64), "half the users");
    tokio::join!(wave(USERS / 8..USERS / 4), scrapes());
    let refused = (0..4).map(|_| (0..USERS / 4).filter(|i| i % 10 == 0).count()).sum::<usize>() as f64;

    eventually("every event settled for both probes", Duration::from_secs(60), || {
        let cluster = &cluster;
        async move {
            let done =
                count(cluster, "SELECT COUNT(*) FROM processed_events WHERE status IN ('done', 'dead_lettered')").await;
            done == 2.0 * USERS as f64
                && unsettled(&cluster.db, backend == Backend::Nats, &["probe-a", "probe-b"]).await.is_empty()
        }
    })
    .await;

    // The write service: calls, group commits, outbox rows and dead letters.
    let write = cluster.write.metrics().await;
    assert_eq!(write.value(created), Some(USERS as f64), "one CreateUser per user");
    assert!(write.sum("reelay_writer_batch_jobs_count", &[]) > 0.0);
    assert!(
        write.declares("reelay_writer_commit_seconds") && write.sum("reelay_writer_commit_seconds_count", &[]) > 0.0
    );
    assert!(
        write.value(r#"reelay_writer_job_seconds_count{job="create_user"}"#) >= Some(USERS as f64),
        "every CreateUser is a timed write job"
    );
    if backend == Backend::Db {
        // The probes' claims are merged jobs: each answers one or more of them.
        let jobs = write.value(r#"reelay_writer_merged_requests_count{job="claim_deliveries"}"#);
        let answered = write.value(r#"reelay_writer_merged_requests_sum{job="claim_deliveries"}"#);
        assert!(jobs > Some(0.0) && answered >= jobs, "merged claims: {jobs:?} jobs answered {answered:?}");
    }
    let rows = outbox_rows(&cluster.db).await.len() as f64;
    assert_eq!(rows, USERS as f64);
    for status in ["pending", "processing", "done", "dead_lettered"] {
        let stored = count(&cluster, &format!("SELECT COUNT(*) FROM event_queue WHERE status = '{status}'")).await;
        assert_eq!(write.value(&format!(r#"reelay_outbox_rows{{status="{status}"}}"#)), Some(stored), "{status} rows");
    }
    let dead =
        count(&cluster, "SELECT COUNT(*) FROM processed_events WHERE status = 'dead_lettered' AND handler = 'probe-a'")
            .await;
    assert_eq!(dead, refused);
    assert_eq!(write.value(r#"reelay_dead_letters{handler="probe-a"}"#), Some(dead), "dead letters metric = rows");
    assert_eq!(write.value(r#"reelay_dead_letters{handler="probe-b"}"#), Some(0.0));
    assert_eq!(write.value("reelay_outbox_oldest_due_age_seconds"), Some(0.0), "nothing waits");

    // The handlers: every delivery counted by outcome, and timed.
    let handlers = cluster.handlers[0].metrics().await;
    let deliveries = |handler: &str, outcome: &str| {
        handlers
            .value(&format!(r#"reelay_handler_deliveries_total{{handler="{handler}",outcome="{outcome}"}}"#))
            .unwrap_or(0.0)
    };
    assert_eq!(deliveries("probe-b", "done"), USERS as f64);
    assert_eq!(deliveries("probe-a", "done"), USERS as f64 - refused);
    assert_eq!(deliveries("probe-a", "dead_lettered"), refused, "handler counters agree with the dead letters");
    assert!(handlers.sum("reelay_handler_batch_duration_seconds_count", &[r#"handler="probe-b""#]) > 0.0);
    assert!(handlers.0.contains(r#"reelay_handler_batch_duration_seconds_bucket{handler="probe-b",le="0.005"}"#));

    match backend {
        Backend::Nats => {
            let relay = cluster.relay.as_ref().unwrap().metrics().await;
            assert_eq!(relay.value(r#"reelay_relay_published_total{outcome="stored"}"#), Some(USERS as f64));
            assert_eq!(relay.value("reelay_relay_deferred_total"), Some(0.0));
            // Every ledger claim on nats goes through the Ledger API: one per (event, probe).
            let claims = write.sum("reelay_ledger_claims_total", &[r#"outcome="acquired""#]);
            assert_eq!(claims, 2.0 * USERS as f64);
        }
        Backend::Db => {
            // The handlers of one process claim together, in one call for all that ask at once.
            let claims = |m: &Metrics| {
                m.sum("reelay_grpc_requests_total", &[r#"method="/reelay.v1.Outbox/ClaimDeliveriesForHandlers""#])
            };
            assert!(claims(&write) > 0.0, "the handlers claim through the Outbox API");
        }
    }
    // Labels come from bounded sets: a made-up method is counted as `unknown`.
    let path = tonic::codegen::http::uri::PathAndQuery::from_static("/made.up.Service/Method");
    let mut grpc = tonic::client::Grpc::new(cluster.write.channel().await);
    grpc.ready().await.unwrap();
    let codec = tonic_prost::ProstCodec::<v1_empty::Empty, v1_empty::Empty>::default();
    let _ = grpc.unary(tonic::Request::new(v1_empty::Empty {}), path, codec).await;
    let write = cluster.write.metrics().await;
    assert!(!write.0.contains("made.up"), "no label value from a caller");
    assert!(write.sum("reelay_grpc_requests_total", &[r#"method="unknown""#]) >= 1.0);
    cluster.stop().await;
}

mod v1_empty {
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Empty {}
}

#[tokio::test]
async fn counters_agree_with_the_database_on_the_db_backend() {
    counters_agree_with_the_database(Backend::Db).await;
}

#[tokio::test]
async fn counters_agree_with_the_database_on_the_nats_backend() {
    counters_agree_with_the_database(Backend::Nats).await;
}

/// The services one port's gRPC reflection lists, in version v1 or v1alpha (two generated
/// APIs of the same shape).
async fn reflected(channel: reelay_harness::AuthedChannel, alpha: bool) -> Vec<String> {
    macro_rules! list_services {
        ($version:ident) => {{
            use tonic_reflection::pb::$version::{
                ServerReflectionRequest, server_reflection_client::ServerReflectionClient,
                server_reflection_request::MessageRequest, server_reflection_response::MessageResponse,
            };
            let request = ServerReflectionRequest {
                message_request: Some(MessageRequest::ListServices(String::new())),
                ..Default::default()
            };
            let mut client = ServerReflectionClient::new(channel);
            let stream = futures_util::stream::iter([request]);
            let mut answers = client.server_reflection_info(stream).await.unwrap().into_inner();
            match answers.message().await.unwrap().and_then(|a| a.message_response) {
                Some(MessageResponse::ListServicesResponse(list)) => list.service.into_iter().map(|s| s.name).collect(),
                other => panic!("{other:?}"),
            }
        }};
    }
    if alpha { list_services!(v1alpha) } else { list_services!(v1) }
}

/// Each port's reflection lists the services it serves, not every service of the protos (a
/// client following it called methods answered UNIMPLEMENTED), in both reflection versions.
#[tokio::test]
async fn reflection_lists_what_each_port_serves() {
    let dir = temp_dir();
    let mut reelay = Reelay::start_all(BIN, &dir.path().join("reelay.db"), &[]).await;
    for alpha in [false, true] {
        let write = reflected(reelay.channel().await, alpha).await;
        assert!(
            write.iter().any(|s| s == "reelay.v1.Admin") && write.iter().any(|s| s == "reelay.v1.Reviews"),
            "{write:?}"
        );
        assert!(!write.iter().any(|s| s == "reelay.v1.Search"), "{write:?}");
        let handlers = reflected(reelay.handlers_channel().await, alpha).await;
        assert!(handlers.iter().any(|s| s == "reelay.v1.Search"), "{handlers:?}");
        assert!(!handlers.iter().any(|s| s == "reelay.v1.Admin"), "{handlers:?}");
        assert!(handlers.iter().any(|s| s == "grpc.health.v1.Health"), "{handlers:?}");
    }
    reelay.stop().await;
}

/// A write batch that hangs (strace holds the write service's fsyncs 4 s each) shows in
/// `reelay_writer_busy_seconds` while it hangs, and the gauge is back to 0 once it commits.
#[tokio::test]
async fn a_hung_write_batch_shows_in_the_writer_busy_gauge() {
    const BUSY: &str = "reelay_writer_busy_seconds";
    let dir = temp_dir();
    let mut write = Reelay::start_write(BIN, &dir.path().join("reelay.db"), &[]).await;
    async fn busy(write: &Reelay) -> f64 {
        write.metrics().await.value(BUSY).expect("the gauge is served")
    }
    assert!(busy(&write).await < 1.0, "an idle writer");
    let slow = reelay_harness::Strace::delay(write.pid(), "fsync,fdatasync", Duration::from_secs(4), dir.path()).await;
    let mut c = write.clients().await;
    // Its answer waits for the commit; whether it comes within the call's deadline is not the
    // point here.
    let call = tokio::spawn(async move { c.user("ana").await });
    eventually("the gauge shows the writer on one batch for seconds", Duration::from_secs(30), || async {
        busy(&write).await >= 2.0
    })
    .await;
    let _ = call.await;
    // Detached after the call's commit, so strace has logged the fsyncs it held.
    assert!(slow.stop().await > 0, "the fsyncs waited");
    eventually("the gauge is back to 0 once the batch committed", Duration::from_secs(30), || async {
        busy(&write).await == 0.0
    })
    .await;
    write.stop().await;
}

/// With a shutdown delay (the gateway's in `k8s/`), SIGTERM makes the process not ready at
/// once, and it goes on answering new connections (a gateway page, a write) until the delay
/// ends, when it stops as always and exits cleanly. Without the delay it closes its listeners
/// at once, refusing what a load balancer still sends it.
#[tokio::test]
async fn a_shutdown_delay_serves_on_not_ready_after_sigterm() {
    let dir = temp_dir();
    let db = dir.path().join("reelay.db");
    let spec = Reelay::spec(BIN, &db, &["write", "gateway"], &[("REELAY_SHUTDOWN_DELAY_MS", "12000")]);
    let mut reelay = Reelay::start(spec).await;
    let ana = reelay.clients().await.user("ana").await;
    assert_eq!(reelay.admin_get("/readyz").await.0, 200);

    reelay.terminate();
    eventually("the process reports not ready after SIGTERM", Duration::from_secs(5), || async {
        reelay.admin_get("/readyz").await.0 == 503
    })
    .await;
    // Each on a new connection, as a load balancer's late ones would come.
    let (code, body) = http_get(reelay.gateway_addr, &format!("/users/{ana}")).await;
    assert_eq!(code, 200, "the gateway serves on during the delay: {body}");
    let mut late = Reelay::clients_via(reelay.addr).await;
    late.user("ben").await;
    reelay.exits_cleanly_within(Duration::from_secs(30)).await;
    let users = query_strings(&db, "SELECT handle FROM users ORDER BY handle").await;
    assert_eq!(users, [["ana"], ["ben"]], "the write taken during the delay is kept");
}
