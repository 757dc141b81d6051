//! The write service: the only owner of the SQLite database.
//!
//! `api` turns gRPC requests into validated commands; `store` is the SQLite adapter that runs
//! each command as one writer job, writing the change and the events it causes in the same
//! transaction through `reelay_outbox::enqueue_events`. Handlers of the API never open
//! transactions.

mod api;
mod convert;
mod internal;
mod store;

pub use api::mount;
pub use internal::{DeliveryPolicy, mount_internal, purge_ledger};
pub use store::Store;
