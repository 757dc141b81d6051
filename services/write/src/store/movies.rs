//! Movies: discovering a movie, asking for its enrichment, and reading it back.

use reelay_contracts::v1::{self, event::Payload};
use reelay_domain::{MovieId, NewEvent, UserId};
use reelay_kit::ServiceError;
use reelay_outbox::WriteTx;

use super::{
    MovieRow, MovieSpec, Result, Store, actor_and_resolved_movie, commit_events, ensure_user, keyed_job, movie_by_id,
};
use crate::convert;
use crate::request_ids::RequestKey;

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
        sqlx::query_as("SELECT id, title, year, external_id, created_at FROM movies WHERE id = ?")
            .bind(id.to_string())
            .fetch_optional(&self.db.reads)
            .await?
            .ok_or_else(|| ServiceError::not_found(format_args!("movie {id}")).into())
    }
}
