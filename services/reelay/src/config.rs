//! Command line and environment. Every setting can come from an environment variable (the same
//! names in every service and in `k8s/`); a flag overrides it.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use reelay_outbox::Synchronous;
use reelay_runtime::Service;

#[derive(Debug, Parser)]
#[command(name = "reelay", version, about = "Reelay: a film diary backend whose events are never lost.")]
pub struct Cli {
    /// Log format: `text` or `json`.
    #[arg(long, env = "REELAY_LOG_FORMAT", default_value = "text", global = true)]
    pub log_format: String,

    #[command(subcommand)]
    pub command: Command,
}

impl Cli {
    pub fn log_json(&self) -> bool {
        self.log_format.eq_ignore_ascii_case("json")
    }
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run Reelay services (all of them when no --service is given).
    Run(RunArgs),
    /// Apply database migrations and exit.
    Migrate(MigrateArgs),
}

#[derive(Debug, Clone, Args)]
pub struct DatabaseArgs {
    /// Directory for Reelay's data (the SQLite file by default).
    #[arg(long, env = "REELAY_DATA_DIR", default_value = "data")]
    pub data_dir: PathBuf,

    /// The SQLite database file; defaults to `<data-dir>/reelay.db`.
    #[arg(long, env = "REELAY_DATABASE")]
    pub database: Option<PathBuf>,

    /// `full` (default: fsync every commit, no acknowledged write is lost on power failure) or
    /// `normal` (faster; a power failure may lose the last commits, a process crash loses none).
    #[arg(long, env = "REELAY_SQLITE_SYNCHRONOUS", default_value = "full")]
    pub sqlite_synchronous: Synchronous,
}

impl DatabaseArgs {
    pub fn database_path(&self) -> PathBuf {
        self.database.clone().unwrap_or_else(|| self.data_dir.join("reelay.db"))
    }
}

#[derive(Debug, Args)]
pub struct RunArgs {
    /// A service to run; repeat for several. None means all of them, in one process.
    #[arg(long = "service", value_name = "SERVICE")]
    pub services: Vec<Service>,

    #[command(flatten)]
    pub database: DatabaseArgs,

    /// Where the write service serves gRPC.
    #[arg(long, env = "REELAY_WRITE_ADDR", default_value = "127.0.0.1:50051")]
    pub write_addr: SocketAddr,

    /// Shared secret every internal call must present as `authorization: Bearer <token>`.
    #[arg(long, env = "REELAY_SERVICE_TOKEN", hide_env_values = true)]
    pub service_token: Option<String>,

    /// File holding the service token (e.g. a mounted Kubernetes secret).
    #[arg(long, env = "REELAY_SERVICE_TOKEN_FILE")]
    pub service_token_file: Option<PathBuf>,

    /// Development mode: allow running without a service token (calls are not authenticated).
    #[arg(long, env = "REELAY_DEV")]
    pub dev: bool,

    /// Largest gRPC message accepted or sent, in bytes.
    #[arg(long, env = "REELAY_GRPC_MAX_MESSAGE_BYTES", default_value_t = 4 * 1024 * 1024)]
    pub grpc_max_message_bytes: usize,

    /// Deadline for a call that brings no shorter `grpc-timeout`, in milliseconds.
    #[arg(long, env = "REELAY_GRPC_TIMEOUT_MS", default_value_t = 30_000)]
    pub grpc_timeout_ms: u64,
}

impl RunArgs {
    pub fn call_timeout(&self) -> Duration {
        Duration::from_millis(self.grpc_timeout_ms)
    }
}

#[derive(Debug, Args)]
pub struct MigrateArgs {
    #[command(flatten)]
    pub database: DatabaseArgs,

    /// Stop after this migration version (to build a database at an older schema).
    #[arg(long)]
    pub to: Option<i64>,
}
