//! The command-line clients of the running services, one file per noun with its verbs:
//! operators' (`status`, `events explain`, `dead-letters list|replay|discard`, `handlers retire`, over the write
//! service's Admin API) and users' (`users create`, `reviews log`, `movies show`, `search reviews`,
//! `wrap-ups request`, `import letterboxd`, over the domain and Search APIs). Each talks gRPC with the service
//! token, like the services talk to each other, so the binary is all a newcomer needs.

pub mod dead_letters;
pub mod events;
pub mod handlers;
pub mod import;
pub mod movies;
pub mod reviews;
pub mod search;
pub mod status;
pub mod users;
pub mod wrap_ups;

use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use reelay_kit::client::{ServiceChannel, check_service_url, connect_lazy};

use crate::config::{Command, read_service_token};

/// `println!` for a command's output. A reader that goes away before the end (`reelay status |
/// head -1`) is no failure: what is left is not written, and the command ends as it would have
/// (`println!` panicked, "failed printing to stdout", exit 101).
macro_rules! outln {
    ($($arg:tt)*) => {
        $crate::commands::write_out(format_args!("{}\n", format_args!($($arg)*)))
    };
}
pub(crate) use outln;

/// `eprintln!` for what a command says on stderr: said if it can be (a closed stderr is no
/// reason to panic).
macro_rules! errln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}
pub(crate) use errln;

/// Whether stdout's reader went away: nothing more is written to it.
static STDOUT_CLOSED: AtomicBool = AtomicBool::new(false);

/// Writes `text` to stdout (see [`outln`]). Any other failure to write (a full disk) ends the
/// process with status 2, as the output is lost.
pub fn write_out(text: std::fmt::Arguments<'_>) {
    if STDOUT_CLOSED.load(Ordering::Relaxed) {
        return;
    }
    let mut out = std::io::stdout().lock();
    match out.write_fmt(text) {
        Ok(()) => {}
        Err(error) if error.kind() == std::io::ErrorKind::BrokenPipe => STDOUT_CLOSED.store(true, Ordering::Relaxed),
        Err(error) => {
            errln!("reelay: cannot write the output: {error}");
            std::process::exit(2);
        }
    }
}

/// A command that ran but did not do what it was asked, with its exit status (a failure to
/// run it exits 2): said as an error, on stderr.
#[derive(Debug)]
pub struct Exit {
    pub status: u8,
    pub message: String,
}

impl std::fmt::Display for Exit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Exit {}

/// How a command reaches the services (the same variables the services use).
#[derive(Debug, Clone, Args)]
pub struct ClientArgs {
    /// The write service (domain and Admin APIs); defaults to `http://<REELAY_WRITE_ADDR>` as
    /// the services read it (an unspecified address as loopback), else http://127.0.0.1:50051.
    #[arg(long, env = "REELAY_WRITE_URL")]
    pub write_url: Option<String>,

    /// Where the write service listens, when it was started with REELAY_WRITE_ADDR (read for
    /// the default of --write-url only, so a value that is no address matters only then).
    #[arg(long, env = "REELAY_WRITE_ADDR", hide = true)]
    pub write_addr: Option<String>,

    /// The service token; none for a service started with --dev.
    #[arg(long, env = "REELAY_SERVICE_TOKEN", hide_env_values = true)]
    pub service_token: Option<String>,

    /// A file holding the service token.
    #[arg(long, env = "REELAY_SERVICE_TOKEN_FILE")]
    pub service_token_file: Option<PathBuf>,

    /// Deadline of each call, in milliseconds: 2 s to an hour, as for the services (a shorter
    /// one cancelled calls the services answer in time).
    #[arg(long, env = "REELAY_GRPC_TIMEOUT_MS", default_value_t = 30_000, value_parser = clap::value_parser!(u64).range(2_000..=3_600_000))]
    pub grpc_timeout_ms: u64,
}

