//! The server kit every Reelay service is built on: the shared error codes and the
//! [`ServiceErrorCode`] trait each crate's error implements, telemetry set-up and the request's
//! trace context, the one gRPC server builder (health, reflection, service-token auth, limits,
//! deadlines, panic catching, trace context, graceful shutdown) and the client side, the
//! shutdown signal, the one backoff, the clock and the test-only failpoints; the metrics
//! registry and the admin HTTP port (`/metrics`, `/healthz`, `/readyz`); and the serving of a
//! public HTTP router with the limits a listener open to anyone needs.
//!
//! It must not know about storage or delivery: no sqlx, no outbox, no handlers. Crates map their
//! own errors into [`ErrorCode`] instead of this crate knowing their error types.

pub mod admin_http;
pub mod backoff;
pub mod client;
pub mod error;
mod failpoints;
pub mod grpc;
pub mod http;
pub mod metrics;
pub mod service;
pub mod shutdown;
pub mod telemetry;

pub use admin_http::{Readiness, ReadyFlag};
pub use backoff::Backoff;
pub use error::{ErrorCode, ServiceError, ServiceErrorCode, grpc_status};
pub use failpoints::failpoint_armed;
pub use grpc::{GrpcConfig, GrpcServer};
pub use service::Service;
pub use shutdown::Shutdown;

/// Milliseconds since the Unix epoch: the unit of every timestamp Reelay stores or sends.
pub fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64)
}
