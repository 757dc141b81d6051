//! Command line and environment. Every setting can come from an environment variable (the same
//! names in every service and in `k8s/`); a flag overrides it. `run --service`, which picks
//! what a process is rather than how it behaves, is a flag only.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use reelay_kit::Service;
use reelay_outbox::Synchronous;

#[derive(Debug, Parser)]
#[command(name = "reelay", version, about = "Reelay: a film diary backend whose events are never lost.")]
pub struct Cli {
    /// Log format: `text` or `json` (anything else is refused, not taken for text).
    #[arg(
        long,
        env = "REELAY_LOG_FORMAT",
        default_value = "text",
        global = true,
        ignore_case = true,
        value_parser = clap::builder::PossibleValuesParser::new(["text", "json"])
    )]
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
    /// Run Reelay services (all of the backend's when no --service is given: the relay only with
    /// EVENT_BUS_BACKEND=nats).
    Run(Box<RunArgs>),
    /// Apply database migrations and exit.
    Migrate(MigrateArgs),
    /// Where the outbox and every handler stand (operator).
    Status(crate::commands::status::StatusArgs),
    /// Look into events (operator).
    #[command(subcommand)]
    Events(crate::commands::events::EventsCommand),
    /// List, replay or discard dead letters (operator).
    #[command(subcommand)]
    DeadLetters(crate::commands::dead_letters::DeadLettersCommand),
    /// Retire a handler no longer delivered to (operator).
    #[command(subcommand)]
    Handlers(crate::commands::handlers::HandlersCommand),
    /// Create users.
    #[command(subcommand)]
    Users(crate::commands::users::UsersCommand),
    /// Log reviews.
    #[command(subcommand)]
    Reviews(crate::commands::reviews::ReviewsCommand),
    /// Show films and what enrichment added.
    #[command(subcommand)]
    Movies(crate::commands::movies::MoviesCommand),
    /// Ask for a year in film.
    #[command(subcommand)]
    WrapUps(crate::commands::wrap_ups::WrapUpsCommand),
    /// Search what handlers indexed.
    #[command(subcommand)]
    Search(crate::commands::search::SearchCommand),
    /// Import from other services.
    #[command(subcommand)]
    Import(crate::commands::import::ImportCommand),
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
    /// A service to run; repeat for several. None means all the backend's services (the relay
    /// only on nats), in one process. (No variable: the command line says what a process is.)
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
    /// The variable takes true/false, 1/0, yes/no or on/off, as the other switches do.
    #[arg(long, env = "REELAY_DEV", value_parser = clap::builder::BoolishValueParser::new())]
    pub dev: bool,

    /// Where this process serves `/metrics` (Prometheus), `/healthz` and `/readyz` over HTTP.
    #[arg(long, env = "REELAY_METRICS_ADDR", default_value = "127.0.0.1:9464")]
    pub metrics_addr: SocketAddr,

    /// Largest gRPC message accepted or sent, in bytes.
    #[arg(long, env = "REELAY_GRPC_MAX_MESSAGE_BYTES", default_value_t = 4 * 1024 * 1024)]
    pub grpc_max_message_bytes: usize,

    /// The largest event a write may raise (encoded, in bytes). A write whose event would be
    /// larger is refused, since it could never be delivered: every event must fit a claim
    /// answer (REELAY_GRPC_MAX_MESSAGE_BYTES) and, on the nats backend, the broker's
    /// `max_payload` (1 MiB by default; the relay refuses to start on a smaller one). 1 byte to
    /// 1 GiB (the room for a claim and headers is added to it).
    #[arg(long, env = "REELAY_MAX_EVENT_BYTES", default_value_t = 1_000_000, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=1024 * 1024 * 1024))]
    pub max_event_bytes: usize,

    /// Deadline for a call that brings no shorter `grpc-timeout`, in milliseconds; also the
    /// deadline of this process's own calls. 2 s (twice an idle claim's 1 s wait, which a
    /// shorter deadline would cut) to an hour.
    #[arg(long, env = "REELAY_GRPC_TIMEOUT_MS", default_value_t = 30_000, value_parser = clap::value_parser!(u64).range(2_000..=3_600_000))]
    pub grpc_timeout_ms: u64,

    /// This process's name among Reelay's processes; it must be unique among live ones (a pod
    /// name). A process starting under a name takes back, at once, the claims an earlier run of
    /// the same name still held when it died. Defaults to `<hostname>:<data dir>`, or that with
    /// `/2`, `/3`, ... when live processes in the same data dir hold it; a name a live process
    /// holds in the same data dir is refused.
    #[arg(long, env = "REELAY_INSTANCE")]
    pub instance: Option<String>,

    /// How long the process keeps serving after SIGTERM, not ready, before it stops accepting
    /// calls and requests, in milliseconds: the time a load balancer takes to stop sending new
    /// connections once the pod is terminating (`k8s/` sets 5 s on the gateway's pods). Work in flight is finished after it as always; a second signal exits at once.
    /// 0 (the default) to 60 s.
    #[arg(long, env = "REELAY_SHUTDOWN_DELAY_MS", default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=60_000))]
    pub shutdown_delay_ms: u64,

    #[command(flatten)]
    pub delivery: DeliveryArgs,

    #[command(flatten)]
    pub handlers: HandlerArgs,

    #[command(flatten)]
    pub nats: NatsArgs,

    #[command(flatten)]
    pub gateway: GatewayArgs,
}

