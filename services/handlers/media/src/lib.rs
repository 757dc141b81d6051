//! The media handlers (issue 11). So far: `poster-sync` and `image-cleanup`.
//!
//! `poster-sync` (on `MovieEnriched` with a poster URL) downloads the poster over HTTP (a
//! timeout, a size cap, a content-type check and a check of the bytes themselves), writes it to
//! `posters/<movie_id>/original` in object storage, then records it through the internal
//! `Movies.RecordPoster`, which raises `PosterSynced` and `ImageStored` in one transaction.
//!
//! Exactly once, across redeliveries and crashes:
//! - a poster already recorded from the same URL is skipped (no download, no write, no event);
//! - a crash after the object write and before `RecordPoster` is retried: the retry finds the
//!   object (no poster recorded yet), records it, and the events are raised once;
//! - `RecordPoster` carries a request id derived from the event, and a repeat of the same key and
//!   digest raises nothing anyway.
//!
//! Failures: a 404/410, another 4xx, a non-image (by `Content-Type` or by its bytes), a body over
//! the cap or a truncated JPEG/PNG are permanent, with the reason in the dead letter, and nothing
//! is written; a 5xx, a timeout or a connection error is retryable; a 429 is waited out as its
//! `Retry-After` says (a few times, up to a minute each), then retryable.

use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use reelay_contracts::v1::{self, event::Payload, movies_client::MoviesClient};
use reelay_delivery::{BuiltHandler, Handler, HandlerContext, HandlerError};
use reelay_kit::client::ServiceChannel;
use reelay_objects::Objects;
use reqwest::StatusCode;
use tonic::Code;

/// How often one download waits out a 429 before giving up for now.
const RATE_LIMIT_RETRIES: u32 = 3;
const MAX_RATE_LIMIT_WAIT: Duration = Duration::from_secs(60);

/// The media handlers' settings.
#[derive(Debug, Clone, clap::Args)]
pub struct MediaSettings {
    /// How long one poster download may take, in milliseconds.
    #[arg(
        id = "media_timeout_ms",
        long = "media-timeout-ms",
        env = "REELAY_MEDIA_TIMEOUT_MS",
        default_value_t = 10_000
    )]
    pub timeout_ms: u64,
    /// The largest poster downloaded, in bytes (a larger one is a permanent failure).
    #[arg(
        id = "media_max_bytes",
        long = "media-max-bytes",
        env = "REELAY_MEDIA_MAX_BYTES",
        default_value_t = 20 * 1024 * 1024
    )]
    pub max_bytes: u64,
}

impl Default for MediaSettings {
    fn default() -> Self {
        Self { timeout_ms: 10_000, max_bytes: 20 * 1024 * 1024 }
    }
}

/// The handlers of this crate, in registry order.
pub const NAMES: &[&str] = &["poster-sync", "image-cleanup"];

/// The object key of a movie's downloaded poster.
pub fn original_key(movie_id: &str) -> String {
    format!("posters/{movie_id}/original")
}

/// Builds `poster-sync`, storing posters in `objects`.
pub fn build_poster_sync(
    settings: &MediaSettings,
    context: &HandlerContext,
    objects: Objects,
) -> anyhow::Result<BuiltHandler> {
    reelay_objects::install_tls_provider();
    let http = reqwest::Client::builder()
        .timeout(Duration::from_millis(settings.timeout_ms))
        .user_agent(concat!("reelay/", env!("CARGO_PKG_VERSION")))
        .build()
        .map_err(|e| anyhow::anyhow!("cannot build the poster download client: {e}"))?;
    let handler =
        PosterSync { http, max_bytes: settings.max_bytes, movies: MoviesClient::new(context.write.clone()), objects };
    Ok(BuiltHandler { handler: Arc::new(handler), grpc: None })
}

/// Builds `image-cleanup`, deleting from `objects`.
pub fn build_image_cleanup(objects: Objects) -> BuiltHandler {
    BuiltHandler { handler: Arc::new(ImageCleanup { objects }), grpc: None }
}

