//! The admin HTTP port every Reelay process serves (`REELAY_METRICS_ADDR`): `/metrics` in the
//! Prometheus text format, `/healthz` (the process answers) and `/readyz` (every service in it
//! is ready: 200, else 503 naming the ones that are not).
//!
//! Readiness is also what the gRPC health service reports under each service's name (see
//! [`crate::GrpcServer::readiness`]), so Kubernetes probes see the same answer on either port.
//! HTTP/1.1 by hand: three GET paths do not justify an HTTP framework.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// Whether each service of this process is ready to take work.
#[derive(Clone, Default)]
pub struct Readiness {
    services: Arc<Mutex<BTreeMap<&'static str, watch::Sender<bool>>>>,
    /// Set once shutdown has started: no service is ready again after it.
    draining: Arc<AtomicBool>,
}

impl Readiness {
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers `service`, not ready until its flag is set.
    pub fn service(&self, service: &'static str) -> ReadyFlag {
        let mut services = self.services.lock().expect("readiness lock");
        let sender = services.entry(service).or_insert_with(|| watch::channel(false).0).clone();
        ReadyFlag(sender, self.draining.clone())
    }

    /// The services not ready now (empty: the process is ready).
    pub fn not_ready(&self) -> Vec<&'static str> {
        let services = self.services.lock().expect("readiness lock");
        services.iter().filter(|(_, s)| !*s.borrow()).map(|(name, _)| *name).collect()
    }

    /// Marks every service not ready for good (shutdown has started): a flag set ready later
    /// (start-up work finishing meanwhile) stays not ready.
    pub fn draining(&self) {
        self.draining.store(true, Ordering::SeqCst);
        for sender in self.services.lock().expect("readiness lock").values() {
            sender.send_replace(false);
        }
    }
}

/// One service's readiness.
#[derive(Clone)]
pub struct ReadyFlag(watch::Sender<bool>, Arc<AtomicBool>);

impl ReadyFlag {
    /// Sets it, unless shutdown has started (then it stays not ready). Checked under the
    /// channel's lock, which `draining` takes after marking shutdown: either the flag is set
    /// before and cleared by it, or not set.
    pub fn set(&self, ready: bool) {
        let draining = &self.1;
        self.0.send_if_modified(|current| {
            let ready = ready && !draining.load(Ordering::SeqCst);
            if *current == ready {
                return false;
            }
            tracing::info!(ready, "service readiness changed");
            *current = ready;
            true
        });
    }

    pub fn is_ready(&self) -> bool {
        *self.0.borrow()
    }

    pub fn subscribe(&self) -> watch::Receiver<bool> {
        self.0.subscribe()
    }
}

/// The most admin connections served at once.
const MAX_ADMIN_CONNECTIONS: usize = 1024;