impl RunArgs {
    pub fn call_timeout(&self) -> Duration {
        Duration::from_millis(self.grpc_timeout_ms)
    }
}

/// A lease setting: shorter than a second, renewals would crowd the write service (or, at 0,
/// every claim could be taken over at once); longer than a day, a dead worker's events would
/// wait that long.
fn lease_ms() -> clap::builder::RangedU64ValueParser<u64> {
    clap::value_parser!(u64).range(1_000..=86_400_000)
}

/// How the outbox and the ledger deliver events (enforced by the write service).
#[derive(Debug, Clone, Args)]
pub struct DeliveryArgs {
    /// Deliveries of an event before it is given up (dead-lettered in SQLite; JetStream's
    /// `max_deliver`).
    #[arg(long, env = "EVENT_QUEUE_MAX_ATTEMPTS", default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub max_attempts: u32,

    /// A relay's claim on an outbox row not settled after this long is claimable again (a
    /// republish is dropped by the broker's dedup). 1 s to a day.
    #[arg(long, env = "REELAY_OUTBOX_LEASE_MS", default_value_t = 30_000, value_parser = lease_ms())]
    pub outbox_lease_ms: u64,

    /// A handler's claim on an event (a ledger claim, or a db-backend delivery) not renewed for
    /// this long may be taken over: its worker is presumed dead. Workers renew their claims
    /// every third of it while the handler runs. 1 s (renewals every 333 ms) to a day.
    #[arg(long, env = "REELAY_LEDGER_LEASE_MS", default_value_t = 30_000, value_parser = lease_ms())]
    pub ledger_lease_ms: u64,

    /// How long finished ledger rows are kept, in days: 1 to 3650. (They are what makes a
    /// redelivery of a finished event a no-op, and what tells a given-up delivery's outcome.)
    #[arg(long, env = "REELAY_LEDGER_RETENTION_DAYS", default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..=3650))]
    pub ledger_retention_days: u64,

    /// How often the write service purges outbox rows, ledger rows and request ids past
    /// retention. 100 ms (each purge is a job of the single writer) to a day.
    #[arg(long, env = "REELAY_LEDGER_PURGE_INTERVAL_MS", default_value_t = 60_000, value_parser = clap::value_parser!(u64).range(100..=86_400_000))]
    pub ledger_purge_interval_ms: u64,

    /// How long outbox rows every handler is finished with are kept, in seconds (7 days): 1 s
    /// to 10 years. Dead-lettered work is kept until an operator replays or discards it.
    #[arg(long, env = "REELAY_OUTBOX_RETENTION_SECS", default_value_t = 7 * 24 * 3600, value_parser = clap::value_parser!(u64).range(1..=315_360_000))]
    pub outbox_retention_secs: u64,

    /// How long a write's `request_id` answers a retry with the first call's answer, in hours:
    /// up to 10 years; 0 keeps a key only until the next purge (tests).
    #[arg(long, env = "REELAY_REQUEST_ID_RETENTION_HOURS", default_value_t = 24, value_parser = clap::value_parser!(u64).range(0..=87_600))]
    pub request_id_retention_hours: u64,

    /// How long the federation's records of activities taken in and sent, and of remote reviews
    /// deleted, are kept, in days: they make a peer's retry of an activity change nothing, and
    /// peers stop retrying within days. 1 to 3650.
    #[arg(long, env = "REELAY_FEDERATION_RETENTION_DAYS", default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..=3650))]
    pub federation_retention_days: u64,

