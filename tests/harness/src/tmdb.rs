//! A TMDB-shaped HTTP server for enrichment tests: the v3 paths Reelay calls, answers shaped like
//! the real API's (field names, nesting, the 404 body), an API key or bearer token checked on
//! every call, and rate limiting on demand (a 429 with `Retry-After`). It counts what it was asked,
//! so a test can tell a retry from a cache. It is also the image host `/configuration` names:
//! every poster path is served as a real JPEG (made by [`crate::images::jpeg`]).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde_json::{Value, json};

/// The API key the server accepts (`?api_key=`); the bearer token is [`TMDB_TOKEN`].
pub const TMDB_API_KEY: &str = "test-tmdb-key";
pub const TMDB_TOKEN: &str = "test-tmdb-read-token";
/// The width of the poster the image host serves.
pub const TMDB_POSTER_WIDTH: u32 = 600;

/// A film the server knows.
#[derive(Debug, Clone)]
pub struct TmdbFilm {
    pub id: u64,
    pub imdb_id: &'static str,
    pub title: &'static str,
    pub release_date: &'static str,
    pub runtime: u32,
    pub genres: &'static [&'static str],
    pub poster_path: Option<&'static str>,
    /// (person id, name, job); only "Director" is a director.
    pub crew: &'static [(u64, &'static str, &'static str)],
    /// (person id, name, character), in billing order.
    pub cast: &'static [(u64, &'static str, &'static str)],
}

/// A person the server knows.
#[derive(Debug, Clone)]
pub struct TmdbPerson {
    pub id: u64,
    pub name: &'static str,
    pub birthday: &'static str,
    pub place_of_birth: &'static str,
    pub biography: &'static str,
}

/// Heat (1995), with a director, an assistant director (Directing department, not a director)
/// and three leads.
pub fn heat() -> TmdbFilm {
    TmdbFilm {
        id: 949,
        imdb_id: "tt0113277",
        title: "Heat",
        release_date: "1995-12-15",
        runtime: 170,
        genres: &["Action", "Crime", "Drama", "Thriller"],
        poster_path: Some("/heat-poster.jpg"),
        crew: &[
            (638, "Michael Mann", "Director"),
            (9001, "Irene Fictional", "First Assistant Director"),
            (638, "Michael Mann", "Screenplay"),
            (9002, "Dante Spinotti", "Director of Photography"),
        ],
        cast: &[
            (1158, "Al Pacino", "Lt. Vincent Hanna"),
            (380, "Robert De Niro", "Neil McCauley"),
            (5576, "Val Kilmer", "Chris Shiherlis"),
        ],
    }
}

/// Collateral (2004), another Michael Mann film.
pub fn collateral() -> TmdbFilm {
    TmdbFilm {
        id: 1538,
        imdb_id: "tt0369339",
        title: "Collateral",
        release_date: "2004-08-04",
        runtime: 120,
        genres: &["Drama", "Crime", "Thriller"],
        poster_path: None,
        crew: &[(638, "Michael Mann", "Director")],
        cast: &[(500, "Tom Cruise", "Vincent"), (134, "Jamie Foxx", "Max")],
    }
}

pub fn people() -> Vec<TmdbPerson> {
    let person = |id, name, birthday, place_of_birth| TmdbPerson {
        id,
        name,
        birthday,
        place_of_birth,
        biography: "A biography as the test server tells it.",
    };
    vec![
        person(638, "Michael Mann", "1943-02-05", "Chicago, Illinois, USA"),
        person(1158, "Al Pacino", "1940-04-25", "New York City, New York, USA"),
        person(380, "Robert De Niro", "1943-08-17", "New York City, New York, USA"),
        person(5576, "Val Kilmer", "1959-12-31", "Los Angeles, California, USA"),
        person(500, "Tom Cruise", "1962-07-03", "Syracuse, New York, USA"),
        person(134, "Jamie Foxx", "1967-12-13", "Terrell, Texas, USA"),
    ]
}

#[derive(Default)]
struct Counters {
    /// Requests per path (`/3/movie/949`).
    requests: HashMap<String, usize>,
    /// 429s still to answer, per path.
    throttle: HashMap<String, usize>,
    /// Other failures still to answer, per path: (how many, status).
    failures: HashMap<String, (usize, u16)>,
    unauthorized: usize,
    /// How long each person request is held before it is answered.
    person_delay: std::time::Duration,
    /// Person requests being answered now, and the most there were at once.
    people_in_flight: usize,
    people_at_once: usize,
}

struct Data {
    /// `http://<addr>/t/p/`, the images' base URL.
    image_base: String,
    /// What every poster path serves.
    poster: Vec<u8>,
    films: Vec<TmdbFilm>,
    people: Vec<TmdbPerson>,
    retry_after_secs: u64,
    counters: Mutex<Counters>,
}

/// The running server; it stops when dropped.
pub struct TmdbServer {
    pub addr: SocketAddr,
    data: Arc<Data>,
    task: tokio::task::JoinHandle<()>,
}

