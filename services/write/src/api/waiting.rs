//! Claims that wait with the writer for new events: the long poll of the Outbox API's `Claim`
//! (the relay, nats backend) and `ClaimDeliveries` / `ClaimDeliveriesForHandlers` (the
//! handlers, db backend; one parked claim per call, however many handlers it claims for).
//!
//! A claimer that finds nothing due parks its claim here. When this set is the writer's
//! [`Rider`], the next batch that enqueues events claims for every parked claim after inserting
//! the events, in the same transaction and under the same fsync, and answers once that batch
//! commits; the writer does so only while no synced job waits, so a busy writer leaves the
//! claims to the commit signal and a claim job of their own. Without it a waiting claim learned
//! of the commit, looked, and claimed in a batch and a commit of its own: a second fsync between
//! a write and whoever takes its events.
//!
//! A claim the writer took is always answered: with what it claimed, with the batch's failure,
//! or with nothing (nothing for it, another claimer was first, or the claim's statements
//! failed), and the claimer then looks again the ordinary way.
//!
//! The claim calls that can hand back a lost answer (the relay's `Claim`, the handlers'
//! `ClaimDeliveriesForHandlers`) run to their end ([`to_the_end`]): when the caller goes away
//! (its deadline passed, its connection dropped) while its claim is being written, the call goes
//! on in a task of its own and ends as it would have (its claims written with its call id, for
//! a hand-back to the call naming it, and its mark as a running call dropped only then), instead
//! of being dropped with the call halfway while the claimer's lease holds what it claimed.

use std::convert::Infallible;
use std::pin::{Pin, pin};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, LazyLock, Mutex};
use std::task::{Context, Poll};

use futures_util::FutureExt;
use futures_util::future::BoxFuture;
use reelay_kit::Shutdown;
use reelay_kit::metrics::{self, Gauge};
use reelay_kit::telemetry::{TRACEPARENT, current_traceparent};
use reelay_outbox::{AfterCommit, CommitError, Rider, WriteTx, Writer};
use tokio::sync::oneshot;
use tokio::task::futures::TaskLocalFuture;
use tokio::time::Instant;
use tracing::Instrument;

use crate::WriteError;

/// Runs a claim call, which `call` makes given its stop signal, to its end: in the caller's own
/// task while the caller waits for it, and, when the caller goes away first (the future
/// returned here is dropped), in a task of its own, so a claim being written ends as it would
/// have, for a hand-back, rather than being dropped halfway. The stop signal resolves once the
/// caller has gone or `shutdown` is requested: the call claims nothing more after that.
pub(super) fn to_the_end<C, F>(shutdown: &Shutdown, call: C) -> ToTheEnd<F>
where
    C: FnOnce(BoxFuture<'static, ()>) -> F,
    F: Future<Output: Send> + Send + 'static,
{
    let (here, gone) = oneshot::channel::<Infallible>();
    let shutdown = shutdown.clone();
    let stop = Box::pin(async move {
        tokio::select! {
            _ = gone => {}
            () = shutdown.requested() => {}
        }
    });
    // The call's span and trace go with it, into its own task if it comes to that.
    let call = TRACEPARENT.scope(current_traceparent(), call(stop)).in_current_span();
    ToTheEnd { call: Some(Box::pin(call)), here: Some(here) }
}

/// A call with its span and trace.
type Traced<F> = tracing::instrument::Instrumented<TaskLocalFuture<String, F>>;

/// A claim call run by [`to_the_end`].
pub(super) struct ToTheEnd<F: Future<Output: Send> + Send + 'static> {
    call: Option<Pin<Box<Traced<F>>>>,
    /// Dropped, it tells the call that its caller has gone.
    here: Option<oneshot::Sender<Infallible>>,
}

impl<F: Future<Output: Send> + Send + 'static> Future for ToTheEnd<F> {
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let call = self.call.as_mut().expect("not polled after it finished");
        let finished = std::task::ready!(call.as_mut().poll(cx));
        self.call = None;
        Poll::Ready(finished)
    }
}

impl<F: Future<Output: Send> + Send + 'static> Drop for ToTheEnd<F> {
    fn drop(&mut self) {
        if let Some(call) = self.call.take() {
            drop(self.here.take());
            match tokio::runtime::Handle::try_current() {
                Ok(runtime) => drop(runtime.spawn(call)),
                Err(_) => tracing::warn!("a claim call whose caller went away was dropped: no runtime to finish it"),
            }
        }
    }
}

