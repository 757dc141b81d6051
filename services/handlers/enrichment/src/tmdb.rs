//! The Movie Database (TMDB) API v3 over HTTP: `/movie/{id}?append_to_response=credits`,
//! `/find/{imdb id}`, `/search/movie` by title and year, `/person/{id}`, and `/configuration`
//! for where posters live. Directors are the crew whose job is "Director" (the Directing
//! department also holds assistants). A 429 is retried after its `Retry-After`; a connection
//! not made, a timeout, a 502/503/504 or a 429 that goes on say TMDB is unavailable (the
//! handler's events are held until it answers); other 5xx are retryable; a 404 means the
//! provider does not know the film.

use std::time::Duration;

use reelay_contracts::v1;
use reqwest::StatusCode;
use serde::Deserialize;
use serde::de::DeserializeOwned;
use tokio::sync::OnceCell;

use crate::provider::{MetadataProvider, MovieQuery, ProviderError};

/// Cast members kept per film (TMDB lists hundreds for some).
const CAST_KEPT: usize = 30;
/// How often one request waits out a 429 before giving up for now, and how long it waits in
/// all: a film takes several requests inside one handler call (a minute by default), so a
/// longer wait is left to the runtime's retry.
const RATE_LIMIT_RETRIES: u32 = 3;
const MAX_RATE_LIMIT_WAIT: Duration = Duration::from_secs(20);
/// The largest answer read (a film with its credits is well under 1 MB).
const MAX_ANSWER_BYTES: usize = 8 * 1024 * 1024;

pub struct Tmdb {
    http: reqwest::Client,
    base: String,
    auth: Auth,
    /// `<secure base url><size>` for posters, learnt once from `/configuration`.
    poster_base: OnceCell<String>,
}

#[derive(Debug, Clone)]
pub enum Auth {
    /// A v3 API key, sent as the `api_key` query parameter.
    ApiKey(String),
    /// A read access token, sent as `Authorization: Bearer`.
    Bearer(String),
}

#[derive(Deserialize)]
struct MovieDetails {
    id: u64,
    #[serde(default)]
    imdb_id: Option<String>,
    title: String,
    #[serde(default, deserialize_with = "null_as_default")]
    release_date: String,
    #[serde(default)]
    runtime: Option<u32>,
    #[serde(default, deserialize_with = "null_as_default")]
    genres: Vec<Named>,
    #[serde(default)]
    poster_path: Option<String>,
    #[serde(default, deserialize_with = "null_as_default")]
    overview: String,
    #[serde(default, deserialize_with = "null_as_default")]
    credits: Credits,
}

#[derive(Deserialize)]
struct Named {
    name: String,
}

#[derive(Deserialize, Default)]
struct Credits {
    #[serde(default, deserialize_with = "null_as_default")]
    cast: Vec<CastMember>,
    #[serde(default, deserialize_with = "null_as_default")]
    crew: Vec<CrewMember>,
}

#[derive(Deserialize)]
struct CastMember {
    id: u64,
    name: String,
    #[serde(default, deserialize_with = "null_as_default")]
    character: String,
    #[serde(default)]
    order: u32,
}

#[derive(Deserialize)]
struct CrewMember {
    id: u64,
    name: String,
    #[serde(default, deserialize_with = "null_as_default")]
    job: String,
}

#[derive(Deserialize)]
struct SearchResults {
    #[serde(default, deserialize_with = "null_as_default")]
    results: Vec<SearchHit>,
}

#[derive(Deserialize)]
struct SearchHit {
    id: u64,
    title: String,
    /// The title in the film's own language, when the search answers in another.
    #[serde(default, deserialize_with = "null_as_default")]
    original_title: String,
    #[serde(default, deserialize_with = "null_as_default")]
    release_date: String,
}

#[derive(Deserialize)]
struct FindResults {
    #[serde(default, deserialize_with = "null_as_default")]
    movie_results: Vec<SearchHit>,
}

#[derive(Deserialize)]
struct PersonDetails {
    id: u64,
    name: String,
    #[serde(default, deserialize_with = "null_as_default")]
    biography: String,
    #[serde(default)]
    birthday: Option<String>,
    #[serde(default)]
    place_of_birth: Option<String>,
    #[serde(default, deserialize_with = "null_as_default")]
    movie_credits: PersonCredits,
}