impl TmdbServer {
    /// Serves `films` and `people` on a free port.
    pub async fn start(films: Vec<TmdbFilm>, people: Vec<TmdbPerson>) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind the TMDB test server");
        let addr = listener.local_addr().unwrap();
        let data = Arc::new(Data {
            image_base: format!("http://{addr}/t/p/"),
            poster: crate::images::jpeg(TMDB_POSTER_WIDTH, TMDB_POSTER_WIDTH * 3 / 2),
            films,
            people,
            retry_after_secs: 1,
            counters: Mutex::default(),
        });
        let router = Router::new()
            .route("/t/p/{size}/{file}", get(poster))
            .route("/3/configuration", get(configuration))
            .route("/3/search/movie", get(search))
            .route("/3/find/{external_id}", get(find))
            .route("/3/movie/{id}", get(movie))
            .route("/3/person/{id}", get(person))
            .fallback(|| async { not_found() })
            .with_state(data.clone());
        let task = tokio::spawn(async move {
            axum::serve(listener, router).await.expect("serve the TMDB test server");
        });
        Self { addr, data, task }
    }

    /// The base URL to configure (`REELAY_ENRICHMENT_TMDB_URL`).
    pub fn url(&self) -> String {
        format!("http://{}/3", self.addr)
    }

    /// The next `times` requests to `path` get a 429 with `Retry-After: 1`.
    pub fn throttle(&self, path: &str, times: usize) {
        self.data.counters.lock().unwrap().throttle.insert(path.to_owned(), times);
    }

    /// The next `times` requests to `path` get `status` (a 5xx, say) with TMDB's error body.
    pub fn fail(&self, path: &str, times: usize, status: u16) {
        self.data.counters.lock().unwrap().failures.insert(path.to_owned(), (times, status));
    }

    /// How many requests reached `path` (429s included).
    pub fn requests(&self, path: &str) -> usize {
        self.data.counters.lock().unwrap().requests.get(path).copied().unwrap_or(0)
    }

    /// The bytes every poster path serves (a JPEG [`TMDB_POSTER_WIDTH`] pixels wide).
    pub fn poster(&self) -> &[u8] {
        &self.data.poster
    }

    /// Requests refused for a missing or wrong key.
    pub fn unauthorized(&self) -> usize {
        self.data.counters.lock().unwrap().unauthorized
    }

    /// Every person request from now on is answered `delay` after it came.
    pub fn delay_people(&self, delay: std::time::Duration) {
        self.data.counters.lock().unwrap().person_delay = delay;
    }

    /// The most person requests that were being answered at once.
    pub fn people_at_once(&self) -> usize {
        self.data.counters.lock().unwrap().people_at_once
    }
}

impl Drop for TmdbServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn not_found() -> Response {
    let body = json!({
        "success": false,
        "status_code": 34,
        "status_message": "The resource you requested could not be found."
    });
    (StatusCode::NOT_FOUND, axum::Json(body)).into_response()
}

/// Counts the request, checks its credentials and answers a pending 429; `Some` ends the request.
fn gate(data: &Data, path: &str, query: &HashMap<String, String>, headers: &HeaderMap) -> Option<Response> {
    let mut counters = data.counters.lock().unwrap();
    *counters.requests.entry(path.to_owned()).or_default() += 1;
    let bearer = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok());
    let authorized = query.get("api_key").map(String::as_str) == Some(TMDB_API_KEY)
        || bearer == Some(&format!("Bearer {TMDB_TOKEN}"));
    if !authorized {
        counters.unauthorized += 1;
        let body = json!({"success": false, "status_code": 7, "status_message": "Invalid API key: You must be granted a valid key."});
        return Some((StatusCode::UNAUTHORIZED, axum::Json(body)).into_response());
    }
    if let Some((left, status)) = counters.failures.get_mut(path).filter(|(left, _)| *left > 0) {
        *left -= 1;
        let body = json!({"success": false, "status_code": 11, "status_message": "Internal error: Something went wrong, contact TMDb."});
        let status = StatusCode::from_u16(*status).expect("a valid status");
        return Some((status, axum::Json(body)).into_response());
    }
    if let Some(left) = counters.throttle.get_mut(path).filter(|left| **left > 0) {
        *left -= 1;
        let body = json!({"success": false, "status_code": 25, "status_message": "Your request count (41) is over the allowed limit of 40."});
        return Some(
            (
                StatusCode::TOO_MANY_REQUESTS,
                [(header::RETRY_AFTER, data.retry_after_secs.to_string())],
                axum::Json(body),
            )
                .into_response(),
        );
    }
    None
}

type Params = Query<HashMap<String, String>>;

async fn configuration(State(data): State<Arc<Data>>, Query(q): Params, headers: HeaderMap) -> Response {
    if let Some(refused) = gate(&data, "/3/configuration", &q, &headers) {
        return refused;
    }
    axum::Json(json!({
        "images": {
            "base_url": data.image_base,
            "secure_base_url": data.image_base,
            "backdrop_sizes": ["w300", "w780", "w1280", "original"],
            "poster_sizes": ["w92", "w154", "w185", "w342", "w500", "w780", "original"],
            "profile_sizes": ["w45", "w185", "h632", "original"]
        },
        "change_keys": ["adult", "title"]
    }))
    .into_response()
}

