//! `federation`: domain events → activities queued for the inboxes they go to.

use reelay_activitypub::documents::{self, Review};
use reelay_contracts::v1::{self, account, event::Payload, queue_deliveries_request::Audience};
use reelay_delivery::{Handler, HandlerError, handle_in_span};

use crate::Remote;

const EVENT_TYPES: &[&str] =
    &["ReviewLogged", "ReviewEdited", "ReviewDeleted", "RemoteFollowReceived", "Followed", "Unfollowed", "Blocked"];

/// The note of a logged or edited review: both events carry the whole review. `$at`: when it
/// was first logged (its note's `published`).
macro_rules! review_note {
    ($r:expr, $at:expr, $updated:expr) => {
        Review {
            user_id: &$r.user_id,
            review_id: &$r.review_id,
            movie_title: &$r.movie_title,
            movie_year: $r.movie_year,
            movie_external_id: &$r.movie_external_id,
            rating: $r.rating,
            body: &$r.body,
            watched_on: &$r.watched_on,
            rewatch: $r.rewatch,
            published_ms: $at,
            updated_ms: $updated,
        }
    };
}

pub struct ActivitiesHandler {
    remote: Remote,
}

impl ActivitiesHandler {
    pub fn new(remote: Remote) -> Self {
        Self { remote }
    }
}

/// The user to whose remote followers the event's activity would go: the author of a review
/// logged, edited or deleted (whether one is sent at all, `handle` decides).
fn followers_of(event: &v1::Event) -> Option<&str> {
    match &event.payload {
        Some(Payload::ReviewLogged(r)) => Some(&r.user_id),
        Some(Payload::ReviewEdited(r)) => Some(&r.user_id),
        Some(Payload::ReviewDeleted(r)) => Some(&r.user_id),
        _ => None,
    }
}

fn remote_target(target: &Option<v1::Account>) -> Option<&str> {
    match target.as_ref()?.kind.as_ref()? {
        account::Kind::ActorUri(uri) => Some(uri),
        account::Kind::UserId(_) => None,
    }
}

