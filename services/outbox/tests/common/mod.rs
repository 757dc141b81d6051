//! What the outbox's test files share.

/// The tests' clock: a month after the day they run. Ahead of the real clock, as a write
/// service's clock always is of the time its leases count from (the writer counts them from
/// its real start); a fixed date would stop doing that once the real clock passed it.
pub fn t0() -> i64 {
    static T0: std::sync::LazyLock<i64> = std::sync::LazyLock::new(|| {
        const DAY: i64 = 86_400_000;
        (reelay_kit::now_ms() / DAY + 30) * DAY
    });
    *T0
}
