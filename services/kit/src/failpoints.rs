//! Test-only fault injection: `REELAY_FAILPOINTS=log_review,edit_review` arms named points
//! (`*` arms every write job's, see the writer) where a service then fails on purpose (a write job fails after all its statements ran
//! and before the commit; the relay aborts between PubAck and mark-done). Compiled only with the
//! `failpoints` feature, which release builds never enable; without it nothing is ever armed.

/// True when the test-only failpoint `name` is armed in `REELAY_FAILPOINTS`. Always false unless
/// built with the `failpoints` feature, which release builds never enable. Services use it to
/// simulate a crash at a precise point (e.g. the relay between PubAck and mark-done).
pub fn failpoint_armed(name: &str) -> bool {
    static ARMED: std::sync::OnceLock<Failpoints> = std::sync::OnceLock::new();
    ARMED.get_or_init(Failpoints::from_env).fires(name)
}

/// The failpoints armed in this process.
struct Failpoints {
    #[cfg(feature = "failpoints")]
    names: Vec<String>,
}

impl Failpoints {
    #[cfg(feature = "failpoints")]
    fn from_env() -> Self {
        let names: Vec<String> = std::env::var("REELAY_FAILPOINTS")
            .unwrap_or_default()
            .split(',')
            .map(|s| s.trim().to_owned())
            .filter(|s| !s.is_empty())
            .collect();
        if !names.is_empty() {
            tracing::warn!(?names, "failpoints armed");
        }
        Self { names }
    }

    #[cfg(not(feature = "failpoints"))]
    fn from_env() -> Self {
        Self {}
    }

    #[cfg(feature = "failpoints")]
    fn fires(&self, job: &str) -> bool {
        self.names.iter().any(|n| n == job)
    }

    #[cfg(not(feature = "failpoints"))]
    fn fires(&self, _job: &str) -> bool {
        false
    }
}
