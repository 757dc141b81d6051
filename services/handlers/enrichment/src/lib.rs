//! Enrichment: a film Reelay learns about gets its runtime, genres, directors and cast from a
//! metadata provider, and the people credited get their profiles.
//!
//! - `movie-enrichment` (on `MovieDiscovered` and `EnrichmentRequested`) looks the film up (its
//!   external id first, then title and year), upserts the people it credits, then writes the
//!   movie's profile last through `Movies.SaveEnrichment`: the profile is the "done" marker, and
//!   writing it raises `MovieEnriched`, once. A film the provider does not know is recorded as
//!   such, not retried. The write carries a request id derived from the event, so a redelivery
//!   replays the first answer; a crash between the people and the profile redoes both.
//! - `person-enrichment` (on `MovieEnriched`) upserts the profiles of the film's directors and
//!   leading cast, keyed by the provider's person id, fetched a few at a time; the ones fetched
//!   are saved even when another fetch failed and the event is to be retried.
//!
//! Providers: the offline catalog shipped with Reelay (the default: no key, no network), or TMDB.
//! Handlers reach the write service only through its gRPC API; they own no storage.

mod catalog;
mod fit;
mod provider;
mod tmdb;

use std::sync::Arc;
use std::time::Duration;

use anyhow::bail;
pub use catalog::Catalog;
use futures_util::StreamExt;
pub use provider::{MetadataProvider, MovieQuery, ProviderError};
use reelay_contracts::v1::{self, event::Payload, movies_client::MoviesClient, save_enrichment_request::Outcome};
use reelay_delivery::{BuiltHandler, Handler, HandlerContext, HandlerError};
use reelay_kit::client::ServiceChannel;
use tonic::Code;

/// Cast members whose profiles person enrichment fetches per film (directors always).
const LEADING_CAST: usize = 10;

/// Person profiles fetched at once: a film with 20 directors takes a fifth of the time it would
/// one at a time, well inside the handler's timeout, and stays far below TMDB's rate limit.
const PERSON_FETCHES: usize = 4;

/// Which metadata provider enrichment asks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum ProviderKind {
    /// The offline catalog shipped with Reelay: 17,472 films (1940–2014) from Wikidata, CC0.
    #[default]
    Catalog,
    /// The Movie Database API v3 (needs an API key or a read access token).
    Tmdb,
}

/// The enrichment handlers' settings.
#[derive(Debug, Clone, clap::Args)]
pub struct EnrichmentSettings {
    /// Where film and person metadata comes from.
    #[arg(
        id = "enrichment_provider",
        long = "enrichment-provider",
        env = "REELAY_ENRICHMENT_PROVIDER",
        value_enum,
        default_value = "catalog"
    )]
    pub provider: ProviderKind,
    /// The TMDB API's base URL.
    #[arg(
        id = "enrichment_tmdb_url",
        long = "enrichment-tmdb-url",
        env = "REELAY_ENRICHMENT_TMDB_URL",
        default_value = "https://api.themoviedb.org/3"
    )]
    pub tmdb_url: String,
    /// A TMDB v3 API key (sent as `api_key`).
    #[arg(
        id = "enrichment_tmdb_api_key",
        long = "enrichment-tmdb-api-key",
        env = "REELAY_ENRICHMENT_TMDB_API_KEY",
        hide_env_values = true
    )]
    pub tmdb_api_key: Option<String>,
    /// A TMDB read access token (sent as `Authorization: Bearer`), instead of an API key.
    #[arg(
        id = "enrichment_tmdb_token",
        long = "enrichment-tmdb-token",
        env = "REELAY_ENRICHMENT_TMDB_TOKEN",
        hide_env_values = true
    )]
    pub tmdb_token: Option<String>,
    /// How long one provider request may take, in milliseconds (100 ms to 10 minutes).
    #[arg(
        id = "enrichment_timeout_ms",
        long = "enrichment-timeout-ms",
        env = "REELAY_ENRICHMENT_TIMEOUT_MS",
        default_value_t = 10_000,
        value_parser = clap::value_parser!(u64).range(100..=600_000)
    )]
    pub timeout_ms: u64,
}

impl Default for EnrichmentSettings {
    fn default() -> Self {
        Self {
            provider: ProviderKind::Catalog,
            tmdb_url: "https://api.themoviedb.org/3".into(),
            tmdb_api_key: None,
            tmdb_token: None,
            timeout_ms: 10_000,
        }
    }
}

