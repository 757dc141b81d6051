//! `poster-sync` (on `MovieEnriched` with a poster URL) downloads the poster over HTTP (a
//! timeout, a size cap, a content-type check and a check of the bytes themselves), writes it to
//! `posters/<movie_id>/original` in object storage, then records it through the internal
//! `Movies.RecordPoster`, which raises `PosterSynced` and `ImageStored` in one transaction.
//!
//! Exactly once, across redeliveries and crashes:
//! - a poster already recorded from the same URL is skipped (no download, no write, no event),
//!   and one downloaded whose bytes are the ones stored is recorded from its URL without being
//!   written again (its variants stay);
//! - a crash after the object write and before `RecordPoster` is retried: the retry finds the
//!   object (no poster recorded yet) and, beside it, `original.from` naming the URL it came
//!   from, records it, and the events are raised once. The note is written after the object
//!   and removed once it is recorded: an unrecorded object without a note naming this URL (an
//!   older event's poster, stored by a try that crashed before recording it, or a write cut
//!   short before its note) is downloaded again, never taken for this URL's;
//! - a movie deleted while its poster downloads (`RecordPoster` answers not found, or a retry
//!   finds no movie) has every object of it removed here: image cleanup may have run before
//!   the write;
//! - `RecordPoster` carries a request id derived from the event, and a repeat of the same key and
//!   digest raises nothing anyway;
//! - a sync takes its turn on the movie's objects (the crate's doc), from reading what is
//!   recorded to recording, so two syncs of one movie never interleave.
//!
//! Failures: a 404/410, another 4xx, a declared non-image `Content-Type` (`text/html`; a generic
//! `application/octet-stream` or none is judged by the bytes), bytes that are not an image, a
//! body over the cap, a truncated JPEG/PNG or a redirect loop are permanent, with the reason in
//! the dead letter, and nothing is written; a 5xx, a 408, a timeout or a connection error is
//! retryable; a 429 is waited out here when its `Retry-After` is short (a few seconds, twenty in
//! all, well inside the handler's timeout), else it is retryable on the runtime's schedule.

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use reelay_contracts::v1::{self, event::Payload, movies_client::MoviesClient};
use reelay_delivery::{Handler, HandlerError};
use reelay_domain::net::{NotPublic, not_public_in, private_literal, public_only};
use reelay_kit::client::ServiceChannel;
use reelay_objects::Objects;
use reqwest::StatusCode;
use tonic::Code;

use crate::{check_image, original_key, sha256_hex};

/// The key of the note naming the URL a movie's stored, not yet recorded original came from.
fn source_key(movie_id: &str) -> String {
    format!("{}/original.from", crate::movie_folder(movie_id))
}

/// How often one download waits out a 429 before giving up for now, and for how long at most
/// in all: the other events of its batch wait behind it, and the handler's timeout (a minute by
/// default) bounds it.
const RATE_LIMIT_RETRIES: u32 = 3;
const MAX_RATE_LIMIT_WAIT: Duration = Duration::from_secs(20);

/// The most redirects one download follows.
const MAX_REDIRECTS: usize = 5;

/// Downloads a film's poster into object storage and records it.
pub struct PosterSync {
    http: reqwest::Client,
    max_bytes: u64,
    /// Whether non-public addresses may be reached (see [`download_client`]).
    allow_private: bool,
    movies: MoviesClient<ServiceChannel>,
    objects: Objects,
}

impl PosterSync {
    pub fn new(
        http: reqwest::Client,
        max_bytes: u64,
        allow_private: bool,
        movies: MoviesClient<ServiceChannel>,
        objects: Objects,
    ) -> Self {
        Self { http, max_bytes, allow_private, movies, objects }
    }
}

/// Resolves names keeping only public addresses (none left: [`NotPublic`]), so a name cannot
/// lead a download into this network, nor a second lookup rebind it after a check.
struct PublicOnly;

