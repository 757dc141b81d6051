//! Building and running a node: the services named on the command line, wired together.

use std::collections::BTreeSet;

use anyhow::{Context, bail};
use reelay_outbox::{Database, DbConfig};
use reelay_runtime::{GrpcConfig, GrpcServer, Service, Shutdown};
use sqlx::Connection;
use tokio::net::TcpListener;

use crate::config::{DatabaseArgs, MigrateArgs, RunArgs};

fn db_config(args: &DatabaseArgs) -> DbConfig {
    let mut config = DbConfig::new(args.database_path());
    config.synchronous = args.sqlite_synchronous;
    config
}

fn service_token(args: &RunArgs) -> anyhow::Result<Option<String>> {
    let token = match (&args.service_token, &args.service_token_file) {
        (Some(token), _) => Some(token.trim().to_owned()),
        (None, Some(path)) => Some(
            std::fs::read_to_string(path)
                .with_context(|| format!("cannot read the service token file {}", path.display()))?
                .trim()
                .to_owned(),
        ),
        (None, None) => None,
    };
    match token {
        Some(token) if token.len() < 16 => bail!("the service token must be at least 16 characters"),
        Some(token) => Ok(Some(token)),
        None if args.dev => {
            tracing::warn!("development mode: no service token, gRPC calls are NOT authenticated");
            Ok(None)
        }
        None => bail!(
            "no service token: set REELAY_SERVICE_TOKEN (or REELAY_SERVICE_TOKEN_FILE), \
             or pass --dev to run unauthenticated on a development machine"
        ),
    }
}

pub async fn run(args: RunArgs) -> anyhow::Result<()> {
    let services: BTreeSet<Service> =
        if args.services.is_empty() { [Service::Write].into() } else { args.services.iter().copied().collect() };
    for service in &services {
        if *service != Service::Write {
            bail!("service `{service}` is not part of this build yet; run `--service write`");
        }
    }
    let grpc = GrpcConfig {
        service_token: service_token(&args)?,
        max_message_bytes: args.grpc_max_message_bytes,
        call_timeout: args.call_timeout(),
        ..GrpcConfig::default()
    };
    // Bind before the slow start-up work so a port clash fails fast.
    let listener =
        TcpListener::bind(args.write_addr).await.with_context(|| format!("cannot listen on {}", args.write_addr))?;

    let shutdown = Shutdown::new();
    shutdown.listen_for_signals();

    let path = args.database.database_path();
    let db = Database::open(&db_config(&args.database))
        .await
        .with_context(|| format!("cannot open the database {}", path.display()))?;
    tracing::info!(database = %path.display(), synchronous = ?args.database.sqlite_synchronous, "database ready");

    let store = reelay_write::Store::new(db.clone());
    let server = reelay_write::mount(GrpcServer::new(grpc), store);
    let stop = shutdown.clone();
    let served = server.serve(listener, async move { stop.requested().await }).await;
    db.close().await;
    served.context("the gRPC server failed")?;
    tracing::info!("stopped");
    Ok(())
}

pub async fn migrate(args: MigrateArgs) -> anyhow::Result<()> {
    let config = db_config(&args.database);
    let conn = config
        .connect_and_migrate(args.to)
        .await
        .with_context(|| format!("cannot migrate {}", config.path.display()))?;
    conn.close().await?;
    tracing::info!(database = %config.path.display(), to = ?args.to, "migrations applied");
    Ok(())
}
