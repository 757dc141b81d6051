//! A real `nats-server` per test: a free port, a temp store, `sync_interval: always`, and
//! controls to kill, pause (SIGSTOP), resume and restart it on the same port and store.

use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::{PORT_TRIES, free_port, port_taken, signal};

/// The pinned server installed by `scripts/install-nats-server` (which `scripts/test` runs and
/// exports as `NATS_SERVER_BIN`); without the variable the script is run, once per test process.
pub fn nats_server_binary() -> PathBuf {
    if let Some(path) = std::env::var_os("NATS_SERVER_BIN") {
        return path.into();
    }
    static INSTALLED: OnceLock<PathBuf> = OnceLock::new();
    INSTALLED
        .get_or_init(|| {
            let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
            let script = root.join("scripts/install-nats-server");
            let out = Command::new(&script).output().unwrap_or_else(|e| panic!("run {}: {e}", script.display()));
            assert!(out.status.success(), "{} failed:\n{}", script.display(), String::from_utf8_lossy(&out.stderr));
            PathBuf::from(
                String::from_utf8_lossy(&out.stdout).trim().lines().last().expect("the script prints the binary path"),
            )
        })
        .clone()
}

pub struct NatsServer {
    child: Option<Child>,
    pub port: u16,
    pub monitor_port: u16,
    config: PathBuf,
    pub log: PathBuf,
}

impl NatsServer {
    /// Starts a JetStream-enabled server storing under `dir`.
    pub fn start(dir: &Path) -> Self {
        Self::start_on(dir, || (free_port(), free_port()))
    }

    /// Like [`NatsServer::start`], with `config` added to the server's configuration (an
    /// account with JetStream limits, say).
    pub fn start_with(dir: &Path, config: &str) -> Self {
        Self::start_configured(dir, config, || (free_port(), free_port()))
    }

    /// Like [`NatsServer::start`], on the (client, monitor) ports `ports` chooses, asked again
    /// while the chosen ones turn out taken.
    fn start_on(dir: &Path, ports: impl FnMut() -> (u16, u16)) -> Self {
        Self::start_configured(dir, "", ports)
    }

    fn start_configured(dir: &Path, extra: &str, mut ports: impl FnMut() -> (u16, u16)) -> Self {
        std::fs::create_dir_all(dir).unwrap();
        let store = dir.join("jetstream");
        on_fresh_ports("nats-server", || {
            let (port, monitor_port) = ports();
            let config = dir.join("nats.conf");
            std::fs::write(
                &config,
                format!(
                    "listen: 127.0.0.1:{port}\nhttp: 127.0.0.1:{monitor_port}\n\
                     jetstream {{\n  store_dir: \"{}\"\n  sync_interval: always\n}}\n{extra}\n",
                    store.display()
                ),
            )
            .unwrap();
            let mut server = Self { child: None, port, monitor_port, config, log: dir.join("nats.log") };
            server.try_launch().map(|()| server)
        })
    }

    /// Starts a JetStream cluster of `nodes` servers routed to each other on loopback, each
    /// storing under `dir/n<i>` (as the cluster overlay runs NATS: file store, every write
    /// fsynced), and waits until it has a meta leader, so streams can be replicated on it.
    pub fn start_cluster(dir: &Path, nodes: usize) -> Vec<Self> {
        let servers = on_fresh_ports("the NATS cluster", || Self::try_cluster(dir, nodes));
        let deadline = Instant::now() + Duration::from_secs(30);
        while !servers.iter().all(Self::has_meta_leader) {
            assert!(Instant::now() < deadline, "the NATS cluster elected no meta leader in 30 s");
            std::thread::sleep(Duration::from_millis(100));
        }
        servers
    }

    /// Launches every node of a cluster on fresh ports and empty stores. On failure the nodes
    /// already running are stopped (dropped).
    fn try_cluster(dir: &Path, nodes: usize) -> Result<Vec<Self>, Launch> {
        let ports: Vec<(u16, u16, u16)> = (0..nodes).map(|_| (free_port(), free_port(), free_port())).collect();
        let routes: Vec<String> = ports.iter().map(|(_, _, route)| format!("nats-route://127.0.0.1:{route}")).collect();
        let mut servers = Vec::new();
        for (i, (port, monitor_port, route)) in ports.iter().copied().enumerate() {
            let node = dir.join(format!("n{i}"));
            // A failed attempt's store knows the old routes.
            let _ = std::fs::remove_dir_all(&node);
            std::fs::create_dir_all(&node).unwrap();
            let config = node.join("nats.conf");
            std::fs::write(
                &config,
                format!(
                    "server_name: n{i}\nlisten: 127.0.0.1:{port}\nhttp: 127.0.0.1:{monitor_port}\n\
                     jetstream {{\n  store_dir: \"{}\"\n  sync_interval: always\n}}\n\
                     cluster {{\n  name: test\n  listen: 127.0.0.1:{route}\n  routes: [{}]\n}}\n",
                    node.join("jetstream").display(),
                    routes.join(", ")
                ),
            )
            .unwrap();
            let mut server = Self { child: None, port, monitor_port, config, log: node.join("nats.log") };
            server.try_launch()?;
            servers.push(server);
        }
        Ok(servers)
    }