/// A poster, as the image host serves it (no key needed there).
async fn poster(State(data): State<Arc<Data>>) -> Response {
    ([(header::CONTENT_TYPE, "image/jpeg")], data.poster.clone()).into_response()
}

fn search_hit(film: &TmdbFilm) -> Value {
    json!({
        "adult": false,
        "id": film.id,
        "title": film.title,
        "original_title": film.title,
        "release_date": film.release_date,
        "poster_path": film.poster_path,
        "genre_ids": [],
        "popularity": 40.5,
        "vote_average": 7.9
    })
}

async fn search(State(data): State<Arc<Data>>, Query(q): Params, headers: HeaderMap) -> Response {
    if let Some(refused) = gate(&data, "/3/search/movie", &q, &headers) {
        return refused;
    }
    let title = q.get("query").map(|t| t.to_lowercase()).unwrap_or_default();
    let year = q.get("year").cloned().unwrap_or_default();
    // Like the real search: a partial title matches, the year narrows.
    let results: Vec<Value> = data
        .films
        .iter()
        .filter(|f| f.title.to_lowercase().contains(&title) && (year.is_empty() || f.release_date.starts_with(&year)))
        .map(search_hit)
        .collect();
    let total = results.len();
    axum::Json(json!({"page": 1, "results": results, "total_pages": 1, "total_results": total})).into_response()
}

async fn find(
    State(data): State<Arc<Data>>,
    Path(external_id): Path<String>,
    Query(q): Params,
    headers: HeaderMap,
) -> Response {
    if let Some(refused) = gate(&data, &format!("/3/find/{external_id}"), &q, &headers) {
        return refused;
    }
    let hits: Vec<Value> = data.films.iter().filter(|f| f.imdb_id == external_id).map(search_hit).collect();
    axum::Json(json!({"movie_results": hits, "person_results": [], "tv_results": []})).into_response()
}

async fn movie(
    State(data): State<Arc<Data>>,
    Path(id): Path<String>,
    Query(q): Params,
    headers: HeaderMap,
) -> Response {
    if let Some(refused) = gate(&data, &format!("/3/movie/{id}"), &q, &headers) {
        return refused;
    }
    let Some(film) = data.films.iter().find(|f| f.id.to_string() == id) else { return not_found() };
    let mut body = json!({
        "adult": false,
        "id": film.id,
        "imdb_id": film.imdb_id,
        "title": film.title,
        "original_title": film.title,
        "release_date": film.release_date,
        "runtime": film.runtime,
        "status": "Released",
        "overview": format!("{} as the test server tells it.", film.title),
        "poster_path": film.poster_path,
        "genres": film.genres.iter().enumerate().map(|(n, g)| json!({"id": 18 + n, "name": g})).collect::<Vec<_>>(),
    });
    if q.get("append_to_response").is_some_and(|a| a.split(',').any(|p| p == "credits")) {
        let department =
            |job: &str| if job.contains("Director") && job != "Director of Photography" { "Directing" } else { "Crew" };
        body["credits"] = json!({
            "id": film.id,
            "cast": film.cast.iter().enumerate().map(|(order, (id, name, character))| json!({
                "id": id, "name": name, "character": character, "order": order, "known_for_department": "Acting"
            })).collect::<Vec<_>>(),
            "crew": film.crew.iter().map(|(id, name, job)| json!({
                "id": id, "name": name, "job": job, "department": department(job)
            })).collect::<Vec<_>>(),
        });
    }
    axum::Json(body).into_response()
}

async fn person(
    State(data): State<Arc<Data>>,
    Path(id): Path<String>,
    Query(q): Params,
    headers: HeaderMap,
) -> Response {
    if let Some(refused) = gate(&data, &format!("/3/person/{id}"), &q, &headers) {
        return refused;
    }
    let delay = {
        let mut counters = data.counters.lock().unwrap();
        counters.people_in_flight += 1;
        counters.people_at_once = counters.people_at_once.max(counters.people_in_flight);
        counters.person_delay
    };
    tokio::time::sleep(delay).await;
    data.counters.lock().unwrap().people_in_flight -= 1;
    let Some(person) = data.people.iter().find(|p| p.id.to_string() == id) else { return not_found() };
    let credit = |f: &TmdbFilm| json!({"id": f.id, "title": f.title, "release_date": f.release_date});
    let cast: Vec<Value> = data.films.iter().filter(|f| f.cast.iter().any(|c| c.0 == person.id)).map(credit).collect();
    let crew: Vec<Value> = data.films.iter().filter(|f| f.crew.iter().any(|c| c.0 == person.id)).map(credit).collect();
    let mut body = json!({
        "id": person.id,
        "name": person.name,
        "birthday": person.birthday,
        "place_of_birth": person.place_of_birth,
        "biography": person.biography,
        "known_for_department": "Acting",
    });
    if q.get("append_to_response").is_some_and(|a| a.contains("movie_credits")) {
        body["movie_credits"] = json!({"cast": cast, "crew": crew});
    }
    axum::Json(body).into_response()
}
