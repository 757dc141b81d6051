//! Serving a public HTTP router (the gateway, the media route) with the limits a listener open
//! to anyone needs, which `axum::serve` does not set: a request's headers must arrive within
//! [`HttpLimits::header_timeout`] and the whole request (its body read included) be answered
//! within [`HttpLimits::request_timeout`] (408 past it), and at most
//! [`HttpLimits::connections`] connections are open at once (one more is closed at once).
//! Without them a client sending a byte now and then holds a connection, and its buffers, for
//! as long as it likes. On shutdown, requests in flight are answered (up to the request
//! timeout) and idle connections closed.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::Request;
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::IntoResponse;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

/// The limits of a public listener.
#[derive(Debug, Clone, Copy)]
pub struct HttpLimits {
    pub connections: usize,
    pub header_timeout: Duration,
    pub request_timeout: Duration,
}

impl Default for HttpLimits {
    /// 1,024 connections, 30 s for the headers, 60 s for the whole request.
    fn default() -> Self {
        Self { connections: 1024, header_timeout: Duration::from_secs(30), request_timeout: Duration::from_secs(60) }
    }
}

/// Serves `app` on `listener` under `limits` until `shutdown` completes.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: HttpLimits,
    shutdown: impl Future<Output = ()>,
) -> std::io::Result<()> {
    let deadline = limits.request_timeout;
    let app = app.layer(axum::middleware::from_fn(move |request: Request, next: Next| async move {
        match tokio::time::timeout(deadline, next.run(request)).await {
            Ok(response) => response,
            Err(_) => (StatusCode::REQUEST_TIMEOUT, "the request was not complete in time").into_response(),
        }
    }));
    let permits = Arc::new(Semaphore::new(limits.connections));
    let graceful = GracefulShutdown::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(error) => {
                    // Out of file descriptors, most likely: wait for some to close.
                    tracing::warn!(%error, "http accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            tracing::warn!(%peer, limit = limits.connections, "closed a connection: as many as allowed are open");
            continue;
        };
        let mut builder = hyper::server::conn::http1::Builder::new();
        builder.timer(TokioTimer::new()).header_read_timeout(limits.header_timeout);
        let connection = builder.serve_connection(TokioIo::new(stream), TowerToHyperService::new(app.clone()));
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            if let Err(error) = connection.await {
                tracing::debug!(%peer, %error, "http connection ended with an error");
            }
            drop(permit);
        });
    }
    if tokio::time::timeout(limits.request_timeout, graceful.shutdown()).await.is_err() {
        tracing::warn!("http connections still open at shutdown were dropped");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    /// What the server sends on `stream` before it closes it, which it must do within 5 s
    /// (a connection left open fails the test, whatever was sent on it).
    async fn answer(stream: &mut TcpStream) -> String {
        let mut text = Vec::new();
        tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut text))
            .await
            .expect("the server closes the connection")
            .expect("read the answer");
        String::from_utf8_lossy(&text).into_owned()
    }

    /// A slow client is cut off: headers not sent in time close the connection, a body not
    /// sent in time gets a 408, and a connection past the cap is closed at once; a whole
    /// request is answered.
    #[tokio::test]
    async fn slow_clients_and_too_many_connections_are_cut_off() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let app = Router::new()
            .route("/", axum::routing::post(|body: axum::body::Bytes| async move { body.len().to_string() }));
        let limits = HttpLimits {
            connections: 2,
            header_timeout: Duration::from_millis(300),
            request_timeout: Duration::from_millis(300),
        };
        tokio::spawn(serve(listener, app, limits, std::future::pending()));

        let mut whole = TcpStream::connect(addr).await.unwrap();
        whole
            .write_all(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\nconnection: close\r\n\r\nabc")
            .await
            .unwrap();
        let answered = answer(&mut whole).await;
        assert!(answered.starts_with("HTTP/1.1 200") && answered.ends_with('3'), "{answered}");
        tokio::time::sleep(Duration::from_millis(50)).await; // its permit is given back

        let mut slow_headers = TcpStream::connect(addr).await.unwrap();
        slow_headers.write_all(b"POST / HTTP/1.1\r\nhost: x\r\n").await.unwrap();
        let mut slow_body = TcpStream::connect(addr).await.unwrap();
        slow_body.write_all(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 10\r\n\r\nab").await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        // Both slow ones are open: a third is over the cap.
        let mut third = TcpStream::connect(addr).await.unwrap();
        assert_eq!(answer(&mut third).await, "", "closed at once, unanswered");

        let cut = answer(&mut slow_headers).await;
        assert!(!cut.starts_with("HTTP/1.1 2"), "{cut}");
        let timed_out = answer(&mut slow_body).await;
        assert!(timed_out.starts_with("HTTP/1.1 408"), "{timed_out}");

        // Their connections closed, there is room again.
        let mut again = TcpStream::connect(addr).await.unwrap();
        again.write_all(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\nconnection: close\r\n\r\n").await.unwrap();
        assert!(answer(&mut again).await.starts_with("HTTP/1.1 200"));
    }
}
