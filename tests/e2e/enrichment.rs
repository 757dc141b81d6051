//! Enrichment and the yearly wrap-up, end to end: films enriched from a TMDB-shaped HTTP server
//! (a 429 with `Retry-After`, a 404, assistants in the Directing department) and from the offline
//! catalog `reelay run` ships; a crash between the people and the profile; every handler run
//! twice on one event; a 2024 diary imported from a Letterboxd export whose wrap-up matches
//! figures computed here, with its card fetched over HTTP from the filesystem and from a real
//! S3-compatible server.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;

use reelay_contracts::v1::{self, event::Payload, search_client::SearchClient};
use reelay_harness::{
    AuthedChannel, Backend, Clients, Cluster, MotoServer, Reelay, TMDB_API_KEY, TMDB_POSTER_WIDTH, TMDB_TOKEN,
    TmdbServer, events_of, films, http_request, movie_ref, outbox_rows, query_strings, temp_dir,
};

const BIN: &str = env!("CARGO_BIN_EXE_reelay");
/// How long a test waits for what handlers do.
const LIMIT: Duration = Duration::from_secs(60);
const DIARY_2024: &[u8] = include_bytes!("../fixtures/letterboxd-2024.csv");

async fn eventually<F, Fut>(what: &str, probe: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    reelay_harness::eventually(what, LIMIT, probe).await
}

/// The movie once its enrichment settled (enriched or not found).
async fn settled_movie(c: &Clients, movie_id: &str) -> v1::Movie {
    reelay_harness::eventually_some(&format!("movie {movie_id} is enriched or known unknown"), LIMIT, || {
        let mut movies = c.movies.clone();
        let id = movie_id.to_owned();
        async move {
            let movie = movies.get_movie(v1::GetMovieRequest { movie_id: id }).await.unwrap().into_inner();
            (movie.enrichment() != v1::EnrichmentStatus::Pending).then_some(movie)
        }
    })
    .await
}

/// The events of one type raised for one aggregate.
async fn events_for(db: &std::path::Path, event_type: &str, aggregate: &str) -> Vec<v1::Event> {
    events_of(db, event_type).await.into_iter().filter(|e| e.aggregate_id == aggregate).collect()
}

fn names(credits: &[v1::PersonCredit]) -> Vec<&str> {
    credits.iter().map(|c| c.name.as_str()).collect()
}

fn tmdb_env(tmdb: &TmdbServer) -> Vec<(String, String)> {
    vec![
        ("REELAY_ENRICHMENT_PROVIDER".into(), "tmdb".into()),
        ("REELAY_ENRICHMENT_TMDB_URL".into(), tmdb.url()),
        ("REELAY_ENRICHMENT_TMDB_API_KEY".into(), TMDB_API_KEY.into()),
    ]
}

/// Handler settings that enrich from `tmdb`, for handlers built in the test's process.
fn tmdb_settings(tmdb: &TmdbServer) -> reelay_handlers::HandlerSettings {
    let mut settings = reelay_handlers::HandlerSettings::default();
    settings.enrichment.provider = reelay_enrichment::ProviderKind::Tmdb;
    settings.enrichment.tmdb_url = tmdb.url();
    settings.enrichment.tmdb_api_key = Some(TMDB_API_KEY.into());
    settings
}

fn borrowed(env: &[(String, String)]) -> Vec<(&str, &str)> {
    env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect()
}

async fn movie_hits(search: &mut SearchClient<AuthedChannel>, query: &str) -> Vec<v1::MovieHit> {
    search
        .search_movies(v1::SearchMoviesRequest { query: query.into(), ..Default::default() })
        .await
        .expect("search movies")
        .into_inner()
        .hits
}