impl reqwest::dns::Resolve for PublicOnly {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let name = name.as_str().to_owned();
        Box::pin(async move {
            let found: Vec<std::net::SocketAddr> = tokio::net::lookup_host((name.as_str(), 0)).await?.collect();
            Ok(Box::new(public_only(&name, found)?.into_iter()) as reqwest::dns::Addrs)
        })
    }
}

/// The IP literal host of `url` when it is not public (see [`private_literal`]).
fn private_host(url: &reqwest::Url) -> Option<std::net::IpAddr> {
    url.host_str().and_then(private_literal)
}

/// The poster download client: `timeout` per download, at most [`MAX_REDIRECTS`] redirects,
/// and unless `allow_private` only public addresses, for the first request and every redirect
/// (a poster URL comes from the provider's answer; a redirect from whatever host it names).
pub(crate) fn download_client(timeout: Duration, allow_private: bool) -> Result<reqwest::Client, reqwest::Error> {
    reelay_objects::install_tls_provider();
    let redirects = reqwest::redirect::Policy::custom(move |attempt| {
        if attempt.previous().len() >= MAX_REDIRECTS {
            return attempt.error(format!("more than {MAX_REDIRECTS} redirects"));
        }
        match private_host(attempt.url()).filter(|_| !allow_private) {
            Some(ip) => attempt.error(NotPublic(ip.to_string())),
            None => attempt.follow(),
        }
    });
    let mut builder = reqwest::Client::builder()
        .timeout(timeout)
        .redirect(redirects)
        .user_agent(concat!("reelay/", env!("CARGO_PKG_VERSION")));
    if !allow_private {
        // Every address is checked, so nothing goes through a proxy (HTTPS_PROXY and the like):
        // a proxy resolves the poster's host itself, and would reach what the check keeps out.
        builder = builder.dns_resolver(PublicOnly).no_proxy();
    }
    builder.build()
}

/// A downloaded (or found) poster, checked.
struct Poster {
    bytes: Bytes,
    content_type: &'static str,
}

/// Why a download failed: retry later (maybe after `after`), or never.
enum DownloadError {
    Retryable { message: String, after: Option<Duration> },
    Permanent(String),
}

impl PosterSync {
    /// The usable poster stored under `key`, if there is one.
    async fn stored(&self, key: &str) -> Result<Option<Poster>, HandlerError> {
        let Some(bytes) = self.objects.get(key).await.map_err(crate::store_failed)? else { return Ok(None) };
        match check_image(&bytes) {
            Ok(content_type) => Ok(Some(Poster { bytes, content_type })),
            Err(reason) => {
                tracing::warn!(key, %reason, "a stored poster is unusable; downloading again");
                Ok(None)
            }
        }
    }

    /// The poster stored under the movie's original key and not recorded as from `url`, if the
    /// note beside it says it came from there.
    async fn stored_from(&self, movie_id: &str, url: &str) -> Result<Option<Poster>, HandlerError> {
        let note = self.objects.get(&source_key(movie_id)).await.map_err(crate::store_failed)?;
        match note {
            Some(note) if note == url.as_bytes() => self.stored(&original_key(movie_id)).await,
            Some(_) => {
                tracing::info!(movie_id, url, "an unrecorded poster from another URL is stored; downloading this one");
                Ok(None)
            }
            None => Ok(None),
        }
    }

    /// Downloads `url`, waiting out a few 429s.
    async fn download(&self, url: &str) -> Result<Poster, HandlerError> {
        let (mut tries, mut waited) = (0, Duration::ZERO);
        loop {
            match self.download_once(url).await {
                Ok(poster) => return Ok(poster),
                Err(DownloadError::Retryable { after: Some(after), .. })
                    if tries < RATE_LIMIT_RETRIES && waited + after <= MAX_RATE_LIMIT_WAIT =>
                {
                    tries += 1;
                    waited += after;
                    tracing::info!(
                        url,
                        wait_ms = after.as_millis() as u64,
                        "poster host asked to slow down (429); waiting"
                    );
                    tokio::time::sleep(after).await;
                }
                Err(DownloadError::Retryable { message, .. }) => return Err(HandlerError::Retryable(message)),
                Err(DownloadError::Permanent(message)) => return Err(HandlerError::Permanent(message)),
            }
        }
    }

