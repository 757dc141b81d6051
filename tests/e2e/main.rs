//! Reelay's end-to-end tests: real `reelay` processes, real SQLite files, a real nats-server,
//! real gRPC. One test binary (it links once), one module per family of scenarios.

mod admin;
mod bad_input;
mod chaos;
mod cli;
mod delivery_db;
mod delivery_nats;
mod enrichment;
mod faults;
mod federation;
mod handlers;
mod import;
mod k8s;
mod logs;
mod media;
mod metrics;
mod migrations;
mod retention;
mod search;
mod write_events;

/// What a handler of this build needs to run in the test process against `reelay`'s write
/// service: its data dir (the process's) and an authenticated channel.
fn handler_context(reelay: &reelay_harness::Reelay) -> reelay_delivery::HandlerContext {
    let url = format!("http://{}", reelay.addr);
    let write =
        reelay_kit::client::connect_lazy(&url, Some(reelay_harness::TEST_TOKEN), std::time::Duration::from_secs(30))
            .expect("a channel to the write service");
    reelay_delivery::HandlerContext { data_dir: reelay.database.parent().unwrap().to_owned(), write }
}
