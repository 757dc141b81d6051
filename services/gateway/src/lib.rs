//! The ActivityPub gateway: the public HTTP side of federation.
//!
//! It serves WebFinger, NodeInfo, each local user as a `Person` (with its public key), the
//! user's outbox (its reviews as `Create` activities, in pages), its followers collection and
//! its review notes; and it takes in activities at the per-user and shared inboxes. An inbox
//! request is checked before anything is written: its size, its HTTP signature (fetching and
//! caching the signer's key), its digest and date, then its JSON and what it claims; accepted
//! activities go to the write service's `Federation` API.
//!
//! It owns nothing durable (a cache of remote keys in memory) and never holds a private key.

mod inbox;
mod public;
mod remote_keys;

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use reelay_activitypub::Urls;
use reelay_activitypub::client::FederationClient;
use reelay_contracts::v1::federation_client::FederationClient as WriteFederation;
use reelay_contracts::v1::movies_client::MoviesClient;
use reelay_contracts::v1::reviews_client::ReviewsClient;
use reelay_kit::client::ServiceChannel;
use tokio::net::TcpListener;

use crate::remote_keys::RemoteKeys;

/// How the gateway runs.
#[derive(Debug, Clone)]
pub struct GatewayConfig {
    /// The public origin every id is built on.
    pub urls: Urls,
    /// Largest inbox body accepted (413 above it).
    pub max_body_bytes: usize,
    /// Deadline of a key fetch.
    pub fetch_timeout: Duration,
    /// How long a fetched key is trusted before it is fetched again.
    pub key_ttl: Duration,
    /// Whether key fetches may reach loopback and private addresses.
    pub allow_private: bool,
}

#[derive(Clone)]
struct Gateway {
    config: Arc<GatewayConfig>,
    federation: WriteFederation<ServiceChannel>,
    reviews: ReviewsClient<ServiceChannel>,
    movies: MoviesClient<ServiceChannel>,
    keys: RemoteKeys,
}

/// Serves the gateway on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: TcpListener,
    config: GatewayConfig,
    write: ServiceChannel,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let http = FederationClient::new(config.fetch_timeout, 1024 * 1024, config.allow_private)
        .map_err(std::io::Error::other)?;
    let gateway = Gateway {
        keys: RemoteKeys::new(http, config.key_ttl),
        federation: WriteFederation::new(write.clone()),
        reviews: ReviewsClient::new(write.clone()),
        movies: MoviesClient::new(write),
        config: Arc::new(config.clone()),
    };
    let app = Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/.well-known/webfinger", get(public::webfinger))
        .route("/.well-known/nodeinfo", get(public::nodeinfo_links))
        .route("/nodeinfo/2.0", get(public::nodeinfo))
        .route("/{profile}", get(public::profile))
        .route("/users/{id}", get(public::actor))
        .route("/users/{id}/outbox", get(public::outbox))
        .route("/users/{id}/followers", get(public::followers))
        .route("/users/{id}/reviews/{review_id}", get(public::note))
        .route("/users/{id}/reviews/{review_id}/activity", get(public::note_create))
        .route("/users/{id}/inbox", post(inbox::user_inbox))
        .route("/inbox", post(inbox::shared_inbox))
        .layer(DefaultBodyLimit::max(config.max_body_bytes))
        .with_state(gateway);
    tracing::info!(addr = ?listener.local_addr().ok(), public_url = config.urls.base(), "gateway serving");
    reelay_kit::http::serve(listener, app, reelay_kit::http::HttpLimits::default(), shutdown).await
}

/// A JSON document with its media type.
fn json(media_type: &'static str, value: serde_json::Value) -> Response {
    let mut response = value.to_string().into_response();
    response.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static(media_type));
    response
}

fn activity_json(value: serde_json::Value) -> Response {
    json(reelay_activitypub::ACTIVITY_JSON, value)
}

/// An error answer: a status and a short reason.
fn refuse(status: StatusCode, reason: impl std::fmt::Display) -> Response {
    (status, reason.to_string()).into_response()
}

/// What a failed write-service call becomes over HTTP.
fn from_status(status: &tonic::Status) -> Response {
    use tonic::Code;
    let http = match status.code() {
        Code::NotFound => StatusCode::NOT_FOUND,
        Code::InvalidArgument => StatusCode::BAD_REQUEST,
        Code::PermissionDenied => StatusCode::FORBIDDEN,
        Code::Unavailable | Code::DeadlineExceeded | Code::ResourceExhausted | Code::Cancelled => {
            StatusCode::SERVICE_UNAVAILABLE
        }
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    };
    if !http.is_server_error() {
        return refuse(http, status.message());
    }
    // What went wrong inside (a storage error, a recovery in progress) is for this log, not
    // for whoever asked.
    tracing::warn!(code = ?status.code(), message = status.message(), "write service call failed");
    match http {
        StatusCode::SERVICE_UNAVAILABLE => refuse(http, "the service is unavailable for now; try again later"),
        _ => refuse(http, "internal error"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn answer(status: tonic::Status) -> (StatusCode, String) {
        let response = from_status(&status);
        let code = response.status();
        let body = axum::body::to_bytes(response.into_body(), 1024).await.unwrap();
        (code, String::from_utf8(body.to_vec()).unwrap())
    }

    /// A refusal keeps the write service's reason (it names the field); a failure inside does
    /// not pass its detail (a storage error, a path) to whoever asked.
    #[tokio::test]
    async fn failures_inside_are_not_told_to_the_caller() {
        let refused = answer(tonic::Status::invalid_argument("max_id: not a page token")).await;
        assert_eq!(refused, (StatusCode::BAD_REQUEST, "max_id: not a page token".to_owned()));
        for (status, code) in [
            (tonic::Status::unavailable("database unavailable: /srv/reelay/reelay.db: disk I/O error"), 503),
            (tonic::Status::internal("database storage error (SqliteError code 10)"), 500),
        ] {
            let (got, body) = answer(status).await;
            assert_eq!(got.as_u16(), code);
            assert!(!body.contains("database") && !body.contains("/srv"), "{body}");
        }
    }
}
