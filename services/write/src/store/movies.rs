//! Movies: discovering a movie, asking for its enrichment, and reading it back.

use prost::Message;
use reelay_contracts::v1::{self, event::Payload};
use reelay_domain::{MovieId, NewEvent, UserId};
use reelay_kit::ServiceError;
use reelay_outbox::WriteTx;

use super::{
    MovieRow, MovieSpec, Result, Store, actor_and_resolved_movie, commit_events, ensure_user, keyed_job, movie_by_id,
    movie_columns, write_job,
};
use crate::convert;
use crate::request_ids::RequestKey;

/// The order poster sizes are listed in: "original" first, then the variants by width ("w92"
/// before "w185").
macro_rules! by_poster_size {
    () => {
        " ORDER BY size != 'original', CAST(substr(size, 2) AS INTEGER)"
    };
}

impl Store {
    pub async fn discover_movie(
        &self,
        actor: UserId,
        spec: MovieSpec,
        key: Option<RequestKey>,
    ) -> Result<v1::DiscoverMovieResponse> {
        keyed_job!(self, "discover_movie", key, |tx| {
            let mut events = Vec::new();
            let (movie, created) = actor_and_resolved_movie(tx, actor, &spec, &mut events).await?;
            commit_events(tx, events).await?;
            Ok(v1::DiscoverMovieResponse { movie: Some(convert::movie(movie)), created })
        })
        .await
    }

    pub async fn request_enrichment(
        &self,
        actor: UserId,
        movie: MovieId,
        key: Option<RequestKey>,
    ) -> Result<v1::RequestEnrichmentResponse> {
        keyed_job!(self, "request_enrichment", key, |tx| {
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
            let event_id = commit_events(tx, vec![event]).await?[0];
            Ok(v1::RequestEnrichmentResponse { event_id: event_id.to_string() })
        })
        .await
    }

    pub async fn get_movie(&self, id: MovieId) -> Result<MovieRow> {
        sqlx::query_as(concat!("SELECT ", movie_columns!(), " FROM movies WHERE id = ?"))
            .bind(id.to_string())
            .fetch_optional(&self.db.reads)
            .await?
            .ok_or_else(|| ServiceError::not_found(format_args!("movie {id}")).into())
    }

    /// The poster sizes stored for a movie ("original" first, then the variants by width) and
    /// where the original came from (empty when none is stored).
    pub async fn posters(&self, id: MovieId) -> Result<(Vec<String>, String)> {
        let rows: Vec<(String, String)> =
            sqlx::query_as(concat!("SELECT size, source_url FROM movie_posters WHERE movie_id = ?", by_poster_size!()))
                .bind(id.to_string())
                .fetch_all(&self.db.reads)
                .await?;
        let source = rows.iter().find(|(size, _)| size == "original").map(|(_, url)| url.clone()).unwrap_or_default();
        Ok((rows.into_iter().map(|(size, _)| size).collect(), source))
    }

    pub async fn get_person(&self, person_id: &str) -> Result<v1::Person> {
        let profile: Option<Vec<u8>> = sqlx::query_scalar("SELECT profile FROM people WHERE person_id = ?")
            .bind(person_id)
            .fetch_optional(&self.db.reads)
            .await?;
        let profile = profile.ok_or_else(|| ServiceError::not_found(format_args!("person {person_id}")))?;
        v1::Person::decode(profile.as_slice())
            .map_err(|e| ServiceError::internal(format!("person {person_id} does not decode: {e}")).into())
    }

    /// Upserts people keyed by provider id. A stub (a name from a film's credits) never
    /// replaces a profile; a profile replaces a stub or an older profile. Returns how many
    /// rows changed.
    pub async fn save_people(&self, people: Vec<v1::Person>) -> Result<v1::SavePeopleResponse> {
        write_job!(self, "save_people", |tx| {
            let mut changed = 0u32;
            for person in &people {
                let encoded = person.encode_to_vec();
                let written = sqlx::query(
                    "INSERT INTO people (person_id, name, profile, profiled, updated_at) VALUES (?1, ?2, ?3, ?4, ?5) \
                     ON CONFLICT (person_id) DO UPDATE SET name = ?2, profile = ?3, profiled = ?4, updated_at = ?5 \
                     WHERE profile != ?3 AND (?4 OR NOT people.profiled)",
                )
                .bind(&person.person_id)
                .bind(&person.name)
                .bind(encoded)
                .bind(person.profiled)
                .bind(tx.now_ms())
                .execute(tx.conn())
                .await?
                .rows_affected();
                changed += written as u32;
            }
            Ok(v1::SavePeopleResponse { changed })
        })
        .await
    }

