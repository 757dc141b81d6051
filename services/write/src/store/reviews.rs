//! Reviews: logging, editing and deleting a user's reviews (a movie goes with its last
//! reference), and reading them back.

use std::collections::HashMap;

use futures_util::future::BoxFuture;
use reelay_contracts::v1::{self, event::Payload};
use reelay_domain::{MovieId, NewEvent, ReviewId, UserId};
use reelay_kit::telemetry::current_traceparent;
use reelay_kit::{ServiceError, now_ms};
use reelay_outbox::{Durability, WriteTx};
use sqlx::{Row, SqliteConnection};

use super::{
    MovieRow, MovieSpec, Result, ReviewFields, ReviewRow, Store, actor_and_movie, actor_and_resolved_movie,
    commit_events, insert_review, keyed_job, movie_by_id, review_logged, select_reviews,
};
use crate::convert;
use crate::request_ids::RequestKey;

async fn review_by_id(conn: &mut SqliteConnection, id: &str) -> Result<Option<ReviewRow>> {
    Ok(sqlx::query_as(select_reviews!("WHERE id = ?")).bind(id.to_owned()).fetch_optional(conn).await?)
}

/// Loads a review the actor owns: NOT_FOUND when missing, PERMISSION_DENIED when someone else's.
async fn owned_review(conn: &mut SqliteConnection, actor: UserId, id: ReviewId) -> Result<ReviewRow> {
    let review = review_by_id(conn, &id.to_string())
        .await?
        .ok_or_else(|| ServiceError::not_found(format_args!("review {id}")))?;
    if review.user_id != actor.to_string() {
        return Err(ServiceError::permission_denied(format!("review {id} belongs to another user")).into());
    }
    Ok(review)
}

/// A review of a movie named by id, waiting to be logged (see [`log_known_movie_reviews`]).
pub(super) struct KnownMovieReview {
    /// Its row, `movie_id` included.
    review: ReviewRow,
    actor: UserId,
    movie: MovieId,
    /// The caller's trace context, for its event.
    traceparent: String,
}

/// Logs reviews of movies named by id, any number of callers' at once, in the caller's write
/// job; one answer per request, in order.
///
/// One statement inserts every review whose user and movie exist (the writer is bound by its
/// round trips to SQLite, not by the rows). Each inserted review raises its `ReviewLogged` with
/// its caller's trace context; a review whose event is refused (over the size limit) is deleted
/// again in the same transaction, so it is answered with the refusal and leaves nothing behind.
/// A review that was not inserted is answered with what was missing. A failed statement fails
/// every request of the job.
fn log_known_movie_reviews(
    tx: &mut WriteTx,
    requests: Vec<KnownMovieReview>,
) -> BoxFuture<'_, Result<Vec<Result<v1::LogReviewResponse>>>> {
    Box::pin(async move {
        let rows: Vec<&ReviewRow> = requests.iter().map(|r| &r.review).collect();
        let rows = serde_json::to_string(&rows).expect("strings and integers encode as JSON");
        let inserted: HashMap<String, MovieRow> = sqlx::query(
            "INSERT INTO reviews (id, user_id, movie_id, rating, body, watched_on, rewatch, source, created_at, updated_at) \
             SELECT r.value ->> 'id', r.value ->> 'user_id', m.id, r.value ->> 'rating', r.value ->> 'body', \
                    r.value ->> 'watched_on', r.value ->> 'rewatch', r.value ->> 'source', r.value ->> 'created_at', \
                    r.value ->> 'updated_at' \
             FROM json_each(?1) r JOIN movies m ON m.id = r.value ->> 'movie_id' \
             WHERE EXISTS (SELECT 1 FROM users u WHERE u.id = r.value ->> 'user_id') \
             RETURNING id, (SELECT title FROM movies WHERE id = movie_id), (SELECT year FROM movies WHERE id = movie_id)",
        )
        .bind(rows)
        .fetch_all(tx.conn())
        .await?
        .into_iter()
        .map(|row| (row.get(0), MovieRow { title: row.get(1), year: row.get(2), ..MovieRow::default() }))
        .collect();
        let mut answers = Vec::with_capacity(requests.len());
        let mut refused = Vec::new();
        for KnownMovieReview { review, actor, movie, traceparent } in requests {
            let Some(movie_row) = inserted.get(&review.id) else {
                // Nothing was written for it; find out what was missing.
                answers.push(match actor_and_movie(tx.conn(), actor, movie).await {
                    Err(missing) => Err(missing),
                    Ok(_) => {
                        Err(ServiceError::internal("the review was not inserted though its user and movie exist")
                            .into())
                    }
                });
                continue;
            };
            tx.set_traceparent(traceparent);
            match commit_events(tx, vec![review_logged(&review, movie_row, v1::ReviewSource::Local)]).await {
                Ok(_) => answers
                    .push(Ok(v1::LogReviewResponse { review: Some(convert::review(review)), movie_created: false })),
                Err(error) => {
                    refused.push(review.id);
                    answers.push(Err(error));
                }
            }
        }
        if !refused.is_empty() {
            sqlx::query("DELETE FROM reviews WHERE id IN (SELECT value FROM json_each(?1))")
                .bind(serde_json::Value::from(refused).to_string())
                .execute(tx.conn())
                .await?;
        }
        Ok(answers)
    })
}

