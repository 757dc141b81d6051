//! Building and running a node: the services named on the command line, wired together.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use futures_util::FutureExt;
use reelay_outbox::ledger::LedgerPolicy;
use reelay_outbox::queue::QueuePolicy;
use reelay_outbox::{Database, DbConfig};
use reelay_runtime::client::connect_lazy;
use reelay_runtime::consumer::run_consumer;
use reelay_runtime::db_source::OutboxSource;
use reelay_runtime::dispatch::Dispatcher;
use reelay_runtime::{GrpcConfig, GrpcServer, Handler, Service, Shutdown};
use reelay_search::{SearchHandler, SearchIndex};
use reelay_write::DeliveryPolicy;
use sqlx::Connection;
use tokio::net::TcpListener;

use crate::config::{Backend, DatabaseArgs, MigrateArgs, RunArgs};

/// How long one outbox claim waits for rows; bounds how long shutdown waits for a fetch.
const CLAIM_LONG_POLL: Duration = Duration::from_secs(5);

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

/// The handlers this build hosts, and the search index the Search API serves.
async fn available_handlers(args: &RunArgs) -> anyhow::Result<(Vec<Arc<dyn Handler>>, SearchIndex)> {
    let search_dir = args.handlers.search_dir.clone().unwrap_or_else(|| args.database.data_dir.join("search"));
    let index = SearchIndex::open(&search_dir)
        .with_context(|| format!("cannot open the search index in {}", search_dir.display()))?;
    let mut handlers: Vec<Arc<dyn Handler>> = vec![Arc::new(SearchHandler::new(index.clone()))];
    handlers.extend(reelay_runtime::probe::probes().await.map_err(anyhow::Error::msg)?);
    Ok((handlers, index))
}

pub async fn run(args: RunArgs) -> anyhow::Result<()> {
    let services: BTreeSet<Service> = if args.services.is_empty() {
        [Service::Write, Service::Handlers].into()
    } else {
        args.services.iter().copied().collect()
    };
    if services.contains(&Service::Relay) || args.handlers.backend == Backend::Nats {
        bail!("the nats backend and the relay service are not part of this build yet; use EVENT_BUS_BACKEND=db");
    }
    if services.contains(&Service::Handlers) && !args.handlers.handlers.is_empty() {
        bail!(
            "--handler/REELAY_HANDLERS picks a subset of handlers, which only the nats backend supports: on the db \
             backend one outbox row carries its event to every handler, so a handlers process hosts all of them"
        );
    }
    let grpc = GrpcConfig {
        service_token: service_token(&args)?,
        max_message_bytes: args.grpc_max_message_bytes,
        call_timeout: args.call_timeout(),
        ..GrpcConfig::default()
    };
    // Bind before the slow start-up work so a port clash fails fast.
    let bind = |addr: SocketAddr| async move {
        TcpListener::bind(addr).await.with_context(|| format!("cannot listen on {addr}"))
    };
    let write_listener = if services.contains(&Service::Write) { Some(bind(args.write_addr).await?) } else { None };
    let handlers_listener =
        if services.contains(&Service::Handlers) { Some(bind(args.handlers.handlers_addr).await?) } else { None };

    let shutdown = Shutdown::new();
    shutdown.listen_for_signals();
    // The write service keeps serving until this node's consumers have settled their last batch.
    let consumers_done = Shutdown::new();
    let mut tasks = tokio::task::JoinSet::new();

    if let Some(listener) = handlers_listener {
        let (handlers, index) = available_handlers(&args).await?;
        let write_url = args.handlers.write_url.clone().unwrap_or_else(|| format!("http://{}", args.write_addr));
        let channel =
            connect_lazy(&write_url, grpc.service_token.as_deref(), args.call_timeout()).map_err(anyhow::Error::msg)?;
        let consumer = format!("handlers-{}", std::process::id());
        let source = OutboxSource::new(channel.clone(), consumer, CLAIM_LONG_POLL);
        let dispatcher = Dispatcher::new(
            handlers,
            channel,
            Duration::from_millis(args.handlers.handler_timeout_ms),
            shutdown.clone(),
        );
        tracing::info!(backend = "db", %write_url, handlers = ?dispatcher.handler_names(), "handlers service starting");
        let (stop, done) = (shutdown.clone(), consumers_done.clone());
        let batch = args.handlers.batch as usize;
        tasks.spawn(async move {
            run_consumer(source, dispatcher, batch, stop).await;
            done.request();
            Ok(())
        });
        let server = reelay_search::mount(GrpcServer::new(grpc.clone()), index);
        let stop = shutdown.clone();
        tasks.spawn(async move {
            server
                .serve(listener, async move { stop.requested().await })
                .await
                .context("the handlers gRPC server failed")
        });
    } else {
        consumers_done.request();
    }

    let mut db = None;
    if let Some(listener) = write_listener {
        let path = args.database.database_path();
        let database = Database::open(&db_config(&args.database))
            .await
            .with_context(|| format!("cannot open the database {}", path.display()))?;
        tracing::info!(database = %path.display(), synchronous = ?args.database.sqlite_synchronous, "database ready");
        let policy = delivery_policy(&args);
        let server = reelay_write::mount(GrpcServer::new(grpc), reelay_write::Store::new(database.clone()));
        let server = reelay_write::mount_internal(server, database.clone(), policy, shutdown.clone());
        tasks.spawn(
            reelay_write::purge_ledger(
                database.clone(),
                policy.ledger,
                Duration::from_millis(args.delivery.ledger_purge_interval_ms),
                shutdown.clone(),
            )
            .map(Ok),
        );
        let (stop, done) = (shutdown.clone(), consumers_done.clone());
        tasks.spawn(async move {
            let drained = async move {
                stop.requested().await;
                done.requested().await;
            };
            server.serve(listener, drained).await.context("the write gRPC server failed")
        });
        db = Some(database);
    }

    let mut result = Ok(());
    while let Some(joined) = tasks.join_next().await {
        let outcome = joined.map_err(anyhow::Error::from).and_then(|r| r);
        if let Err(error) = outcome {
            tracing::error!("{error:#}");
            shutdown.request();
            result = result.and(Err(error));
        }
    }
    if let Some(db) = db {
        db.close().await;
    }
    tracing::info!("stopped");
    result
}

fn delivery_policy(args: &RunArgs) -> DeliveryPolicy {
    let d = &args.delivery;
    DeliveryPolicy {
        queue: QueuePolicy { lease: Duration::from_millis(d.outbox_lease_ms), max_attempts: d.max_attempts },
        ledger: LedgerPolicy {
            lease: Duration::from_millis(d.ledger_lease_ms),
            retention: Duration::from_secs(d.ledger_retention_days * 24 * 3600),
        },
    }
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
