//! A lone claim or completion sent by its own caller (`batch`, `batch_complete`).
//!
//! A claim (or a completion) that finds its batching slot idle marks the slot sending
//! and runs the statement of one key in its caller's own task: no task to hand it to,
//! no channel to bring its answer back. It holds the slot as its [`Lead`] meanwhile, so
//! that what arrives behind it queues, as behind a batch in flight. The lead hands the
//! slot over once: when its statement ends, fails, or its caller gives up (the lead is
//! dropped), and sooner if the statement goes unanswered for `shared::STALLED`
//! (waiting on a row lock, or on a connection that died without a word), so that the
//! claims queued behind it do not wait on it. Handing over drops the queued members
//! whose caller gave up, then starts the slot's `drive` task for those left, or, with
//! nothing left, leaves the slot idle for the next to lead.

use std::{future::Future, pin::Pin, sync::Arc};

use super::{PostgresStore, shared::STALLED};

/// Batching slots and their queues, as a lead hands one over.
pub(super) trait Lanes: Send + Sync + Sized + 'static {
    /// Drops slot `slot`'s queued members whose caller gave up; whether any are left.
    /// If none, the slot is no longer sending: the next to come leads it.
    fn keep_sending(&self, slot: usize) -> bool;

    /// Ends slot `slot`'s sending with no task to send it (no runtime to spawn one on):
    /// its queued members are dropped unanswered, and their callers get an error.
    fn abandon(&self, slot: usize);

    /// The task that sends the queued members of `sending`'s slot, in batches, until
    /// none is left.
    fn drive(
        self: Arc<Self>,
        store: PostgresStore,
        sending: Sending<Self>,
    ) -> impl Future<Output = ()> + Send + 'static;
}

/// A slot's `drive` task, as a guard. Made before the task is first polled, so that a
/// task dropped unpolled (spawned as its runtime shuts down) or midway still gives its
/// slot up: its queued members are answered with an error, and the next to come leads
/// the slot again.
pub(super) struct Sending<L: Lanes> {
    lanes: Arc<L>,
    slot: usize,
    done: bool,
}

impl<L: Lanes> Sending<L> {
    pub(super) fn slot(&self) -> usize {
        self.slot
    }

    /// Whether members are left to send (`Lanes::keep_sending`); once none is, the slot
    /// is idle and the task ends.
    pub(super) fn go_on(&mut self) -> bool {
        let on = self.lanes.keep_sending(self.slot);
        self.done = !on;
        on
    }
}

impl<L: Lanes> Drop for Sending<L> {
    fn drop(&mut self) {
        if !self.done {
            self.lanes.abandon(self.slot);
        }
    }
}

/// A slot held by a caller sending its own lone statement; handed over once (see the
/// module's docs), at the latest when dropped.
pub(super) struct Lead<L: Lanes> {
    lanes: Arc<L>,
    store: PostgresStore,
    slot: usize,
    handed: bool,
}

impl<L: Lanes> Lead<L> {
    /// Slot `slot` of `lanes`, which the caller has just marked sending.
    pub(super) fn new(store: &PostgresStore, lanes: &Arc<L>, slot: usize) -> Self {
        Self {
            lanes: lanes.clone(),
            store: store.clone(),
            slot,
            handed: false,
        }
    }

    /// Runs `work`, the lone statement. Unanswered for `STALLED`, it hands the slot over
    /// and waits on for its own answer. Pinned by the caller: taken by value, the
    /// statement's future would be held twice over in this one's (as the argument, and
    /// pinned), and every claim's and completion's future with it, kilobytes each.
    pub(super) async fn run<T>(&mut self, mut work: Pin<&mut impl Future<Output = T>>) -> T {
        match tokio::time::timeout(STALLED, work.as_mut()).await {
            Ok(done) => done,
            Err(_) => {
                self.hand_over();
                work.await
            }
        }
    }

    /// Hands the slot over: to a `drive` task if members are queued, else to the next
    /// to come. Only the first call does anything.
    fn hand_over(&mut self) {
        if std::mem::replace(&mut self.handed, true) || !self.lanes.keep_sending(self.slot) {
            return;
        }
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                let sending = Sending {
                    lanes: self.lanes.clone(),
                    slot: self.slot,
                    done: false,
                };
                let drive = self.lanes.clone().drive(self.store.clone(), sending);
                runtime.spawn(drive);
            }
            Err(_) => self.lanes.abandon(self.slot),
        }
    }
}

impl<L: Lanes> Drop for Lead<L> {
    fn drop(&mut self) {
        self.hand_over();
    }
}
