//! The Federation service: what the gateway hands over from ActivityPub inboxes, what the
//! federation handlers need to deliver (queued deliveries, signatures), and local users as
//! actors.

use reelay_activitypub::signature::{SIGNED_WITH_BODY, SIGNED_WITHOUT_BODY, outgoing_signing_string};
use reelay_contracts::v1::{self, get_local_actor_request, queue_deliveries_request};
use reelay_domain::{ReviewId, UserId, ValidationError, validate};
use reelay_kit::ServiceError;
use tonic::Request;

use super::{Reply, WriteApi, ok};
use crate::convert;
use crate::store::{Audience, RemoteReview};

/// An optional URI field: empty is `None`.
fn optional_uri(field: &str, value: &str) -> Result<Option<String>, ServiceError> {
    if value.is_empty() { Ok(None) } else { Ok(Some(validate::uri(field, value)?)) }
}

fn uri(field: &str, value: &str) -> Result<String, ServiceError> {
    Ok(validate::uri(field, value)?)
}

/// The most users one `UsersWithFollowers` call asks about.
const MAX_USERS_PER_LOOKUP: usize = 1000;

fn user_id(field: &str, value: &str) -> Result<UserId, ServiceError> {
    Ok(UserId::parse(field, value)?)
}

/// A header value to sign: printable ASCII, bounded.
fn header_value(field: &str, value: &str, required: bool) -> Result<String, ValidationError> {
    if required && value.is_empty() {
        return Err(ValidationError::new(field, "is required"));
    }
    if value.len() > 2048 || !value.chars().all(|c| c == ' ' || c.is_ascii_graphic()) {
        return Err(ValidationError::new(field, "must be at most 2048 printable ASCII characters"));
    }
    Ok(value.to_owned())
}

#[tonic::async_trait]
impl v1::federation_server::Federation for WriteApi {
    async fn save_remote_review(
        &self,
        request: Request<v1::SaveRemoteReviewRequest>,
    ) -> Reply<v1::SaveRemoteReviewResponse> {
        let r = request.into_inner();
        let review = RemoteReview {
            object_uri: uri("object_uri", &r.object_uri)?,
            actor_uri: uri("actor_uri", &r.actor_uri)?,
            movie: convert::movie_spec("movie", r.movie).map_err(ServiceError::from)?,
            rating: validate::rating("rating", r.rating).map_err(ServiceError::from)?,
            body: validate::body("body", &r.body).map_err(ServiceError::from)?,
            published_at_ms: up_to_a_day_ahead("published_at_ms", r.published_at_ms)?,
            edited_at_ms: up_to_a_day_ahead("edited_at_ms", r.edited_at_ms)?,
        };
        let received = optional_uri("received_activity_uri", &r.received_activity_uri)?;
        let saved = self.store.save_remote_review(review, received, r.keep_existing).await?;
        ok(v1::SaveRemoteReviewResponse { remote_review_id: saved.id, created: saved.created, changed: saved.changed })
    }

    async fn delete_remote_review(
        &self,
        request: Request<v1::DeleteRemoteReviewRequest>,
    ) -> Reply<v1::FederationResponse> {
        let r = request.into_inner();
        let object_uri = uri("object_uri", &r.object_uri)?;
        let actor_uri = uri("actor_uri", &r.actor_uri)?;
        let received = optional_uri("received_activity_uri", &r.received_activity_uri)?;
        ok(v1::FederationResponse { changed: self.store.delete_remote_review(object_uri, actor_uri, received).await? })
    }

    async fn delete_remote_actor(
        &self,
        request: Request<v1::DeleteRemoteActorRequest>,
    ) -> Reply<v1::FederationResponse> {
        let r = request.into_inner();
        let actor_uri = uri("actor_uri", &r.actor_uri)?;
        let received = optional_uri("received_activity_uri", &r.received_activity_uri)?;
        ok(v1::FederationResponse { changed: self.store.delete_remote_actor(actor_uri, received).await? })
    }

    async fn receive_follow(&self, request: Request<v1::ReceiveFollowRequest>) -> Reply<v1::FederationResponse> {
        let r = request.into_inner();
        let actor_uri = uri("actor_uri", &r.actor_uri)?;
        let user = user_id("user_id", &r.user_id)?;
        let activity_uri = uri("activity_uri", &r.activity_uri)?;
        let inbox = optional_uri("inbox", &r.inbox)?;
        let shared_inbox = optional_uri("shared_inbox", &r.shared_inbox)?;
        let changed = self.store.receive_follow(actor_uri, user, activity_uri, inbox, shared_inbox).await?;
        ok(v1::FederationResponse { changed })
    }

    async fn receive_undo(&self, request: Request<v1::ReceiveUndoRequest>) -> Reply<v1::FederationResponse> {
        let r = request.into_inner();
        let actor_uri = uri("actor_uri", &r.actor_uri)?;
        let user = if r.user_id.is_empty() { None } else { Some(user_id("user_id", &r.user_id)?) };
        let activity_uri = uri("activity_uri", &r.activity_uri)?;
        let received = optional_uri("received_activity_uri", &r.received_activity_uri)?;
        ok(v1::FederationResponse { changed: self.store.receive_undo(actor_uri, user, activity_uri, received).await? })
    }

