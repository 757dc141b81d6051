//! The inboxes: per user (`/users/<id>/inbox`) and shared (`/inbox`).
//!
//! Checks, in order, each refusing before anything is written:
//! 1. the body is at most `max_body_bytes` (413; the body limit layer);
//! 2. a per-user inbox names a local user (404);
//! 3. a `Signature` header parses, covers `(request-target) host date digest` (401; `(created)`
//!    may stand for `date`), and the `Host` it signs is this server's public one (401);
//! 4. the signed time is within the allowed skew: 12 h old at most, 1 h ahead at most, as
//!    Mastodon allows (401): the `Date` header when the signature covers it, its `created`
//!    parameter when it has one (and when it covers `(created)` in place of `date`, the `Date`
//!    header, unsigned, is not looked at);
//! 5. the `Digest` matches the body (401);
//! 6. the signer's key (fetched and cached; fetched again once if the cached one fails) verifies
//!    the signature (401; why a key could not be had is logged, not answered; 503 when a retry
//!    may pass: its server unreachable, or fetched from too often, see `remote_keys`). The key
//!    must be one its actor publishes, and the actor the one its document's own URL serves.
//!    When the key id's own document answers 410 Gone (a deleted account's actor, whose key id
//!    is `<actor>#main-key`), nothing in the request can be authenticated; the one activity
//!    then taken is that actor's `Delete` of itself, on the proof of a 410 fetched again here
//!    (see [`Gateway::take_in_from_gone`]), and anything else is refused (401);
//! 7. the body is a JSON activity (400) whose `id` is on the signer's server (400).
//!
//! An activity whose `actor` is not its signer is accepted and ignored (202), as Mastodon
//! does: a server forwards activities of others (a reply's, a Delete's) to their followers,
//! signed with its own key, and a refusal would only be retried for days.
//!
//! Then the activity goes to the write service (`Follow`, `Undo` of a Follow, `Accept` and
//! `Reject` of our Follows, `Create`/`Update`/`Delete` of reviews, the `Delete` of an actor by
//! itself: its account deleted), which records its id so a repeat changes nothing. Activities Reelay does not act on are accepted and ignored (202), as Mastodon does.

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use reelay_activitypub::documents::{id_of, same_origin};
use reelay_activitypub::note::{NoteError, read_review};
use reelay_activitypub::signature::{SignatureParams, digest_matches};
use reelay_activitypub::time::{http_date_age_secs, now_ms};
use reelay_contracts::v1::{self, get_local_actor_request};
use serde_json::Value;

use crate::remote_keys::{KeyFetchError, KeySource, RemoteActor};
use crate::{Gateway, from_status, refuse};

/// How old a signed request's date may be, and how far ahead of our clock.
const MAX_AGE_SECS: i64 = 12 * 3600;
const MAX_AHEAD_SECS: i64 = 3600;

pub(crate) async fn user_inbox(
    State(gw): State<Gateway>,
    Path(id): Path<String>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    // The same answer as the actor's own document: 404 for an id that names nobody.
    if let Err(answer) = gw.local_actor(get_local_actor_request::By::UserId(id.clone())).await {
        return answer;
    }
    gw.take_in(Some(id), &method, &uri, &headers, body).await
}

pub(crate) async fn shared_inbox(
    State(gw): State<Gateway>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    gw.take_in(None, &method, &uri, &headers, body).await
}

fn header_text(headers: &HeaderMap, name: &str) -> Option<String> {
    let values: Vec<&str> = headers.get_all(name).iter().filter_map(|v| v.to_str().ok()).collect();
    (!values.is_empty()).then(|| values.join(", "))
}

fn accepted() -> Response {
    StatusCode::ACCEPTED.into_response()
}

/// Why a signed request's signer is not verified.
enum Unverified {
    /// The answer to give.
    Refused(StatusCode, String),
    /// The signer's key could not be had because a document its fetch led to, `url`, answered
    /// 410 Gone. A deleted account's own `Delete` may still be taken (see
    /// [`Gateway::take_in_from_gone`]); anything else is `refused`.
    Gone { url: String, key_id: String, refused: (StatusCode, String) },
}

