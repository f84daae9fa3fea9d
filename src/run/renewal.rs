//! [`Renewal`]: a running claim's lease, renewed by a task shared with every other
//! running claim of the layer (or job runner) on the same runtime.
//!
//! A lease must outlive its handler for as long as the handler runs, however it runs.
//! Renewed from the future that polls the handler, it was renewed only while that
//! future was polled: a handler that blocks its thread (a blocking SDK call, bcrypt, a
//! PDF render, `block_in_place`) renewed nothing, its lease lapsed, and a retry took
//! the key over and ran the handler a second time. Here the renewals are sent by a
//! task of their own (the runner), on whatever worker is free, while the handler is
//! still polled where it was (the connection's task, or the job's).
//!
//! One runner per runtime serves all of a layer's running claims: a claim registers
//! its lease ([`Renewal::start`], a lock and an insert) and takes it back when it is
//! done (dropping the [`Renewal`]). The runner sleeps until the earliest renewal is
//! due, at most one period (a third of the shortest lease it has served) at a time,
//! and sends each due renewal in a task of its own. Most claims end before their first
//! renewal is due, and they cost no task, no timer and no wake-up.
//!
//! The layer's lease mode and [`JobRunner`](crate::job::JobRunner) start one renewal
//! when a claim is acquired, keep it through the handler (or the job's work) and the
//! first attempt to store the result, and stop it by dropping it.

use std::{
    collections::HashMap,
    future::Future,
    pin::pin,
    sync::{
        Arc, Mutex, MutexGuard, PoisonError, Weak,
        atomic::{AtomicBool, Ordering},
    },
    task::{Poll, Waker},
    time::Duration,
};

use tokio::{
    runtime::{self, Handle},
    task::JoinHandle,
    time::Instant,
};
use tracing::Span;

use crate::{
    catch_panic::{Panicked, catch_panic},
    store::{Fenced, Lease, Store},
};

/// The renewals of one layer's (or job runner's) running claims, and the runners that
/// send them, one per runtime the claims run on. Cloning it shares them.
#[derive(Clone, Default)]
pub(crate) struct Renewals(Arc<Hub>);

#[derive(Default)]
struct Hub(Mutex<Registered>);

/// What a [`Hub`] holds under its lock.
#[derive(Default)]
struct Registered {
    /// Numbers the registrations, and the runners.
    next: u64,
    leases: HashMap<u64, Entry>,
    runners: Vec<Runner>,
}

/// A running claim's lease, as its runner sees it.
struct Entry {
    control: Arc<Control>,
    runtime: runtime::Id,
    /// When its next renewal is to be sent.
    due: Instant,
    /// A renewal of it is on its way: the runner sends no second one meanwhile.
    sending: bool,
}

/// A lease whose renewal is due: its registration, and what renews it.
type Due = (u64, Arc<Control>);

/// The task that sends the renewals of the claims on one runtime.
struct Runner {
    runtime: runtime::Id,
    /// Its number: a runner replaced by another, or ended, finds it gone and stops.
    number: u64,
    /// It wakes at least this often: the shortest period of the leases it has served,
    /// so that a lease registered while it sleeps is never due before it wakes.
    period: Duration,
    task: JoinHandle<()>,
}

