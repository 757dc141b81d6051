//! Where events come from, and how a consumer says what became of each delivery.
//!
//! A backend (the outbox via the Outbox API, or JetStream) implements [`EventSource`]. Each
//! [`Delivery`] carries an [`AckHandle`] whose four verbs turn it into a [`Settlement`]:
//! `ack` (done), `nak` (failed; retry after a delay, spending an attempt), `defer` (try again at
//! a time without spending an attempt, where the backend can), `term` (never retry). The source
//! applies settlements in batches. Handlers never see any of this.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use reelay_contracts::v1;

/// One event delivered to this consumer.
#[derive(Debug)]
pub struct Delivery<T> {
    pub event: v1::Event,
    /// The dedup key; `None` for rows from foreign writers (delivered without ledger dedup).
    pub event_id: Option<String>,
    /// 1 for the first delivery.
    pub attempt: u32,
    /// The token of the (event, handler) ledger claim the source already holds for the
    /// consumer's one handler (the db backend's per-handler deliveries): the dispatcher then
    /// claims and settles nothing in the ledger itself; settling the delivery settles the claim.
    pub claimed: Option<i64>,
    pub ack: AckHandle<T>,
}

/// The backend's handle on one delivery (a row claim, a JetStream message).
#[derive(Debug, Clone)]
pub struct AckHandle<T> {
    token: T,
}

impl<T> AckHandle<T> {
    pub fn new(token: T) -> Self {
        Self { token }
    }

    pub fn token(&self) -> &T {
        &self.token
    }

    pub fn into_token(self) -> T {
        self.token
    }

    /// Delivered: every handler is done or skipped.
    pub fn ack(self) -> Settlement<T> {
        Settlement { ack: self, kind: SettleKind::Ack }
    }

    /// Failed: deliver again after `delay`, spending an attempt.
    pub fn nak(self, delay: Duration, error: impl Into<String>) -> Settlement<T> {
        Settlement { ack: self, kind: SettleKind::Nak { delay, error: error.into() } }
    }

    /// Not now: deliver again at `until_ms` without spending an attempt (where the backend can).
    pub fn defer(self, until_ms: i64) -> Settlement<T> {
        Settlement { ack: self, kind: SettleKind::Defer { until_ms } }
    }

