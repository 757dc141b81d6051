//! The Federation service: what the federation handler hands over from ActivityPub.

use reelay_contracts::v1;
use reelay_domain::{UserId, validate};
use reelay_kit::ServiceError;
use tonic::Request;

use super::{Reply, WriteApi, ok};
use crate::convert;
use crate::store::RemoteReview;

#[tonic::async_trait]
impl v1::federation_server::Federation for WriteApi {
    async fn save_remote_review(
        &self,
        request: Request<v1::SaveRemoteReviewRequest>,
    ) -> Reply<v1::SaveRemoteReviewResponse> {
        let r = request.into_inner();
        let review = RemoteReview {
            object_uri: validate::uri("object_uri", &r.object_uri).map_err(ServiceError::from)?,
            actor_uri: validate::uri("actor_uri", &r.actor_uri).map_err(ServiceError::from)?,
            movie: convert::movie_spec("movie", r.movie).map_err(ServiceError::from)?,
            rating: validate::rating("rating", r.rating).map_err(ServiceError::from)?,
            body: validate::body("body", &r.body).map_err(ServiceError::from)?,
            published_at_ms: if r.published_at_ms < 0 {
                return Err(ServiceError::invalid("published_at_ms", "must not be negative").into());
            } else {
                r.published_at_ms
            },
        };
        let saved = self.store.save_remote_review(review).await?;
        ok(v1::SaveRemoteReviewResponse { remote_review_id: saved.id, created: saved.created, changed: saved.changed })
    }

    async fn receive_follow(&self, request: Request<v1::ReceiveFollowRequest>) -> Reply<v1::FederationResponse> {
        let r = request.into_inner();
        let actor_uri = validate::uri("actor_uri", &r.actor_uri).map_err(ServiceError::from)?;
        let user = UserId::parse("user_id", &r.user_id).map_err(ServiceError::from)?;
        let activity_uri = validate::uri("activity_uri", &r.activity_uri).map_err(ServiceError::from)?;
        ok(v1::FederationResponse { changed: self.store.receive_follow(actor_uri, user, activity_uri).await? })
    }

    async fn receive_undo(&self, request: Request<v1::ReceiveUndoRequest>) -> Reply<v1::FederationResponse> {
        let r = request.into_inner();
        let actor_uri = validate::uri("actor_uri", &r.actor_uri).map_err(ServiceError::from)?;
        let user = UserId::parse("user_id", &r.user_id).map_err(ServiceError::from)?;
        let activity_uri = validate::uri("activity_uri", &r.activity_uri).map_err(ServiceError::from)?;
        ok(v1::FederationResponse { changed: self.store.receive_undo(actor_uri, user, activity_uri).await? })
    }
}
