//! `reelay`: process concerns only. Parse the command line and environment, set up logging and
//! the panic hook, then hand off to the node.

mod config;
mod node;

use std::process::ExitCode;

use clap::Parser;

use crate::config::{Cli, Command};

fn main() -> ExitCode {
    let cli = Cli::parse();
    reelay_runtime::telemetry::init(cli.log_json());
    reelay_runtime::telemetry::install_panic_hook();
    // Blocking threads run index commits and searches; a small pool keeps memory bounded.
    let runtime = match tokio::runtime::Builder::new_multi_thread().max_blocking_threads(16).enable_all().build() {
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
