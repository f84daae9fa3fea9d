//! The layer suite, against each store.

mod common;

mod memory {
    use std::sync::Arc;

    use tower_idempotency::store::{MemoryStore, Store};

    async fn make() -> (Arc<dyn Store>, ()) {
        (Arc::new(MemoryStore::new()), ())
    }

    crate::layer_suite!(make);

    /// A handler that blocks its worker outright (`std::thread::sleep`, a blocking call
    /// without `block_in_place`) keeps its lease too: the renewing task, spawned on that
    /// worker for the layer's first claim, runs once before the handler is first polled,
    /// and its timer wakes it on another worker from then on. (On this store a renewal needs nothing else; a
    /// database's connection tasks queued on the blocked worker can be held up with it,
    /// which is why blocking calls belong in `block_in_place` or `spawn_blocking`.)
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_handler_that_blocks_its_worker_outright_keeps_its_lease() {
        let layer = tower_idempotency::IdempotencyLayer::new(MemoryStore::new());
        crate::common::a_blocked_handler_keeps_its_lease(layer, false).await;
    }

    /// The same, while another claim of the layer runs under a lease of the same
    /// length: the blocked handler's lease joins the renewals of the task already
    /// running (no task is spawned for it, nothing yields), asleep on its timer, which
    /// wakes it on another worker.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_handler_that_blocks_its_worker_outright_keeps_its_lease_beside_a_running_claim() {
        use std::time::Duration;

        use crate::common::{app, eventually, post_with_headers, send};

        let layer = tower_idempotency::IdempotencyLayer::new(MemoryStore::new())
            .lease_duration(Duration::from_millis(300));
        let (router, counter) = app(layer.clone());
        let held = tokio::spawn(async move {
            send(&router, post_with_headers("held", &[("x-held", "1")])).await
        });
        eventually(|| counter.runs_of("held") == 1).await;
        crate::common::a_blocked_handler_keeps_its_lease(layer, false).await;
        counter.let_go(1);
        let held = held.await.expect("the held request");
        assert_eq!(held.status, 201);
        assert_eq!(counter.runs_of("held"), 1);
    }

    /// A store at its bound: completed keys make room for new ones, soonest to expire
    /// first, and a retry of an evicted key runs as a new key; running claims are kept,
    /// and while only they are left a new key gets `503 store-unavailable` and nothing
    /// runs.
    #[tokio::test]
    async fn a_full_store_evicts_completed_keys_and_refuses_new_ones_while_all_run() {
        use std::time::Duration;

        use tower_idempotency::{IdempotencyLayer, Outcome};

        use crate::common::{app, in_flight, post, post_with_headers, send};

        let store = MemoryStore::new().with_max_entries(3);
        let layer = IdempotencyLayer::new(store.clone()).lease_duration(Duration::from_secs(60));
        let (router, counter) = app(layer);
        for i in 0..5 {
            let done = send(&router, post(&format!("done{i}"), "{}")).await;
            assert_eq!(done.status, 201);
        }
        assert_eq!((store.len(), store.evicted()), (3, 2));
        assert!(store.bytes() <= store.max_bytes());
        let kept = send(&router, post("done4", "{}")).await;
        assert_eq!(kept.outcome, Some(Outcome::Replayed));
        // done0 went first: a retry with it is a new key, and runs.
        let again = send(&router, post("done0", "{}")).await;
        assert_eq!(again.outcome, Some(Outcome::Executed));
        assert_eq!(counter.runs_of("done0"), 2);
        assert_eq!(store.len(), 3);

        // Three requests still running fill the store...
        let mut running = Vec::new();
        for i in 0..3 {
            let held = post_with_headers(&format!("run{i}"), &[("x-held", "1")]);
            running.push(in_flight(&router, held, &counter).await);
        }
        assert_eq!((store.len(), store.evicted()), (3, 6));
        // ...and a new key is refused before its handler runs.
        let runs = counter.runs();
        let refused = send(&router, post("late", "{}")).await;
        assert_eq!(refused.status, 503);
        assert_eq!(refused.problem(), "store-unavailable");
        assert!(refused.header("retry-after").is_some());
        assert_eq!(refused.outcome, Some(Outcome::StoreError));
        assert_eq!(counter.runs(), runs);
        assert_eq!(counter.runs_of("late"), 0);
        // The running keys are all there: their duplicates are told so.
        for i in 0..3 {
            let dup = send(&router, post(&format!("run{i}"), "{}")).await;
            assert_eq!(dup.status, 409);
        }
        counter.let_go(3);
        for first in running {
            assert_eq!(first.await.unwrap().status, 201);
        }
        // Once they are stored, there is room again.
        let late = send(&router, post("late", "{}")).await;
        assert_eq!(late.outcome, Some(Outcome::Executed));
        assert_eq!(counter.runs_of("late"), 1);
        assert_eq!(store.len(), 3);
    }
}

/// A store that cannot look keys up (`Store::look_up`'s default), over a memory store.
mod without_look_up {
    use std::{sync::Arc, time::Duration};

    use tower_idempotency::{
        IdempotencyLayer, Outcome, Principal, Scope, StoredResponse,
        store::{BoxFuture, Claim, ClaimRequest, Fenced, Lease, MemoryStore, Store, StoreError},
    };