#[tokio::test]
async fn tmdb_enriches_films_and_people_through_rate_limits_and_unknown_films() {
    // A days-long art film whose credits hold a name with a tab and an isolate, and a blank one:
    // the write service refuses each, so enrichment brings them within its limits.
    let forever = reelay_harness::TmdbFilm {
        id: 77_001,
        imdb_id: "tt2091380",
        title: "Modern Times Forever",
        release_date: "2011-06-10",
        runtime: 14_400,
        genres: &["Documentary"],
        poster_path: None,
        crew: &[(77_002, "Jakob\tFenger\u{2066}", "Director"), (77_003, "  ", "Director")],
        cast: &[],
    };
    let tmdb = TmdbServer::start(vec![films::heat(), films::collateral(), forever], films::people()).await;
    tmdb.throttle("/3/movie/949", 1);
    let dir = temp_dir();
    let db = dir.path().join("reelay.db");
    let env = tmdb_env(&tmdb);
    let mut reelay = Reelay::start_all(BIN, &db, &borrowed(&env)).await;
    let mut c = reelay.clients().await;
    let ana = c.user("ana").await;

    let heat = c.movie(&ana, "Heat", 1995).await;
    let unknown = c.movie(&ana, "A Film Nobody Made", 1999).await;
    let movie = settled_movie(&c, &heat).await;
    assert_eq!(movie.enrichment(), v1::EnrichmentStatus::Enriched);
    let profile = movie.profile.clone().unwrap();
    assert_eq!((profile.provider.as_str(), profile.provider_id.as_str()), ("tmdb", "tmdb:949"));
    assert_eq!((profile.imdb_id.as_str(), profile.runtime_minutes, profile.year), ("tt0113277", 170, 1995));
    assert_eq!(profile.genres, ["Action", "Crime", "Drama", "Thriller"]);
    assert_eq!(names(&profile.directors), ["Michael Mann"], "assistants and the DP are not directors");
    assert_eq!(names(&profile.cast), ["Al Pacino", "Robert De Niro", "Val Kilmer"]);
    assert_eq!(profile.cast[0].role, "Lt. Vincent Hanna");
    assert_eq!(profile.poster_url, format!("http://{}/t/p/original/heat-poster.jpg", tmdb.addr));
    assert_eq!(tmdb.requests("/3/movie/949"), 2, "the 429 was waited out and retried once");
    assert_eq!(tmdb.unauthorized(), 0);

    let unknown = settled_movie(&c, &unknown).await;
    assert_eq!(unknown.enrichment(), v1::EnrichmentStatus::NotFound);
    assert!(unknown.profile.is_none());
    assert_eq!(tmdb.requests("/3/search/movie"), 2, "one search per film: a film TMDB lacks is not retried");

    // Person enrichment profiles the director and the leads.
    for (id, name, born) in [("tmdb:638", "Michael Mann", "1943-02-05"), ("tmdb:1158", "Al Pacino", "1940-04-25")] {
        let person = reelay_harness::eventually_some(&format!("{name} is profiled"), LIMIT, || {
            let mut movies = c.movies.clone();
            async move {
                let person = movies.get_person(v1::GetPersonRequest { person_id: id.into() }).await.ok()?.into_inner();
                person.profiled.then_some(person)
            }
        })
        .await;
        assert_eq!((person.name.as_str(), person.birthday.as_str()), (name, born));
        assert!(person.known_for.contains(&"Heat (1995)".to_owned()), "{:?}", person.known_for);
    }
    let stub = c.movies.get_person(v1::GetPersonRequest { person_id: "tmdb:9001".into() }).await;
    assert_eq!(stub.unwrap_err().code(), tonic::Code::NotFound, "the assistant director is nobody's credit");
    let bad = c.movies.get_person(v1::GetPersonRequest { person_id: "638".into() }).await.unwrap_err();
    assert_eq!(bad.code(), tonic::Code::InvalidArgument);
    assert!(bad.message().contains("person_id"), "{}", bad.message());

    // One MovieEnriched for Heat, carrying what the media handlers need.
    let enriched = events_for(&db, "MovieEnriched", &heat).await;
    assert_eq!(enriched.len(), 1);
    let Some(Payload::MovieEnriched(event)) = &enriched[0].payload else { panic!("not a MovieEnriched") };
    assert_eq!((event.title.as_str(), event.year), ("Heat", 1995));
    assert_eq!(event.profile.as_ref().unwrap().poster_url, profile.poster_url);
    assert!(events_for(&db, "MovieEnriched", &unknown.movie_id).await.is_empty(), "an unknown film raises nothing");

    // The media handlers take it from there: TMDB's image host serves the poster, stored as
    // downloaded, and its variants are made.
    let sizes = reelay_harness::eventually_some("Heat's poster and its variants are stored", LIMIT, || {
        let (mut movies, heat) = (c.movies.clone(), heat.clone());
        async move {
            let movie = movies.get_movie(v1::GetMovieRequest { movie_id: heat }).await.ok()?.into_inner();
            (movie.poster_sizes.len() > 1).then_some(movie.poster_sizes)
        }
    })
    .await;
    assert_eq!(sizes, ["original", "w92", "w185", "w342", "w500"], "{TMDB_POSTER_WIDTH} px wide: every width");
    let original = std::fs::read(dir.path().join(format!("objects/posters/{heat}/original"))).unwrap();
    assert_eq!(original, tmdb.poster(), "the stored original is the served poster");

    // Search indexes what enrichment added.
    let mut search = SearchClient::new(reelay.handlers_channel().await);
    eventually("searching the director finds Heat", || {
        let mut search = search.clone();
        async move { movie_hits(&mut search, "Michael Mann").await.iter().any(|h| h.title == "Heat") }
    })
    .await;
    let hit = movie_hits(&mut search, "Michael Mann").await.remove(0);
    assert_eq!((hit.directors, hit.genres.len()), (vec!["Michael Mann".to_owned()], 4));

    // Asking again re-reads the provider, and an unchanged profile raises nothing new.
    c.movies
        .request_enrichment(v1::RequestEnrichmentRequest {
            actor_user_id: ana.clone(),
            movie_id: heat.clone(),
            ..Default::default()
        })
        .await
        .unwrap();
    eventually("the second enrichment ran", || async { tmdb.requests("/3/movie/949") == 3 }).await;
    eventually("the second enrichment is settled", || {
        let db = db.clone();
        async move { reelay_harness::unsettled(&db, false, &["movie-enrichment"]).await.is_empty() }
    })
    .await;
    assert_eq!(events_for(&db, "MovieEnriched", &heat).await.len(), 1);
    assert_eq!(tmdb.requests("/3/search/movie"), 2, "asked again, Heat is looked up by its TMDB id, not its title");

    let forever = c.movie(&ana, "Modern Times Forever", 2011).await;
    let forever = settled_movie(&c, &forever).await;
    assert_eq!(forever.enrichment(), v1::EnrichmentStatus::Enriched);
    let profile = forever.profile.unwrap();
    assert_eq!(profile.runtime_minutes, 0, "no runtime rather than one refused");
    assert_eq!(names(&profile.directors), ["Jakob Fenger"]);
    reelay.stop().await;
}

