//! `image-conversion` (on `ImageStored`): makes the webp variants of a stored poster, one per
//! configured width (aspect kept, never wider than the original), writes each under its exact key
//! `posters/<movie_id>/w<width>.webp`, then records them (`Movies.RecordPosterVariants`, which
//! raises `PosterConverted`).
//!
//! Exactly once, across redeliveries and crashes:
//! - the exact keys are probed first: a variant already stored is not made again (a retry after a
//!   crash half-way makes only the missing ones), and the record is a repeat that changes nothing;
//! - a missing original means done (the movie was deleted, or its poster replaced: the newer
//!   `ImageStored` brings its own conversion), and so does an original whose digest is no longer
//!   the event's (its bytes are not the ones this event stored);
//! - `RecordPosterVariants` answers FAILED_PRECONDITION when the recorded original changed in
//!   between, which is done for the same reason, and NOT_FOUND when the movie was deleted, whose
//!   images then go here (a cleanup may have run before these were stored);
//! - a conversion takes its turn on the movie's objects (the crate's doc), so a sync never
//!   replaces the original, nor a cleanup removes the folder, while it reads and writes.
//!
//! An original that does not decode (or is larger than the decoder's limits) is a permanent
//! failure naming the key; nothing is written for it.

use std::io::Cursor;
use std::sync::Arc;

use bytes::Bytes;
use image::{DynamicImage, ImageReader, Limits};
use reelay_contracts::v1::{self, event::Payload, movies_client::MoviesClient};
use reelay_delivery::{Handler, HandlerError};
use reelay_domain::posters::{MAX_VARIANT_WIDTH, MAX_VARIANTS};
use reelay_kit::client::ServiceChannel;
use reelay_objects::Objects;
use tonic::Code;

use crate::{original_key, sha256_hex, variant_key};

/// The widest and tallest poster decoded, and the memory the decoder may use for its pixels:
/// 32 million RGB pixels (a poster is a few million). (A hostile poster of a few hundred KB,
/// one colour at 12,000 x 12,000, was decoded into 432 MB before.)
const MAX_SIDE: u32 = 10_000;
const MAX_DECODE_BYTES: u64 = 96 * 1024 * 1024;

/// Conversions decoding at once in this process (two cores' worth; each batch in flight would
/// otherwise decode its own).
const CONVERSIONS: usize = 2;
static CONVERTING: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(CONVERSIONS);

/// The memory, in MiB, the conversions of this process may use at once, each taking what
/// [`decode_cost_mib`] says of its poster: the media handlers' 512 MiB less the rest of the
/// process. Two posters of a few million pixels convert side by side; a large one alone. (The
/// decoder's limits count its pixels only: a progressive JPEG of 5,600 x 5,600 at 4:4:4, 1.8
/// MB on disk, peaked at 282 MB decoding, and two at once with their resizes passed 512 MiB.)
const DECODE_BUDGET_MIB: u32 = 360;
static DECODE_MEMORY: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(DECODE_BUDGET_MIB as usize);

/// What converting a `width` x `height` poster into variants at most `widest` wide may take,
/// in MiB (at most the whole [`DECODE_BUDGET_MIB`]): its decoded pixels (at most
/// [`MAX_DECODE_BYTES`]), a progressive JPEG's coefficients (two bytes a sample, three samples a
/// pixel), and the first resize's buffer (`widest` x `height`, 16 bytes a pixel).
pub fn decode_cost_mib(width: u32, height: u32, widest: u32) -> u32 {
    let pixels = u64::from(width) * u64::from(height);
    let bytes = (pixels * 8).min(MAX_DECODE_BYTES) + pixels * 6 + u64::from(widest.min(width)) * u64::from(height) * 16;
    bytes.div_ceil(1 << 20).clamp(1, u64::from(DECODE_BUDGET_MIB)) as u32
}

/// The size an image's header gives, if it can be read.
fn dimensions(original: &[u8]) -> Option<(u32, u32)> {
    ImageReader::new(Cursor::new(original)).with_guessed_format().ok()?.into_dimensions().ok()
}