    use crate::common::{app, app_behind_auth, post_as, send};

    struct CannotLookUp(MemoryStore);

    impl Store for CannotLookUp {
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

        fn release<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, Result<Fenced, StoreError>> {
            self.0.release(lease)
        }

        fn purge<'a>(&'a self, batch: usize) -> BoxFuture<'a, Result<u64, StoreError>> {
            self.0.purge(batch)
        }

        fn renew<'a>(
            &'a self,
            lease: &'a Lease,
            duration: Duration,
        ) -> BoxFuture<'a, Result<Fenced, StoreError>> {
            self.0.renew(lease, duration)
        }
    }

    /// A layer in transition whose look-up under the previous scope fails answers
    /// `503 store-unavailable` and releases its claim: it never runs a request it could
    /// not look up. Its replays, which look up nothing, are served.
    #[tokio::test]
    async fn a_look_up_that_fails_is_a_503_and_runs_nothing() {
        let memory = MemoryStore::new();
        let (old, _) = app(IdempotencyLayer::new(memory.clone()));
        assert_eq!(
            send(&old, post_as("acct7.first", "old", "{}")).await.status,
            201
        );
        let store: Arc<dyn Store> = Arc::new(CannotLookUp(memory.clone()));
        let layer = IdempotencyLayer::new(store).previous_scope_with(Scope::from_authorization);
        let (new, counter) = app_behind_auth(layer);
        for key in ["old", "new"] {
            let refused = send(&new, post_as("acct7.first", key, "{}")).await;
            assert_eq!(refused.status, 503);
            assert_eq!(refused.problem(), "store-unavailable");
            assert_eq!(refused.outcome, Some(Outcome::StoreError));
            assert!(refused.header("retry-after").is_some());
            let scope = Principal::new("acct7").scope().clone();
            assert!(
                memory.look_up(&scope, key).await.unwrap().is_none(),
                "{key}"
            );
        }
        assert_eq!(counter.runs(), 0);
        // A key its own scope holds is answered from there, with no look-up.
        let (plain, counter) = app_behind_auth(IdempotencyLayer::new(memory.clone()));
        let ran = send(&plain, post_as("acct7.first", "mine", "{}")).await;
        assert_eq!(ran.outcome, Some(Outcome::Executed));
        let replayed = send(&new, post_as("acct7.second", "mine", "{}")).await;
        assert_eq!(replayed.outcome, Some(Outcome::Replayed));
        assert_eq!(replayed.body, ran.body);
        assert_eq!(counter.runs(), 1);
    }
}

mod postgres {
    use std::sync::Arc;

    use tower_idempotency::store::Store;

    use crate::common::TestSchema;

    async fn make() -> (Arc<dyn Store>, TestSchema) {
        let schema = TestSchema::new();
        let store = schema.store().await;
        (Arc::new(store), schema)
    }

    crate::layer_suite!(make);
}

/// The same suite with lease mode's statements pipelined on two shared connections.
mod postgres_shared {
    use std::sync::Arc;

    use tower_idempotency::store::Store;

    use crate::common::TestSchema;

    async fn make() -> (Arc<dyn Store>, TestSchema) {
        let schema = TestSchema::new();
        let store = crate::common::sharing_claims(schema.store().await, 2);
        (Arc::new(store), schema)
    }

    crate::layer_suite!(make);
}

/// What happens to a request whose response future is dropped, and to a handler whose
/// lease renewal is slow: the layer's own scheduling, over the in-memory store.
mod scheduling {
    use std::{
        convert::Infallible,
        sync::{
            Arc,
            atomic::{AtomicUsize, Ordering},
        },
        time::Duration,
    };

    use axum::body::{Body, Bytes};
    use tokio::sync::Notify;
    use tower::{Layer, Service, ServiceExt, service_fn};
    use tower_idempotency::{
        IdempotencyLayer, Outcome, Scope, ShutdownHandle, StoredResponse,
        store::{BoxFuture, Claim, ClaimRequest, Fenced, Lease, MemoryStore, Store, StoreError},
    };

    use crate::common::{eventually, post, req};

    /// A `MemoryStore` that lets a test watch the layer: its renewals never answer (the
    /// layer gives up on each after a third of the lease) and are counted while in
    /// flight; each release records how many requests `shutdown` counted in flight; it
    /// counts the claims answered and the duplicates that registered to wait. A test
    /// holds claims, or registrations, on their way to the store for as long as it holds
    /// the write half of `claims_on_the_way`, or of `registrations_on_the_way`.
    #[derive(Default)]
    struct Watched {
        inner: MemoryStore,
        renewals_in_flight: Arc<AtomicUsize>,
        shutdown: std::sync::OnceLock<ShutdownHandle>,
        in_flight_at_release: Arc<std::sync::Mutex<Vec<usize>>>,
        claims_sent: AtomicUsize,
        claims_answered: AtomicUsize,
        claims_on_the_way: tokio::sync::RwLock<()>,
        waiters_registered: AtomicUsize,
        registrations_on_the_way: tokio::sync::RwLock<()>,
        /// Registrations fail, and then no notification comes, as with PostgreSQL.
        registrations_fail: std::sync::atomic::AtomicBool,
    }

