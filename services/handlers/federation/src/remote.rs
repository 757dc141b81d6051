//! What the federation handlers reach through: the write service's Federation API (queueing,
//! signing, saving) and remote servers over signed HTTP.

use std::collections::HashSet;

use bytes::Bytes;
use reelay_activitypub::Urls;
use reelay_activitypub::client::{Answer, FederationClient as HttpClient, FetchError, Outgoing};
use reelay_activitypub::signature::SignatureParams;
use reelay_contracts::v1::{self, federation_client::FederationClient};
use reelay_delivery::HandlerError;
use reelay_kit::client::{ServiceChannel, is_transport_failure};
use serde_json::Value;

#[derive(Clone)]
pub struct Remote {
    urls: Urls,
    http: HttpClient,
    write: FederationClient<ServiceChannel>,
}

/// A failed write-service call: retried when the service was unreachable or busy, or failed
/// inside (`INTERNAL`: a write job that panicked, a storage error it does not classify), given
/// up when it refused the request.
pub fn write_error(status: tonic::Status) -> HandlerError {
    if is_transport_failure(&status) || status.code() == tonic::Code::Internal {
        HandlerError::retryable(format!("write service: {}", status.message()))
    } else {
        HandlerError::permanent(format!("write service refused: {:?}: {}", status.code(), status.message()))
    }
}

/// A failed signed exchange with a remote server: retried when it may pass (unreachable, slow,
/// 5xx, 401, 408, 429), given up otherwise.
pub fn fetch_error(error: FetchError) -> HandlerError {
    if error.is_transient_when_signed() { HandlerError::retryable(error) } else { HandlerError::permanent(error) }
}

impl Remote {
    pub fn new(urls: Urls, http: HttpClient, write: ServiceChannel) -> Self {
        Self { urls, http, write: FederationClient::new(write) }
    }

    pub fn urls(&self) -> &Urls {
        &self.urls
    }

    /// The write service's Federation API.
    pub fn write(&self) -> FederationClient<ServiceChannel> {
        self.write.clone()
    }

    /// Has the write service sign `outgoing` with `user_id`'s key.
    async fn sign(&self, user_id: &str, outgoing: Outgoing) -> Result<Outgoing, HandlerError> {
        let input = outgoing.signing_input();
        let request = v1::SignHttpRequestRequest {
            user_id: user_id.to_owned(),
            method: input.method.clone(),
            path: input.path.clone(),
            host: input.host.clone(),
            date: input.date.clone(),
            digest: input.digest.clone().unwrap_or_default(),
        };
        let signed = self.write().sign_http_request(request).await.map_err(write_error)?.into_inner();
        let header = SignatureParams::format(&self.urls.key_id(user_id), &signed.headers, &signed.signature);
        Ok(outgoing.signed(header))
    }

    /// A signed GET of an ActivityPub document, as `user_id`.
    pub async fn fetch(&self, user_id: &str, url: &str) -> Result<Value, HandlerError> {
        let outgoing = Outgoing::get(url).map_err(HandlerError::permanent)?;
        let outgoing = self.sign(user_id, outgoing).await?;
        self.http.fetch_json(outgoing).await.map_err(fetch_error)
    }

    /// A signed POST of an activity to an inbox, as `user_id`: the answer whatever its status,
    /// or what went wrong at the inbox's server (inside: unreachable, too slow, an answer too
    /// large). Outside, what failed before anything was sent (the URL, the signature).
    pub async fn post(
        &self,
        user_id: &str,
        inbox: &str,
        activity: Bytes,
    ) -> Result<Result<Answer, FetchError>, HandlerError> {
        let outgoing = Outgoing::post(inbox, activity).map_err(HandlerError::permanent)?;
        let outgoing = self.sign(user_id, outgoing).await?;
        Ok(self.http.send(outgoing).await)
    }

