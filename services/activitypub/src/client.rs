//! The outbound HTTP client of federation: hyper-util's pooled client over rustls (ring, the
//! system's roots), which tonic and async-nats already bring, with a deadline on every request
//! and a cap on what a response may bring back.
//!
//! The URLs it is given come from other servers (a signer's `keyId`, an actor's inbox, an
//! outbox's pages), so unless told otherwise it reaches only public addresses: an IP literal is
//! checked before anything is sent, and a name's addresses as it is resolved for the connection
//! (so a name cannot resolve to a public address for a check and a private one for the
//! connection). Loopback, private, link-local, shared and other special ranges are refused.
//!
//! Signing is the caller's: build an [`Outgoing`], have its [`Outgoing::signing_input`] signed
//! (by the write service, which holds the keys), attach the `Signature` header, send.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Method, Request, header};
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::connect::dns::Name;
use hyper_util::rt::TokioExecutor;
use reelay_domain::net::{not_public_in, private_literal, public_only};
use url::Url;

use crate::signature::{SIGNED_WITH_BODY, SIGNED_WITHOUT_BODY, digest_header};
use crate::{ACTIVITY_JSON, time};

const USER_AGENT: &str = concat!("Reelay/", env!("CARGO_PKG_VERSION"));

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FetchError {
    #[error("invalid URL {0:?}")]
    Url(String),
    #[error("no answer from {0} within the deadline")]
    Timeout(String),
    #[error("cannot reach {url}: {error}")]
    Connect { url: String, error: String },
    #[error("the answer from {0} is larger than allowed")]
    TooLarge(String),
    #[error("{url} answered {status}")]
    Status { url: String, status: u16 },
    #[error("{url} answered something that is not JSON: {error}")]
    NotJson { url: String, error: String },
    #[error("{0} is not a public address (REELAY_FEDERATION_ALLOW_PRIVATE allows private ones)")]
    NotPublic(String),
}

impl FetchError {
    /// Worth trying again later: the peer was unreachable, slow, or failing on its side. (A 401
    /// to a signed request may pass too, see [`Self::is_transient_when_signed`]; to an unsigned
    /// one it says the peer wants requests signed, and will go on saying so.)
    pub fn is_transient(&self) -> bool {
        match self {
            Self::Timeout(_) | Self::Connect { .. } => true,
            Self::Status { status, .. } => *status >= 500 || matches!(status, 408 | 429),
            _ => false,
        }
    }

    /// [`Self::is_transient`] for a signed request: a 401 too, as a server answers when it
    /// could not fetch the signer's key just then (Mastodon's own retries count it so).
    pub fn is_transient_when_signed(&self) -> bool {
        self.is_transient() || matches!(self, Self::Status { status: 401, .. })
    }
}

/// What a signer needs to sign one request (the write service's `SignHttpRequest` fields).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SigningInput {
    pub method: String,
    pub path: String,
    pub host: String,
    pub date: String,
    pub digest: Option<String>,
}

/// One request about to be sent.
#[derive(Debug, Clone)]
pub struct Outgoing {
    method: Method,
    url: Url,
    input: SigningInput,
    body: Option<Bytes>,
    signature: Option<String>,
}

impl Outgoing {
    /// A GET for an ActivityPub document.
    pub fn get(url: &str) -> Result<Self, FetchError> {
        Self::new(Method::GET, url, None)
    }

    /// A POST of an activity to an inbox.
    pub fn post(url: &str, body: Bytes) -> Result<Self, FetchError> {
        Self::new(Method::POST, url, Some(body))
    }

    fn new(method: Method, url: &str, body: Option<Bytes>) -> Result<Self, FetchError> {
        let parsed = Url::parse(url).map_err(|_| FetchError::Url(url.to_owned()))?;
        if !matches!(parsed.scheme(), "http" | "https") || parsed.host_str().is_none() {
            return Err(FetchError::Url(url.to_owned()));
        }
        let host = crate::documents::host_port(&parsed);
        let mut path = parsed.path().to_owned();
        if let Some(query) = parsed.query() {
            path = format!("{path}?{query}");
        }
        let input = SigningInput {
            method: method.as_str().to_owned(),
            path,
            host,
            date: time::http_date_now(),
            digest: body.as_deref().map(digest_header),
        };
        Ok(Self { method, url: parsed, input, body, signature: None })
    }

