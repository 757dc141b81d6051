//! Reelay's end-to-end tests: real `reelay` processes, real SQLite files, a real nats-server,
//! real gRPC. One test binary (it links once), one module per family of scenarios.

mod bad_input;
mod chaos;
mod delivery_db;
mod delivery_nats;
mod enrichment;
mod faults;
mod federation;
mod handlers;
mod import;
mod logs;
mod migrations;
mod search;
mod write_events;