impl ClientArgs {
    /// A channel to `url` carrying the service token. `setting` names where the URL came from,
    /// for the error when it is not one a call could use.
    pub fn channel_to(&self, url: &str, setting: &str) -> anyhow::Result<ServiceChannel> {
        check_service_url(url).map_err(|e| anyhow::anyhow!("{setting}: {e}"))?;
        let token = read_service_token(self.service_token.as_deref(), self.service_token_file.as_deref())?;
        connect_lazy(url, token.as_deref(), Duration::from_millis(self.grpc_timeout_ms)).map_err(anyhow::Error::msg)
    }

    pub fn write(&self) -> anyhow::Result<ServiceChannel> {
        self.channel_to(&self.write_url()?, "--write-url (REELAY_WRITE_URL)")
    }

    /// The write service's URL: `--write-url`, else the one `REELAY_WRITE_ADDR` implies.
    pub fn write_url(&self) -> anyhow::Result<String> {
        match &self.write_url {
            Some(url) => Ok(url.clone()),
            None => url_of_addr(self.write_addr.as_deref(), WRITE_SERVICE),
        }
    }
}

/// A service a client command calls: its name, the variables that say where it is, and where
/// it listens by default.
pub struct ServiceAddr {
    pub name: &'static str,
    pub url_var: &'static str,
    pub url_flag: &'static str,
    pub addr_var: &'static str,
    pub default_addr: ([u8; 4], u16),
}

pub const WRITE_SERVICE: ServiceAddr = ServiceAddr {
    name: "write service",
    url_var: "REELAY_WRITE_URL",
    url_flag: "--write-url",
    addr_var: "REELAY_WRITE_ADDR",
    default_addr: ([127, 0, 0, 1], 50051),
};

pub const HANDLERS_SERVICE: ServiceAddr = ServiceAddr {
    name: "handlers service",
    url_var: "REELAY_HANDLERS_URL",
    url_flag: "--handlers-url",
    addr_var: "REELAY_HANDLERS_ADDR",
    default_addr: ([127, 0, 0, 1], 50052),
};

/// The URL a service's listen address implies, as the services read it (`addr`: its
/// `*_ADDR` variable, when set): an unspecified address as loopback; the default address when
/// unset.
pub fn url_of_addr(addr: Option<&str>, service: ServiceAddr) -> anyhow::Result<String> {
    let default = std::net::SocketAddr::from(service.default_addr);
    let mut addr = match addr {
        None => default,
        Some(addr) => addr.trim().parse::<std::net::SocketAddr>().map_err(|_| {
            anyhow::anyhow!(
                "{}: {addr:?} is not an IP address and port (as {default}); set {} ({}) to reach the {} by name",
                service.addr_var,
                service.url_flag,
                service.url_var,
                service.name
            )
        })?,
    };
    if addr.ip().is_unspecified() {
        addr.set_ip(if addr.is_ipv4() {
            std::net::Ipv4Addr::LOCALHOST.into()
        } else {
            std::net::Ipv6Addr::LOCALHOST.into()
        });
    }
    Ok(format!("http://{addr}"))
}

/// Who acts, and the film named by title and year (found, or created when new).
#[derive(Debug, Clone, Args)]
pub struct UserAndFilm {
    /// Your user id (as `reelay users create` printed it).
    #[arg(long)]
    pub user: String,

    /// The film's title.
    #[arg(long)]
    pub movie: String,

    /// The film's release year.
    #[arg(long)]
    pub year: i32,
}

/// Runs a client command.
pub async fn run(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Status(args) => status::run(args).await,
        Command::Events(command) => events::run(command).await,
        Command::DeadLetters(command) => dead_letters::run(command).await,
        Command::Handlers(command) => handlers::run(command).await,
        Command::Users(command) => users::run(command).await,
        Command::Reviews(command) => reviews::run(command).await,
        Command::Movies(command) => movies::run(command).await,
        Command::WrapUps(command) => wrap_ups::run(command).await,
        Command::Search(command) => search::run(command).await,
        Command::Import(command) => import::run(command).await,
        Command::Run(_) | Command::Migrate(_) => unreachable!("main runs the services itself"),
    }
}

