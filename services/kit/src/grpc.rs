//! The one gRPC server builder every Reelay service uses.
//!
//! Every server gets, composed once: grpc.health.v1 (each mounted service marked serving, all
//! marked not serving when shutdown starts), reflection, a service-token check on every call
//! except health checks, a per-call deadline, a per-connection concurrency limit, panic catching
//! (a panicking handler answers INTERNAL instead of dropping the connection), a tracing span per
//! call, and the caller's W3C trace context made available to the write path so every event a
//! call raises carries it. Every call is counted by method and status code, and timed.
//!
//! Health: the empty service name is SERVING while the server runs (liveness); each mounted
//! service and each name given to [`GrpcServer::readiness`] (`write`, `handlers`) is SERVING
//! only while that readiness flag is set (readiness probes).

use std::collections::HashSet;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, LazyLock};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use futures_util::FutureExt;
use futures_util::future::BoxFuture;
use tokio::net::TcpListener;
use tonic::Status;
use tonic::body::Body;
use tonic::codegen::http;
use tonic::server::NamedService;
use tonic::service::RoutesBuilder;
use tonic::transport::server::TcpIncoming;
use tonic_health::ServingStatus;
use tower::{Layer, Service};
use tracing::Instrument;

use crate::metrics::{self, Counter, Histogram};
use crate::telemetry::TRACEPARENT;

static GRPC_REQUESTS: LazyLock<Counter> = LazyLock::new(|| {
    metrics::counter(
        "reelay_grpc_requests_total",
        "gRPC calls served, by method (of the mounted services; `unknown` otherwise) and status code.",
        &["method", "code"],
    )
});
static GRPC_DURATION: LazyLock<Histogram> = LazyLock::new(|| {
    metrics::histogram(
        "reelay_grpc_request_duration_seconds",
        "Time to answer a gRPC call (until its response headers), by method.",
        &["method"],
        metrics::SECONDS,
    )
});

#[derive(Debug, Clone)]
pub struct GrpcConfig {
    /// The shared secret callers present as `authorization: Bearer <token>`. `None` only in dev
    /// mode, where calls are not authenticated.
    pub service_token: Option<String>,
    /// Largest request or response message, in bytes.
    pub max_message_bytes: usize,
    /// Deadline for a call that does not send a shorter `grpc-timeout`.
    pub call_timeout: Duration,
    pub max_concurrent_calls_per_connection: usize,
    /// After shutdown starts, how long in-flight calls get before the server stops anyway.
    pub drain_timeout: Duration,
}

impl Default for GrpcConfig {
    fn default() -> Self {
        Self {
            service_token: None,
            max_message_bytes: 4 * 1024 * 1024,
            call_timeout: Duration::from_secs(30),
            max_concurrent_calls_per_connection: 256,
            drain_timeout: Duration::from_secs(10),
        }
    }
}

/// Health checks must work without the token (Kubernetes probes have none).
const UNAUTHENTICATED_PREFIXES: &[&str] = &["/grpc.health.v1.Health/"];

/// Collects the services of one server, then serves them on a pre-bound listener.
pub struct GrpcServer {
    config: GrpcConfig,
    routes: RoutesBuilder,
    names: Vec<&'static str>,
    readiness: Vec<(&'static str, tokio::sync::watch::Receiver<bool>)>,
}

impl GrpcServer {
    pub fn new(config: GrpcConfig) -> Self {
        Self { config, routes: RoutesBuilder::default(), names: Vec::new(), readiness: Vec::new() }
    }

    /// Reports the health of `name` (and of every service mounted on this server) as SERVING
    /// only while `ready` is set: readiness probes ask for `name`.
    pub fn readiness(mut self, name: &'static str, ready: &crate::admin_http::ReadyFlag) -> Self {
        self.readiness.push((name, ready.subscribe()));
        self
    }

    pub fn config(&self) -> &GrpcConfig {
        &self.config
    }

    /// Mounts a generated tonic service.
    pub fn add_service<S>(mut self, service: S) -> Self
    where
        S: Service<http::Request<Body>, Error = Infallible, Response = http::Response<Body>>
            + NamedService
            + Clone
            + Send
            + Sync
            + 'static,
        S::Future: Send + 'static,
    {
        self.names.push(S::NAME);
        self.routes.add_service(service);
        self
    }

