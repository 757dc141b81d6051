//! A real S3-compatible server for object-storage tests: moto's server mode (`moto[server]`,
//! installed pinned by `scripts/install-moto`), on a free port, stopped by PID.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::{PORT_TRIES, free_port, http_request, listens_on, port_taken, signal};

pub const S3_ACCESS_KEY_ID: &str = "reelay-test-key";
pub const S3_SECRET_ACCESS_KEY: &str = "reelay-test-secret";
pub const S3_REGION: &str = "us-east-1";

/// Where `scripts/install-moto` put moto: `MOTO_DIR`, else the repo's `.tools` (the script is
/// run, once per test process).
fn moto_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("MOTO_DIR") {
        return dir.into();
    }
    static INSTALLED: OnceLock<PathBuf> = OnceLock::new();
    INSTALLED
        .get_or_init(|| {
            let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
            let output = Command::new(root.join("scripts/install-moto"))
                .stderr(Stdio::inherit())
                .output()
                .expect("run scripts/install-moto");
            assert!(output.status.success(), "scripts/install-moto failed");
            String::from_utf8(output.stdout).unwrap().trim().into()
        })
        .clone()
}

/// A running moto server.
pub struct MotoServer {
    child: Child,
    pub port: u16,
    log: PathBuf,
}

impl MotoServer {
    /// Starts moto on a free port, logging into `dir`, and waits until it answers. A port taken
    /// between choosing and binding it makes moto exit; it is then started on another.
    pub async fn start(dir: &Path) -> Self {
        Self::start_on(dir, free_port).await
    }

    /// Like [`MotoServer::start`], on the ports `ports` chooses.
    async fn start_on(dir: &Path, mut ports: impl FnMut() -> u16) -> Self {
        std::fs::create_dir_all(dir).unwrap();
        let moto = moto_dir();
        let log = dir.join("moto.log");
        for _ in 0..PORT_TRIES {
            let port = ports();
            let file = std::fs::File::create(&log).unwrap();
            let child = Command::new("python3")
                .args(["-m", "moto.server", "-H", "127.0.0.1", "-p", &port.to_string()])
                .env("PYTHONPATH", &moto)
                .stdin(Stdio::null())
                .stdout(file.try_clone().unwrap())
                .stderr(file)
                .spawn()
                .expect("spawn moto");
            let mut server = Self { child, port, log: log.clone() };
            let deadline = Instant::now() + Duration::from_secs(60);
            loop {
                if let Ok(Some(status)) = server.child.try_wait() {
                    let logged = server.log_text();
                    assert!(port_taken(&logged), "moto exited ({status}):\n{logged}");
                    break;
                }
                // Answering, and from this process (not another one on a port it failed to take).
                if tokio::net::TcpStream::connect(("127.0.0.1", port)).await.is_ok()
                    && (1..500).contains(&http_request("GET", &server.endpoint(), &[], b"").await.0)
                    && listens_on(server.child.id(), port)
                {
                    return server;
                }
                assert!(Instant::now() < deadline, "moto did not answer within 60 s\n{}", server.log_text());
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        panic!("moto found its port taken {PORT_TRIES} times");
    }

    /// The endpoint to configure (`REELAY_OBJECTS_S3_ENDPOINT`).
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Creates a bucket (moto accepts unsigned requests).
    pub async fn create_bucket(&self, bucket: &str) {
        let (status, _, body) = http_request("PUT", &format!("{}/{bucket}", self.endpoint()), &[], b"").await;
        assert!(status == 200, "creating bucket {bucket} answered {status}: {}", String::from_utf8_lossy(&body));
    }

    /// The keys in a bucket under `prefix`, from a ListObjectsV2 answer.
    pub async fn keys(&self, bucket: &str, prefix: &str) -> Vec<String> {
        let url = format!("{}/{bucket}?list-type=2&prefix={prefix}", self.endpoint());
        let (status, _, body) = http_request("GET", &url, &[], b"").await;
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

    /// The same store as [`MotoServer::env`], as settings for object storage opened in-process.
    pub fn settings(&self, bucket: &str, prefix: &str) -> reelay_objects::ObjectsSettings {
        reelay_objects::ObjectsSettings {
            url: Some(format!("s3://{bucket}/{prefix}")),
            s3_endpoint: Some(self.endpoint()),
            s3_region: S3_REGION.into(),
            s3_access_key_id: Some(S3_ACCESS_KEY_ID.into()),
            s3_secret_access_key: Some(S3_SECRET_ACCESS_KEY.into()),
        }
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

#[cfg(test)]
mod tests {
    use std::net::TcpListener;

    use super::*;

    /// Moto exits on a port another process listens on; it must be started on another one, not
    /// taken as ready because the other process answers.
    #[tokio::test]
    async fn moto_whose_port_is_taken_starts_on_a_fresh_one() {
        let dir = crate::temp_dir();
        // An HTTP server of this test's own holds the first port offered.
        let squatter = TcpListener::bind("127.0.0.1:0").unwrap();
        let held = squatter.local_addr().unwrap().port();
        std::thread::spawn(move || {
            use std::io::{Read, Write};
            for mut stream in squatter.incoming().flatten() {
                let _ = stream.read(&mut [0u8; 1024]);
                let _ = stream.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
            }
        });
        let mut offered = 0;
        let server = MotoServer::start_on(dir.path(), || {
            offered += 1;
            if offered == 1 { held } else { free_port() }
        })
        .await;
        assert_eq!(offered, 2, "the taken port is given up after one try");
        assert_ne!(server.port, held);
        server.create_bucket("fresh").await;
        assert!(server.keys("fresh", "").await.is_empty());
    }
}
