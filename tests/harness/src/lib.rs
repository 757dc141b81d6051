//! The end-to-end test harness.
//!
//! Starts the real `reelay` binary as a child process on a free port with its own temp
//! directory, waits until grpc.health.v1 reports it serving, hands out authenticated clients,
//! and stops it by PID (SIGTERM, or SIGKILL to simulate a crash). Each process's log is kept in
//! its temp dir and printed when a test fails; set `REELAY_KEEP_TEST_DIRS=1` to keep the dirs.
//! It also reads the SQLite file directly, to check what a call really committed.

mod cluster;
mod db;
mod faults;
pub mod images;
mod nats;
mod peer;
mod s3;
mod tmdb;

use reelay_contracts::v1;

use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tonic::metadata::MetadataValue;
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

pub use cluster::{Backend, Cluster, ClusterBuilder};
pub use db::{
    OutboxRow, ReviewLedger, Snapshot, dead_letters, event_ids, events_of, insert_foreign_event, outbox_rows,
    probe_records, query_strings, table_snapshot, unsettled,
};
pub use faults::{CuttingProxy, Strace, Tmpfs};
pub use nats::{NatsServer, nats_server_binary};
pub use s3::MotoServer;
pub use tmdb::{TMDB_API_KEY, TMDB_POSTER_WIDTH, TMDB_TOKEN, TmdbFilm, TmdbPerson, TmdbServer};
pub mod films {
    //! The films the TMDB test server knows.
    pub use crate::tmdb::{collateral, heat, people};
}
pub use peer::{MastodonPeer, Received, Spoil, get_json, http_request};

/// The token test processes are started with.
pub const TEST_TOKEN: &str = "test-service-token-0123456789";

/// Whether process `pid` holds a socket listening on TCP `port`: its socket descriptors'
/// inodes against the listening sockets of `/proc/net/tcp` and `tcp6`.
pub fn listens_on(pid: u32, port: u16) -> bool {
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else { return false };
    let sockets: std::collections::HashSet<String> = fds
        .filter_map(|fd| std::fs::read_link(fd.ok()?.path()).ok())
        .filter_map(|target| {
            let target = target.to_string_lossy().into_owned();
            Some(target.strip_prefix("socket:[")?.strip_suffix(']')?.to_owned())
        })
        .collect();
    const LISTEN: &str = "0A";
    ["/proc/net/tcp", "/proc/net/tcp6"].iter().any(|table| {
        std::fs::read_to_string(table).unwrap_or_default().lines().skip(1).any(|line| {
            // sl local_address rem_address st tx_queue:rx_queue tr:tm->when retrnsmt uid timeout inode
            let fields: Vec<&str> = line.split_whitespace().collect();
            let local_port =
                fields.get(1).and_then(|a| a.rsplit(':').next()).and_then(|p| u16::from_str_radix(p, 16).ok());
            fields.len() > 9 && fields[3] == LISTEN && local_port == Some(port) && sockets.contains(fields[9])
        })
    })
}

/// Launches tried on fresh ports when the chosen ones were taken between choosing and binding
/// them (by any server the harness starts).
pub const PORT_TRIES: usize = 5;

/// Whether a server's log says it could not bind a port another process holds.
pub fn port_taken(log: &str) -> bool {
    log.to_ascii_lowercase().contains("address already in use")
}

/// A port nobody listens on right now, below the kernel's ephemeral range where it can: a
/// process stopped and started again on its ports (a restart, a broker brought back) finds
/// them free, where a port of that range may have become an outgoing connection's source port
/// meanwhile (a restart failed so: "Address already in use" 50 ms after the process exited).
pub fn free_port() -> u16 {
    use std::hash::{BuildHasher, RandomState};
    const LOWEST: u16 = 10_000;
    let ephemeral_from = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32_768);
    let free = |port: u16| !DEFAULT_PORTS.contains(&port) && TcpListener::bind(("127.0.0.1", port)).is_ok();
    if ephemeral_from > LOWEST + 1_000 {
        for _ in 0..1_000 {
            // Random keys per RandomState (and per process: tests run in several), so
            // concurrent tests seldom try the same port.
            let random = RandomState::new().hash_one(std::process::id());
            let port = LOWEST + (random % u64::from(ephemeral_from - LOWEST)) as u16;
            if free(port) {
                return port;
            }
        }
    }
    loop {
        let port =
            TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).expect("find a free port");
        // Not one of `reelay run`'s default ports, which a test of the defaults binds.
        if !DEFAULT_PORTS.contains(&port) {
            return port;
        }
    }
}