    /// Serves until `shutdown` resolves, then stops accepting calls and lets in-flight calls
    /// finish.
    pub async fn serve(
        self,
        listener: TcpListener,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), tonic::transport::Error> {
        let Self { config, mut routes, names, readiness } = self;
        let (health, health_service) = tonic_health::server::health_reporter();
        health.set_service_status("", ServingStatus::Serving).await;
        // Mounted services follow the server's readiness flags (all of them must be set);
        // without flags they serve as soon as the server does. Flags are looked at every 100 ms.
        let (stop_following, mut stopped) = tokio::sync::watch::channel(false);
        let flag_names: Vec<&'static str> = readiness.iter().map(|(name, _)| *name).collect();
        {
            let (health, names) = (health.clone(), names.clone());
            tokio::spawn(async move {
                let mut last: Option<Vec<bool>> = None;
                loop {
                    let now: Vec<bool> = readiness.iter().map(|(_, rx)| *rx.borrow()).collect();
                    if last.as_ref() != Some(&now) {
                        let serving =
                            |ready: bool| if ready { ServingStatus::Serving } else { ServingStatus::NotServing };
                        for ((name, _), ready) in readiness.iter().zip(&now) {
                            health.set_service_status(*name, serving(*ready)).await;
                        }
                        for name in &names {
                            health.set_service_status(*name, serving(now.iter().all(|r| *r))).await;
                        }
                        last = Some(now);
                    }
                    tokio::select! {
                        () = tokio::time::sleep(Duration::from_millis(100)) => {}
                        _ = stopped.changed() => return,
                    }
                }
            });
        }
        let mounted: Vec<&str> = names.iter().copied().chain(["grpc.health.v1.Health"]).collect();
        let known = Arc::new(method_paths(&mounted));
        // Reflection lists what this port serves (every proto's types stay resolvable), in both
        // versions clients ask for (older ones know only v1alpha).
        let reflection = || {
            mounted.iter().fold(
                tonic_reflection::server::Builder::configure()
                    .register_encoded_file_descriptor_set(reelay_contracts::FILE_DESCRIPTOR_SET)
                    .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
                    .with_service_name("grpc.reflection.v1.ServerReflection")
                    .with_service_name("grpc.reflection.v1alpha.ServerReflection"),
                |builder, name| builder.with_service_name(*name),
            )
        };
        routes.add_service(health_service);
        routes.add_service(reflection().build_v1().expect("the embedded descriptor sets are valid"));
        routes.add_service(reflection().build_v1alpha().expect("the embedded descriptor sets are valid"));

        let addr: Option<SocketAddr> = listener.local_addr().ok();
        tracing::info!(?addr, services = ?names, auth = config.service_token.is_some(), "grpc server listening");
        let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
        let (draining_tx, draining) = tokio::sync::oneshot::channel::<()>();
        let signal = async move {
            shutdown.await;
            let _ = stop_following.send(true);
            let _ = draining_tx.send(());
            for name in names.iter().chain(&flag_names) {
                health.set_service_status(*name, ServingStatus::NotServing).await;
            }
            health.set_service_status("", ServingStatus::NotServing).await;
            tracing::info!(?addr, "grpc server draining");
        };
        let serving = tonic::transport::Server::builder()
            // The deadline is kept by `CallContext`; this is its backstop.
            .timeout(config.call_timeout + Duration::from_secs(1))
            .concurrency_limit_per_connection(config.max_concurrent_calls_per_connection)
            .layer(CallContextLayer {
                token: config.service_token.map(Arc::from),
                known,
                call_timeout: config.call_timeout,
            })
            .add_routes(routes.routes())
            .serve_with_incoming_shutdown(incoming, signal);
        let drain_deadline = async move {
            if draining.await.is_ok() {
                tokio::time::sleep(config.drain_timeout).await;
            } else {
                std::future::pending::<()>().await;
            }
        };
        tokio::select! {
            served = serving => served,
            () = drain_deadline => {
                tracing::warn!(?addr, timeout = ?config.drain_timeout, "calls still open after the drain timeout; closing them");
                Ok(())
            }
        }
    }
}

#[derive(Clone)]
struct CallContextLayer {
    token: Option<Arc<str>>,
    /// The services mounted on this server: the only method labels metrics may carry.
    known: Arc<HashSet<String>>,
    /// The server's deadline for a call (tonic's, applied outside this layer).
    call_timeout: Duration,
}

impl<S> Layer<S> for CallContextLayer {
    type Service = CallContext<S>;

