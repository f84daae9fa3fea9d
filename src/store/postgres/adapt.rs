//! How many batching slots take new claims and completions (`batch`, `batch_complete`):
//! the number of batches that may be in flight at once, which follows the load.
//!
//! Fewer slots make bigger batches: fewer statements and commits for the same claims,
//! which is what pays when the database's CPU is the bound. More slots put more
//! statements in flight side by side, which is what pays when each one waits on
//! something besides CPU (a slow commit, a disk, a database across a network, a
//! backend starved of CPU by other processes): then the commits of statements in
//! flight together are flushed together (group commit), and a few batching slots with
//! one statement each would hold back what more connections commit side by side.
//!
//! Which of the two holds is not known in advance and changes with the machine's load,
//! so the number is found by trying: every window of `WINDOW` statements (and at least
//! `WINDOW_TIME`), the mean time a claim or completion took, from its arrival to its
//! answer, is compared with the previous window's. Better than before: one more step the
//! same way; worse: one step back the other way. The number stays between one and
//! the most given (`with_batched_claims`, by default half the pool), and steps down
//! once a window takes `LIGHT` to fill: at light load a claim finds a slot idle and
//! is sent alone by its caller, whatever the number, and the next burst starts from
//! big batches. A lone claim or completion is counted like any other: the number is
//! judged by what every caller waits.

use std::{
    sync::{
        Mutex, PoisonError,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

/// Statements per window.
const WINDOW: u32 = 64;

/// A window's shortest time: a burst of fast statements does not decide alone.
const WINDOW_TIME: Duration = Duration::from_millis(20);

/// A window taking this long to fill: the load is light.
const LIGHT: Duration = Duration::from_secs(1);

/// The slots that take new claims and completions: the first `limit()` of `max()`.
pub(super) struct InFlight {
    max: usize,
    limit: AtomicUsize,
    window: Mutex<Window>,
}

struct Window {
    started: Instant,
    waited: Duration,
    count: u32,
    /// The previous window's mean, if the one before this ran under load.
    last: Option<Duration>,
    /// The direction of the last step.
    up: bool,
}

impl InFlight {
    /// Up to `max` (at least 1) slots, starting with two.
    pub(super) fn new(max: usize) -> Self {
        let max = max.max(1);
        Self {
            max,
            limit: AtomicUsize::new(max.min(2)),
            window: Mutex::new(Window {
                started: Instant::now(),
                waited: Duration::ZERO,
                count: 0,
                last: None,
                up: true,
            }),
        }
    }

    /// The slots that take new claims and completions now.
    pub(super) fn limit(&self) -> usize {
        self.limit.load(Ordering::Relaxed).clamp(1, self.max)
    }

    /// A claim or completion answered `took` after it arrived, at `now`.
    pub(super) fn record(&self, took: Duration, now: Instant) {
        let mut w = self.window.lock().unwrap_or_else(PoisonError::into_inner);
        w.waited += took;
        w.count += 1;
        let elapsed = now.saturating_duration_since(w.started);
        if w.count < WINDOW || elapsed < WINDOW_TIME {
            return;
        }
        let mean = w.waited / w.count;
        let limit = self.limit();
        let next = if elapsed >= LIGHT {
            w.last = None;
            w.up = false;
            limit - 1
        } else {
            if w.last.is_some_and(|last| mean > last) {
                w.up = !w.up;
            }
            w.last = Some(mean);
            if w.up && limit == self.max || !w.up && limit == 1 {
                w.up = !w.up;
            }
            if w.up { limit + 1 } else { limit - 1 }
        };
        self.limit.store(next.clamp(1, self.max), Ordering::Relaxed);
        w.started = now;
        w.waited = Duration::ZERO;
        w.count = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `windows` full windows, each statement taking `cost(limit)`, a window every
    /// 50 ms; the limits seen, one per window.
    fn climb(
        in_flight: &InFlight,
        start: Instant,
        windows: u32,
        cost: impl Fn(usize) -> Duration,
    ) -> Vec<usize> {
        let mut seen = Vec::new();
        for w in 1..=windows {
            let limit = in_flight.limit();
            seen.push(limit);
            for _ in 0..WINDOW {
                in_flight.record(cost(limit), start + w * Duration::from_millis(50));
            }
        }
        seen
    }

    #[test]
    fn climbs_to_the_most_when_more_in_flight_is_faster() {
        let in_flight = InFlight::new(8);
        let start = in_flight.window.lock().unwrap().started;
        let seen = climb(&in_flight, start, 20, |n| {
            Duration::from_millis(64 / n as u64)
        });
        assert_eq!(seen[0], 2);
        // Up to 8, then around the top.
        assert!(seen[..7].windows(2).all(|p| p[1] == p[0] + 1), "{seen:?}");
        assert!(seen[8..].iter().all(|&n| n >= 7), "{seen:?}");
    }

    #[test]
    fn settles_where_the_statements_are_fastest() {
        let in_flight = InFlight::new(8);
        let start = in_flight.window.lock().unwrap().started;
        // Best at 4: fewer hold claims back, more split the batches too fine.
        let cost = |n: usize| Duration::from_millis(10 + 3 * (n as u64).abs_diff(4));
        let seen = climb(&in_flight, start, 30, cost);
        assert!(seen[10..].iter().all(|n| (3..=5).contains(n)), "{seen:?}");
    }

    #[test]
    fn one_at_most_stays_one() {
        let in_flight = InFlight::new(1);
        let start = in_flight.window.lock().unwrap().started;
        let seen = climb(&in_flight, start, 5, |_| Duration::from_millis(1));
        assert_eq!(seen, [1, 1, 1, 1, 1]);
    }

    #[test]
    fn steps_down_when_the_load_is_light() {
        let in_flight = InFlight::new(8);
        let start = in_flight.window.lock().unwrap().started;
        climb(&in_flight, start, 4, |n| {
            Duration::from_millis(64 / n as u64)
        });
        let high = in_flight.limit();
        assert!(high > 2, "{high}");
        // A window that took two seconds to fill.
        let late = start + Duration::from_secs(10);
        for _ in 0..WINDOW {
            in_flight.record(Duration::from_millis(1), late);
        }
        assert_eq!(in_flight.limit(), high - 1);
    }
}