impl Gateway {
    /// Checks the signature of a request: the signer when it holds, why not otherwise.
    async fn verify(
        &self,
        method: &Method,
        uri: &Uri,
        headers: &HeaderMap,
        body: &[u8],
    ) -> Result<RemoteActor, Unverified> {
        let unauthorized = |reason: String| Err(Unverified::Refused(StatusCode::UNAUTHORIZED, reason));
        let Some(header) = header_text(headers, "signature") else {
            return unauthorized("the request is not signed (no Signature header)".into());
        };
        let params = match SignatureParams::parse(&header) {
            Ok(params) => params,
            Err(error) => return unauthorized(error.to_string()),
        };
        if let Err(error) = params.require_coverage(true) {
            return unauthorized(error.to_string());
        }
        // The signed Host must be this server's: a request signed for another server (whose
        // inbox has the same path) is not one to take in here.
        let host = header_text(headers, "host").unwrap_or_default();
        if !self.config.urls.is_own_host(&host) {
            return unauthorized(format!(
                "the request was signed for host {host:?}, not this server's {:?} (REELAY_PUBLIC_URL)",
                self.config.urls.host()
            ));
        }
        if params.headers.iter().any(|h| h == "date") {
            let Some(age) = header_text(headers, "date").as_deref().and_then(http_date_age_secs) else {
                return unauthorized("the Date header is missing or not an HTTP date".into());
            };
            if !(-MAX_AHEAD_SECS..=MAX_AGE_SECS).contains(&age) {
                return unauthorized(format!("the request's date is outside the allowed window ({age} s old)"));
            }
        }
        // Saturating: `created` is the caller's number, and any i64 parses.
        if let Some(created) = params.created
            && !(-MAX_AHEAD_SECS..=MAX_AGE_SECS).contains(&(now_ms() / 1000).saturating_sub(created))
        {
            return unauthorized("the signature's created time is outside the allowed window".into());
        }
        if params.expires.is_some_and(|expires| expires < now_ms() / 1000) {
            return unauthorized("the signature has expired".into());
        }
        match header_text(headers, "digest") {
            Some(digest) if digest_matches(&digest, body) => {}
            Some(_) => return unauthorized("the Digest does not match the body".into()),
            None => return unauthorized("the Digest header is missing".into()),
        }
        let path = uri.path_and_query().map_or(uri.path(), |p| p.as_str());
        let signing_string = match params.signing_string(method.as_str(), path, |h| header_text(headers, h)) {
            Ok(string) => string,
            Err(error) => return unauthorized(error.to_string()),
        };
        // Why a key could not be had stays in this log: the key id is the caller's to choose,
        // and what fetching it met (a refused connection, a status, a body) is not the
        // caller's to learn.
        // A failure that may pass (the signer's server unreachable or busy, or fetched from too
        // often this minute) is a 503, which a sender retries; a 401 it may take as final.
        let no_key = |error: KeyFetchError| {
            tracing::warn!(key_id = %params.key_id, %error, "refused a signed request: no usable key for its keyId");
            let status = if error.is_transient() { StatusCode::SERVICE_UNAVAILABLE } else { StatusCode::UNAUTHORIZED };
            let refused = (status, format!("no usable key could be fetched for keyId {:?}", params.key_id));
            match error.gone() {
                Some(url) => Err(Unverified::Gone { url: url.to_owned(), key_id: params.key_id.clone(), refused }),
                None => Err(Unverified::Refused(refused.0, refused.1)),
            }
        };
        let (mut signer, source) = match self.keys.get(&params.key_id, false).await {
            Ok(key) => (key.actor, key.source),
            Err(error) => return no_key(error),
        };
        if !signer.key.verify(signing_string.as_bytes(), &params.signature) {
            match source {
                // The key that stood in (its server could not be asked) may be an old one: the
                // sender's retry may find the new one fetched.
                KeySource::StandIn => {
                    return Err(Unverified::Refused(
                        StatusCode::SERVICE_UNAVAILABLE,
                        format!("the key of keyId {:?} cannot be fetched again just now", params.key_id),
                    ));
                }
                // Fetched just now: no newer key to be had.
                KeySource::Fetched => {
                    return unauthorized("the signature does not verify with the signer's key".into());
                }
                // The actor may have rotated it since it was cached.
                KeySource::Cached => {}
            }
            signer = match self.keys.get(&params.key_id, true).await {
                Ok(key) => key.actor,
                Err(error) => return no_key(error),
            };
            if !signer.key.verify(signing_string.as_bytes(), &params.signature) {
                return unauthorized("the signature does not verify with the signer's key".into());
            }
        }
        Ok((*signer).clone())
    }

