//! Delivering events to handlers, on every backend: the [`Handler`] trait, the event sources
//! (outbox rows through the Outbox API, JetStream, core NATS) with their `AckHandle`, the
//! ledger-guarded dispatch, the consumer loop, and the JetStream set-up the relay shares.
//!
//! It does not link sqlx: handler processes never touch SQLite, and reach the outbox and the
//! ledger only through the write service's gRPC APIs.

pub mod consumer;
pub mod core_source;
pub mod db_source;
pub mod dispatch;
mod gather;
pub mod given_up;
pub mod handler;
pub mod jetstream;
pub mod nats_source;
mod pause;
pub mod source;

pub use handler::{BuiltHandler, Handler, HandlerContext, HandlerError, MountGrpc, handle_in_span};
