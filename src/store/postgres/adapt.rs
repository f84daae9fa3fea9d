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
//! - if hardly any queued (under 1.25 claims or completions a statement on average;
//!   at the most, under 1.0625) and hardly any claim found every pooled connection
//!   checked out (under one in eight), fewer are waiting than there are slots: twice
//!   the slots (up to the most), as a claim alone on a connection of its own is then
//!   what a claim without batching gets. At the most, claims queue only behind a slot
//!   that is sending while every other one is too, so batches there, even small ones,
//!   mean more are waiting than there are slots: with the 1.25 of below, a load that
//!   reached the most stayed there with batches of about one (0.88 statements a replay
//!   of 64 clients over 16 slots, at a third of the rate the same load had where it
//!   started with fewer slots and settled at 0.09), never trying fewer;
//! - else batches form, or claims wait for the pool as they would without batching:
//!   the mean time a claim or completion took, from its arrival to its answer, is
//!   compared with the previous window's. Better than before, one more step the same
//!   way; worse, one step back the other way, where it then stays for `HOLD` windows
//!   before it tries the other side; a step halves or doubles the number, the first
//!   one halving it (bigger batches). Without the stay, a number that had found where
//!   claims are fastest left it every other window to try a side it had just found
//!   slower. Fewer, bigger batches cost the database less for the same claims, so
//!   they are kept unless more are clearly faster: a halving counts as worse if it
//!   made the mean over 1/16 longer, a doubling unless it made it over 1/16 shorter.
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
const WINDOW_TIME: Duration = Duration::from_millis(50);

/// Windows a number stays at once a step from it was undone, before the other side is
/// tried.
const HOLD: u32 = 4;

/// A window taking this long to fill: the load is light.
const LIGHT: Duration = Duration::from_secs(1);

/// The slots that take new claims and completions: the first `limit()` of `max()`.
pub(super) struct InFlight {
    max: usize,
    limit: AtomicUsize,
    /// Statements sent (a batch, or a claim or completion alone) in this window.
    statements: AtomicU32,
    /// Claims in this window that found a batching slot idle but no pooled connection.
    starved: AtomicU32,
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
    /// Windows left to stay at the number a step was undone back to.
    hold: u32,
}

