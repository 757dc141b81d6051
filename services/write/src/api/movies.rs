//! The Movies service: discovering movies, asking for enrichment, reading a movie.

use reelay_contracts::v1;
use reelay_domain::MovieId;
use reelay_kit::ServiceError;
use tonic::Request;

use super::{Reply, WriteApi, ok, request_key};
use crate::convert;

#[tonic::async_trait]
impl v1::movies_server::Movies for WriteApi {
    async fn discover_movie(&self, request: Request<v1::DiscoverMovieRequest>) -> Reply<v1::DiscoverMovieResponse> {
        let mut r = request.into_inner();
        let key = request_key("DiscoverMovie", &mut r, |r| &mut r.request_id)?;
        let actor = convert::actor(&r.actor_user_id).map_err(ServiceError::from)?;
        let spec = convert::movie_spec(
            "movie",
            Some(v1::MovieRef {
                by: Some(v1::movie_ref::By::TitleYear(v1::TitleYear {
                    title: r.title,
                    year: r.year,
                    external_id: r.external_id,
                })),
            }),
        )
        // The request's fields are flat; name them as the caller sent them.
        .map_err(|e| ServiceError::invalid(e.field.trim_start_matches("movie.title_year."), &e.reason))?;
        ok(self.store.discover_movie(actor, spec, key).await?)
    }

    async fn request_enrichment(
        &self,
        request: Request<v1::RequestEnrichmentRequest>,
    ) -> Reply<v1::RequestEnrichmentResponse> {
        let mut r = request.into_inner();
        let key = request_key("RequestEnrichment", &mut r, |r| &mut r.request_id)?;
        let actor = convert::actor(&r.actor_user_id).map_err(ServiceError::from)?;
        let movie = MovieId::parse("movie_id", &r.movie_id).map_err(ServiceError::from)?;
        ok(self.store.request_enrichment(actor, movie, key).await?)
    }

    async fn get_movie(&self, request: Request<v1::GetMovieRequest>) -> Reply<v1::Movie> {
        let id = MovieId::parse("movie_id", &request.into_inner().movie_id).map_err(ServiceError::from)?;
        ok(convert::movie(self.store.get_movie(id).await?))
    }
}
