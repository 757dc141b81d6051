//! Real poster images for media tests, made here: a picture with gradients and detail (so a
//! JPEG of it is a few tens of kilobytes, as a real poster's is), encoded as JPEG or PNG by the
//! `image` crate's encoders.

use image::{ExtendedColorType, ImageEncoder, RgbImage};

/// A `width`×`height` RGB picture: gradients, stripes and a little noise.
fn picture(width: u32, height: u32) -> RgbImage {
    let mut state: u32 = 0x9E37_79B9;
    RgbImage::from_fn(width, height, |x, y| {
        state ^= state << 13;
        state ^= state >> 17;
        state ^= state << 5;
        let noise = (state & 0x1F) as u8;
        let stripe = if (x / 24 + y / 36) % 2 == 0 { 40 } else { 0 };
        image::Rgb([
            ((x * 200 / width) as u8).saturating_add(noise),
            ((y * 200 / height) as u8).saturating_add(stripe),
            (((x + y) * 255 / (width + height)) as u8).saturating_add(noise / 2),
        ])
    })
}

/// A baseline JPEG (quality 85).
pub fn jpeg(width: u32, height: u32) -> Vec<u8> {
    let mut out = Vec::new();
    image::codecs::jpeg::JpegEncoder::new_with_quality(&mut out, 85)
        .write_image(&picture(width, height), width, height, ExtendedColorType::Rgb8)
        .expect("encode a JPEG");
    out
}

/// A PNG (RGB, 8 bits).
pub fn png(width: u32, height: u32) -> Vec<u8> {
    let mut out = Vec::new();
    image::codecs::png::PngEncoder::new(&mut out)
        .write_image(&picture(width, height), width, height, ExtendedColorType::Rgb8)
        .expect("encode a PNG");
    out
}

/// The width and height of an encoded image, and its format's name, by decoding it whole.
pub fn decoded_size(bytes: &[u8]) -> (u32, u32, String) {
    let format = image::guess_format(bytes).expect("a known image format");
    let image = image::load_from_memory_with_format(bytes, format).expect("the image decodes");
    (image.width(), image.height(), format!("{format:?}"))
}