/// A refused or failed call to the write service, said plainly: the code and the server's
/// message (which names the field for bad input).
pub fn call_failed(what: &str, status: tonic::Status) -> anyhow::Error {
    call_failed_at(what, status, WRITE_SERVICE)
}

/// [`call_failed`] for a call to `service`.
pub fn call_failed_at(what: &str, status: tonic::Status, service: ServiceAddr) -> anyhow::Error {
    let url_var = service.url_var;
    let hint = match status.code() {
        tonic::Code::Unavailable => format!(" (is the service running, and is {url_var} right?)"),
        tonic::Code::Unauthenticated => " (set REELAY_SERVICE_TOKEN or REELAY_SERVICE_TOKEN_FILE)".to_owned(),
        // What a port of something else answers: an HTTP server ("transport error", "h2
        // protocol error", or the connection closed under the call: "operation was canceled"),
        // or another gRPC service ("Unimplemented").
        tonic::Code::Unknown | tonic::Code::Internal | tonic::Code::Cancelled | tonic::Code::Unimplemented => {
            format!(" (is {url_var} the {}'s gRPC address?)", service.name)
        }
        _ => String::new(),
    };
    // Another gRPC service answers an unknown method with no message at all.
    let message = if status.message().is_empty() { String::new() } else { format!(": {}", status.message()) };
    anyhow::anyhow!("{what} failed: {:?}{message}{hint}", status.code())
}

/// A write's idempotency key: `--request-id` when given, else a new one for this run.
pub fn request_id_or_new(given: Option<String>) -> String {
    given.unwrap_or_else(|| format!("cli-{}", uuid::Uuid::now_v7()))
}

/// Whether a failed call may have been carried out all the same (the service unreachable
/// mid-call, the deadline passed, an "outcome unknown" answer).
fn outcome_unknown(status: &tonic::Status) -> bool {
    use tonic::Code;
    matches!(
        status.code(),
        Code::Unavailable | Code::DeadlineExceeded | Code::Aborted | Code::Unknown | Code::Cancelled
    )
}

/// How often a write whose outcome is unknown is sent again, and the first wait between.
const WRITE_RETRIES: u32 = 2;
const FIRST_RETRY_WAIT: Duration = Duration::from_millis(500);

