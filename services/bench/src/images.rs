//! Scenario 8: poster conversion. The image-conversion handler's CPU work, in-process: decode a
//! poster-sized JPEG (2000×3000, what TMDB's `original` size is), then make the four standard
//! variants (92, 185, 342 and 500 px wide) with each webp encoder Reelay could use: libwebp's
//! lossy encoder (the default, quality 80) and the `image` crate's pure-Rust lossless encoder.
//!
//! Baseline, measured in the same run: decoding alone (what any conversion costs before it
//! makes anything), then decoding and resizing without encoding. Bytes per variant are compared
//! between the two encoders.

use std::time::Instant;

use reelay_harness::images::jpeg;
use reelay_media::convert::{WebpEncoding, decode, make_variants, resized};
use reelay_media::{DEFAULT_WEBP_QUALITY, DEFAULT_WIDTHS};

use crate::Bench;
use crate::report::Report;

const WIDTH: u32 = 2000;
const HEIGHT: u32 = 3000;

pub async fn conversion(b: &Bench, report: &mut Report) -> anyhow::Result<()> {
    eprintln!("poster conversion");
    let posters = b.posters;
    let original = tokio::task::spawn_blocking(|| jpeg(WIDTH, HEIGHT)).await?;
    let encodings = [
        ("lossy webp q80 (libwebp)", WebpEncoding::Lossy { quality: DEFAULT_WEBP_QUALITY }),
        ("lossless webp (image crate)", WebpEncoding::Lossless),
    ];
    let measured = tokio::task::spawn_blocking(move || -> anyhow::Result<_> {
        let started = Instant::now();
        for _ in 0..posters {
            decode(&original).map_err(anyhow::Error::msg)?;
        }
        let decoded = posters as f64 / started.elapsed().as_secs_f64();
        let started = Instant::now();
        for _ in 0..posters {
            let image = decode(&original).map_err(anyhow::Error::msg)?;
            anyhow::ensure!(resized(image, DEFAULT_WIDTHS).len() == DEFAULT_WIDTHS.len());
        }
        let resizes = posters as f64 / started.elapsed().as_secs_f64();
        let mut per_encoding = Vec::new();
        for (name, encoding) in encodings {
            let started = Instant::now();
            let mut bytes = vec![0usize; DEFAULT_WIDTHS.len()];
            for _ in 0..posters {
                let image = decode(&original).map_err(anyhow::Error::msg)?;
                let variants = make_variants(image, DEFAULT_WIDTHS, encoding).map_err(anyhow::Error::msg)?;
                for (i, variant) in variants.iter().enumerate() {
                    bytes[i] = variant.bytes.len();
                }
            }
            per_encoding.push((name, posters as f64 / started.elapsed().as_secs_f64(), bytes));
        }
        Ok((original.len(), decoded, resizes, per_encoding))
    })
    .await??;
    let (original_bytes, decoded, resizes, per_encoding) = measured;
    report.add(format!("decode a {WIDTH}x{HEIGHT} JPEG poster ({original_bytes} B)"), decoded, "img/s");
    report.add("decode + resize to the 4 widths, no encoding", resizes, "img/s").against("decode alone", decoded);
    for (name, rate, _) in &per_encoding {
        report.add(format!("4 variants, {name}"), *rate, "img/s").against("decode alone", decoded);
    }
    let (lossy, lossless) = (&per_encoding[0], &per_encoding[1]);
    for (i, width) in DEFAULT_WIDTHS.iter().enumerate() {
        report
            .add(format!("w{width} bytes, {}", lossy.0), lossy.2[i] as f64, "B")
            .against(format!("w{width} lossless"), lossless.2[i] as f64);
    }
    Ok(())
}