impl InFlight {
    /// Up to `max` (at least 1) slots, starting with all of them.
    pub(super) fn new(max: usize) -> Self {
        let max = max.max(1);
        Self {
            max,
            limit: AtomicUsize::new(max),
            statements: AtomicU32::new(0),
            starved: AtomicU32::new(0),
            window: Mutex::new(Window {
                started: Instant::now(),
                waited: Duration::ZERO,
                count: 0,
                last: None,
                up: false,
                hold: 0,
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

    /// A claim found a slot idle but every pooled connection checked out: without
    /// batching it would have waited for one too.
    pub(super) fn starved(&self) {
        self.starved.fetch_add(1, Ordering::Relaxed);
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
        let starved = self.starved.swap(0, Ordering::Relaxed);
        let mean = w.waited / w.count;
        let limit = self.limit();
        let next = if elapsed >= LIGHT {
            w.last = None;
            w.up = false;
            w.hold = 0;
            self.max
        } else if few_queued(w.count, statements, limit == self.max) && 8 * starved < w.count {
            // Hardly any batches, and the pool's connections enough for those
            // waiting: as many in flight as waiting, up to the most.
            w.last = None;
            w.up = false;
            w.hold = 0;
            limit * 2
        } else {
            // Fewer, bigger batches unless more are clearly faster: a step down is
            // undone if it made claims over 1/16 slower, a step up unless it made them
            // over 1/16 faster. Undone, the number stays where it was faster for `HOLD`
            // windows before it tries the other side: a climb that tried a side every
            // window would spend half its time where it had just found it slower.
            let holding = w.hold > 0;
            if holding {
                w.hold -= 1;
            } else if w.last.is_some_and(|last| {
                if w.up {
                    mean + last / 16 > last
                } else {
                    mean > last + last / 16
                }
            }) {
                w.up = !w.up;
                w.hold = HOLD;
            }
            w.last = Some(mean);
            if holding && w.hold > 0 {
                limit
            } else {
                if w.up && limit == self.max || !w.up && limit == 1 {
                    w.up = !w.up;
                }
                if w.up { limit * 2 } else { limit / 2 }
            }
        };
        self.limit.store(next.clamp(1, self.max), Ordering::Relaxed);
        w.started = now;
        w.waited = Duration::ZERO;
        w.count = 0;
    }
}

/// Whether hardly any of a window's `count` claims and completions queued, for its
/// `statements`: under 1.25 a statement, or under 1.0625 at the most (see the module's
/// docs).
fn few_queued(count: u32, statements: u32, at_most: bool) -> bool {
    if at_most {
        16 * u64::from(count) < 17 * u64::from(statements)
    } else {
        4 * u64::from(count) < 5 * u64::from(statements)
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
        // Halving each window while it pays, then between one and two.
        assert_eq!(seen[..5], [16, 8, 4, 2, 1], "{seen:?}");
        assert!(seen[5..].iter().all(|&n| n <= 2), "{seen:?}");
    }

    #[test]
    fn settles_where_the_statements_are_fastest() {
        let in_flight = InFlight::new(8);
        let start = in_flight.window.lock().unwrap().started;
        // Best at 4: fewer hold claims back, more split the batches too fine.
        let cost = |n: usize| Duration::from_millis(10 + 3 * (n as u64).abs_diff(4));
        let seen = climb(&in_flight, start, 30, cost, shared_by(64));
        // Most windows there once found (without the hold after a step undone, half),
        // the others trying either side of it.
        let found = seen.iter().position(|&n| n == 4).expect("found") + 1;
        let at_best = seen[found..].iter().filter(|&&n| n == 4).count();
        assert!(4 * at_best >= 3 * (seen.len() - found), "{seen:?}");
        assert!(
            seen[found..].contains(&2) && seen[found..].contains(&8),
            "{seen:?}"
        );
        assert!(seen.iter().all(|n| [2, 4, 8].contains(n)), "{seen:?}");
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
        // Most windows at the most (without the hold, half), the others trying half as
        // many now and then.
        let at_most = seen.iter().filter(|&&n| n == 8).count();
        assert!(4 * at_most >= 3 * seen.len(), "{seen:?}");
        assert!(seen.iter().all(|&n| n >= 4), "{seen:?}");
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
        // Fewer callers than slots: twice the slots a window, up to the most.
        let later = start + Duration::from_millis(600);
        let seen = climb(&in_flight, later, 10, |_| Duration::from_millis(1), |_| 1);
        assert_eq!(seen[1], low * 2, "{seen:?}");
        assert_eq!(*seen.last().unwrap(), 8, "{seen:?}");
    }

    #[test]
    fn tries_fewer_when_claims_wait_for_pooled_connections() {
        let in_flight = InFlight::new(16);
        let start = in_flight.window.lock().unwrap().started;
        // Each alone, but one in four found no pooled connection at once.
        for i in 0..WINDOW {
            in_flight.sent();
            if i % 4 == 0 {
                in_flight.starved();
            }
            in_flight.record(Duration::from_millis(1), start + Duration::from_millis(50));
        }
        assert_eq!(in_flight.limit(), 8);
    }

    #[test]
    fn tries_fewer_when_small_batches_form_at_the_most() {
        let in_flight = InFlight::new(16);
        let start = in_flight.window.lock().unwrap().started;
        // Every slot sending, and about one claim in eight queued behind one: batches
        // of one or two, which the 1.25 a statement below the most counts as none.
        let seen = climb(&in_flight, start, 2, |_| Duration::from_millis(1), |_| 1);
        assert_eq!(seen, [16, 16]);
        for i in 0..WINDOW {
            if i % 8 != 0 {
                in_flight.sent();
            }
            in_flight.record(Duration::from_millis(1), start + Duration::from_millis(150));
        }
        assert_eq!(in_flight.limit(), 8);
        // Below the most, batches that small still grow it back.
        for i in 0..WINDOW {
            if i % 8 != 0 {
                in_flight.sent();
            }
            in_flight.record(Duration::from_millis(1), start + Duration::from_millis(200));
        }
        assert_eq!(in_flight.limit(), 16);
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
