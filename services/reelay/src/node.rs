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
use reelay_relay as relay;
use reelay_runtime::client::connect_lazy;
use reelay_runtime::consumer::run_consumer;
use reelay_runtime::core_source::CoreSource;
use reelay_runtime::db_source::OutboxSource;
use reelay_runtime::dispatch::Dispatcher;
use reelay_runtime::jetstream::{self, JetStreamConfig};
use reelay_runtime::nats_source::JetStreamSource;
use reelay_runtime::{GrpcConfig, GrpcServer, Handler, Service, Shutdown};
use reelay_search::{SearchHandler, SearchIndex};
use reelay_write::DeliveryPolicy;
use sqlx::Connection;
use tokio::net::TcpListener;

use crate::config::{Backend, DatabaseArgs, MigrateArgs, NatsMode, RunArgs};

/// How long one outbox claim waits for rows. Commits wake it at once, so this only bounds how
/// long a stopping consumer waits for its last fetch (an idle claim costs one empty job).
const CLAIM_LONG_POLL: Duration = Duration::from_secs(1);

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

/// The handlers this process hosts: those named by `--handler`, or all this build has. The
/// search index is opened only when the search handler is hosted.
async fn hosted_handlers(args: &RunArgs) -> anyhow::Result<(Vec<Arc<dyn Handler>>, Option<SearchIndex>)> {
    let wanted = |name: &str| args.handlers.handlers.is_empty() || args.handlers.handlers.iter().any(|h| h == name);
    let probes = reelay_runtime::probe::probes().await.map_err(anyhow::Error::msg)?;
    let mut known: Vec<&str> = vec!["search"];
    known.extend(probes.iter().map(|p| p.name()));
    if let Some(unknown) = args.handlers.handlers.iter().find(|h| !known.contains(&h.as_str())) {
        bail!("unknown handler {unknown:?}; this build has: {}", known.join(", "));
    }
    let mut handlers: Vec<Arc<dyn Handler>> = Vec::new();
    let mut index = None;
    if wanted("search") {
        let dir = args.handlers.search_dir.clone().unwrap_or_else(|| args.database.data_dir.join("search"));
        let opened =
            SearchIndex::open(&dir).with_context(|| format!("cannot open the search index in {}", dir.display()))?;
        handlers.push(Arc::new(SearchHandler::new(opened.clone())));
        index = Some(opened);
    }
    handlers.extend(probes.into_iter().filter(|p| wanted(p.name())));
    Ok((handlers, index))
}

fn jetstream_config(args: &RunArgs) -> JetStreamConfig {
    JetStreamConfig {
        url: args.nats.nats_url.clone(),
        stream: args.nats.stream.clone(),
        subject_prefix: args.nats.subject_prefix.clone(),
        max_deliver: args.delivery.max_attempts,
        ack_wait: Duration::from_millis(args.nats.ack_wait_ms),
        max_ack_pending: args.nats.max_ack_pending,
        monitor_url: args.nats.monitor_url.clone(),
    }
}

/// Room a published event needs beyond its payload: the `Nats-Msg-Id` and `traceparent` headers.
const NATS_HEADER_ROOM: usize = 4096;

/// Connects to NATS and, on JetStream, makes sure the stream is as this build needs it.
/// A relaying node also checks that the broker takes the largest event a write may raise.
async fn nats_setup(args: &RunArgs, js_config: &JetStreamConfig, relays: bool) -> anyhow::Result<async_nats::Client> {
    let client = jetstream::connect(&js_config.url).await?;
    if args.nats.nats_mode == NatsMode::Jetstream {
        jetstream::check_retry_horizon(
            args.delivery.retry(),
            args.delivery.max_attempts,
            Duration::from_millis(args.delivery.outbox_lease_ms),
        )?;
        jetstream::ensure_stream(&async_nats::jetstream::new(client.clone()), js_config).await?;
        jetstream::warn_unless_fsync_always(js_config.monitor_url.as_deref()).await;
    }
    if !relays {
        return Ok(client);
    }
    // The server's INFO arrives with the connection.
    let _ = client.flush().await;
    let max_payload = client.server_info().max_payload;
    if max_payload == 0 {
        tracing::warn!("could not learn the NATS server's max_payload; events over it would be dead-lettered");
    } else if max_payload < args.max_event_bytes + NATS_HEADER_ROOM {
        bail!(
            "the NATS server takes messages of at most {max_payload} bytes (max_payload), but events may be up to \
             {} bytes (REELAY_MAX_EVENT_BYTES) plus {NATS_HEADER_ROOM} bytes of headers: raise the server's \
             max_payload or lower REELAY_MAX_EVENT_BYTES",
            args.max_event_bytes
        );
    }
    Ok(client)
}

