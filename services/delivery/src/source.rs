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

    /// Failed: deliver again after `delay`, spending an attempt. The error is kept to
    /// [`reelay_domain::MAX_ERROR_CHARS`] (the write service keeps no more, and a batch of
    /// settlements must fit a message).
    pub fn nak(self, delay: Duration, error: impl AsRef<str>) -> Settlement<T> {
        Settlement { ack: self, kind: SettleKind::Nak { delay, error: reelay_domain::clip_error(error.as_ref()) } }
    }

    /// Not now: deliver again at `until_ms` without spending an attempt (where the backend can).
    pub fn defer(self, until_ms: i64) -> Settlement<T> {
        Settlement { ack: self, kind: SettleKind::Defer { until_ms } }
    }

    /// Never deliver again (the reason kept as [`AckHandle::nak`]'s error is).
    pub fn term(self, reason: impl AsRef<str>) -> Settlement<T> {
        Settlement { ack: self, kind: SettleKind::Term { reason: reelay_domain::clip_error(reason.as_ref()) } }
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
    /// Another build of the handler (taking other event types) claims its deliveries: this
    /// one is handed nothing until that build stops (db backend). Not an error: wait and ask
    /// again.
    #[error("standing by: {0}")]
    StandingBy(String),
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

    /// A watch on the lease the backend holds a batch under, fetched by a call sent at `asked`:
    /// how long it goes without hearing that the batch is in progress before another consumer
    /// may take it over; `None`: no such lease.
    fn lease(&self, _asked: tokio::time::Instant) -> Option<LeaseWatch> {
        None
    }

    /// Reports deliveries in hand as still being worked on: `Lost` when some of them are held
    /// by another consumer now (taken over); `Held` with the lease the answer gave, if any.
    async fn in_progress(&mut self, _deliveries: &[Delivery<T>]) -> Result<Renewal, SourceError> {
        Ok(Renewal::Held(None))
    }
}

/// The lease the write service last said it gives claims (claim and renewal answers carry it),
/// for what has no answer of its own to go by: how long a claim may wait, how often to renew,
/// and claims whose answer did not say (an older server). A worker bounds its own lease
/// (`REELAY_LEDGER_LEASE_MS` of its process) by it: a worker configured with a longer lease
/// than the write service would otherwise work on past the point where its claims can be
/// handed to someone else. Cheap to clone; clones share what was heard.
#[derive(Debug, Clone, Default)]
pub struct ServerLease(Arc<AtomicU64>);

