//! The storage side of Reelay's transactional outbox, on SQLite.
//!
//! This crate owns how the database is opened and migrated, the single writer every write
//! transaction goes through, and [`enqueue_events`], the only code that inserts outbox rows. It
//! knows nothing of gRPC or of any broker.

mod db;
pub mod deliveries;
mod enqueue;
pub mod ledger;
mod migrate;
pub mod queue;
mod writer;

pub use db::{DEFAULT_MAX_EVENT_BYTES, Database, DbConfig, Synchronous};
pub use enqueue::{EnqueueError, EnqueuedEvent, enqueue_events};
pub use migrate::{MIGRATOR, migrate, migrate_to};
pub use writer::{CommitError, WriteTx, Writer, sqlite_primary_code};
