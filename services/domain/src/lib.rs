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