    async fn receive_accept(&self, request: Request<v1::ReceiveAcceptRequest>) -> Reply<v1::FederationResponse> {
        let (actor_uri, follow_event_id, received) = answer_to_follow(request.into_inner())?;
        let changed = self.store.receive_accept(actor_uri, follow_event_id, received).await?;
        ok(v1::FederationResponse { changed })
    }

    async fn receive_reject(&self, request: Request<v1::ReceiveAcceptRequest>) -> Reply<v1::FederationResponse> {
        let (actor_uri, follow_event_id, received) = answer_to_follow(request.into_inner())?;
        let changed = self.store.receive_reject(actor_uri, follow_event_id, received).await?;
        ok(v1::FederationResponse { changed })
    }

    async fn get_local_actor(&self, request: Request<v1::GetLocalActorRequest>) -> Reply<v1::LocalActor> {
        let (handle, user) = match request.into_inner().by {
            // Handles are lower-case; an address typed otherwise (`acct:Ana@…`) names the same
            // user, as on other servers.
            Some(get_local_actor_request::By::Handle(handle)) => {
                (Some(validate::handle(&handle.to_ascii_lowercase()).map_err(ServiceError::from)?), None)
            }
            Some(get_local_actor_request::By::UserId(id)) => (None, Some(user_id("user_id", &id)?)),
            None => return Err(ServiceError::invalid("by", "is required (handle or user_id)").into()),
        };
        let mut actor = self.store.local_actor(handle.as_deref(), user).await?;
        if actor.is_none() {
            // A user created before keys existed gets its key pair now.
            let user = match (user, &handle) {
                (Some(user), _) => Some(user),
                (None, Some(handle)) => self.store.user_by_handle(handle).await?,
                (None, None) => None,
            };
            if let Some(user) = user {
                self.keys.ensure(user).await?;
                actor = self.store.local_actor(None, Some(user)).await?;
            }
        }
        let actor = actor.ok_or_else(|| match (&handle, user) {
            (Some(handle), _) => ServiceError::not_found(format_args!("user @{handle}")),
            (None, user) => {
                ServiceError::not_found(format_args!("user {}", user.map(|u| u.to_string()).unwrap_or_default()))
            }
        })?;
        ok(v1::LocalActor {
            user_id: actor.user.id,
            handle: actor.user.handle,
            display_name: actor.user.display_name,
            created_at_ms: actor.user.created_at,
            public_key_pem: actor.public_key_pem,
            followers_count: actor.followers,
            reviews_count: actor.reviews,
        })
    }

    async fn list_outbox(&self, request: Request<v1::ListOutboxRequest>) -> Reply<v1::ListOutboxResponse> {
        let r = request.into_inner();
        let user = user_id("user_id", &r.user_id)?;
        let size = validate::page_size(r.page_size).map_err(ServiceError::from)?;
        let after =
            convert::page_token(&r.page_token, |t| ReviewId::parse("page_token", t)).map_err(ServiceError::from)?;
        let rows = self.store.list_outbox(user, size, after).await?;
        if rows.is_empty() {
            // No reviews, or no such user: the latter is NOT_FOUND, as GetUser answers.
            self.store.get_user(user).await?;
        }
        let next_page_token = if rows.len() == size as usize {
            rows.last().map(|row| row.review.id.clone()).unwrap_or_default()
        } else {
            String::new()
        };
        let reviews = rows
            .into_iter()
            .map(|row| v1::OutboxReview {
                review: Some(convert::review(row.review)),
                movie_title: row.movie_title,
                movie_year: row.movie_year as i32,
                movie_external_id: row.movie_external_id.unwrap_or_default(),
            })
            .collect();
        ok(v1::ListOutboxResponse { reviews, next_page_token })
    }

    async fn queue_deliveries(
        &self,
        request: Request<v1::QueueDeliveriesRequest>,
    ) -> Reply<v1::QueueDeliveriesResponse> {
        let r = request.into_inner();
        let activity_id = uri("activity_id", &r.activity_id)?;
        let sender = user_id("sender_user_id", &r.sender_user_id)?;
        // Each delivery's event carries the activity: one over the events' limit could never be
        // queued, and is refused here, by its own name.
        let max = self.store.database().writer.max_event_bytes();
        if r.activity_json.len() > max {
            return Err(ServiceError::invalid(
                "activity_json",
                format!(
                    "is {} bytes, more than an event may carry (REELAY_MAX_EVENT_BYTES, {max})",
                    r.activity_json.len()
                ),
            )
            .into());
        }
        if serde_json_is_object(&r.activity_json).is_none() {
            return Err(ServiceError::invalid("activity_json", "must be a JSON object").into());
        }
        let audience = match r.audience {
            Some(queue_deliveries_request::Audience::Followers(true)) => Audience::Followers,
            Some(queue_deliveries_request::Audience::Inbox(inbox)) => Audience::Inbox(uri("inbox", &inbox)?),
            _ => return Err(ServiceError::invalid("audience", "is required (followers or inbox)").into()),
        };
        let review = (!r.live_review_id.is_empty())
            .then(|| ReviewId::parse("live_review_id", &r.live_review_id))
            .transpose()
            .map_err(ServiceError::from)?;
        let queued = self.store.queue_deliveries(activity_id, sender, r.activity_json, audience, review).await?;
        ok(match queued {
            Some(q) => v1::QueueDeliveriesResponse {
                queued: q.queued,
                duplicate: false,
                skipped_unavailable: q.skipped_unavailable,
                review_gone: q.review_gone,
            },
            None => v1::QueueDeliveriesResponse { duplicate: true, ..Default::default() },
        })
    }

