//! The limits of stored posters, shared by the write API (which refuses what is outside them in
//! `Movies.RecordPoster` and `Movies.RecordPosterVariants`) and the media handlers (which work
//! within them, and check their settings against them at start).

/// The content types a stored original may have.
pub const CONTENT_TYPES: &[&str] = &["image/jpeg", "image/png", "image/webp"];
/// The largest stored poster or variant, in bytes (poster-sync's default download cap).
pub const MAX_BYTES: u64 = 20 * 1024 * 1024;
/// Most variants one poster has.
pub const MAX_VARIANTS: usize = 16;
/// The widest variant, in pixels.
pub const MAX_VARIANT_WIDTH: u32 = 4096;