/// The ports `reelay run` listens on when given none (gRPC 50051-50053, metrics 9464).
const DEFAULT_PORTS: [u16; 4] = [50051, 50052, 50053, 9464];

/// A temp dir that survives the test when `REELAY_KEEP_TEST_DIRS` is set.
pub fn temp_dir() -> tempfile::TempDir {
    let mut dir = tempfile::Builder::new().prefix("reelay-test-").tempdir().expect("create a temp dir");
    if std::env::var_os("REELAY_KEEP_TEST_DIRS").is_some() {
        eprintln!("keeping test dir {}", dir.path().display());
        dir.disable_cleanup(true);
    }
    dir
}

/// How to start one `reelay` process.
#[derive(Debug, Clone)]
pub struct ProcessSpec {
    pub binary: PathBuf,
    /// `--service` values; empty runs every service in one process.
    pub services: Vec<&'static str>,
    pub env: Vec<(String, String)>,
    pub database: PathBuf,
    /// The process's data dir (search index and other local state).
    pub data_dir: PathBuf,
    pub log: PathBuf,
}

impl ProcessSpec {
    fn runs(&self, service: &str) -> bool {
        self.services.is_empty() || self.services.contains(&service)
    }
}

/// A running `reelay run` process.
pub struct Reelay {
    child: Option<Child>,
    /// The write service's gRPC address (also what a handlers-only process is pointed at).
    pub addr: SocketAddr,
    /// The handlers service's gRPC address (the Search API).
    pub handlers_addr: SocketAddr,
    /// The handlers service's HTTP address for stored media (`GET /media/<key>`).
    pub media_addr: SocketAddr,
    /// The gateway's HTTP address; its public URL is `http://<gateway_addr>` unless the spec
    /// sets `REELAY_PUBLIC_URL`.
    pub gateway_addr: SocketAddr,
    /// The admin HTTP port: `/metrics`, `/healthz`, `/readyz`.
    pub metrics_addr: SocketAddr,
    pub database: PathBuf,
    pub log: PathBuf,
    spec: ProcessSpec,
}

fn local_addr() -> SocketAddr {
    format!("127.0.0.1:{}", free_port()).parse().unwrap()
}

/// The number of the next process's log file: unique within the test binary (two processes
/// sharing a data dir once drew the same free port for their log's name and wrote one file).
static NEXT_LOG: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