/// The provider the settings name.
pub fn provider(settings: &EnrichmentSettings) -> anyhow::Result<Arc<dyn MetadataProvider>> {
    Ok(match settings.provider {
        ProviderKind::Catalog => Catalog::shared(),
        ProviderKind::Tmdb => {
            let auth = match (&settings.tmdb_token, &settings.tmdb_api_key) {
                (Some(token), _) => tmdb::Auth::Bearer(token.clone()),
                (None, Some(key)) => tmdb::Auth::ApiKey(key.clone()),
                (None, None) => bail!(
                    "REELAY_ENRICHMENT_PROVIDER=tmdb needs REELAY_ENRICHMENT_TMDB_API_KEY or REELAY_ENRICHMENT_TMDB_TOKEN"
                ),
            };
            Arc::new(
                tmdb::Tmdb::new(&settings.tmdb_url, auth, Duration::from_millis(settings.timeout_ms))
                    .map_err(anyhow::Error::msg)?,
            )
        }
    })
}

/// Builds `movie-enrichment`.
pub fn build_movie_enrichment(settings: &EnrichmentSettings, context: &HandlerContext) -> anyhow::Result<BuiltHandler> {
    let handler = MovieEnrichment { provider: provider(settings)?, movies: MoviesClient::new(context.write.clone()) };
    Ok(BuiltHandler { handler: Arc::new(handler), grpc: None })
}

/// Builds `person-enrichment`.
pub fn build_person_enrichment(
    settings: &EnrichmentSettings,
    context: &HandlerContext,
) -> anyhow::Result<BuiltHandler> {
    let handler = PersonEnrichment { provider: provider(settings)?, movies: MoviesClient::new(context.write.clone()) };
    Ok(BuiltHandler { handler: Arc::new(handler), grpc: None })
}

fn from_provider(error: ProviderError) -> HandlerError {
    match error {
        ProviderError::Retryable(message) => HandlerError::Retryable(message),
        ProviderError::Unavailable { message, .. } => HandlerError::Unavailable(message),
        ProviderError::Permanent(message) => HandlerError::Permanent(message),
    }
}

pub struct MovieEnrichment {
    provider: Arc<dyn MetadataProvider>,
    movies: MoviesClient<ServiceChannel>,
}

impl MovieEnrichment {
    /// The movie and what to look it up by; `None` when the movie no longer exists.
    async fn query(&self, event: &v1::Event) -> Result<Option<Lookup>, HandlerError> {
        let nonempty = |s: &str| (!s.is_empty()).then(|| s.to_owned());
        // The movie as it is now, not as the event saw it: a redelivered MovieDiscovered may
        // find it profiled by then.
        let movie_id = match &event.payload {
            Some(Payload::MovieDiscovered(d)) => &d.movie_id,
            Some(Payload::EnrichmentRequested(r)) => &r.movie_id,
            _ => return Ok(None),
        };
        let request = v1::GetMovieRequest { movie_id: movie_id.clone() };
        match self.movies.clone().get_movie(request).await {
            Ok(movie) => {
                let m = movie.into_inner();
                // A film without an id of its own is looked up again by the id of the
                // profile this provider made (then by title, should that miss): the
                // film retitled there is still found.
                let own_id = m
                    .profile
                    .as_ref()
                    .filter(|p| p.provider == self.provider.name() && !p.provider_id.is_empty())
                    .map(|p| p.provider_id.clone());
                // Only the provider's answer to its own id says the film is gone; a
                // search by title or another id that misses (another provider's
                // profile, a title it spells otherwise) says nothing against it.
                let by_own_id = own_id.as_ref().is_some_and(|id| m.external_id.is_empty() || m.external_id == *id);
                let first = own_id.filter(|_| m.external_id.is_empty());
                let query = MovieQuery { external_id: nonempty(&m.external_id), title: m.title, year: m.year };
                Ok(Some(Lookup {
                    keeps_profile_on_miss: m.profile.is_some() && !by_own_id,
                    movie_id: m.movie_id,
                    first: first.map(|id| MovieQuery { external_id: Some(id), ..query.clone() }),
                    query,
                }))
            }
            Err(status) if status.code() == Code::NotFound => Ok(None),
            Err(status) => Err(HandlerError::from_call("GetMovie", &status)),
        }
    }
}

/// What a movie is looked up by.
struct Lookup {
    movie_id: String,
    /// Asked first, when set: the id of the profile this provider made.
    first: Option<MovieQuery>,
    query: MovieQuery,
    /// The movie has a profile the lookup cannot speak against: a miss keeps it.
    keeps_profile_on_miss: bool,
}