    async fn take_in(
        &self,
        user: Option<String>,
        method: &Method,
        uri: &Uri,
        headers: &HeaderMap,
        body: Bytes,
    ) -> Response {
        let signer = match self.verify(method, uri, headers, &body).await {
            Ok(signer) => signer,
            Err(Unverified::Refused(status, reason)) => return refuse(status, reason),
            Err(Unverified::Gone { url, key_id, refused }) => {
                return self.take_in_from_gone(&url, &key_id, &body, refused).await;
            }
        };
        // This server's own actors are its users: they follow, block and review through its
        // API, where a block and a follow of oneself are refused. Taken in over federation (a
        // user following another, or themselves, by actor URI), they would pass those checks.
        if self.config.urls.is_local(&signer.actor_uri) {
            tracing::info!(actor = %signer.actor_uri, "refused an activity of this server's own actor");
            return refuse(StatusCode::FORBIDDEN, "actor: an actor of this server sends it nothing over federation");
        }
        let activity: Value = match serde_json::from_slice(&body) {
            Ok(Value::Object(object)) => Value::Object(object),
            Ok(_) => return refuse(StatusCode::BAD_REQUEST, "an activity must be a JSON object"),
            Err(error) => return refuse(StatusCode::BAD_REQUEST, format!("the body is not JSON: {error}")),
        };
        let (Some(kind), Some(id)) = (activity.get("type").and_then(Value::as_str), id_of(&activity)) else {
            return refuse(StatusCode::BAD_REQUEST, "an activity needs an id and a type");
        };
        if activity.get("actor").and_then(id_of) != Some(signer.actor_uri.as_str()) {
            tracing::info!(kind, activity = id, signer = %signer.actor_uri, "ignored an activity whose actor is not its signer (forwarded?)");
            return accepted();
        }
        // An activity's id is recorded so that a repeat changes nothing: one naming another
        // server would let its signer take that server's id first (a Delete's predictable
        // `<note>#delete`), and the real activity would then be ignored as a repeat.
        if !same_origin(id, &signer.actor_uri) {
            return refuse(StatusCode::BAD_REQUEST, "id: the activity's id is on another server than its actor");
        }
        let outcome = match kind {
            "Follow" => self.follow(&signer, user, id, &activity).await,
            "Undo" => self.undo(&signer, user, id, &activity).await,
            "Accept" => self.accept(&signer, id, &activity, false).await,
            "Reject" => self.accept(&signer, id, &activity, true).await,
            "Create" | "Update" => self.save_review(&signer, id, &activity, kind == "Create").await,
            "Delete" => self.delete_review(&signer, id, &activity).await,
            _ => Ok(false),
        };
        match outcome {
            Ok(changed) => {
                tracing::info!(kind, activity = id, actor = %signer.actor_uri, changed, "activity received");
                accepted()
            }
            // Nobody here follows the author: nothing to keep, nothing wrong.
            Err(status) if status.code() == tonic::Code::FailedPrecondition => accepted(),
            Err(status) => from_status(&status),
        }
    }

