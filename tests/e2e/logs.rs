//! Logs: a handler's span continues the trace of the write that raised the event, so one trace
//! id appears in the write's log line and in every handler's line for that event, on both
//! backends; and text logs carry no colour codes when they do not go to a terminal.

use std::time::Duration;

use reelay_contracts::v1;
use reelay_harness::{Backend, Cluster, eventually, temp_dir};

const BIN: &str = env!("CARGO_BIN_EXE_reelay");

async fn one_trace_from_write_to_handlers(backend: Backend) {
    let dir = temp_dir();
    let cluster = Cluster::builder(BIN, backend)
        .probes("probe-a,probe-b")
        .env("RUST_LOG", "info,reelay_kit=debug,reelay_delivery=debug")
        .env("REELAY_LOG_FORMAT", "json")
        .handlers(&[("REELAY_HANDLERS", "probe-a")])
        .handlers(&[("REELAY_HANDLERS", "probe-b"), ("REELAY_LOG_FORMAT", "text")])
        .start(dir.path())
        .await;
    let mut c = cluster.write.clients().await;
    let user = c.user("ana").await;
    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let mut request = tonic::Request::new(v1::LogReviewRequest {
        actor_user_id: user,
        movie: reelay_harness::movie_ref("Heat", 1995),
        rating: 9,
        body: "traced".into(),
        ..Default::default()
    });
    request.metadata_mut().insert("traceparent", format!("00-{trace_id}-00f067aa0ba902b7-01").parse().unwrap());
    c.reviews.log_review(request).await.unwrap();

    let json_field = format!("\"trace_id\":\"{trace_id}\"");
    let text_field = format!("trace_id={trace_id}");
    eventually("both handlers log the write's trace id", Duration::from_secs(20), || {
        let (a, b) = (cluster.handlers[0].log_text(), cluster.handlers[1].log_text());
        let (json_field, text_field) = (json_field.clone(), text_field.clone());
        async move {
            let handled = |log: &str, field: &str| {
                log.lines().any(|l| l.contains(field) && l.contains("event handled") && l.contains("ReviewLogged"))
            };
            handled(&a, &json_field) && handled(&b, &text_field)
        }
    })
    .await;
    let write_log = cluster.write.log_text();
    assert!(
        write_log.lines().any(|l| l.contains(&json_field) && l.contains("LogReview")),
        "the write's line carries the trace id:\n{write_log}"
    );
    let text_log = cluster.handlers[1].log_text();
    assert!(!text_log.contains('\u{1b}'), "no ANSI escape codes in a log file:\n{text_log}");
    cluster.stop().await;
}

#[tokio::test]
async fn one_trace_runs_from_the_write_to_every_handler_on_the_db_backend() {
    one_trace_from_write_to_handlers(Backend::Db).await;
}

#[tokio::test]
async fn one_trace_runs_from_the_write_to_every_handler_on_the_nats_backend() {
    one_trace_from_write_to_handlers(Backend::Nats).await;
}