/// TMDB answers 503 (down behind its gateway) more times than a film's event has attempts:
/// the enrichment holds the event, spending none, tries again with a backoff, and enriches the
/// film once TMDB answers; nothing is dead-lettered.
#[tokio::test]
async fn a_tmdb_outage_longer_than_the_attempts_holds_the_film_until_it_answers() {
    let tmdb = TmdbServer::start(vec![films::heat()], films::people()).await;
    tmdb.fail("/3/search/movie", 4, 503);
    let dir = temp_dir();
    let db = dir.path().join("reelay.db");
    let mut env = tmdb_env(&tmdb);
    env.extend([("EVENT_QUEUE_MAX_ATTEMPTS", "2"), ("REELAY_RETRY_BASE_MS", "100")].map(|(k, v)| (k.into(), v.into())));
    let mut reelay = Reelay::start_all(BIN, &db, &borrowed(&env)).await;
    let mut c = reelay.clients().await;
    let ana = c.user("ana").await;
    let heat = c.movie(&ana, "Heat", 1995).await;
    let movie = settled_movie(&c, &heat).await;
    assert_eq!(movie.enrichment(), v1::EnrichmentStatus::Enriched);
    assert_eq!(tmdb.requests("/3/search/movie"), 5, "four 503s, each tried again, then the answer");
    assert_eq!(reelay_harness::dead_letters(&db, false).await, 0);
    assert!(reelay.log_text().contains("a dependency of the handler is unavailable"));
    reelay.stop().await;
}

#[tokio::test]
async fn a_crash_between_the_people_and_the_profile_redoes_the_film_once() {
    let tmdb = TmdbServer::start(vec![films::heat()], films::people()).await;
    let dir = temp_dir();
    let tmdb_url = tmdb.url();
    let cluster = Cluster::builder(BIN, Backend::Db)
        .env("REELAY_ENRICHMENT_PROVIDER", "tmdb")
        .env("REELAY_ENRICHMENT_TMDB_URL", &tmdb_url)
        .env("REELAY_ENRICHMENT_TMDB_TOKEN", TMDB_TOKEN)
        // The crashed process's claim comes back soon, but not so soon that a renewal slowed by
        // a loaded machine lapses (which would fetch the film a third time).
        .env("REELAY_LEDGER_LEASE_MS", "4000")
        .env("REELAY_OUTBOX_LEASE_MS", "4000")
        .handlers(&[("REELAY_HANDLERS", "movie-enrichment"), ("REELAY_FAILPOINTS", "enrichment_after_people")])
        .start(dir.path())
        .await;
    let mut cluster = cluster;
    let mut c = cluster.write.clients().await;
    let ana = c.user("ana").await;
    let heat = c.movie(&ana, "Heat", 1995).await;

    let crashed = &mut cluster.handlers[0];
    eventually("the handler aborted at the failpoint", || {
        let running = crashed.is_running();
        async move { !running }
    })
    .await;
    let people = query_strings(&cluster.db, "SELECT person_id FROM people ORDER BY person_id").await;
    assert_eq!(people.len(), 4, "the people were saved before the crash: {people:?}");
    let movie = c.movies.get_movie(v1::GetMovieRequest { movie_id: heat.clone() }).await.unwrap().into_inner();
    assert_eq!(movie.enrichment(), v1::EnrichmentStatus::Pending, "the profile comes last");

    // The same handlers process, without the failpoint, picks the delivery up again.
    let data_dir = dir.path().join("handlers-again");
    let env = vec![
        ("REELAY_HANDLERS", "movie-enrichment"),
        ("REELAY_ENRICHMENT_PROVIDER", "tmdb"),
        ("REELAY_ENRICHMENT_TMDB_URL", tmdb_url.as_str()),
        ("REELAY_ENRICHMENT_TMDB_TOKEN", TMDB_TOKEN),
    ];
    let mut again = Reelay::start_handlers(BIN, &cluster.write, &data_dir, &env).await;
    let movie = settled_movie(&c, &heat).await;
    assert_eq!(movie.enrichment(), v1::EnrichmentStatus::Enriched);
    assert_eq!(movie.profile.unwrap().runtime_minutes, 170);
    assert_eq!(tmdb.requests("/3/movie/949"), 2, "the film was fetched again after the crash");
    assert_eq!(query_strings(&cluster.db, "SELECT COUNT(*) || '' FROM people").await[0][0], "4");
    eventually("the delivery is settled", || {
        let db = cluster.db.clone();
        async move { reelay_harness::unsettled(&db, false, &["movie-enrichment"]).await.is_empty() }
    })
    .await;
    assert_eq!(events_for(&cluster.db, "MovieEnriched", &heat).await.len(), 1);
    again.stop().await;
    cluster.handlers.clear();
    cluster.stop().await;
}

