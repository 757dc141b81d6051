//! Posters (issue 11, in progress): the `poster-sync` handler against a real write service, a
//! real HTTP server serving a real PNG (built here) and bad answers, and real files in object
//! storage under the data dir.
//!
//! Still to come (see NOTES-issue-11.md): dead letters read from the ledger, JPEGs,
//! image conversion and cleanup, S3.

use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use reelay_contracts::v1;
use reelay_delivery::HandlerError;
use reelay_harness::{Backend, Cluster, Reelay, TEST_TOKEN, outbox_rows, temp_dir};

const BIN: &str = env!("CARGO_BIN_EXE_reelay");

/// A real PNG: `width`×`height` RGB, a gradient.
fn png(width: u32, height: u32) -> Vec<u8> {
    fn chunk(out: &mut Vec<u8>, kind: &[u8; 4], data: &[u8]) {
        out.extend_from_slice(&(data.len() as u32).to_be_bytes());
        let mut crc = flate2::Crc::new();
        crc.update(kind);
        crc.update(data);
        out.extend_from_slice(kind);
        out.extend_from_slice(data);
        out.extend_from_slice(&crc.sum().to_be_bytes());
    }
    let mut raw = Vec::new();
    for y in 0..height {
        raw.push(0); // filter: none
        for x in 0..width {
            raw.extend_from_slice(&[(x * 255 / width) as u8, (y * 255 / height) as u8, 128]);
        }
    }
    let mut z = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::default());
    z.write_all(&raw).unwrap();
    let idat = z.finish().unwrap();
    let mut ihdr = Vec::new();
    ihdr.extend_from_slice(&width.to_be_bytes());
    ihdr.extend_from_slice(&height.to_be_bytes());
    ihdr.extend_from_slice(&[8, 2, 0, 0, 0]);
    let mut out = vec![0x89, b'P', b'N', b'G', 0x0D, 0x0A, 0x1A, 0x0A];
    chunk(&mut out, b"IHDR", &ihdr);
    chunk(&mut out, b"IDAT", &idat);
    chunk(&mut out, b"IEND", &[]);
    out
}

