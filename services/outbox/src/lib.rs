//! The storage side of Reelay's transactional outbox, on SQLite.
//!
//! This crate owns how the database is opened and migrated, the single writer every write
//! transaction goes through, and [`enqueue_events`], the only code that inserts outbox rows. It
//! knows nothing of gRPC or of any broker.

mod db;
mod enqueue;
pub mod ledger;
mod migrate;
pub mod queue;
mod writer;

pub use db::{DEFAULT_MAX_EVENT_BYTES, Database, DbConfig, Synchronous};
pub use enqueue::{EnqueueError, EnqueuedEvent, enqueue_events};
pub use migrate::{MIGRATOR, migrate, migrate_to};
pub use writer::{CommitError, TRACEPARENT, WriteTx, Writer, failpoint_armed, sqlite_primary_code};

/// Milliseconds since the Unix epoch: the unit of every timestamp column.
pub fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64)
}