    /// Never deliver again.
    pub fn term(self, reason: impl Into<String>) -> Settlement<T> {
        Settlement { ack: self, kind: SettleKind::Term { reason: reason.into() } }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SettleKind {
    Ack,
    Nak { delay: Duration, error: String },
    Defer { until_ms: i64 },
    Term { reason: String },
}

#[derive(Debug, Clone)]
pub struct Settlement<T> {
    pub ack: AckHandle<T>,
    pub kind: SettleKind,
}

#[derive(Debug, Clone, thiserror::Error)]
pub enum SourceError {
    /// The backend cannot be reached; pause and try again (spends nothing).
    #[error("event source unavailable: {0}")]
    Unavailable(String),
    /// The backend answered with an error that waiting will not fix.
    #[error("event source refused the request: {0}")]
    Rejected(String),
}

#[async_trait::async_trait]
pub trait EventSource: Send {
    type Token: Send + Sync + std::fmt::Debug + 'static;
    type Settler: Settler<Self::Token>;

    /// Up to `max` deliveries; may wait for some to arrive, and may return none.
    async fn fetch(&mut self, max: usize) -> Result<Vec<Delivery<Self::Token>>, SourceError>;

    /// A handle that settles this source's deliveries, so batches can be worked on while the
    /// next one is fetched.
    fn settler(&self) -> Self::Settler;
}

/// Settles deliveries of one source. Cheap to clone: one clone per batch in flight.
#[async_trait::async_trait]
pub trait Settler<T: Send + Sync + 'static>: Clone + Send + Sync + 'static {
    /// Applies settlements. On `Unavailable` the caller retries the same settlements.
    async fn settle(&mut self, settlements: &[Settlement<T>]) -> Result<(), SourceError>;

    /// How often deliveries in hand must be reported as still in progress so the backend does
    /// not redeliver them (a long handler, a paused consumer). `None`: no need.
    fn progress_interval(&self) -> Option<Duration> {
        None
    }

    /// A watch on the lease the backend holds a batch fetched just now under: how long it
    /// goes without hearing that the batch is in progress before another consumer may take it
    /// over; `None`: no such lease.
    fn lease(&self) -> Option<LeaseWatch> {
        None
    }

    /// Reports deliveries in hand as still being worked on: false when some of them are held
    /// by another consumer now (taken over).
    async fn in_progress(&mut self, _deliveries: &[Delivery<T>]) -> Result<bool, SourceError> {
        Ok(true)
    }
}

/// The lease the write service last said it gives claims (claim answers carry it). A worker
/// bounds its own lease (`REELAY_LEDGER_LEASE_MS` of its process) by it: a worker configured
/// with a longer lease than the write service would otherwise work on past the point where its
/// claims can be handed to someone else. Cheap to clone; clones share what was heard.
#[derive(Debug, Clone, Default)]
pub struct ServerLease(Arc<AtomicU64>);

impl ServerLease {
    /// A claim answer said the lease is `lease_ms` (0: an older server that does not say).
    pub fn heard(&self, lease_ms: i64) {
        let Ok(lease_ms) = u64::try_from(lease_ms) else { return };
        if lease_ms > 0 && self.0.swap(lease_ms, Ordering::Relaxed) != lease_ms {
            tracing::info!(lease_ms, "the write service's claim lease");
        }
    }

    /// `own`, or the write service's lease when it is shorter.
    pub fn bound(&self, own: Duration) -> Duration {
        match self.0.load(Ordering::Relaxed) {
            0 => own,
            heard => own.min(Duration::from_millis(heard)),
        }
    }
}

/// Until when a consumer may still work on leased deliveries: the lease counted from when the
/// last renewal that succeeded was sent (the backend stamps it later), less a margin, so the
/// work stops before anyone else can be handed them. A consumer cut off from the backend for
/// most of a lease, or told its claims were taken over, drops the work unsettled; the
/// deliveries come back (handlers are idempotent) instead of running twice at once.
#[derive(Debug, Clone)]
pub struct LeaseWatch {
    /// This process's lease setting; the write service's, when it says it is shorter.
    lease: Duration,
    server: ServerLease,
    confirmed: tokio::time::Instant,
}

impl LeaseWatch {
    /// A watch for claims made (or last renewed) no earlier than now.
    pub fn start(lease: Duration, server: ServerLease) -> Self {
        Self { lease, server, confirmed: tokio::time::Instant::now() }
    }

    /// The lease as last heard: renew every third of it.
    pub fn lease(&self) -> Duration {
        self.server.bound(self.lease)
    }

    /// A renewal sent at `sent` succeeded.
    pub fn renewed(&mut self, sent: tokio::time::Instant) {
        self.confirmed = self.confirmed.max(sent);
    }

    /// When the work must stop unless a renewal succeeds first: five sixths of the lease.
    pub fn deadline(&self) -> tokio::time::Instant {
        self.confirmed + self.lease() * 5 / 6
    }
}

/// What one report of work in progress (a renewal of its claims) learned.
pub(crate) enum Renewal {
    /// Every claim is still held.
    Held,
    /// Some were taken over by another consumer.
    Lost,
    /// No answer; the next report tries again.
    Unanswered,
}

/// Runs `work` while `renew` reports it in progress every `every` (with a `lease`, at least
/// every third of it as last heard: the write service can say it is shorter while the work
/// runs). The work is dropped (`None`) when a report says its claims were taken over, or, with
/// a `lease`, when none was `Held` before the lease's deadline (a report still unanswered then
/// counts as none).
pub(crate) async fn while_renewing<F, R>(
    work: F,
    every: Duration,
    lease: &mut Option<LeaseWatch>,
    mut renew: impl FnMut() -> R,
) -> Option<F::Output>
where
    F: Future,
    R: Future<Output = Renewal>,
{
    tokio::pin!(work);
    let period = |lease: &Option<LeaseWatch>| lease.as_ref().map_or(every, |lease| every.min(lease.lease() / 3));
    let mut next = tokio::time::Instant::now() + period(lease);
    let never = || tokio::time::Instant::now() + Duration::from_secs(86_400 * 365);
    loop {
        let deadline = lease.as_ref().map_or_else(never, LeaseWatch::deadline);
        tokio::select! {
            output = &mut work => return Some(output),
            () = tokio::time::sleep_until(deadline) => return None,
            () = tokio::time::sleep_until(next) => {
                let sent = tokio::time::Instant::now();
                match tokio::time::timeout_at(deadline, renew()).await {
                    Ok(Renewal::Held) => {
                        if let Some(lease) = lease.as_mut() {
                            lease.renewed(sent);
                        }
                    }
                    Ok(Renewal::Lost) | Err(_) => return None,
                    Ok(Renewal::Unanswered) => {}
                }
                next = sent + period(lease);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::ServerLease;

    /// A worker's lease is its own setting until a claim answer says the write service's is
    /// shorter; an answer without one (an older server) changes nothing.
    #[test]
    fn a_workers_lease_is_bounded_by_the_write_services() {
        let own = Duration::from_secs(60);
        let lease = ServerLease::default();
        assert_eq!(lease.bound(own), own);
        for silent in [0, -5] {
            lease.heard(silent);
            assert_eq!(lease.bound(own), own);
        }
        let shared = lease.clone();
        shared.heard(3_000);
        assert_eq!(lease.bound(own), Duration::from_secs(3));
        assert_eq!(lease.bound(Duration::from_secs(1)), Duration::from_secs(1));
        shared.heard(120_000);
        assert_eq!(lease.bound(own), own);
    }
}
