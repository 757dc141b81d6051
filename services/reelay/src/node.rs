//! Building and running a node: the services named on the command line, wired together.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use futures_util::FutureExt;
use reelay_contracts::v1::{self, ledger_client::LedgerClient, outbox_client::OutboxClient};
use reelay_delivery::consumer::run_consumer;
use reelay_delivery::core_source::CoreSource;
use reelay_delivery::db_source::{ClaimerConfig, DeliveryClaimer, DeliverySource, DeliverySourceConfig};
use reelay_delivery::dispatch::{DispatchConfig, Dispatcher, HandBack, LedgerClaims, build_of};
use reelay_delivery::given_up::GivenUpWatch;
use reelay_delivery::jetstream::{self, JetStreamConfig};
use reelay_delivery::nats_source::{self, JetStreamSource};
use reelay_delivery::{BuiltHandler, Handler, HandlerContext};
use reelay_kit::client::{ServiceChannel, connect_lazy};
use reelay_kit::{Backoff, GrpcConfig, GrpcServer, Readiness, ReadyFlag, Service, Shutdown};
use reelay_outbox::deliveries::HandlerPolicy;
use reelay_outbox::ledger::LedgerPolicy;
use reelay_outbox::queue::QueuePolicy;
use reelay_outbox::{Database, DbConfig};
use reelay_relay as relay;
use reelay_write::{Bus, DeliveryPolicy};
use sqlx::Connection;
use tokio::net::TcpListener;

use crate::config::{Backend, DatabaseArgs, MigrateArgs, NatsMode, RunArgs, read_service_token};

/// How long one outbox claim waits for rows. Commits wake it at once, so this only bounds how
/// long a stopping consumer waits for its last fetch (an idle claim costs one empty job).
const CLAIM_LONG_POLL: Duration = Duration::from_secs(1);

fn db_config(args: &DatabaseArgs) -> DbConfig {
    let mut config = DbConfig::new(args.database_path());
    config.synchronous = args.sqlite_synchronous;
    config
}

