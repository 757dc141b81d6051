//! Federation: what arrives over ActivityPub (remote reviews, follows and their undoing).

use reelay_contracts::v1::{self, event::Payload};
use reelay_domain::{NewEvent, ReviewId, UserId};
use reelay_kit::ServiceError;
use reelay_outbox::WriteTx;
use sqlx::Row;

use super::{
    RemoteReview, RemoteReviewSaved, Result, Store, Target, commit_events, ensure_user, is_blocked, resolve_movie,
    write_job,
};

impl Store {
    /// Saves a review that arrived over ActivityPub, keyed by its object id: a repeat delivery
    /// with the same content changes nothing, an update rewrites it.
    pub async fn save_remote_review(&self, review: RemoteReview) -> Result<RemoteReviewSaved> {
        write_job!(self, "save_remote_review", |tx| {
            let mut events = Vec::new();
            let (movie, _) = resolve_movie(tx, &review.movie, &mut events).await?;
            let existing = sqlx::query("SELECT id, actor_uri, movie_id, rating, body, published_at FROM remote_reviews WHERE object_uri = ?")
                .bind(review.object_uri.clone())
                .fetch_optional(tx.conn())
                .await?;
            let now = tx.now_ms();
            let (id, created) = match existing {
                Some(row) => {
                    let id: String = row.get("id");
                    if row.get::<String, _>("actor_uri") != review.actor_uri {
                        return Err(ServiceError::permission_denied(format!(
                            "object_uri {} belongs to another actor",
                            review.object_uri
                        )).into());
                    }
                    let unchanged = row.get::<String, _>("movie_id") == movie.id
                        && row.get::<i64, _>("rating") == i64::from(review.rating)
                        && row.get::<String, _>("body") == review.body
                        && row.get::<i64, _>("published_at") == review.published_at_ms;
                    if unchanged {
                        commit_events(tx, events).await?;
                        return Ok(RemoteReviewSaved { id, created: false, changed: false });
                    }
                    sqlx::query("UPDATE remote_reviews SET movie_id = ?, rating = ?, body = ?, published_at = ?, updated_at = ? WHERE id = ?")
                        .bind(movie.id.clone())
                        .bind(i64::from(review.rating))
                        .bind(review.body.clone())
                        .bind(review.published_at_ms)
                        .bind(now)
                        .bind(id.clone())
                        .execute(tx.conn())
                        .await?;
                    (id, false)
                }
                None => {
                    let id = ReviewId::new().to_string();
                    sqlx::query(
                        "INSERT INTO remote_reviews (id, object_uri, actor_uri, movie_id, rating, body, published_at, updated_at) \
                         VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    )
                    .bind(id.clone())
                    .bind(review.object_uri.clone())
                    .bind(review.actor_uri.clone())
                    .bind(movie.id.clone())
                    .bind(i64::from(review.rating))
                    .bind(review.body.clone())
                    .bind(review.published_at_ms)
                    .bind(now)
                    .execute(tx.conn())
                    .await?;
                    (id, true)
                }
            };
            events.push(NewEvent::new(
                &id,
                Payload::RemoteReviewSaved(v1::RemoteReviewSaved {
                    remote_review_id: id.clone(),
                    object_uri: review.object_uri,
                    actor_uri: review.actor_uri,
                    movie_id: movie.id,
                    rating: review.rating,
                    body: review.body,
                    published_at_ms: review.published_at_ms,
                    movie_title: movie.title,
                    movie_year: movie.year as i32,
                }),
            ));
            commit_events(tx, events).await?;
            Ok(RemoteReviewSaved { id, created, changed: true })
        })
        .await
    }

    pub async fn receive_follow(&self, actor_uri: String, user: UserId, activity_uri: String) -> Result<bool> {
        write_job!(self, "receive_follow", |tx| {
            ensure_user(tx.conn(), user).await?;
            if is_blocked(tx.conn(), &user.to_string(), &Target::Actor(actor_uri.clone()).key()).await? {
                return Err(ServiceError::failed_precondition(format!("actor_uri: {actor_uri} is blocked by user {user}")).into());
            }
            let inserted =
                sqlx::query("INSERT OR IGNORE INTO remote_followers (user_id, actor_uri, activity_uri, created_at) VALUES (?, ?, ?, ?)")
                    .bind(user.to_string())
                    .bind(actor_uri.clone())
                    .bind(activity_uri.clone())
                    .bind(tx.now_ms())
                    .execute(tx.conn())
                    .await?
                    .rows_affected()
                    > 0;
            if inserted {
                let event = NewEvent::new(
                    user,
                    Payload::RemoteFollowReceived(v1::RemoteFollowReceived { actor_uri, user_id: user.to_string(), activity_uri }),
                );
                commit_events(tx, vec![event]).await?;
            }
            Ok(inserted)
        })
        .await
    }

    pub async fn receive_undo(&self, actor_uri: String, user: UserId, activity_uri: String) -> Result<bool> {
        let sql = "DELETE FROM remote_followers WHERE user_id = ? AND actor_uri = ?";
        let key = (user.to_string(), actor_uri.clone());
        self.remove_pair("receive_undo", sql, user, key, move || {
            let payload = v1::RemoteFollowUndone { actor_uri, user_id: user.to_string(), activity_uri };
            NewEvent::new(user, Payload::RemoteFollowUndone(payload))
        })
        .await
    }
}
