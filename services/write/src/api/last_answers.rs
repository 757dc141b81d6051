//! What the last claim answers handed out, kept so that an answer that never reached its claimer
//! can be handed back to it: the claim requests' `call_id` and `unanswered` (the relay's `Claim`
//! and the handlers' `ClaimDeliveriesForHandlers`).

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::hash::Hash;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use reelay_kit::ServiceError;
use tokio::sync::Notify;
use tokio::time::Instant;

/// Most ids a claim may name as unanswered.
const MAX_UNANSWERED: usize = 64;
/// Longest a call waits for a call it names that is still running here, before it goes on
/// without what that call may hand out (which then waits out its lease).
const MAX_WAIT_FOR_NAMED: Duration = Duration::from_secs(10);

/// Refuses a claim naming more unanswered calls than are kept.
pub(super) fn check_unanswered(unanswered: &[u64]) -> Result<(), ServiceError> {
    if unanswered.len() > MAX_UNANSWERED {
        return Err(ServiceError::invalid(
            "unanswered",
            format!("must hold at most {MAX_UNANSWERED} call ids, got {}", unanswered.len()),
        ));
    }
    Ok(())
}

/// What the last call for each key (a claimer, or a claimer's handler) handed it, and which
/// call that was. The key's next call with something in its answer replaces it, a call naming
/// it as unanswered takes it out (so two calls naming it at once cannot both hand it back), and
/// once a lease the entries older than a lease are dropped (what they handed goes to any
/// claimer by then, a dead one's too). A call without an id (0) cannot be named, so nothing is
/// kept for it.
///
/// The calls still running are known too: a caller that gave up on a call whose claim was
/// being written (a slow commit) names it in its next call at once, and that call waits for
/// the named one to record its answer before taking it.
pub(super) struct LastAnswers<K, T> {
    remembered: Arc<Mutex<Remembered<K, T>>>,
    /// Woken whenever a running call ends.
    ended: Arc<Notify>,
    /// The claims' lease.
    lease: Duration,
}

struct Remembered<K, T> {
    last: HashMap<K, LastAnswer<T>>,
    /// The ids of the calls running for each key.
    running: HashMap<K, Vec<u64>>,
    /// When entries older than a lease are next dropped.
    next_sweep: Option<Instant>,
}

struct LastAnswer<T> {
    call_id: u64,
    at: Instant,
    handed: T,
}

impl<K, T> Clone for LastAnswers<K, T> {
    fn clone(&self) -> Self {
        Self { remembered: self.remembered.clone(), ended: self.ended.clone(), lease: self.lease }
    }
}

impl<K: Eq + Hash + Clone, T> LastAnswers<K, T> {
    /// Nothing kept yet, for claims of `lease`.
    pub(super) fn new(lease: Duration) -> Self {
        let remembered = Remembered { last: HashMap::new(), running: HashMap::new(), next_sweep: None };
        Self { remembered: Arc::new(Mutex::new(remembered)), ended: Arc::default(), lease }
    }

    /// Marks call `call_id` as running for `keys` until the guard returned is dropped, which
    /// must be after the call recorded its answer.
    pub(super) fn running(&self, keys: &[K], call_id: u64) -> Running<K, T> {
        let keys = if call_id == 0 { Vec::new() } else { keys.to_vec() };
        let mut remembered = self.remembered.lock().expect("last answers lock");
        for key in &keys {
            remembered.running.entry(key.clone()).or_default().push(call_id);
        }
        Running { answers: self.clone(), keys, call_id }
    }

    /// Takes out what the last calls for `keys` handed, each with its key's position in `keys`,
    /// where that call is one of `unanswered`; first it waits (up to [`MAX_WAIT_FOR_NAMED`])
    /// for those of them still running for `keys` to end. Unless [`Taken::handed_back`] is
    /// called (the hand-back failed, or the call ended some other way first), they are put back
    /// under `call_id`, the call taking them, which its claimer names next since it got no
    /// answer.
    pub(super) async fn take(&self, keys: &[K], unanswered: &[u64], call_id: u64) -> Taken<K, T> {
        let mut taken = Taken { answers: self.clone(), call_id, lost: Vec::new() };
        if unanswered.is_empty() {
            return taken;
        }
        let waited = tokio::time::timeout(MAX_WAIT_FOR_NAMED, self.named_ended(keys, unanswered, call_id)).await;
        if waited.is_err() {
            tracing::warn!(
                ?unanswered,
                "a claim call named an earlier call still running here after {MAX_WAIT_FOR_NAMED:?}; going on without it"
            );
        }
        let mut remembered = self.remembered.lock().expect("last answers lock");
        for (index, key) in keys.iter().enumerate() {
            if let Entry::Occupied(last) = remembered.last.entry(key.clone())
                && unanswered.contains(&last.get().call_id)
            {
                let (key, last) = last.remove_entry();
                taken.lost.push((index, key, last.handed));
            }
        }
        taken
    }

