//! `reelay`: process concerns only. Parse the command line and environment, set up logging and
//! the panic hook, then hand off to the node.

mod commands;
mod config;
mod node;

use std::process::ExitCode;

use clap::Parser;

use crate::config::{Cli, Command};

fn main() -> ExitCode {
    limit_malloc_arenas();
    let cli = Cli::parse();
    reelay_kit::telemetry::init(cli.log_json());
    reelay_kit::telemetry::install_panic_hook();
    // HTTPS (S3, TMDB) through rustls on ring, Reelay's one crypto library.
    reelay_objects::install_tls_provider();
    // Blocking threads run index commits and searches; a small pool keeps memory bounded.
    let runtime = match tokio::runtime::Builder::new_multi_thread().max_blocking_threads(8).enable_all().build() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("reelay: cannot start the async runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
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
            tracing::error!("{error:#}");
            eprintln!("reelay: {error:#}");
            ExitCode::from(2)
        }
    }
}

/// glibc gives each thread that allocates its own malloc arena, and memory freed in one is not
/// reused by another: with the runtime's, tantivy's and SQLite's threads that fragments into
/// tens of MB of RSS. Two arenas are plenty for a service on a few cores.
fn limit_malloc_arenas() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only tunes the allocator; called before any other thread exists.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 2);
    }
}