#[tokio::test]
async fn the_offline_catalog_enriches_with_no_key_and_no_network() {
    let dir = temp_dir();
    let db = dir.path().join("reelay.db");
    // Nothing set: the default provider is the catalog inside the binary.
    let mut reelay = Reelay::start_all(BIN, &db, &[]).await;
    let mut c = reelay.clients().await;
    let ana = c.user("ana").await;
    let review = c.review(&ana, movie_ref("Heat", 1995), 9).await;
    let unknown = c.movie(&ana, "A Film The Catalog Lacks", 2011).await;

    let movie = settled_movie(&c, &review.movie_id).await;
    assert_eq!(movie.enrichment(), v1::EnrichmentStatus::Enriched);
    let profile = movie.profile.unwrap();
    assert_eq!((profile.provider.as_str(), profile.runtime_minutes), ("catalog", 170));
    assert_eq!(names(&profile.directors), ["Michael Mann"]);
    assert!(profile.genres.contains(&"Crime".to_owned()), "{:?}", profile.genres);
    assert!(names(&profile.cast).contains(&"Al Pacino"), "{:?}", names(&profile.cast));
    assert_eq!(profile.imdb_id, "tt0113277");
    let unknown = settled_movie(&c, &unknown).await;
    assert_eq!(unknown.enrichment(), v1::EnrichmentStatus::NotFound);

    let search = SearchClient::new(reelay.handlers_channel().await);
    eventually("searching the director finds Heat", || {
        let mut search = search.clone();
        async move {
            movie_hits(&mut search, "Michael Mann").await.iter().any(|h| (h.title.as_str(), h.year) == ("Heat", 1995))
        }
    })
    .await;
    eventually("the director is profiled", || {
        let mut movies = c.movies.clone();
        async move {
            movies
                .get_person(v1::GetPersonRequest { person_id: "catalog:Michael Mann".into() })
                .await
                .is_ok_and(|p| p.get_ref().profiled && p.get_ref().known_for.iter().any(|f| f == "Heat (1995)"))
        }
    })
    .await;

    // Switched to a provider that does not find Heat by its title: that says nothing against
    // the catalog's profile, which is kept (asked by its own id, a provider's miss would mean
    // the film is gone from it).
    let tmdb = TmdbServer::start(vec![films::collateral()], films::people()).await;
    let env = tmdb_env(&tmdb);
    reelay.restart_with(&borrowed(&env)).await;
    let c = reelay.clients().await;
    c.movies
        .clone()
        .request_enrichment(v1::RequestEnrichmentRequest {
            actor_user_id: ana.clone(),
            movie_id: review.movie_id.clone(),
            ..Default::default()
        })
        .await
        .unwrap();
    eventually("TMDB is asked", || async { tmdb.requests("/3/search/movie") >= 1 }).await;
    eventually("the request is settled", || {
        let db = db.clone();
        async move { reelay_harness::unsettled(&db, false, &["movie-enrichment"]).await.is_empty() }
    })
    .await;
    let kept = settled_movie(&c, &review.movie_id).await;
    assert_eq!(kept.enrichment(), v1::EnrichmentStatus::Enriched);
    assert_eq!(kept.profile.map(|p| p.provider), Some("catalog".to_owned()));
    assert_eq!(events_for(&db, "MovieEnriched", &review.movie_id).await.len(), 1, "no profile taken away");
    // Nor does a MovieDiscovered of Heat delivered again now: it looks at the film as it is.
    let settings = tmdb_settings(&tmdb);
    let discovered = events_for(&db, "MovieDiscovered", &review.movie_id).await.remove(0);
    handler_here("movie-enrichment", &reelay, settings).await.handle(&discovered).await.unwrap();
    let kept = settled_movie(&c, &review.movie_id).await;
    assert_eq!(kept.profile.map(|p| p.provider), Some("catalog".to_owned()));
    reelay.stop().await;
}

/// Builds one handler of the registry in this process, against a real write service.
async fn handler_here(
    name: &str,
    write: &Reelay,
    settings: reelay_handlers::HandlerSettings,
) -> std::sync::Arc<dyn reelay_delivery::Handler> {
    reelay_objects::install_tls_provider();
    let context = crate::handler_context(write);
    let mut built = reelay_handlers::build(&[name.to_owned()], &settings, &context).await.unwrap();
    assert_eq!(built.len(), 1);
    built.remove(0).handler
}

/// Runs the handler on the event twice at once, then once more (a redelivery after both).
async fn twice_and_again(handler: &dyn reelay_delivery::Handler, event: &v1::Event) {
    let (a, b) = tokio::join!(handler.handle(event), handler.handle(event));
    a.unwrap();
    b.unwrap();
    handler.handle(event).await.unwrap();
}