    struct Counted(Arc<AtomicUsize>);

    impl Drop for Counted {
        fn drop(&mut self) {
            self.0.fetch_sub(1, Ordering::SeqCst);
        }
    }

    impl Store for Watched {
        fn claim<'a>(
            &'a self,
            request: &'a ClaimRequest<'a>,
        ) -> BoxFuture<'a, Result<Claim, StoreError>> {
            self.claims_sent.fetch_add(1, Ordering::SeqCst);
            Box::pin(async move {
                let _on_the_way = self.claims_on_the_way.read().await;
                let claim = self.inner.claim(request).await;
                self.claims_answered.fetch_add(1, Ordering::SeqCst);
                claim
            })
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
            if let Some(shutdown) = self.shutdown.get() {
                self.in_flight_at_release
                    .lock()
                    .expect("lock")
                    .push(shutdown.in_flight());
            }
            self.inner.release(lease)
        }

        fn purge<'a>(&'a self, batch: usize) -> BoxFuture<'a, Result<u64, StoreError>> {
            self.inner.purge(batch)
        }

        fn register_waiter<'a>(
            &'a self,
            scope: &'a Scope,
            key: &'a str,
        ) -> BoxFuture<'a, Result<bool, StoreError>> {
            self.waiters_registered.fetch_add(1, Ordering::SeqCst);
            Box::pin(async move {
                let _on_the_way = self.registrations_on_the_way.read().await;
                if self.registrations_fail.load(Ordering::SeqCst) {
                    return Err(StoreError::new(
                        tower_idempotency::store::StoreErrorKind::Unavailable,
                        "the registration was refused",
                    ));
                }
                self.inner.register_waiter(scope, key).await
            })
        }

        fn changed(&self, scope: &Scope, key: &str) -> BoxFuture<'static, ()> {
            if self.registrations_fail.load(Ordering::SeqCst) {
                return Box::pin(std::future::pending());
            }
            self.inner.changed(scope, key)
        }

        fn renew<'a>(
            &'a self,
            _lease: &'a Lease,
            _duration: Duration,
        ) -> BoxFuture<'a, Result<Fenced, StoreError>> {
            self.renewals_in_flight.fetch_add(1, Ordering::SeqCst);
            let counted = Counted(self.renewals_in_flight.clone());
            Box::pin(async move {
                let _counted = counted;
                std::future::pending().await
            })
        }
    }

    #[tokio::test]
    async fn a_renewal_in_flight_does_not_hold_up_the_handler() {
        let watched = Watched::default();
        let renewals = watched.renewals_in_flight.clone();
        let store: Arc<dyn Store> = Arc::new(watched);
        let gate = Arc::new(Notify::new());
        // What the handler saw when it finished: renewals still in flight.
        let seen = Arc::new(AtomicUsize::new(usize::MAX));
        let handler = {
            let (gate, seen, renewals) = (gate.clone(), seen.clone(), renewals.clone());
            service_fn(move |_req: http::Request<Body>| {
                let (gate, seen, renewals) = (gate.clone(), seen.clone(), renewals.clone());
                async move {
                    gate.notified().await;
                    seen.store(renewals.load(Ordering::SeqCst), Ordering::SeqCst);
                    Ok::<_, Infallible>(http::Response::new(Body::from("done")))
                }
            })
        };
        // Renewals every second, each given up after a second.
        let svc = IdempotencyLayer::new(store)
            .lease_duration(Duration::from_secs(3))
            .layer(handler);
        let request = tokio::spawn(svc.oneshot(post("k", "{}")));
        eventually(|| renewals.load(Ordering::SeqCst) == 1).await;
        gate.notify_one();
        let res = request.await.unwrap().unwrap();
        assert_eq!(res.status(), 200);
        assert_eq!(
            seen.load(Ordering::SeqCst),
            1,
            "the handler ran on while its lease renewal was waiting for the store"
        );
    }

    /// A handler that counts its runs and answers 200.
    fn counting(
        runs: Arc<AtomicUsize>,
    ) -> impl Service<
        http::Request<Body>,
        Response = http::Response<Body>,
        Error = Infallible,
        Future = impl std::future::Future<Output = Result<http::Response<Body>, Infallible>>
                 + Send
                 + 'static,
    > + Clone
    + Send
    + 'static {
        service_fn(move |_req: http::Request<Body>| {
            runs.fetch_add(1, Ordering::SeqCst);
            async { Ok::<_, Infallible>(http::Response::new(Body::from("done"))) }
        })
    }

    #[tokio::test]
    async fn a_request_dropped_before_it_claims_is_not_run() {
        let runs = Arc::new(AtomicUsize::new(0));
        let mut svc = IdempotencyLayer::new(MemoryStore::new()).layer(counting(runs.clone()));
        let dropped = svc.ready().await.unwrap().call(post("k", "{}"));
        drop(dropped);
        // Anything spawned on this single-threaded runtime gets to run now.
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
        assert_eq!(runs.load(Ordering::SeqCst), 0);
        let res = svc.oneshot(post("k", "{}")).await.unwrap();
        assert_eq!(res.extensions().get::<Outcome>(), Some(&Outcome::Executed));
        assert_eq!(runs.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn a_request_dropped_while_its_body_uploads_is_not_run() {
        let runs = Arc::new(AtomicUsize::new(0));
        let mut svc = IdempotencyLayer::new(MemoryStore::new()).layer(counting(runs.clone()));
        let (upload, arriving) = tokio::sync::mpsc::channel::<Bytes>(1);
        let uploading = req("POST")
            .header("idempotency-key", "k")
            .body(Body::new(Upload(arriving)))
            .unwrap();
        let mut pending = Box::pin(svc.ready().await.unwrap().call(uploading));
        // One poll: the layer starts reading a body that has not arrived yet ...
        let first =
            std::future::poll_fn(|cx| std::task::Poll::Ready(pending.as_mut().poll(cx))).await;
        assert!(first.is_pending());
        // ... and is dropped, as by a timeout outside the layer.
        drop(pending);
        assert!(
            upload.send(Bytes::from_static(b"{}")).await.is_err(),
            "nobody reads the body any more"
        );
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
        assert_eq!(runs.load(Ordering::SeqCst), 0);
        let res = svc.oneshot(post("k", "{}")).await.unwrap();
        assert_eq!(res.extensions().get::<Outcome>(), Some(&Outcome::Executed));
    }

    /// A request body that arrives when the test sends it.
    struct Upload(tokio::sync::mpsc::Receiver<Bytes>);

    impl http_body::Body for Upload {
        type Data = Bytes;
        type Error = Infallible;

        fn poll_frame(
            mut self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Infallible>>> {
            self.0
                .poll_recv(cx)
                .map(|chunk| chunk.map(|c| Ok(http_body::Frame::data(c))))
        }
    }

    #[tokio::test]
    async fn a_panicking_request_counts_as_in_flight_until_its_key_is_released() {
        let watched = Arc::new(Watched::default());
        let store: Arc<dyn Store> = watched.clone();
        let layer = IdempotencyLayer::new(store);
        let shutdown = layer.shutdown_handle();
        let _ = watched.shutdown.set(shutdown.clone());
        let handler = service_fn(|_req: http::Request<Body>| async {
            panic!("the handler broke");
            #[allow(unreachable_code)]
            Ok::<_, Infallible>(http::Response::new(Body::empty()))
        });
        let res = layer.layer(handler).oneshot(post("k", "{}")).await.unwrap();
        assert_eq!(res.status(), 500);
        // A graceful shutdown waiting on this request would not have let the process
        // exit before the key was released.
        assert_eq!(*watched.in_flight_at_release.lock().unwrap(), vec![1]);
        assert_eq!(shutdown.in_flight(), 0);
    }

    /// A handler whose first run counts itself in `runs`, waits for `gate`, then answers
    /// `first_status`; later runs count themselves and answer 200 at once.
    fn first_run_waits_for(
        runs: Arc<AtomicUsize>,
        gate: Arc<Notify>,
        first_status: http::StatusCode,
    ) -> impl Service<
        http::Request<Body>,
        Response = http::Response<Body>,
        Error = Infallible,
        Future = impl Send,
    > + Clone
    + Send
    + 'static {
        service_fn(move |_req: http::Request<Body>| {
            let (runs, gate) = (runs.clone(), gate.clone());
            async move {
                let mut res = http::Response::new(Body::empty());
                if runs.fetch_add(1, Ordering::SeqCst) == 0 {
                    gate.notified().await;
                    *res.status_mut() = first_status;
                }
                Ok::<_, Infallible>(res)
            }
        })
    }

    /// A duplicate whose registration to wait failed gets no notification when the first
    /// request completes: it looks again on its own, shortly, rather than sleeping until
    /// the holder's lease lapses (30 s) or its own bound.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_duplicate_that_could_not_register_to_wait_looks_again_on_its_own() {
        let watched = Arc::new(Watched::default());
        watched.registrations_fail.store(true, Ordering::SeqCst);
        let store: Arc<dyn Store> = watched.clone();
        let runs = Arc::new(AtomicUsize::new(0));
        let gate = Arc::new(Notify::new());
        let service = IdempotencyLayer::new(store)
            .wait_for_running(Duration::from_secs(600))
            .layer(first_run_waits_for(
                runs.clone(),
                gate.clone(),
                http::StatusCode::CREATED,
            ));
        let first = tokio::spawn(service.clone().oneshot(post("k", "{}")));
        eventually(|| runs.load(Ordering::SeqCst) == 1).await;
        let waiter = tokio::spawn(service.clone().oneshot(post("k", "{}")));
        eventually(|| watched.waiters_registered.load(Ordering::SeqCst) == 1).await;
        gate.notify_one();
        assert_eq!(first.await.unwrap().unwrap().status(), 201);
        let waited = tokio::time::timeout(Duration::from_secs(10), waiter)
            .await
            .expect("the waiter sleeps on, never notified")
            .unwrap()
            .unwrap();
        assert_eq!(waited.status(), 201);
        assert_eq!(waited.headers()["idempotent-replayed"], "true");
        assert_eq!(runs.load(Ordering::SeqCst), 1);
    }

    /// What the inner service's readiness reserves is held only by requests that run
    /// their handler: with a concurrency limit of 2 inside the layer, one request
    /// running and a duplicate waiting for it, a request with another key still runs.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_waiting_duplicate_holds_no_concurrency_permit() {
        let watched = Arc::new(Watched::default());
        let store: Arc<dyn Store> = watched.clone();
        let runs = Arc::new(AtomicUsize::new(0));
        let gate = Arc::new(Notify::new());
        let service = tower::ServiceBuilder::new()
            .layer(IdempotencyLayer::new(store).wait_for_running(Duration::from_secs(600)))
            .layer(tower::limit::ConcurrencyLimitLayer::new(2))
            .service(first_run_waits_for(
                runs.clone(),
                gate.clone(),
                http::StatusCode::CREATED,
            ));
        let first = tokio::spawn(service.clone().oneshot(post("a", "{}")));
        eventually(|| runs.load(Ordering::SeqCst) == 1).await;
        let waiter = tokio::spawn(service.clone().oneshot(post("a", "{}")));
        eventually(|| watched.waiters_registered.load(Ordering::SeqCst) == 1).await;
        let other = tokio::time::timeout(
            Duration::from_secs(10),
            service.clone().oneshot(post("b", "{}")),
        )
        .await
        .expect("the other key waits for a permit held by a request that does not run")
        .unwrap();
        assert_eq!(other.status(), 200);
        gate.notify_one();
        assert_eq!(first.await.unwrap().unwrap().status(), 201);
        let waited = waiter.await.unwrap().unwrap();
        assert_eq!(waited.status(), 201);
        assert_eq!(waited.headers()["idempotent-replayed"], "true");
        assert_eq!(runs.load(Ordering::SeqCst), 2);
    }

    /// The longest settings are taken as the longest the layer can hold, not as a panic
    /// on every request: a duplicate told to wait "forever" waits, then replays.
    #[tokio::test]
    async fn the_longest_settings_still_serve() {
        let runs = Arc::new(AtomicUsize::new(0));
        let gate = Arc::new(Notify::new());
        let handler = first_run_waits_for(runs.clone(), gate.clone(), http::StatusCode::OK);
        let max = Duration::MAX;
        let svc = IdempotencyLayer::new(MemoryStore::new())
            .wait_for_running(max)
            .lease_duration(max)
            .ttl(max)
            .store_timeout(max)
            .request_body_timeout(max)
            .layer(handler);
        let first = tokio::spawn(svc.clone().oneshot(post("k", "{}")));
        eventually(|| runs.load(Ordering::SeqCst) == 1).await;
        let duplicate = tokio::spawn(svc.clone().oneshot(post("k", "{}")));
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
        assert!(!duplicate.is_finished(), "the duplicate did not wait");
        gate.notify_one();
        let first = first.await.unwrap().unwrap();
        assert_eq!(
            first.extensions().get::<Outcome>(),
            Some(&Outcome::Executed)
        );
        let duplicate = duplicate.await.unwrap().unwrap();
        assert_eq!(
            duplicate.extensions().get::<Outcome>(),
            Some(&Outcome::Replayed)
        );
        assert_eq!(runs.load(Ordering::SeqCst), 1);
    }

    /// When a duplicate's client hangs up, while it waits for the running request.
    #[derive(Clone, Copy)]
    enum HangUp {
        /// Its claim is on its way to the store (the request then finishes that claim
        /// in a task of its own, and finds the key running).
        DuringTheClaim,
        /// Its registration as a waiter is on its way.
        DuringTheRegistration,
        /// It is registered and waits.
        WhileWaiting,
    }

    /// The first request runs until the test lets it fail (500 is not stored: the key
    /// is released); a duplicate waits for it, and its client hangs up at `moment`. Then
    /// the first request fails, and the handler must have run once only, the abandoned
    /// duplicate having not run it for nobody. Returns whether the duplicate registered
    /// to wait.
    async fn a_waiting_duplicate_hangs_up(moment: HangUp) -> usize {
        let watched = Arc::new(Watched::default());
        let store: Arc<dyn Store> = watched.clone();
        let runs = Arc::new(AtomicUsize::new(0));
        let gate = Arc::new(Notify::new());
        // The first run waits for the gate, then fails; any later run succeeds.
        let handler = first_run_waits_for(
            runs.clone(),
            gate.clone(),
            http::StatusCode::INTERNAL_SERVER_ERROR,
        );
        let svc = IdempotencyLayer::new(store)
            .wait_for_running(Duration::from_secs(30))
            .layer(handler);
        let first = tokio::spawn(svc.clone().oneshot(post("k", "{}")));
        eventually(|| runs.load(Ordering::SeqCst) == 1).await;
        let claims = watched.claims_on_the_way.write().await;
        let registrations = watched.registrations_on_the_way.write().await;
        let mut duplicate = Box::pin(svc.clone().oneshot(post("k", "{}")));
        let (sent, registered) = (&watched.claims_sent, &watched.waiters_registered);
        let reached = || match moment {
            HangUp::DuringTheClaim => sent.load(Ordering::SeqCst) == 2,
            HangUp::DuringTheRegistration | HangUp::WhileWaiting => {
                registered.load(Ordering::SeqCst) == 1
            }
        };
        let mut held = (Some(claims), Some(registrations));
        if !matches!(moment, HangUp::DuringTheClaim) {
            held.0 = None;
        }
        if matches!(moment, HangUp::WhileWaiting) {
            held.1 = None;
        }
        for _ in 0..1000 {
            let polled =
                std::future::poll_fn(|cx| std::task::Poll::Ready(duplicate.as_mut().poll(cx)))
                    .await;
            assert!(
                polled.is_pending(),
                "the duplicate answered before it waited"
            );
            if reached() {
                break;
            }
            tokio::task::yield_now().await;
        }
        assert!(
            reached(),
            "the duplicate never reached the moment of the test"
        );
        if matches!(moment, HangUp::WhileWaiting) {
            // Its registration is answered: the next poll waits for the first request.
            let polled =
                std::future::poll_fn(|cx| std::task::Poll::Ready(duplicate.as_mut().poll(cx)))
                    .await;
            assert!(polled.is_pending());
        }
        drop(duplicate);
        drop(held);
        // Every claim sent has its answer before the first request fails.
        eventually(|| watched.claims_answered.load(Ordering::SeqCst) == 2).await;
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
        gate.notify_one();
        let first = first
            .await
            .expect("the first request's task")
            .expect("infallible");
        assert_eq!(first.status(), 500);
        // A duplicate still waiting would wake on the release, claim the key and run.
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(
            runs.load(Ordering::SeqCst),
            1,
            "the abandoned duplicate ran the handler once the key was released"
        );
        watched.waiters_registered.load(Ordering::SeqCst)
    }

    #[tokio::test]
    async fn a_waiting_duplicate_whose_client_hangs_up_does_not_run_later() {
        assert_eq!(a_waiting_duplicate_hangs_up(HangUp::WhileWaiting).await, 1);
    }

    #[tokio::test]
    async fn a_duplicate_whose_client_hangs_up_while_it_registers_to_wait_does_not_run_later() {
        assert_eq!(
            a_waiting_duplicate_hangs_up(HangUp::DuringTheRegistration).await,
            1
        );
    }

    #[tokio::test]
    async fn a_duplicate_whose_client_hangs_up_during_its_claim_does_not_wait_to_run() {
        let registered = a_waiting_duplicate_hangs_up(HangUp::DuringTheClaim).await;
        assert_eq!(registered, 0, "the abandoned duplicate registered to wait");
    }
}