/// How a variant is encoded.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum WebpEncoding {
    /// libwebp's lossy encoder at this quality (0-100).
    Lossy { quality: f32 },
    /// The `image` crate's lossless encoder (pure Rust): the baseline the benchmark compares.
    Lossless,
}

impl WebpEncoding {
    /// Lossy at `quality`, which must be 0-100.
    pub fn lossy(quality: f32) -> anyhow::Result<Self> {
        anyhow::ensure!((0.0..=100.0).contains(&quality), "REELAY_MEDIA_WEBP_QUALITY must be 0-100, got {quality}");
        Ok(Self::Lossy { quality })
    }
}

/// One variant, encoded.
#[derive(Debug, Clone)]
pub struct Variant {
    pub width: u32,
    pub height: u32,
    pub bytes: Vec<u8>,
}

/// Decodes a stored original (JPEG, PNG or WebP, by its bytes), within the decoder's limits.
pub fn decode(original: &[u8]) -> Result<DynamicImage, String> {
    let mut reader = ImageReader::new(Cursor::new(original))
        .with_guessed_format()
        .map_err(|e| format!("cannot read the image: {e}"))?;
    let mut limits = Limits::default();
    limits.max_image_width = Some(MAX_SIDE);
    limits.max_image_height = Some(MAX_SIDE);
    limits.max_alloc = Some(MAX_DECODE_BYTES);
    reader.limits(limits);
    reader.decode().map_err(|e| format!("the image does not decode: {e}"))
}

/// The height of a `width`-pixel-wide variant of `image`, aspect kept (at least 1).
pub fn variant_height(image: &DynamicImage, width: u32) -> u32 {
    let height =
        (u64::from(image.height()) * u64::from(width) + u64::from(image.width()) / 2) / u64::from(image.width());
    height.max(1) as u32
}

/// The variants of `image` at each of `widths` not wider than it (aspect kept), encoded as webp.
pub fn make_variants(image: DynamicImage, widths: &[u32], encoding: WebpEncoding) -> Result<Vec<Variant>, String> {
    resized(image, widths).iter().map(|image| encode_variant(image, encoding)).collect()
}

/// One resized image, encoded as webp.
pub fn encode_variant(image: &DynamicImage, encoding: WebpEncoding) -> Result<Variant, String> {
    Ok(Variant { width: image.width(), height: image.height(), bytes: encode_webp(image, encoding)? })
}

/// `image` resized to each of `widths` not wider than it, aspect kept, narrowest first.
///
/// Widest first, each from the one before (the widest from the original): every step is a
/// small factor for the triangle filter, which costs well under half of filtering the original
/// down to each width (BENCHMARKS.md). Heights come from the original's aspect.
pub fn resized(image: DynamicImage, widths: &[u32]) -> Vec<DynamicImage> {
    let mut sizes: Vec<(u32, u32)> =
        widths.iter().filter(|&&w| w <= image.width()).map(|&w| (w, variant_height(&image, w))).collect();
    sizes.sort_unstable_by(|a, b| b.cmp(a));
    sizes.dedup();
    let mut variants: Vec<DynamicImage> = Vec::with_capacity(sizes.len());
    for (width, height) in sizes {
        let source = variants.last().unwrap_or(&image);
        variants.push(source.resize_exact(width, height, image::imageops::FilterType::Triangle));
    }
    variants.reverse();
    variants
}

fn encode_webp(image: &DynamicImage, encoding: WebpEncoding) -> Result<Vec<u8>, String> {
    let (width, height) = (image.width(), image.height());
    let alpha = image.color().has_alpha();
    match encoding {
        WebpEncoding::Lossy { quality } => {
            let pixels = if alpha { image.to_rgba8().into_raw() } else { image.to_rgb8().into_raw() };
            let encoder = if alpha {
                webp::Encoder::from_rgba(&pixels, width, height)
            } else {
                webp::Encoder::from_rgb(&pixels, width, height)
            };
            let encoded = encoder.encode_simple(false, quality).map_err(|e| format!("webp encoding failed: {e:?}"))?;
            Ok(encoded.to_vec())
        }
        WebpEncoding::Lossless => {
            let mut out = Vec::new();
            let encoder = image::codecs::webp::WebPEncoder::new_lossless(&mut out);
            if alpha {
                let pixels = image.to_rgba8();
                encoder.encode(&pixels, width, height, image::ExtendedColorType::Rgba8)
            } else {
                let pixels = image.to_rgb8();
                encoder.encode(&pixels, width, height, image::ExtendedColorType::Rgb8)
            }
            .map_err(|e| format!("webp encoding failed: {e}"))?;
            Ok(out)
        }
    }
}