/// True when nothing references the movie any more.
pub(super) async fn movie_is_orphan(conn: &mut SqliteConnection, movie_id: &str) -> Result<bool> {
    let referenced = sqlx::query(
        "SELECT EXISTS (SELECT 1 FROM reviews WHERE movie_id = ?1) \
             OR EXISTS (SELECT 1 FROM watchlist WHERE movie_id = ?1) \
             OR EXISTS (SELECT 1 FROM remote_reviews WHERE movie_id = ?1)",
    )
    .bind(movie_id.to_owned())
    .fetch_one(conn)
    .await?
    .get::<bool, _>(0);
    Ok(!referenced)
}

impl Store {
    pub async fn log_review(
        &self,
        actor: UserId,
        spec: MovieSpec,
        fields: ReviewFields,
        key: Option<RequestKey>,
    ) -> Result<v1::LogReviewResponse> {
        let now = now_ms();
        let mut review = ReviewRow {
            id: ReviewId::new().to_string(),
            user_id: actor.to_string(),
            movie_id: String::new(),
            rating: i64::from(fields.rating),
            body: fields.body,
            watched_on: fields.watched_on,
            rewatch: fields.rewatch,
            source: "local".into(),
            created_at: now,
            updated_at: now,
        };
        if let MovieSpec::Id(movie) = spec {
            review.movie_id = movie.to_string();
            let request = KnownMovieReview { review, actor, movie, traceparent: current_traceparent() };
            if key.is_none() {
                // The common case. Reviews that arrive while the writer is busy are logged
                // together, in one job and one statement.
                return self
                    .review_logs
                    .submit(&self.db, "log_review", Durability::Synced, request, log_known_movie_reviews)
                    .await;
            }
            return keyed_job!(self, "log_review", key, |tx| {
                let mut answers = log_known_movie_reviews(tx, vec![request]).await?;
                answers.pop().expect("one answer per request")
            })
            .await;
        }
        keyed_job!(self, "log_review", key, |tx| {
            let mut events = Vec::new();
            let (movie, movie_created) = actor_and_resolved_movie(tx, actor, &spec, &mut events).await?;
            review.movie_id = movie.id.clone();
            insert_review(tx.conn(), &review, None).await?;
            events.push(review_logged(&review, &movie, v1::ReviewSource::Local));
            commit_events(tx, events).await?;
            Ok(v1::LogReviewResponse { review: Some(convert::review(review)), movie_created })
        })
        .await
    }

