//! The watchlist: adding and removing movies, and reading a user's list.

use reelay_contracts::v1::{self, event::Payload};
use reelay_domain::{MovieId, NewEvent, UserId};
use reelay_outbox::WriteTx;

use super::{MovieSpec, Result, Store, WatchlistRow, actor_and_resolved_movie, commit_events, keyed_job};
use crate::convert;
use crate::request_ids::RequestKey;

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

    pub async fn remove_from_watchlist(&self, actor: UserId, movie: MovieId) -> Result<bool> {
        let sql = "DELETE FROM watchlist WHERE user_id = ? AND movie_id = ?";
        let key = (actor.to_string(), movie.to_string());
        self.remove_pair("remove_from_watchlist", sql, actor, key, move || {
            let payload = v1::WatchlistItemRemoved { user_id: actor.to_string(), movie_id: movie.to_string() };
            NewEvent::new(movie, Payload::WatchlistItemRemoved(payload))
        })
        .await
    }

    /// In the order movies were added. `after` is the last movie id of the previous page.
    pub async fn list_watchlist(&self, user: UserId, limit: u32, after: Option<MovieId>) -> Result<Vec<WatchlistRow>> {
        Ok(sqlx::query_as(
            "SELECT user_id, movie_id, added_at FROM watchlist WHERE user_id = ?1 AND (?2 IS NULL OR movie_id > ?2) \
             ORDER BY movie_id LIMIT ?3",
        )
        .bind(user.to_string())
        .bind(after.map(|id| id.to_string()))
        .bind(i64::from(limit))
        .fetch_all(&self.db.reads)
        .await?)
    }
}