    fn layer(&self, inner: S) -> Self::Service {
        CallContext { inner, token: self.token.clone(), known: self.known.clone(), call_timeout: self.call_timeout }
    }
}

#[derive(Clone)]
struct CallContext<S> {
    inner: S,
    token: Option<Arc<str>>,
    known: Arc<HashSet<String>>,
    call_timeout: Duration,
}

/// A call's deadline as its caller sent it (`grpc-timeout: 250m`), if it did.
fn caller_deadline(request: &http::Request<Body>) -> Option<Duration> {
    let value = request.headers().get("grpc-timeout")?.to_str().ok()?;
    let (amount, unit) = value.split_at(value.len().checked_sub(1)?);
    // At most 8 digits, as gRPC says (and tonic reads it).
    if amount.is_empty() || amount.len() > 8 {
        return None;
    }
    let amount: u64 = amount.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(amount.checked_mul(3600)?),
        "M" => Duration::from_secs(amount.checked_mul(60)?),
        "S" => Duration::from_secs(amount),
        "m" => Duration::from_millis(amount),
        "u" => Duration::from_micros(amount),
        "n" => Duration::from_nanos(amount),
        _ => return None,
    })
}

/// Counts a call dropped before it answered: left by its caller (`1`, CANCELLED), or cut off at
/// its deadline by tonic's own timer, which keeps a deadline the caller sent at the same
/// instant as this layer and may fire first (`4`, as this layer counts it). Without it such
/// calls were in no metric.
struct Unanswered {
    /// Disarmed (`None`) once the call answered.
    label: Option<String>,
    started: Instant,
    deadline: Duration,
}

impl Unanswered {
    /// Disarms the guard, handing back the call's label.
    fn answered(&mut self) -> String {
        self.label.take().unwrap_or_default()
    }
}

impl Drop for Unanswered {
    fn drop(&mut self) {
        let Some(label) = self.label.take() else { return };
        let elapsed = self.started.elapsed();
        tracing::debug!(?elapsed, "call dropped before it answered");
        count_call(&label, if elapsed >= self.deadline { "4" } else { "1" }, self.started);
    }
}

/// Counts a call by its method label and code, with its time.
fn count_call(label: &str, code: &str, started: Instant) {
    GRPC_REQUESTS.inc(&[label, code]);
    GRPC_DURATION.observe_duration(&[label], started.elapsed());
}

/// The method label of a call: its path when it is a method of a mounted service, else
/// `unknown` (a caller, even one without the token, must not be able to mint label values).
fn method_label(known: &HashSet<String>, path: &str) -> String {
    if known.contains(path) { path.to_owned() } else { "unknown".to_owned() }
}

/// The paths (`/package.Service/Method`) of every method of the `services` named, from the
/// descriptor sets built in (Reelay's and grpc.health's).
fn method_paths(services: &[&str]) -> HashSet<String> {
    use prost::Message;
    let mut paths = HashSet::new();
    for encoded in [reelay_contracts::FILE_DESCRIPTOR_SET, tonic_health::pb::FILE_DESCRIPTOR_SET] {
        let set = prost_types::FileDescriptorSet::decode(encoded).expect("the embedded descriptor sets are valid");
        for file in set.file {
            for service in &file.service {
                let name = format!("{}.{}", file.package(), service.name());
                if services.contains(&name.as_str()) {
                    paths.extend(service.method.iter().map(|method| format!("/{name}/{}", method.name())));
                }
            }
        }
    }
    paths
}