impl Hub {
    fn lock(&self) -> MutexGuard<'_, Registered> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Renews a lease every third of its duration until dropped, from the layer's runner
/// (see the [module](self)), never from the future that polls the handler.
///
/// - A renewal is bounded by the period (a third of the lease): one that gets no
///   answer by then is given up, and the next, due by then, is sent at once. A slow or
///   stalled store delays renewals, never the handler.
/// - A renewal found due as the owner drops the `Renewal` is not sent.
/// - A renewal on its way when the renewal is dropped finishes in its task, unwatched:
///   dropped midway, it would close (and cancel on) a pooled connection that is fine.
/// - A renewal that finds the lease gone (taken over, released, completed) logs it
///   once, and renewals stop.
/// - A store that panics while it renews stops the renewals; the panic is raised again
///   in the future [`watch`](Self::watch) polls, as if that future had panicked, so
///   that its owner releases the key (the layer) or stops the work (a `JobRunner`).
///
/// Costs one shared allocation per claim run, and a task only when a renewal is due
/// (or the runtime has no runner yet).
pub(crate) struct Renewal {
    /// `None` outside a Tokio runtime: nothing renews the lease.
    hub: Option<Arc<Hub>>,
    id: u64,
    control: Arc<Control>,
    /// This start spawned the runner, which must have its first poll before the
    /// handler's (see `watch`).
    spawned: bool,
}

/// What the owner of a [`Renewal`] shares with the runner and the renewals it sends.
struct Control {
    store: Arc<dyn Store>,
    lease: Lease,
    duration: Duration,
    /// Set when the owner is done with the lease.
    stopped: AtomicBool,
    /// The first attempt to store the result is on its way: a renewal that finds the
    /// lease gone may only have come after it landed, which the attempt reports itself.
    storing: AtomicBool,
    /// A panic of the store while it renewed, for the watched future to raise.
    panic: Mutex<Raised>,
    /// The owner's span (the request's, the job's), for the renewals' events; taken
    /// back when the owner is done, so that a renewal that runs a moment longer does
    /// not keep it open (its closing is when apps count the request's outcome).
    span: Mutex<Option<Span>>,
}

#[derive(Default)]
struct Raised {
    panic: Option<Panicked>,
    /// The watched future's waker, woken when a panic is left here.
    waker: Option<Waker>,
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

    fn period(&self) -> Duration {
        self.duration / 3
    }