    async fn download_once(&self, url: &str) -> Result<Poster, DownloadError> {
        let retryable = |message: String| DownloadError::Retryable { message, after: None };
        let not_public_error = |host: String| {
            DownloadError::Permanent(format!(
                "poster {url}: {host} is not a public address (REELAY_MEDIA_ALLOW_PRIVATE allows private ones); \
                 nothing stored"
            ))
        };
        let parsed = reqwest::Url::parse(url)
            .map_err(|e| DownloadError::Permanent(format!("poster {url}: not a URL ({e}); nothing stored")))?;
        if let Some(ip) = private_host(&parsed).filter(|_| !self.allow_private) {
            return Err(not_public_error(ip.to_string()));
        }
        let mut response = self.http.get(parsed).send().await.map_err(|e| match not_public_in(&e) {
            Some(host) => not_public_error(host),
            // The redirect policy's refusal: a loop, or more than it follows; no retry helps.
            None if e.is_redirect() => {
                DownloadError::Permanent(format!("poster {url}: {}; nothing stored", describe(&e)))
            }
            None => retryable(format!("poster {url}: {}", describe(&e))),
        })?;
        let status = response.status();
        match status {
            s if s.is_success() => {}
            StatusCode::TOO_MANY_REQUESTS => {
                let after = response
                    .headers()
                    .get(reqwest::header::RETRY_AFTER)
                    .and_then(|v| v.to_str().ok())
                    .and_then(retry_after);
                return Err(DownloadError::Retryable { message: format!("poster {url}: rate limited (429)"), after });
            }
            s if s.is_server_error() || s == StatusCode::REQUEST_TIMEOUT => {
                return Err(retryable(format!("poster {url}: the host answered {s}")));
            }
            s => return Err(DownloadError::Permanent(format!("poster {url}: the host answered {s}"))),
        }
        let declared = response
            .headers()
            .get(reqwest::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .split(';')
            .next()
            .unwrap_or("")
            .trim()
            .to_ascii_lowercase();
        // Object stores often serve an upload without a type as a generic one: the bytes decide.
        let generic = matches!(declared.as_str(), "" | "application/octet-stream" | "binary/octet-stream");
        if !declared.starts_with("image/") && !generic {
            return Err(DownloadError::Permanent(format!(
                "poster {url}: not an image (Content-Type {declared:?}); nothing stored"
            )));
        }
        if let Some(length) = response.content_length()
            && length > self.max_bytes
        {
            return Err(DownloadError::Permanent(format!(
                "poster {url}: {length} bytes is over the {} byte cap (REELAY_MEDIA_MAX_BYTES); nothing stored",
                self.max_bytes
            )));
        }
        let mut body = BytesMut::new();
        while let Some(chunk) = response
            .chunk()
            .await
            .map_err(|e| retryable(format!("poster {url}: reading the body: {}", describe(&e))))?
        {
            if (body.len() + chunk.len()) as u64 > self.max_bytes {
                return Err(DownloadError::Permanent(format!(
                    "poster {url}: the body is over the {} byte cap (REELAY_MEDIA_MAX_BYTES); nothing stored",
                    self.max_bytes
                )));
            }
            body.extend_from_slice(&chunk);
        }
        let bytes = body.freeze();
        let content_type = check_image(&bytes).map_err(|reason| {
            DownloadError::Permanent(format!("poster {url} (Content-Type {declared}): {reason}; nothing stored"))
        })?;
        Ok(Poster { bytes, content_type })
    }
}

/// The reason of a reqwest error, with its cause (a timeout says so).
fn describe(error: &reqwest::Error) -> String {
    let mut message = if error.is_timeout() { format!("timed out: {error}") } else { error.to_string() };
    let mut source = std::error::Error::source(error);
    while let Some(cause) = source {
        message.push_str(&format!(": {cause}"));
        source = cause.source();
    }
    message
}

/// A `Retry-After` value: delay seconds or an HTTP date.
fn retry_after(value: &str) -> Option<Duration> {
    let value = value.trim();
    if let Ok(seconds) = value.parse::<u64>() {
        return Some(Duration::from_secs(seconds));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(at.duration_since(std::time::SystemTime::now()).unwrap_or(Duration::ZERO))
}

#[async_trait::async_trait]
impl Handler for PosterSync {
    fn name(&self) -> &'static str {
        "poster-sync"
    }

    fn event_types(&self) -> &'static [&'static str] {
        &["MovieEnriched"]
    }

