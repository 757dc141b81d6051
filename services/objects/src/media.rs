//! The media route: `GET /media/<key>` serves a stored object with the content type its
//! extension says, an `ETag` and `Last-Modified`, and caching for an hour, after which a client
//! asks again with `If-None-Match` (answered 304 while unchanged). Not longer: a key's object
//! can change (a movie's new poster is stored under the same keys), and a year-long
//! `immutable` kept the old one in browsers and CDNs.

use axum::Router;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;

use crate::{Objects, ObjectsError};

/// How long a served object may be used without asking again (see the module's comment).
pub const CACHE_CONTROL: &str = "public, max-age=3600";

/// The router serving `objects` under `/media/`.
pub fn media_router(objects: Objects) -> Router {
    Router::new().route("/media/{*key}", get(serve)).with_state(objects)
}

/// The content type of a key, by its extension.
fn content_type(key: &str) -> &'static str {
    match key.rsplit_once('.').map(|(_, ext)| ext.to_ascii_lowercase()) {
        Some(ext) => match ext.as_str() {
            "svg" => "image/svg+xml",
            "webp" => "image/webp",
            "png" => "image/png",
            "jpg" | "jpeg" => "image/jpeg",
            "json" => "application/json",
            _ => "application/octet-stream",
        },
        // `posters/<id>/original` keeps the downloaded bytes as they came; sniff the common ones.
        None => "application/octet-stream",
    }
}

fn sniff(bytes: &[u8]) -> Option<&'static str> {
    match bytes {
        [0xFF, 0xD8, 0xFF, ..] => Some("image/jpeg"),
        [0x89, b'P', b'N', b'G', ..] => Some("image/png"),
        [b'R', b'I', b'F', b'F', _, _, _, _, b'W', b'E', b'B', b'P', ..] => Some("image/webp"),
        _ => None,
    }
}

async fn serve(State(objects): State<Objects>, Path(key): Path<String>, headers: HeaderMap) -> Response {
    let object = match objects.get(&key).await {
        Ok(Some(object)) => object,
        Ok(None) => return (StatusCode::NOT_FOUND, "no such object").into_response(),
        Err(ObjectsError::BadKey { .. }) => return (StatusCode::BAD_REQUEST, "not an object key").into_response(),
        Err(error) => {
            tracing::warn!(%error, %key, "cannot read an object for the media route");
            return (StatusCode::SERVICE_UNAVAILABLE, "object storage unavailable").into_response();
        }
    };
    let e_tag = format!(
        "\"{}\"",
        object
            .e_tag
            .clone()
            .unwrap_or_else(|| format!("{:x}-{}", object.modified_unix, object.bytes.len()))
            .trim_matches('"')
    );
    if headers.get(header::IF_NONE_MATCH).and_then(|v| v.to_str().ok()) == Some(e_tag.as_str()) {
        return StatusCode::NOT_MODIFIED.into_response();
    }
    let kind = match content_type(&key) {
        "application/octet-stream" => sniff(&object.bytes).unwrap_or("application/octet-stream"),
        kind => kind,
    };
    let mut response = object.bytes.into_response();
    let out = response.headers_mut();
    out.insert(header::CONTENT_TYPE, HeaderValue::from_static(kind));
    out.insert(header::CACHE_CONTROL, HeaderValue::from_static(CACHE_CONTROL));
    if let Ok(value) = HeaderValue::from_str(&e_tag) {
        out.insert(header::ETAG, value);
    }
    out.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_types() {
        assert_eq!(content_type("wrapups/x/card.svg"), "image/svg+xml");
        assert_eq!(content_type("posters/m/w92.webp"), "image/webp");
        assert_eq!(content_type("posters/m/original"), "application/octet-stream");
        assert_eq!(sniff(&[0xFF, 0xD8, 0xFF, 0xE0]), Some("image/jpeg"));
        let bad = |key: &str| matches!(Objects::path(key), Err(ObjectsError::BadKey { .. }));
        assert!(bad("a/../b") && bad("") && !bad("a/b.svg"));
    }
}