impl Reelay {
    /// The spec of a process over `database` that logs next to it. `env` adds or overrides
    /// environment variables.
    pub fn spec(binary: &str, database: &Path, services: &[&'static str], env: &[(&str, &str)]) -> ProcessSpec {
        let data_dir = database.parent().unwrap_or(Path::new(".")).to_owned();
        std::fs::create_dir_all(&data_dir).expect("create the process's data dir");
        let name = if services.is_empty() { "all".to_owned() } else { services.join("+") };
        ProcessSpec {
            binary: binary.into(),
            services: services.to_vec(),
            env: env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            database: database.to_owned(),
            log: data_dir.join(format!("{name}-{}.log", NEXT_LOG.fetch_add(1, std::sync::atomic::Ordering::Relaxed))),
            data_dir,
        }
    }

    /// Starts `reelay run --service write` on `database` and waits until it serves.
    pub async fn start_write(binary: &str, database: &Path, env: &[(&str, &str)]) -> Self {
        Self::start(Self::spec(binary, database, &["write"], env)).await
    }

    /// Starts every service in one process (the embedded default).
    pub async fn start_all(binary: &str, database: &Path, env: &[(&str, &str)]) -> Self {
        Self::start(Self::spec(binary, database, &[], env)).await
    }

    /// Starts a handlers-only process in `data_dir`, consuming from the write service `write`.
    pub async fn start_handlers(binary: &str, write: &Reelay, data_dir: &Path, env: &[(&str, &str)]) -> Self {
        let mut spec = Self::spec(binary, &data_dir.join("unused.db"), &["handlers"], env);
        spec.env.push(("REELAY_WRITE_URL".into(), format!("http://{}", write.addr)));
        Self::start(spec).await
    }

    /// Starts a process on fresh ports and waits until every service in it serves.
    pub async fn start(spec: ProcessSpec) -> Self {
        Self::start_on(spec, || [local_addr(), local_addr(), local_addr(), local_addr(), local_addr()]).await
    }

    /// Like [`Reelay::start`], on the addresses `addrs` chooses (write, handlers, media,
    /// gateway, admin), asked again while the chosen ones turn out taken.
    pub async fn start_on(spec: ProcessSpec, mut addrs: impl FnMut() -> [SocketAddr; 5]) -> Self {
        // A port can be taken between choosing and binding it; try a few.
        let mut last_error = String::new();
        for _ in 0..PORT_TRIES {
            match Self::launch(spec.clone(), addrs()).await {
                Ok(process) => return process,
                Err((error, log)) => {
                    last_error = error;
                    if !port_taken(&log) {
                        break;
                    }
                }
            }
        }
        panic!(
            "reelay did not start: {last_error}\n--- log ---\n{}",
            std::fs::read_to_string(&spec.log).unwrap_or_default()
        );
    }

    /// Starts the same process again: same database, environment and ports (so processes
    /// pointed at it find it again).
    pub async fn restart(&mut self) {
        self.kill();
        let fresh = Self::launch(self.spec.clone(), self.addrs())
            .await
            .unwrap_or_else(|(error, log)| panic!("reelay did not restart: {error}\n{log}"));
        *self = fresh;
    }

    /// Stops the process cleanly and starts it again with `env` set on top of its environment
    /// (a fault fixed, a setting changed), on the same ports.
    pub async fn restart_with(&mut self, env: &[(&str, &str)]) {
        self.stop().await;
        for (key, value) in env {
            self.spec.env.retain(|(k, _)| k != key);
            self.spec.env.push((key.to_string(), value.to_string()));
        }
        let fresh = Self::launch(self.spec.clone(), self.addrs())
            .await
            .unwrap_or_else(|(error, log)| panic!("reelay did not restart: {error}\n{log}"));
        *self = fresh;
    }

    /// The process's ports, to start it again on the same ones.
    fn addrs(&self) -> [SocketAddr; 5] {
        [self.addr, self.handlers_addr, self.media_addr, self.gateway_addr, self.metrics_addr]
    }

    async fn launch(
        spec: ProcessSpec,
        [addr, handlers_addr, media_addr, gateway_addr, metrics_addr]: [SocketAddr; 5],
    ) -> Result<Self, (String, String)> {
        let log_file = std::fs::OpenOptions::new().create(true).append(true).open(&spec.log).expect("open process log");
        let mut command = Command::new(&spec.binary);
        command.arg("run");
        for service in &spec.services {
            command.args(["--service", service]);
        }
        command
            .env("REELAY_DATABASE", &spec.database)
            .env("REELAY_DATA_DIR", &spec.data_dir)
            .env("REELAY_WRITE_ADDR", addr.to_string())
            .env("REELAY_HANDLERS_ADDR", handlers_addr.to_string())
            .env("REELAY_MEDIA_ADDR", media_addr.to_string())
            .env("REELAY_GATEWAY_ADDR", gateway_addr.to_string())
            .env("REELAY_PUBLIC_URL", format!("http://{gateway_addr}"))
            .env("REELAY_METRICS_ADDR", metrics_addr.to_string())
            .env("REELAY_SERVICE_TOKEN", TEST_TOKEN)
            // The tests' image hosts are on loopback (a test of the refusal sets it to false).
            .env("REELAY_MEDIA_ALLOW_PRIVATE", "true")
            .env("RUST_LOG", std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()))
            .stdin(Stdio::null())
            .stdout(log_file.try_clone().unwrap())
            .stderr(log_file);
        for (key, value) in &spec.env {
            command.env(key, value);
        }
        let child = command.spawn().expect("spawn reelay");
        let mut process = Reelay {
            child: Some(child),
            addr,
            handlers_addr,
            media_addr,
            gateway_addr,
            metrics_addr,
            database: spec.database.clone(),
            log: spec.log.clone(),
            spec,
        };
        let mut ready = Ok(());
        for (service, addr) in [("write", addr), ("handlers", handlers_addr), ("gateway", gateway_addr)] {
            if ready.is_ok() && process.spec.runs(service) {
                ready = process.wait_serving(service, addr, Duration::from_secs(30)).await;
            }
        }
        match ready {
            Ok(()) => Ok(process),
            Err(error) => {
                process.kill();
                let log = process.log_text();
                Err((error, log))
            }
        }
    }

