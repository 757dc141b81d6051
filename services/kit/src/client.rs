//! Channels to other Reelay services: authenticated with the service token, connected lazily
//! (a service starts even while its peer is down, and reconnects by itself), with a deadline on
//! every call.

use std::time::Duration;

use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Status};

/// A channel whose calls carry the service token.
pub type ServiceChannel = InterceptedService<Channel, ServiceToken>;

#[derive(Clone)]
pub struct ServiceToken(Option<MetadataValue<Ascii>>);

impl Interceptor for ServiceToken {
    fn call(&mut self, mut request: tonic::Request<()>) -> Result<tonic::Request<()>, Status> {
        if let Some(token) = &self.0 {
            request.metadata_mut().insert("authorization", token.clone());
        }
        Ok(request)
    }
}

/// Checks that `url` names a service this build can reach: `http://` and a host. Without the
/// scheme the URL parses all the same and every call then fails with a bare transport error;
/// `https://` would be spoken in plaintext, since this build has no TLS client.
pub fn check_service_url(url: &str) -> Result<Endpoint, String> {
    let endpoint = Endpoint::from_shared(url.to_owned()).map_err(|e| format!("invalid service URL {url:?}: {e}"))?;
    let uri = endpoint.uri();
    match uri.scheme_str() {
        Some("http") => {}
        Some("https") => {
            return Err(format!(
                "service URL {url:?}: https is not supported (this build speaks plaintext gRPC); use http://"
            ));
        }
        Some(other) => return Err(format!("service URL {url:?}: the scheme must be http, not {other}")),
        None => return Err(format!("service URL {url:?} has no scheme: write http://{url}")),
    }
    if uri.host().is_none_or(str::is_empty) {
        return Err(format!("service URL {url:?} names no host"));
    }
    Ok(endpoint)
}

/// A lazily connected channel to `url` (e.g. `http://127.0.0.1:50051`). `call_timeout` bounds
/// every call that does not set a shorter deadline.
pub fn connect_lazy(url: &str, token: Option<&str>, call_timeout: Duration) -> Result<ServiceChannel, String> {
    let endpoint = check_service_url(url)?
        .connect_timeout(Duration::from_secs(5))
        .timeout(call_timeout)
        .tcp_nodelay(true)
        .http2_keep_alive_interval(Duration::from_secs(30));
    let token = token
        .map(|t| format!("Bearer {t}").parse::<MetadataValue<Ascii>>())
        .transpose()
        .map_err(|_| "the service token must be printable ASCII".to_owned())?;
    Ok(InterceptedService::new(endpoint.connect_lazy(), ServiceToken(token)))
}

/// True when a failed call says the peer could not be reached, did not answer in time, or is out
/// of a resource that comes back (its disk is full): the caller should pause and retry, not
/// count it as a failure of the work.
pub fn is_transport_failure(status: &Status) -> bool {
    matches!(
        status.code(),
        Code::Unavailable
            | Code::DeadlineExceeded
            | Code::Cancelled
            | Code::Unknown
            | Code::Aborted
            | Code::ResourceExhausted
    )
}

/// Whether a failed call never reached the server: its connection was refused, so nothing of
/// the call was sent (unlike a connection lost mid-call, whose outcome is unknown).
pub fn never_connected(status: &Status) -> bool {
    let mut source = std::error::Error::source(status);
    while let Some(cause) = source {
        if cause.downcast_ref::<std::io::Error>().is_some_and(|e| e.kind() == std::io::ErrorKind::ConnectionRefused) {
            return true;
        }
        source = cause.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A URL without a scheme or host, or with one this build cannot speak, is refused before
    /// any call (it used to be taken, and every call failed with "transport error").
    #[test]
    fn a_service_url_needs_http_and_a_host() {
        assert!(check_service_url("http://127.0.0.1:50051").is_ok());
        assert!(check_service_url("http://write.reelay.svc:50051/").is_ok());
        assert!(check_service_url("http://[::1]:50051").is_ok());
        for (url, says) in [
            ("127.0.0.1:50051", "has no scheme: write http://127.0.0.1:50051"),
            ("write:50051", "has no scheme"),
            ("localhost", "has no scheme"),
            ("https://127.0.0.1:50051", "https is not supported"),
            ("grpc://127.0.0.1:50051", "the scheme must be http"),
            ("http://", "invalid service URL"),
            ("", "invalid service URL"),
        ] {
            let error = check_service_url(url).map(drop).unwrap_err();
            assert!(error.contains(says), "{url:?}: {error}");
        }
    }
}