#[tokio::test]
async fn every_handler_run_twice_on_one_event_leaves_one_effect() {
    let tmdb = TmdbServer::start(vec![films::heat()], films::people()).await;
    let dir = temp_dir();
    let db = dir.path().join("reelay.db");
    // The write service alone: no handler runs but the ones this test runs.
    let mut write = Reelay::start_write(BIN, &db, &[]).await;
    let mut c = write.clients().await;
    let ana = c.user("ana").await;
    let heat = c.movie(&ana, "Heat", 1995).await;
    let settings = tmdb_settings(&tmdb);

    let discovered = events_for(&db, "MovieDiscovered", &heat).await.remove(0);
    let movie_enrichment = handler_here("movie-enrichment", &write, settings.clone()).await;
    twice_and_again(movie_enrichment.as_ref(), &discovered).await;
    let enriched = events_for(&db, "MovieEnriched", &heat).await;
    assert_eq!(enriched.len(), 1, "three runs, one MovieEnriched");
    // Run again after TMDB changed the film (a longer cut): the retry saves what it got, as a
    // request of its own, instead of clashing with the first save's key.
    let mut recut = films::heat();
    recut.runtime = 171;
    let tmdb_recut = TmdbServer::start(vec![recut], films::people()).await;
    let mut recut_settings = settings.clone();
    recut_settings.enrichment.tmdb_url = tmdb_recut.url();
    handler_here("movie-enrichment", &write, recut_settings).await.handle(&discovered).await.unwrap();
    let movie = settled_movie(&c, &heat).await;
    assert_eq!(movie.profile.unwrap().runtime_minutes, 171);
    assert_eq!(events_for(&db, "MovieEnriched", &heat).await.len(), 2, "a change is a new MovieEnriched");
    let enriched = [enriched.into_iter().next().unwrap()];
    let rows = outbox_rows(&db).await;
    // A key TMDB refuses is not worth retrying, and the error names the setting to fix.
    let mut refused = settings.clone();
    refused.enrichment.tmdb_api_key = Some("not-the-key".into());
    let error = handler_here("movie-enrichment", &write, refused).await.handle(&discovered).await.unwrap_err();
    assert!(
        matches!(&error, reelay_delivery::HandlerError::Permanent(m) if m.contains("REELAY_ENRICHMENT_TMDB_API_KEY")),
        "{error:?}"
    );
    assert_eq!(tmdb.unauthorized(), 1);
    // A 5xx is worth retrying; a gateway's 503 says TMDB is down, for every film alike.
    tmdb.fail("/3/movie/949", 1, 500);
    let error = movie_enrichment.handle(&discovered).await.unwrap_err();
    assert!(matches!(&error, reelay_delivery::HandlerError::Retryable(m) if m.contains("500")), "{error:?}");

    let people_before = query_strings(&db, "SELECT person_id, profiled || '' FROM people ORDER BY person_id").await;
    let person_enrichment = handler_here("person-enrichment", &write, settings.clone()).await;
    // The four people are fetched at once, and one failing loses only itself: the others are
    // saved, and the retry is answered after them.
    tmdb.fail("/3/person/1158", 1, 503);
    tmdb.delay_people(Duration::from_millis(300));
    let error = person_enrichment.handle(&enriched[0]).await.unwrap_err();
    assert!(matches!(&error, reelay_delivery::HandlerError::Unavailable(m) if m.contains("503")), "{error:?}");
    let profiled = "SELECT person_id FROM people WHERE profiled = 1 ORDER BY person_id";
    let saved = ["tmdb:380", "tmdb:5576", "tmdb:638"].map(|id| vec![id.to_owned()]);
    assert_eq!(query_strings(&db, profiled).await, saved);
    assert!(tmdb.people_at_once() > 1, "fetched one at a time");
    twice_and_again(person_enrichment.as_ref(), &enriched[0]).await;
    let people =
        query_strings(&db, "SELECT person_id, profiled || '', updated_at || '' FROM people ORDER BY person_id").await;
    assert_eq!(people.len(), people_before.len(), "no person twice");
    assert!(people.iter().all(|p| p[1] == "1"), "every credited person profiled: {people:?}");
    person_enrichment.handle(&enriched[0]).await.unwrap();
    let unchanged =
        query_strings(&db, "SELECT person_id, profiled || '', updated_at || '' FROM people ORDER BY person_id").await;
    assert_eq!(unchanged, people, "a repeat rewrites nobody");
    assert_eq!(outbox_rows(&db).await.len(), rows.len(), "person enrichment raises no events");

    c.review(&ana, reelay_harness::movie_id_ref(&heat), 9).await;
    let year = current_year();
    let requested = c
        .wrap_ups
        .request_wrap_up(v1::RequestWrapUpRequest { actor_user_id: ana.clone(), year, ..Default::default() })
        .await
        .unwrap()
        .into_inner()
        .wrap_up
        .unwrap();
    let event = events_for(&db, "WrapUpRequested", &requested.wrap_up_id).await.remove(0);
    let wrap_up = handler_here("wrap-up", &write, settings).await;
    twice_and_again(wrap_up.as_ref(), &event).await;
    assert_eq!(events_for(&db, "WrapUpCompleted", &requested.wrap_up_id).await.len(), 1);
    let done = c
        .wrap_ups
        .get_wrap_up(v1::GetWrapUpRequest { wrap_up_id: requested.wrap_up_id.clone() })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(done.status(), v1::WrapUpStatus::Completed);
    let summary = done.summary.unwrap();
    assert_eq!((summary.films, summary.entries, summary.minutes_watched), (1, 1, 171), "the recut's runtime");
    let cards: Vec<_> =
        reelay_harness::files_under(&dir.path().join("objects")).into_iter().filter(|p| p.ends_with(".svg")).collect();
    assert_eq!(cards.len(), 1, "one card: {cards:?}");
    write.stop().await;
}

/// The current year, as the write service counts a review logged today.
fn current_year() -> i32 {
    let ms = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as i64;
    reelay_domain::validate::civil_from_days(ms.div_euclid(86_400_000)).0 as i32
}

/// One diary row of the fixture.
struct Row {
    title: String,
    year: i32,
    watched_on: String,
    rating: u32,
    rewatch: bool,
}

fn diary_rows() -> Vec<Row> {
    let mut reader = csv::Reader::from_reader(DIARY_2024);
    reader
        .records()
        .map(|r| {
            let r = r.unwrap();
            Row {
                title: r[1].to_owned(),
                year: r[2].parse().unwrap(),
                rating: if r[4].is_empty() { 0 } else { (r[4].parse::<f64>().unwrap() * 2.0).round() as u32 },
                rewatch: &r[5] == "Yes",
                watched_on: r[7].to_owned(),
            }
        })
        .collect()
}

