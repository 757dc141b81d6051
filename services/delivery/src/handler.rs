//! What a handler is: a named, idempotent reaction to some event types.
//!
//! The runtime delivers each event at least once to each handler that subscribes to its type,
//! guarded by the ledger so no two deliveries run one handler for one event at the same time.
//! Handlers must therefore be idempotent: running one twice on the same event must leave the
//! same effect as running it once (the crash between the effect and the ledger mark is the one
//! duplicate the ledger cannot remove).

use std::fmt;

use reelay_contracts::v1;

/// Why a handler did not finish.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HandlerError {
    /// Worth retrying later (a dependency was down, a timeout): retried on the backoff schedule
    /// until the attempts run out.
    #[error("{0}")]
    Retryable(String),
    /// Retrying cannot help (the event cannot be understood): the delivery is terminated.
    #[error("{0}")]
    Permanent(String),
    /// Something the handler needs for every event is down (its provider unreachable or
    /// overloaded, its object store or disk failing), not this event at fault: the runtime holds
    /// the events and calls the handler on them again, backing off, spending no attempt, for up
    /// to the handler's wait for a dependency (`REELAY_HANDLER_UNAVAILABLE_WAIT_MS`); past it,
    /// or when stopping, it is a retryable failure. Say it only of what fails every event
    /// alike: an event that still says so in the round the dependency answered another is let
    /// go as a retryable failure, its batch-mates held up until then. Not for the
    /// write service: the claims and leases a hold needs are renewed there, so a hold could not
    /// outlast its outage (a follow-up write it fails is retryable, see `from_call`).
    #[error("{0}")]
    Unavailable(String),
}

impl HandlerError {
    pub fn retryable(message: impl fmt::Display) -> Self {
        Self::Retryable(message.to_string())
    }

    pub fn permanent(message: impl fmt::Display) -> Self {
        Self::Permanent(message.to_string())
    }

    pub fn unavailable(message: impl fmt::Display) -> Self {
        Self::Unavailable(message.to_string())
    }

    /// A failure worth retrying, which is [`HandlerError::Unavailable`] when `dependency_down`
    /// (the call failed for want of the dependency, not for this event).
    pub fn retryable_or_unavailable(message: impl fmt::Display, dependency_down: bool) -> Self {
        if dependency_down { Self::unavailable(message) } else { Self::retryable(message) }
    }

    /// A failed call of a handler's follow-up write (`what`: the method): a refusal of the
    /// request itself (invalid, failed precondition, denied) cannot pass on a retry; anything
    /// else (unreachable, busy, an unknown outcome) may. (Not `Unavailable`: a hold could not
    /// outlast the write service's outage, its claims being renewed there; the consumer pauses
    /// on an unreachable ledger before it claims, spending nothing.)
    pub fn from_call(what: &str, status: &tonic::Status) -> Self {
        let message = format!("{what}: {:?}: {}", status.code(), status.message());
        match status.code() {
            tonic::Code::InvalidArgument | tonic::Code::FailedPrecondition | tonic::Code::PermissionDenied => {
                Self::Permanent(message)
            }
            _ => Self::Retryable(message),
        }
    }
}

#[async_trait::async_trait]
pub trait Handler: Send + Sync + 'static {
    /// Stable name: the ledger key, the JetStream consumer (`handler-<name>`), the `--handler`
    /// flag value. Lowercase, `a-z0-9-`.
    fn name(&self) -> &'static str;

    /// The event types (`Event.event_type`) this handler takes.
    fn event_types(&self) -> &'static [&'static str];

    fn subscribes_to(&self, event_type: &str) -> bool {
        self.event_types().contains(&event_type)
    }

    /// Applies one event. Must be idempotent.
    async fn handle(&self, event: &v1::Event) -> Result<(), HandlerError>;

    /// Whether the runtime gives this handler a fetched batch's events in one `handle_batch`
    /// call (under one timeout). A handler that overrides `handle_batch` says so here; any other
    /// is called with one event at a time, each under its own timeout, so one slow event fails
    /// alone and what the others did stands.
    fn batches(&self) -> bool {
        false
    }

    /// Applies several events, returning one result per event in order. The runtime calls this
    /// (when [`Handler::batches`]) with every event of a fetched batch it holds a ledger claim
    /// for; a handler whose effect has a per-call fixed cost (an index commit, a flush)
    /// overrides it to pay that cost once, and keeps a batch well inside the handler timeout.
    async fn handle_batch(&self, events: &[&v1::Event]) -> Vec<Result<(), HandlerError>> {
        let mut results = Vec::with_capacity(events.len());
        for event in events {
            results.push(handle_in_span(self, event).await);
        }
        results
    }
}

/// Runs `handler` on one event inside the event's span, so what it logs about the event joins
/// the trace of the write that raised it (what `handle_batch` does for each event unless a
/// handler overrides it).
pub async fn handle_in_span<H: Handler + ?Sized>(handler: &H, event: &v1::Event) -> Result<(), HandlerError> {
    use tracing::Instrument;
    handler.handle(event).instrument(crate::dispatch::event_span(event, handler.name())).await
}

/// What the process hosting a handler gives it.
#[derive(Clone)]
pub struct HandlerContext {
    /// The process's data directory (a handler keeps its local state under it).
    pub data_dir: std::path::PathBuf,
    /// The write service, for follow-up writes through the domain API (authenticated, lazily
    /// connected, with a deadline on every call).
    pub write: reelay_kit::client::ServiceChannel,
}

/// Mounts a handler's own gRPC services on the handlers server.
pub type MountGrpc = Box<dyn FnOnce(reelay_kit::GrpcServer) -> reelay_kit::GrpcServer + Send>;

/// A handler ready to run, with the gRPC services it serves besides (the Search API, say).
pub struct BuiltHandler {
    pub handler: std::sync::Arc<dyn Handler>,
    pub grpc: Option<MountGrpc>,
}