#[async_trait::async_trait]
impl Handler for ActivitiesHandler {
    fn name(&self) -> &'static str {
        "federation"
    }

    fn event_types(&self) -> &'static [&'static str] {
        EVENT_TYPES
    }

    fn batches(&self) -> bool {
        true
    }

    /// Most users have no remote follower, and an activity of theirs reaches nobody: the whole
    /// batch's authors are looked up in one read first, and only the events of followed users
    /// get their activity built and queued (the write service looks again when it queues: a
    /// follower arriving in between is one arriving after the review, as before). Should the
    /// lookup fail, every event is handled on its own, as without it.
    async fn handle_batch(&self, events: &[&v1::Event]) -> Vec<Result<(), HandlerError>> {
        // An event without an id goes to `handle`, which refuses it.
        let authors: Vec<Option<&str>> =
            events.iter().map(|e| followers_of(e).filter(|_| !e.event_id.is_empty())).collect();
        let mut asked: Vec<&str> = authors.iter().flatten().copied().collect();
        asked.sort_unstable();
        asked.dedup();
        let followed = if asked.is_empty() {
            None
        } else {
            match self.remote.users_with_followers(&asked).await {
                Ok(followed) => Some(followed),
                Err(status) => {
                    tracing::warn!(code = ?status.code(), message = status.message(),
                        "cannot look up which authors have remote followers; queueing each event's activity");
                    None
                }
            }
        };
        let mut results = Vec::with_capacity(events.len());
        for (event, author) in events.iter().zip(authors) {
            if let (Some(followed), Some(author)) = (&followed, author)
                && !followed.contains(author)
            {
                reelay_delivery::dispatch::event_span(event, self.name())
                    .in_scope(|| tracing::debug!("no remote follower of the author: no activity to send"));
                results.push(Ok(()));
            } else {
                results.push(handle_in_span(self, event).await);
            }
        }
        results
    }

    async fn handle(&self, event: &v1::Event) -> Result<(), HandlerError> {
        let urls = self.remote.urls();
        let at = event.occurred_at_ms;
        let id = event.event_id.as_str();
        if id.is_empty() {
            // Without an event id there is no stable activity id to send.
            return Err(HandlerError::permanent("an event without an id cannot name an activity"));
        }
        match &event.payload {
            Some(Payload::ReviewLogged(r)) => {
                // An imported diary is history, not news: its reviews are in the outbox for a
                // backfill, but not pushed to every follower one by one.
                if r.source == v1::ReviewSource::Import as i32 {
                    return Ok(());
                }
                // Published when the review was logged, as its note served and its Update say
                // (the event is stamped when its batch commits, a moment later).
                let logged = if r.logged_at_ms > 0 { r.logged_at_ms } else { at };
                let activity = documents::create(urls, &review_note!(r, logged, None));
                self.remote.queue_review(&r.user_id, &r.review_id, &activity).await
            }
            Some(Payload::ReviewEdited(r)) => {
                // An import filling in what an imported entry lacked is history too (followers
                // were never sent the entry); its author's edits are news.
                if r.source == v1::ReviewSource::Import as i32 {
                    return Ok(());
                }
                // An event from before it carried the review's first logging has only the edit's time.
                let logged = if r.logged_at_ms > 0 { r.logged_at_ms } else { at };
                let activity = documents::update(urls, id, &review_note!(r, logged, Some(at)));
                self.remote.queue_review(&r.user_id, &r.review_id, &activity).await
            }
            Some(Payload::ReviewDeleted(r)) => {
                let activity = documents::delete(urls, id, &r.user_id, &r.review_id);
                self.remote.queue(&r.user_id, &activity, Audience::Followers(true)).await
            }
            Some(Payload::RemoteFollowReceived(f)) => {
                if f.inbox.is_empty() {
                    tracing::warn!(actor = %f.actor_uri, "a remote follower without an inbox gets no Accept");
                    return Ok(());
                }
                let activity = documents::accept(urls, id, &f.user_id, &f.actor_uri, &f.activity_uri);
                self.remote.queue(&f.user_id, &activity, Audience::Inbox(f.inbox.clone())).await
            }
            Some(Payload::Blocked(b)) => {
                // A remote follower blocked: its server is told its follow is gone.
                let Some(follower) = remote_target(&b.target) else { return Ok(()) };
                if b.removed_follow_uri.is_empty() || b.removed_follower_inbox.is_empty() {
                    return Ok(());
                }
                let activity = documents::reject(urls, id, &b.blocker_id, follower, &b.removed_follow_uri);
                self.remote.queue(&b.blocker_id, &activity, Audience::Inbox(b.removed_follower_inbox.clone())).await
            }
            Some(Payload::Followed(f)) => {
                let Some(target) = remote_target(&f.target) else { return Ok(()) };
                let inbox = self.remote.inbox_of(&f.follower_id, target).await?;
                // Followed again while waiting for its Accept: the follow's own Follow again, the
                // same activity, queued under a key of this event (its first queueing is recorded).
                let again = !f.resends_follow_event_id.is_empty();
                let named = if again { f.resends_follow_event_id.as_str() } else { id };
                let activity = documents::follow(urls, named, &f.follower_id, target);
                let activity_id = activity["id"].as_str().unwrap_or_default();
                let key = if again { format!("{activity_id}#sent-again-{id}") } else { activity_id.to_owned() };
                self.remote.queue_as(&key, &f.follower_id, &activity, Audience::Inbox(inbox)).await
            }
            Some(Payload::Unfollowed(u)) => {
                let Some(target) = remote_target(&u.target) else { return Ok(()) };
                if u.rejected {
                    // The followed actor ended it: nothing to tell it.
                    return Ok(());
                }
                if u.follow_event_id.is_empty() {
                    // A follow from before Follow activities were named after their event.
                    return Ok(());
                }
                let inbox = self.remote.inbox_of(&u.follower_id, target).await?;
                let activity = documents::undo_follow(urls, id, &u.follower_id, &u.follow_event_id, target);
                self.remote.queue(&u.follower_id, &activity, Audience::Inbox(inbox)).await
            }
            _ => Ok(()),
        }
    }
}
