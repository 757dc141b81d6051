//! The outbound HTTP client of federation: hyper-util's pooled client over rustls (ring, the
//! system's roots), which tonic and async-nats already bring, with a deadline on every request
//! and a cap on what a response may bring back.
//!
//! Signing is the caller's: build an [`Outgoing`], have its [`Outgoing::signing_input`] signed
//! (by the write service, which holds the keys), attach the `Signature` header, send.

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Method, Request, header};
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
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
}

impl FetchError {
    /// Worth trying again later: the peer was unreachable, slow, or failing on its side.
    pub fn is_transient(&self) -> bool {
        match self {
            Self::Timeout(_) | Self::Connect { .. } => true,
            Self::Status { status, .. } => *status >= 500 || *status == 429,
            _ => false,
        }
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
        let host = match parsed.port() {
            Some(port) => format!("{}:{port}", parsed.host_str().unwrap_or_default()),
            None => parsed.host_str().unwrap_or_default().to_owned(),
        };
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
    http: Client<hyper_rustls::HttpsConnector<HttpConnector>, Full<Bytes>>,
    timeout: Duration,
    max_response_bytes: usize,
}

impl FederationClient {
    pub fn new(timeout: Duration, max_response_bytes: usize) -> Result<Self, String> {
        let https = hyper_rustls::HttpsConnectorBuilder::new()
            .with_provider_and_native_roots(rustls::crypto::ring::default_provider())
            .map_err(|e| format!("cannot load the system's TLS roots: {e}"))?
            .https_or_http()
            .enable_http1()
            .build();
        let http = Client::builder(TokioExecutor::new()).pool_idle_timeout(Duration::from_secs(30)).build(https);
        Ok(Self { http, timeout, max_response_bytes })
    }

    /// Sends the request and reads the answer, whatever its status.
    pub async fn send(&self, outgoing: Outgoing) -> Result<Answer, FetchError> {
        let url = outgoing.url.to_string();
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
            let response = self
                .http
                .request(request)
                .await
                .map_err(|e| FetchError::Connect { url: url.clone(), error: e.to_string() })?;
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