    /// A request whose key could not be had because a document its key id led to, `gone`,
    /// answered 410 Gone. Nothing in it can be authenticated (its signature, and the headers it
    /// covers, are the caller's), but a deleted account's actor answers 410, and Mastodon
    /// signs the Deletes of a deleted account with its key while it does. So one activity is
    /// taken, from anyone: the `Delete` of an actor by itself, where the actor is the key id's
    /// own document (`<actor>#main-key`, so no document elsewhere leads to it), the activity's
    /// id lies under the actor's (so no other id of its server is used up), and the actor
    /// still answers 410 when asked again now. What is kept of the actor then goes, as after a
    /// verified Delete. Anything else is `refused`, as any request without a usable key is.
    async fn take_in_from_gone(
        &self,
        gone: &str,
        key_id: &str,
        body: &[u8],
        refused: (StatusCode, String),
    ) -> Response {
        let same = |a: &str, b: &str| matches!((url::Url::parse(a), url::Url::parse(b)), (Ok(a), Ok(b)) if a == b);
        let activity: Value = serde_json::from_slice(body).unwrap_or_default();
        let text = |field: &str| activity.get(field).and_then(id_of);
        let actor = text("actor").filter(|actor| {
            same(actor, gone)
                && same(crate::remote_keys::key_document(key_id), gone)
                && text("object").is_some_and(|object| same(object, actor))
        });
        let id = text("id")
            .filter(|id| actor.is_some_and(|a| id.strip_prefix(a).is_some_and(|rest| rest.starts_with(['#', '/']))));
        let (Some(actor), Some(id), Some("Delete")) = (actor, id, activity.get("type").and_then(Value::as_str)) else {
            return refuse(refused.0, refused.1);
        };
        if !self.keys.answers_gone(gone).await {
            return refuse(refused.0, refused.1);
        }
        match self.delete_actor(actor, id).await {
            Ok(changed) => {
                tracing::info!(actor, activity = id, changed, "a deleted account's Delete, its actor gone (410)");
                accepted()
            }
            Err(status) => from_status(&status),
        }
    }

    /// An account deleted on its server, by its Delete `id`: what is kept of it goes (its
    /// reviews, its follows, local users' follows of it).
    async fn delete_actor(&self, actor_uri: &str, id: &str) -> Result<bool, tonic::Status> {
        let request =
            v1::DeleteRemoteActorRequest { actor_uri: actor_uri.to_owned(), received_activity_uri: id.to_owned() };
        Ok(self.federation.clone().delete_remote_actor(request).await?.into_inner().changed)
    }

    /// The local user an object names: one of our actor ids, and it must be the inbox's user.
    fn local_user(&self, user: &Option<String>, object: Option<&Value>) -> Result<String, tonic::Status> {
        let named = object.and_then(id_of).and_then(|o| self.config.urls.user_of_actor(o));
        match (named, user) {
            (Some(named), Some(user)) if named != user => {
                Err(tonic::Status::invalid_argument("the activity is for another user than this inbox's"))
            }
            (Some(named), _) => Ok(named.to_owned()),
            (None, _) => Err(tonic::Status::not_found("the activity names no user of this instance")),
        }
    }

    async fn follow(
        &self,
        signer: &RemoteActor,
        user: Option<String>,
        id: &str,
        activity: &Value,
    ) -> Result<bool, tonic::Status> {
        let user_id = self.local_user(&user, activity.get("object"))?;
        let request = v1::ReceiveFollowRequest {
            actor_uri: signer.actor_uri.clone(),
            user_id,
            activity_uri: id.to_owned(),
            inbox: signer.inbox.clone().unwrap_or_default(),
            shared_inbox: signer.shared_inbox.clone().unwrap_or_default(),
        };
        Ok(self.federation.clone().receive_follow(request).await?.into_inner().changed)
    }