    fn raised(&self) -> MutexGuard<'_, Raised> {
        self.panic.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Renewal {
    /// Starts renewing `lease` in `store` for `duration` at a time, every third of
    /// `duration`, from `renewals`' runner on the current runtime.
    pub(crate) fn start(
        renewals: &Renewals,
        store: &Arc<dyn Store>,
        lease: &Lease,
        duration: Duration,
    ) -> Self {
        let control = Arc::new(Control {
            store: store.clone(),
            lease: lease.clone(),
            duration,
            stopped: AtomicBool::new(false),
            storing: AtomicBool::new(false),
            panic: Mutex::default(),
            span: Mutex::new(Some(Span::current())),
        });
        let Ok(runtime) = Handle::try_current() else {
            tracing::warn!(
                token = %lease.token,
                "outside a Tokio runtime the lease cannot be renewed; it lapses after its duration"
            );
            return Self {
                hub: None,
                id: 0,
                control,
                spawned: false,
            };
        };
        let hub = &renewals.0;
        let period = control.period();
        let mut registered = hub.lock();
        let id = registered.next;
        registered.next += 1;
        registered.leases.insert(
            id,
            Entry {
                control: control.clone(),
                runtime: runtime.id(),
                due: Instant::now() + period,
                sending: false,
            },
        );
        let spawned = registered.run_on(hub, &runtime, period);
        drop(registered);
        Self {
            hub: Some(hub.clone()),
            id,
            control,
            spawned,
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
        // A runner just spawned from this worker is kept in a slot of the worker's own
        // that no other worker takes tasks from: a handler that blocked this worker
        // before the runner first ran would hold it back for as long as it blocked, and
        // nothing would renew. Yielding once lets it run first (it then waits on its
        // timer, which wakes it on whichever worker is free).
        if std::mem::replace(&mut self.spawned, false) {
            tokio::task::yield_now().await;
        }
        let watching = self.hub.is_some();
        let mut future = pin!(future);
        std::future::poll_fn(|cx| {
            if let Poll::Ready(output) = future.as_mut().poll(cx) {
                return Poll::Ready(output);
            }
            if watching {
                let mut raised = self.control.raised();
                if let Some(panic) = raised.panic.take() {
                    drop(raised);
                    std::panic::resume_unwind(panic);
                }
                match &mut raised.waker {
                    Some(waker) if waker.will_wake(cx.waker()) => {}
                    waker => *waker = Some(cx.waker().clone()),
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
        if let Some(hub) = &self.hub {
            hub.lock().leases.remove(&self.id);
        }
        let span = self
            .control
            .span
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        drop(span);
    }
}

impl Registered {
    /// Makes sure a runner serves `runtime`, waking at least every `period`; whether it
    /// had to spawn one. A runner that wakes less often is replaced: a lease of this
    /// period, due before it wakes, would be renewed late.
    fn run_on(&mut self, hub: &Arc<Hub>, runtime: &Handle, period: Duration) -> bool {
        // Those of runtimes shut down are done.
        self.runners.retain(|runner| !runner.task.is_finished());
        let id = runtime.id();
        let period = match self.runners.iter().position(|r| r.runtime == id) {
            Some(at) if self.runners[at].period <= period => return false,
            Some(at) => {
                let slower = self.runners.swap_remove(at);
                slower.task.abort();
                period
            }
            None => period,
        };
        let number = self.next;
        self.next += 1;
        let task = runtime.spawn(run(Arc::downgrade(hub), id, number));
        self.runners.push(Runner {
            runtime: id,
            number,
            period,
            task,
        });
        true
    }

    /// Marks the leases on `runtime` due by `now` as being renewed, and returns them
    /// with when the runner `number` is to wake next; `None` if it is to stop: replaced,
    /// or no lease left to renew (a lease registered later spawns another).
    fn due(
        &mut self,
        runtime: runtime::Id,
        number: u64,
        now: Instant,
    ) -> Option<(Vec<Due>, Instant)> {
        let at = self.runners.iter().position(|r| r.number == number)?;
        let mut wake = now + self.runners[at].period;
        let mut due = Vec::new();
        let mut any = false;
        for (id, entry) in &mut self.leases {
            if entry.runtime != runtime {
                continue;
            }
            any = true;
            if entry.sending {
                // Its task sets the next one.
                continue;
            }
            if entry.due <= now {
                entry.sending = true;
                entry.due = now + entry.control.period();
                due.push((*id, entry.control.clone()));
            } else {
                wake = wake.min(entry.due);
            }
        }
        if !any {
            self.runners.swap_remove(at);
            return None;
        }
        Some((due, wake))
    }
}

/// A runner: sends the renewals due on `runtime` and sleeps until the next, until no
/// lease is left there, it is replaced, or its layer is gone.
async fn run(hub: Weak<Hub>, runtime: runtime::Id, number: u64) {
    loop {
        let wake = {
            let Some(hub) = hub.upgrade() else { return };
            let Some((due, wake)) = hub.lock().due(runtime, number, Instant::now()) else {
                return;
            };
            for (id, control) in due {
                tokio::spawn(renew(Arc::downgrade(&hub), id, control));
            }
            wake
        };
        tokio::time::sleep_until(wake).await;
    }
}

/// Sends the renewals of the lease registered as `id`: one, and another at once each
/// time the next fell due while it was on its way (one that went unanswered for its
/// whole period, given up on): as a missed tick of a timer, not a period later, when
/// the lease may be ending.
async fn renew(hub: Weak<Hub>, id: u64, control: Arc<Control>) {
    let period = control.period();
    loop {
        if control.stopped.load(Ordering::Acquire) {
            // Its owner dropped it after the runner found it due: nothing to renew.
            return;
        }
        // Not raced against the owner's drop: a renewal on its way finishes.
        let renewed = catch_panic(crate::store::within(period, "a lease renewal", async {
            control.store.renew(&control.lease, control.duration).await
        }))
        .await;
        let lost = match &renewed {
            Ok(Ok(Fenced::Kept) | Err(_)) => false,
            Ok(Ok(Fenced::LeaseLost)) | Err(_) => true,
        };
        let again = match hub.upgrade() {
            Some(hub) => {
                let mut registered = hub.lock();
                if lost {
                    registered.leases.remove(&id);
                    false
                } else if let Some(entry) = registered.leases.get_mut(&id) {
                    let now = Instant::now();
                    if entry.due <= now {
                        // Still marked sending, so that the runner sends no other.
                        entry.due = now + period;
                        true
                    } else {
                        entry.sending = false;
                        false
                    }
                } else {
                    false
                }
            }
            None => false,
        };
        if control.stopped.load(Ordering::Acquire) {
            // Its owner is done with the lease, which may be stored or released by now.
            return;
        }
        match renewed {
            Ok(Ok(Fenced::Kept)) => {}
            Ok(Ok(Fenced::LeaseLost)) => control.log(|| {
                if control.storing.load(Ordering::Relaxed) {
                    tracing::debug!(
                        token = %control.lease.token,
                        "a renewal found the lease gone while the result was being stored (the result may just have landed)"
                    );
                } else {
                    tracing::warn!(
                        token = %control.lease.token,
                        "the lease was lost while the handler ran; its result will not be stored"
                    );
                }
            }),
            Ok(Err(e)) => {
                crate::observe::store_failed("renew");
                control.log(|| tracing::warn!(error = %e, "lease renewal failed"));
            }
            Err(panic) => {
                let waker = {
                    let mut raised = control.raised();
                    raised.panic = Some(panic);
                    raised.waker.take()
                };
                if let Some(waker) = waker {
                    waker.wake();
                }
            }
        }
        if !again {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use tokio::sync::Notify;

    use super::*;
    use crate::{
        StoredResponse,
        store::{BoxFuture, Claim, ClaimRequest, MemoryStore, StoreError},
    };

    /// A memory store that counts the renewals of each key as they are sent, and answers
    /// them as told: each held until `gate` lets it go, the first never, or none at all
    /// (a panic).
    #[derive(Default)]
    struct Probe {
        inner: MemoryStore,
        renewed: Mutex<HashMap<String, usize>>,
        answered: AtomicUsize,
        gated: bool,
        gate: Notify,
        first_stalls: bool,
        panics: bool,
    }

    impl Probe {
        fn gated() -> Self {
            Self {
                gated: true,
                ..Self::default()
            }
        }

        fn first_stalls() -> Self {
            Self {
                first_stalls: true,
                ..Self::default()
            }
        }

        fn panicking() -> Self {
            Self {
                panics: true,
                ..Self::default()
            }
        }

        fn renewals_of(&self, key: &str) -> usize {
            self.renewed.lock().unwrap().get(key).copied().unwrap_or(0)
        }

        fn answered(&self) -> usize {
            self.answered.load(Ordering::SeqCst)
        }

        async fn claimed(&self, key: &str) -> Lease {
            let scope = crate::Scope::anonymous();
            let request = ClaimRequest {
                scope: &scope,
                key,
                fingerprint: crate::Fingerprint::new([0; 32]),
                lease: Duration::from_secs(30),
                ttl: Duration::from_secs(60),
            };
            match self.inner.claim(&request).await {
                Ok(Claim::Acquired(lease)) => lease,
                other => panic!("not acquired: {other:?}"),
            }
        }
    }

    impl Store for Probe {
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
            if self.panics {
                panic!("the store broke while renewing");
            }
            let sent = {
                let mut renewed = self.renewed.lock().unwrap();
                let sent = renewed.entry(lease.key.to_string()).or_default();
                *sent += 1;
                *sent
            };
            Box::pin(async move {
                if self.first_stalls && sent == 1 {
                    std::future::pending::<()>().await;
                }
                if self.gated {
                    self.gate.notified().await;
                }
                let renewed = self.inner.renew(lease, duration).await;
                self.answered.fetch_add(1, Ordering::SeqCst);
                renewed
            })
        }
    }

    async fn until(f: impl Fn() -> bool) {
        while !f() {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_renewal_on_its_way_when_dropped_finishes_and_no_other_starts() {
        let store = Arc::new(Probe::gated());
        let lease = store.claimed("k").await;
        let dynamic: Arc<dyn Store> = store.clone();
        let renewal = Renewal::start(
            &Renewals::default(),
            &dynamic,
            &lease,
            Duration::from_secs(3),
        );
        until(|| store.renewals_of("k") == 1).await;
        drop(renewal);
        store.gate.notify_one();
        until(|| store.answered() == 1).await;
        tokio::time::sleep(Duration::from_secs(10)).await;
        assert_eq!(store.renewals_of("k"), 1, "renewed after the drop");
    }

    #[tokio::test(start_paused = true)]
    async fn renewals_go_on_while_the_watched_future_is_not_polled() {
        let store = Arc::new(Probe::gated());
        let lease = store.claimed("k").await;
        let dynamic: Arc<dyn Store> = store.clone();
        let renewal = Renewal::start(
            &Renewals::default(),
            &dynamic,
            &lease,
            Duration::from_secs(3),
        );
        // Nothing watches: each renewal is answered and the next one sent on time.
        for n in 1..=3 {
            until(|| store.renewals_of("k") == n).await;
            store.gate.notify_one();
            until(|| store.answered() == n).await;
        }
        drop(renewal);
    }

    fn alive_tasks() -> usize {
        tokio::runtime::Handle::current()
            .metrics()
            .num_alive_tasks()
    }

    #[tokio::test(start_paused = true)]
    async fn many_running_claims_share_one_task_and_each_is_renewed_every_period() {
        let store = Arc::new(Probe::default());
        let dynamic: Arc<dyn Store> = store.clone();
        let renewals = Renewals::default();
        let before = alive_tasks();
        let mut running = Vec::new();
        for n in 0..50 {
            let lease = store.claimed(&format!("k{n}")).await;
            running.push(Renewal::start(
                &renewals,
                &dynamic,
                &lease,
                Duration::from_secs(3),
            ));
        }
        assert_eq!(alive_tasks(), before + 1, "one runner for all the claims");
        // Periods of 1 s: renewed at 1, 2 and 3 s.
        tokio::time::sleep(Duration::from_millis(3500)).await;
        for n in 0..50 {
            assert_eq!(store.renewals_of(&format!("k{n}")), 3, "k{n}");
        }
        drop(running);
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert_eq!(store.renewals_of("k0"), 3, "renewed after the drop");
        // With no lease left to renew, the runner has stopped.
        assert_eq!(alive_tasks(), before);
    }

    #[tokio::test(start_paused = true)]
    async fn leases_registered_while_the_runner_sleeps_are_renewed_on_time() {
        let store = Arc::new(Probe::default());
        let dynamic: Arc<dyn Store> = store.clone();
        let renewals = Renewals::default();
        let long = store.claimed("long").await;
        let _long = Renewal::start(&renewals, &dynamic, &long, Duration::from_secs(30));
        tokio::time::sleep(Duration::from_millis(500)).await;
        // Registered while the runner sleeps until the long lease's first renewal, 10 s
        // away, with a period of its own of 1 s.
        let short = store.claimed("short").await;
        let _short = Renewal::start(&renewals, &dynamic, &short, Duration::from_secs(3));
        tokio::time::sleep(Duration::from_millis(200)).await;
        let same = store.claimed("same").await;
        let _same = Renewal::start(&renewals, &dynamic, &same, Duration::from_secs(3));
        // At 1.5 s `short` (due at 1.5 s) was just renewed, `same` (1.7 s) not yet.
        tokio::time::sleep(Duration::from_millis(850)).await;
        assert_eq!(
            (store.renewals_of("short"), store.renewals_of("same")),
            (1, 0)
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(
            (store.renewals_of("short"), store.renewals_of("same")),
            (1, 1)
        );
        tokio::time::sleep(Duration::from_secs(9)).await;
        assert_eq!(store.renewals_of("long"), 1, "renewed at 10 s");
        assert_eq!(store.renewals_of("short"), 10, "renewed every second");
    }

    /// A renewal given up on after its period (the store stalled) is followed at once by
    /// the next, as a timer's missed tick: a period later, the lease would be ending.
    #[tokio::test(start_paused = true)]
    async fn after_a_renewal_given_up_on_the_next_is_sent_at_once() {
        let store = Arc::new(Probe::first_stalls());
        let dynamic: Arc<dyn Store> = store.clone();
        let renewals = Renewals::default();
        let lease = store.claimed("k").await;
        let _renewal = Renewal::start(&renewals, &dynamic, &lease, Duration::from_secs(3));
        // Sent at 1 s, given up on at 2 s; the next sent then, not at 3 s.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        assert_eq!(store.renewals_of("k"), 1);
        tokio::time::sleep(Duration::from_millis(700)).await;
        assert_eq!(store.renewals_of("k"), 2, "the next was not sent at once");
        // And the ones after, every period from there.
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert_eq!(store.renewals_of("k"), 3);
    }

    #[tokio::test(start_paused = true)]
    async fn a_runner_that_stopped_is_started_again_for_the_next_claim() {
        let store = Arc::new(Probe::default());
        let dynamic: Arc<dyn Store> = store.clone();
        let renewals = Renewals::default();
        let before = alive_tasks();
        let first = store.claimed("first").await;
        drop(Renewal::start(
            &renewals,
            &dynamic,
            &first,
            Duration::from_secs(3),
        ));
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_eq!(alive_tasks(), before, "the idle runner stopped");
        let second = store.claimed("second").await;
        let _second = Renewal::start(&renewals, &dynamic, &second, Duration::from_secs(3));
        tokio::time::sleep(Duration::from_millis(2500)).await;
        assert_eq!(store.renewals_of("second"), 2);
        assert_eq!(store.renewals_of("first"), 0);
    }

    /// Claims of one layer run on two runtimes: each runtime has a runner of its own
    /// (a runner on the other, not driven here, renews nothing), and a runtime's
    /// claims go on being renewed once the other has shut down.
    #[test]
    fn each_runtime_has_a_runner_of_its_own() {
        let runtime = || {
            tokio::runtime::Builder::new_current_thread()
                .enable_time()
                .build()
                .unwrap()
        };
        let (a, b) = (runtime(), runtime());
        let store = Arc::new(Probe::default());
        let dynamic: Arc<dyn Store> = store.clone();
        let renewals = Renewals::default();
        let start = |key: &'static str| {
            let (store, dynamic, renewals) = (&store, &dynamic, &renewals);
            async move {
                let lease = store.claimed(key).await;
                Renewal::start(renewals, dynamic, &lease, Duration::from_millis(30))
            }
        };
        // Periods of 10 ms; bounded, so that a broken runner fails the test, not hangs it.
        let renewed_twice = |key: &'static str| {
            let store = &store;
            async move {
                let twice = async {
                    while store.renewals_of(key) < 2 {
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                };
                tokio::time::timeout(Duration::from_secs(10), twice).await
            }
        };
        let on_a = a.block_on(start("a"));
        b.block_on(async {
            let _on_b = start("b").await;
            renewed_twice("b").await.expect("b renewed on its runtime");
        });
        assert_eq!(
            store.renewals_of("a"),
            0,
            "renewed on a runtime not running"
        );
        drop(on_a);
        drop(a);
        b.block_on(async {
            let _on_c = start("c").await;
            renewed_twice("c")
                .await
                .expect("c renewed once the other runtime is gone");
        });
    }

    #[tokio::test]
    async fn a_store_that_panics_while_it_renews_panics_the_watched_future() {
        let store: Arc<dyn Store> = Arc::new(Probe::panicking());
        let lease = Lease {
            scope: crate::Scope::anonymous(),
            key: Arc::from("k"),
            token: crate::store::FencingToken::new(1),
        };
        let mut renewal = Renewal::start(
            &Renewals::default(),
            &store,
            &lease,
            Duration::from_millis(30),
        );
        let watched = crate::catch_panic::catch_panic(renewal.watch(std::future::pending::<()>()));
        let panic = tokio::time::timeout(Duration::from_secs(10), watched)
            .await
            .expect("the panic raised within 10 s")
            .expect_err("the renewal's panic reaches the watched future");
        assert_eq!(
            crate::catch_panic::message(&panic),
            "the store broke while renewing"
        );
    }
}
