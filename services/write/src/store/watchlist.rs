//! The watchlist: adding and removing movies, and reading a user's list.

use reelay_contracts::v1::{self, event::Payload};
use reelay_domain::{MovieId, NewEvent, UserId};
use reelay_outbox::WriteTx;

use super::reviews::delete_if_orphan;
use super::{
    MovieSpec, Result, Store, WatchlistRow, actor_and_resolved_movie, commit_events, ensure_user, keyed_job, write_job,
};
use crate::convert;
use crate::request_ids::RequestKey;

/// A page of a watchlist after a cursor, and the first page: two statements, as
/// [`super::reviews::DIARY_PAGE`].
pub(super) const WATCHLIST_PAGE: &str = "SELECT user_id, movie_id, added_at FROM watchlist \
     WHERE user_id = ?1 AND (added_at, movie_id) > (?2, ?3) ORDER BY added_at, movie_id LIMIT ?4";
pub(super) const WATCHLIST_FIRST_PAGE: &str = "SELECT user_id, movie_id, added_at FROM watchlist \
     WHERE user_id = ?1 AND ?2 IS NULL AND ?3 IS NULL ORDER BY added_at, movie_id LIMIT ?4";

impl Store {
    /// Adds a movie to the actor's watchlist. Adding one already there changes nothing.
    pub async fn add_to_watchlist(
        &self,
        actor: UserId,
        spec: MovieSpec,
        key: Option<RequestKey>,
    ) -> Result<v1::WatchlistEntry> {
        keyed_job!(self, "add_to_watchlist", key, |tx| {
            let mut events = Vec::new();
            let (movie, _) = actor_and_resolved_movie(tx, actor, &spec, &mut events).await?;
            let inserted =
                sqlx::query("INSERT OR IGNORE INTO watchlist (user_id, movie_id, added_at) VALUES (?, ?, ?)")
                    .bind(actor.to_string())
                    .bind(movie.id.clone())
                    .bind(tx.now_ms())
                    .execute(tx.conn())
                    .await?
                    .rows_affected()
                    > 0;
            if inserted {
                events.push(NewEvent::new(
                    &movie.id,
                    Payload::WatchlistItemAdded(v1::WatchlistItemAdded {
                        user_id: actor.to_string(),
                        movie_id: movie.id.clone(),
                    }),
                ));
            }
            let row: WatchlistRow =
                sqlx::query_as("SELECT user_id, movie_id, added_at FROM watchlist WHERE user_id = ? AND movie_id = ?")
                    .bind(actor.to_string())
                    .bind(movie.id.clone())
                    .fetch_one(tx.conn())
                    .await?;
            commit_events(tx, events).await?;
            Ok(convert::watchlist_entry(row))
        })
        .await
    }

    /// Removes a movie from the actor's watchlist; when that was the movie's last reference the
    /// movie goes too, as when its last review is deleted. False when it was not there.
    pub async fn remove_from_watchlist(&self, actor: UserId, movie: MovieId) -> Result<bool> {
        write_job!(self, "remove_from_watchlist", |tx| {
            ensure_user(tx.conn(), actor).await?;
            let movie_id = movie.to_string();
            let removed = sqlx::query("DELETE FROM watchlist WHERE user_id = ? AND movie_id = ?")
                .bind(actor.to_string())
                .bind(movie_id.clone())
                .execute(tx.conn())
                .await?
                .rows_affected()
                > 0;
            if !removed {
                return Ok(false);
            }
            let payload = v1::WatchlistItemRemoved { user_id: actor.to_string(), movie_id: movie_id.clone() };
            let mut events = vec![NewEvent::new(movie, Payload::WatchlistItemRemoved(payload))];
            events.extend(delete_if_orphan(tx.conn(), &movie_id).await?);
            commit_events(tx, events).await?;
            Ok(true)
        })
        .await
    }

    /// In the order movies were added (then by movie id). `after` is the last entry of the
    /// previous page: when it was added, and its movie.
    pub async fn list_watchlist(
        &self,
        user: UserId,
        limit: u32,
        after: Option<(i64, MovieId)>,
    ) -> Result<Vec<WatchlistRow>> {
        let (added_at, movie) = after.map_or((None, None), |(at, id)| (Some(at), Some(id.to_string())));
        let sql = if after.is_some() { WATCHLIST_PAGE } else { WATCHLIST_FIRST_PAGE };
        Ok(sqlx::query_as(sql)
            .bind(user.to_string())
            .bind(added_at)
            .bind(movie)
            .bind(i64::from(limit))
            .fetch_all(&self.db.reads)
            .await?)
    }
}