    pub async fn edit_review(
        &self,
        actor: UserId,
        id: ReviewId,
        fields: ReviewFields,
        key: Option<RequestKey>,
    ) -> Result<v1::Review> {
        keyed_job!(self, "edit_review", key, |tx| {
            let mut review = owned_review(tx.conn(), actor, id).await?;
            review.rating = i64::from(fields.rating);
            review.body = fields.body;
            review.watched_on = fields.watched_on;
            review.rewatch = fields.rewatch;
            review.updated_at = tx.now_ms();
            sqlx::query(
                "UPDATE reviews SET rating = ?, body = ?, watched_on = ?, rewatch = ?, updated_at = ? WHERE id = ?",
            )
            .bind(review.rating)
            .bind(review.body.clone())
            .bind(review.watched_on.clone())
            .bind(review.rewatch)
            .bind(review.updated_at)
            .bind(review.id.clone())
            .execute(tx.conn())
            .await?;
            let movie = movie_by_id(tx.conn(), &review.movie_id)
                .await?
                .ok_or_else(|| ServiceError::internal(format!("review {} references a missing movie", review.id)))?;
            let event = NewEvent::new(
                &review.id,
                Payload::ReviewEdited(v1::ReviewEdited {
                    review_id: review.id.clone(),
                    user_id: review.user_id.clone(),
                    movie_id: review.movie_id.clone(),
                    rating: review.rating as u32,
                    body: review.body.clone(),
                    watched_on: review.watched_on.clone(),
                    rewatch: review.rewatch,
                    movie_title: movie.title,
                    movie_year: movie.year as i32,
                }),
            );
            commit_events(tx, vec![event]).await?;
            Ok(convert::review(review))
        })
        .await
    }

    /// Deletes a review; when it was the movie's last reference the movie goes too. Returns
    /// whether the movie was deleted.
    pub async fn delete_review(
        &self,
        actor: UserId,
        id: ReviewId,
        key: Option<RequestKey>,
    ) -> Result<v1::DeleteReviewResponse> {
        keyed_job!(self, "delete_review", key, |tx| {
            let review = owned_review(tx.conn(), actor, id).await?;
            sqlx::query("DELETE FROM reviews WHERE id = ?").bind(review.id.clone()).execute(tx.conn()).await?;
            let mut events = vec![NewEvent::new(
                &review.id,
                Payload::ReviewDeleted(v1::ReviewDeleted {
                    review_id: review.id.clone(),
                    user_id: review.user_id.clone(),
                    movie_id: review.movie_id.clone(),
                }),
            )];
            let orphan = movie_is_orphan(tx.conn(), &review.movie_id).await?;
            if orphan {
                sqlx::query("DELETE FROM movies WHERE id = ?").bind(review.movie_id.clone()).execute(tx.conn()).await?;
                events.push(NewEvent::new(
                    &review.movie_id,
                    Payload::MovieDeleted(v1::MovieDeleted { movie_id: review.movie_id.clone() }),
                ));
            }
            commit_events(tx, events).await?;
            Ok(v1::DeleteReviewResponse { movie_deleted: orphan })
        })
        .await
    }

    pub async fn get_review(&self, id: ReviewId) -> Result<ReviewRow> {
        sqlx::query_as(select_reviews!("WHERE id = ?"))
            .bind(id.to_string())
            .fetch_optional(&self.db.reads)
            .await?
            .ok_or_else(|| ServiceError::not_found(format_args!("review {id}")).into())
    }

    /// Newest first. `after` is the last review id of the previous page.
    pub async fn list_diary(&self, user: UserId, limit: u32, after: Option<ReviewId>) -> Result<Vec<ReviewRow>> {
        Ok(sqlx::query_as(select_reviews!("WHERE user_id = ?1 AND (?2 IS NULL OR id < ?2) ORDER BY id DESC LIMIT ?3"))
            .bind(user.to_string())
            .bind(after.map(|id| id.to_string()))
            .bind(i64::from(limit))
            .fetch_all(&self.db.reads)
            .await?)
    }
}
