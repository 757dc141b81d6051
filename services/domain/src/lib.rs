//! Reelay's domain: identifiers, validation rules, the event catalogue and the retry policy.
//!
//! Nothing here does I/O or awaits; storage and transport live in `reelay-outbox`, `reelay-kit`,
//! `reelay-delivery` and the services.

pub mod events;
pub mod ids;
pub mod letterboxd;
pub mod net;
pub mod posters;
pub mod profiles;
pub mod validate;

pub use events::{EVENT_TYPES, NewEvent, RetryPolicy, retry_backoff, retry_horizon};
pub use ids::{EventId, MovieId, ReviewId, UserId, WrapUpId};
pub use validate::ValidationError;

/// The largest `WrapUps.GetWrapUpInputs` answer, in bytes: a year's every entry with its film
/// comes in one message, so its limit is above the other calls' (`REELAY_GRPC_MAX_MESSAGE_BYTES`):
/// a year as large as an import may make (`letterboxd::MAX_ROWS` entries, each with a film of a
/// few hundred bytes) fits.
pub const WRAP_UP_INPUTS_MAX_BYTES: usize = 64 * 1024 * 1024;
