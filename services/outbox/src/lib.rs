//! The storage side of Reelay's transactional outbox, on SQLite.
//!
//! This crate owns how the database is opened and migrated, the single writer every write
//! transaction goes through, and [`enqueue_events`] (with [`enqueue_replay`] for an operator's
//! replay), the only code that inserts outbox rows; what operators look at and do
//! ([`inspect`], [`dead_letters`]). It knows nothing of gRPC or of any broker.

mod db;
pub mod dead_letters;
pub mod deliveries;
mod enqueue;
pub mod inspect;
pub mod ledger;
mod migrate;
#[cfg(test)]
mod plans;
pub mod queue;
#[cfg(test)]
mod test_support;
mod writer;

pub use db::{DEFAULT_MAX_EVENT_BYTES, Database, DbConfig, Synchronous, query_plan};
pub use enqueue::{EnqueueError, EnqueuedEvent, enqueue_events, enqueue_replay};
pub use migrate::{MIGRATOR, migrate, migrate_to};
pub use writer::{
    AfterCommit, CommitError, Durability, Rider, WriteTx, Writer, register_metrics, sqlite_primary_code, stale_before,
};