fn service_token(args: &RunArgs) -> anyhow::Result<Option<String>> {
    match read_service_token(args.service_token.as_deref(), args.service_token_file.as_deref())? {
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

/// Who this process is to the write service: `<instance>#<incarnation>`. The instance name is
/// stable across restarts (so a restarted process can take back its predecessor's claims) and
/// its own among the live processes of its data dir (see [`crate::locks::instance`]); the
/// incarnation is new for every run.
#[derive(Clone)]
struct Identity {
    instance: String,
    incarnation: String,
}

impl Identity {
    /// The name, and the lock that keeps it this process's own while it runs (when `claims`: the
    /// process runs a service that claims work; the others need no name of their own).
    async fn claim(args: &RunArgs, claims: bool) -> anyhow::Result<(Self, Option<crate::locks::Held>)> {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_owned())
            .unwrap_or_else(|_| "localhost".into());
        // `#` ends the instance in an owner; a name cannot hold one (default names leave it out).
        let explicit = args.instance.as_ref().map(|name| name.replace('#', "_"));
        let data_dir = &args.database.data_dir;
        let (instance, lock) = if claims {
            crate::locks::instance(explicit.as_deref(), &host, data_dir).await?
        } else {
            // Unused: this process claims nothing, so nothing is taken back under its name.
            (explicit.unwrap_or_else(|| crate::locks::default_name(&host, data_dir, 1)), None)
        };
        let incarnation = format!("{}-{}", std::process::id(), reelay_kit::now_ms());
        Ok((Self { instance, incarnation }, lock))
    }

    fn owner(&self) -> String {
        format!("{}#{}", self.instance, self.incarnation)
    }
}

/// Takes back the claims an earlier run of this instance held when it died (it could not settle
/// them), instead of waiting out their leases. Retried until the write service answers; then
/// the services that depend on it are ready.
async fn release_predecessor(
    write: ServiceChannel,
    identity: &Identity,
    shutdown: Shutdown,
    ready: impl Future<Output = Vec<ReadyFlag>>,
) {
    let mut outbox = OutboxClient::new(write);
    let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(5));
    while !shutdown.is_requested() {
        let request = v1::ReleaseInstanceRequest {
            instance: identity.instance.clone(),
            incarnation: identity.incarnation.clone(),
        };
        match outbox.release_instance(request).await {
            Ok(reply) => {
                let released = reply.into_inner().released;
                if released > 0 {
                    tracing::info!(instance = %identity.instance, claims = released,
                        "took back the claims this instance's previous run left behind");
                }
                for flag in ready.await {
                    flag.set(true);
                }
                return;
            }
            Err(status) => {
                tokio::select! {
                    _ = backoff.wait("taking back the previous run's claims", status.message()) => {}
                    () = shutdown.requested() => return,
                }
            }
        }
    }
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
        replicas: args.nats.stream_replicas as usize,
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

pub async fn run(mut args: RunArgs) -> anyhow::Result<()> {
    let nats = args.handlers.backend == Backend::Nats;
    let services: BTreeSet<Service> = if args.services.is_empty() {
        if nats { Service::ALL.into() } else { [Service::Write, Service::Handlers, Service::Gateway].into() }
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
    // A URL no call could use (no scheme: it parses all the same) is refused before anything
    // starts, not found out by every call failing with a transport error.
    if let Some(url) = &args.handlers.write_url {
        reelay_kit::client::check_service_url(url).map_err(|e| anyhow::anyhow!("REELAY_WRITE_URL: {e}"))?;
    }
    let server_policy = server_policy(&args)?;
    if services.contains(&Service::Relay) && !nats {
        bail!("the relay publishes the outbox to NATS; set EVENT_BUS_BACKEND=nats (and NATS_URL) to run it");
    }
    let known = reelay_handlers::names(&args.handlers.settings);
    if let Some(unknown) = args.handlers.handlers.iter().find(|h| !known.contains(&h.as_str())) {
        bail!("unknown handler {unknown:?}; this build has: {}", known.join(", "));
    }
    // The gateway and the federation handlers name everything after the public origin.
    let gateway_addr = args.gateway.gateway_addr;
    let public_url_set = args.handlers.settings.federation.public_url.is_some();
    let public_url =
        args.handlers.settings.federation.public_url.get_or_insert_with(|| format!("http://{gateway_addr}")).clone();
    let urls = reelay_activitypub::Urls::new(&public_url).map_err(anyhow::Error::msg)?;
    // Every actor, key and activity id is built on it and sent to other servers, which keep
    // them: an address no server can reach (0.0.0.0, ::) would make them all wrong for good.
    if host_is_unspecified(urls.host())
        && (services.contains(&Service::Gateway) || services.contains(&Service::Handlers))
    {
        anyhow::bail!(
            "the public URL {public_url} names an address no other server can reach ({}); set REELAY_PUBLIC_URL to \
             the URL other servers reach the gateway at",
            if public_url_set { "REELAY_PUBLIC_URL" } else { "unset: taken from REELAY_GATEWAY_ADDR" }
        );
    }
    // The write service hands clients links under the media URL (wrap-up cards, posters): an
    // address none of them can reach would make every one wrong.
    let media_url = match &args.handlers.media_url {
        Some(url) => url.clone(),
        None if services.contains(&Service::Write) && args.handlers.media_addr.ip().is_unspecified() => {
            anyhow::bail!(
                "REELAY_MEDIA_URL is unset, and REELAY_MEDIA_ADDR ({}) names no address a client can reach; set \
                 REELAY_MEDIA_URL to the URL clients reach the media route at",
                args.handlers.media_addr
            )
        }
        None => format!("http://{}/media", args.handlers.media_addr),
    };
    // Private addresses are reachable in development (two instances on one machine) only.
    let allow_private = *args.handlers.settings.federation.allow_private.get_or_insert(args.dev);
    args.handlers.settings.media.allow_private.get_or_insert(args.dev);
    // Held until the process ends: the database's writer, and this process's instance name
    // (its claims are taken back by the next process of that name).
    let _writer_lock = if services.contains(&Service::Write) {
        Some(crate::locks::database_writer(&args.database.database_path()).await?)
    } else {
        None
    };
    let claims = [Service::Relay, Service::Handlers, Service::Gateway].iter().any(|s| services.contains(s));
    let (identity, _instance_lock) = Identity::claim(&args, claims).await?;
    let grpc = GrpcConfig {
        service_token: service_token(&args)?,
        max_message_bytes: args.grpc_max_message_bytes,
        call_timeout: args.call_timeout(),
        ..GrpcConfig::default()
    };
    // Bind before the slow start-up work so a port clash fails fast, naming the listener and
    // the setting that moves it.
    let bind = |addr: SocketAddr, listener: Listener| async move {
        TcpListener::bind(addr).await.with_context(|| format!("cannot listen on {addr} ({listener})"))
    };
    let write_listener =
        if services.contains(&Service::Write) { Some(bind(args.write_addr, WRITE).await?) } else { None };
    let handlers_listener = if services.contains(&Service::Handlers) {
        Some(bind(args.handlers.handlers_addr, HANDLERS).await?)
    } else {
        None
    };
    let media_listener =
        if services.contains(&Service::Handlers) { Some(bind(args.handlers.media_addr, MEDIA).await?) } else { None };
    let gateway_listener =
        if services.contains(&Service::Gateway) { Some(bind(gateway_addr, GATEWAY).await?) } else { None };
    // Metrics and probes: every service of this process is registered not ready until it is.
    let readiness = Readiness::new();
    let ready: std::collections::BTreeMap<Service, ReadyFlag> =
        services.iter().map(|s| (*s, readiness.service(s.as_str()))).collect();
    tokio::spawn(reelay_kit::admin_http::serve_admin(bind(args.metrics_addr, ADMIN).await?, readiness.clone()));
    register_metrics(&services);

    // A signal makes the process not ready at once; it stops serving after the shutdown delay
    // (a failed service stops it at once).
    let shutdown = Shutdown::new();
    {
        let signalled = Shutdown::new();
        signalled.listen_for_signals();
        let (stop, readiness) = (shutdown.clone(), readiness.clone());
        let delay = Duration::from_millis(args.shutdown_delay_ms);
        tokio::spawn(async move {
            tokio::select! {
                () = signalled.requested() => {
                    readiness.draining();
                    if !delay.is_zero() {
                        tracing::info!(?delay, "not ready; serving on for the shutdown delay");
                        tokio::select! {
                            () = tokio::time::sleep(delay) => {}
                            () = stop.requested() => {}
                        }
                    }
                    tracing::info!("stopping: no new calls; finishing in-flight work");
                    stop.request();
                }
                () = stop.requested() => readiness.draining(),
            }
        });
    }
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
            owner: identity.owner(),
        };
        tracing::info!(%write_url, nats = %jetstream::redacted(&js_config.url), ?mode, owner = %config.owner, "relay service starting");
        let stop = shutdown.clone();
        clients.spawn(relay::Relay::new(write_channel.clone(), client, config).run(stop));
    }

    // Sent once every consumer is set up (below).
    let (all_set_up, set_up) = tokio::sync::oneshot::channel::<()>();
    if claims {
        let (write, stop) = (write_channel.clone(), shutdown.clone());
        let identity = identity.clone();
        // The relay, the handlers and the gateway are ready once the write service answers
        // (and, on nats, the stream and their consumers are set up, which happened above or
        // happens below before this task can run to the end of its first call).
        let flags: Vec<ReadyFlag> = [Service::Relay, Service::Handlers, Service::Gateway]
            .iter()
            .filter_map(|s| ready.get(s).cloned())
            .collect();
        tasks.spawn(async move {
            release_predecessor(write, &identity, stop, set_up.map(|_| flags)).await;
            Ok(())
        });
    }

    if let Some(listener) = handlers_listener {
        let context = HandlerContext { data_dir: args.database.data_dir.clone(), write: write_channel.clone() };
        let mut built = reelay_handlers::build(&args.handlers.handlers, &args.handlers.settings, &context).await?;
        let names: Vec<&str> = built.iter().map(|b| b.handler.name()).collect();
        tracing::info!(backend = ?args.handlers.backend, %write_url, handlers = ?names, owner = %identity.owner(),
            "handlers service starting");
        let mut server =
            GrpcServer::new(grpc.clone()).readiness(Service::Handlers.as_str(), &ready[&Service::Handlers]);
        for mount in built.iter_mut().filter_map(|b| b.grpc.take()) {
            server = mount(server);
        }
        // Served from the start (not ready until set up): a start-up probe is answered while
        // the write service is still awaited below, which may take a while.
        let stop = shutdown.clone();
        tasks.spawn(async move {
            server
                .serve(listener, async move { stop.requested().await })
                .await
                .context("the handlers gRPC server failed")
        });
        let record_dead_letters = nats_client.is_some() && args.nats.nats_mode == NatsMode::Jetstream;
        // On db the handlers of this process claim together (one call for all that ask at once).
        let mut claimer: Option<DeliveryClaimer> = None;
        // On nats their ledger claims go together the same way.
        let ledger_claims = LedgerClaims::start(write_channel.clone(), identity.owner());
        // Core NATS has no redelivery: a message handed back (while standing by, or unstarted at
        // shutdown) would be gone.
        let hand_back = match (&nats_client, args.nats.nats_mode) {
            (None, _) => HandBack::Free,
            (Some(_), NatsMode::Jetstream) => HandBack::SpendsDelivery { after: nats_source::HAND_BACK_AFTER },
            (Some(_), NatsMode::Core) => HandBack::Never,
        };
        // On JetStream this build of each handler is told before the consumers gain the
        // subjects of the types it takes: from then on an older build's replicas stand by
        // instead of acking those messages as none of theirs. (On db each consumer tells it as
        // it starts. A write service in this process does not serve yet, and no other build
        // shares it.)
        if hand_back != HandBack::Never && nats_client.is_some() && write_listener.is_none() {
            let handlers: Vec<Arc<dyn Handler>> = built.iter().map(|b| b.handler.clone()).collect();
            tell_builds_before_consuming(&ledger_claims, &handlers, &shutdown).await;
        }
        for BuiltHandler { handler, .. } in built {
            // On JetStream the consumer's own limits are what the broker applies: another
            // build's replicas or an operator may have set them otherwise (and an update this
            // start made may have been refused), so its deliveries are counted by them.
            let js_consumer = match (&nats_client, args.nats.nats_mode) {
                (Some(client), NatsMode::Jetstream) => {
                    let js = async_nats::jetstream::new(client.clone());
                    let consumer =
                        jetstream::ensure_consumer(&js, &js_config, handler.name(), handler.event_types()).await?;
                    Some((js, consumer))
                }
                _ => None,
            };
            let (max_attempts, ack_wait) = match &js_consumer {
                Some((_, consumer)) => consumer_limits(consumer, &js_config),
                None => (args.delivery.max_attempts, js_config.ack_wait),
            };
            let dispatcher = Dispatcher::new(
                vec![handler.clone()],
                write_channel.clone(),
                ledger_claims.clone(),
                DispatchConfig {
                    handler_timeout: Duration::from_millis(args.handlers.handler_timeout_ms),
                    retry_policy: args.delivery.retry(),
                    ledger_lease: Duration::from_millis(args.delivery.ledger_lease_ms),
                    max_attempts,
                    record_dead_letters,
                    hand_back,
                    unavailable_wait: Duration::from_millis(args.handlers.handler_unavailable_wait_ms),
                },
                shutdown.clone(),
            );
            let (batch, in_flight) = (args.handlers.batch as usize, args.handlers.in_flight as usize);
            // One consumer per handler on every backend: each handler progresses on its own.
            match (&nats_client, args.nats.nats_mode) {
                (None, _) => {
                    let claimer = claimer
                        .get_or_insert_with(|| {
                            DeliveryClaimer::start(
                                write_channel.clone(),
                                ClaimerConfig {
                                    owner: identity.owner(),
                                    long_poll: CLAIM_LONG_POLL,
                                    lease: Duration::from_millis(args.delivery.ledger_lease_ms),
                                    max_message_bytes: args.grpc_max_message_bytes,
                                },
                            )
                        })
                        .clone();
                    let source = DeliverySource::new(
                        claimer,
                        write_channel.clone(),
                        DeliverySourceConfig {
                            handler: handler.name(),
                            event_types: handler.event_types().iter().map(|t| t.to_string()).collect(),
                            max_message_bytes: args.grpc_max_message_bytes,
                            lease: Duration::from_millis(args.delivery.ledger_lease_ms),
                        },
                    );
                    clients.spawn(run_consumer(source, dispatcher, batch, in_flight, shutdown.clone()));
                }
                (Some(client), NatsMode::Jetstream) => {
                    let (js, consumer) = js_consumer.expect("made above for JetStream");
                    let name = JetStreamConfig::consumer_name(handler.name());
                    let source = JetStreamSource::new(client.clone(), consumer, name, max_attempts, ack_wait);
                    clients.spawn(run_consumer(source, dispatcher, batch, in_flight, shutdown.clone()));
                    // What JetStream gives up with no outcome recorded becomes a dead letter.
                    match jetstream::ensure_given_up_consumer(&js, &js_config, handler.name()).await {
                        Ok(advisories) => {
                            let watch = GivenUpWatch {
                                handler: handler.name().to_owned(),
                                advisories,
                                events: js.get_stream(&js_config.stream).await.context("opening the event stream")?,
                                ledger: LedgerClient::new(write_channel.clone()),
                                shutdown: shutdown.clone(),
                            };
                            clients.spawn(watch.run());
                        }
                        Err(error) => tracing::error!(handler = handler.name(), %error,
                            "not watching for given-up messages: one whose last delivery ends with no outcome will not \
                             become a dead letter"),
                    }
                }
                (Some(client), NatsMode::Core) => {
                    let source = CoreSource::subscribe(client, &js_config.subject_prefix, handler.name())
                        .await
                        .map_err(anyhow::Error::from)?;
                    clients.spawn(run_consumer(source, dispatcher, batch, in_flight, shutdown.clone()));
                }
            }
        }
        if let Some(listener) = media_listener {
            let objects = reelay_handlers::objects(&args.handlers.settings, &args.database.data_dir)?;
            tracing::info!(addr = %args.handlers.media_addr, objects = objects.describe(), "media route listening");
            let stop = shutdown.clone();
            tasks.spawn(async move {
                let media = reelay_objects::media_router(objects);
                let limits = reelay_kit::http::HttpLimits::default();
                reelay_kit::http::serve(listener, media, limits, async move { stop.requested().await })
                    .await
                    .context("the media route failed")
            });
        }
    }
    if let Some(listener) = gateway_listener {
        let config = reelay_gateway::GatewayConfig {
            urls,
            max_body_bytes: args.gateway.gateway_max_body_bytes,
            fetch_timeout: Duration::from_millis(args.handlers.settings.federation.timeout_ms),
            key_ttl: Duration::from_secs(args.gateway.gateway_key_ttl_secs),
            allow_private,
        };
        tracing::info!(%write_url, public_url = %public_url, "gateway service starting");
        let (write, stop) = (write_channel.clone(), shutdown.clone());
        tasks.spawn(async move {
            reelay_gateway::serve(listener, config, write, async move { stop.requested().await })
                .await
                .context("the gateway failed")
        });
    }
    let _ = all_set_up.send(());
    let (done, stop) = (clients_done.clone(), shutdown.clone());
    tasks.spawn(async move {
        // The relay, the consumers and the given-up watches run until shutdown; one that ends
        // before (a panic) would leave this process serving, healthy to every probe, without
        // delivering what it hosts. It stops the process instead, so its supervisor restarts it
        // whole; the others are let finish as at any shutdown.
        let mut failure = None;
        while let Some(joined) = clients.join_next().await {
            if failure.is_none() && !stop.is_requested() {
                let how = match &joined {
                    Err(error) if error.is_panic() => "panicked",
                    Err(_) => "was cancelled",
                    Ok(()) => "ended",
                };
                failure = Some(anyhow::anyhow!(
                    "a relay, consumer or given-up watch task {how} before shutdown was asked for; stopping this \
                     process, which no longer delivers everything it hosts (a restart brings it back whole)"
                ));
                stop.request();
            }
        }
        done.request();
        failure.map_or(Ok(()), Err)
    });

    let mut db = None;
    if let Some(listener) = write_listener {
        let path = args.database.database_path();
        let mut config = db_config(&args.database);
        config.max_event_bytes = args.max_event_bytes;
        let database =
            Database::open(&config).await.with_context(|| format!("cannot open the database {}", path.display()))?;
        tracing::info!(database = %path.display(), synchronous = ?args.database.sqlite_synchronous, "database ready");
        // Every handler this deployment delivers to gets its cursor before the first write, so
        // none misses an event.
        let delivered: Vec<String> = if args.handlers.handlers.is_empty() {
            known.iter().map(|h| h.to_string()).collect()
        } else {
            args.handlers.handlers.clone()
        };
        let added = reelay_write::register_handlers(&database, delivered.clone())
            .await
            .context("cannot register the handlers' delivery cursors")?;
        tracing::info!(handlers = ?delivered, new = ?added, "delivering to handlers");
        let policy = delivery_policy(&args);
        reelay_write::note_lease(&database, policy.ledger.lease).await.context("cannot record the claim lease")?;
        let store = reelay_write::Store::new(database.clone()).with_server_policy(server_policy);
        let keys = reelay_write::ActorKeys::new(store.clone());
        tasks.spawn(keys.clone().generate_missing(shutdown.clone()).map(Ok));
        reelay_write::sample_status(database.clone(), policy.bus, server_policy.leaves_out());
        let write_ready = &ready[&Service::Write];
        let server = GrpcServer::new(grpc).readiness(Service::Write.as_str(), write_ready);
        let server = reelay_write::mount(server, store, keys, Some(media_url));
        let server = reelay_write::mount_internal(server, database.clone(), policy, server_policy, shutdown.clone());
        let retention = reelay_write::Retention {
            ledger: policy.ledger,
            request_ids: Duration::from_secs(args.delivery.request_id_retention_hours * 3600),
            outbox: Duration::from_secs(args.delivery.outbox_retention_secs),
            bus: policy.bus,
            federation: Duration::from_secs(args.delivery.federation_retention_days * 86_400),
            failing_servers: Duration::from_secs(args.delivery.federation_retention_days * 86_400)
                .max(server_policy.unavailable_after.unwrap_or_default()),
        };
        // Migrated, handlers registered, about to serve: the write service is ready.
        write_ready.set(true);
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

/// A port this process listens on: what serves there, and the setting that moves it.
#[derive(Clone, Copy)]
struct Listener {
    variable: &'static str,
    flag: &'static str,
    what: &'static str,
}

impl std::fmt::Display for Listener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} / {}, {}", self.variable, self.flag, self.what)
    }
}