#[async_trait::async_trait]
impl Handler for MovieEnrichment {
    fn name(&self) -> &'static str {
        "movie-enrichment"
    }

    fn event_types(&self) -> &'static [&'static str] {
        &["MovieDiscovered", "EnrichmentRequested"]
    }

    async fn handle(&self, event: &v1::Event) -> Result<(), HandlerError> {
        let Some(Lookup { movie_id, first, query, keeps_profile_on_miss }) = self.query(event).await? else {
            return Ok(());
        };
        // Its own id first, when it has one, then the query.
        let mut found = None;
        for asked in first.iter().chain([&query]) {
            found = self.provider.movie(asked).await.map_err(from_provider)?;
            if found.is_some() {
                break;
            }
        }
        let outcome = match found {
            Some(profile) => {
                let profile = fit::profile(profile);
                // People first: the profile, written last, is what marks the film enriched.
                let people: Vec<v1::Person> = profile
                    .directors
                    .iter()
                    .chain(&profile.cast)
                    .map(|c| v1::Person { person_id: c.person_id.clone(), name: c.name.clone(), ..Default::default() })
                    .collect();
                if !people.is_empty() {
                    self.movies
                        .clone()
                        .save_people(v1::SavePeopleRequest { people })
                        .await
                        .map_err(|s| HandlerError::from_call("SavePeople", &s))?;
                }
                if reelay_kit::failpoint_armed("enrichment_after_people") {
                    tracing::error!("failpoint enrichment_after_people: aborting before the profile is written");
                    std::process::abort();
                }
                Outcome::Profile(profile)
            }
            None if keeps_profile_on_miss => {
                tracing::info!(movie_id = %movie_id, provider = self.provider.name(), query = %query.describe(),
                    "the provider does not find the film; the profile it has from elsewhere is kept");
                return Ok(());
            }
            None => Outcome::NotFound(format!("{} does not know {}", self.provider.name(), query.describe())),
        };
        let mut request =
            v1::SaveEnrichmentRequest { movie_id: movie_id.clone(), outcome: Some(outcome), request_id: String::new() };
        // The event and what the provider answered: a retry after the first save committed
        // that got other data (the provider changed it in between) is a new request that saves
        // it, not a clash with the first under one key (refused, and dead-lettered).
        let answered = ring::digest::digest(&ring::digest::SHA256, &prost::Message::encode_to_vec(&request));
        let digest: String = answered.as_ref()[..8].iter().map(|b| format!("{b:02x}")).collect();
        request.request_id = format!("enrich:{}:{digest}", event.event_id);
        match self.movies.clone().save_enrichment(request).await {
            Ok(saved) => {
                let saved = saved.into_inner();
                tracing::info!(movie_id = %movie_id, changed = saved.changed, movie_enriched = %saved.event_id, "movie enriched");
                Ok(())
            }
            // Deleted since: nothing left to enrich.
            Err(status) if status.code() == Code::NotFound => Ok(()),
            Err(status) => Err(HandlerError::from_call("SaveEnrichment", &status)),
        }
    }
}

pub struct PersonEnrichment {
    provider: Arc<dyn MetadataProvider>,
    movies: MoviesClient<ServiceChannel>,
}

#[async_trait::async_trait]
impl Handler for PersonEnrichment {
    fn name(&self) -> &'static str {
        "person-enrichment"
    }

    fn event_types(&self) -> &'static [&'static str] {
        &["MovieEnriched"]
    }

    async fn handle(&self, event: &v1::Event) -> Result<(), HandlerError> {
        let Some(Payload::MovieEnriched(enriched)) = &event.payload else { return Ok(()) };
        let Some(profile) = &enriched.profile else { return Ok(()) };
        let mut ids: Vec<&str> = Vec::new();
        for credit in profile.directors.iter().chain(profile.cast.iter().take(LEADING_CAST)) {
            if !ids.contains(&credit.person_id.as_str()) {
                ids.push(&credit.person_id);
            }
        }
        // A few at a time, and every answer waited for: a failed fetch does not throw away the
        // others, which are saved before the failure is answered (the retry fetches them again,
        // and saving the same profile twice changes nothing).
        let fetches: Vec<_> = ids.into_iter().map(|id| self.provider.person(id)).collect();
        let fetched: Vec<_> = futures_util::stream::iter(fetches).buffered(PERSON_FETCHES).collect().await;
        let mut people = Vec::new();
        let mut failed = None;
        for answer in fetched {
            match answer {
                Ok(person) => people.extend(person.and_then(fit::person)),
                // The failure retrying helps most decides (an unavailable provider holds
                // them all): the retry fetches the others again too.
                Err(error) => {
                    if failed.as_ref().is_none_or(|first: &ProviderError| first.rank() < error.rank()) {
                        failed = Some(error);
                    }
                }
            }
        }
        if people.is_empty() {
            return failed.map_or(Ok(()), |error| Err(from_provider(error)));
        }
        let saved = self
            .movies
            .clone()
            .save_people(v1::SavePeopleRequest { people })
            .await
            .map_err(|s| HandlerError::from_call("SavePeople", &s))?
            .into_inner();
        if let Some(error) = failed {
            tracing::debug!(movie_id = %enriched.movie_id, changed = saved.changed, "some people profiled, not all");
            return Err(from_provider(error));
        }
        tracing::debug!(movie_id = %enriched.movie_id, changed = saved.changed, "people profiled");
        Ok(())
    }
}
