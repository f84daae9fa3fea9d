//! With the `metrics` feature, what the layer and the job runner do is counted and
//! timed through the `metrics` facade: checked here with a recorder that keeps what it is
//! given (`common/recorder.rs`), set for the test's own thread. Each test runs on a
//! current-thread runtime, so that everything it starts records there.
#![allow(clippy::unwrap_used)] // unwrap in test helpers: a failure is the test failing

mod common;
#[path = "common/recorder.rs"]
mod recorder;

use std::{sync::Arc, time::Duration};

use common::{
    TestSchema, app,
    completions::{AlteredCompletions, Completion},
    eventually, post, send,
};
use recorder::TestRecorder;
use tower_idempotency::{
    IdempotencyLayer, Scope,
    job::JobRunner,
    metrics::{
        CLAIM_DURATION, COMPLETION_DURATION, JOBS, PURGED, REQUESTS, STORE_ERRORS, WAITING, WAITS,
    },
    store::MemoryStore,
};

/// The series of [`REQUESTS`] for a `POST /payments` answered with `status` (none:
/// `""`), as the recorder names it: its labels sorted.
fn requests(mode: &str, outcome: &str, status: &str) -> String {
    let status = if status.is_empty() {
        String::new()
    } else {
        format!(",http.response.status_code={status}")
    };
    format!(
        "{REQUESTS}{{http.request.method=POST{status},http.route=/payments,\
         idempotency.mode={mode},idempotency.outcome={outcome}}}"
    )
}

/// A `5xx` whose key was released is counted apart from a success, under the status it
/// answered; so is the inner service's error, with no status.
#[tokio::test]
async fn a_5xx_that_released_its_key_is_counted_apart_from_a_success() {
    let recorded = TestRecorder::default();
    let _local = metrics::set_default_local_recorder(&recorded);
    let (router, counter) = app(IdempotencyLayer::new(MemoryStore::new()));
    let failing = || common::post_with_headers("order-1", &[("x-status", "500")]);
    assert_eq!(send(&router, failing()).await.status, 500);
    // Released: the retry runs again, and is counted again.
    assert_eq!(send(&router, failing()).await.status, 500);
    assert_eq!(counter.runs(), 2);
    assert_eq!(send(&router, post("order-2", "{}")).await.status, 201);
    assert_eq!(recorded.value(&requests("lease", "released", "500")), 2.0);
    assert_eq!(recorded.value(&requests("lease", "executed", "201")), 1.0);
    assert_eq!(recorded.value(&requests("lease", "executed", "500")), 0.0);
    // A panic: `500 handler-failed`, released too.
    let panicking = common::post_with_headers("order-3", &[("x-panic", "1")]);
    assert_eq!(send(&router, panicking).await.status, 500);
    assert_eq!(recorded.value(&requests("lease", "released", "500")), 3.0);
}

#[tokio::test]
async fn outcomes_claims_and_completions_are_counted() {
    let recorded = TestRecorder::default();
    let _local = metrics::set_default_local_recorder(&recorded);
    let (router, counter) = app(IdempotencyLayer::new(MemoryStore::new()));

    // Executed, replayed, and a duplicate while the first request runs.
    assert_eq!(send(&router, post("order-1", "{}")).await.status, 201);
    assert_eq!(send(&router, post("order-1", "{}")).await.status, 201);
    let held = common::post_with_headers("order-2", &[("x-held", "1")]);
    let first = common::in_flight(&router, held, &counter).await;
    assert_eq!(send(&router, post("order-2", "{}")).await.status, 409);
    counter.let_go(1);
    assert_eq!(first.await.unwrap().status, 201);
    // Refused for its key; and one without a key, passed through.
    assert_eq!(send(&router, post("order 3", "{}")).await.status, 400);
    let unkeyed = common::req("POST")
        .body(axum::body::Body::from("{}"))
        .unwrap();
    assert_eq!(send(&router, unkeyed).await.status, 201);

    let requests = |outcome: &str, status: &str| requests("lease", outcome, status);
    assert_eq!(recorded.value(&requests("executed", "201")), 2.0);
    assert_eq!(recorded.value(&requests("replayed", "201")), 1.0);
    assert_eq!(recorded.value(&requests("conflict", "409")), 1.0);
    assert_eq!(recorded.value(&requests("rejected", "400")), 1.0);
    assert_eq!(recorded.value(&requests("passed_through", "")), 1.0);
    assert_eq!(recorded.value(&requests("mismatch", "422")), 0.0);
    // A claim for each keyed request that got as far; a completion for each that ran.
    assert_eq!(
        recorded.observations(&format!("{CLAIM_DURATION}{{idempotency.mode=lease}}")),
        4
    );
    assert_eq!(
        recorded.observations(&format!("{COMPLETION_DURATION}{{idempotency.mode=lease}}")),
        2
    );
    assert!(
        recorded
            .names()
            .iter()
            .all(|k| !k.starts_with(STORE_ERRORS)),
        "{:?}",
        recorded.names()
    );
}

