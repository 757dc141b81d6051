//! Posters and images: `poster-sync`, `image-conversion` and `image-cleanup` against a real write
//! service, a real HTTP server serving real JPEG and PNG posters (made in the test) and bad
//! answers, and real object storage: files under the data dir, or a real S3-compatible server
//! (moto). The handlers run in this process where a test drives them event by event, and in
//! `reelay run` processes where crashes and dead letters are the point.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use reelay_contracts::v1::{self, admin_client::AdminClient, search_client::SearchClient};
use reelay_harness::images::{decoded_size, jpeg, png};
use reelay_harness::{Backend, Cluster, MotoServer, Reelay, eventually, files_under, http_request, temp_dir};
use reelay_objects::{Objects, ObjectsSettings};

const BIN: &str = env!("CARGO_BIN_EXE_reelay");
const LIMIT: Duration = Duration::from_secs(60);
const WIDTHS: [u32; 4] = [92, 185, 342, 500];

/// The poster host: real posters, failures on demand, and bad answers.
struct PosterHost {
    addr: std::net::SocketAddr,
    /// Successful poster downloads.
    downloads: Arc<AtomicUsize>,
    /// Requests of `/held.jpg` so far, and what lets them be answered.
    held_asked: Arc<AtomicUsize>,
    release: Arc<tokio::sync::Notify>,
    task: tokio::task::JoinHandle<()>,
}

/// The JPEG and PNG posters the host serves: 600×900 and 400×600.
struct Posters {
    jpeg: Vec<u8>,
    png: Vec<u8>,
}

impl Posters {
    fn new() -> Arc<Self> {
        Arc::new(Self { jpeg: jpeg(600, 900), png: png(400, 600) })
    }
}

impl PosterHost {
    /// `/poster.jpg`, `/poster.png`; `/flaky.jpg` (a 503, then the JPEG), `/slow-down.jpg` (a
    /// 429 with `Retry-After: 1`, then the JPEG); `/page.html`, `/truncated.jpg`, `/huge.jpg`
    /// (50 MB streamed with no length), `/held.jpg` (the JPEG once [`Self::release`] is
    /// notified) and a 404 for anything else.
    async fn start(posters: Arc<Posters>) -> Self {
        let downloads = Arc::new(AtomicUsize::new(0));
        let (held_asked, release) = (Arc::new(AtomicUsize::new(0)), Arc::new(tokio::sync::Notify::new()));
        let (flaky, slow) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let serve = |posters: Arc<Posters>, downloads: Arc<AtomicUsize>, png: bool| {
            downloads.fetch_add(1, Ordering::SeqCst);
            if png {
                ([(header::CONTENT_TYPE, "image/png")], posters.png.clone()).into_response()
            } else {
                ([(header::CONTENT_TYPE, "image/jpeg")], posters.jpeg.clone()).into_response()
            }
        };
        let router = Router::new()
            .route("/poster.jpg", {
                let (p, d) = (posters.clone(), downloads.clone());
                get(move || async move { serve(p, d, false) })
            })
            .route("/poster.png", {
                let (p, d) = (posters.clone(), downloads.clone());
                get(move || async move { serve(p, d, true) })
            })
            .route("/flaky.jpg", {
                let (p, d) = (posters.clone(), downloads.clone());
                get(move || async move {
                    if flaky.fetch_add(1, Ordering::SeqCst) == 0 {
                        return (StatusCode::SERVICE_UNAVAILABLE, "try again").into_response();
                    }
                    serve(p, d, false)
                })
            })
            .route("/slow-down.jpg", {
                let (p, d) = (posters.clone(), downloads.clone());
                get(move || async move {
                    if slow.fetch_add(1, Ordering::SeqCst) == 0 {
                        return (StatusCode::TOO_MANY_REQUESTS, [(header::RETRY_AFTER, "1")], "slow down")
                            .into_response();
                    }
                    serve(p, d, false)
                })
            })
            .route("/held.jpg", {
                let (p, d, asked, release) = (posters.clone(), downloads.clone(), held_asked.clone(), release.clone());
                get(move || async move {
                    let released = release.notified();
                    asked.fetch_add(1, Ordering::SeqCst);
                    released.await;
                    serve(p, d, false)
                })
            })
            .route("/page.html", get(|| async { ([(header::CONTENT_TYPE, "text/html")], "<html>no poster</html>") }))
            .route("/truncated.jpg", {
                let p = posters.clone();
                get(move || async move {
                    ([(header::CONTENT_TYPE, "image/jpeg")], p.jpeg[..p.jpeg.len() / 2].to_vec()).into_response()
                })
            })
            .route(
                "/huge.jpg",
                get(|| async {
                    // A JPEG's first bytes, then 50 MB in 1 MB chunks, with no Content-Length.
                    let head =
                        futures_util::stream::once(async { Ok::<_, std::io::Error>(vec![0xFF, 0xD8, 0xFF, 0xE0]) });
                    let rest = futures_util::stream::iter((0..50).map(|_| Ok(vec![0u8; 1024 * 1024])));
                    (
                        [(header::CONTENT_TYPE, "image/jpeg")],
                        Body::from_stream(futures_util::StreamExt::chain(head, rest)),
                    )
                }),
            )
            .fallback(|| async { (StatusCode::NOT_FOUND, "no such poster").into_response() });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let task = tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
        Self { addr, downloads, held_asked, release, task }
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }
}