    /// Writes a movie's profile (or that the provider does not know it), raising MovieEnriched
    /// when the stored profile changes. A repeat of the same profile writes nothing.
    pub async fn save_enrichment(
        &self,
        movie: MovieId,
        outcome: Enrichment,
        key: Option<RequestKey>,
    ) -> Result<v1::SaveEnrichmentResponse> {
        keyed_job!(self, "save_enrichment", key, |tx| {
            let current = movie_by_id(tx.conn(), &movie.to_string())
                .await?
                .ok_or_else(|| ServiceError::not_found(format_args!("movie {movie}")))?;
            let (status, profile) = match &outcome {
                Enrichment::Profile(profile) => ("enriched", Some(profile.encode_to_vec())),
                Enrichment::NotFound(_) => ("not_found", None),
            };
            if current.enrichment == status && current.profile == profile {
                return Ok(v1::SaveEnrichmentResponse { changed: false, event_id: String::new() });
            }
            sqlx::query("UPDATE movies SET enrichment = ?, profile = ?, enriched_at = ? WHERE id = ?")
                .bind(status)
                .bind(profile)
                .bind(tx.now_ms())
                .bind(movie.to_string())
                .execute(tx.conn())
                .await?;
            let event_id = match outcome {
                Enrichment::Profile(profile) => {
                    let event = NewEvent::new(
                        movie,
                        Payload::MovieEnriched(v1::MovieEnriched {
                            movie_id: movie.to_string(),
                            profile: Some(profile),
                            title: current.title.clone(),
                            year: current.year as i32,
                        }),
                    );
                    commit_events(tx, vec![event]).await?[0].to_string()
                }
                Enrichment::NotFound(reason) => {
                    tracing::info!(movie = %movie, %reason, "the metadata provider does not know this film");
                    if current.enrichment != "enriched" {
                        String::new()
                    } else {
                        // It had a profile: what the handlers made of it (search's directors and
                        // genres) goes with it, told by a MovieEnriched without a profile.
                        let event = NewEvent::new(
                            movie,
                            Payload::MovieEnriched(v1::MovieEnriched {
                                movie_id: movie.to_string(),
                                profile: None,
                                title: current.title.clone(),
                                year: current.year as i32,
                            }),
                        );
                        commit_events(tx, vec![event]).await?[0].to_string()
                    }
                }
            };
            Ok(v1::SaveEnrichmentResponse { changed: true, event_id })
        })
        .await
    }
}

impl Store {
    /// Records the poster the poster-sync handler stored for a movie, raising PosterSynced and
    /// ImageStored in the same transaction. A repeat with the same key and digest raises nothing
    /// and writes at most its new source URL (so a redelivered MovieEnriched, or a retry after a crash between the
    /// object write and this call, raises each event once); a different digest replaces the
    /// record and raises both again.
    pub async fn record_poster(
        &self,
        poster: PosterRecord,
        key: Option<RequestKey>,
    ) -> Result<v1::RecordPosterResponse> {
        keyed_job!(self, "record_poster", key, |tx| {
            let movie = poster.movie;
            movie_by_id(tx.conn(), &movie.to_string())
                .await?
                .ok_or_else(|| ServiceError::not_found(format_args!("movie {movie}")))?;
            let current: Option<(String, String)> =
                sqlx::query_as("SELECT object_key, sha256 FROM movie_posters WHERE movie_id = ? AND size = 'original'")
                    .bind(movie.to_string())
                    .fetch_optional(tx.conn())
                    .await?;
            if current.as_ref().is_some_and(|(k, d)| *k == poster.key && *d == poster.sha256) {
                // The same poster, maybe from a new URL (the same bytes served elsewhere): where
                // it came from is kept up to date, so the next sync from there skips it; its
                // variants stay and nothing is raised.
                sqlx::query(
                    "UPDATE movie_posters SET source_url = ? WHERE movie_id = ? AND size = 'original' \
                     AND source_url != ?",
                )
                .bind(&poster.source_url)
                .bind(movie.to_string())
                .bind(&poster.source_url)
                .execute(tx.conn())
                .await?;
                return Ok(v1::RecordPosterResponse::default());
            }
            sqlx::query(
                "INSERT INTO movie_posters \
                 (movie_id, size, object_key, content_type, size_bytes, sha256, source_url, stored_at) \
                 VALUES (?1, 'original', ?2, ?3, ?4, ?5, ?6, ?7) \
                 ON CONFLICT (movie_id, size) DO UPDATE SET object_key = ?2, content_type = ?3, \
                 size_bytes = ?4, sha256 = ?5, source_url = ?6, stored_at = ?7",
            )
            .bind(movie.to_string())
            .bind(&poster.key)
            .bind(&poster.content_type)
            .bind(poster.size_bytes as i64)
            .bind(&poster.sha256)
            .bind(&poster.source_url)
            .bind(tx.now_ms())
            .execute(tx.conn())
            .await?;
            // A replaced original makes its variants stale: forget them (conversion redoes them).
            sqlx::query("DELETE FROM movie_posters WHERE movie_id = ? AND size != 'original'")
                .bind(movie.to_string())
                .execute(tx.conn())
                .await?;
            let synced = NewEvent::new(
                movie,
                Payload::PosterSynced(v1::PosterSynced {
                    movie_id: movie.to_string(),
                    source_url: poster.source_url.clone(),
                    key: poster.key.clone(),
                    content_type: poster.content_type.clone(),
                    size_bytes: poster.size_bytes,
                    sha256: poster.sha256.clone(),
                }),
            );
            let stored = NewEvent::new(
                movie,
                Payload::ImageStored(v1::ImageStored {
                    movie_id: movie.to_string(),
                    key: poster.key.clone(),
                    content_type: poster.content_type.clone(),
                    size_bytes: poster.size_bytes,
                    sha256: poster.sha256.clone(),
                }),
            );
            let ids = commit_events(tx, vec![synced, stored]).await?;
            Ok(v1::RecordPosterResponse {
                changed: true,
                poster_synced_event_id: ids[0].to_string(),
                image_stored_event_id: ids[1].to_string(),
            })
        })
        .await
    }
}

