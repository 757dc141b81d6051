//! The Social service: follows, blocks, and the follower and following lists.

use reelay_contracts::v1;
use reelay_domain::{UserId, validate};
use reelay_kit::ServiceError;
use tonic::Request;

use super::{Reply, WriteApi, keyed_by_actor, ok};
use crate::convert;

/// A page of account keys → the response, with the next token when the page is full.
fn accounts_page(keys: Vec<String>, size: u32) -> v1::ListAccountsResponse {
    let next_page_token =
        if keys.len() == size as usize { keys.last().cloned().unwrap_or_default() } else { String::new() };
    v1::ListAccountsResponse {
        accounts: keys.iter().map(|k| crate::store::account_from_key(k)).collect(),
        next_page_token,
    }
}

fn account_page_token(token: &str) -> Result<String, ServiceError> {
    // An account key: `user:<id>` or `actor:<URI>` (a URI is at most 2,048 characters).
    let issued = token.starts_with("user:") || token.starts_with("actor:");
    if token.is_empty() || (issued && token.len() <= 2_100) {
        Ok(token.to_owned())
    } else {
        Err(ServiceError::invalid("page_token", "is not a token this service issued"))
    }
}

#[tonic::async_trait]
impl v1::social_server::Social for WriteApi {
    async fn follow(&self, request: Request<v1::FollowRequest>) -> Reply<v1::SocialResponse> {
        let mut r = request.into_inner();
        let key = keyed_by_actor("Follow", &mut r, |r| &mut r.request_id, |r| &r.actor_user_id)?;
        let actor = convert::actor(&r.actor_user_id).map_err(ServiceError::from)?;
        let target = convert::target("target", r.target).map_err(ServiceError::from)?;
        ok(self.store.follow(actor, target, key).await?)
    }

    async fn unfollow(&self, request: Request<v1::UnfollowRequest>) -> Reply<v1::SocialResponse> {
        let r = request.into_inner();
        let actor = convert::actor(&r.actor_user_id).map_err(ServiceError::from)?;
        let target = convert::target("target", r.target).map_err(ServiceError::from)?;
        ok(v1::SocialResponse { changed: self.store.unfollow(actor, target).await? })
    }

    async fn block(&self, request: Request<v1::BlockRequest>) -> Reply<v1::SocialResponse> {
        let mut r = request.into_inner();
        let key = keyed_by_actor("Block", &mut r, |r| &mut r.request_id, |r| &r.actor_user_id)?;
        let actor = convert::actor(&r.actor_user_id).map_err(ServiceError::from)?;
        let target = convert::target("target", r.target).map_err(ServiceError::from)?;
        ok(self.store.block(actor, target, key).await?)
    }

    async fn unblock(&self, request: Request<v1::UnblockRequest>) -> Reply<v1::SocialResponse> {
        let r = request.into_inner();
        let actor = convert::actor(&r.actor_user_id).map_err(ServiceError::from)?;
        let target = convert::target("target", r.target).map_err(ServiceError::from)?;
        ok(v1::SocialResponse { changed: self.store.unblock(actor, target).await? })
    }

    async fn list_followers(&self, request: Request<v1::ListFollowersRequest>) -> Reply<v1::ListAccountsResponse> {
        let r = request.into_inner();
        let user = UserId::parse("user_id", &r.user_id).map_err(ServiceError::from)?;
        let size = validate::page_size(r.page_size).map_err(ServiceError::from)?;
        let after = account_page_token(&r.page_token)?;
        let keys = self.store.list_followers(user, size, &after).await?;
        if keys.is_empty() {
            self.store.get_user(user).await?; // no such user: NOT_FOUND
        }
        ok(accounts_page(keys, size))
    }

    async fn list_following(&self, request: Request<v1::ListFollowingRequest>) -> Reply<v1::ListAccountsResponse> {
        let r = request.into_inner();
        let user = UserId::parse("user_id", &r.user_id).map_err(ServiceError::from)?;
        let size = validate::page_size(r.page_size).map_err(ServiceError::from)?;
        let after = account_page_token(&r.page_token)?;
        let keys = self.store.list_following(user, size, &after).await?;
        if keys.is_empty() {
            self.store.get_user(user).await?; // no such user: NOT_FOUND
        }
        ok(accounts_page(keys, size))
    }
}
