//! [`Renewal`]: a running claim's lease, renewed in a task of its own.
//!
//! A lease must outlive its handler for as long as the handler runs, however it runs.
//! Renewed from the future that polls the handler, it was renewed only while that
//! future was polled: a handler that blocks its thread (a blocking SDK call, bcrypt, a
//! PDF render, `block_in_place`) renewed nothing, its lease lapsed, and a retry took
//! the key over and ran the handler a second time. Here the renewals run in a task of
//! their own, on whatever worker is free, while the handler is still polled where it
//! was (the connection's task, or the job's).
//!
//! The layer's lease mode and [`JobRunner`](crate::job::JobRunner) start one renewal
//! when a claim is acquired, keep it through the handler (or the job's work) and the
//! first attempt to store the result, and stop it by dropping it.

use std::{
    future::Future,
    pin::{Pin, pin},
    sync::{
        Arc, Mutex, PoisonError,
        atomic::{AtomicBool, Ordering},
    },
    task::Poll,
    time::Duration,
};

use tokio::{sync::Notify, task::JoinHandle};
use tracing::Span;

use crate::store::{Fenced, Lease, Store};

/// Renews a lease every third of its duration, in a task of its own, until dropped.
///
/// - A renewal is bounded by the period (a third of the lease): one that gets no
///   answer by then is given up, and the next is sent at the next period. A slow or
///   stalled store delays renewals, never the handler.
/// - A renewal on its way when the renewal is dropped finishes in the task, unwatched:
///   dropped midway, it would close (and cancel on) a pooled connection that is fine.
/// - A renewal that finds the lease gone (taken over, released, completed) logs it
///   once, and renewals stop.
/// - A store that panics while it renews ends the task; the panic is raised again in
///   the future [`watch`](Self::watch) polls, as if that future had panicked, so that
///   its owner releases the key (the layer) or stops the work (a `JobRunner`).
///
/// Costs one task and one shared allocation per claim run.
pub(crate) struct Renewal {
    control: Arc<Control>,
    /// `None` outside a Tokio runtime, and once the task has ended.
    task: Option<JoinHandle<()>>,
    /// Whether the owner has let the task have its first poll (see `watch`).
    first_poll: bool,
}

/// What the owner of a [`Renewal`] shares with its task.
struct Control {
    /// Set, then notified, when the owner is done with the lease.
    stopped: AtomicBool,
    stop: Notify,
    /// The first attempt to store the result is on its way: a renewal that finds the
    /// lease gone may only have come after it landed, which the attempt reports itself.
    storing: AtomicBool,
    /// The owner's span (the request's, the job's), for the task's events; taken back
    /// when the owner is done, so that the task, which may run a moment longer, does
    /// not keep it open (its closing is when apps count the request's outcome).
    span: Mutex<Option<Span>>,
}

impl Control {
    /// Logs with `log` in the owner's span, while there is one.
    fn log(&self, log: impl FnOnce()) {
        let span = self
            .span
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        match span {
            Some(span) => span.in_scope(log),
            None => log(),
        }
    }
}