/// Trailers are neither stored nor passed on with a buffered response, so that response
/// must not announce them either.
mod trailers {
    use std::{
        convert::Infallible,
        pin::Pin,
        task::{Context, Poll},
    };

    use axum::body::{Body, Bytes};
    use http::{HeaderMap, HeaderValue, header::TRAILER};
    use http_body::Frame;
    use tower::{Layer, ServiceExt, service_fn};
    use tower_idempotency::{IdempotencyLayer, Outcome, store::MemoryStore};

    use crate::common::post;

    /// `{}`, then a trailer field `x-sum`.
    struct WithTrailers(u8);

    impl http_body::Body for WithTrailers {
        type Data = Bytes;
        type Error = Infallible;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
            self.0 += 1;
            Poll::Ready(match self.0 {
                1 => Some(Ok(Frame::data(Bytes::from_static(b"{}")))),
                2 => {
                    let mut trailers = HeaderMap::new();
                    trailers.insert("x-sum", HeaderValue::from_static("42"));
                    Some(Ok(Frame::trailers(trailers)))
                }
                _ => None,
            })
        }
    }

    #[tokio::test]
    async fn a_response_whose_trailers_are_dropped_does_not_announce_them() {
        let handler = service_fn(|_req: http::Request<Body>| async {
            let mut res = http::Response::new(Body::new(WithTrailers(0)));
            res.headers_mut()
                .insert(TRAILER, HeaderValue::from_static("x-sum"));
            Ok::<_, Infallible>(res)
        });
        let svc = IdempotencyLayer::new(MemoryStore::new()).layer(handler);
        for expected in [Outcome::Executed, Outcome::Replayed] {
            let res = svc.clone().oneshot(post("k", "{}")).await.unwrap();
            assert_eq!(res.extensions().get::<Outcome>(), Some(&expected));
            assert_eq!(res.headers().get(TRAILER), None, "{expected:?}");
            let collected = http_body_util::BodyExt::collect(res.into_body())
                .await
                .unwrap();
            assert_eq!(collected.trailers(), None);
            assert_eq!(collected.to_bytes(), "{}");
        }
    }
}