impl<S> CallContext<S> {
    fn authorized(&self, request: &http::Request<Body>) -> bool {
        let Some(token) = &self.token else { return true };
        if UNAUTHENTICATED_PREFIXES.iter().any(|p| request.uri().path().starts_with(p)) {
            return true;
        }
        let presented = request
            .headers()
            .get(http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        presented.is_some_and(|p| constant_time_eq(p.as_bytes(), token.as_bytes()))
    }
}

impl<S> Service<http::Request<Body>> for CallContext<S>
where
    S: Service<http::Request<Body>, Response = http::Response<Body>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = S::Error;
    type Future = BoxFuture<'static, Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        let method = request.uri().path().to_owned();
        let label = method_label(&self.known, &method);
        let started = Instant::now();
        if !self.authorized(&request) {
            log_rejected(&method);
            GRPC_REQUESTS.inc(&[&label, "16"]);
            let status =
                Status::unauthenticated("missing or invalid service token (send `authorization: Bearer <token>`)");
            return Box::pin(async move { Ok(status.into_http()) });
        }
        let traceparent = request
            .headers()
            .get("traceparent")
            .and_then(|v| v.to_str().ok())
            .filter(|v| is_valid_traceparent(v))
            .map_or_else(new_traceparent, str::to_owned);
        let span = tracing::info_span!("grpc", %method, trace_id = %&traceparent[3..35]);
        let deadline = caller_deadline(&request).map_or(self.call_timeout, |d| d.min(self.call_timeout));
        // Take the service that was driven to readiness; leave a fresh clone for the next call.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let call = inner.call(request);
        let mut unanswered = Unanswered { label: Some(label), started, deadline };
        Box::pin(
            TRACEPARENT
                .scope(traceparent, async move {
                    // The call's deadline is kept here, so that a call cut off by it is answered
                    // DEADLINE_EXCEEDED and counted (tonic's own timer, set a second later, is
                    // the backstop; it answers CANCELLED from outside this layer).
                    let answered = tokio::time::timeout(deadline, AssertUnwindSafe(call).catch_unwind()).await;
                    let label = unanswered.answered();
                    let Ok(answered) = answered else {
                        tracing::warn!(?deadline, "call not answered within its deadline");
                        count_call(&label, "4", started);
                        let status = Status::deadline_exceeded(format!("not answered within {deadline:?}"));
                        return Ok(status.into_http());
                    };
                    match answered {
                        Ok(Ok(mut response)) => {
                            blame_the_request(&mut response);
                            // The status of a call that streams its answer is only in its
                            // trailers; "0" here means the headers carried none.
                            let code =
                                response.headers().get("grpc-status").and_then(|v| v.to_str().ok()).unwrap_or("0");
                            tracing::debug!(code, "call answered");
                            let label = if code == "12" { "unknown" } else { &label };
                            count_call(label, code, started);
                            Ok(response)
                        }
                        Ok(Err(error)) => Err(error),
                        Err(_) => {
                            tracing::error!("handler panicked");
                            count_call(&label, "13", started);
                            Ok(Status::internal("the server failed unexpectedly (see its log)").into_http())
                        }
                    }
                })
                .instrument(span),
        )
    }
}