    /// Whether the process is still alive (it may have exited on its own).
    pub fn is_running(&mut self) -> bool {
        self.child.as_mut().is_some_and(|child| matches!(child.try_wait(), Ok(None)))
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().map(Child::id).expect("process is running")
    }

    /// Waits until `service` at `addr` reports itself ready: grpc.health.v1 for the service's
    /// name, or the gateway's `/healthz`.
    async fn wait_serving(&mut self, service: &str, addr: SocketAddr, timeout: Duration) -> Result<(), String> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(child) = self.child.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                return Err(format!("exited early with {status}"));
            }
            // Serving, and by this process: a port taken between choosing and binding it may
            // be another test's server, which answers too (this process then exits, and the
            // launch is tried again on fresh ports).
            if Self::serving(service, addr).await
                && self.child.as_ref().is_some_and(|c| listens_on(c.id(), addr.port()))
            {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(format!("{service} not serving before the deadline"));
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    async fn serving(service: &str, addr: SocketAddr) -> bool {
        if service == "gateway" {
            let url = format!("http://{addr}/healthz");
            return tokio::net::TcpStream::connect(addr).await.is_ok()
                && matches!(
                    tokio::time::timeout(Duration::from_secs(5), http_request("GET", &url, &[], b"")).await,
                    Ok((200, _, _))
                );
        }
        let Ok(channel) = Endpoint::from_shared(format!("http://{addr}")).unwrap().connect().await else {
            return false;
        };
        // The service's own name: SERVING once it is ready (the process's, "", as soon as it
        // listens, which the handlers service does before its consumers are set up).
        let reply = HealthClient::new(channel).check(HealthCheckRequest { service: service.to_owned() }).await;
        reply.is_ok_and(|r| r.into_inner().status == ServingStatus::Serving as i32)
    }

    /// The gateway's public origin.
    pub fn public_url(&self) -> String {
        self.spec
            .env
            .iter()
            .find(|(k, _)| k == "REELAY_PUBLIC_URL")
            .map_or_else(|| format!("http://{}", self.gateway_addr), |(_, v)| v.clone())
    }

    /// The ActivityPub id of a local user.
    pub fn actor_url(&self, user_id: &str) -> String {
        format!("{}/users/{user_id}", self.public_url())
    }

    /// An authenticated channel to the process.
    pub async fn channel(&self) -> InterceptedService<Channel, Auth> {
        self.channel_with_token(Some(TEST_TOKEN)).await
    }

    pub async fn channel_with_token(&self, token: Option<&str>) -> InterceptedService<Channel, Auth> {
        Self::connect(self.addr, token).await
    }

    /// Clients for the write service's API reached through another address (a proxy).
    pub async fn clients_via(addr: SocketAddr) -> Clients {
        Clients::new(Self::connect(addr, Some(TEST_TOKEN)).await)
    }

    /// An authenticated channel to the handlers service (the Search API).
    pub async fn handlers_channel(&self) -> InterceptedService<Channel, Auth> {
        Self::connect(self.handlers_addr, Some(TEST_TOKEN)).await
    }

    async fn connect(addr: SocketAddr, token: Option<&str>) -> InterceptedService<Channel, Auth> {
        let channel = Endpoint::from_shared(format!("http://{addr}"))
            .unwrap()
            .timeout(Duration::from_secs(30))
            .connect()
            .await
            .expect("connect to reelay");
        InterceptedService::new(channel, Auth(token.map(|t| format!("Bearer {t}").parse().unwrap())))
    }

    /// SIGTERM, then wait for a clean exit. Panics if the process does not exit 0 in time.
    pub async fn stop(&mut self) {
        self.terminate();
        self.exits_cleanly_within(Duration::from_secs(20)).await;
    }

    /// SIGTERM, without waiting: the process begins its shutdown.
    pub fn terminate(&self) {
        if let Some(child) = &self.child {
            signal(child.id(), "TERM");
        }
    }

    /// Waits for the process to exit (after [`Reelay::terminate`]). Panics unless it exits 0
    /// within `limit`.
    pub async fn exits_cleanly_within(&mut self, limit: Duration) {
        let Some(mut child) = self.child.take() else { return };
        let deadline = Instant::now() + limit;
        loop {
            match child.try_wait().expect("wait for reelay") {
                Some(status) => {
                    assert!(status.success(), "reelay exited with {status}\n{}", self.log_text());
                    return;
                }
                None if Instant::now() > deadline => {
                    let _ = child.kill();
                    panic!("reelay did not stop within {limit:?} of SIGTERM\n{}", self.log_text());
                }
                None => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        }
    }

    /// SIGSTOP: frozen, its connections open but unanswered, until [`Reelay::resume`].
    pub fn pause(&self) {
        signal(self.pid(), "STOP");
    }

    pub fn resume(&self) {
        signal(self.pid(), "CONT");
    }

    /// SIGKILL: a crash, with no chance to clean up.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            signal(child.id(), "KILL");
            let _ = child.wait();
        }
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Whether the process logged a failed run of `handler` (one to be retried or given up), or
    /// its saying a dependency of it is unavailable (its events then held).
    pub fn logged_handler_failure(&self, handler: &str) -> bool {
        let span = format!("handler=\"{handler}\"");
        let failed = |l: &str| l.contains("handler failed") || l.contains("a dependency of the handler is unavailable");
        self.log_text().lines().any(|l| l.contains(&span) && failed(l))
    }

    /// GETs `path` from the process's admin HTTP port: the status code and the body.
    pub async fn admin_get(&self, path: &str) -> (u16, String) {
        http_get(self.metrics_addr, path).await
    }

    /// The process's metrics, scraped now.
    pub async fn metrics(&self) -> Metrics {
        let (code, body) = self.admin_get("/metrics").await;
        assert_eq!(code, 200, "/metrics answered {code}: {body}");
        Metrics(body)
    }

    /// Runs a client command of the binary (`reelay <args>`) against this process's services,
    /// with the test token; `env` adds variables.
    pub async fn cli(&self, args: &[&str], env: &[(&str, &str)]) -> CliOutput {
        let mut all = vec![
            ("REELAY_WRITE_URL".to_owned(), format!("http://{}", self.addr)),
            ("REELAY_HANDLERS_URL".to_owned(), format!("http://{}", self.handlers_addr)),
            ("REELAY_SERVICE_TOKEN".to_owned(), TEST_TOKEN.to_owned()),
            ("REELAY_OPERATOR".to_owned(), "test-operator".to_owned()),
        ];
        all.extend(env.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        run_cli(&self.spec.binary, args, &all).await
    }
}

/// What a client command printed, and how it exited.
#[derive(Debug, Clone)]
pub struct CliOutput {
    pub success: bool,
    pub stdout: String,
    pub stderr: String,
}

impl CliOutput {
    /// Panics with the output unless the command succeeded; returns stdout.
    pub fn ok(&self) -> &str {
        assert!(self.success, "the command failed\nstdout: {}\nstderr: {}", self.stdout, self.stderr);
        &self.stdout
    }
}

/// Runs `binary <args>` with `env` (and no inherited REELAY_ settings).
pub async fn run_cli(binary: &Path, args: &[&str], env: &[(String, String)]) -> CliOutput {
    let mut command = tokio::process::Command::new(binary);
    command.args(args).stdin(Stdio::null()).env("RUST_LOG", "warn");
    // A setting of the test's own environment (a toggle for the services it starts) must not
    // change what the command does.
    for (key, _) in std::env::vars_os() {
        if key.to_str().is_some_and(|key| key.starts_with("REELAY_")) {
            command.env_remove(key);
        }
    }
    for (key, value) in env {
        command.env(key, value);
    }
    let out = tokio::time::timeout(Duration::from_secs(120), command.output())
        .await
        .unwrap_or_else(|_| panic!("reelay {args:?} did not finish in 120 s"))
        .expect("run the reelay binary");
    CliOutput {
        success: out.status.success(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// A Prometheus text scrape.
#[derive(Debug, Clone)]
pub struct Metrics(pub String);

impl Metrics {
    /// The value of the sample `name{labels}` exactly as written (e.g.
    /// `reelay_dead_letters{handler="probe-a"}`); `None` when absent.
    pub fn value(&self, series: &str) -> Option<f64> {
        self.0.lines().find_map(|line| {
            let (name, value) = line.rsplit_once(' ')?;
            (name == series).then(|| value.parse().ok()).flatten()
        })
    }

    /// The sum of every sample of `name` whose labels contain each of `labels` (`k="v"`).
    pub fn sum(&self, name: &str, labels: &[&str]) -> f64 {
        self.0
            .lines()
            .filter(|l| !l.starts_with('#'))
            .filter_map(|line| {
                let (series, value) = line.rsplit_once(' ')?;
                let (metric, rest) = series.split_once('{').unwrap_or((series, ""));
                (metric == name && labels.iter().all(|l| rest.contains(l))).then(|| value.parse::<f64>().ok()).flatten()
            })
            .sum()
    }

    /// Whether the scrape declares `name` (its `# TYPE` line).
    pub fn declares(&self, name: &str) -> bool {
        self.0.lines().any(|l| l.starts_with(&format!("# TYPE {name} ")))
    }
}

/// Every file under `dir` (none when it does not exist), as paths.
pub fn files_under(dir: &Path) -> Vec<String> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if path.is_dir() {
            files.extend(files_under(&path));
        } else {
            files.push(path.display().to_string());
        }
    }
    files
}

/// Runs `binary run --service <service>` over `database` and `data_dir` on fresh ports, as a
/// process that should refuse to start: its exit code and what it printed on stderr.
pub async fn refused_at_start(
    binary: &Path,
    service: &str,
    database: &Path,
    data_dir: &Path,
    env: &[(&str, &str)],
) -> (Option<i32>, String) {
    let port = || format!("127.0.0.1:{}", free_port());
    let process = tokio::process::Command::new(binary)
        .args(["run", "--service", service, "--dev"])
        .env("REELAY_DATABASE", database)
        .env("REELAY_DATA_DIR", data_dir)
        .env("REELAY_WRITE_ADDR", port())
        .env("REELAY_HANDLERS_ADDR", port())
        .env("REELAY_MEDIA_ADDR", port())
        .env("REELAY_GATEWAY_ADDR", port())
        .env("REELAY_METRICS_ADDR", port())
        // The caller's settings win, an address among them.
        .envs(env.iter().copied())
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(30), process).await.expect("the process exits").unwrap();
    (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
}

/// [`http_get`], or `None` when nothing answers at `addr` (yet).
pub async fn try_http_get(addr: SocketAddr, path: &str) -> Option<(u16, String)> {
    tokio::net::TcpStream::connect(addr).await.ok()?;
    Some(http_get(addr, path).await)
}

/// A minimal HTTP/1.1 GET: the status code and the body.
pub async fn http_get(addr: SocketAddr, path: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap_or_else(|e| panic!("connect to {addr}: {e}"));
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut response))
        .await
        .unwrap_or_else(|_| panic!("GET {addr}{path} timed out"))
        .unwrap();
    let text = String::from_utf8_lossy(&response);
    let (head, body) = text.split_once("\r\n\r\n").expect("an HTTP response");
    let code = head.split_whitespace().nth(1).and_then(|c| c.parse().ok()).expect("an HTTP status");
    (code, body.to_owned())
}