    async fn handle(&self, event: &v1::Event) -> Result<(), HandlerError> {
        let Some(Payload::MovieEnriched(enriched)) = &event.payload else { return Ok(()) };
        let Some(url) = enriched.profile.as_ref().map(|p| p.poster_url.as_str()).filter(|u| !u.is_empty()) else {
            return Ok(());
        };
        let movie_id = enriched.movie_id.as_str();
        // Its turn on the movie's objects, before it reads what is recorded of them.
        let _turn = crate::lock_movie(movie_id).await;
        let request = v1::GetMovieRequest { movie_id: movie_id.to_owned() };
        let movie = match self.movies.clone().get_movie(request).await {
            Ok(movie) => movie.into_inner(),
            // Deleted since: nothing to store, and nothing an earlier attempt stored may stay.
            Err(status) if status.code() == Code::NotFound => {
                return crate::remove_movie_images(&self.objects, movie_id).await.map(drop);
            }
            Err(status) => return Err(HandlerError::from_call("GetMovie", &status)),
        };
        // The profile is written with its event, so one naming another poster (or none) is
        // newer than this event: a late delivery of an older enrichment must not bring its
        // poster back over the current one. (An object an earlier try of this event stored and
        // never recorded may stay: its note names this URL, so the newer poster's sync does not
        // take it for its own.)
        let recorded = movie.poster_sizes.iter().any(|s| s == "original");
        if movie.profile.as_ref().map(|p| p.poster_url.as_str()) != Some(url) {
            tracing::info!(movie_id, url, "the movie's profile names another poster since; this event's is not stored");
            return Ok(());
        }
        if recorded && movie.poster_source_url == url {
            tracing::debug!(movie_id, url, "poster already recorded; skipping");
            return Ok(());
        }
        let key = original_key(movie_id);
        // The object is there with a note naming this URL, and the record names another poster
        // or none: an earlier try stored it and stopped before RecordPoster (a crash, the
        // write service down past its attempts). Record what was stored rather than download
        // again, which may no longer pass: the record would go on naming the poster it
        // replaced, whose variants that try deleted.
        let found = self.stored_from(movie_id, url).await?;
        let poster = match found {
            Some(poster) => poster,
            None => {
                let poster = self.download(url).await?;
                if self.stored(&key).await?.is_some_and(|stored| stored.bytes == poster.bytes) {
                    // The bytes stored already (the same poster from a new URL: another host, a
                    // cache-busting query): the stored poster and its variants stay, and where
                    // it came from is recorded. Never deleted and written again, which would
                    // lose variants a record of the same digest keeps listing.
                    tracing::info!(movie_id, url, "the poster downloaded is the one stored; keeping it");
                } else {
                    // A new poster: every variant under the movie's prefix is stale (the
                    // recorded ones, and any written and never recorded: a conversion that
                    // failed half-way, another width setting), and conversion probes their keys,
                    // so they go first.
                    let folder = crate::movie_folder(movie_id);
                    for stale in self.objects.list(&folder).await.map_err(crate::store_failed)? {
                        if stale != key {
                            self.objects.delete(&stale).await.map_err(crate::store_failed)?;
                        }
                    }
                    self.objects.put(&key, poster.bytes.clone()).await.map_err(crate::store_failed)?;
                    let note = Bytes::from(url.to_owned());
                    self.objects.put(&source_key(movie_id), note).await.map_err(crate::store_failed)?;
                    if reelay_kit::failpoint_armed("poster_sync_after_put") {
                        tracing::error!("failpoint poster_sync_after_put: aborting before RecordPoster");
                        std::process::abort();
                    }
                }
                poster
            }
        };
        self.record(event, movie_id, &key, url, &poster).await?;
        // Recorded: the movie's source URL says where it came from now. A crash before this
        // delete leaves a note naming the recorded URL (read only for another one), and the
        // next new poster's clearing of stale keys removes it; a retry that finds the bytes
        // stored comes here too.
        self.objects.delete(&source_key(movie_id)).await.map_err(crate::store_failed)
    }
}

