//! The media handlers, on object storage (`reelay-objects`), one key layout:
//!
//! - `posters/<movie_id>/original`: the poster as downloaded (JPEG, PNG or WebP);
//! - `posters/<movie_id>/w<width>.webp`: its variants, `width` pixels wide, aspect kept.
//!
//! `poster-sync` (on `MovieEnriched` with a poster URL) stores the original and records it
//! (`Movies.RecordPoster`: `PosterSynced` + `ImageStored`); `image-conversion` (on `ImageStored`)
//! makes the variants and records them (`Movies.RecordPosterVariants`: `PosterConverted`);
//! `image-cleanup` (on `MovieDeleted`) removes the movie's folder. Each is safe to run twice on
//! the same event and to crash at any point: see the module docs.
//!
//! The keys are a movie's, not a poster's, so the three take turns on a movie's folder: one
//! handler's work on a movie at a time in the process ([`lock_movie`]). Else two syncs of one
//! movie run side by side (the consumer runs batches at once) could delete what the other
//! stored, a late sync could overwrite a newer poster, and a conversion of a replaced original
//! or one racing a cleanup could leave variants behind. A deployment runs one media process per
//! object store (`reelay run`, and the one-replica media Deployment in `k8s/`); processes sharing
//! one store do not take turns.

mod cleanup;
pub mod convert;
mod sync;

use std::sync::Arc;
use std::time::Duration;

use reelay_contracts::v1::movies_client::MoviesClient;
use reelay_delivery::{BuiltHandler, HandlerContext};
use reelay_objects::Objects;

pub use cleanup::ImageCleanup;
pub use convert::{ImageConversion, WebpEncoding};
pub use sync::PosterSync;

/// The media handlers' settings.
#[derive(Debug, Clone, clap::Args)]
pub struct MediaSettings {
    /// How long one poster download may take, in milliseconds (100 ms to 10 minutes).
    #[arg(
        id = "media_timeout_ms",
        long = "media-timeout-ms",
        env = "REELAY_MEDIA_TIMEOUT_MS",
        default_value_t = 10_000,
        value_parser = clap::value_parser!(u64).range(100..=600_000)
    )]
    pub timeout_ms: u64,
    /// The largest poster downloaded, in bytes (a larger one is a permanent failure): 1 to
    /// 20971520, the default, which is the most RecordPoster takes.
    #[arg(
        id = "media_max_bytes",
        long = "media-max-bytes",
        env = "REELAY_MEDIA_MAX_BYTES",
        default_value_t = reelay_domain::posters::MAX_BYTES
    )]
    pub max_bytes: u64,
    /// The widths of the webp variants image conversion makes, in pixels (comma-separated).
    /// A width above the original's is not made (no upscaling).
    #[arg(
        id = "media_widths",
        long = "media-widths",
        env = "REELAY_MEDIA_WIDTHS",
        value_delimiter = ',',
        default_values_t = DEFAULT_WIDTHS.to_vec()
    )]
    pub widths: Vec<u32>,
    /// The lossy webp quality of the variants, 0-100 (higher is larger and sharper).
    #[arg(
        id = "media_webp_quality",
        long = "media-webp-quality",
        env = "REELAY_MEDIA_WEBP_QUALITY",
        default_value_t = DEFAULT_WEBP_QUALITY
    )]
    pub webp_quality: f32,
    /// Whether poster downloads (and the redirects they follow) may reach loopback, private and
    /// other non-public addresses. Off unless `REELAY_DEV`: a poster's URL comes from the
    /// enrichment provider's answer, and private addresses are this network's own services.
    #[arg(
        id = "media_allow_private",
        long = "media-allow-private",
        env = "REELAY_MEDIA_ALLOW_PRIVATE",
        value_parser = clap::builder::BoolishValueParser::new()
    )]
    pub allow_private: Option<bool>,
}

/// The standard poster widths (TMDB's w92, w185, w342 and w500).
pub const DEFAULT_WIDTHS: &[u32] = &[92, 185, 342, 500];
/// Lossy webp quality: see BENCHMARKS.md for what it costs and saves.
pub const DEFAULT_WEBP_QUALITY: f32 = 80.0;

impl Default for MediaSettings {
    fn default() -> Self {
        Self {
            timeout_ms: 10_000,
            max_bytes: reelay_domain::posters::MAX_BYTES,
            widths: DEFAULT_WIDTHS.to_vec(),
            webp_quality: DEFAULT_WEBP_QUALITY,
            allow_private: None,
        }
    }
}

