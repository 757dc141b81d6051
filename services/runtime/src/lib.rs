//! What every Reelay service is built on: the shared error codes, telemetry set-up, the one gRPC
//! server builder (health, reflection, service-token auth, limits, deadlines, panic catching,
//! trace context, graceful shutdown) and the shutdown signal.

pub mod client;
pub mod consumer;
pub mod core_source;
pub mod db_source;
pub mod dispatch;
pub mod error;
pub mod grpc;
pub mod handler;
pub mod jetstream;
pub mod nats_source;
mod pause;
pub mod probe;
pub mod service;
pub mod shutdown;
pub mod source;
pub mod telemetry;

pub use error::{ErrorCode, ServiceError};
pub use grpc::{GrpcConfig, GrpcServer};
pub use handler::{Handler, HandlerError};
pub use service::Service;
pub use shutdown::Shutdown;
