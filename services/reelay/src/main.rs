//! `reelay`: process concerns only. Parse the command line and environment, set up logging and
//! the panic hook, then hand off to the node.

mod commands;
mod config;
mod locks;
mod node;

use std::process::ExitCode;

use clap::{CommandFactory, Parser};

use crate::config::{Cli, Command};

fn main() -> ExitCode {
    tune_malloc();
    let cli = Cli::try_parse().unwrap_or_else(|error| name_the_variable(error).exit());
    reelay_kit::telemetry::init(cli.log_json());
    reelay_kit::telemetry::install_panic_hook();
    // HTTPS (S3, TMDB) through rustls on ring, Reelay's one crypto library.
    reelay_objects::install_tls_provider();
    // Blocking threads run index commits and searches; a small pool keeps memory bounded.
    let runtime = match tokio::runtime::Builder::new_multi_thread().max_blocking_threads(8).enable_all().build() {
        Ok(runtime) => runtime,
        Err(error) => {
            commands::errln!("reelay: cannot start the async runtime: {error}");
            return ExitCode::from(2);
        }
    };
    // A service's failure goes to its log (a collector reads it, and it is on stderr too); a
    // client command's is said on stderr. Either is said once.
    let serves = matches!(cli.command, Command::Run(_) | Command::Migrate(_));
    let result = runtime.block_on(async move {
        match cli.command {
            Command::Run(run) => node::run(*run).await,
            Command::Migrate(migrate) => node::migrate(migrate).await,
            command => commands::run(command).await,
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            // A log filter that leaves errors out (RUST_LOG=off) must not silence the failure.
            if serves && tracing::enabled!(tracing::Level::ERROR) {
                tracing::error!("{error:#}");
            } else {
                commands::errln!("reelay: {error:#}");
            }
            // A command's own status for what is no failure to run it (a replay that changed
            // nothing); 2 for every failure.
            ExitCode::from(error.downcast_ref::<commands::Exit>().map_or(2, |exit| exit.status))
        }
    }
}

/// A value clap refuses names the flag it was given for; one that came from the environment
/// (`REELAY_DEV=maybe`) is named with its variable as well, which is what the user set.
fn name_the_variable(mut error: clap::Error) -> clap::Error {
    use clap::error::{ContextKind, ContextValue, ErrorKind};
    if !matches!(error.kind(), ErrorKind::InvalidValue | ErrorKind::ValueValidation) {
        return error;
    }
    let (Some(ContextValue::String(arg)), Some(ContextValue::String(value))) =
        (error.get(ContextKind::InvalidArg), error.get(ContextKind::InvalidValue))
    else {
        return error;
    };
    // `--flag <VALUE>`, as clap names it.
    let Some(flag) = arg.split([' ', '=']).next().and_then(|f| f.strip_prefix("--")).map(str::to_owned) else {
        return error;
    };
    let typed = std::env::args_os().skip(1).filter_map(|a| a.into_string().ok()).any(|a| {
        a.strip_prefix("--")
            .is_some_and(|a| a == flag || a.strip_prefix(flag.as_str()).is_some_and(|r| r.starts_with('=')))
    });
    if typed {
        return error;
    }
    let Some(variable) = variable_of(&Cli::command(), &flag, value) else {
        return error;
    };
    let tip = clap::builder::StyledStr::from(format!("the value comes from the environment variable {variable}"));
    let tips = match error.get(ContextKind::Suggested) {
        Some(ContextValue::StyledStrs(tips)) => tips.iter().cloned().chain([tip]).collect(),
        _ => vec![tip],
    };
    error.insert(ContextKind::Suggested, ContextValue::StyledStrs(tips));
    error
}

/// The environment variable of `--flag` (in `command` or any of its subcommands) that is set
/// to a value holding `value` (one of a list, for a variable that holds several).
fn variable_of(command: &clap::Command, flag: &str, value: &str) -> Option<String> {
    let here = command.get_arguments().filter(|a| a.get_long() == Some(flag)).find_map(|a| {
        let variable = a.get_env()?.to_str()?.to_owned();
        let set = std::env::var(&variable).ok()?;
        (set == value || set.split(',').any(|v| v == value)).then_some(variable)
    });
    here.or_else(|| command.get_subcommands().find_map(|c| variable_of(c, flag, value)))
}

/// Tunes glibc's malloc for a long-running service:
/// - Each thread that allocates gets its own arena, and memory freed in one is not reused by
///   another: with the runtime's, tantivy's and SQLite's threads that fragments into tens of MB
///   of RSS. Two arenas are plenty for a service on a few cores.
/// - A freed block larger than the mmap threshold (128 KB) raises the threshold to its size, so
///   the next blocks of that size come from the arena and stay in RSS after they are freed.
///   Search allocates and frees several MB per index commit; that kept 25–30 MB of freed memory
///   in the handlers process under load. Setting the threshold fixes it at 128 KB.
fn tune_malloc() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only tunes the allocator; called before any other thread exists.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 2);
        libc::mallopt(libc::M_MMAP_THRESHOLD, 128 * 1024);
    }
}
