//! The media route: `GET /media/<key>` serves a stored object with the content type its
//! extension says, an `ETag` and `Last-Modified`, and caching for an hour, after which a client
//! asks again with `If-None-Match` (answered 304 while unchanged, from what the store says of
//! the object before any of its bytes are read; on S3 the GET's body is dropped unread). Not
//! longer: a key's object can change (a movie's new poster is stored under the same keys), and
//! a year-long `immutable` kept the old one in browsers and CDNs. The bytes are sent as they are
//! read: however many clients fetch large originals at once, none is held whole in memory.

use std::time::UNIX_EPOCH;

use axum::Router;
use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;

use futures_util::StreamExt;

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
    let reading = match objects.read(&key).await {
        Ok(Some(reading)) => reading,
        Ok(None) => return (StatusCode::NOT_FOUND, "no such object").into_response(),
        Err(ObjectsError::BadKey { .. }) => return (StatusCode::BAD_REQUEST, "not an object key").into_response(),
        Err(error) => {
            tracing::warn!(%error, %key, "cannot read an object for the media route");
            return (StatusCode::SERVICE_UNAVAILABLE, "object storage unavailable").into_response();
        }
    };
    let e_tag = format!(
        "\"{}\"",
        reading
            .e_tag
            .clone()
            .unwrap_or_else(|| {
                let secs = reading.modified.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
                format!("{secs:x}-{}", reading.size)
            })
            .trim_matches('"')
    );
    // (An HTTP date cannot say a time before 1970: none is sent for one.)
    let modified = (reading.modified >= UNIX_EPOCH).then(|| httpdate::fmt_http_date(reading.modified));
    let mut out = HeaderMap::new();
    out.insert(header::CACHE_CONTROL, HeaderValue::from_static(CACHE_CONTROL));
    if let Ok(value) = HeaderValue::from_str(&e_tag) {
        out.insert(header::ETAG, value);
    }
    if let Some(value) = modified.and_then(|m| HeaderValue::from_str(&m).ok()) {
        out.insert(header::LAST_MODIFIED, value);
    }
    // Answered from what the store says of the object, before any of its bytes are read.
    if unchanged(&headers, &e_tag) {
        return (StatusCode::NOT_MODIFIED, out).into_response();
    }
    let mut bytes = reading.bytes;
    let (kind, first) = match content_type(&key) {
        "application/octet-stream" => {
            // The first chunk says what the bytes are; it is sent first, then the rest as read.
            let first = match bytes.next().await.transpose() {
                Ok(first) => first,
                Err(error) => {
                    tracing::warn!(%error, %key, "cannot read an object for the media route");
                    return (StatusCode::SERVICE_UNAVAILABLE, "object storage unavailable").into_response();
                }
            };
            (first.as_deref().and_then(sniff).unwrap_or("application/octet-stream"), first)
        }
        kind => (kind, None),
    };
    out.insert(header::CONTENT_TYPE, HeaderValue::from_static(kind));
    out.insert(header::CONTENT_LENGTH, HeaderValue::from(reading.size));
    out.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    let body = Body::from_stream(futures_util::stream::iter(first.map(Ok)).chain(bytes));
    (out, body).into_response()
}

/// Whether the client's `If-None-Match` names `e_tag` (or is `*`): it holds this version.
fn unchanged(headers: &HeaderMap, e_tag: &str) -> bool {
    headers.get_all(header::IF_NONE_MATCH).iter().filter_map(|v| v.to_str().ok()).flat_map(|v| v.split(',')).any(
        |tag| {
            let tag = tag.trim();
            tag == "*" || tag.strip_prefix("W/").unwrap_or(tag) == e_tag
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A client holds this version when its If-None-Match names the tag, weak or strong, alone
    /// or in a list, or is `*`.
    #[test]
    fn if_none_match_names_the_version() {
        let asking = |values: &[&str]| {
            let mut headers = HeaderMap::new();
            for value in values {
                headers.append(header::IF_NONE_MATCH, HeaderValue::from_str(value).unwrap());
            }
            unchanged(&headers, "\"t\"")
        };
        for held in [&["\"t\""][..], &["W/\"t\""], &["\"a\", \"t\""], &["\"a\"", "\"t\""], &["*"]] {
            assert!(asking(held), "{held:?}");
        }
        for other in [&[][..], &["\"a\""], &["\"a\", W/\"b\""], &["t"]] {
            assert!(!asking(other), "{other:?}");
        }
    }

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