/// Makes and records the webp variants of stored posters.
pub struct ImageConversion {
    widths: Arc<[u32]>,
    encoding: WebpEncoding,
    movies: MoviesClient<ServiceChannel>,
    objects: Objects,
}

impl ImageConversion {
    /// `widths` must be within what RecordPosterVariants takes (`reelay_domain::posters`).
    pub fn new(
        widths: &[u32],
        encoding: WebpEncoding,
        movies: MoviesClient<ServiceChannel>,
        objects: Objects,
    ) -> anyhow::Result<Self> {
        let mut sorted = widths.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        anyhow::ensure!(
            !sorted.is_empty()
                && sorted.len() <= MAX_VARIANTS
                && sorted.iter().all(|w| (1..=MAX_VARIANT_WIDTH).contains(w)),
            "REELAY_MEDIA_WIDTHS must list 1-{MAX_VARIANTS} widths of 1-{MAX_VARIANT_WIDTH} pixels, got {widths:?}"
        );
        Ok(Self { widths: sorted.into(), encoding, movies, objects })
    }

    /// The variants of the original (of digest `sha256`) stored under `key`, each already stored
    /// or made now; `None` when the original is gone or no longer that one.
    async fn variants(
        &self,
        movie_id: &str,
        key: &str,
        sha256: &str,
    ) -> Result<Option<Vec<v1::PosterVariant>>, HandlerError> {
        let mut variants = Vec::with_capacity(self.widths.len());
        let mut missing = Vec::new();
        for &width in self.widths.iter() {
            let variant_key = variant_key(movie_id, width);
            match self.objects.get(&variant_key).await.map_err(crate::store_failed)? {
                Some(found) => variants.push(recorded(width, variant_key, &found)),
                None => missing.push(width),
            }
        }
        if missing.is_empty() {
            return Ok(Some(variants));
        }
        let Some(original) = self.objects.get(key).await.map_err(crate::store_failed)? else {
            tracing::info!(movie_id, key, "the original is gone; nothing to convert");
            return Ok(None);
        };
        if sha256_hex(&original) != sha256 {
            tracing::info!(movie_id, key, "the original was replaced since; its own ImageStored converts it");
            return Ok(None);
        }
        let made = self.make(key, original, missing).await?;
        for variant in made {
            let variant_key = variant_key(movie_id, variant.width);
            let bytes = Bytes::from(variant.bytes);
            self.objects.put(&variant_key, bytes.clone()).await.map_err(crate::store_failed)?;
            if reelay_kit::failpoint_armed("image_conversion_after_put") {
                tracing::error!("failpoint image_conversion_after_put: aborting before the other variants");
                std::process::abort();
            }
            variants.push(recorded(variant.width, variant_key, &bytes));
        }
        variants.sort_by_key(|v| v.width);
        Ok(Some(variants))
    }

    /// Decodes the original and makes the `missing` variants not wider than it, off the async
    /// workers (this is the CPU-bound part). Every configured width is resized (each comes from
    /// the next wider one), so a variant made again is the same bytes as the first time.
    async fn make(&self, key: &str, original: Bytes, missing: Vec<u32>) -> Result<Vec<Variant>, HandlerError> {
        let (encoding, widths, key) = (self.encoding, Arc::clone(&self.widths), key.to_owned());
        let widest = widths.iter().copied().max().unwrap_or(0);
        // Unreadable: the decoder says why, within the whole budget.
        let cost = dimensions(&original).map_or(DECODE_BUDGET_MIB, |(w, h)| decode_cost_mib(w, h, widest));
        let converting = CONVERTING.acquire().await.expect("the semaphore is never closed");
        let memory = DECODE_MEMORY.acquire_many(cost).await.expect("the semaphore is never closed");
        tokio::task::spawn_blocking(move || {
            // Held by the conversion itself: should the handler's timeout drop this call, the
            // decode goes on (a blocking task cannot be cancelled), and its memory stays
            // counted until it ends, not handed to the next conversion at once.
            let _permits = (converting, memory);
            let failed = |reason: String| HandlerError::Permanent(format!("{key}: {reason}"));
            let image = decode(&original).map_err(failed)?;
            resized(image, &widths)
                .iter()
                .filter(|image| missing.contains(&image.width()))
                .map(|image| encode_variant(image, encoding).map_err(failed))
                .collect()
        })
        .await
        .map_err(|e| HandlerError::retryable(format!("the conversion task failed: {e}")))?
    }
}

