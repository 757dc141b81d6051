//! The event catalogue and the retry policy shared by every delivery backend.

use std::time::Duration;

use reelay_contracts::v1::event::Payload;

/// An event a write is about to commit. The outbox gives it its id, timestamp and trace context
/// when it is enqueued.
#[derive(Debug, Clone, PartialEq)]
pub struct NewEvent {
    pub aggregate_id: String,
    pub payload: Payload,
}

impl NewEvent {
    pub fn new(aggregate_id: impl ToString, payload: Payload) -> Self {
        Self { aggregate_id: aggregate_id.to_string(), payload }
    }

    pub fn event_type(&self) -> &'static str {
        event_type(&self.payload)
    }
}

/// The name of an event type: the payload message's name, used in the outbox row, in the NATS
/// subject (`<prefix>.<type>`) and by handlers to subscribe.
pub fn event_type(payload: &Payload) -> &'static str {
    match payload {
        Payload::UserRegistered(_) => "UserRegistered",
        Payload::ReviewLogged(_) => "ReviewLogged",
        Payload::ReviewEdited(_) => "ReviewEdited",
        Payload::ReviewDeleted(_) => "ReviewDeleted",
        Payload::MovieDiscovered(_) => "MovieDiscovered",
        Payload::MovieDeleted(_) => "MovieDeleted",
        Payload::EnrichmentRequested(_) => "EnrichmentRequested",
        Payload::WatchlistItemAdded(_) => "WatchlistItemAdded",
        Payload::WatchlistItemRemoved(_) => "WatchlistItemRemoved",
        Payload::WrapUpRequested(_) => "WrapUpRequested",
        Payload::Followed(_) => "Followed",
        Payload::Unfollowed(_) => "Unfollowed",
        Payload::Blocked(_) => "Blocked",
        Payload::Unblocked(_) => "Unblocked",
        Payload::RemoteReviewSaved(_) => "RemoteReviewSaved",
        Payload::RemoteFollowReceived(_) => "RemoteFollowReceived",
        Payload::RemoteFollowUndone(_) => "RemoteFollowUndone",
        Payload::DiaryImported(_) => "DiaryImported",
        Payload::MovieEnriched(_) => "MovieEnriched",
        Payload::WrapUpCompleted(_) => "WrapUpCompleted",
        Payload::RemoteReviewDeleted(_) => "RemoteReviewDeleted",
        Payload::RemoteFollowAccepted(_) => "RemoteFollowAccepted",
        Payload::ActivityQueued(_) => "ActivityQueued",
        Payload::PosterSynced(_) => "PosterSynced",
        Payload::ImageStored(_) => "ImageStored",
        Payload::PosterConverted(_) => "PosterConverted",
    }
}

/// Every event type, in catalogue order.
pub const EVENT_TYPES: &[&str] = &[
    "UserRegistered",
    "ReviewLogged",
    "ReviewEdited",
    "ReviewDeleted",
    "MovieDiscovered",
    "MovieDeleted",
    "EnrichmentRequested",
    "WatchlistItemAdded",
    "WatchlistItemRemoved",
    "WrapUpRequested",
    "Followed",
    "Unfollowed",
    "Blocked",
    "Unblocked",
    "RemoteReviewSaved",
    "RemoteFollowReceived",
    "RemoteFollowUndone",
    "DiaryImported",
    "MovieEnriched",
    "WrapUpCompleted",
    "RemoteReviewDeleted",
    "RemoteFollowAccepted",
    "ActivityQueued",
    "PosterSynced",
    "ImageStored",
    "PosterConverted",
];

/// First retry delay; doubles per failed attempt.
pub const RETRY_BASE: Duration = Duration::from_secs(5);
/// No retry waits longer than this.
pub const RETRY_CAP: Duration = Duration::from_secs(300);

/// How long to wait before delivering again after `attempt` failed deliveries (1 = the first
/// failure): 5 s, 10 s, 20 s, … capped at 300 s. The SQLite queue and JetStream naks both use it,
/// so the two backends retry on the same schedule.
pub fn retry_backoff(attempt: u32) -> Duration {
    RetryPolicy::default().delay(attempt)
}