const WRITE: Listener =
    Listener { variable: "REELAY_WRITE_ADDR", flag: "--write-addr", what: "the write service's gRPC" };
const HANDLERS: Listener = Listener {
    variable: "REELAY_HANDLERS_ADDR",
    flag: "--handlers-addr",
    what: "the handlers service's gRPC, the Search API",
};
const MEDIA: Listener =
    Listener { variable: "REELAY_MEDIA_ADDR", flag: "--media-addr", what: "the handlers service's media route" };
const GATEWAY: Listener =
    Listener { variable: "REELAY_GATEWAY_ADDR", flag: "--gateway-addr", what: "the ActivityPub gateway" };
const ADMIN: Listener = Listener {
    variable: "REELAY_METRICS_ADDR",
    flag: "--metrics-addr",
    what: "the admin HTTP port: /metrics, /healthz, /readyz",
};

/// Whether `host_port` (`host`, `host:port`, `[v6]:port`) names the unspecified address
/// (0.0.0.0, ::), which a server listens on but nobody can reach.
fn host_is_unspecified(host_port: &str) -> bool {
    let host = match host_port.strip_prefix('[') {
        Some(v6) => v6.split(']').next().unwrap_or_default(),
        None => host_port.split(':').next().unwrap_or_default(),
    };
    host.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_unspecified())
}