#[tokio::test]
async fn a_duplicate_that_waits_is_counted_and_gauged_while_it_waits() {
    let recorded = TestRecorder::default();
    let _local = metrics::set_default_local_recorder(&recorded);
    let layer = IdempotencyLayer::new(MemoryStore::new()).wait_for_running(Duration::from_secs(30));
    let (router, counter) = app(layer);
    let held = common::post_with_headers("order-1", &[("x-held", "1")]);
    let first = common::in_flight(&router, held, &counter).await;
    let duplicate = {
        let router = router.clone();
        tokio::spawn(async move { send(&router, post("order-1", "{}")).await })
    };
    let waiting = format!("{WAITING}{{}}");
    eventually(|| recorded.value(&waiting) == 1.0).await;
    assert_eq!(recorded.value(&format!("{WAITS}{{}}")), 1.0);
    counter.let_go(1);
    assert_eq!(first.await.unwrap().status, 201);
    let replay = duplicate.await.unwrap();
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(recorded.value(&waiting), 0.0);
    assert_eq!(recorded.value(&format!("{WAITS}{{}}")), 1.0);
}

#[tokio::test]
async fn store_errors_are_counted_by_operation() {
    let recorded = TestRecorder::default();
    let _local = metrics::set_default_local_recorder(&recorded);
    // Every completion fails: the first attempt before the answer, then more in the
    // background for one lease.
    let store = AlteredCompletions::around(Arc::new(MemoryStore::new()), Completion::Failing);
    let layer = IdempotencyLayer::new(store).lease_duration(Duration::from_millis(100));
    let (router, _) = app(layer);
    assert_eq!(send(&router, post("order-1", "{}")).await.status, 201);
    let failed = format!("{STORE_ERRORS}{{idempotency.operation=complete}}");
    assert!(recorded.value(&failed) >= 1.0);
    assert_eq!(recorded.value(&requests("lease", "executed", "201")), 1.0);
}

#[tokio::test]
async fn jobs_are_counted_by_outcome() {
    let recorded = TestRecorder::default();
    let _local = metrics::set_default_local_recorder(&recorded);
    let runner = JobRunner::new(MemoryStore::new());
    let scope = Scope::new("consumer");
    for input in [&b"a"[..], b"a", b"b"] {
        let _ = runner
            .run(&scope, "msg-1", input, |_| async {
                Ok::<_, std::io::Error>(bytes::Bytes::from("done"))
            })
            .await;
    }
    let failed = runner
        .run(&scope, "msg-2", b"a", |_| async {
            Err::<bytes::Bytes, _>(std::io::Error::other("the ledger is down"))
        })
        .await;
    assert!(failed.is_err());
    let jobs =
        |outcome: &str| format!("{JOBS}{{idempotency.mode=lease,idempotency.outcome={outcome}}}");
    assert_eq!(recorded.value(&jobs("executed")), 1.0);
    assert_eq!(recorded.value(&jobs("replayed")), 1.0);
    assert_eq!(recorded.value(&jobs("mismatch")), 1.0);
    assert_eq!(recorded.value(&jobs("released")), 1.0);
}

/// On PostgreSQL, in transactional mode: the claim (with its `BEGIN`) and the
/// completion (with its `COMMIT`) are timed, under `mode=transactional`.
#[tokio::test]
async fn transactional_claims_and_commits_are_timed() {
    let recorded = TestRecorder::default();
    let _local = metrics::set_default_local_recorder(&recorded);
    let schema = TestSchema::new();
    let store = schema.store().await;
    let (router, _) = app(IdempotencyLayer::transactional(store.clone()));
    assert_eq!(send(&router, post("order-1", "{}")).await.status, 201);
    assert_eq!(send(&router, post("order-1", "{}")).await.status, 201);
    // A 5xx rolls back, and is counted apart.
    let failing = common::post_with_headers("order-2", &[("x-status", "503")]);
    assert_eq!(send(&router, failing).await.status, 503);
    let requests = |outcome: &str, status: &str| requests("transactional", outcome, status);
    assert_eq!(recorded.value(&requests("executed", "201")), 1.0);
    assert_eq!(recorded.value(&requests("replayed", "201")), 1.0);
    assert_eq!(recorded.value(&requests("released", "503")), 1.0);
    let mode = "idempotency.mode=transactional";
    assert_eq!(
        recorded.observations(&format!("{CLAIM_DURATION}{{{mode}}}")),
        3
    );
    assert_eq!(
        recorded.observations(&format!("{COMPLETION_DURATION}{{{mode}}}")),
        1
    );
    common::idle(&store).await;
}

/// The background purge counts the rows it deletes.
#[tokio::test]
async fn purged_rows_are_counted() {
    let recorded = TestRecorder::default();
    let _local = metrics::set_default_local_recorder(&recorded);
    let schema = TestSchema::new();
    let store = schema
        .store()
        .await
        .with_background_purge(Some(Duration::from_millis(20)));
    let layer = IdempotencyLayer::new(store).ttl(Duration::from_millis(1));
    let (router, _) = app(layer);
    for key in ["a", "b", "c"] {
        assert_eq!(send(&router, post(key, "{}")).await.status, 201);
    }
    let purged = format!("{PURGED}{{}}");
    for _ in 0..1000 {
        if recorded.value(&purged) >= 3.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(recorded.value(&purged), 3.0);
}