    /// How long, in seconds, a remote server must fail every delivery (with no gap that long
    /// between two failures) before a fan-out to followers leaves its inboxes out, instead of
    /// giving each activity up there as a dead letter. An answer from the server, or an activity
    /// it sends, makes it available again. 7 days by default; 0 never leaves a server out; at
    /// most a year, and longer than REELAY_RETRY_CAP_MS plus REELAY_FEDERATION_TIMEOUT_MS (a
    /// retry's gap would start the count over every time; the handlers' processes should use
    /// the same values).
    #[arg(long, env = "REELAY_FEDERATION_UNAVAILABLE_AFTER_SECS", default_value_t = 7 * 86_400, value_parser = clap::value_parser!(u64).range(0..=365 * 86_400))]
    pub federation_unavailable_after_secs: u64,

    /// How often, in seconds, a fan-out to followers lets one delivery through to an unavailable
    /// server, to find out whether it is back (a failed probe is dropped, not retried). An hour
    /// by default; 1 to 7 days.
    #[arg(long, env = "REELAY_FEDERATION_PROBE_EVERY_SECS", default_value_t = 3600, value_parser = clap::value_parser!(u64).range(1..=7 * 86_400))]
    pub federation_probe_every_secs: u64,

    /// The first retry delay after a failed delivery; it doubles per attempt. Only tests
    /// should change it. 10 ms to an hour.
    #[arg(long, env = "REELAY_RETRY_BASE_MS", default_value_t = 5_000, value_parser = clap::value_parser!(u64).range(10..=3_600_000))]
    pub retry_base_ms: u64,

    /// The longest retry delay. 10 ms to a day.
    #[arg(long, env = "REELAY_RETRY_CAP_MS", default_value_t = 300_000, value_parser = clap::value_parser!(u64).range(10..=86_400_000))]
    pub retry_cap_ms: u64,
}

impl DeliveryArgs {
    pub fn retry(&self) -> reelay_domain::RetryPolicy {
        reelay_domain::RetryPolicy {
            base: Duration::from_millis(self.retry_base_ms),
            cap: Duration::from_millis(self.retry_cap_ms),
        }
    }
}

/// How the nats backend reaches the broker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum NatsMode {
    /// JetStream: durable, deduplicated, redelivered.
    Jetstream,
    /// Core NATS: fire and forget; no dedup, no redelivery.
    Core,
}

#[derive(Debug, Clone, Args)]
pub struct NatsArgs {
    /// The broker; a user and password or a token in it are never logged.
    #[arg(long, env = "NATS_URL", default_value = "nats://127.0.0.1:4222", hide_env_values = true)]
    pub nats_url: String,

    #[arg(long, env = "NATS_MODE", value_enum, default_value = "jetstream")]
    pub nats_mode: NatsMode,

    #[arg(long, env = "REELAY_STREAM", default_value = "REELAY_EVENTS")]
    pub stream: String,

    /// Events are published to `<prefix>.<event type>`.
    #[arg(long, env = "REELAY_SUBJECT_PREFIX", default_value = "reelay.events")]
    pub subject_prefix: String,

    /// Copies of the stream a NATS cluster keeps (3 in a 3-node cluster: a node's loss loses no
    /// acknowledged event); 1 on a single server.
    #[arg(long, env = "REELAY_STREAM_REPLICAS", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=5))]
    pub stream_replicas: u32,

    /// How long JetStream waits for a handler's ack before redelivering (handlers report
    /// progress while they work, so this bounds a dead handler, not a slow one). 1 s to a day.
    #[arg(long, env = "REELAY_ACK_WAIT_MS", default_value_t = 30_000, value_parser = clap::value_parser!(u64).range(1_000..=86_400_000))]
    pub ack_wait_ms: u64,

    /// Unacked messages one handler consumer may have out, including those waiting out a nak.
    /// 1 to 1000000 (JetStream reads 0 as its default and -1 as no limit).
    #[arg(long, env = "REELAY_MAX_ACK_PENDING", default_value_t = 10_000, value_parser = clap::value_parser!(i64).range(1..=1_000_000))]
    pub max_ack_pending: i64,

    /// The NATS monitoring endpoint, to check that the server fsyncs every write.
    #[arg(long, env = "REELAY_NATS_MONITOR_URL")]
    pub monitor_url: Option<String>,

    /// Rows the relay claims and publishes at once.
    #[arg(long, env = "REELAY_RELAY_BATCH", default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub relay_batch: u32,
}

/// Where events come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Backend {
    /// Handlers claim outbox rows through the write service's Outbox API (no broker).
    Db,
    /// The relay publishes the outbox to NATS JetStream; each handler is a durable consumer.
    Nats,
}

#[derive(Debug, Clone, Args)]
pub struct HandlerArgs {
    /// The event bus.
    #[arg(long, env = "EVENT_BUS_BACKEND", value_enum, default_value = "db")]
    pub backend: Backend,