impl Drop for Reelay {
    fn drop(&mut self) {
        if let Some(child) = &self.child {
            signal(child.id(), "CONT");
            self.kill();
        }
        if std::thread::panicking() {
            eprintln!("--- reelay log ({}) ---\n{}", self.log.display(), self.log_text());
        }
    }
}

/// Sends signal `name` (`TERM`, `KILL`, `STOP`, `CONT`, `INT`) to `pid` with kill(2), not the
/// `kill` program (a fresh Debian may not have procps, and a failure went unseen: a SIGSTOP
/// fault that never happened passed its test). A process already gone is no failure.
pub fn signal(pid: u32, name: &str) {
    let number = match name {
        "TERM" => libc::SIGTERM,
        "KILL" => libc::SIGKILL,
        "STOP" => libc::SIGSTOP,
        "CONT" => libc::SIGCONT,
        "INT" => libc::SIGINT,
        other => panic!("no signal named {other}"),
    };
    let pid = libc::pid_t::try_from(pid).expect("a pid");
    // SAFETY: kill(2) takes any pid and signal number and only reports errors through errno.
    if unsafe { libc::kill(pid, number) } != 0 {
        let error = std::io::Error::last_os_error();
        assert_eq!(error.raw_os_error(), Some(libc::ESRCH), "SIG{name} to {pid}: {error}");
    }
}