/// When federation fan-outs leave a failing server out, checked against the retry schedule.
fn server_policy(args: &RunArgs) -> anyhow::Result<reelay_write::ServerPolicy> {
    let d = &args.delivery;
    let after = d.federation_unavailable_after_secs;
    // Two failures of one delivery are at most a retry delay and an attempt apart.
    let widest_gap_ms = d.retry_cap_ms.saturating_add(args.handlers.settings.federation.timeout_ms);
    if after > 0 && after.saturating_mul(1000) <= widest_gap_ms {
        bail!(
            "REELAY_FEDERATION_UNAVAILABLE_AFTER_SECS ({after}) must be longer than the longest retry delay, \
             REELAY_RETRY_CAP_MS ({} ms), plus an attempt, REELAY_FEDERATION_TIMEOUT_MS ({} ms): a gap between two \
             failures that long starts a server's count over, so it would never turn unavailable (0 turns leaving \
             servers out off)",
            d.retry_cap_ms,
            args.handlers.settings.federation.timeout_ms
        );
    }
    Ok(reelay_write::ServerPolicy {
        unavailable_after: (after > 0).then(|| Duration::from_secs(after)),
        probe_every: Duration::from_secs(d.federation_probe_every_secs),
    })
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
        deliveries: HandlerPolicy {
            lease: Duration::from_millis(d.ledger_lease_ms),
            max_attempts: d.max_attempts,
            retry: d.retry(),
        },
        bus: match args.handlers.backend {
            Backend::Db => Bus::Db,
            Backend::Nats => Bus::Nats,
        },
    }
}