    /// A handler to host (repeat, or comma-separate in the variable); none means every handler
    /// this build has. On the write service: the handlers it delivers to (each gets a delivery
    /// cursor before any write is taken).
    #[arg(long = "handler", value_name = "NAME", env = "REELAY_HANDLERS", value_delimiter = ',')]
    pub handlers: Vec<String>,

    /// Where the handlers service serves gRPC (the Search API).
    #[arg(long, env = "REELAY_HANDLERS_ADDR", default_value = "127.0.0.1:50052")]
    pub handlers_addr: SocketAddr,

    /// Where the handlers service serves stored media over HTTP (`GET /media/<key>`: wrap-up
    /// cards, posters).
    #[arg(long, env = "REELAY_MEDIA_ADDR", default_value = "127.0.0.1:50053")]
    pub media_addr: SocketAddr,

    /// The public base URL of the media route, for the links the API returns (a wrap-up's
    /// `card_url`); defaults to `http://<REELAY_MEDIA_ADDR>/media`.
    #[arg(long, env = "REELAY_MEDIA_URL")]
    pub media_url: Option<String>,

    /// How the handlers and relay services reach the write service; defaults to
    /// `http://<REELAY_WRITE_ADDR>`.
    #[arg(long, env = "REELAY_WRITE_URL")]
    pub write_url: Option<String>,

    /// Each handler's own settings.
    #[command(flatten)]
    pub settings: reelay_handlers::HandlerSettings,

    /// Events fetched and dispatched together.
    #[arg(long, env = "REELAY_CONSUMER_BATCH", default_value_t = 128, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub batch: u32,

    /// Batches a consumer works on at once (while fetching the next).
    #[arg(long, env = "REELAY_CONSUMER_IN_FLIGHT", default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub in_flight: u32,

    /// A handler's run of one event (of a batch, for a handler that batches) that takes longer
    /// fails (and is retried). 1 s to a day.
    #[arg(long, env = "REELAY_HANDLER_TIMEOUT_MS", default_value_t = 60_000, value_parser = clap::value_parser!(u64).range(1_000..=86_400_000))]
    pub handler_timeout_ms: u64,

    /// How long a batch's events are held, spending no attempt, while their handler says a
    /// dependency of it is down (its provider, the object store, its disk), trying
    /// again with a backoff from 1 s to 30 s; past it they fail as a retryable failure (an
    /// attempt spent). 0 (fail at once) to a week.
    #[arg(long, env = "REELAY_HANDLER_UNAVAILABLE_WAIT_MS", default_value_t = 3_600_000, value_parser = clap::value_parser!(u64).range(0..=604_800_000))]
    pub handler_unavailable_wait_ms: u64,
}

/// The ActivityPub gateway (its public origin is `REELAY_PUBLIC_URL`, shared with the
/// federation handlers).
#[derive(Debug, Clone, Args)]
pub struct GatewayArgs {
    /// Where the gateway serves HTTP.
    #[arg(long, env = "REELAY_GATEWAY_ADDR", default_value = "127.0.0.1:8080")]
    pub gateway_addr: SocketAddr,

    /// Largest inbox request body accepted, in bytes (413 above it): 1 KiB (less refuses every
    /// activity) to 64 MiB.
    #[arg(long, env = "REELAY_GATEWAY_MAX_BODY_BYTES", default_value_t = 1024 * 1024, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1024..=64 * 1024 * 1024))]
    pub gateway_max_body_bytes: usize,

    /// How long a remote signer's fetched key is trusted before it is fetched again, in seconds:
    /// a minute (less would fetch a key for nearly every activity, and a busy peer would meet the
    /// per-host fetch limit) to 30 days.
    #[arg(long, env = "REELAY_GATEWAY_KEY_TTL_SECS", default_value_t = 24 * 3600, value_parser = clap::value_parser!(u64).range(60..=30 * 24 * 3600))]
    pub gateway_key_ttl_secs: u64,
}

#[derive(Debug, Args)]
pub struct MigrateArgs {
    #[command(flatten)]
    pub database: DatabaseArgs,

    /// Stop after this migration version (to build a database at an older schema).
    #[arg(long)]
    pub to: Option<i64>,
}