/// Adds the service token to every call.
#[derive(Clone)]
pub struct Auth(Option<MetadataValue<tonic::metadata::Ascii>>);

impl Interceptor for Auth {
    fn call(&mut self, mut request: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(token) = &self.0 {
            request.metadata_mut().insert("authorization", token.clone());
        }
        Ok(request)
    }
}

/// The channel type every client uses.
pub type AuthedChannel = InterceptedService<Channel, Auth>;

/// One client per domain service, all over one connection.
#[derive(Clone)]
pub struct Clients {
    /// The connection every client shares, for calls the generated clients cannot make.
    pub channel: AuthedChannel,
    pub users: v1::users_client::UsersClient<AuthedChannel>,
    pub movies: v1::movies_client::MoviesClient<AuthedChannel>,
    pub reviews: v1::reviews_client::ReviewsClient<AuthedChannel>,
    pub watchlist: v1::watchlist_client::WatchlistClient<AuthedChannel>,
    pub wrap_ups: v1::wrap_ups_client::WrapUpsClient<AuthedChannel>,
    pub social: v1::social_client::SocialClient<AuthedChannel>,
    pub integrations: v1::integrations_client::IntegrationsClient<AuthedChannel>,
    pub federation: v1::federation_client::FederationClient<AuthedChannel>,
    pub outbox: v1::outbox_client::OutboxClient<AuthedChannel>,
    pub ledger: v1::ledger_client::LedgerClient<AuthedChannel>,
}