/// Serves the admin port until the process exits.
pub async fn serve_admin(listener: TcpListener, readiness: Readiness) {
    tracing::info!(addr = ?listener.local_addr().ok(), "admin http (metrics, healthz, readyz) listening");
    // Probes and scrapes are a few at a time; more connections than this wait in the listen
    // backlog instead of each taking a task and a descriptor for up to 30 s.
    let open = std::sync::Arc::new(tokio::sync::Semaphore::new(MAX_ADMIN_CONNECTIONS));
    loop {
        let Ok(permit) = open.clone().acquire_owned().await else { return };
        let (stream, _) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(error) => {
                tracing::warn!(%error, "admin http accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let readiness = readiness.clone();
        tokio::spawn(async move {
            if let Err(error) = tokio::time::timeout(Duration::from_secs(30), answer(stream, readiness)).await {
                tracing::debug!(%error, "admin http request timed out");
            }
            drop(permit);
        });
    }
}

async fn answer(mut stream: TcpStream, readiness: Readiness) {
    let mut request = Vec::with_capacity(1024);
    let mut buffer = [0u8; 1024];
    // Each read looks for the blank line in what it added (and the three bytes before, where
    // the line may have begun), not in the whole request again: a request trickled in a byte
    // at a time costs its length, not its length squared.
    let mut ended = false;
    while !ended && request.len() < 16 * 1024 {
        match stream.read(&mut buffer).await {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                let from = request.len().saturating_sub(3);
                request.extend_from_slice(&buffer[..n]);
                ended = request[from..].windows(4).any(|w| w == b"\r\n\r\n");
            }
        }
    }
    let head = String::from_utf8_lossy(&request);
    let mut parts = head.split_whitespace();
    let (method, target) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let path = target.split('?').next().unwrap_or("");
    let (status, content_type, body) = match (method, path) {
        ("GET" | "HEAD", "/metrics") => {
            ("200 OK", "text/plain; version=0.0.4; charset=utf-8", crate::metrics::render().await)
        }
        ("GET" | "HEAD", "/healthz") => ("200 OK", "text/plain", "ok\n".to_owned()),
        ("GET" | "HEAD", "/readyz") => match readiness.not_ready().as_slice() {
            [] => ("200 OK", "text/plain", "ready\n".to_owned()),
            waiting => ("503 Service Unavailable", "text/plain", format!("not ready: {}\n", waiting.join(", "))),
        },
        ("GET" | "HEAD", _) => ("404 Not Found", "text/plain", "try /metrics, /healthz or /readyz\n".to_owned()),
        _ => ("405 Method Not Allowed", "text/plain", "GET only\n".to_owned()),
    };
    let mut response = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    if method != "HEAD" {
        response.extend_from_slice(body.as_bytes());
    }
    let _ = stream.write_all(&response).await;
    let _ = stream.shutdown().await;
}

/// GETs `path` from an admin port: the status code and the body. For the CLI and tests.
pub async fn get(addr: &str, path: &str) -> Result<(u16, String), String> {
    let connect = tokio::time::timeout(Duration::from_secs(5), TcpStream::connect(addr));
    let mut stream = connect.await.map_err(|_| format!("{addr}: timed out"))?.map_err(|e| format!("{addr}: {e}"))?;
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.map_err(|e| e.to_string())?;
    let mut response = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut response))
        .await
        .map_err(|_| format!("{addr}{path}: no answer"))?
        .map_err(|e| e.to_string())?;
    let text = String::from_utf8_lossy(&response);
    let (head, body) = text.split_once("\r\n\r\n").ok_or("malformed HTTP response")?;
    let code = head.split_whitespace().nth(1).and_then(|c| c.parse().ok()).ok_or("malformed HTTP status line")?;
    Ok((code, body.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn serves_health_readiness_and_metrics() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let readiness = Readiness::new();
        let write = readiness.service("write");
        tokio::spawn(serve_admin(listener, readiness.clone()));
        assert_eq!(get(&addr, "/healthz").await.unwrap().0, 200);
        let (code, body) = get(&addr, "/readyz").await.unwrap();
        assert_eq!((code, body.as_str()), (503, "not ready: write\n"));
        write.set(true);
        assert_eq!(get(&addr, "/readyz").await.unwrap().0, 200);
        readiness.draining();
        assert_eq!(get(&addr, "/readyz").await.unwrap().0, 503);
        write.set(true);
        assert_eq!(get(&addr, "/readyz").await.unwrap().0, 503, "not ready again once draining");
        assert_eq!(get(&addr, "/metrics").await.unwrap().0, 200);
        assert_eq!(get(&addr, "/nope").await.unwrap().0, 404);

        // A request whose blank line is split between two reads is still answered.
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut stream = TcpStream::connect(&addr).await.unwrap();
        stream.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r").await.unwrap();
        stream.flush().await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        stream.write_all(b"\n").await.unwrap();
        let mut answer = String::new();
        stream.read_to_string(&mut answer).await.unwrap();
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    }
}