#[derive(Deserialize, Default)]
struct PersonCredits {
    #[serde(default, deserialize_with = "null_as_default")]
    cast: Vec<SearchHit>,
    #[serde(default, deserialize_with = "null_as_default")]
    crew: Vec<SearchHit>,
}

#[derive(Deserialize)]
struct Configuration {
    images: Images,
}

#[derive(Deserialize)]
struct Images {
    secure_base_url: String,
    #[serde(default, deserialize_with = "null_as_default")]
    poster_sizes: Vec<String>,
}

/// A field's default when it is missing or `null`: TMDB sends `"overview": null`, `"character":
/// null` and the like, which `#[serde(default)]` alone refuses (it covers a missing field only).
fn null_as_default<'de, D, T>(deserializer: D) -> Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Default + Deserialize<'de>,
{
    Ok(Option::<T>::deserialize(deserializer)?.unwrap_or_default())
}

/// Whether `id` is an IMDb title id (`tt` and digits): anything else would be put in a TMDB
/// path as it is (`imdb:../account` reaches another endpoint with the API key).
fn imdb_title_id(id: &str) -> bool {
    id.len() > 2 && id.starts_with("tt") && id[2..].bytes().all(|b| b.is_ascii_digit())
}

fn year_of(date: &str) -> Option<i32> {
    date.get(..4).and_then(|y| y.parse().ok())
}

/// A title as compared with a search hit's: its letters and digits, in lower case (so
/// punctuation, spacing and case aside, "Dr. Strangelove" is "dr strangelove").
fn title_letters(title: &str) -> String {
    reelay_domain::validate::title_key(title).chars().filter(|c| c.is_alphanumeric()).collect()
}

/// The hit that is the film a title and year name: the same title (or original title) in
/// that year, else in the year before or after (release years differ between countries).
/// None when no hit has the title: the search ranks by relevance, and its best hit of the
/// year may be another film ("Heat Wave" for "Heat").
fn best_hit(hits: &[SearchHit], title: &str, year: i32) -> Option<u64> {
    let wanted = title_letters(title);
    let named = |h: &&SearchHit| title_letters(&h.title) == wanted || title_letters(&h.original_title) == wanted;
    let in_year =
        |h: &&SearchHit, distance: i32| year_of(&h.release_date).is_some_and(|y| (y - year).abs() <= distance);
    let exact = hits.iter().filter(named).find(|h| in_year(h, 0));
    exact.or_else(|| hits.iter().filter(named).find(|h| in_year(h, 1))).map(|h| h.id)
}