impl Clients {
    pub fn new(channel: AuthedChannel) -> Self {
        Self {
            channel: channel.clone(),
            users: v1::users_client::UsersClient::new(channel.clone()),
            movies: v1::movies_client::MoviesClient::new(channel.clone()),
            reviews: v1::reviews_client::ReviewsClient::new(channel.clone()),
            watchlist: v1::watchlist_client::WatchlistClient::new(channel.clone()),
            wrap_ups: v1::wrap_ups_client::WrapUpsClient::new(channel.clone()),
            social: v1::social_client::SocialClient::new(channel.clone()),
            integrations: v1::integrations_client::IntegrationsClient::new(channel.clone()),
            federation: v1::federation_client::FederationClient::new(channel.clone()),
            outbox: v1::outbox_client::OutboxClient::new(channel.clone()),
            ledger: v1::ledger_client::LedgerClient::new(channel),
        }
    }

    /// Creates a user with this handle and returns its id.
    pub async fn user(&mut self, handle: &str) -> String {
        self.users
            .create_user(v1::CreateUserRequest {
                handle: handle.into(),
                display_name: handle.to_uppercase(),
                ..Default::default()
            })
            .await
            .expect("create user")
            .into_inner()
            .user_id
    }

    /// Finds or creates a movie by title and year; returns its id.
    pub async fn movie(&mut self, actor: &str, title: &str, year: i32) -> String {
        self.movies
            .discover_movie(v1::DiscoverMovieRequest {
                actor_user_id: actor.to_owned(),
                title: title.into(),
                year,
                ..Default::default()
            })
            .await
            .expect("discover a movie")
            .into_inner()
            .movie
            .expect("the response carries the movie")
            .movie_id
    }