/// Waits for this process's turn on `movie_id`'s objects, held until the guard is dropped (see
/// the crate's doc).
pub(crate) async fn lock_movie(movie_id: &str) -> tokio::sync::OwnedMutexGuard<()> {
    type Locks = std::collections::HashMap<String, std::sync::Weak<tokio::sync::Mutex<()>>>;
    static LOCKS: std::sync::LazyLock<std::sync::Mutex<Locks>> = std::sync::LazyLock::new(Default::default);
    let lock = {
        let mut locks = LOCKS.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        // Movies no task holds or waits for are forgotten: the map holds those in flight.
        locks.retain(|_, lock| lock.strong_count() > 0);
        match locks.get(movie_id).and_then(std::sync::Weak::upgrade) {
            Some(lock) => lock,
            None => {
                let lock = Arc::new(tokio::sync::Mutex::new(()));
                locks.insert(movie_id.to_owned(), Arc::downgrade(&lock));
                lock
            }
        }
    };
    lock.lock_owned().await
}

/// The handlers of this crate, in registry order.
pub const NAMES: &[&str] = &["poster-sync", "image-conversion", "image-cleanup"];

/// The folder of a movie's images: every key of them starts with it.
pub fn movie_folder(movie_id: &str) -> String {
    format!("posters/{movie_id}")
}

/// A failed object store call: the store unavailable holds the handler's events until it
/// answers; another failure is retried later.
pub(crate) fn store_failed(error: reelay_objects::ObjectsError) -> reelay_delivery::HandlerError {
    let down = error.store_unavailable();
    reelay_delivery::HandlerError::retryable_or_unavailable(error, down)
}

/// Deletes every image of a deleted movie (a key already gone counts as deleted); how many.
pub(crate) async fn remove_movie_images(
    objects: &Objects,
    movie_id: &str,
) -> Result<usize, reelay_delivery::HandlerError> {
    use reelay_delivery::HandlerError;
    // Never a prefix wider than one movie's folder.
    if movie_id.is_empty() || !movie_id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_') {
        return Err(HandlerError::permanent(format!("no usable movie id to remove images of: {movie_id:?}")));
    }
    objects.delete_prefix(&movie_folder(movie_id)).await.map_err(store_failed)
}

/// The object key of a movie's downloaded poster.
pub fn original_key(movie_id: &str) -> String {
    format!("{}/original", movie_folder(movie_id))
}

/// The object key of a movie's poster variant `width` pixels wide.
pub fn variant_key(movie_id: &str, width: u32) -> String {
    format!("{}/w{width}.webp", movie_folder(movie_id))
}

/// Builds `poster-sync`, storing posters in `objects`.
pub fn build_poster_sync(
    settings: &MediaSettings,
    context: &HandlerContext,
    objects: Objects,
) -> anyhow::Result<BuiltHandler> {
    anyhow::ensure!(
        (1..=reelay_domain::posters::MAX_BYTES).contains(&settings.max_bytes),
        "REELAY_MEDIA_MAX_BYTES must be 1-{} (what RecordPoster takes), got {}",
        reelay_domain::posters::MAX_BYTES,
        settings.max_bytes
    );
    let allow_private = settings.allow_private.unwrap_or(false);
    let http = sync::download_client(Duration::from_millis(settings.timeout_ms), allow_private)
        .map_err(|e| anyhow::anyhow!("cannot build the poster download client: {e}"))?;
    let handler =
        PosterSync::new(http, settings.max_bytes, allow_private, MoviesClient::new(context.write.clone()), objects);
    Ok(BuiltHandler { handler: Arc::new(handler), grpc: None })
}

/// Builds `image-conversion`, reading and writing `objects`.
pub fn build_image_conversion(
    settings: &MediaSettings,
    context: &HandlerContext,
    objects: Objects,
) -> anyhow::Result<BuiltHandler> {
    let handler = ImageConversion::new(
        &settings.widths,
        WebpEncoding::lossy(settings.webp_quality)?,
        MoviesClient::new(context.write.clone()),
        objects,
    )?;
    Ok(BuiltHandler { handler: Arc::new(handler), grpc: None })
}

/// Builds `image-cleanup`, deleting from `objects`.
pub fn build_image_cleanup(objects: Objects) -> BuiltHandler {
    BuiltHandler { handler: Arc::new(ImageCleanup { objects }), grpc: None }
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
pub fn sha256_hex(bytes: &[u8]) -> String {
    ring::digest::digest(&ring::digest::SHA256, bytes).as_ref().iter().map(|b| format!("{b:02x}")).collect()
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
    fn digests_are_lower_hex() {
        assert_eq!(sha256_hex(b"abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    }

    /// Work on one movie takes turns; another movie's does not wait for it.
    #[tokio::test]
    async fn one_movie_at_a_time() {
        let held = lock_movie("turns-a").await;
        let same = tokio::spawn(async { lock_movie("turns-a").await });
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        assert!(!same.is_finished(), "the same movie waits for its turn");
        let other = tokio::time::timeout(std::time::Duration::from_secs(5), lock_movie("turns-b")).await;
        assert!(other.is_ok(), "another movie does not wait");
        drop(held);
        tokio::time::timeout(std::time::Duration::from_secs(5), same).await.expect("then it runs").unwrap();
    }

    #[test]
    fn keys_follow_the_documented_layout() {
        assert_eq!(original_key("m1"), "posters/m1/original");
        assert_eq!(variant_key("m1", 185), "posters/m1/w185.webp");
    }
}