impl Store {
    /// Records the webp variants the image-conversion handler stored for a movie's current
    /// original and raises PosterConverted. The original must still be the one they were made
    /// from (else FailedPrecondition: a newer ImageStored brings its own conversion); a repeat
    /// with the same variants writes and raises nothing.
    pub async fn record_poster_variants(
        &self,
        variants: PosterVariants,
        key: Option<RequestKey>,
    ) -> Result<v1::RecordPosterVariantsResponse> {
        keyed_job!(self, "record_poster_variants", key, |tx| {
            let movie = variants.movie.to_string();
            let original: Option<String> =
                sqlx::query_scalar("SELECT sha256 FROM movie_posters WHERE movie_id = ? AND size = 'original'")
                    .bind(&movie)
                    .fetch_optional(tx.conn())
                    .await?;
            let original = original
                .ok_or_else(|| ServiceError::not_found(format_args!("the original poster of movie {movie}")))?;
            if original != variants.original_sha256 {
                return Err(ServiceError::failed_precondition(format!(
                    "the original poster of movie {movie} is no longer {} (now {original})",
                    variants.original_sha256
                ))
                .into());
            }
            let mut changed = false;
            for variant in &variants.variants {
                let done = sqlx::query(
                    "INSERT INTO movie_posters \
                     (movie_id, size, object_key, content_type, size_bytes, sha256, source_url, stored_at) \
                     VALUES (?1, ?2, ?3, 'image/webp', ?4, ?5, '', ?6) \
                     ON CONFLICT (movie_id, size) DO UPDATE SET object_key = ?3, size_bytes = ?4, \
                     sha256 = ?5, stored_at = ?6 \
                     WHERE object_key != ?3 OR size_bytes != ?4 OR sha256 != ?5",
                )
                .bind(&movie)
                .bind(format!("w{}", variant.width))
                .bind(&variant.key)
                .bind(variant.size_bytes as i64)
                .bind(&variant.sha256)
                .bind(tx.now_ms())
                .execute(tx.conn())
                .await?;
                changed |= done.rows_affected() > 0;
            }
            if !changed {
                return Ok(v1::RecordPosterVariantsResponse::default());
            }
            let sizes: Vec<String> = sqlx::query_scalar(concat!(
                "SELECT size FROM movie_posters WHERE movie_id = ? AND size != 'original'",
                by_poster_size!()
            ))
            .bind(&movie)
            .fetch_all(tx.conn())
            .await?;
            let converted = NewEvent::new(
                variants.movie,
                Payload::PosterConverted(v1::PosterConverted {
                    movie_id: movie.clone(),
                    original_sha256: original,
                    sizes,
                }),
            );
            let ids = commit_events(tx, vec![converted]).await?;
            Ok(v1::RecordPosterVariantsResponse { changed: true, event_id: ids[0].to_string() })
        })
        .await
    }
}

/// The variants of a movie's poster, checked by the API before they are recorded.
#[derive(Debug, Clone)]
pub struct PosterVariants {
    pub movie: MovieId,
    pub original_sha256: String,
    pub variants: Vec<v1::PosterVariant>,
}

/// A stored poster, checked by the API before it is recorded.
#[derive(Debug, Clone)]
pub struct PosterRecord {
    pub movie: MovieId,
    pub key: String,
    pub content_type: String,
    pub size_bytes: u64,
    pub sha256: String,
    pub source_url: String,
}

/// What enrichment found for a movie.
#[derive(Debug, Clone)]
pub enum Enrichment {
    Profile(v1::MovieProfile),
    NotFound(String),
}