    pub fn signing_input(&self) -> &SigningInput {
        &self.input
    }

    /// The headers a signature over this request covers.
    pub fn signed_headers(&self) -> &'static str {
        if self.body.is_some() { SIGNED_WITH_BODY } else { SIGNED_WITHOUT_BODY }
    }

    /// Attaches the `Signature` header value.
    pub fn signed(mut self, signature_header: String) -> Self {
        self.signature = Some(signature_header);
        self
    }

    pub fn url(&self) -> &str {
        self.url.as_str()
    }
}

/// An answer: its status and (capped) body.
#[derive(Debug, Clone)]
pub struct Answer {
    pub status: u16,
    pub body: Bytes,
}

#[derive(Clone)]
pub struct FederationClient {
    http: Client<hyper_rustls::HttpsConnector<HttpConnector<Resolver>>, Full<Bytes>>,
    timeout: Duration,
    max_response_bytes: usize,
    allow_private: bool,
}

impl FederationClient {
    /// A client reaching only public addresses unless `allow_private` (a local test or
    /// development setup, whose peers are on loopback or a private network).
    pub fn new(timeout: Duration, max_response_bytes: usize, allow_private: bool) -> Result<Self, String> {
        let mut connector = HttpConnector::new_with_resolver(Resolver { allow_private });
        connector.enforce_http(false);
        let https = hyper_rustls::HttpsConnectorBuilder::new()
            .with_provider_and_native_roots(rustls::crypto::ring::default_provider())
            .map_err(|e| format!("cannot load the system's TLS roots: {e}"))?
            .https_or_http()
            .enable_http1()
            .wrap_connector(connector);
        let http = Client::builder(TokioExecutor::new()).pool_idle_timeout(Duration::from_secs(30)).build(https);
        Ok(Self { http, timeout, max_response_bytes, allow_private })
    }

    /// Sends the request and reads the answer, whatever its status.
    pub async fn send(&self, outgoing: Outgoing) -> Result<Answer, FetchError> {
        let url = outgoing.url.to_string();
        if let Some(ip) = outgoing.url.host_str().and_then(private_literal).filter(|_| !self.allow_private) {
            return Err(FetchError::NotPublic(ip.to_string()));
        }
        let mut request = Request::builder()
            .method(outgoing.method.clone())
            .uri(url.as_str())
            .header(header::HOST, &outgoing.input.host)
            .header(header::DATE, &outgoing.input.date)
            .header(header::USER_AGENT, USER_AGENT)
            .header(header::ACCEPT, format!("{ACTIVITY_JSON}, {}", crate::LD_JSON));
        if let Some(digest) = &outgoing.input.digest {
            request = request.header("digest", digest).header(header::CONTENT_TYPE, ACTIVITY_JSON);
        }
        if let Some(signature) = &outgoing.signature {
            let value = HeaderValue::from_str(signature).map_err(|_| FetchError::Url(url.clone()))?;
            request = request.header("signature", value);
        }
        let request =
            request.body(Full::new(outgoing.body.unwrap_or_default())).map_err(|_| FetchError::Url(url.clone()))?;
        let exchange = async {
            let response = self.http.request(request).await.map_err(|e| match not_public_in(&e) {
                Some(name) => FetchError::NotPublic(name),
                None => FetchError::Connect { url: url.clone(), error: e.to_string() },
            })?;
            let status = response.status().as_u16();
            let body = Limited::new(response.into_body(), self.max_response_bytes)
                .collect()
                .await
                .map_err(|e| {
                    if e.is::<http_body_util::LengthLimitError>() {
                        FetchError::TooLarge(url.clone())
                    } else {
                        FetchError::Connect { url: url.clone(), error: e.to_string() }
                    }
                })?
                .to_bytes();
            Ok(Answer { status, body })
        };
        tokio::time::timeout(self.timeout, exchange).await.map_err(|_| FetchError::Timeout(url.clone()))?
    }

