//! Remembered keys (`remember_keys_for`) on the real PostgreSQL: a late retry, after
//! its response's retention, is refused (`410 response-expired`) and runs nothing, on
//! every claim path (alone, batched, transactional); a remembered row holds no headers
//! or body; past its window it is deleted and the key is new again; a store of the
//! previous release never takes a remembered key over. (The layer suite shows the
//! late retry on every store, `tests/common/suite.rs`.)
#![allow(clippy::unwrap_used)] // unwrap in the tests themselves: a failure is the test failing

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::{TestSchema, app, post, send};
use tower_idempotency::{
    IdempotencyLayer, Outcome, Scope,
    job::{JobOutcome, JobRunner},
    store::{MemoryStore, PostgresStore},
};

/// The TTL of the responses in these tests, and how long after it a retry comes.
const TTL: Duration = Duration::from_secs(1);
const AFTER_TTL: Duration = Duration::from_millis(1500);

/// The columns of `key`'s row: its state, status, whether it has headers and a body,
/// and whether it is remembered for about `window` after its completion.
async fn row_of(schema: &TestSchema, key: &str) -> Option<(String, i16, bool, bool, f64)> {
    let rows = schema
        .query(&format!(
            "SELECT state, status, headers IS NOT NULL, body IS NOT NULL,
                    extract(epoch FROM expires_at - completed_at)::float8
             FROM \"{}\".idempotency_keys WHERE key = '{key}'",
            schema.name
        ))
        .await;
    rows.first()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4)))
}

/// A store with the test's schema, no background purge (the tests purge by hand),
/// remembering keys for `window`.
async fn store(schema: &TestSchema, window: Duration) -> PostgresStore {
    schema
        .store()
        .await
        .with_background_purge(None)
        .remember_keys_for(window)
}

#[tokio::test]
async fn a_remembered_row_holds_no_headers_or_body_and_is_refused_with_410() {
    let schema = TestSchema::new();
    let store = store(&schema, Duration::from_secs(3600)).await;
    let (router, counter) = app(IdempotencyLayer::new(store.clone()).ttl(TTL));
    assert_eq!(send(&router, post("late", "{}")).await.status, 201);
    let (_, _, headers, body, _) = row_of(&schema, "late").await.unwrap();
    assert!(headers && body, "a completed row holds its response");
    tokio::time::sleep(AFTER_TTL).await;

    assert_eq!(store.purge_expired(100).await.unwrap(), 1, "reduced");
    let (state, status, headers, body, window) = row_of(&schema, "late").await.unwrap();
    assert_eq!((state.as_str(), status), ("completed", 201));
    assert!(
        !headers && !body,
        "a remembered row holds no headers or body"
    );
    // Forgotten an hour after its response expired, a second after completion.
    assert!((window - 3601.0).abs() < 1.0, "{window}");
    assert_eq!(store.purge_expired(100).await.unwrap(), 0, "reduced once");

    let late = send(&router, post("late", "{}")).await;
    assert_eq!(late.status, 410);
    assert_eq!(late.outcome, Some(Outcome::Expired));
    assert_eq!(counter.runs(), 1);
    let record = tower_idempotency::store::Operator::new(store)
        .look_up(&Scope::anonymous(), "late")
        .await
        .unwrap()
        .expect("a record");
    assert!(matches!(
        record.state,
        tower_idempotency::store::KeyState::Remembered { status } if status == 201
    ));
}

#[tokio::test]
async fn a_remembered_key_past_its_window_is_deleted_and_runs_as_new() {
    let schema = TestSchema::new();
    let store = store(&schema, Duration::from_secs(1)).await;
    let (router, counter) = app(IdempotencyLayer::new(store.clone()).ttl(TTL));
    assert_eq!(send(&router, post("k", "{}")).await.status, 201);
    tokio::time::sleep(AFTER_TTL).await;
    assert_eq!(store.purge_expired(100).await.unwrap(), 1);
    assert_eq!(send(&router, post("k", "{}")).await.status, 410);
    assert_eq!(counter.runs(), 1);

    // Past the window: the purge deletes the row, and the key is new again.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(store.purge_expired(100).await.unwrap(), 1);
    assert!(row_of(&schema, "k").await.is_none(), "deleted");
    let again = send(&router, post("k", "{}")).await;
    assert_eq!((again.status.as_u16(), counter.runs()), (201, 2));
}

