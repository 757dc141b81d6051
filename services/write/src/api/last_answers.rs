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
/// it as unanswered takes it out, and once a lease the entries older than a lease are dropped
/// (what they handed goes to any claimer by then, a dead one's too).
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

impl<K: Eq + Hash, T> LastAnswers<K, T> {
    /// Takes out what the last calls for `keys` handed, each with its key's position in `keys`,
    /// where that call is one of `unanswered`.
    pub(super) fn take(&self, keys: impl IntoIterator<Item = K>, unanswered: &[u64]) -> Vec<(usize, T)> {
        if unanswered.is_empty() {
            return Vec::new();
        }
        let mut remembered = self.0.lock().expect("last answers lock");
        let mut lost = Vec::new();
        for (index, key) in keys.into_iter().enumerate() {
            if let Entry::Occupied(last) = remembered.last.entry(key)
                && unanswered.contains(&last.get().call_id)
            {
                lost.push((index, last.remove().handed));
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
