//! The SQLite adapter of the write service.
//!
//! Every state-changing method is one writer job: it reads what it needs, writes the change and
//! hands the events the change causes to `enqueue_events`, all in one transaction. When a method
//! returns an error, nothing it wrote is kept. Reads use the read-only pool.

use reelay_contracts::v1::{self, account, event::Payload};
use reelay_domain::letterboxd::DiaryRow;
use reelay_domain::{EventId, MovieId, NewEvent, ReviewId, UserId, WrapUpId, validate};
use reelay_outbox::{Database, WriteTx, enqueue_events, now_ms};
use reelay_runtime::ServiceError;
use sqlx::{Row, SqliteConnection};

type Result<T> = std::result::Result<T, ServiceError>;

/// Diary rows committed per import transaction.
pub const IMPORT_CHUNK_ROWS: usize = 250;

// ---------------------------------------------------------------------------------------------
// Commands and rows

/// How a command names a movie.
#[derive(Debug, Clone)]
pub enum MovieSpec {
    Id(MovieId),
    /// Must already exist.
    ExternalId(String),
    /// Created (raising `MovieDiscovered`) when unknown.
    TitleYear {
        title: String,
        year: i32,
        external_id: Option<String>,
    },
}

#[derive(Debug, Clone)]
pub struct ReviewFields {
    pub rating: u32,
    pub body: String,
    pub watched_on: String,
    pub rewatch: bool,
}

/// The other side of a follow or block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    User(UserId),
    Actor(String),
}

impl Target {
    /// The `target` column value.
    fn key(&self) -> String {
        match self {
            Self::User(id) => format!("user:{id}"),
            Self::Actor(uri) => format!("actor:{uri}"),
        }
    }

    fn to_proto(&self) -> v1::Account {
        let kind = match self {
            Self::User(id) => account::Kind::UserId(id.to_string()),
            Self::Actor(uri) => account::Kind::ActorUri(uri.clone()),
        };
        v1::Account { kind: Some(kind) }
    }
}

/// `user:<id>` / `actor:<uri>` back to an account.
pub fn account_from_key(key: &str) -> v1::Account {
    let kind = match key.split_once(':') {
        Some(("user", id)) => account::Kind::UserId(id.to_owned()),
        Some(("actor", uri)) => account::Kind::ActorUri(uri.to_owned()),
        _ => account::Kind::ActorUri(key.to_owned()),
    };
    v1::Account { kind: Some(kind) }
}

#[derive(Debug, Clone, sqlx::FromRow)]
pub struct UserRow {
    pub id: String,
    pub handle: String,
    pub display_name: String,
    pub created_at: i64,
}

#[derive(Debug, Clone, sqlx::FromRow)]
pub struct MovieRow {
    pub id: String,
    pub title: String,
    pub year: i64,
    pub external_id: Option<String>,
    pub created_at: i64,
}

#[derive(Debug, Clone, sqlx::FromRow)]
pub struct ReviewRow {
    pub id: String,
    pub user_id: String,
    pub movie_id: String,
    pub rating: i64,
    pub body: String,
    pub watched_on: String,
    pub rewatch: bool,
    pub source: String,
    pub created_at: i64,
    pub updated_at: i64,
}

#[derive(Debug, Clone, sqlx::FromRow)]
pub struct WatchlistRow {
    pub user_id: String,
    pub movie_id: String,
    pub added_at: i64,
}