#[tokio::test]
async fn a_store_that_remembers_nothing_forgets_a_key_with_its_response() {
    let schema = TestSchema::new();
    let store = store(&schema, Duration::ZERO).await;
    let (router, counter) = app(IdempotencyLayer::new(store.clone()).ttl(TTL));
    assert_eq!(send(&router, post("k", "{}")).await.status, 201);
    tokio::time::sleep(AFTER_TTL).await;
    assert_eq!(store.purge_expired(100).await.unwrap(), 1);
    assert!(row_of(&schema, "k").await.is_none(), "deleted, not reduced");
    assert_eq!(send(&router, post("k", "{}")).await.status, 201);
    assert_eq!(counter.runs(), 2);
}

#[tokio::test]
async fn a_late_retry_through_batched_claims_is_410_and_runs_nothing() {
    let schema = TestSchema::new();
    let store = store(&schema, Duration::from_secs(3600))
        .await
        .with_batched_claims(2, 64);
    let (router, counter) = app(IdempotencyLayer::new(store.clone()).ttl(TTL));
    assert_eq!(send(&router, post("k", "{}")).await.status, 201);
    tokio::time::sleep(AFTER_TTL).await;
    for purged in [false, true] {
        if purged {
            assert_eq!(store.purge_expired(100).await.unwrap(), 1);
        }
        let late = send(&router, post("k", "{}")).await;
        assert_eq!(late.status, 410, "purged {purged}");
    }
    assert_eq!(counter.runs(), 1);
}

#[tokio::test]
async fn a_late_retry_in_transactional_mode_is_410_and_writes_nothing() {
    let schema = TestSchema::new();
    let store = store(&schema, Duration::from_secs(3600)).await;
    let table = common::ledger::setup(&schema, &store).await;
    let layer = IdempotencyLayer::transactional(store.clone()).ttl(TTL);
    let (router, counter) = common::ledger::app(layer, &table);
    let first = send(&router, common::ledger::post_with("k", &[])).await;
    assert_eq!(first.status, 201);
    tokio::time::sleep(AFTER_TTL).await;
    for purged in [false, true] {
        if purged {
            assert_eq!(store.purge_expired(100).await.unwrap(), 1);
        }
        let late = send(&router, common::ledger::post_with("k", &[])).await;
        assert_eq!(late.status, 410, "purged {purged}");
        assert_eq!(late.outcome, Some(Outcome::Expired));
    }
    assert_eq!(counter.runs(), 1);
    let rows = schema
        .query(&format!("SELECT count(*) FROM {table} WHERE key = 'k'"))
        .await;
    assert_eq!(rows[0].get::<_, i64>(0), 1, "one write, the first run's");
}

/// The previous release's takeover, as it was sent (its claim is unchanged: this
/// release adds no migration to the plain table), finds nothing to take over in a
/// remembered row: its `expires_at` is when the key is forgotten, so the row reads as
/// unexpired. (Its claim then replays nothing either: a row without headers does not
/// decode, and answers an error, never a run.)
#[tokio::test]
async fn a_store_of_the_previous_release_never_takes_a_remembered_key_over() {
    let schema = TestSchema::new();
    let store = store(&schema, Duration::from_secs(3600)).await;
    let (router, _) = app(IdempotencyLayer::new(store.clone()).ttl(TTL));
    assert_eq!(send(&router, post("k", "{}")).await.status, 201);
    tokio::time::sleep(AFTER_TTL).await;
    assert_eq!(store.purge_expired(100).await.unwrap(), 1);
    let taken = schema
        .query(&format!(
            "UPDATE \"{s}\".idempotency_keys SET token = token + 1, state = 'running',
                    locked_until = now() + interval '1 minute', expires_at = now() + interval '1 day',
                    completed_at = NULL, status = NULL, headers = NULL, body = NULL
             WHERE key = 'k' AND (state = 'completed' OR locked_until <= now())
               AND (expires_at <= now() OR state = 'running')
             RETURNING token",
            s = schema.name
        ))
        .await;
    assert!(
        taken.is_empty(),
        "the previous release took a remembered key over"
    );
    let (state, ..) = row_of(&schema, "k").await.unwrap();
    assert_eq!(state, "completed");
}

#[tokio::test]
async fn a_job_whose_result_expired_is_not_run_again() {
    let store = MemoryStore::new();
    let runner = JobRunner::new(store).ttl(Duration::from_millis(100));
    let scope = Scope::new("consumer");
    let work = |_| async { Ok::<_, std::io::Error>(Bytes::from_static(b"done")) };
    let ran = runner.run(&scope, "msg", b"p", work).await.unwrap();
    assert_eq!(ran, JobOutcome::Ran(Bytes::from_static(b"done")));
    tokio::time::sleep(Duration::from_millis(200)).await;
    let again = runner.run(&scope, "msg", b"p", work).await.unwrap();
    assert!(
        matches!(again, JobOutcome::ResultExpired { completed_at, remembered_until } if completed_at < remembered_until),
        "{again:?}"
    );
}
