//! NATS JetStream set-up shared by the relay and the handler services: connecting, the stream
//! and the per-handler durable consumers reconciled with what this build needs, and the
//! start-up checks (retry horizon against the duplicate window; fsync on every write).
//!
//! An existing stream or consumer is never recreated: the fields this build needs are updated in
//! place on a clone of the existing config, so operator-set fields and immutable ones are kept.
//! If the server refuses the update, the warning gives the exact `nats` command to apply it by
//! hand, and start-up goes on.

use std::time::Duration;

use async_nats::jetstream::{self, consumer, stream};
use reelay_domain::RetryPolicy;

/// JetStream drops a repeated `Nats-Msg-Id` within this window. Set explicitly: the server's
/// default (2 minutes) is shorter than the relay can take to retry a publish.
pub const DUPLICATE_WINDOW: Duration = Duration::from_secs(3600);

#[derive(Debug, Clone)]
pub struct JetStreamConfig {
    pub url: String,
    pub stream: String,
    /// Events are published to `<subject_prefix>.<event type>`.
    pub subject_prefix: String,
    /// `max_deliver` of every handler consumer (`EVENT_QUEUE_MAX_ATTEMPTS`).
    pub max_deliver: u32,
    pub ack_wait: Duration,
    /// Unacked messages a consumer may have out at once. Messages waiting out a nak delay count
    /// against it, so it must cover a backlog of failing events, not just the fetch batch.
    pub max_ack_pending: i64,
    /// The server's monitoring endpoint (e.g. `http://127.0.0.1:8222`), used to check that it
    /// fsyncs every write.
    pub monitor_url: Option<String>,
    /// Copies of the stream a clustered server keeps (1 on a single server; 3 in a cluster, so
    /// losing a node loses no acknowledged event). The handlers' consumers follow the stream.
    pub replicas: usize,
}

impl JetStreamConfig {
    pub fn subject(&self, event_type: &str) -> String {
        format!("{}.{event_type}", self.subject_prefix)
    }

    pub fn consumer_name(handler: &str) -> String {
        format!("handler-{handler}")
    }

    /// Where an operator's replays for `handler` alone are published (any event type): its
    /// consumer takes this subject besides its event types, no other consumer does.
    pub fn replay_subject(&self, handler: &str, event_type: &str) -> String {
        format!("{}.replay.{handler}.{event_type}", self.subject_prefix)
    }

    /// The stream that keeps JetStream's word that it gave a handler's message up: the
    /// max-deliveries and terminated advisories of the event stream's consumers, which the
    /// server publishes once, to whoever listens then (see [`crate::given_up`]).
    pub fn given_up_stream(&self) -> String {
        format!("{}_GIVEN_UP", self.stream)
    }

    /// The advisories saying the server gave up a message of `consumer` (`*` for every consumer).
    pub fn given_up_subjects(&self, consumer: &str) -> Vec<String> {
        ["MAX_DELIVERIES", "MSG_TERMINATED"]
            .iter()
            .map(|kind| format!("$JS.EVENT.ADVISORY.CONSUMER.{kind}.{}.{consumer}", self.stream))
            .collect()
    }

    /// The durable consumer through which a handler's processes read its given-up advisories.
    pub fn given_up_consumer_name(handler: &str) -> String {
        format!("given-up-{handler}")
    }

    /// The subjects a handler's consumer takes: its event types, and its replays.
    pub fn consumer_subjects(&self, handler: &str, event_types: &[&str]) -> Vec<String> {
        let mut subjects: Vec<String> = event_types.iter().map(|t| self.subject(t)).collect();
        subjects.push(self.replay_subject(handler, "*"));
        subjects
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    #[error("cannot reach NATS at {url}: {message}")]
    Connect { url: String, message: String },
    #[error("JetStream {what} failed: {message}")]
    JetStream { what: String, message: String },
    #[error(
        "the retry horizon ({horizon:?}: the outbox lease or the sum of retry delays over \
         {max_attempts} attempts) outlives the broker's duplicate window ({window:?}), so a late \
         republish could be delivered twice; lower EVENT_QUEUE_MAX_ATTEMPTS or REELAY_OUTBOX_LEASE_MS"
    )]
    Horizon { horizon: Duration, max_attempts: u32, window: Duration },
}