static WAITING: LazyLock<Gauge> = LazyLock::new(|| {
    metrics::gauge(
        "reelay_claims_waiting",
        "Claims waiting with the writer for new events: handlers' delivery claim calls, each for one or more handlers (db backend), or the relay's outbox claims (nats backend).",
        &[],
    )
});

/// What a claim is answered with.
pub(super) type Answer<A> = Result<Vec<A>, WriteError>;

/// Claims for a batch of parked requests inside the writer's transaction: one answer per
/// request, in order. An error rolls back everything it did.
type ClaimMany<Q, A> =
    Arc<dyn for<'t> Fn(&'t mut WriteTx, Vec<Q>) -> BoxFuture<'t, Result<Vec<Answer<A>>, sqlx::Error>> + Send + Sync>;

/// The claims parked now, and the last id handed out.
type ParkedClaims<Q, A> = Arc<Mutex<(u64, Vec<Parked<Q, A>>)>>;

/// A claim waiting for new events.
struct Parked<Q, A> {
    id: u64,
    request: Q,
    reply: oneshot::Sender<Answer<A>>,
}

/// The claims of one API waiting for new events (see the module's comment).
pub(super) struct WaitingClaims<Q, A> {
    parked: ParkedClaims<Q, A>,
    claim: ClaimMany<Q, A>,
    /// Whether the writer hands these claims events (they are its rider); if not, a claimer
    /// waits for the commit signal alone.
    riding: Arc<AtomicBool>,
}

impl<Q, A> Clone for WaitingClaims<Q, A> {
    fn clone(&self) -> Self {
        Self { parked: self.parked.clone(), claim: self.claim.clone(), riding: self.riding.clone() }
    }
}

impl<Q, A> WaitingClaims<Q, A> {
    fn park(&self, request: Q) -> WaitingClaim<Q, A> {
        let (reply, answer) = oneshot::channel();
        let mut parked = self.parked.lock().expect("never poisoned: no panics while held");
        parked.0 += 1;
        let id = parked.0;
        parked.1.push(Parked { id, request, reply });
        WAITING.set(&[], parked.1.len() as f64);
        WaitingClaim { waiting: self.clone(), id, answer }
    }

    /// Takes a claim back; false when the writer has it (its answer is coming).
    fn unpark(&self, id: u64) -> bool {
        let mut parked = self.parked.lock().expect("never poisoned");
        let before = parked.1.len();
        parked.1.retain(|p| p.id != id);
        WAITING.set(&[], parked.1.len() as f64);
        parked.1.len() < before
    }
}

