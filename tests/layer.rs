//! The layer suite, against each store.

mod common;

mod memory {
    use std::sync::Arc;

    use tower_idempotency::store::{MemoryStore, Store};

    async fn make() -> (Arc<dyn Store>, ()) {
        (Arc::new(MemoryStore::new()), ())
    }

    crate::layer_suite!(make);
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
        let store = schema.store().await.with_shared_claim_connections(2);
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
        store::{BoxFuture, Claim, ClaimRequest, Lease, MemoryStore, Store, StoreError},
    };

    use crate::common::{eventually, post, req};

    /// A `MemoryStore` that lets a test watch the layer: its renewals never answer (the
    /// layer gives up on each after a third of the lease) and are counted while in
    /// flight; each release records how many requests `shutdown` counted in flight; it
    /// counts the duplicates that registered to wait.
    #[derive(Default)]
    struct Watched {
        inner: MemoryStore,
        renewals_in_flight: Arc<AtomicUsize>,
        shutdown: std::sync::OnceLock<ShutdownHandle>,
        in_flight_at_release: Arc<std::sync::Mutex<Vec<usize>>>,
        waiters_registered: AtomicUsize,
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
            self.inner.claim(request)
        }

        fn complete<'a>(
            &'a self,
            lease: &'a Lease,
            response: &'a StoredResponse,
            ttl: Duration,
        ) -> BoxFuture<'a, Result<bool, StoreError>> {
            self.inner.complete(lease, response, ttl)
        }

        fn release<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, Result<bool, StoreError>> {
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
            self.inner.register_waiter(scope, key)
        }

        fn changed(&self, scope: &Scope, key: &str) -> BoxFuture<'static, ()> {
            self.inner.changed(scope, key)
        }

        fn renew<'a>(
            &'a self,
            _lease: &'a Lease,
            _duration: Duration,
        ) -> BoxFuture<'a, Result<bool, StoreError>> {
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

    #[tokio::test]
    async fn a_waiting_duplicate_whose_client_hangs_up_does_not_run_later() {
        let watched = Arc::new(Watched::default());
        let store: Arc<dyn Store> = watched.clone();
        let runs = Arc::new(AtomicUsize::new(0));
        let gate = Arc::new(Notify::new());
        // The first run waits for the gate, then fails (500 is not stored: the key is
        // released); any later run succeeds.
        let handler = {
            let (runs, gate) = (runs.clone(), gate.clone());
            service_fn(move |_req: http::Request<Body>| {
                let (runs, gate) = (runs.clone(), gate.clone());
                async move {
                    let mut res = http::Response::new(Body::empty());
                    if runs.fetch_add(1, Ordering::SeqCst) == 0 {
                        gate.notified().await;
                        *res.status_mut() = http::StatusCode::INTERNAL_SERVER_ERROR;
                    }
                    Ok::<_, Infallible>(res)
                }
            })
        };
        let svc = IdempotencyLayer::new(store)
            .wait_for_running(Duration::from_secs(30))
            .layer(handler);
        let first = tokio::spawn(svc.clone().oneshot(post("k", "{}")));
        eventually(|| runs.load(Ordering::SeqCst) == 1).await;
        let mut duplicate = Box::pin(svc.clone().oneshot(post("k", "{}")));
        while watched.waiters_registered.load(Ordering::SeqCst) == 0 {
            let polled =
                std::future::poll_fn(|cx| std::task::Poll::Ready(duplicate.as_mut().poll(cx)))
                    .await;
            assert!(polled.is_pending());
            tokio::task::yield_now().await;
        }
        // The duplicate waits, holding nothing; its client hangs up.
        drop(duplicate);
        gate.notify_one();
        assert_eq!(first.await.unwrap().unwrap().status(), 500);
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
        assert_eq!(
            runs.load(Ordering::SeqCst),
            1,
            "the abandoned duplicate ran the handler once the key was released"
        );
    }
}
