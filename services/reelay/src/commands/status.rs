//! `reelay status`: the outbox by status and, per handler, what is pending, how old the oldest
//! is, and its dead letters. On the nats backend a handler's backlog is its JetStream
//! consumer's, read from the broker (`NATS_URL`) when it can be reached.

use std::time::Duration;

use async_nats::jetstream::context::{ConsumerInfoError, ConsumerInfoErrorKind};
use clap::Args;
use reelay_contracts::v1::{self, admin_client::AdminClient};
use reelay_delivery::jetstream::{self, JetStreamConfig};

use super::{ClientArgs, age, call_failed, outln};

#[derive(Debug, Args)]
pub struct StatusArgs {
    #[command(flatten)]
    pub client: ClientArgs,

    /// The broker, for handlers' consumer backlogs on the nats backend.
    #[arg(long, env = "NATS_URL", default_value = "nats://127.0.0.1:4222", hide_env_values = true)]
    pub nats_url: String,

    #[arg(long, env = "REELAY_STREAM", default_value = "REELAY_EVENTS")]
    pub stream: String,
}

/// A handler's JetStream consumer, as the broker reports it.
struct ConsumerBacklog {
    /// Not yet delivered plus delivered and not yet acked.
    pending: u64,
    oldest_age_ms: i64,
}

/// What the broker said of one handler's consumer.
enum Consumer {
    Found(ConsumerBacklog),
    /// The broker has no such consumer (the handler never ran on nats, or it was removed).
    Missing,
    /// It could not be read (a timeout, an offline consumer): the error, with the consumer's name.
    Unreadable(String),
}

impl Consumer {
    /// A consumer whose info could not be read: missing only when the broker says so.
    fn unread(name: &str, error: &ConsumerInfoError) -> Self {
        if error.kind() == ConsumerInfoErrorKind::NotFound {
            Consumer::Missing
        } else {
            Consumer::Unreadable(format!("consumer {name}: {error}"))
        }
    }
}

pub async fn run(args: StatusArgs) -> anyhow::Result<()> {
    let mut admin = AdminClient::new(args.client.write()?);
    let status = admin.status(v1::StatusRequest {}).await.map_err(|s| call_failed("status", s))?.into_inner();
    outln!("backend: {}", status.backend);
    outln!(
        "outbox: {} pending, {} processing, {} done, {} dead-lettered; oldest waiting: {}",
        status.outbox_pending,
        status.outbox_processing,
        status.outbox_done,
        status.outbox_dead_lettered,
        // Nothing waiting has no age (as a handler row shows it).
        if status.oldest_due_age_ms > 0 { age(status.oldest_due_age_ms) } else { "-".to_owned() }
    );
    if status.federation_servers_failing + status.federation_servers_unavailable > 0 {
        outln!(
            "federation: {} server(s) failing deliveries, {} unavailable (left out of fan-outs but for a probe now and then)",
            status.federation_servers_failing,
            status.federation_servers_unavailable
        );
    }
    let nats = if status.backend == "nats" { Some(nats_backlogs(&args, &status.handlers).await) } else { None };
    outln!(
        "{:<24} {:>10} {:>12} {:>12} {:>10} {:>14}",
        "HANDLER",
        "PENDING",
        "OLDEST",
        "IN PROGRESS",
        "RETRYING",
        "DEAD LETTERS"
    );
    for (i, h) in status.handlers.iter().enumerate() {
        let (pending, oldest) = match &nats {
            None => (h.pending.to_string(), if h.pending == 0 { "-".to_owned() } else { age(h.oldest_age_ms) }),
            // The consumer's backlog: a replay is in it once the relay published its copy (its
            // ledger row, `retry` until claimed, shows under RETRYING, not counted twice here).
            Some(Ok(backlogs)) => match &backlogs[i] {
                Consumer::Found(b) => {
                    (b.pending.to_string(), if b.pending == 0 { "-".to_owned() } else { age(b.oldest_age_ms) })
                }
                Consumer::Missing => ("no consumer".to_owned(), "-".to_owned()),
                Consumer::Unreadable(_) => ("unknown".to_owned(), "-".to_owned()),
            },
            Some(Err(_)) => ("unknown".to_owned(), "-".to_owned()),
        };
        outln!(
            "{:<24} {:>10} {:>12} {:>12} {:>10} {:>14}",
            h.handler,
            pending,
            oldest,
            h.in_progress,
            h.retrying,
            h.dead_lettered
        );
    }
    // During a rolling update: which build of a handler is handed work, which stand by.
    for h in &status.handlers {
        let live: Vec<&v1::HandlerBuildStatus> = h.builds.iter().filter(|b| b.live).collect();
        if live.len() < 2 {
            continue;
        }
        let described: Vec<String> = live
            .iter()
            .map(|b| {
                let role = if b.handed { "handed work" } else { "standing by" };
                // A build is told apart by its types; a long list is only counted.
                let types = if b.event_types.len() <= 4 {
                    format!("[{}]", b.event_types.join(", "))
                } else {
                    format!("[{} types]", b.event_types.len())
                };
                format!("{role} {types} (heard {} ago)", age(b.last_seen_age_ms))
            })
            .collect();
        outln!("{}: {} builds live (a rolling update?): {}", h.handler, live.len(), described.join("; "));
    }
    let retired: Vec<&str> = status.handlers.iter().filter(|h| !h.delivered).map(|h| h.handler.as_str()).collect();
    if !retired.is_empty() {
        outln!(
            "not delivered by this write service (not in its build or --handler list): {}; on db each cursor holds \
             outbox retention back: reelay handlers retire <name>",
            retired.join(", ")
        );
    }
    match nats {
        Some(Err(error)) => {
            outln!("(pending on nats is each handler's JetStream consumer backlog; cannot read it: {error})");
        }
        Some(Ok(backlogs)) => {
            for (h, backlog) in status.handlers.iter().zip(&backlogs) {
                if let Consumer::Unreadable(error) = backlog {
                    outln!("({}: pending unknown, cannot read its JetStream consumer: {error})", h.handler);
                }
            }
        }
        None => {}
    }
    Ok(())
}