/// The total time an event can spend retrying before its last attempt: the sum of the delays
/// between `max_attempts` deliveries. Start-up compares it with the broker's duplicate window.
pub fn retry_horizon(max_attempts: u32) -> Duration {
    RetryPolicy::default().horizon(max_attempts)
}

/// The retry schedule: `base` after the first failure, doubling per attempt, at most `cap`.
/// Production uses the default (5 s, 300 s); tests shorten it by configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    pub base: Duration,
    pub cap: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self { base: RETRY_BASE, cap: RETRY_CAP }
    }
}

impl RetryPolicy {
    pub fn delay(&self, attempt: u32) -> Duration {
        let doublings = attempt.saturating_sub(1).min(16);
        self.base.saturating_mul(1 << doublings).min(self.cap)
    }

    pub fn horizon(&self, max_attempts: u32) -> Duration {
        (1..max_attempts).map(|a| self.delay(a)).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_from_five_seconds_and_caps_at_five_minutes() {
        let secs: Vec<u64> = (1..=9).map(|a| retry_backoff(a).as_secs()).collect();
        assert_eq!(secs, [5, 10, 20, 40, 80, 160, 300, 300, 300]);
        assert_eq!(retry_backoff(0), RETRY_BASE);
        assert_eq!(retry_backoff(u32::MAX), RETRY_CAP);
    }

    #[test]
    fn the_catalogue_lists_every_payload_type_once() {
        use reelay_contracts::v1;
        let samples = [
            Payload::UserRegistered(v1::UserRegistered::default()),
            Payload::ReviewLogged(v1::ReviewLogged::default()),
            Payload::ReviewEdited(v1::ReviewEdited::default()),
            Payload::ReviewDeleted(v1::ReviewDeleted::default()),
            Payload::MovieDiscovered(v1::MovieDiscovered::default()),
            Payload::MovieDeleted(v1::MovieDeleted::default()),
            Payload::EnrichmentRequested(v1::EnrichmentRequested::default()),
            Payload::WatchlistItemAdded(v1::WatchlistItemAdded::default()),
            Payload::WatchlistItemRemoved(v1::WatchlistItemRemoved::default()),
            Payload::WrapUpRequested(v1::WrapUpRequested::default()),
            Payload::Followed(v1::Followed::default()),
            Payload::Unfollowed(v1::Unfollowed::default()),
            Payload::Blocked(v1::Blocked::default()),
            Payload::Unblocked(v1::Unblocked::default()),
            Payload::RemoteReviewSaved(v1::RemoteReviewSaved::default()),
            Payload::RemoteFollowReceived(v1::RemoteFollowReceived::default()),
            Payload::RemoteFollowUndone(v1::RemoteFollowUndone::default()),
            Payload::DiaryImported(v1::DiaryImported::default()),
            Payload::MovieEnriched(v1::MovieEnriched::default()),
            Payload::WrapUpCompleted(v1::WrapUpCompleted::default()),
            Payload::RemoteReviewDeleted(v1::RemoteReviewDeleted::default()),
            Payload::RemoteFollowAccepted(v1::RemoteFollowAccepted::default()),
            Payload::ActivityQueued(v1::ActivityQueued::default()),
            Payload::PosterSynced(v1::PosterSynced::default()),
            Payload::ImageStored(v1::ImageStored::default()),
            Payload::PosterConverted(v1::PosterConverted::default()),
        ];
        let names: Vec<&str> = samples.iter().map(event_type).collect();
        assert_eq!(names, EVENT_TYPES);
    }

    #[test]
    fn horizon_sums_the_waits_between_attempts() {
        assert_eq!(retry_horizon(1), Duration::ZERO);
        assert_eq!(retry_horizon(3), Duration::from_secs(15));
        assert_eq!(retry_horizon(8), Duration::from_secs(5 + 10 + 20 + 40 + 80 + 160 + 300));
        let short = RetryPolicy { base: Duration::from_millis(100), cap: Duration::from_millis(250) };
        assert_eq!(short.horizon(4), Duration::from_millis(100 + 200 + 250));
    }
}