#[derive(Debug, Clone, sqlx::FromRow)]
pub struct WrapUpRow {
    pub id: String,
    pub user_id: String,
    pub year: i64,
    pub status: String,
    pub summary_json: String,
    pub requested_at: i64,
    pub completed_at: Option<i64>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ImportSummary {
    pub rows: u32,
    pub imported: u32,
    pub skipped_duplicates: u32,
    pub movies_discovered: u32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteReviewSaved {
    pub id: String,
    pub created: bool,
    pub changed: bool,
}

pub struct RemoteReview {
    pub object_uri: String,
    pub actor_uri: String,
    pub movie: MovieSpec,
    pub rating: u32,
    pub body: String,
    pub published_at_ms: i64,
}

/// `SELECT <every review column> FROM reviews <rest>`, as a static string.
macro_rules! select_reviews {
    ($rest:literal) => {
        concat!("SELECT id, user_id, movie_id, rating, body, watched_on, rewatch, source, created_at, updated_at FROM reviews ", $rest)
    };
}

// ---------------------------------------------------------------------------------------------
// Helpers that run inside a write job

async fn ensure_user(conn: &mut SqliteConnection, id: UserId) -> Result<()> {
    let found = sqlx::query("SELECT 1 FROM users WHERE id = ?").bind(id.to_string()).fetch_optional(conn).await?;
    found.map(|_| ()).ok_or_else(|| ServiceError::not_found(format_args!("user {id}")))
}

/// The hot path of a write that names a movie by id: checks the actor and loads the movie in one
/// statement (each statement is a round trip to SQLite's thread, inside the single writer).
async fn actor_and_movie(conn: &mut SqliteConnection, actor: UserId, movie: MovieId) -> Result<MovieRow> {
    let row = sqlx::query(
        "SELECT EXISTS (SELECT 1 FROM users WHERE id = ?1), m.id, m.title, m.year, m.external_id, m.created_at \
         FROM (SELECT 1) LEFT JOIN movies m ON m.id = ?2",
    )
    .bind(actor.to_string())
    .bind(movie.to_string())
    .fetch_one(conn)
    .await?;
    if !row.get::<bool, _>(0) {
        return Err(ServiceError::not_found(format_args!("user {actor}")));
    }
    let Some(id) = row.get::<Option<String>, _>(1) else {
        return Err(ServiceError::not_found(format_args!("movie {movie}")));
    };
    Ok(MovieRow { id, title: row.get(2), year: row.get(3), external_id: row.get(4), created_at: row.get(5) })
}

/// Checks the actor, then finds or creates the movie the command names.
async fn actor_and_resolved_movie(
    tx: &mut WriteTx,
    actor: UserId,
    spec: &MovieSpec,
    events: &mut Vec<NewEvent>,
) -> Result<(MovieRow, bool)> {
    if let MovieSpec::Id(id) = spec {
        return Ok((actor_and_movie(tx.conn(), actor, *id).await?, false));
    }
    ensure_user(tx.conn(), actor).await?;
    resolve_movie(tx, spec, events).await
}

async fn movie_by_id(conn: &mut SqliteConnection, id: &str) -> Result<Option<MovieRow>> {
    Ok(sqlx::query_as("SELECT id, title, year, external_id, created_at FROM movies WHERE id = ?")
        .bind(id.to_owned())
        .fetch_optional(conn)
        .await?)
}

async fn movie_by_external_id(conn: &mut SqliteConnection, external_id: &str) -> Result<Option<MovieRow>> {
    Ok(sqlx::query_as("SELECT id, title, year, external_id, created_at FROM movies WHERE external_id = ?")
        .bind(external_id.to_owned())
        .fetch_optional(conn)
        .await?)
}

/// Finds the movie a command names, creating it when it is named by title and year and unknown.
/// Returns the movie and whether it was created (its `MovieDiscovered` is in `events`).
async fn resolve_movie(tx: &mut WriteTx, spec: &MovieSpec, events: &mut Vec<NewEvent>) -> Result<(MovieRow, bool)> {
    match spec {
        MovieSpec::Id(id) => movie_by_id(tx.conn(), &id.to_string())
            .await?
            .map(|m| (m, false))
            .ok_or_else(|| ServiceError::not_found(format_args!("movie {id}"))),
        MovieSpec::ExternalId(external_id) => movie_by_external_id(tx.conn(), external_id)
            .await?
            .map(|m| (m, false))
            .ok_or_else(|| ServiceError::not_found(format_args!("movie with external_id {external_id:?}"))),
        MovieSpec::TitleYear { title, year, external_id } => {
            if let Some(ext) = external_id
                && let Some(movie) = movie_by_external_id(tx.conn(), ext).await?
            {
                return Ok((movie, false));
            }
            let key = validate::title_key(title);
            let existing: Option<MovieRow> = sqlx::query_as(
                "SELECT id, title, year, external_id, created_at FROM movies WHERE title_key = ? AND year = ?",
            )
            .bind(key.clone())
            .bind(*year)
            .fetch_optional(tx.conn())
            .await?;
            if let Some(movie) = existing {
                return Ok((movie, false));
            }
            let movie = MovieRow {
                id: MovieId::new().to_string(),
                title: title.clone(),
                year: i64::from(*year),
                external_id: external_id.clone(),
                created_at: tx.now_ms(),
            };
            sqlx::query(
                "INSERT INTO movies (id, title, title_key, year, external_id, created_at) VALUES (?, ?, ?, ?, ?, ?)",
            )
            .bind(movie.id.clone())
            .bind(movie.title.clone())
            .bind(key)
            .bind(movie.year)
            .bind(movie.external_id.clone())
            .bind(movie.created_at)
            .execute(tx.conn())
            .await?;
            events.push(NewEvent::new(
                &movie.id,
                Payload::MovieDiscovered(v1::MovieDiscovered {
                    movie_id: movie.id.clone(),
                    title: movie.title.clone(),
                    year: *year,
                    external_id: movie.external_id.clone().unwrap_or_default(),
                }),
            ));
            Ok((movie, true))
        }
    }
}

async fn review_by_id(conn: &mut SqliteConnection, id: &str) -> Result<Option<ReviewRow>> {
    Ok(sqlx::query_as(select_reviews!("WHERE id = ?")).bind(id.to_owned()).fetch_optional(conn).await?)
}

/// Loads a review the actor owns: NOT_FOUND when missing, PERMISSION_DENIED when someone else's.
async fn owned_review(conn: &mut SqliteConnection, actor: UserId, id: ReviewId) -> Result<ReviewRow> {
    let review = review_by_id(conn, &id.to_string())
        .await?
        .ok_or_else(|| ServiceError::not_found(format_args!("review {id}")))?;
    if review.user_id != actor.to_string() {
        return Err(ServiceError::permission_denied(format!("review {id} belongs to another user")));
    }
    Ok(review)
}

async fn insert_review(conn: &mut SqliteConnection, review: &ReviewRow, import_key: Option<String>) -> Result<()> {
    sqlx::query(
        "INSERT INTO reviews (id, user_id, movie_id, rating, body, watched_on, rewatch, source, import_key, created_at, updated_at) \
         VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
    )
    .bind(review.id.clone())
    .bind(review.user_id.clone())
    .bind(review.movie_id.clone())
    .bind(review.rating)
    .bind(review.body.clone())
    .bind(review.watched_on.clone())
    .bind(review.rewatch)
    .bind(review.source.clone())
    .bind(import_key)
    .bind(review.created_at)
    .bind(review.updated_at)
    .execute(conn)
    .await?;
    Ok(())
}

/// Inserts a review of the movie `movie` only if both the actor and the movie exist, returning
/// the movie; when either is missing, says which.
async fn insert_review_of_known_movie(
    conn: &mut SqliteConnection,
    review: &mut ReviewRow,
    actor: UserId,
    movie: MovieId,
) -> Result<MovieRow> {
    let inserted = sqlx::query(
        "INSERT INTO reviews (id, user_id, movie_id, rating, body, watched_on, rewatch, source, created_at, updated_at) \
         SELECT ?1, ?2, m.id, ?4, ?5, ?6, ?7, ?8, ?9, ?9 FROM movies m \
         WHERE m.id = ?3 AND EXISTS (SELECT 1 FROM users WHERE id = ?2) \
         RETURNING (SELECT title FROM movies WHERE id = movie_id), (SELECT year FROM movies WHERE id = movie_id), \
                   (SELECT external_id FROM movies WHERE id = movie_id), (SELECT created_at FROM movies WHERE id = movie_id)",
    )
    .bind(review.id.clone())
    .bind(review.user_id.clone())
    .bind(movie.to_string())
    .bind(review.rating)
    .bind(review.body.clone())
    .bind(review.watched_on.clone())
    .bind(review.rewatch)
    .bind(review.source.clone())
    .bind(review.created_at)
    .fetch_optional(&mut *conn)
    .await?;
    let Some(row) = inserted else {
        // Nothing was written; find out what was missing.
        actor_and_movie(conn, actor, movie).await?;
        return Err(ServiceError::internal("the review was not inserted though its user and movie exist"));
    };
    review.movie_id = movie.to_string();
    Ok(MovieRow {
        id: movie.to_string(),
        title: row.get(0),
        year: row.get(1),
        external_id: row.get(2),
        created_at: row.get(3),
    })
}

fn review_logged(review: &ReviewRow, movie: &MovieRow, source: v1::ReviewSource) -> NewEvent {
    NewEvent::new(
        &review.id,
        Payload::ReviewLogged(v1::ReviewLogged {
            review_id: review.id.clone(),
            user_id: review.user_id.clone(),
            movie_id: review.movie_id.clone(),
            rating: review.rating as u32,
            body: review.body.clone(),
            watched_on: review.watched_on.clone(),
            rewatch: review.rewatch,
            source: source as i32,
            movie_title: movie.title.clone(),
            movie_year: movie.year as i32,
        }),
    )
}

/// True when nothing references the movie any more.
async fn movie_is_orphan(conn: &mut SqliteConnection, movie_id: &str) -> Result<bool> {
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

async fn is_blocked(conn: &mut SqliteConnection, blocker: &str, target_key: &str) -> Result<bool> {
    Ok(sqlx::query("SELECT 1 FROM blocks WHERE blocker_id = ? AND target = ?")
        .bind(blocker.to_owned())
        .bind(target_key.to_owned())
        .fetch_optional(conn)
        .await?
        .is_some())
}

/// Validates the other side of a social command: a local user must exist and not be the actor.
async fn check_target(conn: &mut SqliteConnection, actor: UserId, target: &Target) -> Result<()> {
    if let Target::User(id) = target {
        if *id == actor {
            return Err(ServiceError::invalid("target", "must be another account than actor_user_id"));
        }
        ensure_user(conn, *id).await?;
    }
    Ok(())
}

async fn commit_events(tx: &mut WriteTx, events: Vec<NewEvent>) -> Result<Vec<EventId>> {
    Ok(enqueue_events(tx, events).await?.into_iter().map(|e| e.event_id).collect())
}

// ---------------------------------------------------------------------------------------------
// The store

#[derive(Clone)]
pub struct Store {
    db: Database,
}

/// Runs a write job; the closure body is an async block over `tx`.
macro_rules! write_job {
    ($store:expr, $name:literal, |$tx:ident| $body:block) => {
        $store.db.writer.transact::<_, ServiceError, _>($name, move |$tx: &mut WriteTx| Box::pin(async move $body))
    };
    ($store:expr, single_statement $name:literal, |$tx:ident| $body:block) => {
        $store
            .db
            .writer
            .transact_single_statement::<_, ServiceError, _>($name, move |$tx: &mut WriteTx| Box::pin(async move $body))
    };
}

impl Store {
    pub fn new(db: Database) -> Self {
        Self { db }
    }

    pub fn database(&self) -> &Database {
        &self.db
    }

    // --- users -----------------------------------------------------------------------------

    pub async fn create_user(&self, handle: String, display_name: String) -> Result<UserRow> {
        write_job!(self, "create_user", |tx| {
            let taken = sqlx::query("SELECT 1 FROM users WHERE handle = ?")
                .bind(handle.clone())
                .fetch_optional(tx.conn())
                .await?;
            if taken.is_some() {
                return Err(ServiceError::already_exists(format!("handle: @{handle} is taken")));
            }
            let user = UserRow { id: UserId::new().to_string(), handle, display_name, created_at: tx.now_ms() };
            sqlx::query("INSERT INTO users (id, handle, display_name, created_at) VALUES (?, ?, ?, ?)")
                .bind(user.id.clone())
                .bind(user.handle.clone())
                .bind(user.display_name.clone())
                .bind(user.created_at)
                .execute(tx.conn())
                .await?;
            let event = NewEvent::new(
                &user.id,
                Payload::UserRegistered(v1::UserRegistered {
                    user_id: user.id.clone(),
                    handle: user.handle.clone(),
                    display_name: user.display_name.clone(),
                }),
            );
            commit_events(tx, vec![event]).await?;
            Ok(user)
        })
        .await
    }

    // --- movies ----------------------------------------------------------------------------

    pub async fn discover_movie(&self, actor: UserId, spec: MovieSpec) -> Result<(MovieRow, bool)> {
        write_job!(self, "discover_movie", |tx| {
            let mut events = Vec::new();
            let (movie, created) = actor_and_resolved_movie(tx, actor, &spec, &mut events).await?;
            commit_events(tx, events).await?;
            Ok((movie, created))
        })
        .await
    }

    pub async fn request_enrichment(&self, actor: UserId, movie: MovieId) -> Result<EventId> {
        write_job!(self, "request_enrichment", |tx| {
            ensure_user(tx.conn(), actor).await?;
            movie_by_id(tx.conn(), &movie.to_string())
                .await?
                .ok_or_else(|| ServiceError::not_found(format_args!("movie {movie}")))?;
            let event = NewEvent::new(
                movie,
                Payload::EnrichmentRequested(v1::EnrichmentRequested {
                    movie_id: movie.to_string(),
                    requested_by: actor.to_string(),
                }),
            );
            Ok(commit_events(tx, vec![event]).await?[0])
        })
        .await
    }

    // --- reviews ---------------------------------------------------------------------------

    pub async fn log_review(&self, actor: UserId, spec: MovieSpec, fields: ReviewFields) -> Result<(ReviewRow, bool)> {
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
            // The common case, a known movie by id, is one statement (the writer is bound by
            // statement round trips, not by SQLite), so it needs no savepoint either.
            return write_job!(self, single_statement "log_review", |tx| {
                let movie = insert_review_of_known_movie(tx.conn(), &mut review, actor, movie).await?;
                commit_events(tx, vec![review_logged(&review, &movie, v1::ReviewSource::Local)]).await?;
                Ok((review, false))
            })
            .await;
        }
        write_job!(self, "log_review", |tx| {
            let mut events = Vec::new();
            let (movie, movie_created) = actor_and_resolved_movie(tx, actor, &spec, &mut events).await?;
            review.movie_id = movie.id.clone();
            insert_review(tx.conn(), &review, None).await?;
            events.push(review_logged(&review, &movie, v1::ReviewSource::Local));
            commit_events(tx, events).await?;
            Ok((review, movie_created))
        })
        .await
    }

    pub async fn edit_review(&self, actor: UserId, id: ReviewId, fields: ReviewFields) -> Result<ReviewRow> {
        write_job!(self, "edit_review", |tx| {
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
            Ok(review)
        })
        .await
    }

    /// Deletes a review; when it was the movie's last reference the movie goes too. Returns
    /// whether the movie was deleted.
    pub async fn delete_review(&self, actor: UserId, id: ReviewId) -> Result<bool> {
        write_job!(self, "delete_review", |tx| {
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
            Ok(orphan)
        })
        .await
    }

    // --- watchlist -------------------------------------------------------------------------

    /// Adds a movie to the actor's watchlist. Adding one already there changes nothing.
    pub async fn add_to_watchlist(&self, actor: UserId, spec: MovieSpec) -> Result<WatchlistRow> {
        write_job!(self, "add_to_watchlist", |tx| {
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
            Ok(row)
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

    // --- wrap-ups --------------------------------------------------------------------------

    /// Starts generating the actor's wrap-up of `year`, or returns the one that exists.
    pub async fn request_wrap_up(&self, actor: UserId, year: i32) -> Result<(WrapUpRow, bool)> {
        write_job!(self, "request_wrap_up", |tx| {
            ensure_user(tx.conn(), actor).await?;
            let existing: Option<WrapUpRow> = sqlx::query_as(
                "SELECT id, user_id, year, status, summary_json, requested_at, completed_at FROM wrap_ups WHERE user_id = ? AND year = ?",
            )
            .bind(actor.to_string())
            .bind(year)
            .fetch_optional(tx.conn())
            .await?;
            if let Some(wrap_up) = existing {
                return Ok((wrap_up, false));
            }
            let wrap_up = WrapUpRow {
                id: WrapUpId::new().to_string(),
                user_id: actor.to_string(),
                year: i64::from(year),
                status: "generating".into(),
                summary_json: String::new(),
                requested_at: tx.now_ms(),
                completed_at: None,
            };
            sqlx::query("INSERT INTO wrap_ups (id, user_id, year, status, requested_at) VALUES (?, ?, ?, ?, ?)")
                .bind(wrap_up.id.clone())
                .bind(wrap_up.user_id.clone())
                .bind(wrap_up.year)
                .bind(wrap_up.status.clone())
                .bind(wrap_up.requested_at)
                .execute(tx.conn())
                .await?;
            let event = NewEvent::new(
                &wrap_up.id,
                Payload::WrapUpRequested(v1::WrapUpRequested { wrap_up_id: wrap_up.id.clone(), user_id: actor.to_string(), year }),
            );
            commit_events(tx, vec![event]).await?;
            Ok((wrap_up, true))
        })
        .await
    }

    // --- social ----------------------------------------------------------------------------

    pub async fn follow(&self, actor: UserId, target: Target) -> Result<bool> {
        write_job!(self, "follow", |tx| {
            ensure_user(tx.conn(), actor).await?;
            check_target(tx.conn(), actor, &target).await?;
            let actor_key = Target::User(actor).key();
            let blocked_by_target = match &target {
                Target::User(id) => is_blocked(tx.conn(), &id.to_string(), &actor_key).await?,
                Target::Actor(_) => false,
            };
            if blocked_by_target || is_blocked(tx.conn(), &actor.to_string(), &target.key()).await? {
                return Err(ServiceError::failed_precondition("target: a block exists between these accounts"));
            }
            let inserted =
                sqlx::query("INSERT OR IGNORE INTO follows (follower_id, target, created_at) VALUES (?, ?, ?)")
                    .bind(actor.to_string())
                    .bind(target.key())
                    .bind(tx.now_ms())
                    .execute(tx.conn())
                    .await?
                    .rows_affected()
                    > 0;
            if inserted {
                let event = NewEvent::new(
                    actor,
                    Payload::Followed(v1::Followed { follower_id: actor.to_string(), target: Some(target.to_proto()) }),
                );
                commit_events(tx, vec![event]).await?;
            }
            Ok(inserted)
        })
        .await
    }

    pub async fn unfollow(&self, actor: UserId, target: Target) -> Result<bool> {
        let sql = "DELETE FROM follows WHERE follower_id = ? AND target = ?";
        let key = (actor.to_string(), target.key());
        self.remove_pair("unfollow", sql, actor, key, move || {
            let payload = v1::Unfollowed { follower_id: actor.to_string(), target: Some(target.to_proto()) };
            NewEvent::new(actor, Payload::Unfollowed(payload))
        })
        .await
    }

    /// Deletes the row `sql` names by (`first`, `second`) after checking that `owner` exists,
    /// and raises `event` when there was a row: unfollow, unblock, watchlist removal, a remote
    /// actor's undone follow.
    async fn remove_pair(
        &self,
        job: &'static str,
        sql: &'static str,
        owner: UserId,
        (first, second): (String, String),
        event: impl FnOnce() -> NewEvent + Send + 'static,
    ) -> Result<bool> {
        self.db
            .writer
            .transact::<_, ServiceError, _>(job, move |tx: &mut WriteTx| {
                Box::pin(async move {
                    ensure_user(tx.conn(), owner).await?;
                    let removed =
                        sqlx::query(sql).bind(first).bind(second).execute(tx.conn()).await?.rows_affected() > 0;
                    if removed {
                        commit_events(tx, vec![event()]).await?;
                    }
                    Ok(removed)
                })
            })
            .await
    }

    /// Blocks an account and severs follows in both directions, in one transaction.
    pub async fn block(&self, actor: UserId, target: Target) -> Result<bool> {
        write_job!(self, "block", |tx| {
            ensure_user(tx.conn(), actor).await?;
            check_target(tx.conn(), actor, &target).await?;
            let inserted =
                sqlx::query("INSERT OR IGNORE INTO blocks (blocker_id, target, created_at) VALUES (?, ?, ?)")
                    .bind(actor.to_string())
                    .bind(target.key())
                    .bind(tx.now_ms())
                    .execute(tx.conn())
                    .await?
                    .rows_affected()
                    > 0;
            if !inserted {
                return Ok(false);
            }
            let mut events = vec![NewEvent::new(
                actor,
                Payload::Blocked(v1::Blocked { blocker_id: actor.to_string(), target: Some(target.to_proto()) }),
            )];
            let outgoing = sqlx::query("DELETE FROM follows WHERE follower_id = ? AND target = ?")
                .bind(actor.to_string())
                .bind(target.key())
                .execute(tx.conn())
                .await?
                .rows_affected();
            if outgoing > 0 {
                events.push(NewEvent::new(
                    actor,
                    Payload::Unfollowed(v1::Unfollowed {
                        follower_id: actor.to_string(),
                        target: Some(target.to_proto()),
                    }),
                ));
            }
            match &target {
                Target::User(id) => {
                    let incoming = sqlx::query("DELETE FROM follows WHERE follower_id = ? AND target = ?")
                        .bind(id.to_string())
                        .bind(Target::User(actor).key())
                        .execute(tx.conn())
                        .await?
                        .rows_affected();
                    if incoming > 0 {
                        events.push(NewEvent::new(
                            *id,
                            Payload::Unfollowed(v1::Unfollowed {
                                follower_id: id.to_string(),
                                target: Some(Target::User(actor).to_proto()),
                            }),
                        ));
                    }
                }
                Target::Actor(uri) => {
                    // The federation handler delivers the Block, which tells the remote server
                    // its follow is gone; no separate event is needed for the removed row.
                    sqlx::query("DELETE FROM remote_followers WHERE user_id = ? AND actor_uri = ?")
                        .bind(actor.to_string())
                        .bind(uri.clone())
                        .execute(tx.conn())
                        .await?;
                }
            }
            commit_events(tx, events).await?;
            Ok(true)
        })
        .await
    }

    pub async fn unblock(&self, actor: UserId, target: Target) -> Result<bool> {
        let sql = "DELETE FROM blocks WHERE blocker_id = ? AND target = ?";
        let key = (actor.to_string(), target.key());
        self.remove_pair("unblock", sql, actor, key, move || {
            let payload = v1::Unblocked { blocker_id: actor.to_string(), target: Some(target.to_proto()) };
            NewEvent::new(actor, Payload::Unblocked(payload))
        })
        .await
    }

    // --- integrations ----------------------------------------------------------------------

    /// Checks that the importing user exists before any chunk is written.
    pub async fn user_exists(&self, user: UserId) -> Result<bool> {
        Ok(sqlx::query("SELECT 1 FROM users WHERE id = ?")
            .bind(user.to_string())
            .fetch_optional(&self.db.reads)
            .await?
            .is_some())
    }

    /// Imports validated diary rows, one transaction per chunk of [`IMPORT_CHUNK_ROWS`] with
    /// each row's events and a `DiaryImported` summary. Rows imported before are skipped.
    pub async fn import_diary(&self, actor: UserId, import_id: String, rows: Vec<DiaryRow>) -> Result<ImportSummary> {
        let mut summary = ImportSummary { rows: rows.len() as u32, ..Default::default() };
        for (chunk_index, chunk) in rows.chunks(IMPORT_CHUNK_ROWS).enumerate() {
            let chunk = chunk.to_vec();
            let import_id = import_id.clone();
            let (imported, skipped, discovered) = write_job!(self, "import_diary", |tx| {
                ensure_user(tx.conn(), actor).await?;
                let mut events = Vec::new();
                let (mut imported, mut skipped, mut discovered) = (0u32, 0u32, 0u32);
                for row in &chunk {
                    let import_key = format!("{actor}|{}", row.import_key());
                    let seen = sqlx::query("SELECT 1 FROM reviews WHERE import_key = ?")
                        .bind(import_key.clone())
                        .fetch_optional(tx.conn())
                        .await?
                        .is_some();
                    if seen {
                        skipped += 1;
                        continue;
                    }
                    let spec = MovieSpec::TitleYear { title: row.title.clone(), year: row.year, external_id: None };
                    let (movie, created) = resolve_movie(tx, &spec, &mut events).await?;
                    discovered += u32::from(created);
                    let now = tx.now_ms();
                    let review = ReviewRow {
                        id: ReviewId::new().to_string(),
                        user_id: actor.to_string(),
                        movie_id: movie.id.clone(),
                        rating: i64::from(row.rating),
                        body: row.body.clone(),
                        watched_on: row.watched_on.clone(),
                        rewatch: row.rewatch,
                        source: "import".into(),
                        created_at: now,
                        updated_at: now,
                    };
                    insert_review(tx.conn(), &review, Some(import_key)).await?;
                    events.push(review_logged(&review, &movie, v1::ReviewSource::Import));
                    imported += 1;
                }
                if imported > 0 {
                    events.push(NewEvent::new(
                        actor,
                        Payload::DiaryImported(v1::DiaryImported {
                            import_id,
                            user_id: actor.to_string(),
                            chunk: chunk_index as u32,
                            imported,
                            skipped_duplicates: skipped,
                        }),
                    ));
                }
                commit_events(tx, events).await?;
                Ok((imported, skipped, discovered))
            })
            .await?;
            summary.imported += imported;
            summary.skipped_duplicates += skipped;
            summary.movies_discovered += discovered;
        }
        Ok(summary)
    }

    // --- federation ------------------------------------------------------------------------

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
                        )));
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
                return Err(ServiceError::failed_precondition(format!("actor_uri: {actor_uri} is blocked by user {user}")));
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

    // --- reads -----------------------------------------------------------------------------

    pub async fn get_user(&self, id: UserId) -> Result<UserRow> {
        sqlx::query_as("SELECT id, handle, display_name, created_at FROM users WHERE id = ?")
            .bind(id.to_string())
            .fetch_optional(&self.db.reads)
            .await?
            .ok_or_else(|| ServiceError::not_found(format_args!("user {id}")))
    }

    pub async fn get_movie(&self, id: MovieId) -> Result<MovieRow> {
        sqlx::query_as("SELECT id, title, year, external_id, created_at FROM movies WHERE id = ?")
            .bind(id.to_string())
            .fetch_optional(&self.db.reads)
            .await?
            .ok_or_else(|| ServiceError::not_found(format_args!("movie {id}")))
    }

    pub async fn get_review(&self, id: ReviewId) -> Result<ReviewRow> {
        sqlx::query_as(select_reviews!("WHERE id = ?"))
            .bind(id.to_string())
            .fetch_optional(&self.db.reads)
            .await?
            .ok_or_else(|| ServiceError::not_found(format_args!("review {id}")))
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

    pub async fn get_wrap_up(&self, id: WrapUpId) -> Result<WrapUpRow> {
        sqlx::query_as(
            "SELECT id, user_id, year, status, summary_json, requested_at, completed_at FROM wrap_ups WHERE id = ?",
        )
        .bind(id.to_string())
        .fetch_optional(&self.db.reads)
        .await?
        .ok_or_else(|| ServiceError::not_found(format_args!("wrap-up {id}")))
    }

    /// Local and remote followers as account keys, ordered by key; `after` is the last key seen.
    pub async fn list_followers(&self, user: UserId, limit: u32, after: &str) -> Result<Vec<String>> {
        let keys = sqlx::query(
            "SELECT k FROM (SELECT 'user:' || follower_id AS k FROM follows WHERE target = ?1 \
                            UNION ALL SELECT 'actor:' || actor_uri FROM remote_followers WHERE user_id = ?2) \
             WHERE k > ?3 ORDER BY k LIMIT ?4",
        )
        .bind(Target::User(user).key())
        .bind(user.to_string())
        .bind(after.to_owned())
        .bind(i64::from(limit))
        .fetch_all(&self.db.reads)
        .await?;
        Ok(keys.into_iter().map(|r| r.get(0)).collect())
    }

    pub async fn list_following(&self, user: UserId, limit: u32, after: &str) -> Result<Vec<String>> {
        let keys =
            sqlx::query("SELECT target FROM follows WHERE follower_id = ?1 AND target > ?2 ORDER BY target LIMIT ?3")
                .bind(user.to_string())
                .bind(after.to_owned())
                .bind(i64::from(limit))
                .fetch_all(&self.db.reads)
                .await?;
        Ok(keys.into_iter().map(|r| r.get(0)).collect())
    }
}
