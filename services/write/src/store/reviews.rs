//! Reviews: logging, editing and deleting a user's reviews (a movie goes with its last
//! reference), and reading them back.

use std::collections::HashMap;

use futures_util::future::BoxFuture;
use reelay_contracts::v1::{self, event::Payload};
use reelay_domain::{MovieId, NewEvent, ReviewId, UserId};
use reelay_kit::telemetry::current_traceparent;
use reelay_kit::{ServiceError, now_ms};
use reelay_outbox::{Durability, WriteTx};
use sqlx::{AssertSqlSafe, Row, SqliteConnection};

use super::{
    MovieRow, MovieSpec, Result, ReviewFields, ReviewRow, Store, actor_and_movie, actor_and_resolved_movie,
    bind_review, commit_events, insert_review, keyed_job, movie_by_id, review_logged, select_reviews,
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

/// Writes `review`'s values as they now are, edited now (by `source`: its author, or an import),
/// and returns its `ReviewEdited`.
pub(super) async fn save_edit(tx: &mut WriteTx, review: &mut ReviewRow, source: v1::ReviewSource) -> Result<NewEvent> {
    review.updated_at = tx.now_ms();
    sqlx::query("UPDATE reviews SET rating = ?, body = ?, watched_on = ?, rewatch = ?, updated_at = ? WHERE id = ?")
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
    Ok(review_edited(review, &movie, source))
}

/// The `ReviewEdited` of `review` (as it now is) of `movie`.
fn review_edited(review: &ReviewRow, movie: &MovieRow, source: v1::ReviewSource) -> NewEvent {
    NewEvent::new(
        &review.id,
        Payload::ReviewEdited(v1::ReviewEdited {
            review_id: review.id.clone(),
            user_id: review.user_id.clone(),
            movie_id: review.movie_id.clone(),
            rating: review.rating as u32,
            body: review.body.clone(),
            watched_on: review.watched_on.clone(),
            rewatch: review.rewatch,
            movie_title: movie.title.clone(),
            movie_year: movie.year as i32,
            movie_external_id: movie.external_id.clone().unwrap_or_default(),
            logged_at_ms: review.created_at,
            source: source as i32,
        }),
    )
}

/// Reviews per insert statement of [`log_known_movie_reviews`] (ten parameters each, far below
/// SQLite's limit of 32,766).
const REVIEWS_PER_INSERT: usize = 500;

/// The insert of `rows` reviews of [`log_known_movie_reviews`]: each review's values are bound
/// (one row of `VALUES` each) and it is inserted only when its user and movie exist; the
/// inserted reviews come back with their movie's title, year and external id.
fn insert_reviews_sql(rows: usize) -> String {
    let mut sql = String::from(
        "INSERT INTO reviews (id, user_id, movie_id, rating, body, watched_on, rewatch, source, created_at, updated_at) \
         SELECT r.column1, r.column2, m.id, r.column4, r.column5, r.column6, r.column7, r.column8, r.column9, r.column10 \
         FROM (VALUES ",
    );
    sql.push_str(&vec!["(?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"; rows].join(", "));
    sql.push_str(
        ") r JOIN movies m ON m.id = r.column3 WHERE EXISTS (SELECT 1 FROM users u WHERE u.id = r.column2) \
         RETURNING id, (SELECT title FROM movies WHERE id = movie_id), (SELECT year FROM movies WHERE id = movie_id), \
             (SELECT external_id FROM movies WHERE id = movie_id)",
    );
    sql
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
/// One statement (per [`REVIEWS_PER_INSERT`] reviews) inserts every review whose user and movie
/// exist (the writer is bound by its round trips to SQLite, not by the rows); the values are
/// bound, not read out of a JSON document (which SQLite parsed again for every field). Each inserted review raises its `ReviewLogged` with
/// its caller's trace context; a review whose event is refused (over the size limit) is deleted
/// again in the same transaction, so it is answered with the refusal and leaves nothing behind.
/// A review that was not inserted is answered with what was missing. A failed statement fails
/// every request of the job.
fn log_known_movie_reviews(
    tx: &mut WriteTx,
    mut requests: Vec<KnownMovieReview>,
) -> BoxFuture<'_, Result<Vec<Result<v1::LogReviewResponse>>>> {
    Box::pin(async move {
        // Ids are minted here, in the writer's order: a review's id (v7, by time) then sorts
        // as the reviews commit, so a diary page's cursor (`id <`) never passes one that
        // commits after the page was read.
        for request in &mut requests {
            request.review.id = ReviewId::new().to_string();
        }
        let mut inserted: HashMap<String, MovieRow> = HashMap::with_capacity(requests.len());
        for chunk in requests.chunks(REVIEWS_PER_INSERT) {
            let mut query = sqlx::query(AssertSqlSafe(insert_reviews_sql(chunk.len())));
            for KnownMovieReview { review, .. } in chunk {
                query = bind_review(query, review);
            }
            for row in query.fetch_all(tx.conn()).await? {
                let movie =
                    MovieRow { title: row.get(1), year: row.get(2), external_id: row.get(3), ..MovieRow::default() };
                inserted.insert(row.get(0), movie);
            }
        }
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

/// Deletes the movie when nothing references it any more (its last review, watchlist entry or
/// remote review just went) and returns its `MovieDeleted`, to commit with the change.
pub(super) async fn delete_if_orphan(conn: &mut SqliteConnection, movie_id: &str) -> Result<Option<NewEvent>> {
    let referenced = sqlx::query(
        "SELECT EXISTS (SELECT 1 FROM reviews WHERE movie_id = ?1) \
             OR EXISTS (SELECT 1 FROM watchlist WHERE movie_id = ?1) \
             OR EXISTS (SELECT 1 FROM remote_reviews WHERE movie_id = ?1)",
    )
    .bind(movie_id.to_owned())
    .fetch_one(&mut *conn)
    .await?
    .get::<bool, _>(0);
    if referenced {
        return Ok(None);
    }
    sqlx::query("DELETE FROM movies WHERE id = ?").bind(movie_id.to_owned()).execute(conn).await?;
    let deleted = v1::MovieDeleted { movie_id: movie_id.to_owned() };
    Ok(Some(NewEvent::new(movie_id, Payload::MovieDeleted(deleted))))
}

/// A page of a diary after a cursor, and the first page. Two statements, not one with
/// `?2 IS NULL OR id < ?2`: SQLite cannot start at the cursor in `reviews_user` for that, so
/// every page walked the diary from its newest review.
pub(super) const DIARY_PAGE: &str = select_reviews!("WHERE user_id = ?1 AND id < ?2 ORDER BY id DESC LIMIT ?3");
pub(super) const DIARY_FIRST_PAGE: &str =
    select_reviews!("WHERE user_id = ?1 AND ?2 IS NULL ORDER BY id DESC LIMIT ?3");

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
            id: String::new(), // minted in the write job
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
            // Minted in the writer's order, as [`log_known_movie_reviews`] does.
            review.id = ReviewId::new().to_string();
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
            let unchanged = review.rating == i64::from(fields.rating)
                && review.body == fields.body
                && review.watched_on == fields.watched_on
                && review.rewatch == fields.rewatch;
            if unchanged {
                // Nothing to write, and no edit to tell followers or search about.
                return Ok(convert::review(review));
            }
            review.rating = i64::from(fields.rating);
            review.body = fields.body;
            review.watched_on = fields.watched_on;
            review.rewatch = fields.rewatch;
            let edited = save_edit(tx, &mut review, v1::ReviewSource::Local).await?;
            commit_events(tx, vec![edited]).await?;
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
            let import_key: Option<String> =
                sqlx::query_scalar("DELETE FROM reviews WHERE id = ? RETURNING import_key")
                    .bind(review.id.clone())
                    .fetch_one(tx.conn())
                    .await?;
            // An imported entry deleted stays deleted: a later import of the export skips it.
            if let Some(import_key) = import_key {
                sqlx::query("INSERT OR IGNORE INTO deleted_imports (import_key, deleted_at) VALUES (?, ?)")
                    .bind(import_key)
                    .bind(tx.now_ms())
                    .execute(tx.conn())
                    .await?;
            }
            let mut events = vec![NewEvent::new(
                &review.id,
                Payload::ReviewDeleted(v1::ReviewDeleted {
                    review_id: review.id.clone(),
                    user_id: review.user_id.clone(),
                    movie_id: review.movie_id.clone(),
                }),
            )];
            let deleted = delete_if_orphan(tx.conn(), &review.movie_id).await?;
            let orphan = deleted.is_some();
            events.extend(deleted);
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
        let sql = if after.is_some() { DIARY_PAGE } else { DIARY_FIRST_PAGE };
        Ok(sqlx::query_as(sql)
            .bind(user.to_string())
            .bind(after.map(|id| id.to_string()))
            .bind(i64::from(limit))
            .fetch_all(&self.db.reads)
            .await?)
    }
}

#[cfg(test)]
mod tests {
    use prost::Message;
    use reelay_outbox::{Database, DbConfig};

    use crate::WriteError;

    use super::*;

    fn review(n: usize, actor: UserId, movie: MovieId) -> KnownMovieReview {
        let review = ReviewRow {
            id: String::new(), // minted in the job
            user_id: actor.to_string(),
            movie_id: movie.to_string(),
            rating: (n % 10 + 1) as i64,
            body: format!("review {n}"),
            watched_on: "2024-03-01".into(),
            rewatch: n.is_multiple_of(3),
            source: "local".into(),
            created_at: n as i64,
            updated_at: n as i64,
        };
        KnownMovieReview { review, actor, movie, traceparent: String::new() }
    }

    /// A database with one user and one movie.
    async fn ana_and_heat(dir: &tempfile::TempDir) -> (Database, UserId, MovieId) {
        let db = Database::open(&DbConfig::new(dir.path().join("reelay.db"))).await.unwrap();
        let (user, movie) = (UserId::new(), MovieId::new());
        let (user_id, movie_id) = (user.to_string(), movie.to_string());
        db.writer
            .transact::<_, WriteError, _>("fixtures", move |tx: &mut WriteTx| {
                Box::pin(async move {
                    sqlx::query("INSERT INTO users (id, handle, display_name, created_at) VALUES (?, 'ana', 'Ana', 0)")
                        .bind(user_id)
                        .execute(tx.conn())
                        .await?;
                    sqlx::query(
                        "INSERT INTO movies (id, title, title_key, year, external_id, created_at) \
                         VALUES (?, 'Heat', 'heat', 1995, 'tmdb:949', 0)",
                    )
                    .bind(movie_id)
                    .execute(tx.conn())
                    .await?;
                    Ok(())
                })
            })
            .await
            .unwrap();
        (db, user, movie)
    }

    /// Ids are minted in the write job, in the writer's order: a review asked for first and
    /// written second sorts after the one written first, so a diary page's cursor (`id <`)
    /// never passes a review that commits after the page was read.
    #[tokio::test]
    async fn a_review_id_follows_the_order_reviews_are_written() {
        let dir = tempfile::tempdir().unwrap();
        let (db, user, movie) = ana_and_heat(&dir).await;
        let asked_first = review(0, user, movie);
        let asked_second = review(1, user, movie);
        for request in [asked_second, asked_first] {
            db.writer
                .transact::<_, WriteError, _>("log_review", move |tx: &mut WriteTx| {
                    Box::pin(async move { log_known_movie_reviews(tx, vec![request]).await })
                })
                .await
                .unwrap()
                .pop()
                .unwrap()
                .unwrap();
        }
        let by_id: Vec<i64> =
            sqlx::query_scalar("SELECT created_at FROM reviews ORDER BY id").fetch_all(&db.reads).await.unwrap();
        assert_eq!(by_id, [1, 0], "the review written first has the lower id");
    }

    /// More reviews than one insert statement takes, with missing users and movies among them
    /// on both sides of the statement boundary: every review is answered by its own outcome, and
    /// exactly the ones whose user and movie exist are written, each with its event.
    #[tokio::test]
    async fn a_job_larger_than_one_statement_answers_every_review() {
        let dir = tempfile::tempdir().unwrap();
        let (db, user, movie) = ana_and_heat(&dir).await;
        let total = REVIEWS_PER_INSERT * 2 + 7;
        let missing = |n: usize| n % 97 == 5 || n == REVIEWS_PER_INSERT || n == REVIEWS_PER_INSERT - 1;
        let requests: Vec<KnownMovieReview> = (0..total)
            .map(|n| match (missing(n), n % 2) {
                (true, 0) => review(n, user, MovieId::new()),
                (true, _) => review(n, UserId::new(), movie),
                (false, _) => review(n, user, movie),
            })
            .collect();
        let answers = db
            .writer
            .transact::<_, WriteError, _>("log_review", move |tx: &mut WriteTx| {
                Box::pin(async move { log_known_movie_reviews(tx, requests).await })
            })
            .await
            .unwrap();
        assert_eq!(answers.len(), total);
        for (n, answer) in answers.iter().enumerate() {
            match (missing(n), answer) {
                (true, Err(error)) => {
                    let answer = error.answer();
                    assert_eq!(answer.code, reelay_kit::ErrorCode::NotFound, "review {n}: {answer:?}");
                    let what = if n % 2 == 0 { "movie" } else { "user" };
                    assert!(answer.message.starts_with(what), "review {n}: {answer:?}");
                }
                (false, Ok(answer)) => {
                    let logged = answer.review.as_ref().unwrap();
                    assert_eq!(
                        (logged.body.as_str(), logged.rating),
                        (format!("review {n}").as_str(), (n % 10 + 1) as u32)
                    );
                }
                (_, answer) => panic!("review {n}: {answer:?}"),
            }
        }
        let expected = (0..total).filter(|n| !missing(*n)).count() as i64;
        let count = |sql: &'static str| sqlx::query_scalar::<_, i64>(sql).fetch_one(&db.reads);
        assert_eq!(count("SELECT COUNT(*) FROM reviews").await.unwrap(), expected);
        // Each value in its own column.
        let consistent = "SELECT COUNT(*) FROM reviews WHERE body = 'review ' || created_at \
             AND rating = created_at % 10 + 1 AND rewatch = (created_at % 3 = 0) AND updated_at = created_at \
             AND watched_on = '2024-03-01' AND source = 'local'";
        assert_eq!(count(consistent).await.unwrap(), expected);
        // One event each, carrying its review and the movie's title, year and external id.
        let payloads: Vec<Vec<u8>> =
            sqlx::query_scalar("SELECT payload FROM event_queue WHERE event_type = 'ReviewLogged'")
                .fetch_all(&db.reads)
                .await
                .unwrap();
        let mut bodies: Vec<String> = payloads
            .iter()
            .map(|payload| {
                let event = v1::Event::decode(payload.as_slice()).unwrap();
                let Some(Payload::ReviewLogged(logged)) = event.payload else { panic!("{event:?}") };
                assert_eq!(
                    (logged.movie_title.as_str(), logged.movie_year, logged.movie_external_id.as_str()),
                    ("Heat", 1995, "tmdb:949"),
                    "{logged:?}"
                );
                logged.body
            })
            .collect();
        bodies.sort();
        let mut written: Vec<String> = (0..total).filter(|n| !missing(*n)).map(|n| format!("review {n}")).collect();
        written.sort();
        assert_eq!(bodies, written);
        db.close().await;
    }

    /// A page after a cursor starts at the cursor in its index (`id<?`, `(added_at,movie_id)>`),
    /// not at the start of the user's entries; a first page reads from the start, unsorted.
    #[tokio::test]
    async fn pages_start_at_their_cursor_in_the_index() {
        let dir = tempfile::tempdir().unwrap();
        let db = Database::open(&DbConfig::new(dir.path().join("reelay.db"))).await.unwrap();
        let pages = [
            (DIARY_PAGE, "reviews_user (user_id=? AND id<?)"),
            (DIARY_FIRST_PAGE, "reviews_user (user_id=?)"),
            (super::super::federation::OUTBOX_PAGE, "reviews_user (user_id=? AND id<?)"),
            (super::super::federation::OUTBOX_FIRST_PAGE, "reviews_user (user_id=?)"),
            (super::super::watchlist::WATCHLIST_PAGE, "watchlist_user_added (user_id=? AND (added_at,movie_id)>(?,?))"),
            (super::super::watchlist::WATCHLIST_FIRST_PAGE, "watchlist_user_added (user_id=?)"),
        ];
        for (sql, index) in pages {
            let plan = reelay_outbox::query_plan(&mut db.reads.acquire().await.unwrap(), sql).await.unwrap();
            assert!(plan.iter().any(|step| step.ends_with(index)), "{sql}\n{plan:#?}");
            assert!(!plan.iter().any(|step| step.contains("TEMP B-TREE")), "{sql}\n{plan:#?}");
        }
        db.close().await;
    }
}
