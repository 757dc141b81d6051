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

/// The most characters of a failure's text kept (a delivery's, a relay row's, a dead
/// letter's). Handlers' clients send no more, so a batch of long errors never outgrows a
/// message; the relay's texts are the broker's own short errors.
pub const MAX_ERROR_CHARS: usize = 2000;

/// `error` cut to [`MAX_ERROR_CHARS`] characters.
pub fn clip_error(error: &str) -> String {
    error.chars().take(MAX_ERROR_CHARS).collect()
}

/// The longest claimer name (`<instance>#<incarnation>`) the write service takes, in bytes.
pub const MAX_OWNER_BYTES: usize = 200;
/// The longest instance name, in bytes: with `#` and an incarnation (`<pid>-<ms>`, at most 24
/// bytes) it stays within [`MAX_OWNER_BYTES`].
pub const MAX_INSTANCE_BYTES: usize = 160;

/// The largest `WrapUps.GetWrapUpInputs` answer the write service sends, in bytes, when
/// `REELAY_GRPC_MAX_MESSAGE_BYTES` is lower: a year's every entry with its film comes in one
/// message, about 40,000 entries of a few hundred bytes (a heavy diarist logs a thousand a
/// year), while the write service's memory stays within its pod's.
pub const WRAP_UP_INPUTS_MAX_BYTES: usize = 16 * 1024 * 1024;