    /// Whether this server knows its cluster's JetStream meta leader (`/jsz`).
    fn has_meta_leader(&self) -> bool {
        use std::io::{Read, Write};
        let Ok(mut stream) = TcpStream::connect(("127.0.0.1", self.monitor_port)) else { return false };
        let _ = stream.write_all(b"GET /jsz HTTP/1.0\r\n\r\n");
        let mut body = String::new();
        let _ = stream.read_to_string(&mut body);
        body.split("\"meta_cluster\"")
            .nth(1)
            .is_some_and(|m| m.contains("\"leader\": \"n") || m.contains("\"leader\":\"n"))
    }

    /// Starts the process on this server's ports and waits until it says it is ready. A
    /// port taken by another process makes the server exit (it does not share a port), which
    /// is told apart from other failures so the caller can choose new ports.
    fn try_launch(&mut self) -> Result<(), Launch> {
        let logged_before = std::fs::metadata(&self.log).map_or(0, |m| m.len() as usize);
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&self.log).unwrap();
        let mut child = Command::new(nats_server_binary())
            .arg("-c")
            .arg(&self.config)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("start nats-server");
        let this_launch = || {
            let log = std::fs::read(&self.log).unwrap_or_default();
            String::from_utf8_lossy(log.get(logged_before..).unwrap_or_default()).into_owned()
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            // Readiness from the server's own log, not a connect: another process may be the
            // one listening on a port this server failed to take.
            let logged = this_launch();
            if let Ok(Some(status)) = child.try_wait() {
                let log = format!("exited ({status}):\n{logged}");
                return Err(if port_taken(&logged) { Launch::PortTaken(log) } else { Launch::Failed(log) });
            }
            if logged.contains("Server is ready") && TcpStream::connect(("127.0.0.1", self.port)).is_ok() {
                self.child = Some(child);
                return Ok(());
            }
            if Instant::now() >= deadline {
                let _ = child.kill();
                let _ = child.wait();
                return Err(Launch::Failed(format!("not ready in 20 s:\n{logged}")));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Starts the process again on the same ports (clients hold its address).
    fn launch(&mut self) {
        if let Err(Launch::PortTaken(log) | Launch::Failed(log)) = self.try_launch() {
            panic!("nats-server did not start again on port {}: {log}", self.port);
        }
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    pub fn monitor_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.monitor_port)
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().map(Child::id).expect("nats-server is running")
    }

    /// SIGKILL: the broker is gone until [`NatsServer::restart`].
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            signal(child.id(), "KILL");
            let _ = child.wait();
        }
    }

    /// SIGSTOP: the process is frozen; connections stay open but nothing answers.
    pub fn pause(&self) {
        signal(self.pid(), "STOP");
    }

    pub fn resume(&self) {
        signal(self.pid(), "CONT");
    }

    /// Starts again on the same port with the same store.
    pub fn restart(&mut self) {
        self.kill();
        self.launch();
    }
}

/// Why a launch failed: its ports were taken (worth new ones), or anything else.
enum Launch {
    PortTaken(String),
    Failed(String),
}

/// Runs `launch` (which chooses its own ports each time) until its ports are not taken.
fn on_fresh_ports<T>(what: &str, mut launch: impl FnMut() -> Result<T, Launch>) -> T {
    let mut taken = String::new();
    for _ in 0..PORT_TRIES {
        match launch() {
            Ok(started) => return started,
            Err(Launch::PortTaken(log)) => taken = log,
            Err(Launch::Failed(log)) => panic!("{what} did not start:\n{log}"),
        }
    }
    panic!("{what} found its ports taken {PORT_TRIES} times; last log:\n{taken}")
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        if let Some(child) = &self.child {
            signal(child.id(), "CONT");
        }
        self.kill();
    }
}

#[cfg(test)]
mod tests {
    use std::io::Read;
    use std::net::TcpListener;

    use super::*;

    /// A port another process holds makes the server exit; the harness must not mistake that
    /// process for the server (a connect to the port succeeds), and must try other ports.
    #[test]
    fn a_server_whose_port_is_taken_starts_on_fresh_ones() {
        let dir = crate::temp_dir();
        let squatter = TcpListener::bind("127.0.0.1:0").unwrap();
        let held = squatter.local_addr().unwrap().port();
        let mut offered = 0;
        let server = NatsServer::start_on(dir.path(), || {
            offered += 1;
            if offered == 1 { (held, free_port()) } else { (free_port(), free_port()) }
        });
        assert_eq!(offered, 2, "the taken port is given up after one try");
        assert_ne!(server.port, held);
        let log = std::fs::read_to_string(&server.log).unwrap();
        assert!(log.contains("address already in use"), "the first launch failed on the held port:\n{log}");
        // The one listening is a NATS server: it greets with INFO.
        let mut stream = TcpStream::connect(("127.0.0.1", server.port)).unwrap();
        let mut greeting = [0u8; 4];
        stream.read_exact(&mut greeting).unwrap();
        assert_eq!(&greeting, b"INFO");
        drop(squatter);
    }
}