    /// The inbox of a remote actor, from its actor document.
    pub async fn inbox_of(&self, user_id: &str, actor_uri: &str) -> Result<String, HandlerError> {
        let actor = self.fetch(user_id, actor_uri).await?;
        actor
            .get("inbox")
            .and_then(Value::as_str)
            .map(str::to_owned)
            .ok_or_else(|| HandlerError::permanent(format!("the actor {actor_uri} has no inbox")))
    }

    /// Of `users`, those with a remote follower to send to (asked in calls as large as the
    /// Federation API takes).
    pub async fn users_with_followers(&self, users: &[&str]) -> Result<HashSet<String>, tonic::Status> {
        const USERS_PER_CALL: usize = 1000;
        let mut followed = HashSet::new();
        for chunk in users.chunks(USERS_PER_CALL) {
            let request = v1::UsersWithFollowersRequest { user_ids: chunk.iter().map(|u| (*u).to_owned()).collect() };
            followed.extend(self.write().users_with_followers(request).await?.into_inner().user_ids);
        }
        Ok(followed)
    }

    /// Queues `activity` (its `id` is the dedup key) for `audience`.
    pub async fn queue(
        &self,
        user_id: &str,
        activity: &Value,
        audience: v1::queue_deliveries_request::Audience,
    ) -> Result<(), HandlerError> {
        self.queue_as(activity["id"].as_str().unwrap_or_default(), user_id, activity, audience).await
    }

    /// [`Self::queue`] under `activity_id`, the key that queues the activity once, where it is
    /// not the activity's own id (an activity sent again).
    pub async fn queue_as(
        &self,
        activity_id: &str,
        user_id: &str,
        activity: &Value,
        audience: v1::queue_deliveries_request::Audience,
    ) -> Result<(), HandlerError> {
        self.send(queue_request(activity_id, user_id, activity, audience)).await
    }

    /// [`Self::queue`] to the followers of `user_id`, of an activity (a Create, an Update) about
    /// their review `review_id`: queued only while the review exists.
    pub async fn queue_review(&self, user_id: &str, review_id: &str, activity: &Value) -> Result<(), HandlerError> {
        let followers = v1::queue_deliveries_request::Audience::Followers(true);
        let request = queue_request(activity["id"].as_str().unwrap_or_default(), user_id, activity, followers);
        self.send(v1::QueueDeliveriesRequest { live_review_id: review_id.to_owned(), ..request }).await
    }

    async fn send(&self, request: v1::QueueDeliveriesRequest) -> Result<(), HandlerError> {
        let activity_id = request.activity_id.clone();
        let queued = self.write().queue_deliveries(request).await.map_err(write_error)?.into_inner();
        tracing::info!(activity = %activity_id, queued = queued.queued, duplicate = queued.duplicate,
            skipped_unavailable = queued.skipped_unavailable, review_gone = queued.review_gone,
            "activity queued for delivery");
        Ok(())
    }
}

fn queue_request(
    activity_id: &str,
    user_id: &str,
    activity: &Value,
    audience: v1::queue_deliveries_request::Audience,
) -> v1::QueueDeliveriesRequest {
    v1::QueueDeliveriesRequest {
        activity_id: activity_id.to_owned(),
        sender_user_id: user_id.to_owned(),
        activity_json: activity.to_string(),
        audience: Some(audience),
        live_review_id: String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_write_service_failing_inside_is_retried_and_a_refusal_is_not() {
        let retried = |status: tonic::Status| matches!(write_error(status), HandlerError::Retryable(_));
        assert!(retried(tonic::Status::internal("database error: disk I/O error")));
        assert!(retried(tonic::Status::unavailable("write service down")));
        assert!(retried(tonic::Status::resource_exhausted("database or disk is full")));
        assert!(!retried(tonic::Status::invalid_argument("inbox: must be an https URL")));
        assert!(!retried(tonic::Status::failed_precondition("nobody here follows")));
        assert!(!retried(tonic::Status::not_found("user_id: no such user")));
    }
}