impl Tmdb {
    pub fn new(base: &str, auth: Auth, timeout: Duration) -> Result<Self, String> {
        // A base no request could use is refused here, not found out by every film's retries.
        let base = match reqwest::Url::parse(base.trim()) {
            Ok(url)
                if matches!(url.scheme(), "http" | "https")
                    && url.host_str().is_some()
                    && url.query().is_none()
                    && url.fragment().is_none() =>
            {
                url
            }
            _ => {
                return Err(format!(
                    "REELAY_ENRICHMENT_TMDB_URL must be an http(s) URL with a host and no query, got {base:?}"
                ));
            }
        };
        let http = reqwest::Client::builder()
            .timeout(timeout)
            // A TMDB that does not take the connection (blackholed) is told apart from one slow
            // to answer, and soon: reqwest reports this as a connect error.
            .connect_timeout(timeout.min(Duration::from_secs(5)))
            .user_agent(concat!("reelay/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| format!("cannot build the TMDB client: {e}"))?;
        Ok(Self { http, base: base.as_str().trim_end_matches('/').to_owned(), auth, poster_base: OnceCell::new() })
    }

    /// GETs `path` (with `query`), decoding a 2xx body; `None` on 404. A 429 is retried after
    /// the wait its `Retry-After` asks for (a few times, [`MAX_RATE_LIMIT_WAIT`] in all); past
    /// that TMDB is unavailable for now.
    async fn get<T: DeserializeOwned>(&self, path: &str, query: &[(&str, &str)]) -> Result<Option<T>, ProviderError> {
        let (mut tries, mut waited) = (0, Duration::ZERO);
        loop {
            match self.get_once(path, query).await {
                Err(ProviderError::Unavailable { after: Some(after), .. })
                    if tries < RATE_LIMIT_RETRIES && waited + after <= MAX_RATE_LIMIT_WAIT =>
                {
                    tries += 1;
                    waited += after;
                    tracing::info!(path, wait_ms = after.as_millis() as u64, "TMDB asked to slow down (429); waiting");
                    tokio::time::sleep(after).await;
                }
                result => return result,
            }
        }
    }

    async fn get_once<T: DeserializeOwned>(
        &self,
        path: &str,
        query: &[(&str, &str)],
    ) -> Result<Option<T>, ProviderError> {
        let mut request = self.http.get(format!("{}{path}", self.base)).query(query);
        request = match &self.auth {
            Auth::ApiKey(key) => request.query(&[("api_key", key.as_str())]),
            Auth::Bearer(token) => request.bearer_auth(token),
        };
        // An error's text names its URL, whose query holds an API key: the key must not reach
        // the delivery's error (kept in the ledger and dead letters, shown by the CLI) or logs.
        let failed = |e: reqwest::Error| {
            // Not connected, or no answer in time: TMDB (or the way there) is down for every
            // request alike. (A film that alone times out is let go by the runtime's hold.)
            let down = e.is_connect() || e.is_timeout();
            let message = format!("TMDB {path}: {}", e.without_url());
            if down { ProviderError::unavailable(message) } else { ProviderError::retryable(message) }
        };
        let response = request.send().await.map_err(failed)?;
        let status = response.status();
        match status {
            s if s.is_success() => {}
            StatusCode::NOT_FOUND => return Ok(None),
            StatusCode::TOO_MANY_REQUESTS => {
                let after = response
                    .headers()
                    .get(reqwest::header::RETRY_AFTER)
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.trim().parse::<u64>().ok())
                    .map(Duration::from_secs);
                return Err(ProviderError::Unavailable { message: format!("TMDB {path}: rate limited (429)"), after });
            }
            // A gateway's answers: TMDB behind it is down or overloaded, for every request.
            StatusCode::BAD_GATEWAY | StatusCode::SERVICE_UNAVAILABLE | StatusCode::GATEWAY_TIMEOUT => {
                return Err(ProviderError::unavailable(format!("TMDB {path}: {status}")));
            }
            // 408 and 425 (too early) say to try again, as a 5xx does.
            s if s.is_server_error() || matches!(s.as_u16(), 408 | 425) => {
                return Err(ProviderError::retryable(format!("TMDB {path}: {s}")));
            }
            StatusCode::UNAUTHORIZED => {
                return Err(ProviderError::Permanent(format!(
                    "TMDB {path}: 401: the API key or token was refused (REELAY_ENRICHMENT_TMDB_API_KEY / _TOKEN)"
                )));
            }
            s => return Err(ProviderError::Permanent(format!("TMDB {path}: {s}"))),
        }
        let mut response = response;
        let mut body = Vec::new();
        while let Some(chunk) = response.chunk().await.map_err(failed)? {
            if body.len() + chunk.len() > MAX_ANSWER_BYTES {
                return Err(ProviderError::Permanent(format!(
                    "TMDB {path}: an answer over {MAX_ANSWER_BYTES} bytes (REELAY_ENRICHMENT_TMDB_URL is not TMDB?)"
                )));
            }
            body.extend_from_slice(&chunk);
        }
        serde_json::from_slice(&body)
            .map(Some)
            .map_err(|e| ProviderError::Permanent(format!("TMDB {path}: an answer that does not decode: {e}")))
    }

    async fn poster_base(&self) -> Result<&str, ProviderError> {
        self.poster_base
            .get_or_try_init(|| async {
                let config: Configuration = self
                    .get("/configuration", &[])
                    .await?
                    .ok_or_else(|| ProviderError::Permanent("TMDB /configuration: 404".into()))?;
                let size = if config.images.poster_sizes.iter().any(|s| s == "original") { "original" } else { "w500" };
                Ok(format!("{}{size}", config.images.secure_base_url))
            })
            .await
            .map(String::as_str)
    }

    /// The TMDB id of the film a query names.
    async fn resolve(&self, query: &MovieQuery) -> Result<Option<u64>, ProviderError> {
        match query.external_id.as_deref().and_then(|id| id.split_once(':')) {
            // Not a TMDB id after all (`tmdb:tt0133093`): looked up by title, as any id TMDB
            // cannot use.
            Some(("tmdb", id)) => {
                if let Ok(id) = id.parse() {
                    return Ok(Some(id));
                }
            }
            Some(("imdb", imdb)) if imdb_title_id(imdb) => {
                let found: Option<FindResults> =
                    self.get(&format!("/find/{imdb}"), &[("external_source", "imdb_id")]).await?;
                if let Some(hit) = found.and_then(|f| f.movie_results.into_iter().next()) {
                    return Ok(Some(hit.id));
                }
            }
            _ => {}
        }
        let year = query.year.to_string();
        let found: Option<SearchResults> =
            self.get("/search/movie", &[("query", query.title.as_str()), ("year", year.as_str())]).await?;
        let hits = found.map(|f| f.results).unwrap_or_default();
        Ok(best_hit(&hits, &query.title, query.year))
    }
}

#[async_trait::async_trait]
impl MetadataProvider for Tmdb {
    fn name(&self) -> &'static str {
        "tmdb"
    }

