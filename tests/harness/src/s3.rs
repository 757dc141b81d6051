//! A real S3-compatible server for object-storage tests: moto's server mode (`moto[server]`,
//! installed pinned by `scripts/install-moto`), on a free port, stopped by PID. Plus the small
//! HTTP/1.1 client the tests use to fetch what Reelay serves and to create buckets.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::{free_port, signal};

pub const S3_ACCESS_KEY_ID: &str = "reelay-test-key";
pub const S3_SECRET_ACCESS_KEY: &str = "reelay-test-secret";
pub const S3_REGION: &str = "us-east-1";

/// Where `scripts/install-moto` put moto: `MOTO_DIR`, else the repo's `.tools`.
fn moto_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("MOTO_DIR") {
        return dir.into();
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let output = Command::new(root.join("scripts/install-moto"))
        .stderr(Stdio::inherit())
        .output()
        .expect("run scripts/install-moto");
    assert!(output.status.success(), "scripts/install-moto failed");
    String::from_utf8(output.stdout).unwrap().trim().into()
}

/// A running moto server.
pub struct MotoServer {
    child: Child,
    pub port: u16,
    log: PathBuf,
}

impl MotoServer {
    /// Starts moto on a free port, logging into `dir`, and waits until it answers.
    pub async fn start(dir: &Path) -> Self {
        std::fs::create_dir_all(dir).unwrap();
        let moto = moto_dir();
        let port = free_port();
        let log = dir.join("moto.log");
        let file = std::fs::File::create(&log).unwrap();
        let child = Command::new("python3")
            .args(["-m", "moto.server", "-H", "127.0.0.1", "-p", &port.to_string()])
            .env("PYTHONPATH", &moto)
            .stdin(Stdio::null())
            .stdout(file.try_clone().unwrap())
            .stderr(file)
            .spawn()
            .expect("spawn moto");
        let server = Self { child, port, log };
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Ok((status, _)) = http("GET", &server.endpoint(), "/", &[]).await
                && status < 500
            {
                return server;
            }
            assert!(Instant::now() < deadline, "moto did not answer within 60 s\n{}", server.log_text());
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The endpoint to configure (`REELAY_OBJECTS_S3_ENDPOINT`).
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Creates a bucket (moto accepts unsigned requests).
    pub async fn create_bucket(&self, bucket: &str) {
        let (status, body) = http("PUT", &self.endpoint(), &format!("/{bucket}"), &[]).await.expect("create a bucket");
        assert!(status == 200, "creating bucket {bucket} answered {status}: {}", String::from_utf8_lossy(&body));
    }

    /// The keys in a bucket under `prefix`, from a ListObjectsV2 answer.
    pub async fn keys(&self, bucket: &str, prefix: &str) -> Vec<String> {
        let (status, body) = http("GET", &self.endpoint(), &format!("/{bucket}?list-type=2&prefix={prefix}"), &[])
            .await
            .expect("list a bucket");
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
        let text = String::from_utf8(body).unwrap();
        text.split("<Key>").skip(1).filter_map(|s| s.split_once("</Key>")).map(|(key, _)| key.to_owned()).collect()
    }

    /// The variables that point Reelay's object storage at `s3://bucket/prefix` here.
    pub fn env(&self, bucket: &str, prefix: &str) -> Vec<(String, String)> {
        vec![
            ("REELAY_OBJECTS_URL".into(), format!("s3://{bucket}/{prefix}")),
            ("REELAY_OBJECTS_S3_ENDPOINT".into(), self.endpoint()),
            ("REELAY_OBJECTS_S3_REGION".into(), S3_REGION.into()),
            ("REELAY_OBJECTS_S3_ACCESS_KEY_ID".into(), S3_ACCESS_KEY_ID.into()),
            ("REELAY_OBJECTS_S3_SECRET_ACCESS_KEY".into(), S3_SECRET_ACCESS_KEY.into()),
        ]
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for MotoServer {
    fn drop(&mut self) {
        signal(self.child.id(), "KILL");
        let _ = self.child.wait();
    }
}

/// One HTTP/1.1 request to `base` (`http://host:port`) with `Connection: close`; the status and
/// the body. Enough for tests: no TLS, no chunked uploads.
pub async fn http(method: &str, base: &str, path: &str, headers: &[(&str, &str)]) -> std::io::Result<(u16, Vec<u8>)> {
    let host = base.strip_prefix("http://").expect("an http:// base").trim_end_matches('/');
    let host = host.split('/').next().unwrap();
    let mut stream = tokio::net::TcpStream::connect(host).await?;
    let mut request = format!("{method} {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\nContent-Length: 0\r\n");
    for (name, value) in headers {
        request.push_str(&format!("{name}: {value}\r\n"));
    }
    request.push_str("\r\n");
    stream.write_all(request.as_bytes()).await?;
    let mut response = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), stream.read_to_end(&mut response))
        .await
        .map_err(|_| std::io::Error::other("no answer within 30 s"))??;
    let split =
        response.windows(4).position(|w| w == b"\r\n\r\n").ok_or_else(|| std::io::Error::other("no end of headers"))?;
    let head = String::from_utf8_lossy(&response[..split]).to_string();
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("no status in {head:?}")))?;
    let mut body = response[split + 4..].to_vec();
    if head.to_ascii_lowercase().contains("transfer-encoding: chunked") {
        body = dechunk(&body);
    }
    Ok((status, body))
}

/// Decodes a chunked body.
fn dechunk(mut data: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(line_end) = data.windows(2).position(|w| w == b"\r\n") {
        let size = std::str::from_utf8(&data[..line_end])
            .ok()
            .and_then(|s| usize::from_str_radix(s.split(';').next().unwrap().trim(), 16).ok())
            .unwrap_or(0);
        if size == 0 {
            break;
        }
        let start = line_end + 2;
        out.extend_from_slice(&data[start..(start + size).min(data.len())]);
        data = &data[(start + size + 2).min(data.len())..];
    }
    out
}

/// GETs a full URL (`http://host:port/path`).
pub async fn http_get(url: &str) -> std::io::Result<(u16, Vec<u8>)> {
    let rest = url.strip_prefix("http://").expect("an http:// URL");
    let (host, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    http("GET", &format!("http://{host}"), if path.is_empty() { "/" } else { path }, &[]).await
}
