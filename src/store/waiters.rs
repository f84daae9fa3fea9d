//! Requests waiting for keys to change, woken by key.
//!
//! A completion or a release wakes the requests waiting on its key, and no other: with
//! thousands of keys waited on at once (clients retrying after an outage), each change
//! costs a map lookup, not a wake-up of every waiter. Nothing stays behind once a key's
//! last waiter goes, so the map holds only keys being waited on now.

use std::{
    borrow::Borrow,
    collections::HashMap,
    future::Future,
    hash::Hash,
    sync::{Arc, Mutex, MutexGuard, PoisonError},
};

use tokio::sync::Notify;

/// The keys being waited on, each with the requests waiting on it.
pub(crate) struct Waiters<K> {
    keys: Mutex<HashMap<K, Waiting>>,
}

struct Waiting {
    notify: Arc<Notify>,
    count: usize,
}

impl<K> Default for Waiters<K> {
    fn default() -> Self {
        Self {
            keys: Mutex::new(HashMap::new()),
        }
    }
}

impl<K: Hash + Eq + Clone + Send + Sync + 'static> Waiters<K> {
    fn keys(&self) -> MutexGuard<'_, HashMap<K, Waiting>> {
        self.keys.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A future that resolves at the next [`wake`](Self::wake) of `key`, or the next
    /// [`wake_all`](Self::wake_all), counted from now, not from its first poll: a
    /// change between this call and the first poll is not missed.
    pub(crate) fn wait(self: &Arc<Self>, key: K) -> impl Future<Output = ()> + Send + 'static {
        let notified = {
            let mut keys = self.keys();
            let waiting = keys.entry(key.clone()).or_insert_with(|| Waiting {
                notify: Arc::default(),
                count: 0,
            });
            waiting.count += 1;
            // Receives every `notify_waiters` from its creation on.
            waiting.notify.clone().notified_owned()
        };
        let registered = Registered {
            waiters: self.clone(),
            key,
        };
        async move {
            let _registered = registered;
            notified.await;
        }
    }

    /// Wakes every request waiting on `key`.
    ///
    /// Woken outside the lock, so that no waker runs while it is held: a request that
    /// registers between the two is woken too, for nothing, and one whose key went
    /// meanwhile is not there to wake.
    pub(crate) fn wake<Q>(&self, key: &Q)
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let notify = self.keys().get(key).map(|waiting| waiting.notify.clone());
        if let Some(notify) = notify {
            notify.notify_waiters();
        }
    }

    /// Wakes every waiting request, whatever its key (outside the lock, as `wake`).
    #[cfg(any(test, feature = "postgres"))]
    pub(crate) fn wake_all(&self) {
        let all: Vec<_> = self
            .keys()
            .values()
            .map(|waiting| waiting.notify.clone())
            .collect();
        for notify in all {
            notify.notify_waiters();
        }
    }

    /// How many keys are being waited on.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.keys().len()
    }
}

/// Takes a waiting request off its key's count when it is done or dropped; the key goes
/// with its last waiter.
struct Registered<K: Hash + Eq + Clone + Send + Sync + 'static> {
    waiters: Arc<Waiters<K>>,
    key: K,
}

impl<K: Hash + Eq + Clone + Send + Sync + 'static> Drop for Registered<K> {
    fn drop(&mut self) {
        let mut keys = self.waiters.keys();
        if let Some(waiting) = keys.get_mut(&self.key) {
            waiting.count -= 1;
            if waiting.count == 0 {
                keys.remove(&self.key);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::{
        pin::Pin,
        sync::atomic::{AtomicUsize, Ordering},
        task::{Context, Poll, Wake, Waker},
    };

    use super::*;

    /// Counts the times it is woken.
    #[derive(Default)]
    struct Counting(AtomicUsize);

    impl Wake for Counting {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    type Wait = Pin<Box<dyn Future<Output = ()> + Send>>;

    fn poll(wait: &mut Wait, waker: &Arc<Counting>) -> Poll<()> {
        let waker = Waker::from(waker.clone());
        wait.as_mut().poll(&mut Context::from_waker(&waker))
    }

    /// Waits on `n` keys, `k0` to `k{n-1}`, each polled once with a waker of its own.
    fn waiting_on(waiters: &Arc<Waiters<String>>, n: usize) -> Vec<(Wait, Arc<Counting>)> {
        (0..n)
            .map(|i| {
                let mut wait: Wait = Box::pin(waiters.wait(format!("k{i}")));
                let waker = Arc::new(Counting::default());
                assert!(poll(&mut wait, &waker).is_pending());
                (wait, waker)
            })
            .collect()
    }

    fn woken(waits: &[(Wait, Arc<Counting>)]) -> usize {
        waits
            .iter()
            .map(|(_, waker)| waker.0.load(Ordering::SeqCst))
            .sum()
    }

    #[test]
    fn a_change_wakes_the_waiters_of_its_key_alone() {
        let waiters = Arc::new(Waiters::default());
        let mut waits = waiting_on(&waiters, 1000);
        waiters.wake("k7");
        assert_eq!(woken(&waits), 1);
        let (wait, waker) = &mut waits[7];
        assert!(poll(wait, waker).is_ready());
        // A key nobody waits on wakes nobody.
        waiters.wake("k1000");
        assert_eq!(woken(&waits), 1);
    }

    #[test]
    fn every_waiter_on_a_key_is_woken() {
        let waiters = Arc::new(Waiters::default());
        let mut waits: Vec<_> = (0..3)
            .map(|_| {
                let mut wait: Wait = Box::pin(waiters.wait("k".to_owned()));
                let waker = Arc::new(Counting::default());
                assert!(poll(&mut wait, &waker).is_pending());
                (wait, waker)
            })
            .collect();
        waiters.wake("k");
        for (wait, waker) in &mut waits {
            assert!(poll(wait, waker).is_ready());
        }
    }

    #[test]
    fn a_change_before_the_first_poll_is_not_missed() {
        let waiters = Arc::new(Waiters::default());
        let mut wait: Wait = Box::pin(waiters.wait("k".to_owned()));
        waiters.wake("k");
        assert!(poll(&mut wait, &Arc::default()).is_ready());
        // A change before the wait began is not its business.
        waiters.wake("j");
        let mut later: Wait = Box::pin(waiters.wait("j".to_owned()));
        assert!(poll(&mut later, &Arc::default()).is_pending());
    }

    #[test]
    fn wake_all_wakes_every_key() {
        let waiters = Arc::new(Waiters::default());
        let mut waits = waiting_on(&waiters, 50);
        waiters.wake_all();
        assert_eq!(woken(&waits), 50);
        for (wait, waker) in &mut waits {
            assert!(poll(wait, waker).is_ready());
        }
    }

    #[test]
    fn keys_go_with_their_last_waiter() {
        let waiters = Arc::new(Waiters::default());
        let mut waits = waiting_on(&waiters, 100);
        let again: Wait = Box::pin(waiters.wait("k0".to_owned()));
        assert_eq!(waiters.len(), 100);
        // Done (woken and finished) or dropped unfinished, alike.
        waiters.wake("k1");
        let (wait, waker) = &mut waits[1];
        assert!(poll(wait, waker).is_ready());
        drop(waits);
        assert_eq!(waiters.len(), 1, "k0 still has a waiter");
        drop(again);
        assert_eq!(waiters.len(), 0);
    }
}
