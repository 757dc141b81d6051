//! Typed identifiers. Every id is a UUID on the wire and in SQLite (as lowercase text).

use std::fmt;

use uuid::Uuid;

use crate::ValidationError;

macro_rules! uuid_id {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(Uuid);

        impl $name {
            /// A new, time-ordered id (UUID v7), so ids sort by creation.
            pub fn new() -> Self {
                Self(Uuid::now_v7())
            }

            /// Parses the id carried in request field `field`.
            pub fn parse(field: &str, value: &str) -> Result<Self, ValidationError> {
                if value.is_empty() {
                    return Err(ValidationError::new(field, "is required"));
                }
                Uuid::try_parse(value)
                    .map(Self)
                    .map_err(|_| ValidationError::new(field, format!("is not a valid UUID: {value:?}")))
            }

            pub fn as_uuid(&self) -> Uuid {
                self.0
            }
        }

        impl Default for $name {
            fn default() -> Self {
                Self::new()
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                self.0.as_hyphenated().fmt(f)
            }
        }
    };
}

uuid_id!(
    /// A local user.
    UserId
);
uuid_id!(
    /// A movie known to this instance.
    MovieId
);
uuid_id!(
    /// A diary entry (review) of a local user, or a remote review saved from federation.
    ReviewId
);
uuid_id!(
    /// A yearly wrap-up.
    WrapUpId
);

/// The id of one event: the dedup key of the broker (`Nats-Msg-Id`) and of the ledger.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct EventId(Uuid);

impl Default for EventId {
    fn default() -> Self {
        Self::new()
    }
}

impl EventId {
    /// A fresh, time-ordered id (UUID v7). The ledger's key and the outbox's index of event ids
    /// then grow at their end: with random ids (v4) every claim and settlement touched a
    /// different page of a ledger that keeps 30 days of pairs (BENCHMARKS.md).
    pub fn new() -> Self {
        Self(Uuid::now_v7())
    }

    pub fn parse(field: &str, value: &str) -> Result<Self, ValidationError> {
        Uuid::try_parse(value)
            .map(Self)
            .map_err(|_| ValidationError::new(field, format!("is not a valid UUID: {value:?}")))
    }
}

impl fmt::Display for EventId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.as_hyphenated().fmt(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Event ids are the ledger's key: a later one sorts after an earlier one (as stored, in
    /// lowercase text), so the ledger grows at its end.
    #[test]
    fn event_ids_sort_by_creation() {
        let first = EventId::new();
        std::thread::sleep(std::time::Duration::from_millis(2));
        let (second, third) = (EventId::new(), EventId::new());
        assert!(first.to_string() < second.to_string(), "{first} then {second}");
        assert_ne!(second, third);
        assert_eq!(EventId::parse("event_id", &third.to_string()).unwrap(), third);
    }

    #[test]
    fn ids_round_trip_and_reject_garbage() {
        let id = ReviewId::new();
        assert_eq!(ReviewId::parse("review_id", &id.to_string()).unwrap(), id);
        let err = ReviewId::parse("review_id", "nope").unwrap_err();
        assert_eq!(err.field, "review_id");
        assert!(err.to_string().contains("nope"), "{err}");
        assert_eq!(UserId::parse("user_id", "").unwrap_err().field, "user_id");
    }

    #[test]
    fn v7_ids_sort_by_creation() {
        let a = MovieId::new();
        let b = MovieId::new();
        assert!(a.to_string() < b.to_string());
    }
}