/// A drain waits for what the layer still does for requests already answered.
mod draining {
    use std::{
        sync::{Arc, atomic::Ordering},
        time::Duration,
    };

    use tower_idempotency::{IdempotencyLayer, store::MemoryStore};

    use crate::common::{
        app,
        completions::{AlteredCompletions, Completion},
        post, send,
    };

    /// A claim given up on at the store timeout (503) may still land; it is then
    /// released, and a drain waits for that release, so that a process that exits at
    /// once does not leave the key claimed for a lease.
    #[tokio::test]
    async fn a_drain_waits_for_a_late_claim_to_be_released() {
        let (store, releases) = AlteredCompletions::counting_releases(
            Arc::new(MemoryStore::new()),
            Completion::SlowClaim(Duration::from_millis(300)),
        );
        let layer = IdempotencyLayer::new(store).store_timeout(Duration::from_millis(50));
        let shutdown = layer.shutdown_handle();
        let (router, counter) = app(layer);
        assert_eq!(send(&router, post("k", "{}")).await.status, 503);
        shutdown.drain().await;
        assert_eq!(releases.load(Ordering::SeqCst), 1);
        assert_eq!(counter.runs_of("k"), 0);
    }

    /// `in_flight` counts requests: one running its handler counts once, though the
    /// layer holds a second share of its count for the part that stores its result.
    #[tokio::test]
    async fn in_flight_counts_each_running_request_once() {
        let gate = Arc::new(tokio::sync::Semaphore::new(0));
        let counter = crate::common::Counter::default();
        let (g, c) = (gate.clone(), counter.clone());
        let handler = move || {
            let (g, c) = (g.clone(), c.clone());
            async move {
                c.count_run();
                let _permit = g.acquire().await.expect("gate");
                (axum::http::StatusCode::CREATED, "{}")
            }
        };
        let layer = IdempotencyLayer::new(MemoryStore::new());
        let shutdown = layer.shutdown_handle();
        let router = axum::Router::new()
            .route("/payments", axum::routing::post(handler))
            .layer(layer);
        let running: Vec<_> = ["a", "b", "c"]
            .into_iter()
            .map(|key| tokio::spawn(send_owned(router.clone(), post(key, "{}"))))
            .collect();
        crate::common::eventually(|| counter.runs() == 3).await;
        assert_eq!(shutdown.in_flight(), 3);
        gate.add_permits(3);
        for request in running {
            assert_eq!(request.await.expect("request").status, 201);
        }
        crate::common::eventually(|| shutdown.in_flight() == 0).await;
    }

