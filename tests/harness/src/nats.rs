//! A real `nats-server` per test: a free port, a temp store, `sync_interval: always`, and
//! controls to kill, pause (SIGSTOP), resume and restart it on the same port and store.

use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::{free_port, signal};

/// The pinned server installed by `scripts/install-nats-server` (which `scripts/test` runs and
/// exports as `NATS_SERVER_BIN`).
pub fn nats_server_binary() -> PathBuf {
    if let Some(path) = std::env::var_os("NATS_SERVER_BIN") {
        return path.into();
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let script = root.join("scripts/install-nats-server");
    let out = Command::new(&script).output().unwrap_or_else(|e| panic!("run {}: {e}", script.display()));
    assert!(out.status.success(), "{} failed:\n{}", script.display(), String::from_utf8_lossy(&out.stderr));
    PathBuf::from(
        String::from_utf8_lossy(&out.stdout).trim().lines().last().expect("the script prints the binary path"),
    )
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
        std::fs::create_dir_all(dir).unwrap();
        let (port, monitor_port) = (free_port(), free_port());
        let config = dir.join("nats.conf");
        let store = dir.join("jetstream");
        std::fs::write(
            &config,
            format!(
                "listen: 127.0.0.1:{port}\nhttp: 127.0.0.1:{monitor_port}\n\
                 jetstream {{\n  store_dir: \"{}\"\n  sync_interval: always\n}}\n",
                store.display()
            ),
        )
        .unwrap();
        let mut server = Self { child: None, port, monitor_port, config, log: dir.join("nats.log") };
        server.launch();
        server
    }

    /// Starts a JetStream cluster of `nodes` servers routed to each other on loopback, each
    /// storing under `dir/n<i>` (as the cluster overlay runs NATS: file store, every write
    /// fsynced), and waits until it has a meta leader, so streams can be replicated on it.
    pub fn start_cluster(dir: &Path, nodes: usize) -> Vec<Self> {
        let ports: Vec<(u16, u16, u16)> = (0..nodes).map(|_| (free_port(), free_port(), free_port())).collect();
        let routes: Vec<String> = ports.iter().map(|(_, _, route)| format!("nats-route://127.0.0.1:{route}")).collect();
        let mut servers = Vec::new();
        for (i, (port, monitor_port, route)) in ports.iter().copied().enumerate() {
            let node = dir.join(format!("n{i}"));
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
            server.launch();
            servers.push(server);
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        while !servers.iter().all(Self::has_meta_leader) {
            assert!(Instant::now() < deadline, "the NATS cluster elected no meta leader in 30 s");
            std::thread::sleep(Duration::from_millis(100));
        }
        servers
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

    fn launch(&mut self) {
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&self.log).unwrap();
        let child = Command::new(nats_server_binary())
            .arg("-c")
            .arg(&self.config)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("start nats-server");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(20);
        while TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "nats-server did not start:\n{}",
                std::fs::read_to_string(&self.log).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(20));
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

impl Drop for NatsServer {
    fn drop(&mut self) {
        if let Some(child) = &self.child {
            signal(child.id(), "CONT");
        }
        self.kill();
    }
}