/// The poster host: a PNG, a 404, an HTML page, a truncated JPEG and a body over the cap.
struct PosterHost {
    addr: std::net::SocketAddr,
    /// Requests for `/poster.png`.
    downloads: Arc<std::sync::atomic::AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl PosterHost {
    async fn start(poster: Arc<Vec<u8>>) -> Self {
        let downloads = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counter = downloads.clone();
        let router = Router::new()
            .route(
                "/poster.png",
                get(move || {
                    let poster = poster.clone();
                    counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    async move { ([(header::CONTENT_TYPE, "image/png")], poster.as_ref().clone()) }
                }),
            )
            .route("/page.html", get(|| async { ([(header::CONTENT_TYPE, "text/html")], "<html>no poster</html>") }))
            .route(
                "/truncated.jpg",
                get(|| async {
                    ([(header::CONTENT_TYPE, "image/jpeg")], vec![0xFF, 0xD8, 0xFF, 0xE0, 0, 16, 1, 2, 3])
                }),
            )
            .route("/huge.png", get(|| async { ([(header::CONTENT_TYPE, "image/png")], vec![0u8; 300 * 1024]) }))
            .fallback(|| async { (StatusCode::NOT_FOUND, "no such poster").into_response() });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let task = tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
        Self { addr, downloads, task }
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

/// Builds `name` (a media handler) in this process, as [`poster_sync`] does.
async fn media_handler(name: &str, write: &Reelay, data_dir: &std::path::Path) -> Arc<dyn reelay_delivery::Handler> {
    let context = reelay_delivery::HandlerContext {
        data_dir: data_dir.to_owned(),
        write: reelay_kit::client::connect_lazy(
            &format!("http://{}", write.addr),
            Some(TEST_TOKEN),
            Duration::from_secs(30),
        )
        .unwrap(),
    };
    let settings = reelay_handlers::HandlerSettings::default();
    let mut built = reelay_handlers::build(&[name.to_owned()], &settings, &context).await.unwrap();
    built.remove(0).handler
}

/// Builds `poster-sync` in this process against a real write service, objects under `data_dir`.
async fn poster_sync(write: &Reelay, data_dir: &std::path::Path) -> Arc<dyn reelay_delivery::Handler> {
    reelay_objects::install_tls_provider();
    let context = reelay_delivery::HandlerContext {
        data_dir: data_dir.to_owned(),
        write: reelay_kit::client::connect_lazy(
            &format!("http://{}", write.addr),
            Some(TEST_TOKEN),
            Duration::from_secs(30),
        )
        .unwrap(),
    };
    let mut settings = reelay_handlers::HandlerSettings::default();
    settings.media.max_bytes = 256 * 1024;
    settings.media.timeout_ms = 5_000;
    let mut built = reelay_handlers::build(&["poster-sync".to_owned()], &settings, &context).await.unwrap();
    built.remove(0).handler
}

/// Discovers a film and enriches it with `poster_url` (through the internal SaveEnrichment, as
/// movie-enrichment does); returns its id and its MovieEnriched event.
async fn enriched_film(
    c: &mut reelay_harness::Clients,
    db: &std::path::Path,
    actor: &str,
    title: &str,
    poster_url: &str,
) -> (String, v1::Event) {
    let movie_id = c.movie(actor, title, 1995).await;
    let profile = v1::MovieProfile {
        provider: "tmdb".into(),
        provider_id: format!("tmdb:{title}"),
        poster_url: poster_url.into(),
        ..Default::default()
    };
    c.movies
        .save_enrichment(v1::SaveEnrichmentRequest {
            movie_id: movie_id.clone(),
            outcome: Some(v1::save_enrichment_request::Outcome::Profile(profile)),
            request_id: String::new(),
        })
        .await
        .unwrap();
    let event = events(db, "MovieEnriched", &movie_id).await.remove(0);
    (movie_id, event)
}

async fn events(db: &std::path::Path, event_type: &str, aggregate: &str) -> Vec<v1::Event> {
    outbox_rows(db)
        .await
        .into_iter()
        .filter(|r| r.event_type == event_type && r.aggregate_id == aggregate)
        .filter_map(|r| r.envelope)
        .collect()
}

#[tokio::test]
async fn poster_sync_stores_a_real_png_once_and_refuses_bad_posters_for_good() {
    let poster = Arc::new(png(300, 450));
    let host = PosterHost::start(poster.clone()).await;
    let dir = temp_dir();
    let db = dir.path().join("reelay.db");
    let mut write = Reelay::start_write(BIN, &db, &[]).await;
    let mut c = write.clients().await;
    let ana = c.user("ana").await;
    let handler = poster_sync(&write, dir.path()).await;

    // Three runs (two at once, then a redelivery): one object, one PosterSynced, one ImageStored.
    let (heat, event) = enriched_film(&mut c, &db, &ana, "Heat", &host.url("/poster.png")).await;
    let (a, b) = tokio::join!(handler.handle(&event), handler.handle(&event));
    a.unwrap();
    b.unwrap();
    handler.handle(&event).await.unwrap();
    assert_eq!(events(&db, "PosterSynced", &heat).await.len(), 1, "one PosterSynced");
    let stored = events(&db, "ImageStored", &heat).await;
    assert_eq!(stored.len(), 1, "one ImageStored");
    let Some(v1::event::Payload::ImageStored(image)) = &stored[0].payload else { panic!("{stored:?}") };
    assert_eq!(image.key, format!("posters/{heat}/original"));
    assert_eq!(image.content_type, "image/png");
    assert_eq!(image.size_bytes, poster.len() as u64);
    let file = dir.path().join("objects").join(&image.key);
    assert_eq!(std::fs::read(&file).unwrap(), *poster, "the stored object is the served PNG");
    let movie = c.movies.get_movie(v1::GetMovieRequest { movie_id: heat.clone() }).await.unwrap().into_inner();
    assert_eq!(movie.poster_sizes, ["original"]);
    assert_eq!(movie.poster_source_url, host.url("/poster.png"));

    // The crash window, in process: the object was written but RecordPoster never ran. The
    // retry records what is stored, once. (The failpoint in a `reelay run` process is next.)
    let (ronin, event) = enriched_film(&mut c, &db, &ana, "Ronin", &host.url("/poster.png")).await;
    let objects = reelay_objects::Objects::open(&Default::default(), dir.path()).unwrap();
    objects.put(&format!("posters/{ronin}/original"), poster.as_ref().clone().into()).await.unwrap();
    handler.handle(&event).await.unwrap();
    handler.handle(&event).await.unwrap();
    assert_eq!(events(&db, "PosterSynced", &ronin).await.len(), 1);
    assert_eq!(events(&db, "ImageStored", &ronin).await.len(), 1);

    // Bad posters: each a permanent failure with a clear reason, and nothing stored.
    for (title, path, reason) in [
        ("Thief", "/missing.jpg", "404"),
        ("Manhunter", "/page.html", "not an image"),
        ("Collateral", "/truncated.jpg", "truncated JPEG"),
        ("Miami Vice", "/huge.png", "cap"),
    ] {
        let (movie, event) = enriched_film(&mut c, &db, &ana, title, &host.url(path)).await;
        match handler.handle(&event).await {
            Err(HandlerError::Permanent(message)) => {
                assert!(message.contains(reason), "{title}: {message:?} should say {reason:?}")
            }
            other => panic!("{title}: expected a permanent failure, got {other:?}"),
        }
        assert!(!objects.exists(&format!("posters/{movie}/original")).await.unwrap(), "{title}: nothing stored");
        assert!(events(&db, "PosterSynced", &movie).await.is_empty());
    }

    // RecordPoster's validation names the field.
    let refused = c
        .movies
        .record_poster(v1::RecordPosterRequest {
            movie_id: heat.clone(),
            key: "posters/elsewhere/original".into(),
            content_type: "image/png".into(),
            size_bytes: 10,
            sha256: "0".repeat(64),
            source_url: "https://example.com/p.png".into(),
            request_id: String::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::InvalidArgument);
    assert!(refused.message().contains("key"), "{}", refused.message());
    write.stop().await;
}

/// The crash window in real processes: `poster-sync` aborts at the failpoint after the object
/// write and before RecordPoster; a handlers process started again finds the object, records it
/// without downloading again, and PosterSynced and ImageStored are in the outbox exactly once.
#[tokio::test]
async fn a_crash_after_the_object_write_records_the_poster_once() {
    let poster = Arc::new(png(200, 300));
    let host = PosterHost::start(poster.clone()).await;
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
    let (heat, _) = enriched_film(&mut c, &db, &ana, "Heat", &host.url("/poster.png")).await;

    let crashed = &mut cluster.handlers[0];
    reelay_harness::eventually("the handler aborted at the failpoint", Duration::from_secs(60), || {
        let running = crashed.is_running();
        async move { !running }
    })
    .await;
    let key = format!("posters/{heat}/original");
    assert_eq!(std::fs::read(objects_dir.join(&key)).unwrap(), *poster, "the object was written before the crash");
    assert!(events(&db, "PosterSynced", &heat).await.is_empty(), "nothing recorded before the crash");

    let env = vec![("REELAY_HANDLERS", "poster-sync"), ("REELAY_OBJECTS_URL", objects_url.as_str())];
    let mut again = Reelay::start_handlers(BIN, &cluster.write, &dir.path().join("handlers-again"), &env).await;
    reelay_harness::eventually("the delivery is settled", Duration::from_secs(60), || {
        let db = db.clone();
        async move { reelay_harness::unsettled(&db, false, &["poster-sync"]).await.is_empty() }
    })
    .await;
    let movie = c.movies.get_movie(v1::GetMovieRequest { movie_id: heat.clone() }).await.unwrap().into_inner();
    assert_eq!(movie.poster_sizes, ["original"]);
    assert_eq!(events(&db, "PosterSynced", &heat).await.len(), 1);
    assert_eq!(events(&db, "ImageStored", &heat).await.len(), 1);
    assert_eq!(host.downloads.load(std::sync::atomic::Ordering::SeqCst), 1, "the retry used the stored object");
    again.stop().await;
    cluster.handlers.clear();
    cluster.stop().await;
}

/// Cleanup after the film's last review is deleted: every key under `posters/<movie_id>/` goes,
/// another film's stay, and a redelivery is a no-op.
#[tokio::test]
async fn deleting_the_last_review_removes_every_key_of_the_film() {
    let dir = temp_dir();
    let db = dir.path().join("reelay.db");
    let mut write = Reelay::start_write(BIN, &db, &[]).await;
    let mut c = write.clients().await;
    let ana = c.user("ana").await;
    let review = c.review(&ana, reelay_harness::movie_ref("Heat", 1995), 9).await;
    let heat = review.movie_id.clone();
    let objects = reelay_objects::Objects::open(&Default::default(), dir.path()).unwrap();
    for key in ["original", "w92.webp", "w185.webp"] {
        objects.put(&format!("posters/{heat}/{key}"), png(4, 6).into()).await.unwrap();
    }
    objects.put("posters/other-film/original", png(4, 6).into()).await.unwrap();
    c.reviews
        .delete_review(v1::DeleteReviewRequest {
            actor_user_id: ana.clone(),
            review_id: review.review_id.clone(),
            ..Default::default()
        })
        .await
        .unwrap();
    let deleted = events(&db, "MovieDeleted", &heat).await.remove(0);
    let cleanup = media_handler("image-cleanup", &write, dir.path()).await;
    cleanup.handle(&deleted).await.unwrap();
    assert!(objects.list(&format!("posters/{heat}")).await.unwrap().is_empty(), "every key of the film is gone");
    assert!(objects.exists("posters/other-film/original").await.unwrap(), "another film's poster stays");
    cleanup.handle(&deleted).await.unwrap();
    write.stop().await;
}