    async fn send_owned(
        router: axum::Router,
        req: axum::http::Request<axum::body::Body>,
    ) -> crate::common::Reply {
        send(&router, req).await
    }

    /// That release is bounded by the store timeout, as every other is: a store that
    /// stops answering once the late claim landed does not hold the drain. The clock is
    /// tokio's paused one, so an unbounded release would run it to the hour at once.
    #[tokio::test(start_paused = true)]
    async fn a_drain_does_not_wait_on_the_release_of_a_late_claim_for_ever() {
        let memory = Arc::new(MemoryStore::new());
        let (store, releases) = AlteredCompletions::counting_releases(
            memory.clone(),
            Completion::SlowClaimThenSilent(Duration::from_millis(300)),
        );
        let layer = IdempotencyLayer::new(store).store_timeout(Duration::from_millis(50));
        let shutdown = layer.shutdown_handle();
        let (router, counter) = app(layer);
        assert_eq!(send(&router, post("k", "{}")).await.status, 503);
        tokio::time::timeout(Duration::from_secs(3600), shutdown.drain())
            .await
            .expect("the drain waited for a release that never answers");
        assert_eq!(shutdown.in_flight(), 0);
        assert_eq!(releases.load(Ordering::SeqCst), 0, "no release answered");
        assert_eq!(memory.len(), 1, "the late claim landed, and holds its key");
        assert_eq!(counter.runs_of("k"), 0);
    }
}