/// Runs a write carrying `request_id`, again with the same key while its outcome is unknown:
/// the write service answers a repeat with the first call's answer, so it is written once
/// however many times it is sent. When it still cannot be told, the error says how to ask
/// again later without writing twice.
pub async fn keyed_write<T, F, Fut>(what: &str, request_id: &str, mut call: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
{
    let mut backoff = reelay_kit::Backoff::bounded(FIRST_RETRY_WAIT, FIRST_RETRY_WAIT * 4, WRITE_RETRIES);
    // Whether any try may have reached the service: only then can its outcome be unknown.
    let mut maybe_sent = false;
    loop {
        let status = match call().await {
            Ok(answer) => return Ok(answer.into_inner()),
            Err(status) => status,
        };
        if !outcome_unknown(&status) {
            return Err(call_failed(what, status));
        }
        maybe_sent |= !reelay_kit::client::never_connected(&status);
        let why = format!("{:?}: {} (sending it again with the same request id)", status.code(), status.message());
        if !backoff.wait(what, why).await {
            if !maybe_sent {
                return Err(call_failed(what, status).context(format!(
                    "the service refused every connection ({} tries): nothing was written",
                    WRITE_RETRIES + 1
                )));
            }
            return Err(call_failed(what, status).context(format!(
                "whether it was written cannot be told: run the same command with --request-id {request_id} once \
                 the service answers, which writes it at most once"
            )));
        }
    }
}

/// A film named by title and year (found, or created when Reelay does not know it yet).
pub fn movie_by_title(title: &str, year: i32) -> reelay_contracts::v1::MovieRef {
    use reelay_contracts::v1;
    v1::MovieRef {
        by: Some(v1::movie_ref::By::TitleYear(v1::TitleYear {
            title: title.to_owned(),
            year,
            external_id: String::new(),
        })),
    }
}

/// Who is asking, for the audit record of operator actions: `REELAY_OPERATOR`, else the login
/// name. Refused when there is none (a `kubectl exec` has no `$USER`): an action recorded as
/// nobody's tells `events explain` nothing.
pub fn operator_name() -> anyhow::Result<String> {
    ["REELAY_OPERATOR", "USER", "LOGNAME"]
        .iter()
        .filter_map(|name| std::env::var(name).ok())
        .map(|name| name.trim().to_owned())
        .find(|name| !name.is_empty())
        .ok_or_else(|| {
            anyhow::anyhow!(
                "who is acting? set REELAY_OPERATOR to your name, for the audit record (no $USER here; in a pod: \
                 kubectl exec ... -- env REELAY_OPERATOR=<you> reelay ...)"
            )
        })
}

/// `5s`, `3m 20s`, `2h 5m`, `3d 4h`.
pub fn age(ms: i64) -> String {
    let s = ms.max(0) / 1000;
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m {}s", s / 60, s % 60),
        3600..86400 => format!("{}h {}m", s / 3600, s % 3600 / 60),
        _ => format!("{}d {}h", s / 86400, s % 86400 / 3600),
    }
}

/// A millisecond timestamp as `YYYY-MM-DD HH:MM:SS` UTC; `-` for 0.
pub fn utc(ms: i64) -> String {
    if ms <= 0 {
        return "-".into();
    }
    let secs = ms.div_euclid(1000);
    let (days, rest) = (secs.div_euclid(86400), secs.rem_euclid(86400));
    let (year, month, day) = reelay_domain::validate::civil_from_days(days);
    format!("{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02}", rest / 3600, rest % 3600 / 60, rest % 60)
}

/// `90s`, `15m`, `2h`, `7d` → a duration.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let split = text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let n: u64 = number.parse().map_err(|_| format!("{text:?} is not a duration like 90s, 15m, 2h or 7d"))?;
    let per_unit = match unit {
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86400,
        _ => return Err(format!("{text:?} is not a duration like 90s, 15m, 2h or 7d")),
    };
    let secs = n.checked_mul(per_unit).ok_or_else(|| format!("{text:?} is too long a duration"))?;
    Ok(Duration::from_secs(secs))
}

/// `--since`: a duration (as [`parse_duration`] reads it) back from now that stays after the
/// Unix epoch, before which nothing was recorded.
pub fn parse_since(text: &str) -> Result<Duration, String> {
    let span = parse_duration(text)?;
    since_ms(reelay_kit::now_ms(), span).map_err(|e| format!("{text:?} {e}"))?;
    Ok(span)
}

/// The moment `span` before `now_ms`, in milliseconds since the Unix epoch; an error for a span
/// reaching before the epoch (a negative moment the services refuse, or one that wraps).
pub fn since_ms(now_ms: i64, span: Duration) -> Result<i64, String> {
    i64::try_from(span.as_millis())
        .ok()
        .and_then(|span_ms| now_ms.checked_sub(span_ms))
        .filter(|since| *since >= 0)
        .ok_or_else(|| "reaches back before 1970-01-01 (the Unix epoch)".to_owned())
}

/// Reads a whole file, saying which one failed.
pub fn read_file(path: &std::path::Path) -> anyhow::Result<Vec<u8>> {
    let size = std::fs::metadata(path).with_context(|| format!("cannot read {}", path.display()))?.len();
    if size > MAX_INPUT_FILE_BYTES {
        anyhow::bail!("{} is {size} bytes, over the {MAX_INPUT_FILE_BYTES} bytes an export may have", path.display());
    }
    std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))
}

