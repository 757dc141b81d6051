//! `reelay`: process concerns only. Parse the command line and environment, set up logging and
//! the panic hook, then hand off to the node.

mod commands;
mod config;
mod locks;
mod node;

use std::process::ExitCode;

use clap::Parser;

use crate::config::{Cli, Command};

fn main() -> ExitCode {
    tune_malloc();
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
    // A service's failure goes to its log too (a collector reads it); a client command's is
    // said once, on stderr.
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
            if serves {
                tracing::error!("{error:#}");
            }
            eprintln!("reelay: {error:#}");
            ExitCode::from(2)
        }
    }
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