impl PosterSync {
    /// Records `poster`, stored under `key`, as the movie's poster from `url`.
    async fn record(
        &self,
        event: &v1::Event,
        movie_id: &str,
        key: &str,
        url: &str,
        poster: &Poster,
    ) -> Result<(), HandlerError> {
        let sha256 = sha256_hex(&poster.bytes);
        let request = v1::RecordPosterRequest {
            movie_id: movie_id.to_owned(),
            key: key.to_owned(),
            content_type: poster.content_type.to_owned(),
            size_bytes: poster.bytes.len() as u64,
            // The event and the bytes: a retry that downloaded other bytes (the host changed the
            // image in between) is a new request, not a clash with the first under one id.
            request_id: format!("poster:{}:{}", event.event_id, &sha256[..16]),
            sha256,
            source_url: url.to_owned(),
        };
        match self.movies.clone().record_poster(request).await {
            Ok(recorded) => {
                let recorded = recorded.into_inner();
                tracing::info!(movie_id, %key, changed = recorded.changed, bytes = poster.bytes.len(), "poster stored");
                Ok(())
            }
            // Deleted while the poster was downloaded or written: image cleanup (on
            // MovieDeleted) may have run before the write, so the object goes here.
            Err(status) if status.code() == Code::NotFound => {
                tracing::info!(movie_id, %key, "the movie was deleted meanwhile; its poster is removed");
                crate::remove_movie_images(&self.objects, movie_id).await.map(drop)
            }
            Err(status) => Err(HandlerError::from_call("RecordPoster", &status)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A poster-sync whose download client reaches private addresses only when `allowed`
    /// (its write service and objects are never used by a download).
    fn sync_with(allowed: bool, dir: &std::path::Path) -> PosterSync {
        let write = reelay_kit::client::connect_lazy("http://127.0.0.1:1", None, Duration::from_secs(1)).unwrap();
        let objects = Objects::open(&Default::default(), dir).unwrap();
        let http = download_client(Duration::from_secs(5), allowed).unwrap();
        PosterSync::new(http, 1024, allowed, MoviesClient::new(write), objects)
    }

    /// A listener on loopback that counts the connections it gets and answers each 404.
    async fn counting_listener() -> (std::net::SocketAddr, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
        use std::sync::atomic::Ordering;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let count = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = count.clone();
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                counted.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    use tokio::io::{AsyncReadExt, AsyncWriteExt};
                    let mut buffer = [0; 4096];
                    let _ = stream.read(&mut buffer).await;
                    let _ = stream.write_all(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n").await;
                });
            }
        });
        (addr, count)
    }

    #[test]
    fn ip_literals_of_private_addresses_are_found() {
        for (url, private) in [
            ("http://127.0.0.1:8080/p.jpg", true),
            ("http://169.254.169.254/latest/meta-data", true),
            ("http://[::1]/p.jpg", true),
            ("http://[::ffff:10.0.0.1]/p.jpg", true),
            ("https://1.1.1.1/p.jpg", false),
            ("https://image.tmdb.org/t/p/w500/p.jpg", false),
        ] {
            assert_eq!(private_host(&reqwest::Url::parse(url).unwrap()).is_some(), private, "{url}");
        }
    }

    /// Without leave, neither an address nor a name of loopback is connected to, and the
    /// download fails for good saying why; with it, both are reached.
    #[tokio::test]
    async fn private_addresses_are_downloaded_from_only_when_allowed() {
        use std::sync::atomic::Ordering;
        let dir = tempfile::tempdir().unwrap();
        let (addr, connections) = counting_listener().await;
        let urls =
            [format!("http://127.0.0.1:{}/p.jpg", addr.port()), format!("http://localhost:{}/p.jpg", addr.port())];
        let strict = sync_with(false, dir.path());
        for url in &urls {
            match strict.download_once(url).await {
                Err(DownloadError::Permanent(message)) => {
                    assert!(message.contains("is not a public address"), "{url}: {message}")
                }
                Err(DownloadError::Retryable { message, .. }) => panic!("{url}: retryable: {message}"),
                Ok(_) => panic!("{url}: downloaded"),
            }
        }
        assert_eq!(connections.load(Ordering::SeqCst), 0, "nothing was connected to");
        let allowed = sync_with(true, dir.path());
        for url in &urls {
            match allowed.download_once(url).await {
                Err(DownloadError::Permanent(message)) => assert!(message.contains("404"), "{url}: {message}"),
                _ => panic!("{url}: the listener answers 404"),
            }
        }
        assert_eq!(connections.load(Ordering::SeqCst), 2);
    }

    /// A listener on loopback answering every request with `head` (status line and headers)
    /// and `body`; returns the base URL.
    async fn answering(head: &'static str, body: &'static [u8]) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                tokio::spawn(async move {
                    use tokio::io::{AsyncReadExt, AsyncWriteExt};
                    let mut buffer = [0; 4096];
                    let _ = stream.read(&mut buffer).await;
                    let head = format!("{head}\r\ncontent-length: {}\r\n\r\n", body.len());
                    let _ = stream.write_all(head.as_bytes()).await;
                    let _ = stream.write_all(body).await;
                });
            }
        });
        format!("http://{addr}")
    }

    /// What each answer of a poster host becomes: an image typed generically (or not at all) is
    /// judged by its bytes, a page is not one, a 408 passes on a retry, a redirect loop never
    /// does, and a 429 asking for longer than this handler waits is left to the runtime's retry.
    #[tokio::test]
    async fn answers_are_classified_by_what_a_retry_can_change() {
        const JPEG: &[u8] = &[0xFF, 0xD8, 0xFF, 0xE0, 0, 0, 0, 0, 0xFF, 0xD9];
        let dir = tempfile::tempdir().unwrap();
        let sync = sync_with(true, dir.path());
        for head in ["HTTP/1.1 200 OK\r\ncontent-type: application/octet-stream", "HTTP/1.1 200 OK"] {
            let poster = sync.download_once(&answering(head, JPEG).await).await;
            assert!(matches!(poster, Ok(Poster { content_type: "image/jpeg", .. })), "{head}");
        }
        let page = answering("HTTP/1.1 200 OK\r\ncontent-type: text/html", JPEG).await;
        assert!(matches!(sync.download_once(&page).await, Err(DownloadError::Permanent(m)) if m.contains("text/html")));
        let slow = answering("HTTP/1.1 408 Request Timeout", b"").await;
        assert!(matches!(sync.download_once(&slow).await, Err(DownloadError::Retryable { .. })));
        let looping = answering("HTTP/1.1 302 Found\r\nlocation: /again", b"").await;
        match sync.download_once(&looping).await {
            Err(DownloadError::Permanent(message)) => assert!(message.contains("redirects"), "{message}"),
            _ => panic!("a redirect loop is a permanent failure"),
        }
        let later = answering("HTTP/1.1 429 Too Many Requests\r\nretry-after: 30", b"").await;
        let answer = tokio::time::timeout(Duration::from_secs(15), sync.download(&later)).await;
        assert!(matches!(answer, Ok(Err(HandlerError::Retryable(_)))), "not waited out here");
    }

    #[test]
    fn retry_after_takes_seconds_or_a_date() {
        assert_eq!(retry_after("3"), Some(Duration::from_secs(3)));
        assert_eq!(retry_after("Thu, 01 Jan 1970 00:00:00 GMT"), Some(Duration::ZERO));
        assert_eq!(retry_after("soon"), None);
    }
}
