//! The Reviews service: logging, editing, deleting and reading reviews, and the diary.

use reelay_contracts::v1;
use reelay_domain::{ReviewId, UserId, validate};
use reelay_kit::ServiceError;
use tonic::Request;

use super::{Reply, WriteApi, keyed_by_actor, ok};
use crate::convert;

#[tonic::async_trait]
impl v1::reviews_server::Reviews for WriteApi {
    async fn log_review(&self, request: Request<v1::LogReviewRequest>) -> Reply<v1::LogReviewResponse> {
        let mut r = request.into_inner();
        let key = keyed_by_actor("LogReview", &mut r, |r| &mut r.request_id, |r| &r.actor_user_id)?;
        let actor = convert::actor(&r.actor_user_id).map_err(ServiceError::from)?;
        let spec = convert::movie_spec("movie", r.movie).map_err(ServiceError::from)?;
        let fields = convert::review_fields(r.rating, &r.body, &r.watched_on, r.rewatch).map_err(ServiceError::from)?;
        ok(self.store.log_review(actor, spec, fields, key).await?)
    }

    async fn edit_review(&self, request: Request<v1::EditReviewRequest>) -> Reply<v1::Review> {
        let mut r = request.into_inner();
        let key = keyed_by_actor("EditReview", &mut r, |r| &mut r.request_id, |r| &r.actor_user_id)?;
        let actor = convert::actor(&r.actor_user_id).map_err(ServiceError::from)?;
        let id = ReviewId::parse("review_id", &r.review_id).map_err(ServiceError::from)?;
        let fields = convert::review_fields(r.rating, &r.body, &r.watched_on, r.rewatch).map_err(ServiceError::from)?;
        ok(self.store.edit_review(actor, id, fields, key).await?)
    }

    async fn delete_review(&self, request: Request<v1::DeleteReviewRequest>) -> Reply<v1::DeleteReviewResponse> {
        let mut r = request.into_inner();
        let key = keyed_by_actor("DeleteReview", &mut r, |r| &mut r.request_id, |r| &r.actor_user_id)?;
        let actor = convert::actor(&r.actor_user_id).map_err(ServiceError::from)?;
        let id = ReviewId::parse("review_id", &r.review_id).map_err(ServiceError::from)?;
        ok(self.store.delete_review(actor, id, key).await?)
    }

    async fn get_review(&self, request: Request<v1::GetReviewRequest>) -> Reply<v1::Review> {
        let id = ReviewId::parse("review_id", &request.into_inner().review_id).map_err(ServiceError::from)?;
        ok(convert::review(self.store.get_review(id).await?))
    }

    async fn list_diary(&self, request: Request<v1::ListDiaryRequest>) -> Reply<v1::ListDiaryResponse> {
        let r = request.into_inner();
        let user = UserId::parse("user_id", &r.user_id).map_err(ServiceError::from)?;
        let size = validate::page_size(r.page_size).map_err(ServiceError::from)?;
        let after =
            convert::page_token(&r.page_token, |t| ReviewId::parse("page_token", t)).map_err(ServiceError::from)?;
        let rows = self.store.list_diary(user, size, after).await?;
        if rows.is_empty() {
            // An empty diary, or no such user: the latter is NOT_FOUND, as GetUser answers.
            self.store.get_user(user).await?;
        }
        let next_page_token = if rows.len() == size as usize {
            rows.last().map(|r| r.id.clone()).unwrap_or_default()
        } else {
            String::new()
        };
        ok(v1::ListDiaryResponse { reviews: rows.into_iter().map(convert::review).collect(), next_page_token })
    }
}
