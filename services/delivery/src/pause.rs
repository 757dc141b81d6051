//! Pausing while a peer is unreachable: the kit's [`Backoff`] from 100 ms doubling to 5 s, said
//! in the log once when the pause starts and once when it ends (not on every wait).

use std::time::Duration;

use reelay_kit::Backoff;

pub struct Pause {
    what: &'static str,
    backoff: Backoff,
}

impl Pause {
    pub fn new(what: &'static str) -> Self {
        Self { what, backoff: Backoff::new(Duration::from_millis(100), Duration::from_secs(5)) }
    }

    pub async fn wait(&mut self, error: &str) {
        if self.backoff.retries() == 0 {
            tracing::warn!(peer = self.what, %error, "peer unreachable; pausing consumption (no attempt is spent)");
        }
        self.backoff.sleep().await;
    }

    pub fn resumed(&mut self) {
        if self.backoff.retries() > 0 {
            tracing::info!(peer = self.what, "peer reachable again; resuming");
        }
        self.backoff.reset();
    }
}