impl Renewal {
    /// Starts renewing `lease` for `duration` at a time, every third of `duration`.
    pub(crate) fn start(store: &Arc<dyn Store>, lease: &Lease, duration: Duration) -> Self {
        let control = Arc::new(Control {
            stopped: AtomicBool::new(false),
            stop: Notify::new(),
            storing: AtomicBool::new(false),
            span: Mutex::new(Some(Span::current())),
        });
        let task = match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                let renewing = renew(store.clone(), lease.clone(), duration, control.clone());
                Some(runtime.spawn(renewing))
            }
            Err(_) => {
                tracing::warn!(
                    token = %lease.token,
                    "outside a Tokio runtime the lease cannot be renewed; it lapses after its duration"
                );
                None
            }
        };
        Self {
            control,
            task,
            first_poll: false,
        }
    }

    /// From now on a lost lease means the result may just have been stored (see
    /// `Control::storing`): logged at `debug`, not as a lost result.
    pub(crate) fn storing(&self) {
        self.control.storing.store(true, Ordering::Relaxed);
    }

    /// Awaits `future`, polled here, raising in it a panic of the store while it renews
    /// (see [`Renewal`]). Renewals go on, whether or not `future` is polled.
    pub(crate) async fn watch<F: Future>(&mut self, future: F) -> F::Output {
        // The task was spawned from this worker, which keeps it in a slot of its own
        // that no other worker takes tasks from: a handler that blocked this worker
        // before the task first ran would hold it back for as long as it blocked, and
        // nothing would renew. Yielding once lets it run first (it then waits on its
        // timer, which wakes it on whichever worker is free).
        if !std::mem::replace(&mut self.first_poll, true) && self.task.is_some() {
            tokio::task::yield_now().await;
        }
        let mut future = pin!(future);
        std::future::poll_fn(|cx| {
            if let Poll::Ready(output) = future.as_mut().poll(cx) {
                return Poll::Ready(output);
            }
            if let Some(task) = &mut self.task
                && let Poll::Ready(ended) = Pin::new(task).poll(cx)
            {
                self.task = None;
                if let Err(e) = ended
                    && e.is_panic()
                {
                    std::panic::resume_unwind(e.into_panic());
                }
            }
            Poll::Pending
        })
        .await
    }
}

impl Drop for Renewal {
    fn drop(&mut self) {
        self.control.stopped.store(true, Ordering::Release);
        // Kept as a permit if the task is not waiting now: it stops when it next looks.
        self.control.stop.notify_one();
        let span = self
            .control
            .span
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        drop(span);
    }
}

