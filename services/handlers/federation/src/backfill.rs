//! `federation-backfill`: once a remote actor accepts a local user's follow, its reviews so far
//! are read from its outbox (signed GETs, newest page first) and saved, keyed by object id.
//!
//! The walk is bounded, since the outbox is another server's: at most `max_pages` pages, the
//! first [`ITEMS_PER_PAGE`] items of each, and [`TIME_BUDGET`] in all (inside the handler's
//! timeout, a minute by default: a walk cut by the timeout would start again at the first page
//! on every retry, and end a dead letter). A later page that cannot be had for good (gone, not
//! JSON, too large) ends the walk with what it saved; one that may come later (unreachable, busy)
//! is retried, and the retry's saves of the pages before repeat nothing.

use reelay_activitypub::documents::{id_of, same_origin};
use reelay_activitypub::note::{NoteError, read_review};
use reelay_contracts::v1::{self, event::Payload};
use reelay_delivery::{Handler, HandlerError};
use serde_json::Value;

use crate::Remote;
use crate::remote::write_error;

/// The items of one page looked at (Mastodon's pages hold 20).
const ITEMS_PER_PAGE: usize = 100;
/// How long one backfill walks, from its start, before it reads no further page: with the
/// default fetch timeout (10 s) a last page fetched at its end still ends inside the handler's
/// default timeout (60 s).
const TIME_BUDGET: std::time::Duration = std::time::Duration::from_secs(40);

pub struct BackfillHandler {
    remote: Remote,
    max_pages: u32,
}

impl BackfillHandler {
    pub fn new(remote: Remote, max_pages: u32) -> Self {
        Self { remote, max_pages }
    }

    /// Saves one outbox item when it is a `Create` of a review by `actor`; true when saved.
    async fn save(&self, actor: &str, item: &Value) -> Result<bool, HandlerError> {
        if item.get("type").and_then(Value::as_str) != Some("Create") {
            return Ok(false);
        }
        let Some(object) = item.get("object").filter(|o| o.is_object()) else { return Ok(false) };
        let note = match read_review(object) {
            Ok(note) if note.attributed_to == actor && same_origin(&note.object_uri, actor) => note,
            Ok(_) | Err(NoteError::NotAReview(_) | NoteError::NotPublic | NoteError::Invalid(_)) => return Ok(false),
        };
        // An outbox's Creates: a copy saved meanwhile is kept unless this one's edit is known
        // to be later.
        let request = note.into_save_request("", true);
        match self.remote.write().save_remote_review(request).await {
            Ok(_) => Ok(true),
            // Unfollowed meanwhile, or a review the write service will not take (one it holds
            // as another actor's among them): skip it, and go on with the rest.
            Err(status)
                if matches!(
                    status.code(),
                    tonic::Code::FailedPrecondition | tonic::Code::InvalidArgument | tonic::Code::PermissionDenied
                ) =>
            {
                tracing::debug!(code = ?status.code(), message = status.message(), "skipped a backfilled review the write service refused");
                Ok(false)
            }
            Err(status) => Err(write_error(status)),
        }
    }
}

#[async_trait::async_trait]
impl Handler for BackfillHandler {
    fn name(&self) -> &'static str {
        "federation-backfill"
    }

    fn event_types(&self) -> &'static [&'static str] {
        &["RemoteFollowAccepted"]
    }

    async fn handle(&self, event: &v1::Event) -> Result<(), HandlerError> {
        let Some(Payload::RemoteFollowAccepted(accepted)) = &event.payload else { return Ok(()) };
        // From the start: the actor, its outbox and the first page are fetched within it too.
        let started = std::time::Instant::now();
        let (user, actor_uri) = (accepted.follower_id.as_str(), accepted.actor_uri.as_str());
        let actor = self.remote.fetch(user, actor_uri).await?;
        let Some(outbox) = actor.get("outbox").and_then(Value::as_str) else { return Ok(()) };
        let collection = self.remote.fetch(user, outbox).await?;
        let mut page = match collection.get("first") {
            Some(Value::String(url)) => self.remote.fetch(user, url).await?,
            Some(embedded @ Value::Object(_)) => embedded.clone(),
            _ => collection,
        };
        let (mut pages, mut saved) = (1, 0);
        loop {
            let items = page.get("orderedItems").or_else(|| page.get("items")).and_then(Value::as_array);
            for item in items.into_iter().flatten().take(ITEMS_PER_PAGE) {
                saved += usize::from(self.save(actor_uri, item).await?);
            }
            let next = page.get("next").and_then(id_of).map(str::to_owned);
            let Some(next) = next.filter(|_| pages < self.max_pages) else { break };
            if started.elapsed() >= TIME_BUDGET {
                tracing::info!(actor = %actor_uri, pages, "the backfill's time is up; later pages are not read");
                break;
            }
            page = match self.remote.fetch(user, &next).await {
                Ok(page) => page,
                Err(HandlerError::Permanent(error)) => {
                    tracing::warn!(actor = %actor_uri, page = %next, %error, "an outbox page cannot be read; the backfill ends there");
                    break;
                }
                Err(error) => return Err(error),
            };
            pages += 1;
        }
        tracing::info!(actor = %actor_uri, pages, saved, "backfilled a followed actor's reviews");
        Ok(())
    }
}
