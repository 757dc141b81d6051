//! The SQLite adapter of the write service.
//!
//! Every state-changing method is one writer job: it reads what it needs, writes the change and
//! hands the events the change causes to `enqueue_events`, all in one transaction. When a method
//! returns an error, nothing it wrote is kept. Reads use the read-only pool.

use reelay_contracts::v1::{self, account, event::Payload};
use reelay_domain::{EventId, MovieId, NewEvent, UserId, validate};
use reelay_kit::ServiceError;
use reelay_outbox::{Database, WriteTx, enqueue_events};
use sqlx::{Row, SqliteConnection};

use crate::WriteError;
use crate::merge::Merged;

mod federation;
mod integrations;
mod keys;
mod movies;
mod reviews;
mod social;
mod users;
mod watchlist;
mod wrap_ups;

pub(crate) use federation::purge_records as purge_federation_records;
pub use movies::{Enrichment, PosterRecord, PosterVariants};
pub use wrap_ups::WrapUpCompletion;

type Result<T> = std::result::Result<T, WriteError>;

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
        /// Where the request carried `external_id` (`movie.title_year.external_id`), named
        /// when the id conflicts with the film's.
        external_id_field: String,
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

#[derive(Debug, Clone, Default, sqlx::FromRow)]
pub struct MovieRow {
    pub id: String,
    pub title: String,
    pub year: i64,
    pub external_id: Option<String>,
    pub created_at: i64,
    /// pending | enriched | not_found
    #[sqlx(default)]
    pub enrichment: String,
    /// The encoded `MovieProfile`, once enriched.
    #[sqlx(default)]
    pub profile: Option<Vec<u8>>,
    #[sqlx(default)]
    pub enriched_at: Option<i64>,
}

/// Every column of a `MovieRow`, for `SELECT {MOVIE_COLUMNS} FROM movies ...`.
macro_rules! movie_columns {
    () => {
        "id, title, year, external_id, created_at, enrichment, profile, enriched_at"
    };
}
pub(crate) use movie_columns;

#[derive(Debug, Clone, sqlx::FromRow, serde::Serialize)]
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

#[derive(Debug, Clone, Default, PartialEq, sqlx::FromRow)]
pub struct WrapUpRow {
    pub id: String,
    pub user_id: String,
    pub year: i64,
    pub status: String,
    pub requested_at: i64,
    pub completed_at: Option<i64>,
    /// The encoded `WrapUpSummary`, once completed.
    #[sqlx(default)]
    pub summary: Option<Vec<u8>>,
    #[sqlx(default)]
    pub card_key: Option<String>,
    #[sqlx(default)]
    pub card_content_type: Option<String>,
    /// What the completed figures were computed from (`inputs_digest`), if known.
    #[sqlx(default)]
    pub inputs_digest: Option<String>,
    /// The wrap-up of the same user and year this one replaces.
    #[sqlx(default)]
    pub previous_id: Option<String>,
}

