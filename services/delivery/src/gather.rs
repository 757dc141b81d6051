//! Requests that the consumers of one process make at the same time, sent as one call: the
//! handlers a commit or a message reaches together ask together, and one call (one write job
//! and one answer in the write service) serves them all.

use std::future::Future;

use tokio::sync::mpsc;

/// Starts a task that gathers the requests sent on the returned channel: it takes every request
/// that has arrived (after letting the other ready tasks run once, so that requests made
/// together go together), cuts them into calls with `split`, and runs each call with `call` on
/// a task of its own, so a call that waits does not hold back the next. The task ends when
/// every sender is gone.
pub(crate) fn gather<A, S, C, F>(mut split: S, call: C) -> mpsc::UnboundedSender<A>
where
    A: Send + 'static,
    S: FnMut(Vec<A>) -> Vec<Vec<A>> + Send + 'static,
    C: Fn(Vec<A>) -> F + Send + 'static,
    F: Future<Output = ()> + Send + 'static,
{
    let (requests, mut queue) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Some(first) = queue.recv().await {
            tokio::task::yield_now().await;
            let mut gathered = vec![first];
            while let Ok(request) = queue.try_recv() {
                gathered.push(request);
            }
            for batch in split(gathered) {
                tokio::spawn(call(batch));
            }
        }
    });
    requests
}