/// The largest file (and, in a zip, the largest file once decompressed) a command reads: a
/// Letterboxd export of a lifetime's diary is a few MB.
pub const MAX_INPUT_FILE_BYTES: u64 = 256 * 1024 * 1024;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_times_and_ages() {
        assert_eq!(utc(0), "-");
        assert_eq!(utc(86_400_000 + 3_723_000), "1970-01-02 01:02:03");
        assert_eq!(utc(1_709_251_200_000), "2024-03-01 00:00:00");
        assert_eq!(age(59_999), "59s");
        assert_eq!(age(3_600_000 * 25), "1d 1h");
    }

    /// A write whose outcome is unknown is sent again with the same key until it is answered;
    /// a refusal is not; one never answered says how to ask again.
    #[tokio::test]
    async fn a_keyed_write_is_sent_again_while_its_outcome_is_unknown() {
        use std::sync::atomic::{AtomicU32, Ordering};
        let calls = AtomicU32::new(0);
        let answered = keyed_write("x", "k", || {
            let n = calls.fetch_add(1, Ordering::SeqCst);
            async move {
                match n {
                    0 => Err(tonic::Status::unavailable("connection reset")),
                    1 => Err(tonic::Status::deadline_exceeded("too slow")),
                    _ => Ok(tonic::Response::new(7)),
                }
            }
        })
        .await
        .unwrap();
        assert_eq!((answered, calls.load(Ordering::SeqCst)), (7, 3));

        let calls = AtomicU32::new(0);
        let refused = keyed_write::<u32, _, _>("x", "k", || {
            calls.fetch_add(1, Ordering::SeqCst);
            async { Err(tonic::Status::invalid_argument("rating: too high")) }
        })
        .await
        .unwrap_err();
        assert_eq!(calls.load(Ordering::SeqCst), 1, "a refusal is final");
        assert!(format!("{refused:#}").contains("rating: too high"));

        let never = keyed_write::<u32, _, _>("x", "key-1", || async { Err(tonic::Status::unavailable("down")) })
            .await
            .unwrap_err();
        assert!(format!("{never:#}").contains("--request-id key-1"), "{never:#}");
    }

    #[test]
    fn the_write_url_defaults_to_the_write_address() {
        let args = |url: Option<&str>, addr: Option<&str>| ClientArgs {
            write_url: url.map(str::to_owned),
            write_addr: addr.map(str::to_owned),
            service_token: None,
            service_token_file: None,
            grpc_timeout_ms: 1000,
        };
        let url = |url: Option<&str>, addr: Option<&str>| args(url, addr).write_url().unwrap();
        assert_eq!(url(None, None), "http://127.0.0.1:50051");
        assert_eq!(url(None, Some("127.0.0.1:6000")), "http://127.0.0.1:6000");
        assert_eq!(url(None, Some("0.0.0.0:6000")), "http://127.0.0.1:6000");
        assert_eq!(url(None, Some("[::]:6000")), "http://[::1]:6000");
        assert_eq!(url(Some("http://w:1"), Some("0.0.0.0:6000")), "http://w:1");
        // An address that is none is an error only when it is read.
        assert_eq!(url(Some("http://w:1"), Some("write:50051")), "http://w:1");
        let error = args(None, Some("write:50051")).write_url().unwrap_err().to_string();
        assert!(error.contains("REELAY_WRITE_ADDR") && error.contains("--write-url"), "{error}");
    }

    /// search's default follows REELAY_HANDLERS_ADDR as the write service's follows
    /// REELAY_WRITE_ADDR.
    #[test]
    fn the_handlers_url_defaults_to_the_handlers_address() {
        let url = |addr: Option<&str>| url_of_addr(addr, HANDLERS_SERVICE);
        assert_eq!(url(None).unwrap(), "http://127.0.0.1:50052");
        assert_eq!(url(Some("0.0.0.0:6002")).unwrap(), "http://127.0.0.1:6002");
        let error = url(Some("handlers:50052")).unwrap_err().to_string();
        assert!(error.contains("REELAY_HANDLERS_ADDR") && error.contains("--handlers-url"), "{error}");
    }

    /// What another port answers (an HTTP server, another gRPC service) is said with a hint at
    /// the URL's variable, as a refused connection is.
    #[test]
    fn a_call_answered_by_something_else_hints_at_the_url() {
        let said = |status: tonic::Status, service| format!("{:#}", call_failed_at("status", status, service));
        for status in [
            tonic::Status::unknown("transport error"),
            tonic::Status::internal("h2 protocol error: http2 error"),
            tonic::Status::cancelled("operation was canceled"),
            tonic::Status::unimplemented(""),
        ] {
            let code = status.code();
            let error = said(status, WRITE_SERVICE);
            assert!(error.ends_with("(is REELAY_WRITE_URL the write service's gRPC address?)"), "{error}");
            assert!(error.starts_with(&format!("status failed: {code:?}")), "{error}");
        }
        assert_eq!(
            said(tonic::Status::unimplemented(""), HANDLERS_SERVICE),
            "status failed: Unimplemented (is REELAY_HANDLERS_URL the handlers service's gRPC address?)"
        );
        let refused = said(tonic::Status::invalid_argument("handle: taken"), WRITE_SERVICE);
        assert_eq!(refused, "status failed: InvalidArgument: handle: taken");
    }

    #[test]
    fn parses_durations() {
        assert_eq!(parse_duration("90s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("2h"), Ok(Duration::from_secs(7200)));
        assert!(parse_duration("2 weeks").is_err());
        assert!(parse_duration("h").is_err());
        // Spans that overflowed (a panic in debug builds, a wrap in release) are refused.
        assert!(parse_duration("999999999999999d").unwrap_err().contains("too long"));
        assert!(parse_duration("18446744073709551615m").unwrap_err().contains("too long"));
        assert_eq!(parse_duration("213503982334601d"), Ok(Duration::from_secs(213_503_982_334_601 * 86400)));
    }

    /// `--since` reaches back from now, never before the epoch: a span that did came out as a
    /// negative moment (refused by the service, naming its `since_ms`) or, wrapped, one in the
    /// future (no dead letters listed).
    #[test]
    fn a_since_span_stays_after_the_epoch() {
        let now = 1_709_251_200_000;
        assert_eq!(since_ms(now, Duration::from_secs(86400)), Ok(now - 86_400_000));
        assert_eq!(since_ms(now, Duration::from_millis(now as u64)), Ok(0));
        assert!(since_ms(now, Duration::from_millis(now as u64 + 1)).is_err());
        for span in ["30000d", "200000000000d", "999999999999999d"] {
            let error = parse_since(span).unwrap_err();
            assert!(error.contains("1970") || error.contains("too long"), "{span}: {error}");
        }
        assert_eq!(parse_since("7d"), Ok(Duration::from_secs(7 * 86400)));
    }

    /// A URL a call could not use is refused before any call, naming the setting it came from.
    #[test]
    fn a_client_url_without_a_scheme_is_refused_naming_its_setting() {
        let args = ClientArgs {
            write_url: Some("127.0.0.1:50051".into()),
            write_addr: None,
            service_token: None,
            service_token_file: None,
            grpc_timeout_ms: 30_000,
        };
        let error = args.write().map(drop).unwrap_err().to_string();
        assert!(error.contains("REELAY_WRITE_URL") && error.contains("\"127.0.0.1:50051\""), "{error}");
        let error = args.channel_to("localhost:50052", "REELAY_HANDLERS_URL").map(drop).unwrap_err().to_string();
        assert!(error.contains("REELAY_HANDLERS_URL") && error.contains("no scheme"), "{error}");
    }
}
