//! Claim calls whose answers never reached their claimer (the claim requests' `call_id` and
//! `unanswered`: the relay's `Claim` and the handlers' `ClaimDeliveriesForHandlers`).
//!
//! A claim writes its call's id on every row it claims (`claim_call`), so what an unanswered
//! call claimed is found in the database when the claimer names it, even after this service
//! restarted: only the calls still running here are kept in memory, since a call naming one of
//! them must wait for it to write its claims before looking for them.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use reelay_kit::ServiceError;
use tokio::sync::Notify;

/// Most ids a claim may name as unanswered.
const MAX_UNANSWERED: usize = 64;
/// Longest a call waits for a call it names that is still running here, before it goes on
/// without what that call may claim (which then waits out its lease).
const MAX_WAIT_FOR_NAMED: Duration = Duration::from_secs(10);

/// Refuses a claim naming more unanswered calls than a call may name.
pub(super) fn check_unanswered(unanswered: &[u64]) -> Result<(), ServiceError> {
    if unanswered.len() > MAX_UNANSWERED {
        return Err(ServiceError::invalid(
            "unanswered",
            format!("must hold at most {MAX_UNANSWERED} call ids, got {}", unanswered.len()),
        ));
    }
    Ok(())
}

/// The claim calls running here for each claimer (by owner: a claimer's call ids are its own).
/// A caller that gave up on a call whose claim was being written (a slow commit) names it in
/// its next call at once; that call waits for the named one to end before looking for what it
/// claimed.
#[derive(Clone, Default)]
pub(super) struct RunningCalls {
    running: Arc<Mutex<HashMap<String, Vec<u64>>>>,
    /// Woken whenever a running call ends.
    ended: Arc<Notify>,
}

impl RunningCalls {
    /// Marks `owner`'s call `call_id` as running until the guard returned is dropped, which must
    /// be after the call wrote its claims (or gave up). A call without an id (0) cannot be
    /// named, so it is not marked.
    pub(super) fn running(&self, owner: &str, call_id: u64) -> Running {
        if call_id != 0 {
            self.running.lock().expect("running calls lock").entry(owner.to_owned()).or_default().push(call_id);
        }
        Running { calls: self.clone(), owner: owner.to_owned(), call_id }
    }

    /// Waits (up to [`MAX_WAIT_FOR_NAMED`]) until none of `owner`'s calls `unanswered` (but
    /// `call_id`, the call waiting) runs.
    pub(super) async fn named_ended(&self, owner: &str, unanswered: &[u64], call_id: u64) {
        if unanswered.is_empty() {
            return;
        }
        let waited = tokio::time::timeout(MAX_WAIT_FOR_NAMED, self.none_running(owner, unanswered, call_id)).await;
        if waited.is_err() {
            tracing::warn!(
                ?unanswered,
                "a claim call named an earlier call still running here after {MAX_WAIT_FOR_NAMED:?}; going on without it"
            );
        }
    }

    async fn none_running(&self, owner: &str, unanswered: &[u64], call_id: u64) {
        loop {
            // Listening before looking, so an end between the two is not missed.
            let ended = self.ended.notified();
            let mut ended = std::pin::pin!(ended);
            ended.as_mut().enable();
            {
                let running = self.running.lock().expect("running calls lock");
                let mut named_runs = running.get(owner).into_iter().flatten();
                if !named_runs.any(|id| *id != call_id && unanswered.contains(id)) {
                    return;
                }
            }
            ended.await;
        }
    }
}

/// A call running (see [`RunningCalls::running`]); dropped, it has ended.
pub(super) struct Running {
    calls: RunningCalls,
    owner: String,
    call_id: u64,
}

impl Drop for Running {
    fn drop(&mut self) {
        if self.call_id == 0 {
            return;
        }
        {
            let mut running = self.calls.running.lock().expect("running calls lock");
            if let Entry::Occupied(mut ids) = running.entry(std::mem::take(&mut self.owner)) {
                if let Some(at) = ids.get().iter().position(|id| *id == self.call_id) {
                    ids.get_mut().swap_remove(at);
                }
                if ids.get().is_empty() {
                    ids.remove();
                }
            }
        }
        self.calls.ended.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use tokio::time::Instant;

    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_call_naming_a_running_call_waits_for_it_to_end_up_to_a_bound() {
        let calls = RunningCalls::default();
        let running = calls.running("relay#1", 7);
        let named = tokio::spawn({
            let calls = calls.clone();
            async move { calls.named_ended("relay#1", &[7], 8).await }
        });
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(!named.is_finished(), "it waits while call 7 runs");
        drop(running);
        tokio::time::timeout(Duration::from_millis(1), named).await.expect("call 7 ended").unwrap();
        // Calls of other owners, calls not named, and the call itself, are not waited for; nor
        // is anything when no call is named.
        let _other = calls.running("relay#2", 9);
        let _itself = calls.running("relay#1", 10);
        let _not_named = calls.running("relay#1", 13);
        let started = Instant::now();
        calls.named_ended("relay#1", &[9, 10], 10).await;
        calls.named_ended("relay#1", &[], 14).await;
        assert_eq!(started.elapsed(), Duration::ZERO);
        // A call without an id is never marked running.
        let _unnamed = calls.running("relay#1", 0);
        calls.named_ended("relay#1", &[0], 15).await;
        assert_eq!(started.elapsed(), Duration::ZERO);
        // A named call that never ends is waited for only so long.
        let _stuck = calls.running("relay#1", 11);
        calls.named_ended("relay#1", &[11], 12).await;
        assert_eq!(started.elapsed(), MAX_WAIT_FOR_NAMED);
    }
}