    /// Resolves once none of the calls `unanswered` (but `call_id`) runs for any of `keys`.
    async fn named_ended(&self, keys: &[K], unanswered: &[u64], call_id: u64) {
        loop {
            // Listening before looking, so an end between the two is not missed.
            let ended = self.ended.notified();
            let mut ended = std::pin::pin!(ended);
            ended.as_mut().enable();
            {
                let remembered = self.remembered.lock().expect("last answers lock");
                let mut named_runs = keys.iter().filter_map(|key| remembered.running.get(key)).flatten();
                if !named_runs.any(|id| *id != call_id && unanswered.contains(id)) {
                    return;
                }
            }
            ended.await;
        }
    }

    /// Keeps what call `call_id` handed each key in `handed` (in place of an earlier call's).
    pub(super) fn record(&self, call_id: u64, handed: impl IntoIterator<Item = (K, T)>) {
        if call_id == 0 {
            return;
        }
        let now = Instant::now();
        let entries: Vec<(K, LastAnswer<T>)> =
            handed.into_iter().map(|(key, handed)| (key, LastAnswer { call_id, at: now, handed })).collect();
        let mut remembered = self.remembered.lock().expect("last answers lock");
        if remembered.next_sweep.is_none_or(|at| now >= at) {
            remembered.last.retain(|_, answer| now.duration_since(answer.at) < self.lease);
            remembered.next_sweep = Some(now + self.lease);
        }
        remembered.last.extend(entries);
    }
}

/// A call running for some keys (see [`LastAnswers::running`]); dropped, it has ended.
pub(super) struct Running<K: Eq + Hash + Clone, T> {
    answers: LastAnswers<K, T>,
    keys: Vec<K>,
    call_id: u64,
}

impl<K: Eq + Hash + Clone, T> Drop for Running<K, T> {
    fn drop(&mut self) {
        if self.keys.is_empty() {
            return;
        }
        {
            let mut remembered = self.answers.remembered.lock().expect("last answers lock");
            for key in &self.keys {
                if let Entry::Occupied(mut running) = remembered.running.entry(key.clone()) {
                    if let Some(at) = running.get().iter().position(|id| *id == self.call_id) {
                        running.get_mut().swap_remove(at);
                    }
                    if running.get().is_empty() {
                        running.remove();
                    }
                }
            }
        }
        self.answers.ended.notify_waiters();
    }
}

/// What a call took out to hand back (see [`LastAnswers::take`]).
pub(super) struct Taken<K: Eq + Hash + Clone, T> {
    answers: LastAnswers<K, T>,
    call_id: u64,
    lost: Vec<(usize, K, T)>,
}

impl<K: Eq + Hash + Clone, T> Taken<K, T> {
    pub(super) fn is_empty(&self) -> bool {
        self.lost.is_empty()
    }

    /// What was taken, each with its key's position.
    pub(super) fn lost(&self) -> impl Iterator<Item = (usize, &T)> {
        self.lost.iter().map(|(index, _, handed)| (*index, handed))
    }

    /// The hand-back was made: nothing is put back.
    pub(super) fn handed_back(mut self) {
        self.lost.clear();
    }
}

