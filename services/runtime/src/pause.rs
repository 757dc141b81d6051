//! Pausing while a peer is unreachable: wait 100 ms, doubling to 5 s, and say so in the log
//! once when it starts and once when it ends.

use std::time::Duration;

const FIRST: Duration = Duration::from_millis(100);
const MAX: Duration = Duration::from_secs(5);

pub struct Pause {
    what: &'static str,
    delay: Duration,
    paused: bool,
}

impl Pause {
    pub fn new(what: &'static str) -> Self {
        Self { what, delay: FIRST, paused: false }
    }

    pub async fn wait(&mut self, error: &str) {
        if !self.paused {
            tracing::warn!(peer = self.what, %error, "peer unreachable; pausing consumption (no attempt is spent)");
            self.paused = true;
        }
        tokio::time::sleep(self.delay).await;
        self.delay = (self.delay * 2).min(MAX);
    }

    pub fn resumed(&mut self) {
        if self.paused {
            tracing::info!(peer = self.what, "peer reachable again; resuming");
        }
        self.paused = false;
        self.delay = FIRST;
    }
}