/// The figures of 2024, computed here from the CSV and each film's profile as GetMovie shows it.
fn expected_figures(rows: &[Row], movies: &HashMap<(String, i32), v1::Movie>) -> v1::WrapUpSummary {
    let year: Vec<&Row> = rows.iter().filter(|r| r.watched_on.starts_with("2024-")).collect();
    let mut s = v1::WrapUpSummary {
        entries: year.len() as u32,
        rating_counts: vec![0; 11],
        per_month: vec![0; 12],
        ..Default::default()
    };
    let mut films = HashSet::new();
    let mut genres: BTreeMap<String, HashSet<String>> = BTreeMap::new();
    let mut directors: BTreeMap<String, HashSet<String>> = BTreeMap::new();
    let mut best: HashMap<String, (u32, String)> = HashMap::new();
    let mut rated = Vec::new();
    for row in &year {
        let movie = &movies[&(row.title.clone(), row.year)];
        films.insert(movie.movie_id.clone());
        s.rewatches += u32::from(row.rewatch);
        s.rating_counts[row.rating as usize] += 1;
        s.per_month[row.watched_on[5..7].parse::<usize>().unwrap() - 1] += 1;
        if row.rating > 0 {
            rated.push(row.rating);
            let b = best.entry(movie.movie_id.clone()).or_insert((0, String::new()));
            if (row.rating, row.watched_on.as_str()) > (b.0, b.1.as_str()) {
                *b = (row.rating, row.watched_on.clone());
            }
        }
        if let Some(p) = &movie.profile {
            s.minutes_watched += p.runtime_minutes;
            for g in &p.genres {
                genres.entry(g.clone()).or_default().insert(movie.movie_id.clone());
            }
            for d in &p.directors {
                directors.entry(d.name.clone()).or_default().insert(movie.movie_id.clone());
            }
        }
    }
    s.films = films.len() as u32;
    s.mean_rating = f64::from(rated.iter().sum::<u32>()) / rated.len() as f64;
    let top = |m: BTreeMap<String, HashSet<String>>| {
        let mut v: Vec<(String, u32)> = m.into_iter().map(|(k, f)| (k, f.len() as u32)).collect();
        v.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        v.into_iter().take(5).map(|(name, count)| v1::NameCount { name, count }).collect()
    };
    s.top_genres = top(genres);
    s.top_directors = top(directors);
    let by_id: HashMap<&str, &v1::Movie> = movies.values().map(|m| (m.movie_id.as_str(), m)).collect();
    let mut ranked: Vec<(String, (u32, String))> = best.into_iter().collect();
    ranked.sort_by(|a, b| {
        let title = |id: &str| by_id[id].title.clone();
        b.1.0.cmp(&a.1.0).then(b.1.1.cmp(&a.1.1)).then(title(&a.0).cmp(&title(&b.0))).then(a.0.cmp(&b.0))
    });
    s.highest_rated = ranked
        .into_iter()
        .take(5)
        .map(|(id, (rating, _))| v1::RatedFilm {
            title: by_id[id.as_str()].title.clone(),
            year: by_id[id.as_str()].year,
            movie_id: id,
            rating,
        })
        .collect();
    s
}

/// The wrap-up `id` once it is completed.
async fn completed(c: &Clients, id: &str, what: &str) -> v1::WrapUp {
    reelay_harness::eventually_some(what, LIMIT, || {
        let mut wrap_ups = c.wrap_ups.clone();
        let id = id.to_owned();
        async move {
            let w = wrap_ups.get_wrap_up(v1::GetWrapUpRequest { wrap_up_id: id }).await.unwrap().into_inner();
            (w.status() == v1::WrapUpStatus::Completed).then_some(w)
        }
    })
    .await
}

/// Imports the 2024 diary, waits for every film's enrichment, asks for the wrap-up twice and
/// checks the figures, the single WrapUpCompleted and the card served at `card_url`.
async fn wrap_up_of_a_known_year(reelay: &Reelay) -> v1::WrapUp {
    let mut c = reelay.clients().await;
    let ana = c.user("ana").await;
    let rows = diary_rows();
    let imported = c.import(&ana, DIARY_2024).await.unwrap();
    assert_eq!(imported.imported as usize, rows.len());
    let mut movies = HashMap::new();
    for row in &rows {
        let key = (row.title.clone(), row.year);
        if let std::collections::hash_map::Entry::Vacant(slot) = movies.entry(key) {
            let id = c.movie(&ana, &row.title, row.year).await;
            slot.insert(settled_movie(&c, &id).await);
        }
    }
    let unknown = movies.values().filter(|m| m.enrichment() == v1::EnrichmentStatus::NotFound).count();
    assert_eq!(unknown, 1, "every film but the invented one is in the catalog");
    let expected = expected_figures(&rows, &movies);
    assert!(expected.films >= 40 && expected.rewatches >= 5 && expected.rating_counts[0] > 0, "{expected:?}");

    let ask = |request_id: &str| v1::RequestWrapUpRequest {
        actor_user_id: ana.clone(),
        year: 2024,
        request_id: request_id.into(),
    };
    let first = c.wrap_ups.request_wrap_up(ask("")).await.unwrap().into_inner();
    let second = c.wrap_ups.request_wrap_up(ask("")).await.unwrap().into_inner();
    assert!(first.created);
    let id = first.wrap_up.unwrap().wrap_up_id;
    assert_eq!(second.wrap_up.unwrap().wrap_up_id, id, "asking again is the same wrap-up");
    let done = completed(&c, &id, "the wrap-up is completed").await;
    let summary = done.summary.clone().unwrap();
    assert_eq!(summary.films, expected.films);
    assert_eq!(summary.entries, expected.entries);
    assert_eq!(summary.rewatches, expected.rewatches);
    assert_eq!(summary.minutes_watched, expected.minutes_watched);
    assert_eq!(summary.rating_counts, expected.rating_counts);
    assert!(
        (summary.mean_rating - expected.mean_rating).abs() < 1e-9,
        "{} vs {}",
        summary.mean_rating,
        expected.mean_rating
    );
    assert_eq!(summary.per_month, expected.per_month);
    assert_eq!(summary.top_genres, expected.top_genres);
    assert_eq!(summary.top_directors, expected.top_directors);
    assert_eq!(summary.highest_rated, expected.highest_rated);
    assert_eq!(done.card_content_type, "image/svg+xml");
    assert!(done.card_key.starts_with(&format!("wrapups/{id}/card-")) && done.card_key.ends_with(".svg"));

    let (status, _, body) = http_request("GET", &done.card_url, &[], b"").await;
    assert_eq!(status, 200, "{}: {}", done.card_url, String::from_utf8_lossy(&body));
    check_card(&body, &summary);

    // The inputs carry what the figures use of each profile, not its cast or overview (a heavy
    // year's answer must fit one message).
    let inputs = c.wrap_ups.get_wrap_up_inputs(v1::GetWrapUpInputsRequest { wrap_up_id: id.clone() }).await.unwrap();
    let entries = inputs.into_inner().entries;
    assert_eq!(entries.len() as u32, expected.entries);
    let profiles: Vec<&v1::MovieProfile> = entries.iter().filter_map(|e| e.movie.as_ref()?.profile.as_ref()).collect();
    assert!(profiles.iter().any(|p| !p.directors.is_empty() && !p.genres.is_empty() && p.runtime_minutes > 0));
    assert!(profiles.iter().all(|p| p.cast.is_empty() && p.overview.is_empty()), "no cast, no overview");

    // A third ask, after completion, changes nothing either: the diary is what it was computed
    // from.
    let third = c.wrap_ups.request_wrap_up(ask("again-1")).await.unwrap().into_inner();
    assert!(!third.created);
    assert_eq!(third.wrap_up.unwrap().wrap_up_id, id);
    assert_eq!(events_for(&reelay.database, "WrapUpRequested", &id).await.len(), 1);
    assert_eq!(events_for(&reelay.database, "WrapUpCompleted", &id).await.len(), 1);
    done
}