impl ServerLease {
    /// A claim or renewal answer said the lease is `lease_ms` (0: an older server that does not
    /// say); returns it, for the claims that answer confirmed.
    pub fn heard(&self, lease_ms: i64) -> Option<Duration> {
        let lease_ms = u64::try_from(lease_ms).ok().filter(|&ms| ms > 0)?;
        if self.0.swap(lease_ms, Ordering::Relaxed) != lease_ms {
            tracing::info!(lease_ms, "the write service's claim lease");
        }
        Some(Duration::from_millis(lease_ms))
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
/// claim, or the last renewal that succeeded, was sent (the backend stamps it later), less a
/// margin, so the work stops before anyone else can be handed them. Never from when the answer
/// arrived: an answer held up on its way (a slow network, a process stopped and resumed) would
/// otherwise leave the worker believing in a lease that has already run out. A consumer cut off
/// from the backend for most of a lease, or told its claims were taken over, drops the work
/// unsettled; the deliveries come back (handlers are idempotent) instead of running twice at
/// once.
#[derive(Debug, Clone)]
pub struct LeaseWatch {
    /// This process's lease setting.
    lease: Duration,
    server: ServerLease,
    confirmed: tokio::time::Instant,
    /// The lease the claims were held under when last confirmed, as the answer that confirmed
    /// them said: the write service gives a claim the lease it has when it makes or renews it
    /// (after a restart with a shorter one it takes nothing over before the longer one has
    /// passed), so a shorter lease heard later applies from the next renewal on, not to the time
    /// already confirmed; and an answer from before a restart, read late, cannot lengthen it.
    confirmed_for: Duration,
}

impl LeaseWatch {
    /// A watch for claims asked for at `asked`: the backend made them no earlier, under the
    /// lease their answer `granted` (`None`: it did not say; the lease last heard).
    pub fn start(lease: Duration, server: ServerLease, asked: tokio::time::Instant, granted: Option<Duration>) -> Self {
        let confirmed_for = Self::held_for(lease, &server, granted);
        Self { lease, server, confirmed: asked, confirmed_for }
    }

    /// How long claims an answer confirmed are held: the lease it `granted` (`None`: it did not
    /// say; the lease last heard), never longer than this process's own `lease`.
    fn held_for(lease: Duration, server: &ServerLease, granted: Option<Duration>) -> Duration {
        granted.map_or_else(|| server.bound(lease), |granted| lease.min(granted))
    }

    /// The lease to renew by (every third of it): the shorter of the one last heard and the
    /// one the claims were last confirmed for.
    pub fn lease(&self) -> Duration {
        self.server.bound(self.lease).min(self.confirmed_for)
    }

    /// A renewal sent at `sent` succeeded, under the lease its answer `granted` (`None`: it did
    /// not say; the lease last heard).
    pub fn renewed(&mut self, sent: tokio::time::Instant, granted: Option<Duration>) {
        if sent >= self.confirmed {
            self.confirmed = sent;
            self.confirmed_for = Self::held_for(self.lease, &self.server, granted);
        }
    }

    /// When the work must stop unless a renewal succeeds first: five sixths of the lease.
    pub fn deadline(&self) -> tokio::time::Instant {
        self.confirmed + self.confirmed_for * 5 / 6
    }
}

/// What one report of work in progress (a renewal of its claims) learned.
pub enum Renewal {
    /// Every claim is still held, under the lease the answer gave (`None`: it did not say).
    Held(Option<Duration>),
    /// Some were taken over by another consumer.
    Lost,
    /// No answer; the next report tries again.
    Unanswered,
}

/// What a claim answer handed, with the lease it gave the claims (`None`: it did not say).
pub type Leased<T> = (T, Option<Duration>);

/// The lease that several answers for one batch gave (its claims or renewals went out in more
/// than one call): the shortest, or none when one of them gave none.
#[derive(Debug, Default)]
pub(crate) struct Granted(Option<Option<Duration>>);

impl Granted {
    /// One more answer, which gave `granted`.
    pub(crate) fn add(&mut self, granted: Option<Duration>) {
        self.0 = Some(match self.0 {
            None => granted,
            Some(so_far) => so_far.zip(granted).map(|(a, b)| a.min(b)),
        });
    }

    pub(crate) fn lease(&self) -> Option<Duration> {
        self.0.flatten()
    }
}

/// Runs `work` while `renew` reports it in progress every `every` (with a `lease`, at least
/// every third of the lease it renews by, see [`LeaseWatch::lease`]: the write service can say
/// it is shorter while the work runs); the first report is due a period after the claims were
/// confirmed (with a `lease`), else after `since`: when the last report was sent, or the
/// deliveries fetched, kept by the caller across the calls one batch's work takes (a batch
/// whose every call is shorter than a period is still reported); each next one a period after
/// the last was sent (`since` is moved to it). The work goes on while a report is on its way; a report not
/// answered within a period counts as unanswered, and the next goes out. The work is dropped
/// (`None`) when a report says its claims were taken over, or, with a `lease`, when none was
/// `Held` before the lease's deadline (a report still unanswered then counts as none; work whose
/// deadline has passed before it starts never starts).
pub(crate) async fn while_renewing<F, R>(
    work: F,
    every: Duration,
    lease: &mut Option<LeaseWatch>,
    since: &mut tokio::time::Instant,
    mut renew: impl FnMut() -> R,
) -> Option<F::Output>
where
    F: Future,
    R: Future<Output = Renewal>,
{
    tokio::pin!(work);
    let period = |lease: &Option<LeaseWatch>| lease.as_ref().map_or(every, |lease| every.min(lease.lease() / 3));
    // At once when the claims' answer took a period to arrive.
    let asked = lease.as_ref().map_or(*since, |lease| lease.confirmed);
    let mut next = asked + period(lease);
    let never = || tokio::time::Instant::now() + Duration::from_secs(86_400 * 365);
    // The report on its way, and when it was sent.
    let mut report: Option<(std::pin::Pin<Box<tokio::time::Timeout<R>>>, tokio::time::Instant)> = None;
    loop {
        let deadline = lease.as_ref().map_or_else(never, LeaseWatch::deadline);
        let idle = report.is_none();
        let answer = async {
            match report.as_mut() {
                Some((answer, _)) => answer.await.unwrap_or(Renewal::Unanswered),
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            // The deadline first: work past it must not go on, even for one more poll.
            biased;
            () = tokio::time::sleep_until(deadline) => return None,
            output = &mut work => return Some(output),
            renewal = answer => {
                let (_, sent) = report.take().expect("an answer comes only to a report on its way");
                match renewal {
                    Renewal::Held(granted) => {
                        if let Some(lease) = lease.as_mut() {
                            lease.renewed(sent, granted);
                        }
                    }
                    Renewal::Lost => return None,
                    Renewal::Unanswered => {}
                }
                next = sent + period(lease);
            }
            () = tokio::time::sleep_until(next), if idle => {
                *since = tokio::time::Instant::now();
                report = Some((Box::pin(tokio::time::timeout(period(lease), renew())), *since));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;
    use std::time::Duration;

    use tokio::time::Instant;

    use super::{LeaseWatch, Renewal, ServerLease, while_renewing};

    /// A worker's lease counts from when it asked for the claims, not from when the answer came:
    /// with a 3 s lease whose answer took 2.4 s to arrive and renewals that go unanswered, a
    /// 1.5 s run is dropped at five sixths of the lease from the asking (0.1 s in), and the
    /// first renewal goes out at once, its period having passed on the way.
    #[tokio::test(start_paused = true)]
    async fn a_lease_counts_from_when_the_claims_were_asked_for() {
        let asked = Instant::now();
        tokio::time::sleep(Duration::from_millis(2_400)).await;
        let mut lease = Some(LeaseWatch::start(Duration::from_secs(3), ServerLease::default(), asked, None));
        let renewals = Cell::new(Vec::new());
        let renew = || {
            renewals.set([renewals.take(), vec![asked.elapsed()]].concat());
            std::future::pending::<Renewal>()
        };
        let work = tokio::time::sleep(Duration::from_millis(1_500));
        let ran = while_renewing(work, Duration::from_secs(20), &mut lease, &mut Instant::now(), renew).await;
        assert!(ran.is_none(), "the run was dropped");
        assert_eq!(asked.elapsed(), Duration::from_millis(2_500));
        assert_eq!(renewals.take(), vec![Duration::from_millis(2_400)]);
    }

    /// Without a lease (JetStream's ack wait), a batch waiting out an outage in calls shorter
    /// than a period (dispatches failing fast, pauses between them) is still reported a period
    /// after its fetch and every period after: the schedule is the batch's, not each call's, or
    /// the broker redelivers the batch at every ack wait and each copy spends an attempt.
    #[tokio::test(start_paused = true)]
    async fn progress_without_a_lease_is_due_from_the_last_report_across_calls() {
        let fetched = Instant::now();
        let mut since = fetched;
        let reports = Cell::new(Vec::new());
        let renew = || {
            reports.set([reports.take(), vec![fetched.elapsed().as_secs()]].concat());
            std::future::ready(Renewal::Held(None))
        };
        for _ in 0..5 {
            let work = tokio::time::sleep(Duration::from_secs(6));
            let ran = while_renewing(work, Duration::from_secs(10), &mut None, &mut since, renew).await;
            assert!(ran.is_some());
        }
        assert_eq!(reports.take(), vec![10, 20], "every 10 s of the 30 s, though no call lasted 10 s");
        assert_eq!(since - fetched, Duration::from_secs(20));
    }

    /// A shorter lease heard while the work runs (the write service restarted with one) applies
    /// from the next renewal that is answered on: the time the claims were confirmed for under
    /// the longer lease stands, so the run is not dropped while renewals go unanswered for
    /// longer than the new lease, and once renewed it goes by the shorter one.
    #[tokio::test(start_paused = true)]
    async fn a_shorter_lease_heard_later_applies_from_the_next_renewal() {
        let asked = Instant::now();
        let server = ServerLease::default();
        server.heard(18_000);
        let mut lease = Some(LeaseWatch::start(Duration::from_secs(60), server.clone(), asked, None));
        server.heard(3_000);
        let deadline = lease.as_ref().unwrap().deadline();
        assert_eq!(deadline - asked, Duration::from_secs(15), "five sixths of the lease the claims were made under");
        // The renewals go unanswered for the first 4 s (longer than the new lease's 2.5 s).
        let renewals = Cell::new(Vec::new());
        let renew = || {
            renewals.set([renewals.take(), vec![asked.elapsed()]].concat());
            let answered = asked.elapsed() >= Duration::from_secs(5);
            std::future::ready(if answered { Renewal::Held(None) } else { Renewal::Unanswered })
        };
        let work = tokio::time::sleep(Duration::from_secs(9));
        let ran = while_renewing(work, Duration::from_secs(20), &mut lease, &mut Instant::now(), renew).await;
        assert!(ran.is_some(), "the run ended");
        let secs = (1..=8).map(Duration::from_secs).collect::<Vec<_>>();
        assert_eq!(renewals.take(), secs, "every third of the lease heard");
        assert_eq!(lease.unwrap().deadline() - asked, Duration::from_millis(8_000 + 2_500), "the new lease's");
    }

    /// Claims and renewals hold for the lease their own answer gave, not the one last heard by
    /// the process (another answer, read later, may be from before a restart with a longer one).
    #[tokio::test(start_paused = true)]
    async fn claims_hold_for_the_lease_their_answer_gave() {
        let asked = Instant::now();
        let server = ServerLease::default();
        server.heard(18_000);
        let three = Some(Duration::from_secs(3));
        let mut lease = LeaseWatch::start(Duration::from_secs(60), server.clone(), asked, three);
        assert_eq!(lease.deadline() - asked, Duration::from_millis(2_500));
        tokio::time::sleep(Duration::from_secs(1)).await;
        lease.renewed(Instant::now(), three);
        assert_eq!(lease.deadline() - asked, Duration::from_millis(3_500));
        lease.renewed(Instant::now(), None);
        assert_eq!(lease.deadline() - asked, Duration::from_secs(16), "an answer that says none: the lease last heard");
        let mut granted = super::Granted::default();
        granted.add(Some(Duration::from_secs(5)));
        granted.add(three);
        assert_eq!(granted.lease(), three, "the shortest of a batch's answers");
        granted.add(None);
        assert_eq!(granted.lease(), None, "unless one said none");
    }

    /// A batch renews at the pace of the lease its claims were given, also when the process last
    /// heard a longer one (an answer from before a restart, read late): it is not dropped for
    /// renewing too slowly.
    #[tokio::test(start_paused = true)]
    async fn renewals_keep_the_pace_of_the_claims_own_lease() {
        let asked = Instant::now();
        let server = ServerLease::default();
        server.heard(30_000);
        let own = Duration::from_secs(30);
        let mut lease = Some(LeaseWatch::start(own, server, asked, Some(Duration::from_secs(3))));
        let renewals = Cell::new(0);
        let renew = || {
            renewals.set(renewals.get() + 1);
            std::future::ready(Renewal::Held(Some(Duration::from_secs(3))))
        };
        let work = tokio::time::sleep(Duration::from_millis(4_500));
        let ran = while_renewing(work, Duration::from_secs(10), &mut lease, &mut Instant::now(), renew).await;
        assert!(ran.is_some(), "the run ended");
        assert_eq!(renewals.get(), 4, "every second (a third of 3 s), not every 10 s");
    }

    /// Work whose lease ran out before it could start (its process was stopped, say) never
    /// starts, even work that would finish at once: the deadline is looked at first. Run many
    /// times, since without that order which branch goes first is drawn at random.
    #[tokio::test(start_paused = true)]
    async fn work_past_its_deadline_never_starts() {
        for _ in 0..32 {
            let asked = Instant::now();
            tokio::time::sleep(Duration::from_secs(3)).await;
            let mut lease = Some(LeaseWatch::start(Duration::from_secs(3), ServerLease::default(), asked, None));
            let started = Cell::new(false);
            let work = async { started.set(true) };
            let ran = while_renewing(
                work,
                Duration::from_secs(20),
                &mut lease,
                &mut Instant::now(),
                std::future::pending::<Renewal>,
            )
            .await;
            assert!(ran.is_none() && !started.get(), "work past its deadline started");
        }
    }

    /// The work goes on while a renewal is on its way: a slow answer does not hold it up.
    #[tokio::test(start_paused = true)]
    async fn work_goes_on_while_a_renewal_is_answered() {
        let asked = Instant::now();
        let mut lease = Some(LeaseWatch::start(Duration::from_secs(3), ServerLease::default(), asked, None));
        let renew = || async {
            tokio::time::sleep(Duration::from_secs(2)).await;
            Renewal::Held(None)
        };
        let work = tokio::time::sleep(Duration::from_millis(1_500));
        let ran = while_renewing(work, Duration::from_secs(20), &mut lease, &mut Instant::now(), renew).await;
        assert!(ran.is_some(), "the run ended");
        assert_eq!(asked.elapsed(), Duration::from_millis(1_500), "when its own time was up, not after the renewal");
    }

    /// A report that never comes back (a call lost on a dead connection) counts as unanswered
    /// after a period, and the next goes out: the run is not dropped for want of trying.
    #[tokio::test(start_paused = true)]
    async fn a_report_that_never_returns_is_followed_by_another() {
        let asked = Instant::now();
        let mut lease = Some(LeaseWatch::start(Duration::from_secs(3), ServerLease::default(), asked, None));
        let renewals = Cell::new(Vec::new());
        let renew = || {
            let first = renewals.take();
            let lost = first.is_empty();
            renewals.set([first, vec![asked.elapsed()]].concat());
            async move {
                if lost {
                    std::future::pending::<()>().await;
                }
                Renewal::Held(None)
            }
        };
        let work = tokio::time::sleep(Duration::from_secs(4));
        let ran = while_renewing(work, Duration::from_secs(20), &mut lease, &mut Instant::now(), renew).await;
        assert!(ran.is_some(), "the run ended");
        let secs = (1..=3).map(Duration::from_secs).collect::<Vec<_>>();
        assert_eq!(renewals.take(), secs);
    }

    /// Renewed every third of the lease, counted from the asking, the same kind of run goes on
    /// to its end however long it takes.
    #[tokio::test(start_paused = true)]
    async fn renewed_work_runs_to_its_end() {
        let asked = Instant::now();
        tokio::time::sleep(Duration::from_millis(200)).await;
        let mut lease = Some(LeaseWatch::start(Duration::from_secs(3), ServerLease::default(), asked, None));
        let renewals = Cell::new(0);
        let renew = || {
            renewals.set(renewals.get() + 1);
            std::future::ready(Renewal::Held(None))
        };
        let work = tokio::time::sleep(Duration::from_millis(4_500));
        let ran = while_renewing(work, Duration::from_secs(20), &mut lease, &mut Instant::now(), renew).await;
        assert!(ran.is_some(), "the run ended");
        assert_eq!(asked.elapsed(), Duration::from_millis(4_700));
        assert_eq!(renewals.get(), 4, "renewed at 1, 2, 3 and 4 s after the asking");
    }

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
