//! The Watchlist service: adding, removing and listing watchlist entries.

use reelay_contracts::v1;
use reelay_domain::{MovieId, UserId, validate};
use reelay_kit::ServiceError;
use tonic::Request;

use super::{Reply, WriteApi, keyed_by_actor, ok};
use crate::convert;

#[tonic::async_trait]
impl v1::watchlist_server::Watchlist for WriteApi {
    async fn add_to_watchlist(&self, request: Request<v1::AddToWatchlistRequest>) -> Reply<v1::WatchlistEntry> {
        let mut r = request.into_inner();
        let key = keyed_by_actor("AddToWatchlist", &mut r, |r| &mut r.request_id, |r| &r.actor_user_id)?;
        let actor = convert::actor(&r.actor_user_id).map_err(ServiceError::from)?;
        let spec = convert::movie_spec("movie", r.movie).map_err(ServiceError::from)?;
        ok(self.store.add_to_watchlist(actor, spec, key).await?)
    }

    async fn remove_from_watchlist(
        &self,
        request: Request<v1::RemoveFromWatchlistRequest>,
    ) -> Reply<v1::RemoveFromWatchlistResponse> {
        let r = request.into_inner();
        let actor = convert::actor(&r.actor_user_id).map_err(ServiceError::from)?;
        let movie = MovieId::parse("movie_id", &r.movie_id).map_err(ServiceError::from)?;
        let removed = self.store.remove_from_watchlist(actor, movie).await?;
        ok(v1::RemoveFromWatchlistResponse { removed })
    }

    async fn list_watchlist(&self, request: Request<v1::ListWatchlistRequest>) -> Reply<v1::ListWatchlistResponse> {
        let r = request.into_inner();
        let user = UserId::parse("user_id", &r.user_id).map_err(ServiceError::from)?;
        let size = validate::page_size(r.page_size).map_err(ServiceError::from)?;
        // A token is `<added_at ms>.<movie id>` of the previous page's last entry.
        let after = convert::page_token(&r.page_token, |t| {
            let bad = || reelay_domain::ValidationError::new("page_token", "malformed");
            let (at, movie) = t.split_once('.').ok_or_else(bad)?;
            Ok((at.parse::<i64>().map_err(|_| bad())?, MovieId::parse("page_token", movie)?))
        })
        .map_err(ServiceError::from)?;
        let rows = self.store.list_watchlist(user, size, after).await?;
        if rows.is_empty() {
            self.store.get_user(user).await?; // no such user: NOT_FOUND
        }
        let next_page_token = if rows.len() == size as usize {
            rows.last().map(|r| format!("{}.{}", r.added_at, r.movie_id)).unwrap_or_default()
        } else {
            String::new()
        };
        ok(v1::ListWatchlistResponse {
            entries: rows.into_iter().map(convert::watchlist_entry).collect(),
            next_page_token,
        })
    }
}