/// Each handler's consumer backlog, in the order of `handlers`.
async fn nats_backlogs(args: &StatusArgs, handlers: &[v1::HandlerStatus]) -> Result<Vec<Consumer>, String> {
    let client = tokio::time::timeout(Duration::from_secs(5), async_nats::connect(&args.nats_url))
        .await
        .map_err(|_| format!("{}: timed out", jetstream::redacted(&args.nats_url)))?
        .map_err(|e| format!("{}: {e}", jetstream::redacted(&args.nats_url)))?;
    let js = async_nats::jetstream::new(client);
    let stream = js.get_stream(&args.stream).await.map_err(|e| format!("stream {}: {e}", args.stream))?;
    let mut backlogs = Vec::with_capacity(handlers.len());
    for h in handlers {
        let name = JetStreamConfig::consumer_name(&h.handler);
        let info = match stream.consumer_info(&name).await {
            Ok(info) => info,
            Err(error) => {
                backlogs.push(Consumer::unread(&name, &error));
                continue;
            }
        };
        let pending = info.num_pending + info.num_ack_pending as u64;
        // The oldest message the consumer has not acked: the first of its subjects after its
        // ack floor.
        let mut oldest_age_ms = 0;
        if pending > 0 {
            let mut oldest: Option<i128> = None;
            for subject in info.config.filter_subjects.iter().chain(Some(&info.config.filter_subject)) {
                if subject.is_empty() {
                    continue;
                }
                let found = stream
                    .raw_message_builder()
                    .sequence(info.ack_floor.stream_sequence + 1)
                    .next_by_subject(subject.clone())
                    .send()
                    .await;
                if let Ok(message) = found {
                    let at = message.time.unix_timestamp_nanos();
                    oldest = Some(oldest.map_or(at, |o| o.min(at)));
                }
            }
            if let Some(at) = oldest {
                oldest_age_ms = (reelay_kit::now_ms() - (at / 1_000_000) as i64).max(0);
            }
        }
        backlogs.push(Consumer::Found(ConsumerBacklog { pending, oldest_age_ms }));
    }
    Ok(backlogs)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Only the broker's "consumer not found" is shown as no consumer; any other failure to
    /// read one (it was shown as no consumer too) is unknown, with the error.
    #[test]
    fn only_a_consumer_the_broker_does_not_have_is_missing() {
        let missing = ConsumerInfoError::new(ConsumerInfoErrorKind::NotFound);
        assert!(matches!(Consumer::unread("handler-search", &missing), Consumer::Missing));
        for kind in
            [ConsumerInfoErrorKind::TimedOut, ConsumerInfoErrorKind::Offline, ConsumerInfoErrorKind::NoResponders]
        {
            let error = ConsumerInfoError::new(kind.clone());
            match Consumer::unread("handler-search", &error) {
                Consumer::Unreadable(text) => {
                    assert!(text.contains("handler-search") && text.contains(&kind.to_string()), "{text}")
                }
                _ => panic!("{kind:?} was taken for a missing consumer"),
            }
        }
    }
}
