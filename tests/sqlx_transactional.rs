//! Transactional mode on sqlx: the layer and the job runner over the app's own
//! `sqlx::PgPool`, the handler writing through a `SqlxTransaction`. The core cases of
//! `tests/transactional.rs`, run through the sqlx driver: one commit for the claim, the
//! handler's writes and the response; a race of duplicates; a connection cut mid
//! handler; a handler that commits itself; one that keeps the connection past the
//! response; a commit whose answer was lost.
#![cfg(feature = "sqlx")]
#![allow(clippy::unwrap_used)] // unwrap in test helpers: a failure is the test failing

mod common;

use std::{sync::Arc, time::Duration};

use axum::{
    Router,
    extract::State,
    http::{HeaderMap, StatusCode},
    response::{IntoResponse, Response},
    routing::post,
};
use bytes::Bytes;
use sqlx::{Acquire as _, Executor as _, PgConnection, PgPool, postgres::PgPoolOptions};
use tower_idempotency::{
    IdempotencyKey, IdempotencyLayer, Outcome, Scope,
    job::{JobError, JobOutcome, JobRunner},
    store::SqlxStore,
    transactional::SqlxTransaction,
};

use common::{
    Counter, TestSchema, database_url, in_flight,
    ledger::{App, post_with, setup},
    pooler_url,
    proxy::PgProxy,
    send, send_bounded,
};

/// A pool of `size` connections to `url`; behind the test pooler (`TI_POOLER_URL`),
/// without prepared statements of its own, as an app behind PgBouncer runs.
async fn pool(url: &str, size: u32) -> PgPool {
    let options: sqlx::postgres::PgConnectOptions = url.parse().unwrap();
    let options = if pooler_url().as_deref() == Some(url) {
        options.statement_cache_capacity(0)
    } else {
        options
    };
    PgPoolOptions::new()
        .max_connections(size)
        .connect_with(options)
        .await
        .expect("pool")
}

/// A migrated sqlx store in `schema` on `size` connections to `url` (through the
/// pooler, if there is one, for the database's own URL), and the ledger table.
async fn store_at(schema: &TestSchema, url: &str, size: u32) -> (SqlxStore, String) {
    store_keeping_at(schema, url, size, 0).await
}

/// [`store_at`], the store keeping up to `kept` connections out of the pool.
async fn store_keeping_at(
    schema: &TestSchema,
    url: &str,
    size: u32,
    kept: usize,
) -> (SqlxStore, String) {
    let table = setup(schema, &schema.store_direct(1).await).await;
    let store = match pooler_url() {
        Some(pooler) if url == database_url() => SqlxStore::new(pool(&pooler, size).await)
            .with_transaction_pooling(true)
            .with_notification_pool(pool(&database_url(), 1).await),
        _ => SqlxStore::new(pool(url, size).await),
    };
    let store = store
        .with_kept_connections(kept)
        .with_schema_name(&schema.name)
        .unwrap();
    store.migrate().await.unwrap();
    (store, table)
}

async fn count(schema: &TestSchema, sql: &str) -> i64 {
    schema.query(sql).await[0].get(0)
}

async fn rows_in(schema: &TestSchema, table: &str) -> i64 {
    count(schema, &format!("SELECT count(*) FROM {table}")).await
}

/// The app's repository, written for any sqlx connection or transaction. Its
/// statements unnamed (`persistent(false)`), as behind a transaction pooler they must
/// be: one server session serves many clients' transactions.
async fn insert_row(db: &mut PgConnection, table: &str, key: &str, run: usize, body: &str) {
    sqlx::query(&format!(
        "INSERT INTO {table} (key, run, body) VALUES ($1, $2, $3)"
    ))
    .persistent(false)
    .bind(key)
    .bind(run as i32)
    .bind(body)
    .execute(db)
    .await
    .unwrap();
}