/// `image-cleanup` (on `MovieDeleted`): deletes every key under `posters/<movie_id>/`; a key
/// already gone counts as deleted, so a redelivery is a no-op.
pub struct ImageCleanup {
    objects: Objects,
}

#[async_trait::async_trait]
impl Handler for ImageCleanup {
    fn name(&self) -> &'static str {
        "image-cleanup"
    }

    fn event_types(&self) -> &'static [&'static str] {
        &["MovieDeleted"]
    }

    async fn handle(&self, event: &v1::Event) -> Result<(), HandlerError> {
        let Some(Payload::MovieDeleted(deleted)) = &event.payload else { return Ok(()) };
        let id = deleted.movie_id.as_str();
        // Never a prefix wider than one movie's folder.
        if id.is_empty() || !id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_') {
            return Err(HandlerError::permanent(format!("MovieDeleted names no usable movie id: {id:?}")));
        }
        let prefix = format!("posters/{id}");
        let deleted = self.objects.delete_prefix(&prefix).await.map_err(HandlerError::retryable)?;
        tracing::info!(movie_id = id, deleted, "images of a deleted movie removed");
        Ok(())
    }
}

/// A failed call to the write service: transient failures are retried, refusals are not.
fn from_status(what: &str, status: tonic::Status) -> HandlerError {
    let message = format!("{what}: {:?}: {}", status.code(), status.message());
    match status.code() {
        Code::InvalidArgument | Code::FailedPrecondition | Code::PermissionDenied => HandlerError::Permanent(message),
        _ => HandlerError::Retryable(message),
    }
}