    async fn record_inbox_outcome(
        &self,
        request: Request<v1::RecordInboxOutcomeRequest>,
    ) -> Reply<v1::FederationResponse> {
        let r = request.into_inner();
        let inbox = uri("inbox", &r.inbox)?;
        ok(v1::FederationResponse { changed: self.store.record_inbox_outcome(inbox, r.answered).await? })
    }

    async fn users_with_followers(
        &self,
        request: Request<v1::UsersWithFollowersRequest>,
    ) -> Reply<v1::UsersWithFollowersResponse> {
        let r = request.into_inner();
        if r.user_ids.len() > MAX_USERS_PER_LOOKUP {
            return Err(ServiceError::invalid(
                "user_ids",
                format!("at most {MAX_USERS_PER_LOOKUP} per call, got {}", r.user_ids.len()),
            )
            .into());
        }
        let users = r
            .user_ids
            .iter()
            .enumerate()
            .map(|(i, id)| user_id(&format!("user_ids[{i}]"), id))
            .collect::<Result<Vec<_>, _>>()?;
        let followed = self.store.users_with_followers(&users).await?;
        // Answered in the caller's own spelling of each id, each once.
        let mut user_ids: Vec<String> =
            r.user_ids.into_iter().zip(&users).filter(|(_, user)| followed.contains(user)).map(|(id, _)| id).collect();
        user_ids.sort_unstable();
        user_ids.dedup();
        ok(v1::UsersWithFollowersResponse { user_ids })
    }

    async fn remove_followers_at(
        &self,
        request: Request<v1::RemoveFollowersAtRequest>,
    ) -> Reply<v1::FederationResponse> {
        let r = request.into_inner();
        let user = user_id("user_id", &r.user_id)?;
        let inbox = uri("inbox", &r.inbox)?;
        ok(v1::FederationResponse { changed: self.store.remove_followers_at(user, inbox).await? })
    }

    async fn sign_http_request(
        &self,
        request: Request<v1::SignHttpRequestRequest>,
    ) -> Reply<v1::SignHttpRequestResponse> {
        let r = request.into_inner();
        let user = user_id("user_id", &r.user_id)?;
        let method = header_value("method", &r.method, true).map_err(ServiceError::from)?;
        let path = header_value("path", &r.path, true).map_err(ServiceError::from)?;
        if !path.starts_with('/') {
            return Err(ServiceError::invalid("path", "must start with '/'").into());
        }
        let host = header_value("host", &r.host, true).map_err(ServiceError::from)?;
        let date = header_value("date", &r.date, true).map_err(ServiceError::from)?;
        let digest = header_value("digest", &r.digest, false).map_err(ServiceError::from)?;
        let digest = (!digest.is_empty()).then_some(digest);
        let headers = if digest.is_some() { SIGNED_WITH_BODY } else { SIGNED_WITHOUT_BODY };
        let string = outgoing_signing_string(&method, &path, &host, &date, digest.as_deref());
        let signature = self.keys.sign(user, string.as_bytes()).await?;
        ok(v1::SignHttpRequestResponse { headers: headers.to_owned(), signature })
    }
}

fn serde_json_is_object(text: &str) -> Option<()> {
    serde_json::from_str::<serde_json::Value>(text).ok().filter(serde_json::Value::is_object).map(|_| ())
}

/// The checked fields of an Accept or a Reject of a local user's Follow: who answered, the
/// Follow's event id, the activity received.
fn answer_to_follow(r: v1::ReceiveAcceptRequest) -> Result<(String, String, Option<String>), ServiceError> {
    let actor_uri = uri("actor_uri", &r.actor_uri)?;
    let follow_event_id =
        reelay_domain::EventId::parse("follow_event_id", &r.follow_event_id).map_err(ServiceError::from)?.to_string();
    let received = optional_uri("received_activity_uri", &r.received_activity_uri)?;
    Ok((actor_uri, follow_event_id, received))
}

/// A remote date in ms, from 0 to a day ahead of this clock: another server's clock may run
/// ahead, by a day at most (the gateway's bound too); a date further on would sort first among
/// the film's reviews, or win over every later edit, for ever.
fn up_to_a_day_ahead(field: &str, ms: i64) -> Result<i64, ServiceError> {
    const DAY_MS: i64 = 24 * 3600 * 1000;
    if !(0..=reelay_kit::now_ms() + DAY_MS).contains(&ms) {
        return Err(ServiceError::invalid(field, format!("must be from 0 to a day from now, got {ms}")));
    }
    Ok(ms)
}