    async fn movie(&self, query: &MovieQuery) -> Result<Option<v1::MovieProfile>, ProviderError> {
        let Some(id) = self.resolve(query).await? else { return Ok(None) };
        let Some(details): Option<MovieDetails> =
            self.get(&format!("/movie/{id}"), &[("append_to_response", "credits")]).await?
        else {
            return Ok(None);
        };
        let poster_url = match &details.poster_path {
            Some(path) if !path.is_empty() => format!("{}{path}", self.poster_base().await?),
            _ => String::new(),
        };
        let mut cast = details.credits.cast;
        cast.sort_by_key(|c| c.order);
        Ok(Some(v1::MovieProfile {
            provider: "tmdb".into(),
            provider_id: format!("tmdb:{}", details.id),
            imdb_id: details.imdb_id.unwrap_or_default(),
            year: year_of(&details.release_date).unwrap_or(query.year),
            title: details.title,
            runtime_minutes: details.runtime.unwrap_or(0),
            genres: details.genres.into_iter().map(|g| g.name).collect(),
            directors: details
                .credits
                .crew
                .into_iter()
                .filter(|c| c.job == "Director")
                .map(|c| v1::PersonCredit { person_id: format!("tmdb:{}", c.id), name: c.name, role: String::new() })
                .collect(),
            cast: cast
                .into_iter()
                .take(CAST_KEPT)
                .map(|c| v1::PersonCredit { person_id: format!("tmdb:{}", c.id), name: c.name, role: c.character })
                .collect(),
            poster_url,
            overview: details.overview,
        }))
    }