/// Every column of a `WrapUpRow`.
macro_rules! wrap_up_columns {
    () => {
        "id, user_id, year, status, requested_at, completed_at, summary, card_key, card_content_type, \
         inputs_digest, previous_id"
    };
}
pub(crate) use wrap_up_columns;

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ImportSummary {
    pub rows: u32,
    pub imported: u32,
    pub skipped_duplicates: u32,
    pub movies_discovered: u32,
    /// Entries imported before whose missing text or rating this import filled in.
    pub completed: u32,
    /// Rows left out for naming no year.
    pub without_year: u32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteReviewSaved {
    pub id: String,
    pub created: bool,
    pub changed: bool,
}

pub use federation::{Audience, ServerPolicy};

pub struct RemoteReview {
    pub object_uri: String,
    pub actor_uri: String,
    pub movie: MovieSpec,
    pub rating: u32,
    pub body: String,
    pub published_at_ms: i64,
    /// When its author last edited it (0: unknown).
    pub edited_at_ms: i64,
}

/// `SELECT <every review column> FROM reviews <rest>`, as a static string.
macro_rules! select_reviews {
    ($rest:literal) => {
        concat!("SELECT id, user_id, movie_id, rating, body, watched_on, rewatch, source, created_at, updated_at FROM reviews ", $rest)
    };
}
pub(crate) use select_reviews;

// ---------------------------------------------------------------------------------------------
// Helpers that run inside a write job

async fn ensure_user(conn: &mut SqliteConnection, id: UserId) -> Result<()> {
    let found = sqlx::query("SELECT 1 FROM users WHERE id = ?").bind(id.to_string()).fetch_optional(conn).await?;
    found.map(|_| ()).ok_or_else(|| ServiceError::not_found(format_args!("user {id}")).into())
}

/// The hot path of a write that names a movie by id: checks the actor and loads the movie in one
/// statement (each statement is a round trip to SQLite's thread, inside the single writer).
async fn actor_and_movie(conn: &mut SqliteConnection, actor: UserId, movie: MovieId) -> Result<MovieRow> {
    let row = sqlx::query(
        "SELECT EXISTS (SELECT 1 FROM users WHERE id = ?1), m.id, m.title, m.year, m.external_id, m.created_at, \
                m.enrichment, m.profile, m.enriched_at \
         FROM (SELECT 1) LEFT JOIN movies m ON m.id = ?2",
    )
    .bind(actor.to_string())
    .bind(movie.to_string())
    .fetch_one(conn)
    .await?;
    if !row.get::<bool, _>(0) {
        return Err(ServiceError::not_found(format_args!("user {actor}")).into());
    }
    let Some(id) = row.get::<Option<String>, _>(1) else {
        return Err(ServiceError::not_found(format_args!("movie {movie}")).into());
    };
    Ok(MovieRow {
        id,
        title: row.get(2),
        year: row.get(3),
        external_id: row.get(4),
        created_at: row.get(5),
        enrichment: row.get(6),
        profile: row.get(7),
        enriched_at: row.get(8),
    })
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
    Ok(sqlx::query_as(concat!("SELECT ", movie_columns!(), " FROM movies WHERE id = ?"))
        .bind(id.to_owned())
        .fetch_optional(conn)
        .await?)
}

async fn movie_by_external_id(conn: &mut SqliteConnection, external_id: &str) -> Result<Option<MovieRow>> {
    Ok(sqlx::query_as(concat!("SELECT ", movie_columns!(), " FROM movies WHERE external_id = ?"))
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
            .ok_or_else(|| ServiceError::not_found(format_args!("movie {id}")).into()),
        MovieSpec::ExternalId(external_id) => movie_by_external_id(tx.conn(), external_id)
            .await?
            .map(|m| (m, false))
            .ok_or_else(|| ServiceError::not_found(format_args!("movie with external_id {external_id:?}")).into()),
        MovieSpec::TitleYear { title, year, external_id, external_id_field } => {
            if let Some(ext) = external_id
                && let Some(movie) = movie_by_external_id(tx.conn(), ext).await?
            {
                return Ok((movie, false));
            }
            let key = validate::title_key(title);
            let existing: Option<MovieRow> =
                sqlx::query_as(concat!("SELECT ", movie_columns!(), " FROM movies WHERE title_key = ? AND year = ?"))
                    .bind(key.clone())
                    .bind(*year)
                    .fetch_optional(tx.conn())
                    .await?;
            if let Some(movie) = existing {
                // The same film under another id of the same provider is a different film with
                // this title and year, which this movie cannot also be (an id of another
                // provider says nothing against it).
                if let (Some(asked), Some(known)) = (external_id, &movie.external_id)
                    && asked != known
                    && asked.split_once(':').map(|(scheme, _)| scheme)
                        == known.split_once(':').map(|(scheme, _)| scheme)
                {
                    return Err(ServiceError::failed_precondition(format!(
                        "{external_id_field}: {title} ({year}) is known here as {known}, not {asked}"
                    ))
                    .into());
                }
                return Ok((movie, false));
            }
            let movie = MovieRow {
                id: MovieId::new().to_string(),
                title: title.clone(),
                year: i64::from(*year),
                external_id: external_id.clone(),
                created_at: tx.now_ms(),
                enrichment: "pending".into(),
                ..MovieRow::default()
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

/// A query with `review`'s values bound after what it has, in the column order
/// `id, user_id, movie_id, rating, body, watched_on, rewatch, source, created_at, updated_at`.
fn bind_review<'q>(
    query: sqlx::query::Query<'q, sqlx::Sqlite, <sqlx::Sqlite as sqlx::Database>::Arguments>,
    review: &ReviewRow,
) -> sqlx::query::Query<'q, sqlx::Sqlite, <sqlx::Sqlite as sqlx::Database>::Arguments> {
    query
        .bind(review.id.clone())
        .bind(review.user_id.clone())
        .bind(review.movie_id.clone())
        .bind(review.rating)
        .bind(review.body.clone())
        .bind(review.watched_on.clone())
        .bind(review.rewatch)
        .bind(review.source.clone())
        .bind(review.created_at)
        .bind(review.updated_at)
}

async fn insert_review(conn: &mut SqliteConnection, review: &ReviewRow, import_key: Option<String>) -> Result<()> {
    let insert = sqlx::query(
        "INSERT INTO reviews (id, user_id, movie_id, rating, body, watched_on, rewatch, source, created_at, updated_at, import_key) \
         VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
    );
    bind_review(insert, review).bind(import_key).execute(conn).await?;
    Ok(())
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
            movie_external_id: movie.external_id.clone().unwrap_or_default(),
            logged_at_ms: review.created_at,
        }),
    )
}

