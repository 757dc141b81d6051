//! A Reelay deployment for one test, shaped like a cluster: a write service, the relay and a
//! nats-server on the nats backend, and any number of handlers processes, each with its own
//! data dir and settings. Probe handlers count their effects in one file for the whole cluster.
//!
//! ```ignore
//! let cluster = Cluster::builder(BIN, Backend::Db).probes("probe-a,probe-b").handlers(&[]).start(dir).await;
//! ```

use std::path::{Path, PathBuf};

use crate::{NatsServer, Reelay};

/// Where events travel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Db,
    Nats,
}

pub struct ClusterBuilder {
    binary: String,
    backend: Backend,
    env: Vec<(String, String)>,
    database: Option<PathBuf>,
    write_log: Option<PathBuf>,
    handlers: Vec<Vec<(String, String)>>,
    nats_config: String,
}

impl ClusterBuilder {
    /// A variable for every process of the cluster.
    pub fn env(mut self, key: &str, value: &str) -> Self {
        self.env.push((key.into(), value.into()));
        self
    }

    /// The probe handlers the cluster has (the write service registers them; every handlers
    /// process hosts them unless it picks a subset with `REELAY_HANDLERS`).
    pub fn probes(self, probes: &str) -> Self {
        self.env("REELAY_PROBE_HANDLERS", probes)
    }

    /// Puts the database somewhere else than the cluster's dir (a small tmpfs, say).
    pub fn database(mut self, path: &Path) -> Self {
        self.database = Some(path.to_owned());
        self
    }

    /// Keeps the write service's log off the database's disk.
    pub fn write_log(mut self, path: &Path) -> Self {
        self.write_log = Some(path.to_owned());
        self
    }

    /// Adds `config` to nats-server's configuration (nats backend).
    pub fn nats_config(mut self, config: &str) -> Self {
        self.nats_config = config.into();
        self
    }

    /// Adds a handlers process with these variables on top of the cluster's.
    pub fn handlers(mut self, env: &[(&str, &str)]) -> Self {
        self.handlers.push(env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect());
        self
    }

    pub async fn start(self, dir: &Path) -> Cluster {
        let bin = self.binary.as_str();
        let effects = dir.join("effects.db");
        let nats =
            (self.backend == Backend::Nats).then(|| NatsServer::start_with(&dir.join("nats"), &self.nats_config));
        let mut env = vec![("REELAY_PROBE_DB".to_owned(), effects.to_str().unwrap().to_owned())];
        if let Some(nats) = &nats {
            env.push(("EVENT_BUS_BACKEND".into(), "nats".into()));
            env.push(("NATS_URL".into(), nats.url()));
            env.push(("REELAY_NATS_MONITOR_URL".into(), nats.monitor_url()));
        }
        env.extend(self.env);
        let db = self.database.unwrap_or_else(|| dir.join("reelay.db"));
        let mut spec = Reelay::spec(bin, &db, &["write"], &[]);
        spec.env = env.clone();
        if let Some(log) = self.write_log {
            spec.log = log;
        }
        let write = Reelay::start(spec).await;
        let relay = match self.backend {
            Backend::Db => None,
            Backend::Nats => {
                let mut spec = Reelay::spec(bin, &dir.join("relay").join("unused.db"), &["relay"], &[]);
                spec.env = env.clone();
                spec.env.push(("REELAY_WRITE_URL".into(), format!("http://{}", write.addr)));
                Some(Reelay::start(spec).await)
            }
        };
        let mut handlers = Vec::new();
        for (n, extra) in self.handlers.into_iter().enumerate() {
            let mut all = env.clone();
            all.extend(extra);
            let all: Vec<(&str, &str)> = all.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
            handlers.push(Reelay::start_handlers(bin, &write, &dir.join(format!("handlers-{n}")), &all).await);
        }
        Cluster { backend: self.backend, binary: self.binary, env, db, effects, nats, write, relay, handlers }
    }
}

pub struct Cluster {
    pub backend: Backend,
    binary: String,
    /// The variables of every process.
    env: Vec<(String, String)>,
    pub db: PathBuf,
    /// The probes' effects file.
    pub effects: PathBuf,
    pub nats: Option<NatsServer>,
    pub write: Reelay,
    pub relay: Option<Reelay>,
    pub handlers: Vec<Reelay>,
}

impl Cluster {
    /// A cluster of the `reelay` binary at `binary` (a test's `CARGO_BIN_EXE_reelay`).
    pub fn builder(binary: &str, backend: Backend) -> ClusterBuilder {
        ClusterBuilder {
            binary: binary.into(),
            backend,
            env: Vec::new(),
            database: None,
            write_log: None,
            handlers: Vec::new(),
            nats_config: String::new(),
        }
    }

    /// Runs a client command of the binary against the cluster: the write service, the first
    /// handlers process (search) and the broker.
    pub async fn cli(&self, args: &[&str]) -> crate::CliOutput {
        let mut env = Vec::new();
        if let Some(nats) = &self.nats {
            env.push(("NATS_URL".to_owned(), nats.url()));
        }
        if let Some(handlers) = self.handlers.first() {
            env.push(("REELAY_HANDLERS_URL".to_owned(), format!("http://{}", handlers.handlers_addr)));
        }
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        self.write.cli(args, &env).await
    }

    /// Starts one more handlers process, in `data_dir`, with these variables on top of the
    /// cluster's; it is the last of `handlers`.
    pub async fn add_handlers(&mut self, data_dir: &Path, env: &[(&str, &str)]) {
        let all: Vec<(&str, &str)> =
            self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())).chain(env.iter().copied()).collect();
        self.handlers.push(Reelay::start_handlers(&self.binary, &self.write, data_dir, &all).await);
    }

    /// Stops every process with SIGTERM (each must exit cleanly), consumers first.
    pub async fn stop(mut self) {
        for handlers in &mut self.handlers {
            handlers.stop().await;
        }
        if let Some(relay) = &mut self.relay {
            relay.stop().await;
        }
        self.write.stop().await;
    }
}