    /// Logs a review (no text, no date) and returns it.
    pub async fn review(&mut self, actor: &str, movie: Option<v1::MovieRef>, rating: u32) -> v1::Review {
        self.review_with_text(actor, movie, rating, "").await
    }

    /// Logs a review with its text and returns it.
    pub async fn review_with_text(
        &mut self,
        actor: &str,
        movie: Option<v1::MovieRef>,
        rating: u32,
        body: &str,
    ) -> v1::Review {
        self.reviews
            .log_review(v1::LogReviewRequest {
                actor_user_id: actor.to_owned(),
                movie,
                rating,
                body: body.to_owned(),
                ..Default::default()
            })
            .await
            .expect("log a review")
            .into_inner()
            .review
            .expect("the response carries the review")
    }

    /// Streams a Letterboxd export in 4 KiB chunks.
    pub async fn import(&mut self, actor: &str, csv: &[u8]) -> Result<v1::ImportDiaryResponse, tonic::Status> {
        self.import_with_request_id(actor, csv, "").await
    }

    /// Streams a Letterboxd export with an idempotency key on its first chunk.
    pub async fn import_with_request_id(
        &mut self,
        actor: &str,
        csv: &[u8],
        request_id: &str,
    ) -> Result<v1::ImportDiaryResponse, tonic::Status> {
        let chunks: Vec<v1::ImportDiaryChunk> = csv
            .chunks(4096)
            .enumerate()
            .map(|(i, data)| v1::ImportDiaryChunk {
                actor_user_id: if i == 0 { actor.to_owned() } else { String::new() },
                data: data.to_vec(),
                request_id: if i == 0 { request_id.to_owned() } else { String::new() },
            })
            .collect();
        self.integrations.import_diary(tokio_stream_iter(chunks)).await.map(tonic::Response::into_inner)
    }
}

fn tokio_stream_iter<T: Send + 'static>(
    items: Vec<T>,
) -> impl tonic::codegen::tokio_stream::Stream<Item = T> + Send + 'static {
    tonic::codegen::tokio_stream::iter(items)
}

impl Reelay {
    pub async fn clients(&self) -> Clients {
        Clients::new(self.channel().await)
    }
}

/// Polls `probe` until it returns true; panics after `limit`.
pub async fn eventually<F, Fut>(what: &str, limit: Duration, mut probe: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    eventually_some(what, limit, || {
        let done = probe();
        async move { done.await.then_some(()) }
    })
    .await
}

/// Polls `probe` until it gives a value, and returns it; panics after `limit`.
pub async fn eventually_some<T, F, Fut>(what: &str, limit: Duration, mut probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + limit;
    loop {
        if let Some(value) = probe().await {
            return value;
        }
        assert!(Instant::now() < deadline, "timed out after {limit:?} waiting until {what}");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// A title-and-year movie reference.
pub fn movie_ref(title: &str, year: i32) -> Option<v1::MovieRef> {
    Some(v1::MovieRef {
        by: Some(v1::movie_ref::By::TitleYear(v1::TitleYear { title: title.into(), year, external_id: String::new() })),
    })
}

pub fn movie_id_ref(id: &str) -> Option<v1::MovieRef> {
    Some(v1::MovieRef { by: Some(v1::movie_ref::By::MovieId(id.into())) })
}

pub fn user_account(id: &str) -> Option<v1::Account> {
    Some(v1::Account { kind: Some(v1::account::Kind::UserId(id.into())) })
}

pub fn actor_account(uri: &str) -> Option<v1::Account> {
    Some(v1::Account { kind: Some(v1::account::Kind::ActorUri(uri.into())) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_listening_socket_is_found_for_its_own_process_only() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        assert!(listens_on(std::process::id(), port));
        // Another process (pid 1) does not hold it; a port with nothing listening is nobody's.
        assert!(!listens_on(1, port));
        drop(listener);
        assert!(!listens_on(std::process::id(), port));
    }
}
