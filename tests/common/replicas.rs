//! Two replicas of a service, each with a store of its own on one table: a request on
//! one, and its duplicate on the other, which waits for it. Run over plain TCP and over
//! TLS.

use std::time::Duration;

use tower_idempotency::{
    IdempotencyLayer, Outcome,
    store::{PostgresStore, StoreMetrics},
};

use super::{app, in_flight, post, post_with_headers, send};

/// `a_duplicate_waits_on_another_replica` for a 3 s request, the duplicate woken by the
/// completion's notification (received, and counted as the wake-up); `b`'s counters
/// before and after.
pub async fn woken_by_a_notification(
    a: PostgresStore,
    b: PostgresStore,
) -> (StoreMetrics, StoreMetrics) {
    let (before, after) = a_duplicate_waits_on_another_replica(a, b, "3000").await;
    // (Not `notifications`: tests alongside notify on the same channel.)
    assert!(
        after.notified_wakeups > before.notified_wakeups,
        "{after:?}"
    );
    (before, after)
}

/// A request on replica `a` that runs `delay_ms`, and its duplicate on `b`, which waits
/// for it and replays its response, running nothing; `b`'s counters before and after.
pub async fn a_duplicate_waits_on_another_replica(
    a: PostgresStore,
    b: PostgresStore,
    delay_ms: &str,
) -> (StoreMetrics, StoreMetrics) {
    let (router_a, counter_a) = app(IdempotencyLayer::new(a));
    let (router_b, counter_b) =
        app(IdempotencyLayer::new(b.clone()).wait_for_running(Duration::from_secs(30)));
    let slow = post_with_headers("k", &[("x-delay-ms", delay_ms)]);
    let first = in_flight(&router_a, slow, &counter_a).await;
    let before = b.metrics();
    let waited = send(&router_b, post("k", "{}")).await;
    let first = first.await.expect("the first request");
    assert_eq!(waited.outcome, Some(Outcome::Replayed));
    assert_eq!(waited.body, first.body);
    assert_eq!((counter_a.runs(), counter_b.runs()), (1, 0));
    (before, b.metrics())
}
