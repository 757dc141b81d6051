//! The write service: the only owner of the SQLite database.
//!
//! `api` turns gRPC requests into validated commands, one file per domain service, plus the
//! internal Outbox, Ledger and Admin services; `store` is the SQLite adapter, one file per aggregate,
//! that runs each command as one writer job, writing the change and the events it causes in the
//! same transaction through `reelay_outbox::enqueue_events`. Handlers of the API never open
//! transactions. `request_ids` makes writes that carry a client `request_id` happen at most
//! once. `error` says what each failure (a refusal, a SQLite fault, a failed commit) tells the
//! caller.

mod actor_keys;
mod api;
mod convert;
mod error;
mod merge;
mod request_ids;
mod retention;
mod store;

pub use actor_keys::ActorKeys;
pub use api::mount;
pub use api::{Bus, DeliveryPolicy, mount_internal, note_lease, register_handlers, sample_status};
pub use error::WriteError;
pub use retention::{Retention, purge_expired};
pub use store::{ServerPolicy, Store};

/// Declares the write service's metrics (the ledger's and the merged jobs'), so they are scraped
/// before the first request.
pub fn register_metrics() {
    api::register_ledger_metrics();
    api::register_outbox_metrics();
    merge::register_metrics();
}
