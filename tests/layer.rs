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

    use axum::body::Body;
    use tokio::sync::Notify;
    use tower::{Layer, Service, ServiceExt, service_fn};
    use tower_idempotency::{
        IdempotencyLayer, Outcome, Scope, StoredResponse,
        store::{BoxFuture, Claim, ClaimRequest, Lease, MemoryStore, Store, StoreError},
    };

    use crate::common::{eventually, post};

    /// A `MemoryStore` whose renewals never answer (the layer gives up on each after a
    /// third of the lease); counts the renewals in flight.
    #[derive(Default)]
    struct StalledRenewals {
        inner: MemoryStore,
        in_flight: Arc<AtomicUsize>,
    }

    struct InFlight(Arc<AtomicUsize>);

    impl Drop for InFlight {
        fn drop(&mut self) {
            self.0.fetch_sub(1, Ordering::SeqCst);
        }
    }

    impl Store for StalledRenewals {
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
            self.in_flight.fetch_add(1, Ordering::SeqCst);
            let guard = InFlight(self.in_flight.clone());
            Box::pin(async move {
                let _guard = guard;
                std::future::pending().await
            })
        }
    }

    #[tokio::test]
    async fn a_renewal_in_flight_does_not_hold_up_the_handler() {
        let stalled = StalledRenewals::default();
        let renewals = stalled.in_flight.clone();
        let store: Arc<dyn Store> = Arc::new(stalled);
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

    #[tokio::test]
    async fn a_request_dropped_before_it_claims_is_not_run() {
        let runs = Arc::new(AtomicUsize::new(0));
        let handler = {
            let runs = runs.clone();
            service_fn(move |_req: http::Request<Body>| {
                runs.fetch_add(1, Ordering::SeqCst);
                async { Ok::<_, Infallible>(http::Response::new(Body::from("done"))) }
            })
        };
        let mut svc = IdempotencyLayer::new(MemoryStore::new()).layer(handler);
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
}