/// The card is a well-formed SVG of the right size whose month bars carry the month counts.
fn check_card(svg: &[u8], summary: &v1::WrapUpSummary) {
    use quick_xml::events::Event;
    let mut reader = quick_xml::Reader::from_reader(svg);
    let mut buf = Vec::new();
    let (mut root, mut months, mut texts) = (None, Vec::new(), Vec::new());
    loop {
        match reader.read_event_into(&mut buf).expect("the card is well-formed XML") {
            Event::Start(e) | Event::Empty(e) if root.is_none() => {
                let attr = |name: &str| {
                    e.try_get_attribute(name).unwrap().map(|a| String::from_utf8(a.value.to_vec()).unwrap())
                };
                root = Some((String::from_utf8(e.name().as_ref().to_vec()).unwrap(), attr("width"), attr("height")));
            }
            Event::Start(e) | Event::Empty(e)
                if e.name().as_ref() == b"rect"
                    && e.try_get_attribute("class").unwrap().is_some_and(|a| a.value.as_ref() == b"month") =>
            {
                let count = e.try_get_attribute("data-count").unwrap().unwrap();
                months.push(std::str::from_utf8(&count.value).unwrap().parse::<u32>().unwrap());
            }
            Event::Text(t) => texts.push(String::from_utf8_lossy(t.as_ref()).to_string()),
            Event::Eof => break,
            _ => {}
        }
        buf.clear();
    }
    let (name, width, height) = root.expect("a root element");
    assert_eq!(name, "svg");
    assert_eq!((width.as_deref(), height.as_deref()), (Some("1080"), Some("1350")));
    assert_eq!(months, summary.per_month, "one bar per month, with its count");
    assert!(texts.iter().any(|t| t.contains("2024")), "the year is on the card: {texts:?}");
    assert!(texts.iter().any(|t| t.trim() == summary.films.to_string()), "the film count is on the card: {texts:?}");
}

#[tokio::test]
async fn a_known_2024_diary_gets_exactly_its_wrap_up_with_a_card() {
    let dir = temp_dir();
    let mut reelay = Reelay::start_all(BIN, &dir.path().join("reelay.db"), &[]).await;
    let done = wrap_up_of_a_known_year(&reelay).await;
    let card = dir.path().join("objects").join(&done.card_key);
    assert!(card.is_file(), "the card is stored under the data dir by default: {}", card.display());
    assert!(done.card_url.starts_with(&format!("http://{}/media/", reelay.media_addr)), "{}", done.card_url);
    wrap_up_made_again_after_the_diary_changed(&reelay, &done).await;
    let cards: Vec<String> =
        reelay_harness::files_under(&dir.path().join("objects")).into_iter().filter(|p| p.ends_with(".svg")).collect();
    assert_eq!(cards.len(), 2, "a card each: {cards:?}");
    reelay.stop().await;
}

/// One more 2024 entry (a rewatch on New Year's Eve, rated 1.5 stars) after `done` was
/// completed: asking again makes a new wrap-up, naming `done`, from the diary as it is now; `done`
/// keeps its figures.
async fn wrap_up_made_again_after_the_diary_changed(reelay: &Reelay, done: &v1::WrapUp) {
    let mut c = reelay.clients().await;
    let before = done.summary.clone().unwrap();
    let film = before.highest_rated[0].movie_id.clone();
    c.reviews
        .log_review(v1::LogReviewRequest {
            actor_user_id: done.user_id.clone(),
            movie: reelay_harness::movie_id_ref(&film),
            rating: 3,
            watched_on: "2024-12-31".into(),
            rewatch: true,
            ..Default::default()
        })
        .await
        .unwrap();
    let ask = v1::RequestWrapUpRequest { actor_user_id: done.user_id.clone(), year: 2024, ..Default::default() };
    let again = c.wrap_ups.request_wrap_up(ask.clone()).await.unwrap().into_inner();
    assert!(again.created, "the diary changed: a new wrap-up");
    let again = again.wrap_up.unwrap();
    assert_eq!(again.previous_wrap_up_id, done.wrap_up_id);
    let renewed = completed(&c, &again.wrap_up_id, "the new wrap-up is completed").await;
    let after = renewed.summary.unwrap();
    assert_eq!((after.films, after.entries, after.rewatches), (before.films, before.entries + 1, before.rewatches + 1));
    assert_eq!(after.per_month[11], before.per_month[11] + 1, "December");
    assert_eq!(after.rating_counts[3], before.rating_counts[3] + 1, "1.5 stars");
    assert!(renewed.card_key.starts_with(&format!("wrapups/{}/card-", again.wrap_up_id)), "{}", renewed.card_key);
    let (status, _, body) = http_request("GET", &renewed.card_url, &[], b"").await;
    assert_eq!(status, 200, "{}", renewed.card_url);
    check_card(&body, &after);

    let first = c.wrap_ups.get_wrap_up(v1::GetWrapUpRequest { wrap_up_id: done.wrap_up_id.clone() }).await.unwrap();
    assert_eq!(first.into_inner().summary.unwrap(), before, "the first keeps its figures");
    let unchanged = c.wrap_ups.request_wrap_up(ask).await.unwrap().into_inner();
    assert!(!unchanged.created);
    assert_eq!(unchanged.wrap_up.unwrap().wrap_up_id, again.wrap_up_id, "the newest, while nothing changed");
}

