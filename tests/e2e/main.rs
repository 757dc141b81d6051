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