    /// Sends a GET and reads a 2xx JSON answer.
    pub async fn fetch_json(&self, outgoing: Outgoing) -> Result<serde_json::Value, FetchError> {
        let url = outgoing.url().to_owned();
        let answer = self.send(outgoing).await?;
        if !(200..300).contains(&answer.status) {
            return Err(FetchError::Status { url, status: answer.status });
        }
        serde_json::from_slice(&answer.body).map_err(|e| FetchError::NotJson { url, error: e.to_string() })
    }
}

/// Resolves a name for a connection, keeping only public addresses unless private ones are
/// allowed; none left is a [`NotPublic`] error.
#[derive(Clone)]
struct Resolver {
    allow_private: bool,
}

impl tower::Service<Name> for Resolver {
    type Response = std::vec::IntoIter<SocketAddr>;
    type Error = Box<dyn std::error::Error + Send + Sync>;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, name: Name) -> Self::Future {
        let allow_private = self.allow_private;
        Box::pin(async move {
            let found: Vec<SocketAddr> = tokio::net::lookup_host((name.as_str(), 0)).await?.collect();
            let kept = if allow_private { found } else { public_only(name.as_str(), found)? };
            Ok(kept.into_iter())
        })
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    /// A listener on loopback that counts the connections it gets, and answers each `{}`.
    async fn counting_listener() -> (SocketAddr, Arc<AtomicUsize>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let count = Arc::new(AtomicUsize::new(0));
        let counted = count.clone();
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                counted.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    use tokio::io::{AsyncReadExt, AsyncWriteExt};
                    let mut buffer = [0; 4096];
                    let _ = stream.read(&mut buffer).await;
                    let _ = stream
                        .write_all(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}")
                        .await;
                });
            }
        });
        (addr, count)
    }

    /// Without leave, neither an address nor a name of loopback is connected to (a signer's
    /// keyId pointing into this network, say); with it, both are.
    #[tokio::test]
    async fn private_addresses_are_reached_only_when_allowed() {
        let (addr, connections) = counting_listener().await;
        let port = addr.port();
        let strict = FederationClient::new(Duration::from_secs(5), 1024, false).unwrap();
        for url in [format!("http://127.0.0.1:{port}/users/a"), format!("http://localhost:{port}/users/a")] {
            let error = strict.fetch_json(Outgoing::get(&url).unwrap()).await.unwrap_err();
            assert!(matches!(error, FetchError::NotPublic(_)), "{url}: {error:?}");
            assert!(!error.is_transient(), "{url}: refusing it again will not help");
        }
        assert_eq!(connections.load(Ordering::SeqCst), 0, "nothing was connected to");
        let allowed = FederationClient::new(Duration::from_secs(5), 1024, true).unwrap();
        for url in [format!("http://127.0.0.1:{port}/users/a"), format!("http://localhost:{port}/users/a")] {
            assert_eq!(allowed.fetch_json(Outgoing::get(&url).unwrap()).await.unwrap(), serde_json::json!({}), "{url}");
        }
        assert!(connections.load(Ordering::SeqCst) >= 1);
    }

    /// Which answers a later try may pass: the peer's own trouble, not a refusal of the request.
    #[test]
    fn statuses_worth_trying_again() {
        let answered = |status| FetchError::Status { url: "https://peer.example/a".into(), status };
        for status in [408, 429, 500, 502, 503] {
            assert!(answered(status).is_transient() && answered(status).is_transient_when_signed(), "{status}");
        }
        // An unsigned request answered 401 is to be signed; a signed one may pass later.
        assert!(!answered(401).is_transient() && answered(401).is_transient_when_signed());
        for status in [400, 403, 404, 410, 422] {
            assert!(!answered(status).is_transient() && !answered(status).is_transient_when_signed(), "{status}");
        }
    }
}
