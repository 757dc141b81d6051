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

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use reelay_contracts::v1::{self, event::Payload, movies_client::MoviesClient};
use reelay_delivery::{Handler, HandlerError};
use reelay_kit::client::ServiceChannel;
use reelay_objects::Objects;
use reqwest::StatusCode;
use tonic::Code;

use crate::{check_image, original_key, sha256_hex};

/// How often one download waits out a 429 before giving up for now.
const RATE_LIMIT_RETRIES: u32 = 3;
const MAX_RATE_LIMIT_WAIT: Duration = Duration::from_secs(60);

/// Downloads a film's poster into object storage and records it.
pub struct PosterSync {
    http: reqwest::Client,
    max_bytes: u64,
    movies: MoviesClient<ServiceChannel>,
    objects: Objects,
}

impl PosterSync {
    pub fn new(http: reqwest::Client, max_bytes: u64, movies: MoviesClient<ServiceChannel>, objects: Objects) -> Self {
        Self { http, max_bytes, movies, objects }
    }
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
        let Some(object) = self.objects.get(key).await.map_err(HandlerError::retryable)? else { return Ok(None) };
        match check_image(&object.bytes) {
            Ok(content_type) => Ok(Some(Poster { bytes: object.bytes, content_type })),
            Err(reason) => {
                tracing::warn!(key, %reason, "a stored poster is unusable; downloading again");
                Ok(None)
            }
        }
    }

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
            Err(status) => return Err(HandlerError::from_call("GetMovie", &status)),
        };
        // The profile is written with its event, so one naming another poster (or none) is
        // newer than this event: a late delivery of an older enrichment must not bring its
        // poster back over the current one.
        if movie.profile.as_ref().map(|p| p.poster_url.as_str()) != Some(url) {
            tracing::info!(movie_id, url, "the movie's profile names another poster since; this event's is not stored");
            return Ok(());
        }
        let recorded = movie.poster_sizes.iter().any(|s| s == "original");
        if recorded && movie.poster_source_url == url {
            tracing::debug!(movie_id, url, "poster already recorded; skipping");
            return Ok(());
        }
        let key = original_key(movie_id);
        // Nothing recorded yet but the object is there: a crash after the write and before
        // RecordPoster. Record what was stored rather than downloading again.
        let found = if recorded { None } else { self.stored(&key).await? };
        let poster = match found {
            Some(poster) => poster,
            None => {
                let poster = self.download(url).await?;
                // A new poster: every variant under the movie's prefix is stale (the recorded
                // ones, and any written and never recorded: a conversion that failed half-way,
                // another width setting), and conversion probes their keys, so they go first.
                let prefix = format!("posters/{movie_id}");
                for stale in self.objects.list(&prefix).await.map_err(HandlerError::retryable)? {
                    if stale != key {
                        self.objects.delete(&stale).await.map_err(HandlerError::retryable)?;
                    }
                }
                self.objects.put(&key, poster.bytes.clone()).await.map_err(HandlerError::retryable)?;
                if reelay_kit::failpoint_armed("poster_sync_after_put") {
                    tracing::error!("failpoint poster_sync_after_put: aborting before RecordPoster");
                    std::process::abort();
                }
                poster
            }
        };
        let sha256 = sha256_hex(&poster.bytes);
        let request = v1::RecordPosterRequest {
            movie_id: movie_id.to_owned(),
            key: key.clone(),
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
            // Deleted since: image cleanup (on MovieDeleted) removes the object.
            Err(status) if status.code() == Code::NotFound => Ok(()),
            Err(status) => Err(HandlerError::from_call("RecordPoster", &status)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_takes_seconds_or_a_date() {
        assert_eq!(retry_after("3"), Some(Duration::from_secs(3)));
        assert_eq!(retry_after("Thu, 01 Jan 1970 00:00:00 GMT"), Some(Duration::ZERO));
        assert_eq!(retry_after("soon"), None);
    }
}
