//! The process-wide stop signal: the first SIGTERM or Ctrl-C asks every service to stop taking
//! work and finish what it has; a second one exits at once.

use tokio_util::sync::CancellationToken;

#[derive(Clone, Default)]
pub struct Shutdown {
    token: CancellationToken,
}

impl Shutdown {
    pub fn new() -> Self {
        Self::default()
    }

    /// Resolves when shutdown has been requested.
    pub async fn requested(&self) {
        self.token.cancelled().await
    }

    /// Runs `work` to its end, or until shutdown is requested (`None`: `work` is dropped).
    pub async fn unless_requested<T>(&self, work: impl Future<Output = T>) -> Option<T> {
        tokio::select! {
            done = work => Some(done),
            () = self.requested() => None,
        }
    }

    pub fn is_requested(&self) -> bool {
        self.token.is_cancelled()
    }

    pub fn request(&self) {
        self.token.cancel()
    }

    /// Listens for SIGTERM / SIGINT in the background.
    pub fn listen_for_signals(&self) {
        let this = self.clone();
        tokio::spawn(async move {
            wait_for_signal().await;
            tracing::info!("shutdown requested (signal again to exit at once)");
            this.request();
            wait_for_signal().await;
            tracing::warn!("second signal; exiting immediately");
            std::process::exit(130);
        });
    }
}

async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let mut term = signal(SignalKind::terminate()).expect("install SIGTERM handler");
        tokio::select! {
            _ = term.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
