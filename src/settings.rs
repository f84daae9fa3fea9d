//! The bounds every duration setting is held to, the layer's, a `JobRunner`'s and the
//! store's alike.

use std::time::Duration;

/// The longest duration accepted for a TTL, a lease, a wait or a timeout; longer
/// settings are held to it (PostgreSQL's timestamps end in 294276 AD, and `now()` plus
/// more fails the statement).
pub(crate) const TEN_YEARS: Duration = Duration::from_secs(10 * 365 * 24 * 3600);

/// The longest `lock_timeout` PostgreSQL accepts (`i32::MAX` milliseconds, 24.8 days).
#[cfg(feature = "postgres")]
pub(crate) const LONGEST_LOCK_TIMEOUT: Duration = Duration::from_millis(i32::MAX as u64);

/// A duration setting `d`, held to at least `shortest` and at most ten years.
pub(crate) fn duration(d: Duration, shortest: Duration) -> Duration {
    d.clamp(shortest, TEN_YEARS)
}

/// The shortest timeout or TTL accepted.
pub(crate) const MILLISECOND: Duration = Duration::from_millis(1);

/// The shortest lease accepted: renewed every third of it, a shorter one could not be
/// kept.
pub(crate) const SHORTEST_LEASE: Duration = Duration::from_millis(10);