pub async fn run(args: RunArgs) -> anyhow::Result<()> {
    let nats = args.handlers.backend == Backend::Nats;
    let services: BTreeSet<Service> = if args.services.is_empty() {
        if nats { Service::ALL.into() } else { [Service::Write, Service::Handlers].into() }
    } else {
        args.services.iter().copied().collect()
    };
    let claim_room = reelay_outbox::queue::CLAIM_ROW_OVERHEAD + 1024;
    if args.max_event_bytes + claim_room > args.grpc_max_message_bytes {
        bail!(
            "REELAY_MAX_EVENT_BYTES ({}) must leave {claim_room} bytes of room under REELAY_GRPC_MAX_MESSAGE_BYTES ({}): \
             every event must fit one claim answer",
            args.max_event_bytes,
            args.grpc_max_message_bytes
        );
    }
    if services.contains(&Service::Relay) && !nats {
        bail!("the relay publishes the outbox to NATS; set EVENT_BUS_BACKEND=nats (and NATS_URL) to run it");
    }
    if services.contains(&Service::Handlers) && !nats && !args.handlers.handlers.is_empty() {
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
    // The write service keeps serving until this node's consumers and relay have settled.
    let clients_done = Shutdown::new();
    let mut clients = tokio::task::JoinSet::new();
    let mut tasks = tokio::task::JoinSet::new();
    let write_url = args.handlers.write_url.clone().unwrap_or_else(|| format!("http://{}", args.write_addr));
    let write_channel =
        connect_lazy(&write_url, grpc.service_token.as_deref(), args.call_timeout()).map_err(anyhow::Error::msg)?;
    let js_config = jetstream_config(&args);
    let nats_client = if nats && (services.contains(&Service::Relay) || services.contains(&Service::Handlers)) {
        Some(nats_setup(&args, &js_config, services.contains(&Service::Relay)).await?)
    } else {
        None
    };

    if services.contains(&Service::Relay) {
        let client = nats_client.clone().expect("connected above");
        let mode = if args.nats.nats_mode == NatsMode::Core { relay::Mode::Core } else { relay::Mode::JetStream };
        let config = relay::RelayConfig {
            subject_prefix: args.nats.subject_prefix.clone(),
            mode,
            batch: args.nats.relay_batch,
            long_poll: CLAIM_LONG_POLL,
            max_message_bytes: args.grpc_max_message_bytes,
        };
        tracing::info!(%write_url, nats = %js_config.url, ?mode, "relay service starting");
        let stop = shutdown.clone();
        clients.spawn(relay::Relay::new(write_channel.clone(), client, config).run(stop));
    }

    if let Some(listener) = handlers_listener {
        let (handlers, index) = hosted_handlers(&args).await?;
        let timeout = Duration::from_millis(args.handlers.handler_timeout_ms);
        let batch = args.handlers.batch as usize;
        let in_flight = args.handlers.in_flight as usize;
        let names: Vec<&str> = handlers.iter().map(|h| h.name()).collect();
        tracing::info!(backend = ?args.handlers.backend, %write_url, handlers = ?names, "handlers service starting");
        let dispatcher = |hosted: Vec<Arc<dyn Handler>>| {
            Dispatcher::new(hosted, write_channel.clone(), timeout, args.delivery.retry(), shutdown.clone())
        };
        match (&nats_client, args.nats.nats_mode) {
            (None, _) => {
                let source = OutboxSource::new(
                    write_channel.clone(),
                    format!("handlers-{}", std::process::id()),
                    CLAIM_LONG_POLL,
                    args.grpc_max_message_bytes,
                );
                clients.spawn(run_consumer(source, dispatcher(handlers), batch, in_flight, shutdown.clone()));
            }
            (Some(client), NatsMode::Jetstream) => {
                let js = async_nats::jetstream::new(client.clone());
                for handler in handlers {
                    let consumer =
                        jetstream::ensure_consumer(&js, &js_config, handler.name(), handler.event_types()).await?;
                    let name = JetStreamConfig::consumer_name(handler.name());
                    let source =
                        JetStreamSource::new(client.clone(), consumer, name, js_config.max_deliver, js_config.ack_wait);
                    clients.spawn(run_consumer(source, dispatcher(vec![handler]), batch, in_flight, shutdown.clone()));
                }
            }
            (Some(client), NatsMode::Core) => {
                for handler in handlers {
                    let source = CoreSource::subscribe(client, &js_config.subject_prefix, handler.name())
                        .await
                        .map_err(anyhow::Error::from)?;
                    clients.spawn(run_consumer(source, dispatcher(vec![handler]), batch, in_flight, shutdown.clone()));
                }
            }
        }
        let mut server = GrpcServer::new(grpc.clone());
        if let Some(index) = index {
            server = reelay_search::mount(server, index);
        }
        let stop = shutdown.clone();
        tasks.spawn(async move {
            server
                .serve(listener, async move { stop.requested().await })
                .await
                .context("the handlers gRPC server failed")
        });
    }
    let done = clients_done.clone();
    tasks.spawn(async move {
        while clients.join_next().await.is_some() {}
        done.request();
        Ok(())
    });

    let mut db = None;
    if let Some(listener) = write_listener {
        let path = args.database.database_path();
        let mut config = db_config(&args.database);
        config.max_event_bytes = args.max_event_bytes;
        let database =
            Database::open(&config).await.with_context(|| format!("cannot open the database {}", path.display()))?;
        tracing::info!(database = %path.display(), synchronous = ?args.database.sqlite_synchronous, "database ready");
        let policy = delivery_policy(&args);
        let server = reelay_write::mount(GrpcServer::new(grpc), reelay_write::Store::new(database.clone()));
        let server = reelay_write::mount_internal(server, database.clone(), policy, shutdown.clone());
        let retention = reelay_write::Retention {
            ledger: policy.ledger,
            request_ids: Duration::from_secs(args.delivery.request_id_retention_hours * 3600),
        };
        tasks.spawn(
            reelay_write::purge_expired(
                database.clone(),
                retention,
                Duration::from_millis(args.delivery.ledger_purge_interval_ms),
                shutdown.clone(),
            )
            .map(Ok),
        );
        let (stop, done) = (shutdown.clone(), clients_done.clone());
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
        queue: QueuePolicy {
            lease: Duration::from_millis(d.outbox_lease_ms),
            max_attempts: d.max_attempts,
            retry: d.retry(),
        },
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