    async fn undo(
        &self,
        signer: &RemoteActor,
        user: Option<String>,
        id: &str,
        activity: &Value,
    ) -> Result<bool, tonic::Status> {
        let Some(object) = activity.get("object") else { return Ok(false) };
        // An embedded object says what it undoes; a bare id can only be a Follow of ours to undo.
        if object.is_object() && object.get("type").and_then(Value::as_str) != Some("Follow") {
            return Ok(false);
        }
        let Some(follow_id) = id_of(object) else { return Ok(false) };
        let user_id = match self.local_user(&user, object.get("object")) {
            Ok(user_id) => user_id,
            Err(_) if object.get("object").is_none() => user.unwrap_or_default(),
            Err(status) => return Err(status),
        };
        let request = v1::ReceiveUndoRequest {
            actor_uri: signer.actor_uri.clone(),
            user_id,
            activity_uri: follow_id.to_owned(),
            received_activity_uri: id.to_owned(),
        };
        Ok(self.federation.clone().receive_undo(request).await?.into_inner().changed)
    }

    /// An Accept, or a Reject (`rejected`), of one of our Follows: of the follow of the signer
    /// that Follow made, so only the followed actor can answer it.
    async fn accept(
        &self,
        signer: &RemoteActor,
        id: &str,
        activity: &Value,
        rejected: bool,
    ) -> Result<bool, tonic::Status> {
        let Some(follow_id) = activity.get("object").and_then(id_of) else { return Ok(false) };
        let Some(event_id) = self.config.urls.event_of_activity(follow_id) else { return Ok(false) };
        let request = v1::ReceiveAcceptRequest {
            actor_uri: signer.actor_uri.clone(),
            follow_event_id: event_id.to_owned(),
            received_activity_uri: id.to_owned(),
        };
        let answer = if rejected {
            self.federation.clone().receive_reject(request).await?
        } else {
            self.federation.clone().receive_accept(request).await?
        };
        Ok(answer.into_inner().changed)
    }

    /// A Create (`create`) or an Update of a review.
    async fn save_review(
        &self,
        signer: &RemoteActor,
        id: &str,
        activity: &Value,
        create: bool,
    ) -> Result<bool, tonic::Status> {
        let Some(object) = activity.get("object").filter(|o| o.is_object()) else { return Ok(false) };
        let note = match read_review(object) {
            Ok(note) => note,
            // A review edited to followers-only or direct is no longer one to keep: it goes as
            // at its author's Delete, and stays gone.
            Err(NoteError::NotPublic) if !create => return self.delete_review(signer, id, activity).await,
            Err(NoteError::NotAReview(_) | NoteError::NotPublic) => return Ok(false),
            Err(NoteError::Invalid(reason)) => return Err(tonic::Status::invalid_argument(reason)),
        };
        if note.attributed_to != signer.actor_uri {
            return Err(tonic::Status::permission_denied("the review is attributed to another actor than the signer"));
        }
        // Else an actor could take another server's note id first, and its author's own copy
        // would be refused as someone else's.
        if !same_origin(&note.object_uri, &signer.actor_uri) {
            return Err(tonic::Status::permission_denied("the review's id is on another server than its author"));
        }
        // A Create after the Update that edited it (deliveries come in any order, and a retried
        // Create may land after the Update) keeps the Update's copy.
        let request = note.into_save_request(id, create);
        Ok(self.federation.clone().save_remote_review(request).await?.into_inner().changed)
    }

    async fn delete_review(&self, signer: &RemoteActor, id: &str, activity: &Value) -> Result<bool, tonic::Status> {
        let Some(object_uri) = activity.get("object").and_then(id_of) else { return Ok(false) };
        if object_uri == signer.actor_uri {
            return self.delete_actor(&signer.actor_uri, id).await;
        }
        // What it deletes stays deleted (a Create of it arriving later is not saved), so an
        // actor deletes only ids of its own server.
        if !same_origin(object_uri, &signer.actor_uri) {
            return Err(tonic::Status::permission_denied(
                "the deleted object's id is on another server than its actor",
            ));
        }
        let request = v1::DeleteRemoteReviewRequest {
            object_uri: object_uri.to_owned(),
            actor_uri: signer.actor_uri.clone(),
            received_activity_uri: id.to_owned(),
        };
        Ok(self.federation.clone().delete_remote_review(request).await?.into_inner().changed)
    }
}