async fn is_blocked(conn: &mut SqliteConnection, blocker: &str, target_key: &str) -> Result<bool> {
    Ok(sqlx::query("SELECT 1 FROM blocks WHERE blocker_id = ? AND target = ?")
        .bind(blocker.to_owned())
        .bind(target_key.to_owned())
        .fetch_optional(conn)
        .await?
        .is_some())
}

async fn commit_events(tx: &mut WriteTx, events: Vec<NewEvent>) -> Result<Vec<EventId>> {
    Ok(enqueue_events(tx, events).await?.into_iter().map(|e| e.event_id).collect())
}

// ---------------------------------------------------------------------------------------------
// The store

#[derive(Clone)]
pub struct Store {
    db: Database,
    /// Reviews of movies named by id, waiting for the next job that logs them.
    review_logs: Merged<reviews::KnownMovieReview, v1::LogReviewResponse>,
    /// When fan-outs leave a failing server out, and how often they probe it.
    servers: ServerPolicy,
    /// Reads of a year's diary for a wrap-up asked again go one at a time: each can take a
    /// read connection for a second, and the pool serves every read (diary and outbox pages).
    year_reads: std::sync::Arc<tokio::sync::Semaphore>,
}

/// Runs a write job; the closure body is an async block over `tx`.
macro_rules! write_job {
    ($store:expr, $name:literal, |$tx:ident| $body:block) => {
        $store.db.writer.transact::<_, $crate::WriteError, _>($name, move |$tx: &mut WriteTx| Box::pin(async move $body))
    };
}
pub(crate) use write_job;

/// Runs a write job under the caller's idempotency key (`Option<RequestKey>`): a key seen before
/// returns the answer recorded then and writes nothing; otherwise the body runs, and the answer
/// it returns (the gRPC response) is recorded in the same transaction.
macro_rules! keyed_job {
    ($store:expr, $name:literal, $key:expr, |$tx:ident| $body:block) => {{
        let key: Option<$crate::request_ids::RequestKey> = $key;
        $store.db.writer.transact::<_, $crate::WriteError, _>($name, move |$tx: &mut WriteTx| {
            Box::pin(async move {
                if let Some(key) = &key {
                    if let Some(answer) = key.recorded($tx).await? {
                        return Ok(answer);
                    }
                }
                let answer: std::result::Result<_, $crate::WriteError> = async { $body }.await;
                let answer = answer?;
                if let Some(key) = &key {
                    key.record($tx, &answer).await?;
                }
                Ok(answer)
            })
        })
    }};
}
pub(crate) use keyed_job;

impl Store {
    pub fn new(db: Database) -> Self {
        Self {
            db,
            review_logs: Merged::default(),
            servers: ServerPolicy::default(),
            year_reads: std::sync::Arc::new(tokio::sync::Semaphore::new(1)),
        }
    }

    /// Sets when a fan-out to followers leaves a failing server's inboxes out.
    pub fn with_server_policy(mut self, servers: ServerPolicy) -> Self {
        self.servers = servers;
        self
    }

    pub fn database(&self) -> &Database {
        &self.db
    }
}

/// A store on a new database, and its user ana (for the store's tests).
#[cfg(test)]
pub(crate) async fn store_with_ana() -> (tempfile::TempDir, Database, Store, UserId) {
    let dir = tempfile::tempdir().unwrap();
    let db = Database::open(&reelay_outbox::DbConfig::new(dir.path().join("reelay.db"))).await.unwrap();
    let store = Store::new(db.clone());
    let user = store.create_user("ana".into(), "Ana".into(), None).await.unwrap();
    let actor = UserId::parse("user_id", &user.user_id).unwrap();
    (dir, db, store, actor)
}