/// Writes one ledger row per run in the request's transaction, through a
/// `SqlxTransaction`. Headers steer it: `x-end: commit` (then `COMMIT` on the
/// connection), `x-savepoint` (the row written by a helper in a `begin()`/`commit()` of
/// sqlx's own), `x-keep` (a spawned task keeps the connection past the response, in
/// `pg_sleep(1.5)`), `x-delay-ms`, `x-status`, `x-panic`.
async fn create(
    State(app): State<App>,
    key: IdempotencyKey,
    tx: SqlxTransaction,
    headers: HeaderMap,
) -> Response {
    let run = app.counter.count_run();
    // A charge recorded as a step, apart from the transaction: a retry after a
    // rollback gets the first run's charge, not a new one.
    let charged = if headers.contains_key("x-step") {
        let charging = || async { Ok::<_, std::convert::Infallible>(run) };
        match key.try_step("charge", charging).await {
            Ok(charge) => Some(charge),
            Err(e) => return (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
        }
    } else {
        None
    };
    if headers.contains_key("x-keep") {
        let (holding, held) = tokio::sync::oneshot::channel();
        let table = app.table.clone();
        tokio::spawn(async move {
            let mut conn = tx.connection().await.unwrap();
            let _ = holding.send(());
            insert_row(&mut conn, &table, key.as_str(), run, "kept").await;
            let _ = sqlx::query("SELECT pg_sleep(1.5)")
                .execute(&mut *conn)
                .await;
            drop(conn);
            tokio::time::sleep(Duration::from_secs(600)).await;
            drop(tx);
        });
        held.await.unwrap();
        return (StatusCode::CREATED, "{}").into_response();
    }
    {
        let mut conn = tx.connection().await.unwrap();
        if headers.contains_key("x-savepoint") {
            let mut own = conn.begin().await.unwrap();
            insert_row(&mut own, &app.table, key.as_str(), run, "savepoint").await;
            own.commit().await.unwrap();
        } else {
            let inserted = sqlx::query(&format!(
                "INSERT INTO {} (key, run, body) VALUES ($1, $2, '')",
                app.table
            ))
            .persistent(false)
            .bind(key.as_str())
            .bind(run as i32)
            .execute(&mut *conn)
            .await;
            if let Err(e) = inserted {
                return (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response();
            }
        }
        if headers.get("x-end").is_some_and(|v| v == "commit") {
            // Through the connection's own `Executor` (whose future is `Send` in a
            // handler, which `RawSql::execute`'s is not).
            conn.execute("COMMIT").await.unwrap();
        }
    }
    if let Some(ms) = headers
        .get("x-delay-ms")
        .and_then(|v| v.to_str().ok()?.parse().ok())
    {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    app.counter.count_finished();
    if headers.contains_key("x-panic") {
        panic!("handler panicked on purpose");
    }
    let status = headers
        .get("x-status")
        .and_then(|v| v.to_str().ok()?.parse().ok())
        .and_then(|s| StatusCode::from_u16(s).ok())
        .unwrap_or(StatusCode::CREATED);
    match charged {
        Some(charge) => (status, format!("{{\"run\":{run},\"charge\":{charge}}}")),
        None => (status, format!("{{\"run\":{run}}}")),
    }
    .into_response()
}

fn app(layer: IdempotencyLayer, table: &str) -> (Router, Counter) {
    common::ledger::app_on(post(create), layer, table)
}

#[tokio::test]
async fn the_claim_the_handler_s_writes_and_the_response_commit_together() {
    let schema = TestSchema::new();
    let (store, table) = store_at(&schema, &database_url(), 4).await;
    let (router, counter) = app(IdempotencyLayer::transactional(store), &table);
    let first = send(&router, post_with("k", &[])).await;
    assert_eq!(first.status, 201, "{:?}", first.body);
    assert_eq!(first.outcome, Some(Outcome::Executed));
    assert_eq!(rows_in(&schema, &table).await, 1);
    let completed = format!(
        "SELECT count(*) FROM \"{}\".idempotency_keys WHERE key = 'k' AND state = 'completed' AND status = 201",
        schema.name
    );
    assert_eq!(count(&schema, &completed).await, 1);
    let retry = send(&router, post_with("k", &[])).await;
    assert_eq!(retry.outcome, Some(Outcome::Replayed));
    assert_eq!(retry.body, first.body);
    assert_eq!(counter.runs(), 1);
}

/// A helper that opens a transaction of its own with sqlx's `begin()` gets a savepoint
/// inside the request's transaction: its `commit()` releases it, and its row commits
/// with the stored response.
#[tokio::test]
async fn sqlx_s_own_begin_in_the_handler_is_a_savepoint_of_the_request_s_transaction() {
    let schema = TestSchema::new();
    let (store, table) = store_at(&schema, &database_url(), 4).await;
    let (router, counter) = app(IdempotencyLayer::transactional(store), &table);
    let first = send(&router, post_with("k", &[("x-savepoint", "1")])).await;
    assert_eq!(first.status, 201, "{:?}", first.body);
    assert_eq!(first.outcome, Some(Outcome::Executed));
    // Rolled back with it too: the same helper, then a 500.
    let failed = send(
        &router,
        post_with("other", &[("x-savepoint", "1"), ("x-status", "500")]),
    )
    .await;
    assert_eq!(failed.status, 500);
    assert_eq!(rows_in(&schema, &table).await, 1);
    assert_eq!(counter.runs(), 2);
}

/// A step recorded apart from the request's transaction: the rollback keeps it, the
/// retry gets it without running it again, and the commit forgets it.
#[tokio::test]
async fn a_rolled_back_transaction_keeps_its_recorded_step_and_the_commit_forgets_it() {
    let schema = TestSchema::new();
    let (store, table) = store_at(&schema, &database_url(), 4).await;
    let (router, counter) = app(IdempotencyLayer::transactional(store), &table);
    let steps = format!(
        "SELECT count(*) FROM \"{}\".idempotency_keys_steps",
        schema.name
    );
    let failed = send(
        &router,
        post_with("k", &[("x-step", "1"), ("x-status", "500")]),
    )
    .await;
    assert_eq!(failed.status, 500);
    assert_eq!(
        count(&schema, &steps).await,
        1,
        "the rollback kept the step: {:?}",
        String::from_utf8_lossy(&failed.body)
    );
    let retry = send(&router, post_with("k", &[("x-step", "1")])).await;
    assert_eq!(retry.status, 201, "{:?}", retry.body);
    assert_eq!(retry.json()["run"], 2);
    assert_eq!(
        retry.json()["charge"],
        1,
        "the first run's charge, recorded"
    );
    assert_eq!(
        count(&schema, &steps).await,
        0,
        "the commit forgets the steps"
    );
    assert_eq!(counter.runs(), 2);
    assert_eq!(rows_in(&schema, &table).await, 1);
}

/// 40 requests with one key at once: one runs and commits, the others wait on its
/// uncommitted row and replay its response.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_duplicates_run_once_and_replay_the_commit() {
    concurrent_duplicates(0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_duplicates_run_once_and_replay_the_commit_on_kept_connections() {
    concurrent_duplicates(2).await;
}

async fn concurrent_duplicates(kept: usize) {
    let schema = TestSchema::new();
    let (store, table) = store_keeping_at(&schema, &database_url(), 16, kept).await;
    let layer = IdempotencyLayer::transactional(store).wait_for_running(Duration::from_secs(10));
    let (router, counter) = app(layer, &table);
    let barrier = Arc::new(tokio::sync::Barrier::new(40));
    let tasks: Vec<_> = (0..40)
        .map(|_| {
            let (router, barrier) = (router.clone(), barrier.clone());
            tokio::spawn(async move {
                let r = post_with("race", &[("x-delay-ms", "200")]);
                barrier.wait().await;
                send(&router, r).await
            })
        })
        .collect();
    let mut replies = Vec::new();
    for t in tasks {
        replies.push(t.await.unwrap());
    }
    assert!(
        replies.iter().all(|r| r.status == 201),
        "{:?}",
        replies.iter().map(|r| r.status).collect::<Vec<_>>()
    );
    let executed = replies
        .iter()
        .filter(|r| r.outcome == Some(Outcome::Executed))
        .count();
    assert_eq!(executed, 1);
    assert!(replies.iter().all(|r| r.body == replies[0].body));
    assert_eq!(counter.runs(), 1, "the handler ran more than once");
    assert_eq!(rows_in(&schema, &table).await, 1);
}

/// Not told to wait, a duplicate waits on the first request's uncommitted row a
/// moment, then gets 409; once the first commits, a retry replays it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_duplicate_of_a_running_request_gets_409_then_the_replay() {
    let schema = TestSchema::new();
    let (store, table) = store_at(&schema, &database_url(), 4).await;
    let (router, counter) = app(IdempotencyLayer::transactional(store), &table);
    let first = in_flight(&router, post_with("k", &[("x-delay-ms", "1000")]), &counter).await;
    let duplicate = send(&router, post_with("k", &[])).await;
    assert_eq!(duplicate.status, 409, "{:?}", duplicate.body);
    assert_eq!(duplicate.problem(), "in-progress");
    let first = first.await.unwrap();
    assert_eq!(first.status, 201);
    let retry = send(&router, post_with("k", &[])).await;
    assert_eq!(retry.outcome, Some(Outcome::Replayed));
    assert_eq!(retry.body, first.body);
    assert_eq!(counter.runs(), 1);
}

#[tokio::test]
async fn a_handler_error_or_panic_rolls_back_and_frees_the_key() {
    let schema = TestSchema::new();
    let (store, table) = store_at(&schema, &database_url(), 4).await;
    let (router, counter) = app(IdempotencyLayer::transactional(store), &table);
    let failed = send(&router, post_with("k", &[("x-status", "500")])).await;
    assert_eq!(failed.status, 500);
    let panicked = send(&router, post_with("k", &[("x-panic", "1")])).await;
    assert_eq!(panicked.status, 500);
    assert_eq!(panicked.problem(), "handler-failed");
    assert_eq!(
        rows_in(&schema, &table).await,
        0,
        "the writes were rolled back"
    );
    let retry = send(&router, post_with("k", &[])).await;
    assert_eq!(retry.status, 201);
    assert_eq!(retry.outcome, Some(Outcome::Executed));
    assert_eq!(counter.runs(), 3);
    assert_eq!(rows_in(&schema, &table).await, 1);
}

/// The connection cut while the handler runs: nothing of its transaction is kept,
/// and the retry runs clean.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_connection_cut_mid_handler_rolls_back_and_the_retry_runs_clean() {
    cut_mid_handler(0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_connection_cut_mid_handler_rolls_back_and_the_retry_runs_clean_on_kept_connections() {
    cut_mid_handler(2).await;
}

async fn cut_mid_handler(kept: usize) {
    let schema = TestSchema::new();
    let proxy = PgProxy::start().await;
    let (store, table) = store_keeping_at(&schema, &proxy.url(), 2, kept).await;
    let (router, counter) = app(IdempotencyLayer::transactional(store), &table);
    let first = in_flight(&router, post_with("k", &[("x-delay-ms", "300")]), &counter).await;
    proxy.cut();
    let first = first.await.unwrap();
    assert!(
        (first.status == 503 && first.problem() == "not-committed") || first.status == 500,
        "{} {:?}",
        first.status,
        first.body
    );
    assert_eq!(rows_in(&schema, &table).await, 0);
    let retry = common::retry_until_created_with(&router, || post_with("k", &[]), &[503]).await;
    assert_eq!(retry.outcome, Some(Outcome::Executed));
    assert_eq!(rows_in(&schema, &table).await, 1);
}

/// A handler that sends `COMMIT` itself: its row committed without the response, so
/// the key is completed with `500 transaction-ended`, and a retry replays that.
///
/// Behind a transaction pooler (the suite's second run), the session goes back to the
/// pooler with the handler's `COMMIT`: the layer finds its transaction ended before it
/// sends a statement of two exchanges, which the pooler could give to two sessions.
#[tokio::test]
async fn a_handler_that_commits_itself_gets_transaction_ended_and_runs_once() {
    commits_itself(0, &[]).await;
}

/// On a kept connection, which serves the requests after it once the layer's
/// `ROLLBACK` has ended what is left of the transaction on it.
#[tokio::test]
async fn a_handler_that_commits_itself_gets_transaction_ended_and_runs_once_on_kept_connections() {
    commits_itself(2, &[]).await;
}

/// Then answers 500, which the layer rolls back: the check that goes with its
/// `ROLLBACK` finds the transaction ended.
#[tokio::test]
async fn a_handler_that_commits_then_answers_500_gets_transaction_ended_and_runs_once() {
    commits_itself(2, &[("x-status", "500")]).await;
}

/// With a step recorded, which the commit forgets in the transaction: not in one that
/// has ended.
#[tokio::test]
async fn a_handler_with_a_step_that_commits_itself_gets_transaction_ended_and_runs_once() {
    commits_itself(2, &[("x-step", "1")]).await;
}

async fn commits_itself(kept: usize, headers: &[(&str, &str)]) {
    let schema = TestSchema::new();
    let (store, table) = store_keeping_at(&schema, &database_url(), 4, kept).await;
    let (router, counter) = app(IdempotencyLayer::transactional(store), &table);
    let headers = [&[("x-end", "commit")], headers].concat();
    let first = send_bounded(&router, post_with("k", &headers)).await;
    assert_eq!(first.status, 500, "{:?}", first.body);
    assert_eq!(first.problem(), "transaction-ended");
    let retry = send_bounded(&router, post_with("k", &headers)).await;
    assert_eq!(retry.outcome, Some(Outcome::Replayed));
    assert_eq!(retry.body, first.body);
    assert_eq!(counter.runs(), 1, "the handler ran once");
    assert_eq!(rows_in(&schema, &table).await, 1, "its own COMMIT stays");
    // The connections lent since serve as any other.
    let next = send_bounded(&router, post_with("k2", &[])).await;
    assert_eq!(next.status, 201, "{:?}", next.body);
    assert_eq!(rows_in(&schema, &table).await, 2);
}

/// Work that keeps the transaction's connection past the response: the layer ends the
/// transaction on the server, so nothing of it commits and a retry runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_connection_kept_past_the_response_does_not_hold_the_key() {
    kept_past_the_response(0).await;
}

/// On a kept connection, which the layer's end of the transaction closes: it is not
/// lent again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_connection_kept_past_the_response_does_not_hold_the_key_on_kept_connections() {
    kept_past_the_response(2).await;
}

async fn kept_past_the_response(kept: usize) {
    let schema = TestSchema::new();
    let (store, table) = store_keeping_at(&schema, &database_url(), 2, kept).await;
    let layer = IdempotencyLayer::transactional(store.clone())
        .store_timeout(Duration::from_millis(500))
        .lock_timeout(Duration::from_millis(200));
    let (router, counter) = app(layer, &table);
    let first = send(&router, post_with("k", &[("x-keep", "1")])).await;
    assert_eq!(first.status, 500, "{:?}", first.body);
    assert_eq!(first.problem(), "handler-failed");
    let started = std::time::Instant::now();
    let mut statuses = Vec::new();
    let retry = loop {
        let r = send(&router, post_with("k", &[])).await;
        statuses.push(r.status.as_u16());
        if r.status != 409 || started.elapsed() > Duration::from_secs(10) {
            break r;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(retry.status, 201, "{statuses:?}");
    assert_eq!(retry.outcome, Some(Outcome::Executed));
    assert_eq!(counter.runs(), 2);
    let kept_write = format!("SELECT count(*) FROM {table} WHERE body = 'kept'");
    assert_eq!(
        count(&schema, &kept_write).await,
        0,
        "the kept write rolled back"
    );
    assert_eq!(rows_in(&schema, &table).await, 1);
    // The ended session is not lent again: the requests after it run.
    for i in 0..4 {
        let r = send(&router, post_with(&format!("after-{i}"), &[])).await;
        assert_eq!(r.status, 201, "{:?}", r.body);
    }
    assert_eq!(rows_in(&schema, &table).await, 5);
    assert!(store.kept_connections() <= kept);
}

/// A `COMMIT` whose answer is lost: the layer checks on another connection, and tells
/// the client it committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_commit_whose_answer_was_lost_is_checked_before_the_client_is_told() {
    let schema = TestSchema::new();
    let proxy = PgProxy::start().await;
    let (store, table) = store_at(&schema, &proxy.url(), 2).await;
    let (router, counter) = app(IdempotencyLayer::transactional(store), &table);
    let commits = proxy.commits();
    let first = in_flight(&router, post_with("k", &[("x-delay-ms", "300")]), &counter).await;
    proxy.lose_next_commit_reply();
    let first = first.await.unwrap();
    assert_eq!(first.status, 201, "{:?}", first.body);
    assert_eq!(first.outcome, Some(Outcome::Executed));
    assert_eq!(proxy.commits() - commits, 1, "one COMMIT, the request's");
    assert_eq!(rows_in(&schema, &table).await, 1);
    let retry = send(&router, post_with("k", &[])).await;
    assert_eq!(retry.outcome, Some(Outcome::Replayed));
    assert_eq!(retry.body, first.body);
    assert_eq!(counter.runs(), 1);
}

/// A job runner over the app's pool: the work writes in the transaction that claims
/// its key, and its result commits with it; a failed work rolls back.
#[tokio::test]
async fn a_transactional_job_on_sqlx_commits_its_writes_with_its_result() {
    let schema = TestSchema::new();
    let (store, table) = store_at(&schema, &database_url(), 4).await;
    let runner = JobRunner::transactional(store);
    let scope = Scope::new("consumer");
    let work = |fail: bool| {
        let table = table.clone();
        move |ctx: tower_idempotency::job::JobContext| async move {
            let tx = ctx.sqlx_transaction.expect("a sqlx transaction");
            let mut conn = tx.connection().await.unwrap();
            insert_row(&mut conn, &table, ctx.key.as_str(), 1, "job").await;
            if fail {
                return Err("failed on purpose");
            }
            Ok(Bytes::from_static(b"done"))
        }
    };
    let failed = runner.run(&scope, "job-1", b"input", work(true)).await;
    assert!(matches!(failed, Err(JobError::Failed(_))), "{failed:?}");
    assert_eq!(rows_in(&schema, &table).await, 0, "rolled back");
    let ran = runner
        .run(&scope, "job-1", b"input", work(false))
        .await
        .unwrap();
    assert_eq!(ran, JobOutcome::Ran(Bytes::from_static(b"done")));
    let again = runner
        .run(&scope, "job-1", b"input", work(false))
        .await
        .unwrap();
    assert_eq!(again, JobOutcome::AlreadyDone(Bytes::from_static(b"done")));
    assert_eq!(rows_in(&schema, &table).await, 1);
}

/// The claim's wait and the handler's are bounded apart on sqlx too: a duplicate told
/// to wait waits on the first request's row past `lock_timeout` and replays its answer,
/// while the handler's own statements run under `lock_timeout`, which the claim set.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_duplicate_waits_past_the_lock_timeout_which_the_handler_runs_under() {
    let schema = TestSchema::new();
    let (store, table) = store_at(&schema, &database_url(), 4).await;
    let layer = IdempotencyLayer::transactional(store)
        .lock_timeout(Duration::from_millis(100))
        .wait_for_running(Duration::from_secs(30));
    let handler = |State(app): State<App>, tx: SqlxTransaction, headers: HeaderMap| async move {
        let run = app.counter.count_run();
        let mut conn = tx.connection().await.expect("transaction");
        let lock_timeout: String = sqlx::query_scalar("SHOW lock_timeout")
            .persistent(false)
            .fetch_one(&mut *conn)
            .await
            .unwrap();
        drop(conn);
        if headers.contains_key("x-held") {
            app.counter.held().await;
        }
        (StatusCode::CREATED, format!("{run} {lock_timeout}"))
    };
    let (router, counter) = common::ledger::app_on(post(handler), layer, &table);
    let first = in_flight(&router, post_with("k", &[("x-held", "1")]), &counter).await;
    let dup = tokio::spawn({
        let router = router.clone();
        async move { send(&router, post_with("k", &[])).await }
    });
    schema.wait_for_lock_waiters(1).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !dup.is_finished(),
        "the duplicate stopped waiting at the lock timeout"
    );
    counter.let_go(1);
    let first = first.await.unwrap();
    let dup = dup.await.unwrap();
    assert_eq!(first.status, 201);
    assert_eq!(first.body, "1 100ms");
    assert_eq!(dup.outcome, Some(Outcome::Replayed));
    assert_eq!(dup.body, first.body);
    assert_eq!(counter.runs(), 1);
}

/// A table in generations serves transactional mode on sqlx too: the claim, the
/// handler's row and the response commit together into the current generation, the
/// key is replayed across a rotation, and it stays one row in all generations.
#[tokio::test]
async fn a_table_in_generations_commits_and_replays_across_a_rotation() {
    let schema = TestSchema::new();
    let (plain, table) = store_at(&schema, &database_url(), 4).await;
    let store = SqlxStore::new(plain.pool().clone())
        .with_transaction_pooling(pooler_url().is_some())
        .with_schema_name(&schema.name)
        .unwrap()
        .with_table_name("keys_in_generations")
        .unwrap()
        .with_background_purge(None)
        .with_generations(Duration::from_millis(1));
    store.migrate().await.unwrap();
    let (router, counter) = app(IdempotencyLayer::transactional(store.clone()), &table);
    let first = send(&router, post_with("k", &[])).await;
    assert_eq!(first.status, 201, "{:?}", first.body);
    let rotation = store.rotate_generations().await.unwrap();
    assert!(rotation.started.is_some(), "{rotation:?}");
    let retry = send(&router, post_with("k", &[])).await;
    assert_eq!(retry.outcome, Some(Outcome::Replayed));
    assert_eq!(retry.body, first.body);
    let second = send(&router, post_with("k2", &[])).await;
    assert_eq!(second.status, 201, "{:?}", second.body);
    assert_eq!(counter.runs(), 2);
    assert_eq!(rows_in(&schema, &table).await, 2);
    let rows = format!(
        "SELECT count(*) FROM \"{}\".keys_in_generations WHERE key IN ('k', 'k2') AND state = 'completed'",
        schema.name
    );
    assert_eq!(count(&schema, &rows).await, 2);
}