/// tonic answers a request it could not read with codes that blame the server: OUT_OF_RANGE for
/// a message over the size limit and INTERNAL for one that does not decode. Both are the
/// caller's doing, so they become RESOURCE_EXHAUSTED (gRPC's own code for a message over the
/// limit) and INVALID_ARGUMENT. Such answers carry their status in the response headers.
fn blame_the_request(response: &mut http::Response<Body>) {
    let Some(status) = Status::from_header_map(response.headers()) else { return };
    let code = match status.code() {
        tonic::Code::OutOfRange if status.message().contains("decoded message length too large") => {
            tonic::Code::ResourceExhausted
        }
        tonic::Code::Internal if status.message().starts_with("failed to decode") => tonic::Code::InvalidArgument,
        _ => return,
    };
    let message = format!("the request could not be read: {}", status.message());
    let _ = Status::new(code, message).add_header(response.headers_mut());
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// `00-<32 hex trace id>-<16 hex parent id>-<2 hex flags>`.
fn is_valid_traceparent(value: &str) -> bool {
    let parts: Vec<&str> = value.split('-').collect();
    let hex = |s: &str, len: usize| s.len() == len && s.bytes().all(|b| b.is_ascii_hexdigit());
    parts.len() == 4
        && parts[0] == "00"
        && hex(parts[1], 32)
        && hex(parts[2], 16)
        && hex(parts[3], 2)
        && parts[1] != "0".repeat(32)
}

/// A new root trace context for a call that did not bring one.
pub fn new_traceparent() -> String {
    let trace = uuid::Uuid::new_v4().simple().to_string();
    let span = &uuid::Uuid::new_v4().simple().to_string()[..16];
    format!("00-{trace}-{span}-01")
}

/// Logs a call refused for its token, at most once every 10 s with how many went unlogged
/// since (a caller without the token could otherwise fill the log); every one is counted in
/// `reelay_grpc_requests_total` with code 16.
fn log_rejected(method: &str) {
    use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
    static LAST_LOGGED_S: AtomicI64 = AtomicI64::new(i64::MIN);
    static UNLOGGED: AtomicU64 = AtomicU64::new(0);
    let now_s = crate::now_ms() / 1000;
    let last = LAST_LOGGED_S.load(Ordering::Relaxed);
    if now_s.saturating_sub(last) >= 10
        && LAST_LOGGED_S.compare_exchange(last, now_s, Ordering::Relaxed, Ordering::Relaxed).is_ok()
    {
        let unlogged = UNLOGGED.swap(0, Ordering::Relaxed);
        tracing::warn!(%method, unlogged_since = unlogged, "rejected a call without a valid service token");
    } else {
        UNLOGGED.fetch_add(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traceparents() {
        let generated = new_traceparent();
        assert!(is_valid_traceparent(&generated), "{generated}");
        assert!(!is_valid_traceparent("00-abc-def-01"));
        assert!(!is_valid_traceparent(&format!("00-{}-0000000000000001-01", "0".repeat(32))));
    }

    #[test]
    fn only_the_methods_of_mounted_services_are_label_values() {
        let known = method_paths(&["reelay.v1.Reviews", "grpc.health.v1.Health"]);
        assert_eq!(method_label(&known, "/reelay.v1.Reviews/LogReview"), "/reelay.v1.Reviews/LogReview");
        assert_eq!(method_label(&known, "/grpc.health.v1.Health/Check"), "/grpc.health.v1.Health/Check");
        // A made-up method of a mounted service (answered before any routing when the token is
        // missing), a method of a service not mounted here, anything else: one value.
        for path in ["/reelay.v1.Reviews/LogReview2", "/reelay.v1.Reviews/", "/reelay.v1.Users/CreateUser", "/x", ""] {
            assert_eq!(method_label(&known, path), "unknown", "{path}");
        }
    }

    #[test]
    fn token_comparison() {
        assert!(constant_time_eq(b"secret", b"secret"));
        assert!(!constant_time_eq(b"secret", b"secreT"));
        assert!(!constant_time_eq(b"secret", b"secret2"));
    }

    /// A service that never answers (a write service whose writer hangs).
    #[derive(Clone)]
    struct Hung;

    impl Service<http::Request<Body>> for Hung {
        type Response = http::Response<Body>;
        type Error = Infallible;
        type Future = std::future::Pending<Result<Self::Response, Infallible>>;

        fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
            Poll::Ready(Ok(()))
        }

        fn call(&mut self, _request: http::Request<Body>) -> Self::Future {
            std::future::pending()
        }
    }

    /// A call not answered within its deadline (the server's, or a shorter one its caller sent)
    /// is answered DEADLINE_EXCEEDED and counted so, with its time, as is one tonic's timer cut
    /// off at that deadline first; one its caller left early is counted CANCELLED.
    #[tokio::test]
    async fn calls_not_answered_in_time_are_answered_and_counted() {
        let method = "/reelay.v1.Reviews/LogReview";
        let known = Arc::new(method_paths(&["reelay.v1.Reviews"]));
        let layer = |call_timeout| CallContextLayer { token: None, known: known.clone(), call_timeout };
        let request = |timeout: Option<&str>| {
            let mut request = http::Request::builder().uri(format!("http://x{method}"));
            if let Some(timeout) = timeout {
                request = request.header("grpc-timeout", timeout);
            }
            request.body(Body::empty()).unwrap()
        };
        let count = |code| GRPC_REQUESTS.get(&[method, code]);
        let (deadline, cancelled) = (count("4"), count("1"));
        // Cut off at the server's deadline, and at the caller's shorter one.
        let mut service = layer(Duration::from_millis(100)).layer(Hung);
        for timeout in [None, Some("50m")] {
            let answer = tokio::time::timeout(Duration::from_secs(30), service.call(request(timeout))).await;
            let answer = answer.expect("answered at the deadline").unwrap();
            assert_eq!(answer.headers()["grpc-status"], "4", "{timeout:?}");
        }
        assert_eq!((count("4"), count("1")), (deadline + 2, cancelled));
        // Left by its caller long before its deadline.
        let mut service = layer(Duration::from_secs(60)).layer(Hung);
        assert!(tokio::time::timeout(Duration::from_millis(10), service.call(request(None))).await.is_err());
        assert_eq!((count("4"), count("1")), (deadline + 2, cancelled + 1));
        // Dropped once its deadline had passed, before this layer saw it (tonic's own timer
        // fired first): cut off, not left.
        let call = service.call(request(Some("50m")));
        tokio::time::sleep(Duration::from_millis(100)).await;
        drop(call);
        assert_eq!((count("4"), count("1")), (deadline + 3, cancelled + 1));
        assert_eq!(caller_deadline(&request(Some("2M"))), Some(Duration::from_secs(120)));
        assert_eq!(caller_deadline(&request(Some("x"))), None);
        assert_eq!(caller_deadline(&request(Some("123456789S"))), None, "over 8 digits");
        assert_eq!(caller_deadline(&request(None)), None);
    }
}
