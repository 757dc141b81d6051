//! What the last claim answers handed out, kept so that an answer that never reached its claimer
//! can be handed back to it: the claim requests' `call_id` and `unanswered` (the relay's `Claim`
//! and the handlers' `ClaimDeliveriesForHandlers`).

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::hash::Hash;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use reelay_kit::ServiceError;
use tokio::time::Instant;

/// Most ids a claim may name as unanswered.
const MAX_UNANSWERED: usize = 64;

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
pub(super) struct LastAnswers<K, T> {
    remembered: Arc<Mutex<Remembered<K, T>>>,
    /// The claims' lease.
    lease: Duration,
}

struct Remembered<K, T> {
    last: HashMap<K, LastAnswer<T>>,
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
        Self { remembered: self.remembered.clone(), lease: self.lease }
    }
}

impl<K: Eq + Hash, T> LastAnswers<K, T> {
    /// Nothing kept yet, for claims of `lease`.
    pub(super) fn new(lease: Duration) -> Self {
        Self { remembered: Arc::new(Mutex::new(Remembered { last: HashMap::new(), next_sweep: None })), lease }
    }

    /// Takes out what the last calls for `keys` handed, each with its key's position in `keys`,
    /// where that call is one of `unanswered`. Unless [`Taken::handed_back`] is called (the
    /// hand-back failed, or the call ended some other way first), they are put back under
    /// `call_id`, the call taking them, which its claimer names next since it got no answer.
    pub(super) fn take(&self, keys: impl IntoIterator<Item = K>, unanswered: &[u64], call_id: u64) -> Taken<K, T> {
        let mut taken = Taken { answers: self.clone(), call_id, lost: Vec::new() };
        if unanswered.is_empty() {
            return taken;
        }
        let mut remembered = self.remembered.lock().expect("last answers lock");
        for (index, key) in keys.into_iter().enumerate() {
            if let Entry::Occupied(last) = remembered.last.entry(key)
                && unanswered.contains(&last.get().call_id)
            {
                let (key, last) = last.remove_entry();
                taken.lost.push((index, key, last.handed));
            }
        }
        taken
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

/// What a call took out to hand back (see [`LastAnswers::take`]).
pub(super) struct Taken<K: Eq + Hash, T> {
    answers: LastAnswers<K, T>,
    call_id: u64,
    lost: Vec<(usize, K, T)>,
}

impl<K: Eq + Hash, T> Taken<K, T> {
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

impl<K: Eq + Hash, T> Drop for Taken<K, T> {
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

    #[test]
    fn only_a_named_call_of_the_same_key_is_taken_and_only_once() {
        let answers: LastAnswers<&str, Vec<i64>> = LastAnswers::new(LEASE);
        answers.record(7, [("relay#1", vec![1, 2]), ("relay#2", vec![3])]);
        assert!(answers.take(["relay#1"], &[], 9).is_empty(), "no call named");
        assert!(answers.take(["relay#1"], &[6, 8], 9).is_empty(), "another call named");
        assert!(answers.take(["relay#3"], &[7], 9).is_empty(), "another key");
        let taken = answers.take(["relay#3", "relay#1"], &[7], 9);
        assert_eq!(lost(&taken), vec![(1, vec![1, 2])]);
        // A second call naming it at the same time gets nothing: one hand-back at a time.
        assert!(answers.take(["relay#1"], &[7], 10).is_empty());
        taken.handed_back();
        assert!(answers.take(["relay#1"], &[7, 9], 11).is_empty(), "handed back: gone");
        // The next call with something in its answer replaces an entry.
        answers.record(12, [("relay#2", vec![4])]);
        assert!(answers.take(["relay#2"], &[7], 13).is_empty());
        assert_eq!(lost(&answers.take(["relay#2"], &[12], 13)), vec![(0, vec![4])]);
    }

    #[test]
    fn what_a_call_took_and_did_not_hand_back_is_put_back_under_that_call() {
        let answers: LastAnswers<&str, Vec<i64>> = LastAnswers::new(LEASE);
        answers.record(7, [("relay#1", vec![1, 2])]);
        // Call 8 takes it and fails (or goes away) before handing it back.
        drop(answers.take(["relay#1"], &[7], 8));
        assert!(answers.take(["relay#1"], &[7], 9).is_empty(), "no longer under call 7");
        let again = answers.take(["relay#1"], &[7, 8], 9);
        assert_eq!(lost(&again), vec![(0, vec![1, 2])], "named with call 8, it comes back");
        again.handed_back();
        // A call without an id cannot be named: nothing is put back under it.
        answers.record(10, [("relay#1", vec![5])]);
        drop(answers.take(["relay#1"], &[10], 0));
        assert!(answers.take(["relay#1"], &[0, 10], 11).is_empty());
    }

    #[test]
    fn entries_older_than_a_lease_are_dropped_once_a_lease() {
        let answers: LastAnswers<&str, Vec<i64>> = LastAnswers::new(Duration::ZERO);
        answers.record(1, [("relay#1", vec![1])]);
        answers.record(2, [("relay#2", vec![2])]);
        assert!(answers.take(["relay#1"], &[1], 3).is_empty(), "swept by the next record");
        assert_eq!(lost(&answers.take(["relay#2"], &[2], 3)), vec![(0, vec![2])], "the new entry is kept");
    }
}