/// The renewal task: renews every period until stopped, or until the lease is lost.
async fn renew(store: Arc<dyn Store>, lease: Lease, duration: Duration, control: Arc<Control>) {
    let period = duration / 3;
    let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            biased;
            () = control.stop.notified() => return,
            _ = ticker.tick() => {}
        }
        // Not raced against the stop: a renewal on its way finishes.
        let renewed =
            crate::store::within(period, "a lease renewal", store.renew(&lease, duration)).await;
        if control.stopped.load(Ordering::Acquire) {
            // Its owner is done with the lease, which may be stored or released by now.
            return;
        }
        match renewed {
            Ok(Fenced::Kept) => {}
            Ok(Fenced::LeaseLost) => {
                control.log(|| {
                    if control.storing.load(Ordering::Relaxed) {
                        tracing::debug!(
                            token = %lease.token,
                            "a renewal found the lease gone while the result was being stored (the result may just have landed)"
                        );
                    } else {
                        tracing::warn!(
                            token = %lease.token,
                            "the lease was lost while the handler ran; its result will not be stored"
                        );
                    }
                });
                return;
            }
            Err(e) => {
                crate::observe::store_failed("renew");
                control.log(|| tracing::warn!(error = %e, "lease renewal failed"));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use super::*;
    use crate::{
        StoredResponse,
        store::{BoxFuture, Claim, ClaimRequest, MemoryStore, StoreError},
    };

    /// A memory store that counts renewals, and holds each until `gate` lets it go.
    #[derive(Default)]
    struct Gated {
        inner: MemoryStore,
        started: AtomicUsize,
        answered: AtomicUsize,
        gate: Notify,
    }

    impl Store for Gated {
        fn claim<'a>(
            &'a self,
            request: &'a ClaimRequest<'a>,
        ) -> BoxFuture<'a, Result<Claim, StoreError>> {
            self.inner.claim(request)
        }

        fn complete<'a>(
            &'a self,
            lease: &'a Lease,
            response: &'a StoredResponse,
            ttl: Duration,
        ) -> BoxFuture<'a, Result<Fenced, StoreError>> {
            self.inner.complete(lease, response, ttl)
        }

        fn release<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, Result<Fenced, StoreError>> {
            self.inner.release(lease)
        }

        fn purge<'a>(&'a self, batch: usize) -> BoxFuture<'a, Result<u64, StoreError>> {
            self.inner.purge(batch)
        }

        fn renew<'a>(
            &'a self,
            lease: &'a Lease,
            duration: Duration,
        ) -> BoxFuture<'a, Result<Fenced, StoreError>> {
            Box::pin(async move {
                self.started.fetch_add(1, Ordering::SeqCst);
                self.gate.notified().await;
                let renewed = self.inner.renew(lease, duration).await;
                self.answered.fetch_add(1, Ordering::SeqCst);
                renewed
            })
        }
    }

    async fn claimed(store: &Arc<Gated>) -> Lease {
        let scope = crate::Scope::anonymous();
        let request = ClaimRequest {
            scope: &scope,
            key: "k",
            fingerprint: crate::Fingerprint::new([0; 32]),
            lease: Duration::from_secs(30),
            ttl: Duration::from_secs(60),
        };
        match store.claim(&request).await {
            Ok(Claim::Acquired(lease)) => lease,
            other => panic!("not acquired: {other:?}"),
        }
    }

    async fn until(f: impl Fn() -> bool) {
        while !f() {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_renewal_on_its_way_when_dropped_finishes_and_no_other_starts() {
        let store = Arc::new(Gated::default());
        let lease = claimed(&store).await;
        let dynamic: Arc<dyn Store> = store.clone();
        let renewal = Renewal::start(&dynamic, &lease, Duration::from_secs(3));
        until(|| store.started.load(Ordering::SeqCst) == 1).await;
        drop(renewal);
        store.gate.notify_one();
        until(|| store.answered.load(Ordering::SeqCst) == 1).await;
        tokio::time::sleep(Duration::from_secs(10)).await;
        assert_eq!(
            store.started.load(Ordering::SeqCst),
            1,
            "renewed after the drop"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn renewals_go_on_while_the_watched_future_is_not_polled() {
        let store = Arc::new(Gated::default());
        let lease = claimed(&store).await;
        let dynamic: Arc<dyn Store> = store.clone();
        let renewal = Renewal::start(&dynamic, &lease, Duration::from_secs(3));
        // Nothing watches: each renewal is answered and the next one sent on time.
        for n in 1..=3 {
            until(|| store.started.load(Ordering::SeqCst) == n).await;
            store.gate.notify_one();
            until(|| store.answered.load(Ordering::SeqCst) == n).await;
        }
        drop(renewal);
    }

    #[tokio::test]
    async fn a_store_that_panics_while_it_renews_panics_the_watched_future() {
        struct Panicking(MemoryStore);
        impl Store for Panicking {
            fn claim<'a>(
                &'a self,
                request: &'a ClaimRequest<'a>,
            ) -> BoxFuture<'a, Result<Claim, StoreError>> {
                self.0.claim(request)
            }
            fn complete<'a>(
                &'a self,
                lease: &'a Lease,
                response: &'a StoredResponse,
                ttl: Duration,
            ) -> BoxFuture<'a, Result<Fenced, StoreError>> {
                self.0.complete(lease, response, ttl)
            }
            fn release<'a>(
                &'a self,
                lease: &'a Lease,
            ) -> BoxFuture<'a, Result<Fenced, StoreError>> {
                self.0.release(lease)
            }
            fn purge<'a>(&'a self, batch: usize) -> BoxFuture<'a, Result<u64, StoreError>> {
                self.0.purge(batch)
            }
            fn renew<'a>(
                &'a self,
                _: &'a Lease,
                _: Duration,
            ) -> BoxFuture<'a, Result<Fenced, StoreError>> {
                panic!("the store broke while renewing")
            }
        }
        let store: Arc<dyn Store> = Arc::new(Panicking(MemoryStore::new()));
        let lease = Lease {
            scope: crate::Scope::anonymous(),
            key: Arc::from("k"),
            token: crate::store::FencingToken::new(1),
        };
        let mut renewal = Renewal::start(&store, &lease, Duration::from_millis(30));
        let watched = crate::catch_panic::catch_panic(renewal.watch(std::future::pending::<()>()));
        let panic = watched
            .await
            .expect_err("the renewal's panic reaches the watched future");
        assert_eq!(
            crate::catch_panic::message(&panic),
            "the store broke while renewing"
        );
    }
}