pub struct PosterSync {
    http: reqwest::Client,
    max_bytes: u64,
    movies: MoviesClient<ServiceChannel>,
    objects: Objects,
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
    /// Downloads `url`, waiting out a few 429s.
    async fn download(&self, url: &str) -> Result<Poster, HandlerError> {
        let mut tries = 0;
        loop {
            match self.download_once(url).await {
                Ok(poster) => return Ok(poster),
                Err(DownloadError::Retryable { after: Some(after), .. })
                    if tries < RATE_LIMIT_RETRIES && after <= MAX_RATE_LIMIT_WAIT =>
                {
                    tries += 1;
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
        let mut response =
            self.http.get(url).send().await.map_err(|e| retryable(format!("poster {url}: {}", describe(&e))))?;
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
            s if s.is_server_error() => return Err(retryable(format!("poster {url}: the host answered {s}"))),
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
        if !declared.starts_with("image/") {
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

/// The content type of a whole JPEG, PNG or WebP image, by its bytes; a reason otherwise
/// (an HTML page, a truncated file).
pub fn check_image(bytes: &[u8]) -> Result<&'static str, String> {
    const PNG_END: &[u8] = &[0, 0, 0, 0, b'I', b'E', b'N', b'D', 0xAE, 0x42, 0x60, 0x82];
    match bytes {
        [] => Err("an empty body".into()),
        [0xFF, 0xD8, 0xFF, ..] => {
            // A JPEG ends with its EOI marker (some encoders pad after it).
            let tail = &bytes[bytes.len().saturating_sub(64)..];
            if tail.windows(2).any(|w| w == [0xFF, 0xD9]) {
                Ok("image/jpeg")
            } else {
                Err(format!("a truncated JPEG ({} bytes, no end-of-image marker)", bytes.len()))
            }
        }
        [0x89, b'P', b'N', b'G', 0x0D, 0x0A, 0x1A, 0x0A, ..] => {
            if bytes.ends_with(PNG_END) {
                Ok("image/png")
            } else {
                Err(format!("a truncated PNG ({} bytes, no IEND chunk at the end)", bytes.len()))
            }
        }
        [b'R', b'I', b'F', b'F', a, b, c, d, b'W', b'E', b'B', b'P', ..] => {
            let declared = u32::from_le_bytes([*a, *b, *c, *d]) as usize + 8;
            if bytes.len() >= declared {
                Ok("image/webp")
            } else {
                Err(format!("a truncated WebP ({} of {declared} bytes)", bytes.len()))
            }
        }
        _ => Err("not a JPEG, PNG or WebP image".into()),
    }
}

/// Lower-case hex SHA-256.
fn sha256_hex(bytes: &[u8]) -> String {
    ring::digest::digest(&ring::digest::SHA256, bytes).as_ref().iter().map(|b| format!("{b:02x}")).collect()
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
        let request = v1::GetMovieRequest { movie_id: movie_id.to_owned() };
        let movie = match self.movies.clone().get_movie(request).await {
            Ok(movie) => movie.into_inner(),
            // Deleted since: nothing to store.
            Err(status) if status.code() == Code::NotFound => return Ok(()),
            Err(status) => return Err(from_status("GetMovie", status)),
        };
        let recorded = movie.poster_sizes.iter().any(|s| s == "original");
        if recorded && movie.poster_source_url == url {
            tracing::debug!(movie_id, url, "poster already recorded; skipping");
            return Ok(());
        }
        let key = original_key(movie_id);
        // Nothing recorded yet but the object is there: a crash after the write and before
        // RecordPoster. Record what was stored rather than downloading again.
        let found = if recorded {
            None
        } else {
            match self.objects.get(&key).await.map_err(HandlerError::retryable)? {
                Some(object) => match check_image(&object.bytes) {
                    Ok(content_type) => Some(Poster { bytes: object.bytes, content_type }),
                    Err(reason) => {
                        tracing::warn!(movie_id, %key, %reason, "a stored poster is unusable; downloading again");
                        None
                    }
                },
                None => None,
            }
        };
        let poster = match found {
            Some(poster) => poster,
            None => {
                let poster = self.download(url).await?;
                self.objects.put(&key, poster.bytes.clone()).await.map_err(HandlerError::retryable)?;
                if reelay_kit::failpoint_armed("poster_sync_after_put") {
                    tracing::error!("failpoint poster_sync_after_put: aborting before RecordPoster");
                    std::process::abort();
                }
                poster
            }
        };
        let request = v1::RecordPosterRequest {
            movie_id: movie_id.to_owned(),
            key: key.clone(),
            content_type: poster.content_type.to_owned(),
            size_bytes: poster.bytes.len() as u64,
            sha256: sha256_hex(&poster.bytes),
            source_url: url.to_owned(),
            request_id: format!("poster:{}", event.event_id),
        };
        match self.movies.clone().record_poster(request).await {
            Ok(recorded) => {
                let recorded = recorded.into_inner();
                tracing::info!(movie_id, %key, changed = recorded.changed, bytes = poster.bytes.len(), "poster stored");
                Ok(())
            }
            // Deleted since: image cleanup (on MovieDeleted) removes the object.
            Err(status) if status.code() == Code::NotFound => Ok(()),
            Err(status) => Err(from_status("RecordPoster", status)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn images_are_checked_by_their_bytes() {
        assert_eq!(check_image(&[0xFF, 0xD8, 0xFF, 0xE0, 1, 2, 0xFF, 0xD9]), Ok("image/jpeg"));
        assert!(check_image(&[0xFF, 0xD8, 0xFF, 0xE0, 1, 2, 3]).unwrap_err().contains("truncated JPEG"));
        let mut png = vec![0x89, b'P', b'N', b'G', 0x0D, 0x0A, 0x1A, 0x0A];
        assert!(check_image(&png).unwrap_err().contains("truncated PNG"));
        png.extend_from_slice(&[0, 0, 0, 0, b'I', b'E', b'N', b'D', 0xAE, 0x42, 0x60, 0x82]);
        assert_eq!(check_image(&png), Ok("image/png"));
        assert!(check_image(b"<!doctype html><html></html>").unwrap_err().contains("not a JPEG"));
        assert!(check_image(b"").is_err());
    }

    #[test]
    fn retry_after_takes_seconds_or_a_date() {
        assert_eq!(retry_after("3"), Some(Duration::from_secs(3)));
        assert_eq!(retry_after("Thu, 01 Jan 1970 00:00:00 GMT"), Some(Duration::ZERO));
        assert_eq!(retry_after("soon"), None);
    }

    #[test]
    fn digests_are_lower_hex() {
        assert_eq!(sha256_hex(b"abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    }
}
