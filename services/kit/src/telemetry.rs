//! Structured logs via `tracing`: `RUST_LOG` filters (default `info`), `REELAY_LOG_FORMAT=json`
//! switches to one JSON object per line for log collectors. Text logs are coloured only when
//! they go to a terminal. Also the trace context of the call being served, which the gRPC
//! server sets and the write path stamps on every event it raises.

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

tokio::task_local! {
    /// The W3C `traceparent` of the request being served; stamped on every event it enqueues.
    pub static TRACEPARENT: String;
}

/// The `traceparent` of the request this task serves; empty outside one.
pub fn current_traceparent() -> String {
    TRACEPARENT.try_with(Clone::clone).unwrap_or_default()
}

pub fn init(json: bool) {
    // Unset: info. Set but not a filter: info too, and said so (a typo would silence the
    // logs it meant to open).
    let filter = match std::env::var(EnvFilter::DEFAULT_ENV) {
        Err(_) => EnvFilter::new("info"),
        Ok(value) => EnvFilter::try_new(&value).unwrap_or_else(|error| {
            eprintln!("RUST_LOG={value:?} is not a log filter ({error}); logging at info");
            EnvFilter::new("info")
        }),
    };
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    let result = if json { builder.json().try_init() } else { builder.try_init() };
    // A second init (tests) keeps the first subscriber.
    let _ = result;
}

/// Logs panics through tracing before the default hook runs, so they reach the log collector.
pub fn install_panic_hook() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        tracing::error!(panic = %info, "panic");
        default(info);
    }));
}