    async fn person(&self, person_id: &str) -> Result<Option<v1::Person>, ProviderError> {
        // Digits only, as a film's id: the id goes into the URL's path.
        let Some(id) =
            person_id.strip_prefix("tmdb:").filter(|id| !id.is_empty() && id.bytes().all(|b| b.is_ascii_digit()))
        else {
            return Ok(None);
        };
        let Some(details): Option<PersonDetails> =
            self.get(&format!("/person/{id}"), &[("append_to_response", "movie_credits")]).await?
        else {
            return Ok(None);
        };
        let mut films: Vec<SearchHit> =
            details.movie_credits.crew.into_iter().chain(details.movie_credits.cast).collect();
        films.sort_by(|a, b| a.release_date.cmp(&b.release_date));
        films.dedup_by_key(|f| f.id);
        Ok(Some(v1::Person {
            person_id: format!("tmdb:{}", details.id),
            name: details.name,
            biography: details.biography,
            birthday: details.birthday.unwrap_or_default(),
            place_of_birth: details.place_of_birth.unwrap_or_default(),
            known_for: films
                .iter()
                .take(20)
                .map(|f| match year_of(&f.release_date) {
                    Some(year) => format!("{} ({year})", f.title),
                    None => f.title.clone(),
                })
                .collect(),
            profiled: true,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hit(id: u64, title: &str, original_title: &str, release_date: &str) -> SearchHit {
        SearchHit { id, title: title.into(), original_title: original_title.into(), release_date: release_date.into() }
    }

    /// A search's hits are the film only under its own title (or original title), in its year
    /// or the next to it: never the best-ranked other film of that year.
    /// TMDB's nulls read as missing fields, and an external id that is not an IMDb title id is
    /// never put in a path.
    #[test]
    fn nulls_are_defaults_and_imdb_ids_have_their_shape() {
        let details: MovieDetails = serde_json::from_str(
            r#"{"id": 1, "title": "Heat", "release_date": null, "overview": null, "genres": null,
                "credits": {"cast": [{"id": 2, "name": "Al Pacino", "character": null}], "crew": null}}"#,
        )
        .unwrap();
        assert_eq!((details.overview.as_str(), details.release_date.as_str()), ("", ""));
        assert_eq!(details.credits.cast[0].character, "");
        assert!(imdb_title_id("tt0113277"));
        for bad in ["../../account", "tt", "tt12/x", "nm0000001", ""] {
            assert!(!imdb_title_id(bad), "{bad}");
        }
    }

    /// A request that fails on its way (here a server that closes every connection) is a
    /// retryable error, one that cannot connect says TMDB is unavailable; either's text names the path but not the API key of its query; a person id
    /// that is not digits is never put in a path (no request: a closed server would fail it).
    #[tokio::test]
    async fn failures_keep_the_api_key_out_and_person_ids_have_their_shape() {
        // As the binary does at its start (reqwest's TLS needs a provider even for http).
        let _ = rustls::crypto::ring::default_provider().install_default();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move {
            while let Ok((connection, _)) = listener.accept().await {
                drop(connection);
            }
        });
        let tmdb = Tmdb::new(&base, Auth::ApiKey("k3y-n0t-t0-l3ak".into()), Duration::from_secs(5)).unwrap();
        match tmdb.person("tmdb:287").await {
            Err(ProviderError::Retryable(message)) => {
                assert!(message.starts_with("TMDB /person/287: "), "{message}");
                assert!(!message.contains("k3y-n0t-t0-l3ak"), "{message}");
            }
            other => panic!("{other:?}"),
        }
        for bad in ["tmdb:../account", "tmdb:", "tmdb:1/credits", "tmdb:12?x=1"] {
            assert!(matches!(tmdb.person(bad).await, Ok(None)), "{bad}");
        }
        // Nobody listening: TMDB is unavailable, for every request alike.
        let closed = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", closed.local_addr().unwrap());
        drop(closed);
        let tmdb = Tmdb::new(&base, Auth::ApiKey("k3y-n0t-t0-l3ak".into()), Duration::from_secs(5)).unwrap();
        match tmdb.person("tmdb:287").await {
            Err(ProviderError::Unavailable { message, .. }) => {
                assert!(!message.contains("k3y-n0t-t0-l3ak"), "{message}")
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_hit_is_the_film_only_by_its_title() {
        let hits = [hit(1, "Heat", "Heat", "1995-12-15"), hit(2, "Heat Wave", "Heat Wave", "1996-03-01")];
        assert_eq!(best_hit(&hits, "Heat", 1995), Some(1));
        assert_eq!(best_hit(&hits, "heat ", 1996), Some(1), "a year off, the same title");
        assert_eq!(best_hit(&hits, "Heat Wave", 1996), Some(2));
        assert_eq!(best_hit(&hits, "Heat", 1997), None);
        assert_eq!(best_hit(&hits, "Fire", 1996), None, "no hit of the year by another title");
        let hits =
            [hit(3, "Léon: The Professional", "Léon", "1994-09-14"), hit(4, "Dr. Strangelove", "", "1964-01-29")];
        assert_eq!(best_hit(&hits, "LÉON", 1994), Some(3), "by its original title");
        assert_eq!(best_hit(&hits, "Dr Strangelove", 1964), Some(4), "punctuation aside");
    }
}