/// A digest of what a RecordPosterVariants call records, for its request id: a retry that made
/// other bytes (the widths were reconfigured, say) is then a new request, not a clash with the
/// first under the same id.
fn digest_of(variants: &[v1::PosterVariant]) -> String {
    let listed: Vec<String> = variants.iter().map(|v| format!("{}={}", v.width, v.sha256)).collect();
    sha256_hex(listed.join(",").as_bytes())
}

fn recorded(width: u32, key: String, bytes: &[u8]) -> v1::PosterVariant {
    v1::PosterVariant { width, key, size_bytes: bytes.len() as u64, sha256: sha256_hex(bytes) }
}

#[async_trait::async_trait]
impl Handler for ImageConversion {
    fn name(&self) -> &'static str {
        "image-conversion"
    }

    fn event_types(&self) -> &'static [&'static str] {
        &["ImageStored"]
    }

    async fn handle(&self, event: &v1::Event) -> Result<(), HandlerError> {
        let Some(Payload::ImageStored(stored)) = &event.payload else { return Ok(()) };
        let movie_id = stored.movie_id.as_str();
        if stored.key != original_key(movie_id) {
            return Err(HandlerError::permanent(format!(
                "ImageStored names {:?}, not a movie's original poster; nothing converted",
                stored.key
            )));
        }
        let _turn = crate::lock_movie(movie_id).await;
        let Some(variants) = self.variants(movie_id, &stored.key, &stored.sha256).await? else { return Ok(()) };
        if variants.is_empty() {
            // Narrower than every configured width: the original is all there is.
            tracing::info!(movie_id, "the original is narrower than every variant width; none made");
            return Ok(());
        }
        let sizes: Vec<u32> = variants.iter().map(|v| v.width).collect();
        let request = v1::RecordPosterVariantsRequest {
            movie_id: movie_id.to_owned(),
            original_sha256: stored.sha256.clone(),
            request_id: format!("variants:{}:{}", event.event_id, &digest_of(&variants)[..16]),
            variants,
        };
        match self.movies.clone().record_poster_variants(request).await {
            Ok(reply) => {
                tracing::info!(movie_id, ?sizes, changed = reply.into_inner().changed, "poster variants stored");
                Ok(())
            }
            // Replaced by a newer original since: nothing of this event to record (the newer
            // one's sync cleared the variants before storing it, and its conversion makes them).
            Err(status) if status.code() == Code::FailedPrecondition => {
                tracing::info!(movie_id, reason = status.message(), "poster variants not recorded");
                Ok(())
            }
            // Deleted: image cleanup may have run before these variants were stored (another
            // process's; this one's waits its turn), so they go here, as poster-sync does.
            Err(status) if status.code() == Code::NotFound => {
                tracing::info!(movie_id, "the movie was deleted meanwhile; its images are removed");
                crate::remove_movie_images(&self.objects, movie_id).await.map(drop)
            }
            Err(status) => Err(HandlerError::from_call("RecordPosterVariants", &status)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use image::{ImageEncoder, RgbImage};

    fn poster(width: u32, height: u32) -> DynamicImage {
        DynamicImage::ImageRgb8(RgbImage::from_fn(width, height, |x, y| {
            image::Rgb([(x * 255 / width) as u8, (y * 255 / height) as u8, ((x ^ y) & 0xFF) as u8])
        }))
    }

    #[test]
    fn variants_keep_the_aspect_decode_as_webp_and_are_never_wider_than_the_original() {
        for encoding in [WebpEncoding::Lossy { quality: 80.0 }, WebpEncoding::Lossless] {
            // 1999 wide: 185 from the original, 92 from the 185 one, heights from the
            // original's aspect.
            let variants = make_variants(poster(1999, 2999), &[92, 185, 4000], encoding).unwrap();
            let sizes: Vec<(u32, u32)> = variants.iter().map(|v| (v.width, v.height)).collect();
            assert_eq!(sizes, [(92, 138), (185, 278)]);
            for variant in &variants {
                let decoded = image::load_from_memory_with_format(&variant.bytes, image::ImageFormat::WebP).unwrap();
                assert_eq!((decoded.width(), decoded.height()), (variant.width, variant.height));
            }
        }
        assert!(make_variants(poster(50, 75), &[92], WebpEncoding::Lossless).unwrap().is_empty());
    }

    #[test]
    fn a_png_original_decodes_and_garbage_is_a_reason() {
        let mut png = Vec::new();
        let image = poster(40, 60).to_rgb8();
        image::codecs::png::PngEncoder::new(&mut png)
            .write_image(&image, 40, 60, image::ExtendedColorType::Rgb8)
            .unwrap();
        assert_eq!(decode(&png).unwrap().width(), 40);
        assert!(decode(&png[..png.len() / 2]).unwrap_err().contains("does not decode"));
        assert!(decode(b"<html></html>").is_err());
    }

    /// A PNG that says it is `width` x `height` RGB (its pixel data cut off): what a decoder
    /// sizes its buffers by.
    fn png_claiming(width: u32, height: u32) -> Vec<u8> {
        let mut png = Vec::new();
        image::codecs::png::PngEncoder::new(&mut png)
            .write_image(&[0, 0, 0], 1, 1, image::ExtendedColorType::Rgb8)
            .unwrap();
        png[16..20].copy_from_slice(&width.to_be_bytes());
        png[20..24].copy_from_slice(&height.to_be_bytes());
        // The IHDR chunk's CRC-32, over its type and data.
        let mut crc = !0u32;
        for byte in &png[12..29] {
            crc ^= u32::from(*byte);
            for _ in 0..8 {
                crc = if crc & 1 == 1 { (crc >> 1) ^ 0xEDB8_8320 } else { crc >> 1 };
            }
        }
        png[29..33].copy_from_slice(&(!crc).to_be_bytes());
        png
    }

    /// A poster too large to decode within the media handlers' memory is refused before its
    /// pixels are allocated, whatever its size on the wire.
    /// Posters of a few million pixels convert two at a time within the budget; one as large as
    /// the decoder takes (the progressive JPEG that peaked at 282 MB decoding) converts alone.
    #[test]
    fn large_posters_convert_alone() {
        let poster = decode_cost_mib(2_000, 3_000, 500);
        assert!((50..=DECODE_BUDGET_MIB / 2).contains(&poster), "{poster} MiB");
        assert!(decode_cost_mib(5_600, 5_600, 500) > DECODE_BUDGET_MIB / 2);
        assert_eq!(decode_cost_mib(10_000, 10_000, 500), DECODE_BUDGET_MIB);
        assert_eq!(decode_cost_mib(1, 1, 500), 1);
        let png = png_claiming(3_000, 4_000);
        assert_eq!(dimensions(&png), Some((3_000, 4_000)), "read from the header, nothing decoded");
        assert_eq!(dimensions(b"<html>"), None);
    }

    #[test]
    fn a_poster_too_large_to_decode_is_refused_before_it_is_allocated() {
        for (width, height) in [(12_000, 12_000), (10_001, 10), (10, 10_001), (6_000, 6_000)] {
            let error = decode(&png_claiming(width, height)).unwrap_err();
            assert!(error.contains("limit"), "{width}x{height}: {error}");
        }
        // Within the limits it gets as far as the missing pixel data.
        let error = decode(&png_claiming(2_000, 3_000)).unwrap_err();
        assert!(!error.contains("limit"), "{error}");
    }

    #[test]
    fn the_quality_must_be_a_percentage() {
        assert!(WebpEncoding::lossy(80.0).is_ok());
        assert!(WebpEncoding::lossy(101.0).unwrap_err().to_string().contains("REELAY_MEDIA_WEBP_QUALITY"));
    }
}