/// What the extractors answer when the layer did not guard the request: a client
/// without a key is told so; a request no layer guarded is the server's fault (500,
/// released), not a 400 the client is blamed for, stored and replayed.
mod extractors {
    use axum::{
        Router,
        body::Body,
        http::HeaderName,
        routing::{post, put},
    };
    use tower_idempotency::{IdempotencyKey, IdempotencyLayer, store::MemoryStore};

    use crate::common::{req, send};

    fn keyed(method: &str, header: &str) -> axum::http::Request<Body> {
        req(method)
            .header(header, "k")
            .body(Body::from("{}"))
            .expect("request")
    }

    #[tokio::test]
    async fn a_request_the_layer_did_not_guard_is_500_not_400() {
        // PUT is not among the guarded methods (POST, PATCH): with a key or without.
        let router = Router::new()
            .route(
                "/payments",
                put(|key: IdempotencyKey| async move { key.to_string() }),
            )
            .layer(IdempotencyLayer::new(MemoryStore::new()));
        for request in [
            keyed("PUT", "idempotency-key"),
            req("PUT").body(Body::from("{}")).unwrap(),
        ] {
            let r = send(&router, request).await;
            assert_eq!(r.status, 500);
            assert_eq!(r.problem(), "handler-failed");
        }
        // A route behind no layer at all, keyless.
        let bare = Router::new().route(
            "/payments",
            post(|key: IdempotencyKey| async move { key.to_string() }),
        );
        let r = send(&bare, req("POST").body(Body::from("{}")).unwrap()).await;
        assert_eq!(r.status, 500);
        assert_eq!(r.problem(), "handler-failed");
    }

    #[tokio::test]
    async fn a_request_the_layer_saw_without_its_key_is_400() {
        // The layer reads the key from X-Request-Id: an Idempotency-Key is no key here.
        let layer = IdempotencyLayer::new(MemoryStore::new())
            .header_name(HeaderName::from_static("x-request-id"));
        let router = Router::new()
            .route(
                "/payments",
                post(|key: IdempotencyKey| async move { key.to_string() }),
            )
            .layer(layer);
        let r = send(&router, keyed("POST", "idempotency-key")).await;
        assert_eq!(r.status, 400);
        assert_eq!(r.problem(), "key-missing");
        // The answer names the field the client must send.
        let detail = r.json()["detail"].as_str().unwrap_or_default().to_owned();
        assert!(detail.contains("x-request-id"), "{detail}");
        let r = send(&router, keyed("POST", "x-request-id")).await;
        assert_eq!(r.status, 200);
        assert_eq!(r.body, "k");
    }

