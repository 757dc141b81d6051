//! What the last claim answers handed out, kept so that an answer that never reached its claimer
//! can be handed back to it: the claim requests' `call_id` and `unanswered` (the relay's `Claim`
//! and the handlers' `ClaimDeliveriesForHandlers`).

use std::collections::HashMap;
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
/// call that was. The key's next call with something in its answer replaces it (a hand-back
/// too), and once a lease the entries older than a lease are dropped (what they handed goes to
/// any claimer by then, a dead one's too). A call naming it as unanswered reads it and leaves
/// it: a hand-back that fails or whose caller goes away can be asked for again, and the
/// claimer never names a call again once an answer has reached it.
pub(super) struct LastAnswers<K, T>(Arc<Mutex<Remembered<K, T>>>);

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
        Self(self.0.clone())
    }
}

impl<K, T> Default for LastAnswers<K, T> {
    fn default() -> Self {
        Self(Arc::new(Mutex::new(Remembered { last: HashMap::new(), next_sweep: None })))
    }
}

impl<K: Eq + Hash, T: Clone> LastAnswers<K, T> {
    /// What the last calls for `keys` handed, each with its key's position in `keys`, where that
    /// call is one of `unanswered`.
    pub(super) fn lost(&self, keys: impl IntoIterator<Item = K>, unanswered: &[u64]) -> Vec<(usize, T)> {
        if unanswered.is_empty() {
            return Vec::new();
        }
        let remembered = self.0.lock().expect("last answers lock");
        let mut lost = Vec::new();
        for (index, key) in keys.into_iter().enumerate() {
            if let Some(last) = remembered.last.get(&key)
                && unanswered.contains(&last.call_id)
            {
                lost.push((index, last.handed.clone()));
            }
        }
        lost
    }

    /// Keeps what call `call_id` handed each key in `handed` (in place of an earlier call's).
    pub(super) fn record(&self, call_id: u64, handed: impl IntoIterator<Item = (K, T)>, lease: Duration) {
        let now = Instant::now();
        let entries: Vec<(K, LastAnswer<T>)> =
            handed.into_iter().map(|(key, handed)| (key, LastAnswer { call_id, at: now, handed })).collect();
        let mut remembered = self.0.lock().expect("last answers lock");
        if remembered.next_sweep.is_none_or(|at| now >= at) {
            remembered.last.retain(|_, answer| now.duration_since(answer.at) < lease);
            remembered.next_sweep = Some(now + lease);
        }
        remembered.last.extend(entries);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LEASE: Duration = Duration::from_secs(30);

    #[test]
    fn only_a_named_call_of_the_same_key_is_lost_and_it_stays_until_replaced() {
        let answers: LastAnswers<&str, Vec<i64>> = LastAnswers::default();
        answers.record(7, [("relay#1", vec![1, 2]), ("relay#2", vec![3])], LEASE);
        assert!(answers.lost(["relay#1"], &[]).is_empty(), "no call named");
        assert!(answers.lost(["relay#1"], &[6, 8]).is_empty(), "another call named");
        assert!(answers.lost(["relay#3"], &[7]).is_empty(), "another key");
        assert_eq!(answers.lost(["relay#3", "relay#1"], &[7]), vec![(1, vec![1, 2])]);
        // Read, not taken: asked again (the first hand-back failed), it is still there.
        assert_eq!(answers.lost(["relay#1"], &[7, 8]), vec![(0, vec![1, 2])]);
        // The next call with something in its answer (a hand-back too) replaces it.
        answers.record(8, [("relay#1", vec![1, 2])], LEASE);
        assert!(answers.lost(["relay#1"], &[7]).is_empty());
        assert_eq!(answers.lost(["relay#1", "relay#2"], &[7, 8]), vec![(0, vec![1, 2]), (1, vec![3])]);
    }

    #[test]
    fn entries_older_than_a_lease_are_dropped_once_a_lease() {
        let answers: LastAnswers<&str, Vec<i64>> = LastAnswers::default();
        answers.record(1, [("relay#1", vec![1])], Duration::ZERO);
        answers.record(2, [("relay#2", vec![2])], Duration::ZERO);
        assert!(answers.lost(["relay#1"], &[1]).is_empty(), "swept by the next record");
        assert_eq!(answers.lost(["relay#2"], &[2]), vec![(0, vec![2])], "the new entry is kept");
    }
}