impl<K: Eq + Hash + Clone, T> Drop for Taken<K, T> {
    fn drop(&mut self) {
        if !self.lost.is_empty() {
            let lost = std::mem::take(&mut self.lost).into_iter().map(|(_, key, handed)| (key, handed));
            self.answers.record(self.call_id, lost);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LEASE: Duration = Duration::from_secs(30);

    fn lost(taken: &Taken<&'static str, Vec<i64>>) -> Vec<(usize, Vec<i64>)> {
        taken.lost().map(|(index, handed)| (index, handed.clone())).collect()
    }

    #[tokio::test]
    async fn only_a_named_call_of_the_same_key_is_taken_and_only_once() {
        let answers: LastAnswers<&str, Vec<i64>> = LastAnswers::new(LEASE);
        answers.record(7, [("relay#1", vec![1, 2]), ("relay#2", vec![3])]);
        assert!(answers.take(&["relay#1"], &[], 9).await.is_empty(), "no call named");
        assert!(answers.take(&["relay#1"], &[6, 8], 9).await.is_empty(), "another call named");
        assert!(answers.take(&["relay#3"], &[7], 9).await.is_empty(), "another key");
        let taken = answers.take(&["relay#3", "relay#1"], &[7], 9).await;
        assert_eq!(lost(&taken), vec![(1, vec![1, 2])]);
        // A second call naming it at the same time gets nothing: one hand-back at a time.
        assert!(answers.take(&["relay#1"], &[7], 10).await.is_empty());
        taken.handed_back();
        assert!(answers.take(&["relay#1"], &[7, 9], 11).await.is_empty(), "handed back: gone");
        // The next call with something in its answer replaces an entry.
        answers.record(12, [("relay#2", vec![4])]);
        assert!(answers.take(&["relay#2"], &[7], 13).await.is_empty());
        assert_eq!(lost(&answers.take(&["relay#2"], &[12], 13).await), vec![(0, vec![4])]);
    }

    #[tokio::test]
    async fn what_a_call_took_and_did_not_hand_back_is_put_back_under_that_call() {
        let answers: LastAnswers<&str, Vec<i64>> = LastAnswers::new(LEASE);
        answers.record(7, [("relay#1", vec![1, 2])]);
        // Call 8 takes it and fails (or goes away) before handing it back.
        drop(answers.take(&["relay#1"], &[7], 8).await);
        assert!(answers.take(&["relay#1"], &[7], 9).await.is_empty(), "no longer under call 7");
        let again = answers.take(&["relay#1"], &[7, 8], 9).await;
        assert_eq!(lost(&again), vec![(0, vec![1, 2])], "named with call 8, it comes back");
        again.handed_back();
        // A call without an id cannot be named: nothing is put back under it.
        answers.record(10, [("relay#1", vec![5])]);
        drop(answers.take(&["relay#1"], &[10], 0).await);
        assert!(answers.take(&["relay#1"], &[0, 10], 11).await.is_empty());
    }

    #[tokio::test]
    async fn entries_older_than_a_lease_are_dropped_once_a_lease() {
        let answers: LastAnswers<&str, Vec<i64>> = LastAnswers::new(Duration::ZERO);
        answers.record(1, [("relay#1", vec![1])]);
        answers.record(2, [("relay#2", vec![2])]);
        assert!(answers.take(&["relay#1"], &[1], 3).await.is_empty(), "swept by the next record");
        assert_eq!(lost(&answers.take(&["relay#2"], &[2], 3).await), vec![(0, vec![2])], "the new entry is kept");
    }

    #[tokio::test(start_paused = true)]
    async fn a_call_naming_a_running_call_waits_for_its_answer_up_to_a_bound() {
        let answers: LastAnswers<&str, Vec<i64>> = LastAnswers::new(LEASE);
        let running = answers.running(&["relay#1"], 7);
        let named = tokio::spawn({
            let answers = answers.clone();
            async move { lost(&answers.take(&["relay#1"], &[7], 8).await) }
        });
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(!named.is_finished(), "it waits while call 7 runs");
        answers.record(7, [("relay#1", vec![1, 2])]);
        drop(running);
        assert_eq!(named.await.unwrap(), vec![(0, vec![1, 2])], "and takes what call 7 recorded");
        // Calls of other keys, and the call itself, are not waited for.
        let _other = answers.running(&["relay#2"], 9);
        let _itself = answers.running(&["relay#1"], 10);
        let started = Instant::now();
        assert!(answers.take(&["relay#1"], &[9, 10], 10).await.is_empty());
        assert_eq!(started.elapsed(), Duration::ZERO);
        // A named call that never ends is waited for only so long.
        let _stuck = answers.running(&["relay#1"], 11);
        answers.take(&["relay#1"], &[11], 12).await.handed_back();
        assert_eq!(started.elapsed(), MAX_WAIT_FOR_NAMED);
    }
}