/// The service token from its variable or its file (trimmed); `None` when neither is set. A
/// token must be at least 16 characters. Both set is refused: which one is meant cannot be
/// told (a variable left behind after the file's secret was rotated keeps the old token).
pub fn read_service_token(token: Option<&str>, file: Option<&std::path::Path>) -> anyhow::Result<Option<String>> {
    let token = match (token, file) {
        (Some(_), Some(path)) => anyhow::bail!(
            "both REELAY_SERVICE_TOKEN and REELAY_SERVICE_TOKEN_FILE ({}) are set; set one",
            path.display()
        ),
        (Some(token), None) => Some(token.trim().to_owned()),
        (None, Some(path)) => Some(
            std::fs::read_to_string(path)
                .map_err(|e| anyhow::anyhow!("cannot read the service token file {}: {e}", path.display()))?
                .trim()
                .to_owned(),
        ),
        (None, None) => None,
    };
    match token {
        Some(token) if token.len() < 16 => anyhow::bail!("the service token must be at least 16 characters"),
        token => Ok(token),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A search's --limit out of 1..=100 is refused before any call, as its help says.
    #[test]
    fn a_search_limit_is_checked() {
        use clap::Parser;
        for limit in ["0", "101"] {
            let parsed = Cli::try_parse_from(["reelay", "search", "reviews", "heat", "--limit", limit]);
            let error = parsed.map(drop).unwrap_err().to_string();
            assert!(error.contains("--limit"), "{limit}: {error}");
        }
        assert!(Cli::try_parse_from(["reelay", "search", "reviews", "heat", "--limit", "100"]).is_ok());
    }

    /// Settings that broke a run at 0, below 0 or near the integer's top (an overflow panic at
    /// start, every poster download timing out, every inbox body refused) are refused when
    /// parsed, naming the flag and what it accepts; their defaults parse.
    #[test]
    fn run_settings_out_of_range_are_refused() {
        use clap::Parser;
        for (flag, value, accepted) in [
            ("--max-event-bytes", "18446744073709551615", "1073741824"),
            ("--max-event-bytes", "0", "1073741824"),
            ("--max-ack-pending", "-1", "1000000"),
            ("--max-ack-pending", "0", "1000000"),
            ("--gateway-max-body-bytes", "0", "67108864"),
            ("--media-timeout-ms", "0", "600000"),
            ("--federation-backfill-pages", "0", "1000"),
            ("--gateway-key-ttl-secs", "0", "2592000"),
        ] {
            let parsed = Cli::try_parse_from(["reelay", "run", &format!("{flag}={value}")]);
            let error = parsed.map(drop).unwrap_err().to_string();
            assert!(error.contains(flag) && error.contains(accepted), "{flag} {value}: {error}");
        }
        assert!(Cli::try_parse_from(["reelay", "run"]).is_ok(), "the defaults are in range");
    }

    /// The clients' limits and deadlines are refused out of range before any call: a 0 deadline
    /// cancelled every call, a 0 limit meant 100 and one over 1000 was refused by the service.
    #[test]
    fn client_limits_and_deadlines_are_checked() {
        use clap::Parser;
        for args in [
            &["dead-letters", "list", "--limit", "0"][..],
            &["dead-letters", "list", "--limit", "1001"],
            &["status", "--grpc-timeout-ms", "0"],
            &["search", "reviews", "heat", "--grpc-timeout-ms", "3600001"],
            &["dead-letters", "list", "--since", "30000d"],
            &["dead-letters", "list", "--since", "999999999999999d"],
        ] {
            let parsed = Cli::try_parse_from(std::iter::once("reelay").chain(args.iter().copied()));
            let error = parsed.map(drop).unwrap_err().to_string();
            let flag = args.iter().rev().nth(1).unwrap();
            assert!(error.contains(flag), "{args:?}: {error}");
        }
        for args in [
            &["dead-letters", "list", "--limit", "1000", "--since", "7d"][..],
            &["wrap-ups", "request", "--user", "u", "--year", "2024", "--wait-secs", "0"],
        ] {
            assert!(Cli::try_parse_from(std::iter::once("reelay").chain(args.iter().copied())).is_ok(), "{args:?}");
        }
    }

    #[test]
    fn the_service_token_comes_from_one_place() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("token");
        std::fs::write(&file, "a-token-of-the-file\n").unwrap();
        assert_eq!(read_service_token(None, Some(&file)).unwrap().as_deref(), Some("a-token-of-the-file"));
        assert_eq!(
            read_service_token(Some(" a-token-of-the-variable "), None).unwrap().as_deref(),
            Some("a-token-of-the-variable")
        );
        let both = read_service_token(Some("a-token-of-the-variable"), Some(&file)).unwrap_err().to_string();
        assert!(both.contains("both REELAY_SERVICE_TOKEN and REELAY_SERVICE_TOKEN_FILE"), "{both}");
        assert!(read_service_token(Some("short"), None).is_err());
        assert_eq!(read_service_token(None, None).unwrap(), None);
    }
}
