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
//! The number starts at the most given (`with_batched_claims`, by default the pool's
//! size), where batching is never behind sending each claim alone: a claim or
//! completion that finds one of the slots idle is sent at once by its own caller, so
//! while fewer are waiting than there are slots, as many statements are in flight as
//! without batching; only those that find every slot busy queue, as they would have
//! queued for a pooled connection, and they go in the next batch.
//!
//! From there it only comes down where batching wins, found by trying: every window of
//! `WINDOW` claims and completions (and at least `WINDOW_TIME`),
//!
//! - if the window's statements carried fewer than two each on average, few are
//!   waiting: one more slot (up to the most), as a claim alone on a connection of its
//!   own is then what a claim without batching gets;
//! - else the mean time a claim or completion took, from its arrival to its answer, is
//!   compared with the previous window's: better than before, one more step the same
//!   way; worse, one step back the other way. The first step is down (bigger batches).
//!
//! A window taking `LIGHT` to fill puts the number back at the most: at light load a
//! claim finds a slot idle and is sent alone by its caller, whatever the number, and
//! the next burst starts from as many in flight as the pool would have. A lone claim or
//! completion is counted like any other: the number is judged by what every caller
//! waits.

use std::{
    sync::{
        Mutex, PoisonError,
        atomic::{AtomicU32, AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

/// Claims and completions per window.
const WINDOW: u32 = 128;

/// A window's shortest time: a burst of fast statements does not decide alone.
const WINDOW_TIME: Duration = Duration::from_millis(20);

/// A window taking this long to fill: the load is light.
const LIGHT: Duration = Duration::from_secs(1);

/// The slots that take new claims and completions: the first `limit()` of `max()`.
pub(super) struct InFlight {
    max: usize,
    limit: AtomicUsize,
    /// Statements sent (a batch, or a claim or completion alone) in this window.
    statements: AtomicU32,
    window: Mutex<Window>,
}

struct Window {
    started: Instant,
    waited: Duration,
    count: u32,
    /// The previous window's mean, if it was one where batches formed.
    last: Option<Duration>,
    /// The direction of the last step.
    up: bool,
}

impl InFlight {
    /// Up to `max` (at least 1) slots, starting with all of them.
    pub(super) fn new(max: usize) -> Self {
        let max = max.max(1);
        Self {
            max,
            limit: AtomicUsize::new(max),
            statements: AtomicU32::new(0),
            window: Mutex::new(Window {
                started: Instant::now(),
                waited: Duration::ZERO,
                count: 0,
                last: None,
                up: false,
            }),
        }
    }

    /// The slots that take new claims and completions now.
    pub(super) fn limit(&self) -> usize {
        self.limit.load(Ordering::Relaxed).clamp(1, self.max)
    }

    /// A statement went out: a batch, or a claim or completion alone.
    pub(super) fn sent(&self) {
        self.statements.fetch_add(1, Ordering::Relaxed);
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
        let statements = self.statements.swap(0, Ordering::Relaxed).max(1);
        let mean = w.waited / w.count;
        let limit = self.limit();
        let next = if elapsed >= LIGHT {
            w.last = None;
            w.up = false;
            self.max
        } else if w.count < 2 * statements {
            // Batches of fewer than two: as many in flight as waiting, up to the most.
            w.last = None;
            w.up = false;
            limit + 1
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

    /// Runs `windows` full windows, each claim taking `cost(limit)` and going in a
    /// statement of `size(limit)` claims, a window every 50 ms; the limits seen, one
    /// per window.
    fn climb(
        in_flight: &InFlight,
        start: Instant,
        windows: u32,
        cost: impl Fn(usize) -> Duration,
        size: impl Fn(usize) -> u32,
    ) -> Vec<usize> {
        let mut seen = Vec::new();
        for w in 1..=windows {
            let limit = in_flight.limit();
            seen.push(limit);
            for i in 0..WINDOW {
                if i % size(limit) == 0 {
                    in_flight.sent();
                }
                in_flight.record(cost(limit), start + w * Duration::from_millis(50));
            }
        }
        seen
    }

    /// Batches of `n` claims with `c` callers over `n` slots: c / n each.
    fn shared_by(c: u32) -> impl Fn(usize) -> u32 {
        move |n| (c / n as u32).max(1)
    }

    #[test]
    fn starts_with_every_slot_and_stays_there_while_fewer_wait() {
        let in_flight = InFlight::new(16);
        let start = in_flight.window.lock().unwrap().started;
        // 16 callers, 16 slots: each claim alone, however slow.
        let seen = climb(
            &in_flight,
            start,
            20,
            |_| Duration::from_millis(5),
            shared_by(16),
        );
        assert!(seen.iter().all(|&n| n == 16), "{seen:?}");
    }

    #[test]
    fn climbs_down_to_bigger_batches_while_they_are_faster() {
        let in_flight = InFlight::new(16);
        let start = in_flight.window.lock().unwrap().started;
        // 64 callers on a busy database: the fewer statements, the faster.
        let seen = climb(
            &in_flight,
            start,
            30,
            |n| Duration::from_millis(10 + n as u64),
            shared_by(64),
        );
        assert_eq!(seen[0], 16);
        assert!(seen[..15].windows(2).all(|p| p[1] + 1 == p[0]), "{seen:?}");
        assert!(seen[16..].iter().all(|&n| n <= 2), "{seen:?}");
    }

    #[test]
    fn settles_where_the_statements_are_fastest() {
        let in_flight = InFlight::new(8);
        let start = in_flight.window.lock().unwrap().started;
        // Best at 4: fewer hold claims back, more split the batches too fine.
        let cost = |n: usize| Duration::from_millis(10 + 3 * (n as u64).abs_diff(4));
        let seen = climb(&in_flight, start, 30, cost, shared_by(64));
        assert!(seen[10..].iter().all(|n| (3..=5).contains(n)), "{seen:?}");
    }

    #[test]
    fn stays_at_the_most_when_more_in_flight_is_faster() {
        let in_flight = InFlight::new(8);
        let start = in_flight.window.lock().unwrap().started;
        // Slow commits: each batch takes as long, whatever its size.
        let seen = climb(
            &in_flight,
            start,
            20,
            |n| Duration::from_millis(64 / n as u64),
            shared_by(64),
        );
        assert!(seen.iter().all(|&n| n >= 7), "{seen:?}");
    }

    #[test]
    fn grows_back_when_batches_thin_out() {
        let in_flight = InFlight::new(8);
        let start = in_flight.window.lock().unwrap().started;
        climb(
            &in_flight,
            start,
            10,
            |n| Duration::from_millis(10 + n as u64),
            shared_by(64),
        );
        let low = in_flight.limit();
        assert!(low <= 2, "{low}");
        // Fewer callers than slots: one more slot a window, up to the most.
        let later = start + Duration::from_millis(600);
        let seen = climb(&in_flight, later, 10, |_| Duration::from_millis(1), |_| 1);
        assert_eq!(seen[1], low + 1, "{seen:?}");
        assert_eq!(*seen.last().unwrap(), 8, "{seen:?}");
    }

    #[test]
    fn one_at_most_stays_one() {
        let in_flight = InFlight::new(1);
        let start = in_flight.window.lock().unwrap().started;
        let seen = climb(
            &in_flight,
            start,
            5,
            |_| Duration::from_millis(1),
            shared_by(64),
        );
        assert_eq!(seen, [1, 1, 1, 1, 1]);
    }

    #[test]
    fn goes_back_to_the_most_when_the_load_is_light() {
        let in_flight = InFlight::new(8);
        let start = in_flight.window.lock().unwrap().started;
        climb(
            &in_flight,
            start,
            4,
            |n| Duration::from_millis(10 + n as u64),
            shared_by(64),
        );
        assert!(in_flight.limit() < 8, "{}", in_flight.limit());
        // A window that took seconds to fill.
        let late = start + Duration::from_secs(10);
        for _ in 0..WINDOW {
            in_flight.sent();
            in_flight.record(Duration::from_millis(1), late);
        }
        assert_eq!(in_flight.limit(), 8);
    }
}