fn js_error(what: impl Into<String>, error: impl std::fmt::Display) -> SetupError {
    SetupError::JetStream { what: what.into(), message: error.to_string() }
}

/// Connects; the client keeps reconnecting by itself after an outage.
pub async fn connect(url: &str) -> Result<async_nats::Client, SetupError> {
    async_nats::ConnectOptions::new()
        .name("reelay")
        .retry_on_initial_connect()
        .connection_timeout(Duration::from_secs(5))
        .request_timeout(Some(Duration::from_secs(5)))
        .event_callback(|event| async move {
            match event {
                async_nats::Event::Disconnected => tracing::warn!("disconnected from NATS; reconnecting"),
                async_nats::Event::Connected => tracing::info!("connected to NATS"),
                other => tracing::debug!(event = %other, "nats client event"),
            }
        })
        .connect(url)
        .await
        .map_err(|e| SetupError::Connect { url: redacted(url), message: e.to_string() })
}

/// A broker URL (one or more, comma-separated) with any user, password or token replaced by
/// `***`, for logs and errors.
pub fn redacted(url: &str) -> String {
    url.split(',')
        .map(|one| {
            let Some((scheme, rest)) = one.split_once("://") else { return one.to_owned() };
            let authority_end = rest.find('/').unwrap_or(rest.len());
            match rest[..authority_end].rfind('@') {
                Some(at) => format!("{scheme}://***@{}", &rest[at + 1..]),
                None => one.to_owned(),
            }
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// Refuses a configuration whose retries could outlast the broker's dedup memory.
pub fn check_retry_horizon(retry: RetryPolicy, max_attempts: u32, outbox_lease: Duration) -> Result<(), SetupError> {
    let horizon = retry.horizon(max_attempts).max(outbox_lease);
    if horizon >= DUPLICATE_WINDOW {
        return Err(SetupError::Horizon { horizon, max_attempts, window: DUPLICATE_WINDOW });
    }
    Ok(())
}

/// Creates the event stream and the stream of given-up advisories beside it, or brings an
/// existing event stream's `duplicate_window` to what Reelay needs.
pub async fn ensure_stream(js: &jetstream::Context, config: &JetStreamConfig) -> Result<(), SetupError> {
    ensure_event_stream(js, config).await?;
    // Without it the pipeline still runs; only given-up messages go unrecorded, which is said.
    if let Err(error) = ensure_given_up_stream(js, config).await {
        tracing::error!(%error,
            "cannot keep JetStream's given-up advisories (does another stream take $JS.EVENT.ADVISORY subjects?): \
             a message whose last delivery ends with no outcome will not become a dead letter");
    }
    Ok(())
}

/// How long a given-up advisory is kept for a handler that does not run to read it.
const GIVEN_UP_MAX_AGE: Duration = Duration::from_secs(30 * 86_400);

/// Creates the stream of given-up advisories, or brings an existing one to what this build needs
/// (see [`given_up_stream_update`]): one made by an older build, or edited by hand, still keeps
/// every advisory a handler records, for as long as one may wait for its handler, in as many
/// copies as the event stream (a deployment that moved to a cluster keeps both in three).
async fn ensure_given_up_stream(js: &jetstream::Context, config: &JetStreamConfig) -> Result<(), SetupError> {
    let name = config.given_up_stream();
    let stream = js
        .get_or_create_stream(stream::Config {
            name: name.clone(),
            subjects: config.given_up_subjects("*"),
            storage: stream::StorageType::File,
            num_replicas: config.replicas,
            max_age: GIVEN_UP_MAX_AGE,
            description: Some(format!(
                "JetStream's advisories that it stopped delivering a message of {} to a handler (its deliveries ran \
             out, or it was terminated); each handler records those without an outcome as dead letters",
                config.stream
            )),
            ..Default::default()
        })
        .await
        .map_err(|e| js_error(format!("creating stream {name}"), e))?;
    // The stream as the server just described it (opening it reads its info).
    let current = stream.cached_info().config.clone();
    if let Some(wanted) = given_up_stream_update(&current, config) {
        match js.update_stream(&wanted).await {
            Ok(_) => tracing::warn!(stream = %name, from_replicas = current.num_replicas,
                to_replicas = wanted.num_replicas, from_subjects = ?current.subjects, to_subjects = ?wanted.subjects,
                from_max_age = ?current.max_age, to_max_age = ?wanted.max_age,
                "updated the existing stream's replicas, subjects and max age in place"),
            // It still keeps what it did, in fewer copies, for less long or of fewer kinds.
            Err(error) => tracing::warn!(stream = %name, %error,
                "could not update the stream; apply it by hand: nats stream edit {name} --replicas {} --subjects {} \
                 --max-age {}s",
                wanted.num_replicas, wanted.subjects.join(","), wanted.max_age.as_secs()),
        }
    }
    Ok(())
}

/// The given-up stream's config with what this build needs of it, if that differs from
/// `current`: the event stream's copies, every advisory subject a handler reads (others an
/// operator added are kept), and advisories kept at least [`GIVEN_UP_MAX_AGE`] (no limit, or a
/// longer one, is kept).
fn given_up_stream_update(current: &stream::Config, config: &JetStreamConfig) -> Option<stream::Config> {
    let mut wanted = current.clone();
    wanted.num_replicas = config.replicas;
    for subject in config.given_up_subjects("*") {
        if !wanted.subjects.contains(&subject) {
            wanted.subjects.push(subject);
        }
    }
    if !current.max_age.is_zero() && current.max_age < GIVEN_UP_MAX_AGE {
        wanted.max_age = GIVEN_UP_MAX_AGE;
    }
    (wanted != *current).then_some(wanted)
}

/// Opens (or creates) the durable consumer through which `handler`'s processes read the
/// advisories of messages given up for it, adding to its filter any advisory subject of the
/// handler it lacks (one made by an older build, or edited by hand).
pub async fn ensure_given_up_consumer(
    js: &jetstream::Context,
    config: &JetStreamConfig,
    handler: &str,
) -> Result<consumer::PullConsumer, SetupError> {
    let stream_name = config.given_up_stream();
    let name = JetStreamConfig::given_up_consumer_name(handler);
    let subjects = config.given_up_subjects(&JetStreamConfig::consumer_name(handler));
    let stream =
        js.get_stream(&stream_name).await.map_err(|e| js_error(format!("looking up stream {stream_name}"), e))?;
    let consumer: consumer::PullConsumer = stream
        .get_or_create_consumer(
            &name,
            consumer::pull::Config {
                durable_name: Some(name.clone()),
                description: Some(format!("Reelay handler `{handler}`: messages JetStream gave up")),
                filter_subjects: subjects.clone(),
                ack_policy: consumer::AckPolicy::Explicit,
                deliver_policy: consumer::DeliverPolicy::All,
                ack_wait: Duration::from_secs(30),
                ..Default::default()
            },
        )
        .await
        .map_err(|e| js_error(format!("creating consumer {name}"), e))?;
    let current = consumer.cached_info().config.clone();
    let Some(filters) = filters_with(&current, subjects) else {
        return Ok(consumer);
    };
    let wanted = consumer::Config { filter_subject: String::new(), filter_subjects: filters.clone(), ..current };
    match stream.update_consumer(wanted).await {
        Ok(_) => {
            tracing::warn!(consumer = %name, subjects = ?filters, "updated the existing consumer's subjects in place");
            stream.get_consumer(&name).await.map_err(|e| js_error(format!("opening consumer {name}"), e))
        }
        // It still reads the advisories its filter takes.
        Err(error) => {
            tracing::warn!(consumer = %name, %error,
                "could not update the consumer; apply it by hand: nats consumer edit {stream_name} {name} --filter {}",
                filters.join(" --filter "));
            Ok(consumer)
        }
    }
}

/// Creates the event stream, or brings an existing one to what Reelay needs: its
/// `duplicate_window` and replicas, and, when an operator gave it a size limit, the discard
/// policy `new` (at the limit the broker refuses new events, which the relay waits out, instead
/// of dropping the oldest, which handlers may not have read). A per-subject limit takes
/// `discard_new_per_subject` too: without it the broker drops a subject's oldest message at
/// that limit whatever the discard policy (subjects are event types, so one limit there drops
/// unread events of one type). An update the broker refuses fails the start when the stream as
/// it is could repeat or drop events (a shorter window, the discard policy), and is said
/// otherwise.
async fn ensure_event_stream(js: &jetstream::Context, config: &JetStreamConfig) -> Result<(), SetupError> {
    match js.get_stream(&config.stream).await {
        Ok(existing) => {
            let current = existing.cached_info().config.clone();
            if current.retention != stream::RetentionPolicy::Limits {
                return Err(js_error(
                    format!("checking stream {}", config.stream),
                    format!(
                        "its retention is {:?}; Reelay needs limits retention (an event stays, read or not, for a \
                         handler that starts later and for a given-up message's dead letter), which cannot be set \
                         in place: make the stream anew (nats stream rm {}) while nothing is unread",
                        current.retention, config.stream
                    ),
                ));
            }
            // Every subject the relay publishes (replays too), if the stream was made narrower.
            let all = format!("{}.>", config.subject_prefix);
            let uncovered = !current.subjects.iter().any(|s| s.ends_with('>') && takes(s, &all));
            let limited = current.max_messages > 0 || current.max_bytes > 0 || current.max_messages_per_subject > 0;
            let discard = if limited { stream::DiscardPolicy::New } else { current.discard };
            let per_subject = current.max_messages_per_subject > 0 || current.discard_new_per_subject;
            if current.duplicate_window != DUPLICATE_WINDOW
                || current.num_replicas != config.replicas
                || current.discard != discard
                || current.discard_new_per_subject != per_subject
                || uncovered
            {
                let mut wanted = current.clone();
                if uncovered {
                    // The narrower subjects it covers would overlap it; the operator's others stay.
                    wanted.subjects.retain(|s| !takes(&all, s));
                    wanted.subjects.push(all.clone());
                }
                wanted.duplicate_window = DUPLICATE_WINDOW;
                wanted.num_replicas = config.replicas;
                wanted.discard = discard;
                wanted.discard_new_per_subject = per_subject;
                match js.update_stream(&wanted).await {
                    Ok(_) => {
                        tracing::warn!(stream = %config.stream, from = ?current.duplicate_window, to = ?DUPLICATE_WINDOW,
                        from_replicas = current.num_replicas, to_replicas = config.replicas,
                        from_discard = ?current.discard, to_discard = ?discard,
                        from_discard_new_per_subject = current.discard_new_per_subject,
                        to_discard_new_per_subject = per_subject, added_subject = uncovered.then_some(all.as_str()),
                        "updated the existing stream's duplicate_window, replicas, discard policy and subjects in place")
                    }
                    Err(error) => {
                        let by_hand = format!(
                            "nats stream edit {} --dupe-window 1h --replicas {}{}{}{}",
                            config.stream,
                            config.replicas,
                            if limited { " --discard new" } else { "" },
                            if per_subject { " --discard-per-subject" } else { "" },
                            if uncovered {
                                format!(" --subjects '{}'", wanted.subjects.join(","))
                            } else {
                                String::new()
                            }
                        );
                        // Left as it is, a stream that forgets a publish sooner than a relay may
                        // repeat it delivers it twice, and one that drops at its limit drops
                        // unread events: not a stream to run on. Its replicas or a subject of
                        // a replay only, it can run on, said.
                        let loses = current.duplicate_window < DUPLICATE_WINDOW
                            || current.discard != discard
                            || current.discard_new_per_subject != per_subject;
                        if loses {
                            return Err(js_error(
                                format!("updating stream {}", config.stream),
                                format!(
                                    "{error}; as it is, an event could be delivered twice or dropped unread: {by_hand}"
                                ),
                            ));
                        }
                        tracing::warn!(stream = %config.stream, %error, "could not update the stream; apply it by hand: {by_hand}");
                    }
                }
            }
            if !current.max_age.is_zero() {
                tracing::warn!(stream = %config.stream, max_age = ?current.max_age,
                    "the event stream deletes events older than its max_age, read or not: a handler stopped for \
                     longer misses them; remove the limit (nats stream edit {} --max-age 0) unless that is meant",
                    config.stream);
            }
            Ok(())
        }
        Err(error)
            if matches!(error.kind(), jetstream::context::GetStreamErrorKind::JetStream(e)
                if e.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND) =>
        {
            let created = js
                .create_stream(stream::Config {
                    name: config.stream.clone(),
                    subjects: vec![format!("{}.>", config.subject_prefix)],
                    storage: stream::StorageType::File,
                    duplicate_window: DUPLICATE_WINDOW,
                    num_replicas: config.replicas,
                    description: Some("Reelay domain events, published from the outbox by the relay".into()),
                    ..Default::default()
                })
                .await
                .map_err(|e| js_error(format!("creating stream {}", config.stream), e))?;
            tracing::info!(stream = %created.cached_info().config.name, "created the event stream");
            Ok(())
        }
        Err(error) => Err(js_error(format!("looking up stream {}", config.stream), error)),
    }
}

/// Creates a handler's durable pull consumer, or brings an existing one's `max_deliver`,
/// `ack_wait` and `max_ack_pending` to this build's values and adds the subjects it lacks.
/// Returns the consumer to pull from.
pub async fn ensure_consumer(
    js: &jetstream::Context,
    config: &JetStreamConfig,
    handler: &str,
    event_types: &[&str],
) -> Result<consumer::PullConsumer, SetupError> {
    let name = JetStreamConfig::consumer_name(handler);
    let stream =
        js.get_stream(&config.stream).await.map_err(|e| js_error(format!("looking up stream {}", config.stream), e))?;
    let max_deliver = i64::from(config.max_deliver);
    match stream.get_consumer::<consumer::Config>(&name).await {
        Ok(existing) => {
            let current = existing.cached_info().config.clone();
            // A newer build's handler may take more event types (and consumers made before
            // replays existed lack the replay subject): what it lacks is added, or those
            // events would never reach it; subjects an operator added are kept.
            let filters = filters_with(&current, config.consumer_subjects(handler, event_types));
            if current.max_deliver != max_deliver
                || current.ack_wait != config.ack_wait
                || current.max_ack_pending != config.max_ack_pending
                || filters.is_some()
            {
                let mut wanted = current.clone();
                wanted.max_deliver = max_deliver;
                wanted.ack_wait = config.ack_wait;
                wanted.max_ack_pending = config.max_ack_pending;
                if let Some(filters) = filters {
                    wanted.filter_subject = String::new();
                    wanted.filter_subjects = filters;
                }
                match stream.update_consumer(wanted).await {
                    Ok(_) => {
                        tracing::warn!(consumer = %name, from_max_deliver = current.max_deliver, to_max_deliver = max_deliver,
                        from_ack_wait = ?current.ack_wait, to_ack_wait = ?config.ack_wait,
                        from_max_ack_pending = current.max_ack_pending, to_max_ack_pending = config.max_ack_pending,
                        "updated the existing consumer's max_deliver, ack_wait, max_ack_pending and subjects in place")
                    }
                    Err(error) => tracing::warn!(consumer = %name, %error,
                        "could not update the consumer; apply it by hand: nats consumer edit {} {} --max-deliver {} --wait {}s \
                         --max-pending {}",
                        config.stream, name, max_deliver, config.ack_wait.as_secs().max(1), config.max_ack_pending),
                }
            }
        }
        // Not found (or unreadable): create it; a real conflict surfaces as the create's error.
        Err(_) => {
            stream
                .create_consumer(consumer::pull::Config {
                    durable_name: Some(name.clone()),
                    description: Some(format!("Reelay handler `{handler}`")),
                    filter_subjects: config.consumer_subjects(handler, event_types),
                    ack_policy: consumer::AckPolicy::Explicit,
                    deliver_policy: consumer::DeliverPolicy::All,
                    ack_wait: config.ack_wait,
                    max_deliver,
                    max_ack_pending: config.max_ack_pending,
                    // No `backoff`: naks carry their own delay (retry_backoff), and setting it
                    // makes the server rewrite ack_wait.
                    ..Default::default()
                })
                .await
                .map_err(|e| js_error(format!("creating consumer {name}"), e))?;
            tracing::info!(consumer = %name, "created the handler's durable consumer");
        }
    }
    stream.get_consumer(&name).await.map_err(|e| js_error(format!("opening consumer {name}"), e))
}

/// A consumer's filter with the `needed` subjects none of its own takes added (its own kept as
/// they are), or `None` if it takes them all (a consumer without a filter takes everything).
fn filters_with(current: &consumer::Config, needed: impl IntoIterator<Item = String>) -> Option<Vec<String>> {
    let mut filters = current.filter_subjects.clone();
    if !current.filter_subject.is_empty() {
        filters.push(current.filter_subject.clone());
    }
    if filters.is_empty() {
        return None;
    }
    let mut missing: Vec<String> = Vec::new();
    for subject in needed {
        if !filters.iter().chain(&missing).any(|filter| takes(filter, &subject)) {
            missing.push(subject);
        }
    }
    (!missing.is_empty()).then(|| [filters, missing].concat())
}

/// Whether the filter `filter` takes every subject `subject` names (NATS wildcards: `*` one
/// token, `>` the rest), so adding `subject` beside it would overlap, which JetStream refuses.
fn takes(filter: &str, subject: &str) -> bool {
    let (mut filter, mut subject) = (filter.split('.'), subject.split('.'));
    loop {
        match (filter.next(), subject.next()) {
            (None, None) | (Some(">"), Some(_)) => return true,
            (Some(f), Some(s)) if f == "*" || f == s => {}
            _ => return false,
        }
    }
}

/// Warns unless the server reports that it fsyncs every write (`sync_interval: always`).
pub async fn warn_unless_fsync_always(monitor_url: Option<&str>) {
    let Some(url) = monitor_url else {
        tracing::warn!(
            "cannot check that NATS fsyncs every write: set REELAY_NATS_MONITOR_URL to its monitoring endpoint"
        );
        return;
    };
    match fetch_sync_always(url).await {
        Ok(true) => tracing::info!("NATS fsyncs every JetStream write (sync_interval: always)"),
        Ok(false) => tracing::warn!(
            "the NATS server does not fsync every write: an acknowledged event can be lost if its machine loses power; \
             set `sync_interval: always` in its jetstream config"
        ),
        Err(error) => tracing::warn!(%url, %error, "cannot check whether NATS fsyncs every write"),
    }
}

/// Reads `jetstream.config.sync_always` from the server's `/varz`.
async fn fetch_sync_always(base: &str) -> Result<bool, String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let authority = base.trim_start_matches("http://").trim_end_matches('/');
    let mut stream = tokio::time::timeout(Duration::from_secs(3), tokio::net::TcpStream::connect(authority))
        .await
        .map_err(|_| "timed out".to_owned())?
        .map_err(|e| e.to_string())?;
    let request = format!("GET /varz HTTP/1.1\r\nHost: {authority}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.map_err(|e| e.to_string())?;
    let mut response = Vec::new();
    tokio::time::timeout(Duration::from_secs(3), stream.read_to_end(&mut response))
        .await
        .map_err(|_| "timed out".to_owned())?
        .map_err(|e| e.to_string())?;
    let text = String::from_utf8_lossy(&response);
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b).ok_or("malformed HTTP response")?;
    // Chunked or not, the JSON object is the text between the first '{' and the last '}'.
    let json = json_object(body).ok_or("no JSON object in /varz")?;
    let varz: serde_json::Value = serde_json::from_str(json).map_err(|e| e.to_string())?;
    Ok(varz.pointer("/jetstream/config/sync_always").and_then(serde_json::Value::as_bool).unwrap_or(false))
}

/// The text from the first `{` to the last `}` after it, if there is one.
fn json_object(body: &str) -> Option<&str> {
    let start = body.find('{')?;
    let end = body.rfind('}').filter(|&end| end > start)?;
    body.get(start..=end)
}

#[cfg(test)]
mod tests {
    #[test]
    fn credentials_are_not_shown() {
        assert_eq!(redacted("nats://reelay:s3cret@nats:4222"), "nats://***@nats:4222");
        assert_eq!(redacted("nats://token@nats:4222,nats://other:4222"), "nats://***@nats:4222,nats://other:4222");
        assert_eq!(redacted("nats://127.0.0.1:4222"), "nats://127.0.0.1:4222");
        assert_eq!(redacted("tls://u:p@host:4222/x@y"), "tls://***@host:4222/x@y");
    }

    use super::*;

    fn config(replicas: usize) -> JetStreamConfig {
        JetStreamConfig {
            url: "nats://127.0.0.1:4222".into(),
            stream: "REELAY".into(),
            subject_prefix: "reelay".into(),
            max_deliver: 5,
            ack_wait: Duration::from_secs(30),
            max_ack_pending: 1000,
            monitor_url: None,
            replicas,
        }
    }

    /// A given-up stream as this build makes it is left alone; one made otherwise (fewer copies,
    /// a subject missing, advisories kept less long) is brought to what handlers need, and what
    /// an operator chose beyond that (a subject of their own, a longer or no age limit) is kept.
    #[test]
    fn a_given_up_stream_is_brought_to_what_handlers_need() {
        let made = stream::Config {
            name: "REELAY_GIVEN_UP".into(),
            subjects: config(1).given_up_subjects("*"),
            num_replicas: 1,
            max_age: GIVEN_UP_MAX_AGE,
            description: Some("kept".into()),
            ..Default::default()
        };
        assert_eq!(given_up_stream_update(&made, &config(1)), None);
        let clustered = given_up_stream_update(&made, &config(3)).expect("three copies asked for");
        assert_eq!(clustered, stream::Config { num_replicas: 3, ..made.clone() });

        let terminated = "$JS.EVENT.ADVISORY.CONSUMER.MSG_TERMINATED.REELAY.*".to_owned();
        let deliveries = "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.REELAY.*".to_owned();
        let mine = "$JS.EVENT.ADVISORY.CONSUMER.MSG_NAKED.REELAY.*".to_owned();
        let edited = stream::Config {
            subjects: vec![mine.clone(), terminated.clone()],
            max_age: Duration::from_secs(3600),
            ..made.clone()
        };
        let wanted = given_up_stream_update(&edited, &config(1)).expect("a subject and the age restored");
        assert_eq!(wanted.subjects, [mine, terminated, deliveries]);
        assert_eq!(wanted.max_age, GIVEN_UP_MAX_AGE);
        assert_eq!(wanted.description.as_deref(), Some("kept"));

        for longer in [Duration::ZERO, GIVEN_UP_MAX_AGE * 2] {
            let kept = stream::Config { max_age: longer, ..made.clone() };
            assert_eq!(given_up_stream_update(&kept, &config(1)), None, "{longer:?}");
        }
    }

    /// `/varz` comes from the broker's monitoring port (or whatever answers there): a body
    /// without a well-formed object is an error, never a panic at start-up.
    #[test]
    fn the_varz_object_is_found_or_refused() {
        assert_eq!(json_object("1a\r\n{\"a\":{}}\r\n0\r\n"), Some("{\"a\":{}}"));
        for body in ["", "no json", "}x{", "}", "{"] {
            assert_eq!(json_object(body), None, "{body:?}");
        }
    }

    #[test]
    fn a_consumers_filter_gains_only_the_subjects_none_of_its_own_takes() {
        let with = |filters: &[&str], needed: &[&str]| {
            let current = consumer::Config {
                filter_subjects: filters.iter().map(|s| s.to_string()).collect(),
                ..Default::default()
            };
            filters_with(&current, needed.iter().map(|s| s.to_string()))
        };
        let needed = ["r.events.A", "r.events.B", "r.events.replay.h.*"];
        assert_eq!(
            with(&["r.events.A", "r.events.Ops"], &needed),
            Some(["r.events.A", "r.events.Ops", "r.events.B", "r.events.replay.h.*"].map(String::from).to_vec())
        );
        assert_eq!(with(&["r.events.>"], &needed), None, "a wildcard takes them all");
        assert_eq!(with(&["r.events.*", "r.events.replay.h.*"], &needed), None);
        assert_eq!(
            with(&["r.events.*"], &needed),
            Some(["r.events.*", "r.events.replay.h.*"].map(String::from).to_vec()),
            "`*` is one token"
        );
        assert_eq!(with(&[], &needed), None, "no filter takes everything");
        assert_eq!(with(&needed, &needed), None);
    }
}