impl Drop for PosterHost {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The media handlers built from the registry in this process, on `objects`.
struct InProcess {
    sync: Arc<dyn reelay_delivery::Handler>,
    conversion: Arc<dyn reelay_delivery::Handler>,
    cleanup: Arc<dyn reelay_delivery::Handler>,
    objects: Objects,
}

impl InProcess {
    /// On `objects`, beside `write`'s database (its data dir).
    async fn build(write: &Reelay, objects: ObjectsSettings) -> Self {
        reelay_objects::install_tls_provider();
        let context = crate::handler_context(write);
        let mut settings = reelay_handlers::HandlerSettings { objects: objects.clone(), ..Default::default() };
        settings.media.allow_private = Some(true); // the test's image host is on loopback
        let names = ["poster-sync", "image-conversion", "image-cleanup"].map(str::to_owned);
        let mut built = reelay_handlers::build(&names, &settings, &context).await.unwrap().into_iter();
        Self {
            sync: built.next().unwrap().handler,
            conversion: built.next().unwrap().handler,
            cleanup: built.next().unwrap().handler,
            objects: Objects::open(&objects, &context.data_dir).unwrap(),
        }
    }
}

/// Enriches `movie_id` with `poster_url` through the internal SaveEnrichment, as
/// movie-enrichment does; returns its MovieEnriched event.
async fn enrich(c: &mut reelay_harness::Clients, db: &std::path::Path, movie_id: &str, poster_url: &str) -> v1::Event {
    let profile = v1::MovieProfile {
        provider: "tmdb".into(),
        provider_id: format!("tmdb:{movie_id}"),
        poster_url: poster_url.into(),
        ..Default::default()
    };
    c.movies
        .save_enrichment(v1::SaveEnrichmentRequest {
            movie_id: movie_id.to_owned(),
            outcome: Some(v1::save_enrichment_request::Outcome::Profile(profile)),
            request_id: String::new(),
        })
        .await
        .unwrap();
    events(db, "MovieEnriched", movie_id).await.pop().expect("a MovieEnriched event")
}

/// Deletes `review` as its author `user`.
async fn delete_review(c: &mut reelay_harness::Clients, user: &str, review: &v1::Review) {
    let request = v1::DeleteReviewRequest {
        actor_user_id: user.to_owned(),
        review_id: review.review_id.clone(),
        ..Default::default()
    };
    c.reviews.delete_review(request).await.unwrap();
}

async fn events(db: &std::path::Path, event_type: &str, aggregate: &str) -> Vec<v1::Event> {
    reelay_harness::events_of(db, event_type).await.into_iter().filter(|e| e.aggregate_id == aggregate).collect()
}

async fn poster_sizes(c: &mut reelay_harness::Clients, movie_id: &str) -> Vec<String> {
    let movie = c.movies.get_movie(v1::GetMovieRequest { movie_id: movie_id.to_owned() }).await.unwrap();
    movie.into_inner().poster_sizes
}

/// The sizes recorded for a poster `width` pixels wide: the original and every variant width
/// up to its own (no upscaling).
fn sizes_of(width: u32) -> Vec<String> {
    let variants = WIDTHS.iter().filter(|&&w| w <= width).map(|w| format!("w{w}"));
    std::iter::once("original".to_owned()).chain(variants).collect()
}

fn all_sizes() -> Vec<String> {
    sizes_of(u32::MAX)
}

/// A movie deleted while poster-sync downloads its poster: image cleanup waits for the sync's
/// turn on the movie, the sync finds the movie gone when it records and removes what it wrote,
/// and nothing of the movie stays.
#[tokio::test]
async fn a_movie_deleted_while_its_poster_downloads_keeps_no_object() {
    let dir = temp_dir();
    let host = PosterHost::start(Posters::new()).await;
    let db = dir.path().join("reelay.db");
    let mut write = Reelay::start_write(BIN, &db, &[]).await;
    let mut c = write.clients().await;
    let ana = c.user("ana").await;
    let media = InProcess::build(&write, ObjectsSettings::default()).await;
    let review = c.review(&ana, reelay_harness::movie_ref("Heat", 1995), 8).await;
    let movie = review.movie_id.clone();
    let enriched = enrich(&mut c, &db, &movie, &host.url("/held.jpg")).await;

    let sync = media.sync.clone();
    let syncing = tokio::spawn(async move { sync.handle(&enriched).await });
    eventually("the download has started", LIMIT, || {
        let asked = host.held_asked.clone();
        async move { asked.load(Ordering::SeqCst) == 1 }
    })
    .await;
    delete_review(&mut c, &ana, &review).await;
    let deleted = events(&db, "MovieDeleted", &movie).await.remove(0);
    // The cleanup waits for the sync's turn on the movie's objects (else it could run before
    // the sync's write): the sync finds the movie gone when it records, and removes what it
    // stored; the cleanup then finds nothing.
    let cleanup = media.cleanup.clone();
    let cleaning = tokio::spawn(async move { cleanup.handle(&deleted).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!cleaning.is_finished(), "the cleanup waits for the sync's turn");
    host.release.notify_waiters();
    syncing.await.unwrap().expect("a deleted movie's poster is not a failure");
    cleaning.await.unwrap().unwrap();
    assert_eq!(host.downloads.load(Ordering::SeqCst), 1);
    assert!(media.objects.list(&format!("posters/{movie}")).await.unwrap().is_empty(), "nothing of the movie stays");
    assert!(events(&db, "PosterSynced", &movie).await.is_empty());
    write.stop().await;
}

/// A poster replacing a recorded one, stored by a try that stopped before its record (its
/// bytes and note as that try leaves them, the old poster's variants deleted), is recorded by
/// the next try from what was stored, though its URL no longer answers: the record does not go
/// on naming the poster it replaced, and conversion makes the new one's variants.
#[tokio::test]
async fn a_replacing_poster_stored_before_its_record_is_recorded_from_the_store() {
    let dir = temp_dir();
    let posters = Posters::new();
    let host = PosterHost::start(posters.clone()).await;
    let db = dir.path().join("reelay.db");
    let mut write = Reelay::start_write(BIN, &db, &[]).await;
    let mut c = write.clients().await;
    let ana = c.user("ana").await;
    let media = InProcess::build(&write, ObjectsSettings::default()).await;
    let heat = c.movie(&ana, "Heat", 1995).await;
    let first = enrich(&mut c, &db, &heat, &host.url("/poster.jpg")).await;
    media.sync.handle(&first).await.unwrap();
    let stored = events(&db, "ImageStored", &heat).await.remove(0);
    media.conversion.handle(&stored).await.unwrap();
    assert_eq!(poster_sizes(&mut c, &heat).await, sizes_of(600));

    let gone = host.url("/gone.png");
    let second = enrich(&mut c, &db, &heat, &gone).await;
    let folder = format!("posters/{heat}");
    for key in media.objects.list(&folder).await.unwrap() {
        media.objects.delete(&key).await.unwrap();
    }
    media.objects.put(&format!("{folder}/original"), posters.png.clone().into()).await.unwrap();
    media.objects.put(&format!("{folder}/original.from"), gone.clone().into()).await.unwrap();
    media.sync.handle(&second).await.expect("recorded from the store, not downloaded");
    assert_eq!(host.downloads.load(Ordering::SeqCst), 1, "only the first poster was downloaded");
    let movie = c.movies.get_movie(v1::GetMovieRequest { movie_id: heat.clone() }).await.unwrap().into_inner();
    assert_eq!(
        (movie.poster_source_url.as_str(), movie.poster_sizes.as_slice()),
        (gone.as_str(), &["original".to_owned()][..])
    );
    let stored = events(&db, "ImageStored", &heat).await;
    assert_eq!(stored.len(), 2, "the new poster is announced");
    media.conversion.handle(&stored[1]).await.unwrap();
    assert_eq!(poster_sizes(&mut c, &heat).await, sizes_of(400), "the new poster's variants");
    assert!(!media.objects.list(&folder).await.unwrap().iter().any(|k| k.ends_with(".from")), "the note went");
    write.stop().await;
}

/// Runs `handler` on `event` twice at once and once more after: it must succeed each time.
async fn thrice(handler: &Arc<dyn reelay_delivery::Handler>, event: &v1::Event) {
    let (a, b) = tokio::join!(handler.handle(event), handler.handle(event));
    a.unwrap();
    b.unwrap();
    handler.handle(event).await.unwrap();
}

/// The whole path of a JPEG and a PNG poster, every handler run three times per event: one
/// original, one PosterSynced, one ImageStored, a webp variant per width up to the original's
/// (the 400-pixel PNG gets no w500) that decodes at its width (aspect kept) and is smaller than
/// the original, one PosterConverted; a variant lost in a crash half-way is made again alone; a
/// missing original means done.
async fn posters_are_stored_and_converted_once(objects: ObjectsSettings, dir: &std::path::Path) {
    let posters = Posters::new();
    let host = PosterHost::start(posters.clone()).await;
    let db = dir.join("reelay.db");
    let mut write = Reelay::start_write(BIN, &db, &[]).await;
    let mut c = write.clients().await;
    let ana = c.user("ana").await;
    let media = InProcess::build(&write, objects).await;

    let mut movies = Vec::new();
    for (title, path, served, content_type, (width, height)) in [
        ("Heat", "/poster.jpg", &posters.jpeg, "image/jpeg", (600, 900)),
        ("Thief", "/poster.png", &posters.png, "image/png", (400, 600)),
    ] {
        let movie = c.movie(&ana, title, 1981).await;
        movies.push(movie.clone());
        let enriched = enrich(&mut c, &db, &movie, &host.url(path)).await;
        thrice(&media.sync, &enriched).await;
        assert_eq!(events(&db, "PosterSynced", &movie).await.len(), 1, "{title}: one PosterSynced");
        let mut stored = events(&db, "ImageStored", &movie).await;
        assert_eq!(stored.len(), 1, "{title}: one ImageStored");
        let stored = stored.remove(0);
        let Some(v1::event::Payload::ImageStored(image)) = &stored.payload else { panic!("{stored:?}") };
        assert_eq!(
            (image.key.as_str(), image.content_type.as_str()),
            (format!("posters/{movie}/original").as_str(), content_type)
        );
        let original = media.objects.get(&image.key).await.unwrap().expect("the original is stored");
        assert_eq!(original.as_ref(), served.as_slice(), "{title}: the stored original is the served poster");
        assert_eq!(poster_sizes(&mut c, &movie).await, ["original"]);

        thrice(&media.conversion, &stored).await;
        assert_eq!(events(&db, "PosterConverted", &movie).await.len(), 1, "{title}: one PosterConverted");
        assert_eq!(poster_sizes(&mut c, &movie).await, sizes_of(width), "{title}");
        let mut variants = Vec::new();
        for w in WIDTHS.into_iter().filter(|&w| w <= width) {
            let key = format!("posters/{movie}/w{w}.webp");
            let variant = media.objects.get(&key).await.unwrap().unwrap_or_else(|| panic!("{title}: {key} stored"));
            let expected_height = (height * w + width / 2) / width;
            assert_eq!(decoded_size(&variant), (w, expected_height, "WebP".to_owned()), "{title}: {key}");
            assert!(variant.len() < served.len(), "{title}: {key} is smaller than the original");
            variants.push((key, variant));
        }
        let keys = media.objects.list(&format!("posters/{movie}")).await.unwrap();
        assert_eq!(keys.len(), sizes_of(width).len(), "{title}: no other keys: {keys:?}");

        // A crash half-way: one variant is missing. The retry makes that one alone, the others
        // stay as they were, and the record is a repeat (no second PosterConverted).
        let (lost, _) = &variants[2];
        media.objects.delete(lost).await.unwrap();
        media.conversion.handle(&stored).await.unwrap();
        for (key, bytes) in &variants {
            assert_eq!(media.objects.get(key).await.unwrap().unwrap(), bytes, "{title}: {key} the same");
        }
        assert_eq!(events(&db, "PosterConverted", &movie).await.len(), 1, "{title}: still one PosterConverted");
    }

    // A new poster replaces Heat's 600-pixel JPEG with a 400-pixel PNG: the old variants go
    // before the new original is written (no stale w500 stays), with one written and never
    // recorded (a conversion that failed half-way, another width setting), and the new ones
    // are made.
    let heat = &movies[0];
    media.objects.put(&format!("posters/{heat}/w780.webp"), b"stray".to_vec().into()).await.unwrap();
    let enriched = enrich(&mut c, &db, heat, &host.url("/poster.png")).await;
    media.sync.handle(&enriched).await.unwrap();
    assert_eq!(events(&db, "PosterSynced", heat).await.len(), 2, "a new poster is a new PosterSynced");
    assert_eq!(poster_sizes(&mut c, heat).await, ["original"], "the old variants are no longer recorded");
    assert_eq!(media.objects.list(&format!("posters/{heat}")).await.unwrap(), [format!("posters/{heat}/original")]);
    let stored = events(&db, "ImageStored", heat).await.pop().unwrap();
    media.conversion.handle(&stored).await.unwrap();
    assert_eq!(poster_sizes(&mut c, heat).await, sizes_of(400));
    let w185 = media.objects.get(&format!("posters/{heat}/w185.webp")).await.unwrap().unwrap();
    assert_eq!(decoded_size(&w185), (185, 278, "WebP".to_owned()));

    // Heat's first enrichment (the JPEG) delivered again, late: the profile names the PNG now,
    // so nothing is downloaded, replaced or recorded.
    let first = events(&db, "MovieEnriched", heat).await.remove(0);
    let downloads = host.downloads.load(Ordering::SeqCst);
    media.sync.handle(&first).await.unwrap();
    assert_eq!(host.downloads.load(Ordering::SeqCst), downloads, "nothing downloaded for an outdated event");
    assert_eq!(events(&db, "PosterSynced", heat).await.len(), 2);
    assert_eq!(poster_sizes(&mut c, heat).await, sizes_of(400));
    let original = media.objects.get(&format!("posters/{heat}/original")).await.unwrap().unwrap();
    assert_eq!(original.as_ref(), posters.png.as_slice(), "the current poster stays");

    // The same poster at a new URL (a cache-busting query): downloaded once to compare, then
    // only its source changes; the variants stay, stored and recorded, nothing is raised, and
    // the next delivery from that URL downloads nothing.
    let thief = &movies[1];
    let kept = media.objects.list(&format!("posters/{thief}")).await.unwrap();
    let enriched = enrich(&mut c, &db, thief, &host.url("/poster.png?v=2")).await;
    let downloads = host.downloads.load(Ordering::SeqCst);
    media.sync.handle(&enriched).await.unwrap();
    media.sync.handle(&enriched).await.unwrap();
    assert_eq!(host.downloads.load(Ordering::SeqCst), downloads + 1, "downloaded once, to compare");
    assert_eq!(events(&db, "PosterSynced", thief).await.len(), 1, "the same poster is no new PosterSynced");
    assert_eq!(poster_sizes(&mut c, thief).await, sizes_of(400), "its variants are still recorded");
    assert_eq!(media.objects.list(&format!("posters/{thief}")).await.unwrap(), kept, "and still stored");
    let movie = c.movies.get_movie(v1::GetMovieRequest { movie_id: thief.clone() }).await.unwrap().into_inner();
    assert_eq!(movie.poster_source_url, host.url("/poster.png?v=2"));

    // An older enrichment's poster stored with its note and never recorded (a crash between),
    // then a newer enrichment naming another poster, synced before or after the older event is
    // delivered again: the newer poster's sync downloads its own instead of recording the
    // older bytes as its own. So does it for an unrecorded object with no note (stored by an
    // older build, or a crash between the object and its note).
    for (title, note, older_first) in [("Heist", true, true), ("Spartan", true, false), ("Redbelt", false, false)] {
        let movie = c.movie(&ana, title, 2001).await;
        let older = enrich(&mut c, &db, &movie, &host.url("/poster.jpg")).await;
        media.objects.put(&format!("posters/{movie}/original"), posters.jpeg.clone().into()).await.unwrap();
        if note {
            let from = host.url("/poster.jpg").into_bytes().into();
            media.objects.put(&format!("posters/{movie}/original.from"), from).await.unwrap();
        }
        let newer = enrich(&mut c, &db, &movie, &host.url("/poster.png")).await;
        if older_first {
            media.sync.handle(&older).await.unwrap();
        }
        media.sync.handle(&newer).await.unwrap();
        media.sync.handle(&older).await.unwrap();
        let original = media.objects.get(&format!("posters/{movie}/original")).await.unwrap().unwrap();
        assert_eq!(original.as_ref(), posters.png.as_slice(), "{title}: the newer poster is stored");
        let synced = events(&db, "PosterSynced", &movie).await;
        assert_eq!(synced.len(), 1, "{title}");
        let Some(v1::event::Payload::PosterSynced(synced)) = &synced[0].payload else { panic!("{synced:?}") };
        assert_eq!(
            (synced.source_url.as_str(), synced.content_type.as_str()),
            (host.url("/poster.png").as_str(), "image/png"),
            "{title}"
        );
        let keys = media.objects.list(&format!("posters/{movie}")).await.unwrap();
        assert_eq!(keys, [format!("posters/{movie}/original")], "{title}: the note is removed once recorded");
    }

    // A missing original means done: nothing made, nothing recorded.
    let ronin = c.movie(&ana, "Ronin", 1998).await;
    let enriched = enrich(&mut c, &db, &ronin, &host.url("/poster.jpg")).await;
    media.sync.handle(&enriched).await.unwrap();
    let stored = events(&db, "ImageStored", &ronin).await.remove(0);
    media.objects.delete(&format!("posters/{ronin}/original")).await.unwrap();
    media.conversion.handle(&stored).await.unwrap();
    assert!(media.objects.list(&format!("posters/{ronin}")).await.unwrap().is_empty());
    assert!(events(&db, "PosterConverted", &ronin).await.is_empty());

    // The crash window of poster sync, in process: the object and its note were written,
    // RecordPoster never ran. The retry records what is stored (no download), once, and the
    // note goes.
    let collateral = c.movie(&ana, "Collateral", 2004).await;
    let enriched = enrich(&mut c, &db, &collateral, &host.url("/poster.jpg")).await;
    media.objects.put(&format!("posters/{collateral}/original"), posters.jpeg.clone().into()).await.unwrap();
    let from = host.url("/poster.jpg").into_bytes().into();
    media.objects.put(&format!("posters/{collateral}/original.from"), from).await.unwrap();
    let downloads = host.downloads.load(Ordering::SeqCst);
    thrice(&media.sync, &enriched).await;
    assert_eq!(host.downloads.load(Ordering::SeqCst), downloads, "the stored object was recorded, not downloaded");
    assert_eq!(events(&db, "PosterSynced", &collateral).await.len(), 1);
    assert_eq!(events(&db, "ImageStored", &collateral).await.len(), 1);
    let keys = media.objects.list(&format!("posters/{collateral}")).await.unwrap();
    assert_eq!(keys, [format!("posters/{collateral}/original")]);

    // The internal methods name the field they refuse.
    let refused = c
        .movies
        .record_poster_variants(v1::RecordPosterVariantsRequest {
            movie_id: collateral.clone(),
            original_sha256: "0".repeat(64),
            variants: vec![v1::PosterVariant {
                width: 92,
                key: "posters/elsewhere/w92.webp".into(),
                size_bytes: 10,
                sha256: "0".repeat(64),
            }],
            request_id: String::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::InvalidArgument);
    assert!(refused.message().contains("variants[0].key"), "{}", refused.message());
    write.stop().await;
}

#[tokio::test]
async fn posters_are_stored_and_converted_once_under_the_data_dir() {
    let dir = temp_dir();
    posters_are_stored_and_converted_once(ObjectsSettings::default(), dir.path()).await;
    assert!(dir.path().join("objects/posters").is_dir(), "the default store is the data dir");
}

#[tokio::test]
async fn posters_are_stored_and_converted_once_in_an_s3_compatible_server() {
    let dir = temp_dir();
    let moto = MotoServer::start(&dir.path().join("moto")).await;
    moto.create_bucket("reelay-media").await;
    let settings = moto.settings("reelay-media", "prod");
    posters_are_stored_and_converted_once(settings, dir.path()).await;
    let keys = moto.keys("reelay-media", "prod/posters/").await;
    // Three variants each: Heat's poster was replaced by the 400-pixel PNG.
    assert_eq!(keys.iter().filter(|k| k.ends_with(".webp")).count(), 3 + 3, "{keys:?}");
    assert!(!dir.path().join("objects").exists(), "nothing stored locally");
}

#[tokio::test]
async fn bad_posters_are_dead_letters_of_poster_sync_alone_under_the_data_dir() {
    let dir = temp_dir();
    bad_posters_are_dead_letters_of_poster_sync_alone(dir.path(), ObjectsSettings::default(), Vec::new()).await;
    let files = files_under(&dir.path().join("objects"));
    assert!(!files.is_empty() && files.iter().all(|f| f.ends_with("original") || f.ends_with(".webp")), "{files:?}");
}

#[tokio::test]
async fn bad_posters_are_dead_letters_of_poster_sync_alone_in_an_s3_compatible_server() {
    let dir = temp_dir();
    let moto = MotoServer::start(&dir.path().join("moto")).await;
    moto.create_bucket("reelay-media").await;
    let settings = moto.settings("reelay-media", "prod");
    let env = moto.env("reelay-media", "prod");
    bad_posters_are_dead_letters_of_poster_sync_alone(dir.path(), settings, env).await;
    assert!(!dir.path().join("objects").exists(), "nothing stored locally");
}

/// In one `reelay run` process: a poster that fails once (a 503, a 429) is stored in the end;
/// bad posters (a 404, an HTML page, a truncated JPEG, 50 MB) are dead letters of poster-sync
/// alone, each with its reason, and leave nothing in storage; a variant is served over HTTP; and
/// deleting a film's last review removes every key of that film (and a redelivered cleanup
/// removes nothing more).
async fn bad_posters_are_dead_letters_of_poster_sync_alone(
    dir: &std::path::Path,
    settings: ObjectsSettings,
    objects_env: Vec<(String, String)>,
) {
    let posters = Posters::new();
    let host = PosterHost::start(posters.clone()).await;
    let db = dir.join("reelay.db");
    let mut env = vec![("REELAY_HANDLERS", "search,poster-sync,image-conversion,image-cleanup")];
    env.extend(objects_env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
    let mut reelay = Reelay::start_all(BIN, &db, &env).await;
    let mut c = reelay.clients().await;
    let ana = c.user("ana").await;
    let media = InProcess::build(&reelay, settings).await;
    let objects = media.objects.clone();

    let mut good = Vec::new();
    for (title, path) in [("Heat", "/flaky.jpg"), ("Thief", "/slow-down.jpg")] {
        let review = c.review(&ana, reelay_harness::movie_ref(title, 1995), 8).await;
        enrich(&mut c, &db, &review.movie_id, &host.url(path)).await;
        good.push((review, path));
    }
    let mut bad = Vec::new();
    for (title, path, reason) in [
        ("Manhunter", "/missing.jpg", "404"),
        ("Collateral", "/page.html", "not an image"),
        ("Miami Vice", "/truncated.jpg", "truncated JPEG"),
        ("Ali", "/huge.jpg", "over the 20971520 byte cap"),
    ] {
        let movie = c.movie(&ana, title, 2001).await;
        enrich(&mut c, &db, &movie, &host.url(path)).await;
        bad.push((movie, path, reason));
    }

    for (review, path) in &good {
        let movie = review.movie_id.clone();
        let sizes = eventually_sizes(&mut c, &movie).await;
        assert_eq!(sizes, all_sizes(), "{path}: stored after its retry");
    }
    let admin = AdminClient::new(reelay.channel().await);
    let letters = reelay_harness::eventually_some("four dead letters", LIMIT, || {
        let mut admin = admin.clone();
        async move {
            let request = v1::ListDeadLettersRequest { limit: 100, ..Default::default() };
            let letters = admin.list_dead_letters(request).await.ok()?.into_inner().dead_letters;
            (letters.len() >= 4).then_some(letters)
        }
    })
    .await;
    assert_eq!(letters.len(), 4, "{letters:?}");
    for (movie, path, reason) in &bad {
        let letter =
            letters.iter().find(|l| l.aggregate_id == *movie).unwrap_or_else(|| panic!("{path}: a dead letter"));
        assert_eq!((letter.handler.as_str(), letter.event_type.as_str()), ("poster-sync", "MovieEnriched"));
        assert!(letter.last_error.contains(reason), "{path}: {:?} should say {reason:?}", letter.last_error);
        assert_eq!(letter.attempts, 1, "{path}: a permanent failure is not retried");
        assert!(objects.list(&format!("posters/{movie}")).await.unwrap().is_empty(), "{path}: nothing stored");
    }
    let keys = objects.list("posters").await.unwrap();
    assert!(keys.iter().all(|k| k.ends_with("/original") || k.ends_with(".webp")), "nothing half-written: {keys:?}");
    // Search indexes the same MovieEnriched events, and settles them all: the failures were
    // poster-sync's alone (the four letters above are all it has).
    eventually("search settles every event", LIMIT, || {
        let db = db.clone();
        async move { reelay_harness::unsettled(&db, false, &["search"]).await.is_empty() }
    })
    .await;

    // Search results say which sizes are stored.
    let search = SearchClient::new(reelay.handlers_channel().await);
    let thief = good[1].0.movie_id.clone();
    let hit = reelay_harness::eventually_some("search lists Thief's poster sizes", LIMIT, || {
        let (mut search, thief) = (search.clone(), thief.clone());
        async move {
            let request = v1::SearchMoviesRequest { query: "thief".into(), ..Default::default() };
            let hits = search.search_movies(request).await.ok()?.into_inner().hits;
            hits.into_iter().find(|h| h.movie_id == thief && h.poster_sizes.len() == all_sizes().len())
        }
    })
    .await;
    assert_eq!(hit.poster_sizes, all_sizes());

    // The variants are served over HTTP with their type and caching headers.
    let heat = good[0].0.movie_id.clone();
    let url = format!("http://{}/media/posters/{heat}/w185.webp", reelay.media_addr);
    let (status, head, body) = http_request("GET", &url, &[], &[]).await;
    assert_eq!(status, 200, "{head}");
    let head = head.to_ascii_lowercase();
    assert!(head.contains("content-type: image/webp"), "{head}");
    // For an hour, then asked again: a movie's next poster is stored under these keys.
    assert!(head.contains("cache-control: public, max-age=3600") && !head.contains("immutable"), "{head}");
    assert!(head.contains("last-modified:"), "{head}");
    assert_eq!(decoded_size(&body).0, 185);
    // Asked again with its tag: 304, no body.
    let e_tag = head.lines().find_map(|l| l.strip_prefix("etag: ")).expect("an ETag").trim().to_owned();
    let (status, _, again) = http_request("GET", &url, &[("If-None-Match", e_tag.clone())], &[]).await;
    assert_eq!((status, again.len()), (304, 0), "unchanged since {e_tag}");
    let (status, _, _) = http_request("GET", &url, &[("If-None-Match", "\"other\"".into())], &[]).await;
    assert_eq!(status, 200, "another version's tag");
    // The original, streamed as read: its type from its first bytes, its whole length.
    let original = format!("http://{}/media/posters/{heat}/original", reelay.media_addr);
    let (status, head, body) = http_request("GET", &original, &[], &[]).await;
    let head = head.to_ascii_lowercase();
    assert_eq!(status, 200, "{head}");
    assert!(head.contains("content-type: image/jpeg") || head.contains("content-type: image/png"), "{head}");
    let stored = objects.get(&format!("posters/{heat}/original")).await.unwrap().unwrap();
    assert!(head.contains(&format!("content-length: {}", stored.len())), "{head}");
    assert_eq!(body, stored.to_vec(), "the stored bytes, whole");

    // Deleting the film's last review deletes the film, and image cleanup every key of it.
    let (review, _) = &good[0];
    delete_review(&mut c, &ana, review).await;
    eventually("every key of the deleted film is gone", LIMIT, || {
        let (objects, prefix) = (objects.clone(), format!("posters/{heat}"));
        async move { objects.list(&prefix).await.unwrap().is_empty() }
    })
    .await;
    assert_eq!(objects.list(&format!("posters/{thief}")).await.unwrap().len(), 5, "another film's keys stay");
    let deleted = events(&db, "MovieDeleted", &heat).await.remove(0);
    thrice(&media.cleanup, &deleted).await;
    assert_eq!(objects.list(&format!("posters/{thief}")).await.unwrap().len(), 5, "a redelivery deletes nothing more");
    reelay.stop().await;
}

async fn eventually_sizes(c: &mut reelay_harness::Clients, movie: &str) -> Vec<String> {
    let c = c.clone();
    reelay_harness::eventually_some("the poster and its variants are recorded", LIMIT, || {
        let (mut c, movie) = (c.clone(), movie.to_owned());
        async move {
            let sizes = poster_sizes(&mut c, &movie).await;
            (sizes.len() == all_sizes().len()).then_some(sizes)
        }
    })
    .await
}

/// The crash windows in real processes. `poster-sync` aborts at its failpoint after the object
/// write and before RecordPoster; a process started again with `image-conversion` aborting after
/// its first variant write records the poster, once; a third process makes the missing variants
/// alone and records them: one PosterSynced, one ImageStored, one PosterConverted, one download.
#[tokio::test]
async fn crashes_between_the_object_writes_and_the_records_lose_and_repeat_nothing() {
    let posters = Posters::new();
    let host = PosterHost::start(posters.clone()).await;
    let dir = temp_dir();
    let objects_dir = dir.path().join("shared-objects");
    let objects_url = objects_dir.display().to_string();
    let mut cluster = Cluster::builder(BIN, Backend::Db)
        .env("REELAY_LEDGER_LEASE_MS", "2000")
        .env("REELAY_OUTBOX_LEASE_MS", "2000")
        .env("REELAY_OBJECTS_URL", &objects_url)
        .handlers(&[("REELAY_HANDLERS", "poster-sync"), ("REELAY_FAILPOINTS", "poster_sync_after_put")])
        .start(dir.path())
        .await;
    let mut c = cluster.write.clients().await;
    let ana = c.user("ana").await;
    let db = cluster.db.clone();
    let heat = c.movie(&ana, "Heat", 1995).await;
    enrich(&mut c, &db, &heat, &host.url("/poster.jpg")).await;

    let aborted = |process: &mut Reelay| {
        let running = process.is_running();
        async move { !running }
    };
    let crashed = &mut cluster.handlers[0];
    eventually("poster-sync aborted at its failpoint", LIMIT, || aborted(crashed)).await;
    let original = objects_dir.join(format!("posters/{heat}/original"));
    assert_eq!(std::fs::read(&original).unwrap(), posters.jpeg, "the object was written before the crash");
    assert!(events(&db, "PosterSynced", &heat).await.is_empty(), "nothing recorded before the crash");

    let handlers = "poster-sync,image-conversion";
    let env = [
        ("REELAY_HANDLERS", handlers),
        ("REELAY_OBJECTS_URL", objects_url.as_str()),
        ("REELAY_FAILPOINTS", "image_conversion_after_put"),
    ];
    let mut second = Reelay::start_handlers(BIN, &cluster.write, &dir.path().join("second"), &env).await;
    eventually("image-conversion aborted after its first variant", LIMIT, || aborted(&mut second)).await;
    assert_eq!(events(&db, "PosterSynced", &heat).await.len(), 1);
    let first_variant = objects_dir.join(format!("posters/{heat}/w92.webp"));
    let kept = std::fs::read(&first_variant).expect("the first variant was written before the crash");
    assert!(events(&db, "PosterConverted", &heat).await.is_empty());

    let mut third = Reelay::start_handlers(BIN, &cluster.write, &dir.path().join("third"), &env[..2]).await;
    eventually("every delivery is settled", LIMIT, || {
        let db = db.clone();
        async move { reelay_harness::unsettled(&db, false, &["poster-sync", "image-conversion"]).await.is_empty() }
    })
    .await;
    assert_eq!(poster_sizes(&mut c, &heat).await, all_sizes());
    assert_eq!(std::fs::read(&first_variant).unwrap(), kept, "the variant made before the crash was kept");
    for event_type in ["PosterSynced", "ImageStored", "PosterConverted"] {
        assert_eq!(events(&db, event_type, &heat).await.len(), 1, "one {event_type}");
    }
    assert_eq!(host.downloads.load(Ordering::SeqCst), 1, "the retry used the stored object");
    assert!(!objects_dir.join(format!("posters/{heat}/original.from")).exists(), "its note went once recorded");
    third.stop().await;
    drop(second); // it aborted: nothing to stop
    cluster.handlers.clear();
    cluster.stop().await;
}

/// A deleted movie's images are gone on disk before image-cleanup reports done: while strace
/// fails the handlers process's fsyncs with EIO, the cleanup (whose unlinks would otherwise sit
/// in the page cache, for a power cut to bring the posters back) fails and is retried; once
/// fsyncs pass it completes.
#[tokio::test]
async fn a_movie_s_images_are_deleted_on_disk_before_cleanup_is_done() {
    let dir = temp_dir();
    let cluster = Cluster::builder(BIN, Backend::Db)
        .env("REELAY_RETRY_BASE_MS", "200")
        .handlers(&[("REELAY_HANDLERS", "image-cleanup")])
        .start(dir.path())
        .await;
    let mut c = cluster.write.clients().await;
    let ana = c.user("ana").await;
    let review = c.review(&ana, reelay_harness::movie_ref("Heat", 1995), 8).await;
    let posters = dir.path().join("handlers-0/objects/posters").join(&review.movie_id);
    std::fs::create_dir_all(&posters).unwrap();
    for name in ["original", "w92.webp"] {
        std::fs::write(posters.join(name), b"image").unwrap();
    }
    let handlers = &cluster.handlers[0];
    let strace = reelay_harness::Strace::inject(handlers.pid(), "fsync,fdatasync", "EIO", "1+1", dir.path()).await;
    delete_review(&mut c, &ana, &review).await;
    eventually("the cleanup fails while fsyncs fail", LIMIT, || {
        let failed = handlers.logged_handler_failure("image-cleanup");
        async move { failed }
    })
    .await;
    assert!(strace.stop().await > 0, "no fsync failed");
    eventually("the cleanup is done once fsyncs pass", LIMIT, || {
        let db = cluster.db.clone();
        async move { reelay_harness::unsettled(&db, false, &["image-cleanup"]).await.is_empty() }
    })
    .await;
    assert_eq!(files_under(&dir.path().join("handlers-0/objects")), Vec::<String>::new());
    cluster.stop().await;
}

/// The temporary file of an object write a killed process left (`<key>#<n>`, which nothing
/// lists or deletes) is removed by the handlers service when it starts, once old enough; a
/// young one (a write in flight in another process sharing the directory) stays.
#[tokio::test]
async fn a_killed_write_s_temporary_file_is_swept_at_start() {
    let dir = temp_dir();
    let objects = dir.path().join("handlers-0/objects/posters/m1");
    std::fs::create_dir_all(&objects).unwrap();
    let (stale, young) = (objects.join("original#1"), objects.join("w92.webp#1"));
    let hour_ago = std::time::SystemTime::now() - Duration::from_secs(3600);
    std::fs::File::create(&stale).unwrap().set_modified(hour_ago).unwrap();
    std::fs::File::create(&young).unwrap();
    let cluster =
        Cluster::builder(BIN, Backend::Db).handlers(&[("REELAY_HANDLERS", "image-cleanup")]).start(dir.path()).await;
    eventually("the stale temporary file is removed", LIMIT, || {
        let gone = !stale.exists();
        async move { gone }
    })
    .await;
    assert!(young.exists(), "a young one stays");
    let log = cluster.handlers[0].log_text();
    assert!(log.contains("removed the staging files of object writes that never finished"), "{log}");
    cluster.stop().await;
}
