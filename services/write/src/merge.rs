//! Merging concurrent requests of one kind into one write job.
//!
//! The single writer is bound by its round trips to SQLite, not by rows, so requests that can
//! share their statements are answered together:
//! - On the db backend every (event, handler) pair is a claim and a settlement. The handlers of
//!   one process claim in one call, but several processes (and calls a process sends while
//!   another waits) claim at once, and each handler settles on its own: eight handlers woken by
//!   one commit send eight settlements at once. Merged, the statements they can share run once
//!   for all of them (`claim_many`, `settle_many`): with eight handlers, about 45 % more events
//!   per second (BENCHMARKS.md).
//! - Reviews of known movies, the commonest write, are inserted by one statement per job
//!   (`store::reviews`).
//!
//! The first request of a kind that finds none waiting submits a job; requests arriving before
//! that job starts join it. The job answers each request, in order, and the answers are handed
//! out only after the batch committed, so nobody acts on a claim that was not written. A job
//! that fails fails every request in it with the same answer.

use std::sync::{Arc, LazyLock, Mutex};

use futures_util::future::BoxFuture;
use reelay_kit::metrics::{self, Histogram};
use reelay_kit::{ErrorCode, ServiceError};
use reelay_outbox::{Database, Durability, WriteTx};
use tokio::sync::oneshot;

use crate::WriteError;

static MERGED_REQUESTS: LazyLock<Histogram> = LazyLock::new(|| {
    metrics::histogram(
        "reelay_writer_merged_requests",
        "Requests answered by one merged write job, by job (how well concurrent callers share it).",
        &["job"],
        metrics::BATCH_SIZES,
    )
});

/// Declares the merging's metrics, so they are scraped before the first merged job.
pub(crate) fn register_metrics() {
    LazyLock::force(&MERGED_REQUESTS);
}

type Reply<A> = oneshot::Sender<Result<A, WriteError>>;
/// Requests waiting for a job, each with where its answer goes.
type Waiting<R, A> = Arc<Mutex<Vec<(R, Reply<A>)>>>;

/// Requests of one kind waiting for the next job. Cheap to clone (shared).
pub(crate) struct Merged<R, A> {
    waiting: Waiting<R, A>,
}

impl<R, A> Clone for Merged<R, A> {
    fn clone(&self) -> Self {
        Self { waiting: self.waiting.clone() }
    }
}

impl<R, A> Default for Merged<R, A> {
    fn default() -> Self {
        Self { waiting: Arc::default() }
    }
}

impl<R: Send + 'static, A: Send + 'static> Merged<R, A> {
    /// Answers `request` in a job named `name`, committed with `durability`, that runs `work`
    /// over every request waiting when it starts; `work` returns one answer per request, in
    /// order.
    pub(crate) async fn submit<F>(
        &self,
        db: &Database,
        name: &'static str,
        durability: Durability,
        request: R,
        work: F,
    ) -> Result<A, WriteError>
    where
        F: for<'t> FnOnce(&'t mut WriteTx, Vec<R>) -> BoxFuture<'t, Result<Vec<Result<A, WriteError>>, WriteError>>
            + Send
            + 'static,
    {
        let (reply, answer) = oneshot::channel();
        let first = {
            let mut waiting = self.waiting.lock().expect("never poisoned: no panics while held");
            waiting.push((request, reply));
            waiting.len() == 1
        };
        if first {
            // Its own task: a caller that goes away must not strand the requests that joined.
            tokio::spawn(self.clone().run(db.clone(), name, durability, work));
        }
        answer.await.unwrap_or_else(|_| {
            Err(ServiceError::new(ErrorCode::Unavailable, "the write job was dropped; try again").into())
        })
    }

    async fn run<F>(self, db: Database, name: &'static str, durability: Durability, work: F)
    where
        F: for<'t> FnOnce(&'t mut WriteTx, Vec<R>) -> BoxFuture<'t, Result<Vec<Result<A, WriteError>>, WriteError>>
            + Send
            + 'static,
    {
        let replies: Arc<Mutex<Option<Vec<Reply<A>>>>> = Arc::default();
        let (waiting, taken) = (self.waiting.clone(), replies.clone());
        let outcome = db
            .writer
            .transact_as::<_, WriteError, _>(name, durability, move |tx: &mut WriteTx| {
                let (requests, replies): (Vec<R>, Vec<Reply<A>>) =
                    std::mem::take(&mut *waiting.lock().expect("never poisoned")).into_iter().unzip();
                MERGED_REQUESTS.observe(&[name], requests.len() as f64);
                *taken.lock().expect("never poisoned") = Some(replies);
                work(tx, requests)
            })
            .await;
        // The job never ran (the writer is closed or recovering): nobody took the requests.
        let replies = replies.lock().expect("never poisoned").take().unwrap_or_else(|| {
            std::mem::take(&mut *self.waiting.lock().expect("never poisoned"))
                .into_iter()
                .map(|(_, reply)| reply)
                .collect()
        });
        match outcome {
            Ok(answers) => {
                for (reply, answer) in replies.into_iter().zip(answers) {
                    let _ = reply.send(answer);
                }
            }
            Err(error) => {
                let answer = error.answer();
                for reply in replies {
                    let _ = reply.send(Err(answer.clone().into()));
                }
            }
        }
    }
}