    /// A layer that requires its key in another field names that field when the key is
    /// missing or malformed, not `Idempotency-Key`.
    #[tokio::test]
    async fn a_key_in_another_field_is_named_in_the_answer() {
        let layer = IdempotencyLayer::new(MemoryStore::new())
            .header_name(HeaderName::from_static("x-request-id"))
            .require_key(true);
        let (router, _) = crate::common::app(layer);
        let missing = send(&router, req("POST").body(Body::from("{}")).unwrap()).await;
        let malformed = send(
            &router,
            req("POST")
                .header("x-request-id", "a b")
                .body(Body::from("{}"))
                .unwrap(),
        )
        .await;
        for (r, problem) in [(missing, "key-missing"), (malformed, "key-malformed")] {
            assert_eq!(r.status, 400);
            assert_eq!(r.problem(), problem);
            let detail = r.json()["detail"].as_str().unwrap_or_default().to_owned();
            assert!(detail.contains("x-request-id"), "{detail}");
            assert!(!detail.contains("Idempotency-Key"), "{detail}");
        }
    }
}

/// The settings that change which requests are guarded and what is compared and
/// replayed, each with a value other than its default.
mod settings {
    use axum::{
        body::Body,
        http::{HeaderName, Method},
    };
    use tower_idempotency::{IdempotencyLayer, Outcome, store::MemoryStore};

    use crate::common::{app, post, post_with_headers, req, send};

    fn layer() -> IdempotencyLayer {
        IdempotencyLayer::new(MemoryStore::new())
    }

    #[tokio::test]
    async fn methods_sets_which_requests_are_guarded() {
        let (router, counter) = app(layer().methods([Method::PATCH]));
        let patch = || {
            req("PATCH")
                .header("idempotency-key", "k")
                .body(Body::from("{}"))
                .unwrap()
        };
        assert_eq!(
            send(&router, patch()).await.outcome,
            Some(Outcome::Executed)
        );
        assert_eq!(
            send(&router, patch()).await.outcome,
            Some(Outcome::Replayed)
        );
        // POST is no longer guarded: it runs every time, its key ignored.
        for _ in 0..2 {
            let r = send(&router, post("k2", "{}")).await;
            assert_eq!(r.outcome, Some(Outcome::PassedThrough));
        }
        assert_eq!(counter.runs(), 3);
    }

    #[tokio::test]
    async fn header_name_sets_which_field_carries_the_key() {
        let name = HeaderName::from_static("x-request-id");
        let (router, counter) = app(layer().header_name(name));
        let keyed = || post_with_headers("ignored", &[("x-request-id", "k")]);
        // `post_with_headers` also sends `Idempotency-Key`; only `X-Request-Id` counts:
        // the first request under another Idempotency-Key value still replays.
        assert_eq!(
            send(&router, keyed()).await.outcome,
            Some(Outcome::Executed)
        );
        let other = post_with_headers("other", &[("x-request-id", "k")]);
        assert_eq!(send(&router, other).await.outcome, Some(Outcome::Replayed));
        // Idempotency-Key alone is not a key here.
        let r = send(&router, post("k", "{}")).await;
        assert_eq!(r.outcome, Some(Outcome::PassedThrough));
        assert_eq!(counter.runs(), 2);
    }

    #[tokio::test]
    async fn unreplayed_headers_sets_what_a_replay_leaves_out() {
        let (router, _) = app(layer().unreplayed_headers([HeaderName::from_static("x-run")]));
        let first = send(&router, post("k", "{}")).await;
        assert_eq!(first.header("x-run"), Some("1"));
        let replay = send(&router, post("k", "{}")).await;
        assert_eq!(replay.outcome, Some(Outcome::Replayed));
        assert_eq!(replay.header("x-run"), None);
        // The list replaces the default: Set-Cookie is replayed now.
        assert_eq!(replay.header("set-cookie"), Some("session=1"));
    }

    #[tokio::test]
    async fn fingerprint_headers_sets_what_a_retry_must_repeat() {
        let tenant = HeaderName::from_static("x-tenant");
        let (router, counter) = app(layer().fingerprint_headers([tenant]));
        let with = |t: &str| post_with_headers("k", &[("x-tenant", t)]);
        assert_eq!(send(&router, with("a")).await.status, 201);
        let other = send(&router, with("b")).await;
        assert_eq!(other.status, 422);
        assert_eq!(other.problem(), "key-reused");
        // Content-Type is no longer compared: another one still replays.
        let retype = req("POST")
            .header("idempotency-key", "k")
            .header("x-tenant", "a")
            .header("content-type", "text/plain")
            .body(Body::from("{}"))
            .unwrap();
        assert_eq!(send(&router, retype).await.outcome, Some(Outcome::Replayed));
        assert_eq!(counter.runs(), 1);
    }
}
