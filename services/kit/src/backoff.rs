//! The one backoff every retry loop in Reelay uses: wait a first delay, doubling up to a cap,
//! until the work succeeds or, when bounded, until the retries are spent. The consumer pausing
//! on an unreachable peer, the relay pausing on the broker or the write service, and start-up
//! work racing other processes on one SQLite file all wait through it.
//!
//! Each wait is jittered: between half the delay and the whole of it, at random, so processes
//! that met one failure together (every consumer when the write service restarts) do not come
//! back in step, all at once, at every doubling.

use std::fmt;
use std::time::Duration;

#[derive(Debug, Clone)]
pub struct Backoff {
    first: Duration,
    max: Duration,
    /// `None`: retry for as long as the caller keeps calling.
    max_retries: Option<u32>,
    delay: Duration,
    retries: u32,
}

impl Backoff {
    /// Waits `first`, doubling to `max`, for as long as the caller retries.
    pub const fn new(first: Duration, max: Duration) -> Self {
        Self { first, max, max_retries: None, delay: first, retries: 0 }
    }

    /// Like [`Backoff::new`], but gives up after `max_retries` waits.
    pub const fn bounded(first: Duration, max: Duration, max_retries: u32) -> Self {
        Self { first, max, max_retries: Some(max_retries), delay: first, retries: 0 }
    }

    /// How long the next wait sleeps at most (at least half of it).
    pub fn delay(&self) -> Duration {
        self.delay
    }

    /// Waits since the start or the last [`Backoff::reset`]: non-zero while backing off.
    pub fn retries(&self) -> u32 {
        self.retries
    }

    /// Logs that `what` failed with `error` and sleeps before the next try. False, without
    /// sleeping, when a bounded backoff has spent its retries.
    pub async fn wait(&mut self, what: &str, error: impl fmt::Display) -> bool {
        if self.spent() {
            return false;
        }
        tracing::warn!(%error, retry = self.retries + 1, delay_ms = self.delay.as_millis() as u64, "{what} failed; retrying");
        self.sleep().await
    }

    /// Sleeps before the next try without logging, for a caller that says in its own words why
    /// it waits (once per outage, say). False, without sleeping, when the retries are spent.
    pub async fn sleep(&mut self) -> bool {
        if self.spent() {
            return false;
        }
        self.retries += 1;
        tokio::time::sleep(jittered(self.delay)).await;
        self.delay = (self.delay * 2).min(self.max);
        true
    }

    /// The work succeeded: the next failure waits the first delay again.
    pub fn reset(&mut self) {
        self.delay = self.first;
        self.retries = 0;
    }

    fn spent(&self) -> bool {
        self.max_retries.is_some_and(|max| self.retries >= max)
    }
}

/// Between half of `delay` and all of it, at random.
fn jittered(delay: Duration) -> Duration {
    let half = delay / 2;
    half + Duration::from_nanos(fastrand::u64(0..=(delay - half).as_nanos().min(u128::from(u64::MAX)) as u64))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn doubles_to_the_cap_and_resets() {
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_millis(350));
        let mut delays = Vec::new();
        for _ in 0..4 {
            delays.push(backoff.delay().as_millis());
            assert!(backoff.sleep().await);
        }
        assert_eq!(delays, [100, 200, 350, 350]);
        assert_eq!(backoff.retries(), 4);
        backoff.reset();
        assert_eq!((backoff.delay(), backoff.retries()), (Duration::from_millis(100), 0));
    }

    /// A wait is between half its delay and all of it, and waits of one delay differ.
    #[test]
    fn waits_are_jittered_within_half_the_delay() {
        let delay = Duration::from_millis(100);
        let waits: std::collections::BTreeSet<Duration> = (0..100).map(|_| jittered(delay)).collect();
        assert!(waits.iter().all(|w| (delay / 2..=delay).contains(w)), "{waits:?}");
        assert!(waits.len() > 50, "{} distinct waits of 100", waits.len());
        assert_eq!(jittered(Duration::ZERO), Duration::ZERO);
    }

    #[tokio::test(start_paused = true)]
    async fn bounded_gives_up_after_its_retries() {
        let mut backoff = Backoff::bounded(Duration::from_millis(100), Duration::from_secs(1), 5);
        let started = tokio::time::Instant::now();
        let mut waits = 0;
        while backoff.wait("test work", "it failed").await {
            waits += 1;
        }
        assert_eq!(waits, 5);
        // 100 + 200 + 400 + 800 + 1000 ms at most, each wait at least half of its delay.
        let waited = started.elapsed();
        assert!((Duration::from_millis(1250)..=Duration::from_millis(2500)).contains(&waited), "{waited:?}");
        assert!(!backoff.sleep().await, "spent retries stay spent");
    }
}