#[tokio::test]
async fn wrap_up_cards_are_stored_in_an_s3_compatible_server() {
    let dir = temp_dir();
    let moto = MotoServer::start(&dir.path().join("moto")).await;
    moto.create_bucket("reelay-media").await;
    let env = moto.env("reelay-media", "prod");
    let mut reelay = Reelay::start_all(BIN, &dir.path().join("reelay.db"), &borrowed(&env)).await;
    let done = wrap_up_of_a_known_year(&reelay).await;
    assert_eq!(moto.keys("reelay-media", "prod/").await, [format!("prod/{}", done.card_key)]);
    assert!(!dir.path().join("objects").exists(), "nothing stored locally");
    reelay.stop().await;
}

/// A card is on stable storage before its wrap-up is completed: while the handlers process's
/// fsyncs fail (EIO, injected by strace), storing the card fails and the wrap-up stays
/// generating (a card written to the page cache alone could be gone after a power cut while
/// the wrap-up, committed by the write service, points at it); once they pass, it completes.
#[tokio::test]
async fn a_card_is_synced_to_disk_before_its_wrap_up_completes() {
    let dir = temp_dir();
    let cluster = Cluster::builder(BIN, Backend::Db)
        .env("REELAY_RETRY_BASE_MS", "200")
        .handlers(&[("REELAY_HANDLERS", "wrap-up,movie-enrichment")])
        .start(dir.path())
        .await;
    let mut c = cluster.write.clients().await;
    let ana = c.user("ana").await;
    let logged = c
        .reviews
        .log_review(v1::LogReviewRequest {
            actor_user_id: ana.clone(),
            movie: movie_ref("Heat", 1995),
            rating: 9,
            watched_on: "2024-06-01".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    settled_movie(&c, &logged.into_inner().review.unwrap().movie_id).await;
    let handlers = &cluster.handlers[0];
    let strace = reelay_harness::Strace::inject(handlers.pid(), "fsync,fdatasync", "EIO", "1+1", dir.path()).await;

    let ask = v1::RequestWrapUpRequest { actor_user_id: ana.clone(), year: 2024, ..Default::default() };
    let id = c.wrap_ups.request_wrap_up(ask).await.unwrap().into_inner().wrap_up.unwrap().wrap_up_id;
    eventually("storing the card fails while fsyncs fail", || {
        let failed = handlers.logged_handler_failure("wrap-up");
        async move { failed }
    })
    .await;
    let generating = c.wrap_ups.get_wrap_up(v1::GetWrapUpRequest { wrap_up_id: id.clone() }).await.unwrap();
    assert_eq!(generating.get_ref().status(), v1::WrapUpStatus::Generating);
    assert!(strace.stop().await > 0, "no fsync failed");

    let done = completed(&c, &id, "the wrap-up is completed once fsyncs pass").await;
    let card = std::fs::read(dir.path().join("handlers-0/objects").join(&done.card_key)).expect("the card");
    check_card(&card, done.summary.as_ref().unwrap());
    cluster.stop().await;
}

/// A year's inputs come in one answer, which may be larger than any other call's: with the
/// write service's calls held to 64 KiB (REELAY_GRPC_MAX_MESSAGE_BYTES), a year of 700 films
/// (over 100 KB of inputs) still gets its wrap-up. (This checks the write service's answer
/// limit; the handler's client taking answers past tonic's 4 MiB default is not reached here.)
#[tokio::test]
async fn a_year_larger_than_other_calls_may_be_still_gets_its_wrap_up() {
    let dir = temp_dir();
    let db = dir.path().join("reelay.db");
    let env = [("REELAY_GRPC_MAX_MESSAGE_BYTES", "65536"), ("REELAY_MAX_EVENT_BYTES", "32768")];
    let reelay = Reelay::start_all(BIN, &db, &env).await;
    let mut c = reelay.clients().await;
    let ana = c.user("ana").await;
    let mut csv = String::from("Date,Name,Year,Letterboxd URI,Rating,Rewatch,Tags,Watched Date\n");
    for i in 0..700 {
        let watched = format!("2024-{:02}-{:02}", i % 12 + 1, i % 28 + 1);
        csv += &format!("{watched},A Film Of A Long Year Number {i},2001,https://boxd.it/y{i},4,,,{watched}\n");
    }
    assert_eq!(c.import(&ana, csv.as_bytes()).await.unwrap().imported, 700);
    let ask = v1::RequestWrapUpRequest { actor_user_id: ana.clone(), year: 2024, ..Default::default() };
    let asked = c.wrap_ups.request_wrap_up(ask).await.unwrap().into_inner().wrap_up.unwrap();
    let done = completed(&c, &asked.wrap_up_id, "the heavy year's wrap-up completes").await;
    let summary = done.summary.unwrap();
    assert_eq!((summary.entries, summary.films), (700, 700));
}