impl<Q: Clone + Send + 'static, A: Send + 'static> WaitingClaims<Q, A> {
    pub(super) fn new<F>(claim: F) -> Self
    where
        F: for<'t> Fn(&'t mut WriteTx, Vec<Q>) -> BoxFuture<'t, Result<Vec<Answer<A>>, sqlx::Error>>
            + Send
            + Sync
            + 'static,
    {
        WAITING.set(&[], 0.0);
        Self { parked: Arc::default(), claim: Arc::new(claim), riding: Arc::default() }
    }

    /// Makes these claims the writer's rider (a warning if it has another: then these wait for
    /// commits alone).
    pub(super) fn ride_with(&self, writer: &Writer) {
        let riding = writer.set_rider(Arc::new(self.clone()));
        if !riding {
            tracing::warn!(
                "the writer already hands events to another set of waiting claims; these wait for commits instead"
            );
        }
        self.riding.store(riding, Ordering::SeqCst);
    }

    /// Claims as soon as there is something to claim, waiting up to `deadline`: it looks first
    /// (`peek` answers whether anything is due, and when to look again), since an empty claim
    /// would still cost a write job, and claims what is due with `claim`. Otherwise it waits
    /// with the writer for the next batch with events (when riding), for any commit that adds
    /// events or for the next due time, until `stop` (shutdown, or the caller went away).
    pub(super) async fn long_poll<P, C>(
        &self,
        writer: &Writer,
        deadline: Instant,
        request: &Q,
        peek: impl Fn() -> P,
        claim: impl Fn() -> C,
        stop: impl Future<Output = ()>,
    ) -> Answer<A>
    where
        P: Future<Output = Result<(bool, Instant), WriteError>>,
        C: Future<Output = Answer<A>>,
    {
        let mut stop = pin!(stop);
        let mut commits = writer.subscribe_commits();
        loop {
            // Mark the commits seen before looking, so one landing after the look wakes us.
            commits.borrow_and_update();
            let (due, wake) = peek().await?;
            // Nothing new is claimed once stopped (a commit or the due time may have won the
            // wait below, or the caller left while looking).
            if stop.as_mut().now_or_never().is_some() {
                return Ok(Vec::new());
            }
            if due {
                let claimed = claim().await?;
                if !claimed.is_empty() {
                    return Ok(claimed);
                }
            }
            if Instant::now() >= deadline {
                return Ok(Vec::new());
            }
            let mut parked = self.riding.load(Ordering::SeqCst).then(|| self.park(request.clone()));
            let answer = async {
                match parked.as_mut() {
                    Some(parked) => (&mut parked.answer).await,
                    None => std::future::pending().await,
                }
            };
            let mut closed = false;
            tokio::select! {
                biased;
                answered = answer => match answered {
                    Ok(Ok(claimed)) if claimed.is_empty() => continue,
                    Ok(answered) => return answered,
                    Err(_) => continue,
                },
                () = &mut stop => closed = true,
                changed = commits.changed() => closed = changed.is_err(),
                () = tokio::time::sleep_until(wake) => {}
            }
            if let Some(mut parked) = parked
                && !parked.take_back()
            {
                // The writer has it in a batch: its answer comes with that batch's commit.
                match (&mut parked.answer).await {
                    Ok(Ok(claimed)) if claimed.is_empty() => {}
                    Ok(answered) => return answered,
                    Err(_) => {}
                }
            }
            if closed {
                return Ok(Vec::new());
            }
        }
    }
}

/// One parked claim, from the claimer's side. Dropped (the claimer stopped waiting: its
/// deadline, shutdown, its caller gone), it takes the claim back: nothing is claimed for a
/// claimer that went away, which would hold what it was handed until its lease ran out.
struct WaitingClaim<Q, A> {
    waiting: WaitingClaims<Q, A>,
    id: u64,
    answer: oneshot::Receiver<Answer<A>>,
}

impl<Q, A> WaitingClaim<Q, A> {
    /// Takes the claim back; false when the writer has it (its answer is coming).
    fn take_back(&self) -> bool {
        self.waiting.unpark(self.id)
    }
}

impl<Q, A> Drop for WaitingClaim<Q, A> {
    fn drop(&mut self) {
        self.take_back();
    }
}

impl<Q: Clone + Send + 'static, A: Send + 'static> Rider for WaitingClaims<Q, A> {
    fn wants(&self) -> bool {
        !self.parked.lock().expect("never poisoned").1.is_empty()
    }

    /// Claims for every parked claim (on db also for handlers that take none of the batch's
    /// event types: their cursors move past the new rows here, not in a claim job later).
    fn ride<'t>(&'t self, tx: &'t mut WriteTx) -> BoxFuture<'t, Result<AfterCommit, sqlx::Error>> {
        Box::pin(async move {
            let taken = {
                let mut parked = self.parked.lock().expect("never poisoned");
                WAITING.set(&[], 0.0);
                std::mem::take(&mut parked.1)
            };
            let (requests, replies): (Vec<Q>, Vec<_>) = taken.into_iter().map(|p| (p.request, p.reply)).unzip();
            match (self.claim)(tx, requests).await {
                Ok(answers) => {
                    let replies: Vec<_> = replies.into_iter().zip(answers).collect();
                    Ok(Box::new(move |committed: Result<(), CommitError>| {
                        for (reply, answer) in replies {
                            let answer = match (&committed, answer) {
                                (_, Ok(claimed)) if claimed.is_empty() => Ok(claimed),
                                (Err(error), _) => Err(error.clone().into()),
                                (Ok(()), answer) => answer,
                            };
                            let _ = reply.send(answer);
                        }
                    }) as AfterCommit)
                }
                Err(error) => {
                    // Rolled back: nothing was claimed; the claimers look again.
                    for reply in replies {
                        let _ = reply.send(Ok(Vec::new()));
                    }
                    Err(error)
                }
            }
        })
    }
}