/// Declares the metrics of the services this process runs, so a scrape shows them before they
/// first move: counters without labels, each handler's outcomes and the ledger's at zero.
fn register_metrics(services: &BTreeSet<Service>) {
    if services.contains(&Service::Write) {
        reelay_outbox::register_metrics();
        reelay_write::register_metrics();
    }
    if services.contains(&Service::Relay) {
        relay::register_metrics();
    }
    if services.contains(&Service::Handlers) {
        reelay_delivery::dispatch::register_metrics();
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

/// Tells the write service which build of each of `handlers` this process runs (see
/// `LedgerClaimRequest.builds`), in one call, asking again until it has heard: the consumers
/// are about to gain this build's subjects, and an older build not yet standing by would ack
/// those messages. Returns early at shutdown.
async fn tell_builds_before_consuming(claims: &LedgerClaims, handlers: &[Arc<dyn Handler>], shutdown: &Shutdown) {
    let builds: Vec<v1::HandlerBuild> = handlers.iter().map(|h| build_of(h.as_ref())).collect();
    let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(5));
    while !shutdown.is_requested() {
        let error = match tokio::time::timeout(Duration::from_secs(3), claims.standing_by(builds.clone())).await {
            Ok(Ok(standing_by)) => {
                for s in standing_by {
                    tracing::warn!(handler = %s.handler, why = %s.why, "another build of this handler claims; it stands by");
                }
                return;
            }
            // An older write service refuses a claim of no key: it tells no builds apart.
            Ok(Err(status)) if !reelay_kit::client::is_transport_failure(&status) => {
                tracing::warn!(error = %status.message(), "the write service does not tell builds apart");
                return;
            }
            Ok(Err(status)) => status.message().to_owned(),
            Err(_) => "no answer within 3 s".to_owned(),
        };
        if backoff.retries() == 0 {
            tracing::warn!(%error, "telling the write service this build before consuming; asking again");
        }
        backoff.sleep().await;
    }
}

/// The delivery limits a handler's JetStream consumer has (`max_deliver`, `ack_wait`), which the
/// broker applies whatever this process's settings say; a difference is said once at start.
fn consumer_limits(
    consumer: &async_nats::jetstream::consumer::PullConsumer,
    config: &JetStreamConfig,
) -> (u32, Duration) {
    let actual = &consumer.cached_info().config;
    // No limit (-1) or one past what an attempt count holds: as many as a count holds.
    let max_deliver = u32::try_from(actual.max_deliver).ok().filter(|n| *n > 0).unwrap_or(u32::MAX);
    if max_deliver != config.max_deliver || actual.ack_wait != config.ack_wait {
        tracing::warn!(consumer = %consumer.cached_info().name, max_deliver, ack_wait = ?actual.ack_wait,
            configured_max_deliver = config.max_deliver, configured_ack_wait = ?config.ack_wait,
            "the consumer's max_deliver and ack_wait differ from this process's settings (another build's, an \
             operator's, or an update refused); its own are used");
    }
    (max_deliver, actual.ack_wait)
}

#[cfg(test)]
mod tests {
    use super::host_is_unspecified;

    #[test]
    fn unspecified_hosts_are_found() {
        for host in ["0.0.0.0", "0.0.0.0:8080", "[::]:8080", "[::]"] {
            assert!(host_is_unspecified(host), "{host}");
        }
        for host in ["127.0.0.1:8080", "reelay.example.org", "[::1]:8080", "10.0.0.1"] {
            assert!(!host_is_unspecified(host), "{host}");
        }
    }
}
