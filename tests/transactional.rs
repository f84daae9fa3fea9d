//! Transactional mode: the claim, the handler's writes and the stored response commit
//! together; crashes and failures roll all of it back.

#![allow(clippy::unwrap_used)] // unwrap in test helpers: a failure is the test failing

mod common;

use std::{sync::Arc, time::Duration};

use axum::{
    Router,
    body::{Body, Bytes},
    extract::State,
    http::{HeaderMap, StatusCode},
    response::{IntoResponse, Response},
    routing::{MethodRouter, post},
};
use common::{
    Counter, Reply, TestSchema, eventually, in_flight,
    ledger::{
        App, abandoned_claim_stops_waiting, app, app_on, create, post_body, post_with, setup,
    },
    proxy::PgProxy,
    req, send,
};
use tower_idempotency::{
    IdempotencyKey, IdempotencyLayer, Outcome, ShutdownHandle, store::PostgresStore,
    transactional::TransactionHandle,
};

/// Counts a run and writes its row into the ledger, in the request's transaction.
async fn write_a_row(app: &App, key: &IdempotencyKey, tx: &TransactionHandle) -> usize {
    let run = app.counter.count_run();
    let client = tx.client().await.expect("transaction");
    let insert = format!(
        "INSERT INTO {} (key, run, body) VALUES ($1, $2, '')",
        app.table
    );
    client
        .execute(&insert, &[&key.as_str(), &(run as i32)])
        .await
        .unwrap();
    run
}

/// A store of `size` connections that reach PostgreSQL through a [`PgProxy`], and the
/// ledger table.
async fn through_proxy(schema: &TestSchema, size: usize) -> (PgProxy, PostgresStore, String) {
    let proxy = PgProxy::start().await;
    let store = schema.store_at(&proxy.url(), size).await;
    let table = setup(schema, &store).await;
    (proxy, store, table)
}

async fn count(schema: &TestSchema, sql: &str) -> i64 {
    schema.query(sql).await[0].get(0)
}

/// How many rows the handlers wrote to `table`.
async fn rows_in(schema: &TestSchema, table: &str) -> i64 {
    count(schema, &format!("SELECT count(*) FROM {table}")).await
}

/// How many records of `key` the store's table holds.
async fn records_of(schema: &TestSchema, key: &str) -> i64 {
    let sql = format!(
        "SELECT count(*) FROM \"{}\".idempotency_keys WHERE key = '{key}'",
        schema.name
    );
    count(schema, &sql).await
}

#[tokio::test]
async fn a_new_key_commits_its_writes_and_response_together_in_one_commit() {
    let schema = TestSchema::new();
    let (proxy, store, table) = through_proxy(&schema, 1).await;
    let (router, counter) = app(IdempotencyLayer::transactional(store), &table);
    // Warm the connection's statement cache.
    assert_eq!(send(&router, post_with("warm-up", &[])).await.status, 201);

    let (commits, statements) = (proxy.commits(), proxy.executes());
    let first = send(&router, post_with("k", &[])).await;
    assert_eq!(first.status, 201);
    assert_eq!(first.outcome, Some(Outcome::Executed));
    assert_eq!(proxy.commits() - commits, 1, "one commit per new key");
    // BEGIN with its settings and claim (one round trip; the claim sets the handler's
    // lock timeout itself), the handler's INSERT, completion and COMMIT (one round
    // trip).
    assert_eq!(proxy.executes() - statements, 5);

    let commits = proxy.commits();
    let replay = send(&router, post_with("k", &[])).await;
    assert_eq!(replay.outcome, Some(Outcome::Replayed));
    assert_eq!(replay.body, first.body);
    assert_eq!(proxy.commits(), commits, "a replay commits nothing");
    assert_eq!(counter.runs(), 2);
    assert_eq!(
        count(
            &schema,
            &format!("SELECT count(*) FROM {table} WHERE key = 'k'")
        )
        .await,
        1
    );
}

/// The longest settings are taken as the longest PostgreSQL can hold: `lock_timeout`
/// is capped at its own limit, not sent as a number it refuses on every request.
#[tokio::test]
async fn the_longest_settings_still_serve() {
    let schema = TestSchema::new();
    let store = schema.store().await;
    let table = setup(&schema, &store).await;
    let max = Duration::MAX;
    let layer = IdempotencyLayer::transactional(store.clone())
        .lock_timeout(max)
        .store_timeout(max)
        .ttl(max);
    let (router, counter) = app(layer, &table);
    let first = send(&router, post_with("k", &[])).await;
    assert_eq!(first.status, 201);
    let retry = send(&router, post_with("k", &[])).await;
    assert_eq!(retry.outcome, Some(Outcome::Replayed));
    assert_eq!(counter.runs(), 1);
    common::idle(&store).await;
}

/// The TTL counts from completion, not from the claim: a handler that runs for longer
/// than the TTL still leaves a response to replay, rather than a record that commits
/// already expired, which a retry would take over and run again.
#[tokio::test]
async fn the_ttl_counts_from_the_commit_not_from_the_claim() {
    let schema = TestSchema::new();
    let store = schema.store().await;
    let table = setup(&schema, &store).await;
    let layer = IdempotencyLayer::transactional(store.clone()).ttl(Duration::from_secs(3));
    let (router, counter) = app(layer, &table);
    let first = send(&router, post_with("k", &[("x-delay-ms", "3300")])).await;
    assert_eq!(first.status, 201);
    let expires_in: f64 = schema
        .query(&format!(
            "SELECT extract(epoch FROM expires_at - now())::float8 FROM \"{}\".idempotency_keys WHERE key = 'k'",
            schema.name
        ))
        .await[0]
        .get(0);
    assert!(
        expires_in > 0.0,
        "the record committed already expired ({expires_in:.3} s)"
    );
    let retry = send(&router, post_with("k", &[])).await;
    assert_eq!(retry.outcome, Some(Outcome::Replayed));
    assert_eq!(retry.body, first.body);
    assert_eq!(counter.runs(), 1);
    common::idle(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_hundred_concurrent_duplicates_write_one_row() {
    concurrent_duplicates_write_one_row(&common::database_url()).await;
}

/// Where every transaction defaults to serializable, a duplicate blocked on the first
/// request's row fails with a serialization failure when that row commits: it looks
/// again in a new transaction and replays, rather than answering 503.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn duplicates_replay_where_transactions_default_to_serializable() {
    concurrent_duplicates_write_one_row(&common::serializable_url()).await;
}

/// 200 requests with one key at once, on a store connected to `url`: one runs, the
/// others get its response or 409, and its one row is written once.
async fn concurrent_duplicates_write_one_row(url: &str) {
    let schema = TestSchema::new();
    let store = schema.store_at(url, 32).await;
    let table = setup(&schema, &store).await;
    let (router, counter) = app(IdempotencyLayer::transactional(store), &table);
    let barrier = Arc::new(tokio::sync::Barrier::new(200));
    let tasks: Vec<_> = (0..200)
        .map(|_| {
            let (router, barrier) = (router.clone(), barrier.clone());
            tokio::spawn(async move {
                let r = post_with("race", &[("x-delay-ms", "200")]);
                barrier.wait().await;
                send(&router, r).await
            })
        })
        .collect();
    let mut created = Vec::new();
    for t in tasks {
        let r = t.await.unwrap();
        match r.status.as_u16() {
            201 => created.push(r),
            409 => assert_eq!(r.problem(), "in-progress"),
            other => panic!("unexpected {other}: {:?}", r.body),
        }
    }
    assert_eq!(counter.runs(), 1, "the handler ran more than once");
    assert!(created.iter().all(|r| r.body == created[0].body));
    assert_eq!(
        created
            .iter()
            .filter(|r| r.outcome == Some(Outcome::Executed))
            .count(),
        1
    );
    assert_eq!(rows_in(&schema, &table).await, 1);
}

#[tokio::test]
async fn a_handler_error_rolls_back_its_writes_and_frees_the_key() {
    let schema = TestSchema::new();
    let store = schema.store().await;
    let table = setup(&schema, &store).await;
    let (router, counter) = app(IdempotencyLayer::transactional(store), &table);
    let failed = send(&router, post_with("k", &[("x-status", "500")])).await;
    assert_eq!(failed.status, 500);
    assert_eq!(
        rows_in(&schema, &table).await,
        0,
        "the write was rolled back"
    );
    assert_eq!(
        records_of(&schema, "k").await,
        0,
        "the claim was rolled back"
    );

    let retry = send(&router, post_with("k", &[])).await;
    assert_eq!(retry.status, 201);
    assert_eq!(retry.outcome, Some(Outcome::Executed));
    assert_eq!(counter.runs(), 2);
    assert_eq!(rows_in(&schema, &table).await, 1);
}

/// The app's repository, written for any `deadpool_postgres` client or transaction.
async fn insert_row(
    db: &impl tower_idempotency::deadpool_postgres::GenericClient,
    table: &str,
    key: &str,
) -> Result<u64, tokio_postgres::Error> {
    let insert = format!("INSERT INTO {table} (key, run, body) VALUES ($1, 1, '')");
    db.execute(&insert, &[&key]).await
}

/// The app's repository, written for any `tokio_postgres` client or transaction.
async fn rows_of(
    db: &impl tower_idempotency::tokio_postgres::GenericClient,
    table: &str,
    key: &str,
) -> Result<i64, tokio_postgres::Error> {
    let count = format!("SELECT count(*) FROM {table} WHERE key = $1");
    Ok(db.query_one(&count, &[&key]).await?.get(0))
}

/// Helpers written against either crate's `GenericClient`, handed the transaction's
/// client, run in the request's transaction: their write commits with a stored
/// response, and rolls back with one the storage policy releases.
#[tokio::test]
async fn helpers_written_against_generic_client_write_in_the_request_s_transaction() {
    let schema = TestSchema::new();
    let store = schema.store().await;
    let table = setup(&schema, &store).await;
    let handler = |State(app): State<App>,
                   key: IdempotencyKey,
                   tx: TransactionHandle,
                   headers: HeaderMap| async move {
        let client = tx.client().await.expect("transaction");
        insert_row(client.as_deadpool(), &app.table, key.as_str())
            .await
            .unwrap();
        // The helper sees the write: the same connection, the same transaction.
        let seen = rows_of(client.as_tokio_postgres(), &app.table, key.as_str())
            .await
            .unwrap();
        let status = if headers.contains_key("x-fail") {
            StatusCode::SERVICE_UNAVAILABLE
        } else {
            StatusCode::CREATED
        };
        (status, seen.to_string())
    };
    let (router, _) = app_on(
        post(handler),
        IdempotencyLayer::transactional(store.clone()),
        &table,
    );

    let created = send(&router, post_with("kept", &[])).await;
    assert_eq!(
        (created.status, &created.body[..]),
        (StatusCode::CREATED, &b"1"[..])
    );
    let replay = send(&router, post_with("kept", &[])).await;
    assert_eq!(replay.outcome, Some(Outcome::Replayed));
    assert_eq!(replay.body, created.body);

    let failed = send(&router, post_with("released", &[("x-fail", "1")])).await;
    assert_eq!(failed.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(failed.body, "1", "the helper saw its own write");
    let written = format!("SELECT key FROM {table} ORDER BY key");
    let keys: Vec<String> = schema
        .query(&written)
        .await
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(
        keys,
        ["kept"],
        "the released request's write was rolled back"
    );
    assert_eq!(records_of(&schema, "released").await, 0);
    common::idle(&store).await;
}

/// Inserts the payment id the body names into `app.table` (its primary key) in the
/// request's transaction and answers 201; an id already taken answers 409, from the
/// aborted transaction, as a payments API would. With `x-savepoint` the insert runs under
/// a savepoint, rolled back to if it fails, so the transaction stays usable. With
/// `x-ignore-errors` it answers 201 whatever the insert did. `x-backend` names the
/// connection's backend.
async fn create_once_per_id(
    State(app): State<App>,
    tx: TransactionHandle,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    app.counter.count_run();
    let client = tx.client().await.expect("transaction");
    let backend: i32 = client
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    let id = String::from_utf8_lossy(&body).into_owned();
    let savepoint = headers.contains_key("x-savepoint");
    if savepoint {
        client.batch_execute("SAVEPOINT payment").await.unwrap();
    }
    let inserted = client
        .execute(
            &format!("INSERT INTO {} (id) VALUES ($1)", app.table),
            &[&id],
        )
        .await;
    if savepoint && inserted.is_err() {
        client
            .batch_execute("ROLLBACK TO SAVEPOINT payment")
            .await
            .unwrap();
    }
    let status = match inserted {
        Ok(_) => StatusCode::CREATED,
        Err(_) if headers.contains_key("x-ignore-errors") => StatusCode::CREATED,
        Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::UNIQUE_VIOLATION) => {
            StatusCode::CONFLICT
        }
        Err(_) => StatusCode::INTERNAL_SERVER_ERROR,
    };
    (status, [("x-backend", backend.to_string())], id).into_response()
}

/// A pool of one connection, and a table of payment ids where `taken` is already in.
async fn once_per_id(schema: &TestSchema, taken: &str) -> (Router, Counter, PostgresStore) {
    let store = schema.store_at(&common::database_url(), 1).await;
    let table = format!("\"{}\".payment_ids", schema.name);
    schema
        .query(&format!("CREATE TABLE {table} (id text PRIMARY KEY)"))
        .await;
    schema
        .query(&format!("INSERT INTO {table} VALUES ('{taken}')"))
        .await;
    let counter = Counter::default();
    let router = Router::new()
        .route("/payments", post(create_once_per_id))
        .layer(IdempotencyLayer::transactional(store.clone()))
        .with_state(App {
            counter: counter.clone(),
            table,
        });
    (router, counter, store)
}

#[tokio::test]
async fn a_handler_that_answers_409_after_its_insert_failed_gets_its_409() {
    let schema = TestSchema::new();
    let (router, counter, store) = once_per_id(&schema, "pay_1").await;
    // The insert fails on the primary key, which aborts the transaction; the handler
    // answers 409 from it.
    let first = send(&router, post_body("k1", "pay_1", &[])).await;
    assert_eq!(first.status, 409);
    assert_eq!(first.outcome, Some(Outcome::Released));
    assert_eq!(first.body, "pay_1");
    assert_eq!(records_of(&schema, "k1").await, 0, "nothing was committed");
    // The key is free: the retry runs again, and meets the same answer.
    let retry = send(&router, post_body("k1", "pay_1", &[])).await;
    assert_eq!(retry.status, 409);
    assert_eq!(counter.runs(), 2);
    // The pool's one connection came back clean, and serves the next request.
    let next = send(&router, post_body("k2", "pay_2", &[])).await;
    assert_eq!(next.status, 201);
    // The same server session, unless a transaction pooler lends another.
    if common::pooler_url().is_none() {
        assert_eq!(next.header("x-backend"), first.header("x-backend"));
    }
    let replay = send(&router, post_body("k2", "pay_2", &[])).await;
    assert_eq!(replay.outcome, Some(Outcome::Replayed));
    assert_eq!(counter.runs(), 3);
    common::idle(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_duplicate_that_gets_the_row_after_close_answers_503_and_never_runs() {
    let schema = TestSchema::new();
    let store = schema.store().await;
    let table = setup(&schema, &store).await;
    let layer = IdempotencyLayer::transactional(store.clone());
    let shutdown = layer.shutdown_handle();
    let (router, counter) = app(layer, &table);
    // The first fails, and so rolls back, once the duplicate waits on its row.
    let failing = post_with("k", &[("x-held", "1"), ("x-status", "503")]);
    let first = in_flight(&router, failing, &counter).await;
    let duplicate = tokio::spawn({
        let router = router.clone();
        async move { send(&router, post_with("k", &[])).await }
    });
    schema.wait_for_lock_waiters(1).await;
    shutdown.close();
    counter.let_go(1);
    assert_eq!(first.await.unwrap().status, 503);
    let duplicate = duplicate.await.unwrap();
    assert_eq!(duplicate.status, 503);
    assert_eq!(duplicate.problem(), "shutting-down");
    assert_eq!(counter.runs(), 1);
    assert_eq!(rows_in(&schema, &table).await, 0);
    common::idle(&store).await;
}

/// One shutdown for the whole app: a lease-mode layer on one route and a transactional
/// layer on another, given one handle closed by the app's own `CancellationToken`. The
/// app's cancel closes both layers (new keys on each are refused with `503
/// shutting-down`, claiming nothing); one drain waits for the request running under
/// each, and both complete and are stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_drain_shuts_down_a_lease_mode_and_a_transactional_layer_together() {
    let schema = TestSchema::new();
    let store = schema.store().await;
    let table = setup(&schema, &store).await;
    let cancel = tokio_util::sync::CancellationToken::new();
    let shutdown = ShutdownHandle::closed_by(&cancel);
    let leased = IdempotencyLayer::new(store.clone()).shutdown_with(shutdown.clone());
    let transactional =
        IdempotencyLayer::transactional(store.clone()).shutdown_with(shutdown.clone());
    let counter = Counter::default();
    let lease_handler = |State(app): State<App>, headers: HeaderMap| async move {
        let run = app.counter.count_run();
        if headers.contains_key("x-held") {
            app.counter.held().await;
        }
        (StatusCode::CREATED, format!("{{\"run\":{run}}}"))
    };
    let router = Router::new()
        .route("/leased", post(lease_handler).route_layer(leased))
        .route("/payments", post(create).route_layer(transactional))
        .with_state(App {
            counter: counter.clone(),
            table: table.clone(),
        });
    let to = |path: &str, key: &str, held: bool| {
        let mut b = req("POST").uri(path).header("idempotency-key", key);
        if held {
            b = b.header("x-held", "1");
        }
        b.body(Body::from("{}")).unwrap()
    };
    let running_leased = in_flight(&router, to("/leased", "l", true), &counter).await;
    let running_tx = in_flight(&router, to("/payments", "t", true), &counter).await;
    assert_eq!(shutdown.in_flight(), 2);

    cancel.cancel(); // the app's signal handler
    for (path, key) in [("/leased", "l-new"), ("/payments", "t-new")] {
        let refused = send(&router, to(path, key, false)).await;
        assert_eq!(refused.status, 503, "{path}");
        assert_eq!(refused.problem(), "shutting-down");
        assert_eq!(
            records_of(&schema, key).await,
            0,
            "a refused request claims nothing"
        );
    }
    let drained = tokio::spawn({
        let shutdown = shutdown.clone();
        async move { shutdown.drain().await }
    });
    // However long it is given, the drain does not end while either request runs.
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(
        !drained.is_finished(),
        "the drain waits for both layers' requests"
    );
    counter.let_go(2);
    tokio::time::timeout(Duration::from_secs(30), drained)
        .await
        .expect("drained")
        .unwrap();
    assert_eq!(shutdown.in_flight(), 0);
    let (leased, tx) = (running_leased.await.unwrap(), running_tx.await.unwrap());
    assert_eq!(
        (leased.status, tx.status),
        (StatusCode::CREATED, StatusCode::CREATED)
    );
    // Drained means stored: both keys are complete, the transactional one with its write.
    let completed = format!(
        "SELECT key FROM \"{}\".idempotency_keys WHERE state = 'completed' ORDER BY key",
        schema.name
    );
    let keys: Vec<String> = schema
        .query(&completed)
        .await
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(keys, ["l", "t"]);
    assert_eq!(rows_in(&schema, &table).await, 1);
    common::idle(&store).await;
}

#[tokio::test]
async fn a_handler_that_rolls_back_to_a_savepoint_has_its_409_stored() {
    let schema = TestSchema::new();
    let (router, counter, store) = once_per_id(&schema, "pay_1").await;
    let first = send(&router, post_body("k1", "pay_1", &[("x-savepoint", "1")])).await;
    assert_eq!(first.status, 409);
    assert_eq!(first.outcome, Some(Outcome::Executed));
    let retry = send(&router, post_body("k1", "pay_1", &[("x-savepoint", "1")])).await;
    assert_eq!(retry.status, 409);
    assert_eq!(retry.outcome, Some(Outcome::Replayed));
    assert_eq!(counter.runs(), 1);
    common::idle(&store).await;
}

#[tokio::test]
async fn a_handler_that_answers_201_after_its_insert_failed_gets_503_not_committed() {
    let schema = TestSchema::new();
    let (router, counter, store) = once_per_id(&schema, "pay_1").await;
    let before = send(&router, post_body("k0", "pay_0", &[])).await;
    assert_eq!(before.status, 201);
    // The handler claims success, but its transaction was aborted: nothing committed.
    let first = send(
        &router,
        post_body("k1", "pay_1", &[("x-ignore-errors", "1")]),
    )
    .await;
    assert_eq!(first.status, 503);
    assert_eq!(first.problem(), "not-committed");
    assert_eq!(records_of(&schema, "k1").await, 0);
    assert_eq!(counter.runs(), 2);
    // The pool's one connection came back clean, and serves the next request.
    let next = send(&router, post_body("k2", "pay_2", &[])).await;
    assert_eq!(next.status, 201);
    // The same server session, unless a transaction pooler lends another.
    if common::pooler_url().is_none() {
        assert_eq!(next.header("x-backend"), before.header("x-backend"));
    }
    common::idle(&store).await;
}

#[tokio::test]
async fn a_panic_rolls_back_and_the_connection_is_not_reused_mid_transaction() {
    let schema = TestSchema::new();
    let store = schema.store_at(&common::database_url(), 1).await;
    let table = setup(&schema, &store).await;
    let (router, counter) = app(IdempotencyLayer::transactional(store.clone()), &table);
    let panicked = send(&router, post_with("k", &[("x-panic", "1")])).await;
    assert_eq!(panicked.status, 500);
    assert_eq!(panicked.problem(), "handler-failed");
    assert_eq!(rows_in(&schema, &table).await, 0);
    // The pool's one connection is usable and outside any transaction.
    let client = store.pool().get().await.unwrap();
    // SAVEPOINT fails with 25P01 outside a transaction block.
    let probe = client.batch_execute("SAVEPOINT probe").await;
    assert_eq!(
        probe.err().and_then(|e| e.code().cloned()),
        Some(tokio_postgres::error::SqlState::NO_ACTIVE_SQL_TRANSACTION),
        "the pooled connection is still inside a transaction"
    );
    drop(client);
    assert_eq!(send(&router, post_with("k", &[])).await.status, 201);
    assert_eq!(counter.runs(), 2);
}

#[tokio::test]
async fn a_client_that_hangs_up_does_not_cancel_the_transaction() {
    let schema = TestSchema::new();
    let store = schema.store_at(&common::database_url(), 2).await;
    let table = setup(&schema, &store).await;
    let (router, counter) = app(IdempotencyLayer::transactional(store.clone()), &table);
    let client = in_flight(&router, post_with("k", &[("x-delay-ms", "200")]), &counter).await;
    client.abort();
    // The handler finishes and commits without its client: the retry is its replay.
    let retry = common::retry_until_created_with(&router, || post_with("k", &[]), &[409]).await;
    assert_eq!(retry.outcome, Some(Outcome::Replayed));
    assert_eq!(counter.runs(), 1);
    assert_eq!(rows_in(&schema, &table).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_hangs_up_before_its_claim_is_acquired_leaves_nothing() {
    let schema = TestSchema::new();
    let (proxy, store, table) = through_proxy(&schema, 2).await;
    let (router, counter) = app(IdempotencyLayer::transactional(store.clone()), &table);
    // Warm: the statements are prepared, so the stalled claim is on the wire whole.
    assert_eq!(send(&router, post_with("warm-up", &[])).await.status, 201);
    proxy.stall(true);
    let before = proxy.received();
    let client = tokio::spawn({
        let router = router.clone();
        async move { send(&router, post_with("k", &[])).await }
    });
    // Let BEGIN and the claim (sent together) reach the proxy, then hang up while they
    // are held there.
    eventually(|| proxy.received() > before).await;
    client.abort();
    proxy.stall(false);
    // Its connection was closed, and a cancel request sent: the claim rolled back with
    // the transaction (or, had the cancel reached the BEGIN as it started, ran
    // nowhere: `a_claim_whose_begin_fails_claims_nothing`), and the retry runs as a new
    // request.
    let retry = common::retry_until_created_with(&router, || post_with("k", &[]), &[409]).await;
    assert_eq!(retry.outcome, Some(Outcome::Executed));
    assert_eq!(counter.runs(), 2, "the warm-up and the retry");
    assert_eq!(
        count(
            &schema,
            &format!("SELECT count(*) FROM {table} WHERE key = 'k'")
        )
        .await,
        1
    );
}

/// The claim goes on the wire right behind its `BEGIN`, in the same round trip, as a
/// message of its own. A `BEGIN` that fails before it runs (misspelt here; a cancel
/// request that reaches it as it starts fails it so, as a client that hangs up while
/// its claim is on the way sends one) leaves the session outside any transaction: the
/// claim must claim nothing there. Run alone, it would commit the key `running`, with
/// no transaction to roll it back and nobody to finish it, and every retry would get
/// `409` until the lease lapsed.
#[tokio::test]
async fn a_claim_whose_begin_fails_claims_nothing() {
    let schema = TestSchema::new();
    let (proxy, store, table) = through_proxy(&schema, 2).await;
    let (router, counter) = app(IdempotencyLayer::transactional(store.clone()), &table);
    proxy.break_begin(true);
    let failed = send(&router, post_with("k", &[])).await;
    proxy.break_begin(false);
    assert_eq!(failed.status, 503, "{:?}", failed.body);
    assert_eq!(counter.runs(), 0);
    assert_eq!(records_of(&schema, "k").await, 0, "the key was claimed");
    // The key is free: the retry runs at once.
    let retry = send(&router, post_with("k", &[])).await;
    assert_eq!(retry.status, 201, "{:?}", retry.body);
    assert_eq!(retry.outcome, Some(Outcome::Executed));
    assert_eq!(counter.runs(), 1);
    assert_eq!(rows_in(&schema, &table).await, 1);
}

#[tokio::test]
async fn a_panic_after_the_client_hung_up_still_rolls_back() {
    let schema = TestSchema::new();
    let store = schema.store_at(&common::database_url(), 2).await;
    let table = setup(&schema, &store).await;
    let (router, counter) = app(IdempotencyLayer::transactional(store.clone()), &table);
    let client = in_flight(
        &router,
        post_with("k", &[("x-delay-ms", "200"), ("x-panic", "1")]),
        &counter,
    )
    .await;
    client.abort();
    // The handler runs on to its panic without its client, ...
    common::eventually(|| counter.finished() == 1).await;
    // ... which rolls back with nobody to answer: the retry runs, and only its row is
    // written.
    let retry = common::retry_until_created_with(&router, || post_with("k", &[]), &[409]).await;
    assert_eq!(retry.outcome, Some(Outcome::Executed));
    assert_eq!(counter.runs(), 2);
    assert_eq!(rows_in(&schema, &table).await, 1);
}

#[tokio::test]
async fn a_response_the_policy_does_not_store_rolls_everything_back() {
    let schema = TestSchema::new();
    let store = schema.store().await;
    let table = setup(&schema, &store).await;
    let (router, _) = app(IdempotencyLayer::transactional(store), &table);
    let r = send(&router, post_with("k", &[("x-status", "429")])).await;
    assert_eq!(r.status, 429);
    assert_eq!(rows_in(&schema, &table).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_duplicate_past_the_lock_timeout_gets_409() {
    let schema = TestSchema::new();
    let store = schema.store().await;
    let table = setup(&schema, &store).await;
    let layer = IdempotencyLayer::transactional(store).lock_timeout(Duration::from_millis(100));
    let (router, counter) = app(layer, &table);
    let first = in_flight(&router, post_with("k", &[("x-held", "1")]), &counter).await;
    let dup = send(&router, post_with("k", &[])).await;
    assert_eq!(dup.status, 409);
    assert_eq!(dup.problem(), "in-progress");
    assert!(dup.header("retry-after").is_some());
    counter.let_go(1);
    assert_eq!(first.await.unwrap().status, 201);
    assert_eq!(
        send(&router, post_with("k", &[])).await.outcome,
        Some(Outcome::Replayed)
    );
    assert_eq!(counter.runs(), 1);
}

/// `wait_for_running` holds in transactional mode too: a duplicate waits on the first
/// request's row for as long as it allows, past `lock_timeout`, and replays the answer;
/// the handler's own lock waits keep `lock_timeout`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_duplicate_waits_for_running_past_the_lock_timeout_and_replays() {
    let schema = TestSchema::new();
    let store = schema.store().await;
    let table = setup(&schema, &store).await;
    let layer = IdempotencyLayer::transactional(store)
        .lock_timeout(Duration::from_millis(100))
        .wait_for_running(Duration::from_secs(30));
    let handler = |State(app): State<App>, tx: TransactionHandle, headers: HeaderMap| async move {
        let run = app.counter.count_run();
        let client = tx.client().await.expect("transaction");
        let row = client.query_one("SHOW lock_timeout", &[]).await.unwrap();
        let lock_timeout: String = row.get(0);
        drop(client);
        if headers.contains_key("x-held") {
            app.counter.held().await;
        }
        (StatusCode::CREATED, format!("{run} {lock_timeout}"))
    };
    let (router, counter) = app_on(post(handler), layer, &table);
    let first = in_flight(&router, post_with("k", &[("x-held", "1")]), &counter).await;
    let dup = tokio::spawn({
        let router = router.clone();
        async move { send(&router, post_with("k", &[])).await }
    });
    // It waits on the first request's row, past the 100 ms lock timeout.
    schema.wait_for_lock_waiters(1).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !dup.is_finished(),
        "the duplicate stopped waiting at the lock timeout"
    );
    counter.let_go(1);
    let dup = dup.await.unwrap();
    let first = first.await.unwrap();
    assert_eq!(first.status, 201);
    assert_eq!(first.body, "1 100ms");
    assert_eq!(dup.status, 201, "{}", String::from_utf8_lossy(&dup.body));
    assert_eq!(dup.outcome, Some(Outcome::Replayed));
    assert_eq!(dup.body, first.body);
    assert_eq!(counter.runs(), 1);
}

/// A response body that breaks off rolls the handler's writes back with its claim: in
/// transactional mode they are the request's effects, and a retry makes them once.
#[tokio::test]
async fn a_response_body_that_breaks_off_rolls_back_the_handler_s_writes() {
    let schema = TestSchema::new();
    let store = schema.store().await;
    let table = setup(&schema, &store).await;
    let handler = |State(app): State<App>, key: IdempotencyKey, tx: TransactionHandle| async move {
        let run = write_a_row(&app, &key, &tx).await;
        let body = if run == 1 {
            Body::new(common::BreaksOff::default())
        } else {
            Body::from("{}")
        };
        (StatusCode::CREATED, body).into_response()
    };
    let (router, counter) = app_on(
        post(handler),
        IdempotencyLayer::transactional(store),
        &table,
    );
    let first = send(&router, post_with("k", &[])).await;
    assert_eq!(first.status, 500);
    assert_eq!(first.problem(), "handler-failed");
    assert_eq!(rows_in(&schema, &table).await, 0);
    let retry = send(&router, post_with("k", &[])).await;
    assert_eq!(retry.status, 201);
    assert_eq!(retry.outcome, Some(Outcome::Executed));
    assert_eq!(counter.runs(), 2);
    assert_eq!(rows_in(&schema, &table).await, 1);
}

/// A response body that never ends does not hold the transaction open without end: at
/// `response_body_timeout` the key commits as `response-not-stored`, with the handler's
/// writes, and the body goes on to its client.
#[tokio::test]
async fn a_response_body_that_never_ends_commits_as_not_stored() {
    use http_body_util::BodyExt;
    use tower::ServiceExt;

    let schema = TestSchema::new();
    let store = schema.store().await;
    let table = setup(&schema, &store).await;
    let layer =
        IdempotencyLayer::transactional(store).response_body_timeout(Duration::from_millis(300));
    let handler = |State(app): State<App>, key: IdempotencyKey, tx: TransactionHandle| async move {
        write_a_row(&app, &key, &tx).await;
        Response::new(Body::new(common::Trickle {
            left: None,
            every: Duration::from_millis(20),
            sleep: None,
        }))
    };
    let (router, counter) = app_on(post(handler), layer, &table);
    let res = tokio::time::timeout(
        Duration::from_secs(10),
        router.clone().oneshot(post_with("k", &[])),
    )
    .await
    .expect("the head arrives")
    .unwrap();
    assert_eq!(res.status(), 200);
    let mut body = res.into_body();
    assert!(body.frame().await.expect("more").unwrap().is_data());
    drop(body);
    let retry = send(&router, post_with("k", &[])).await;
    assert_eq!(retry.status, 500);
    assert_eq!(retry.problem(), "response-not-stored");
    assert_eq!(retry.outcome, Some(Outcome::Replayed));
    assert_eq!(counter.runs(), 1);
    assert_eq!(rows_in(&schema, &table).await, 1);
}

/// A handler that takes a `TransactionHandle` behind a layer in lease mode is the
/// server's mistake: 500, and the key released, not a `400 key-missing` stored and
/// replayed to a client that sent a key.
#[tokio::test]
async fn a_transaction_handler_behind_a_lease_mode_layer_is_500_and_stores_nothing() {
    let schema = TestSchema::new();
    let store = schema.store().await;
    let table = setup(&schema, &store).await;
    let (router, counter) = app(IdempotencyLayer::new(store), &table);
    for _ in 0..2 {
        let r = send(&router, post_with("k", &[])).await;
        assert_eq!(r.status, 500);
        assert_eq!(r.problem(), "handler-failed");
        assert_eq!(r.outcome, Some(Outcome::Released));
    }
    assert_eq!(counter.runs(), 0);
    let keys = format!("SELECT count(*) FROM \"{}\".idempotency_keys", schema.name);
    assert_eq!(count(&schema, &keys).await, 0);
    // A route no layer guards at all, keyed or not: the wiring, not the client.
    let (unguarded, _) = app_on(
        post(create),
        IdempotencyLayer::new(tower_idempotency::store::MemoryStore::new())
            .methods([axum::http::Method::PATCH]),
        &table,
    );
    let r = send(&unguarded, post_with("k", &[])).await;
    assert_eq!(r.status, 500);
    assert_eq!(r.problem(), "handler-failed");
}

/// A duplicate whose client hangs up while its claim waits on a lock does not leave
/// its server backend waiting on, for as long as `wait_for_running` allows: the
/// server does not notice a closed connection then, and is told to cancel.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_abandoned_claim_stops_waiting_on_the_server() {
    if common::pooler_url().is_some() {
        // Behind a transaction pooler no cancel request is sent
        // (`with_transaction_pooling`): the statement runs to its own bound.
        eprintln!("not behind a transaction pooler: it sends no cancel requests");
        return;
    }
    let schema = TestSchema::new();
    let store = schema.store().await;
    abandoned_claim_stops_waiting(&schema, store).await;
}

/// A transactional route inside a router-wide layer in lease mode (on another store):
/// the inner layer guards the request in its own mode, and opens the transaction its
/// handler needs, instead of letting it through as it does a request guarded in its
/// own mode.
#[tokio::test]
async fn a_transactional_route_inside_a_lease_mode_layer_runs_in_its_transaction() {
    let schema = TestSchema::new();
    let store = schema.store().await;
    let table = setup(&schema, &store).await;
    let (inner, counter) = app(IdempotencyLayer::transactional(store), &table);
    let router = inner.layer(IdempotencyLayer::new(
        tower_idempotency::store::MemoryStore::new(),
    ));
    let first = send(&router, post_with("k", &[])).await;
    assert_eq!(
        first.status,
        201,
        "{}",
        String::from_utf8_lossy(&first.body)
    );
    let retry = send(&router, post_with("k", &[])).await;
    assert_eq!(retry.outcome, Some(Outcome::Replayed));
    assert_eq!(retry.body, first.body);
    assert_eq!(counter.runs(), 1);
    assert_eq!(rows_in(&schema, &table).await, 1);
}

/// A close ends a duplicate's wait on the first request's row at once, however long
/// `wait_for_running` would let it wait: 503, nothing run, its lock wait cancelled.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_close_ends_a_duplicate_s_wait_on_the_row() {
    let schema = TestSchema::new();
    let store = schema.store().await;
    let table = setup(&schema, &store).await;
    let layer =
        IdempotencyLayer::transactional(store.clone()).wait_for_running(Duration::from_secs(600));
    let shutdown = layer.shutdown_handle();
    let (router, counter) = app(layer, &table);
    let first = in_flight(&router, post_with("k", &[("x-delay-ms", "5000")]), &counter).await;
    let duplicate = tokio::spawn({
        let router = router.clone();
        async move { send(&router, post_with("k", &[])).await }
    });
    schema.wait_for_lock_waiters(1).await;
    shutdown.close();
    let duplicate = duplicate.await.unwrap();
    assert_eq!(duplicate.status, 503);
    assert_eq!(duplicate.problem(), "shutting-down");
    assert!(
        !first.is_finished(),
        "the wait ended with the first request, not the close"
    );
    assert_eq!(first.await.unwrap().status, 201);
    assert_eq!(counter.runs(), 1);
    common::idle(&store).await;
}

/// Transactional claims waiting for a connection are this process's overload, not a
/// running duplicate: a new key that cannot get its turn in time is told 503, not the
/// 409 "in progress" of a key nobody has used.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_new_key_that_cannot_get_its_turn_to_claim_gets_503_not_409() {
    let schema = TestSchema::new();
    // Two connections: one transactional claim at a time.
    let store = schema.store_at(&common::database_url(), 2).await;
    let table = setup(&schema, &store).await;
    // A claim waits up to 4.2 s for its turn. The first duplicate holds it for its
    // wait on the row (3 s), the second from then on (to 6 s): the new key, behind
    // them, gives up 4.2 s after it came, and the second duplicate has 1.2 s to spare;
    // the first request is held until both duplicates have answered.
    let layer = IdempotencyLayer::transactional(store.clone())
        .wait_for_running(Duration::from_secs(3))
        .store_timeout(Duration::from_millis(1200));
    let (router, counter) = app(layer, &table);
    // Both connections open before the race, so that no turn waits for a connection
    // to be made.
    let (one, two) = (store.pool().get().await, store.pool().get().await);
    drop((one.unwrap(), two.unwrap()));
    let first = in_flight(&router, post_with("k", &[("x-held", "1")]), &counter).await;
    // Two duplicates take the claims' turn one after the other, each waiting on the
    // first request's row until the lock timeout.
    let duplicates: Vec<_> = (0..2)
        .map(|_| {
            let router = router.clone();
            tokio::spawn(async move { send(&router, post_with("k", &[])).await })
        })
        .collect();
    // The first duplicate waits on the row (holding the turn), the second for its turn;
    // the turns are first come, first served, and the new key must come after both.
    // (Nothing outside the store shows a claim waiting for its turn: a pause, ample
    // for one that was sent before the first duplicate got the row.)
    schema.wait_for_lock_waiters(1).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let other = send(&router, post_with("new", &[])).await;
    assert_eq!(other.status, 503);
    assert_eq!(other.problem(), "store-unavailable");
    assert!(other.header("retry-after").is_some());
    for duplicate in duplicates {
        let duplicate = duplicate.await.unwrap();
        assert_eq!(duplicate.status, 409);
        assert_eq!(duplicate.problem(), "in-progress");
    }
    counter.let_go(1);
    assert_eq!(first.await.unwrap().status, 201);
    assert_eq!(records_of(&schema, "new").await, 0);
    assert_eq!(counter.runs(), 1);
    // Its retry, once there is room, runs.
    assert_eq!(send(&router, post_with("new", &[])).await.status, 201);
    common::idle(&store).await;
}

/// Requests that wait for the inner service's readiness (here a concurrency limit of
/// one, in a tower stack inside the layer) wait before their transactions open, holding
/// no connection: a burst queues there and is served in turn, and other apps on the
/// same pool are served meanwhile, rather than finding every connection idle in a
/// transaction that waits for its turn to run.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn requests_waiting_for_a_concurrency_permit_hold_no_connection() {
    let schema = TestSchema::new();
    let store = schema.store_at(&common::database_url(), 2).await;
    let table = setup(&schema, &store).await;
    let layer =
        IdempotencyLayer::transactional(store.clone()).store_timeout(Duration::from_millis(500));
    let counter = Counter::default();
    let handler = Router::new()
        .route("/payments", post(create))
        .with_state(App {
            counter: counter.clone(),
            table: table.clone(),
        });
    // An axum route's readiness is always ready (it waits inside its call); a tower
    // stack's is not.
    let limited = Router::new().fallback_service(
        tower::ServiceBuilder::new()
            .layer(layer.clone())
            .layer(tower::limit::ConcurrencyLimitLayer::new(1))
            .service(handler),
    );
    let (other, _) = app(layer, &table);
    let burst = Arc::new(tokio::sync::Barrier::new(4));
    let queued: Vec<_> = (0..4)
        .map(|i| {
            let (router, burst) = (limited.clone(), burst.clone());
            tokio::spawn(async move {
                let r = post_with(&format!("burst-{i}"), &[("x-delay-ms", "500")]);
                burst.wait().await;
                send(&router, r).await
            })
        })
        .collect();
    eventually(|| counter.runs() == 1).await;
    assert_eq!(send(&other, post_with("other", &[])).await.status, 201);
    for r in queued {
        let r = r.await.unwrap();
        assert_eq!(r.status, 201, "{}", String::from_utf8_lossy(&r.body));
    }
    assert_eq!(counter.runs(), 4);
    common::idle(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cut_connection_mid_handler_rolls_back_and_the_retry_runs_clean() {
    let schema = TestSchema::new();
    let (proxy, store, table) = through_proxy(&schema, 2).await;
    let (router, counter) = app(IdempotencyLayer::transactional(store), &table);
    let first = in_flight(&router, post_with("k", &[("x-delay-ms", "300")]), &counter).await;
    proxy.cut();
    // Cut before the handler's INSERT, the handler fails (500); cut after it, the
    // commit fails (503 not-committed). Either way nothing is kept.
    let first = first.await.unwrap();
    assert!(
        (first.status == 503 && first.problem() == "not-committed") || first.status == 500,
        "{} {:?}",
        first.status,
        first.body
    );
    assert_eq!(rows_in(&schema, &table).await, 0);
    let mut statuses = Vec::new();
    let retry = loop {
        let r = send(&router, post_with("k", &[])).await;
        statuses.push(r.status.as_u16());
        if r.status != 503 {
            break r;
        }
        assert!(statuses.len() < 20, "{statuses:?}");
    };
    assert_eq!(retry.status, 201, "{statuses:?}");
    assert_eq!(retry.outcome, Some(Outcome::Executed));
    assert_eq!(rows_in(&schema, &table).await, 1);
}

/// Writes through a task that keeps the request's transaction handle long after the
/// response; with `x-keep-handle`, the task holds the connection for `pg_sleep(1.5)`
/// past the layer's store timeout (the layer ends the transaction on the server
/// meanwhile, which fails the statement), then lets go of the client but keeps the
/// handle.
async fn keeps_its_handle(
    State(app): State<App>,
    key: IdempotencyKey,
    tx: TransactionHandle,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if !headers.contains_key("x-keep-handle") {
        return create(State(app), key, tx, headers, body).await;
    }
    app.counter.count_run();
    let (holding, held) = tokio::sync::oneshot::channel();
    let table = app.table.clone();
    tokio::spawn(async move {
        let client = tx.client().await.expect("transaction");
        let _ = holding.send(());
        let insert = format!("INSERT INTO {table} (key, run, body) VALUES ($1, 0, 'kept')");
        client.execute(&insert, &[&key.as_str()]).await.unwrap();
        let _ = client.batch_execute("SELECT pg_sleep(1.5)").await;
        drop(client);
        // Kept as a careless app might keep it: in a cache, a struct, a task.
        tokio::time::sleep(Duration::from_secs(600)).await;
        drop(tx);
    });
    held.await.unwrap();
    (StatusCode::CREATED, "{}").into_response()
}

/// A handle kept beyond the request must not keep its row lock, and so its key, for as
/// long as it lives: the transaction rolls back and a retry runs clean.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_handle_kept_past_the_request_does_not_hold_the_key() {
    let schema = TestSchema::new();
    let store = schema.store_at(&common::database_url(), 2).await;
    let table = setup(&schema, &store).await;
    let layer = IdempotencyLayer::transactional(store)
        .store_timeout(Duration::from_millis(500))
        .lock_timeout(Duration::from_millis(200));
    let (router, counter) = app_on(post(keeps_its_handle), layer, &table);
    let first = send(&router, post_with("k", &[("x-keep-handle", "1")])).await;
    assert_eq!(first.status, 500);
    assert_eq!(first.problem(), "handler-failed");
    // 10 s is the bound for a retry to run, against the 600 s the handle is kept.
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
    // The kept transaction's write was rolled back; the retry's is the only one.
    assert_eq!(
        count(
            &schema,
            &format!("SELECT count(*) FROM {table} WHERE body = 'kept'")
        )
        .await,
        0
    );
    assert_eq!(rows_in(&schema, &table).await, 1);
}

/// A `COMMIT` whose answer is lost with its connection may have committed: the layer
/// checks before it answers, so the client is told what happened, not "no effect".
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_commit_whose_answer_was_lost_is_checked_before_the_client_is_told() {
    let schema = TestSchema::new();
    let (proxy, store, table) = through_proxy(&schema, 2).await;
    let (router, counter) = app(IdempotencyLayer::transactional(store), &table);
    let commits = proxy.commits();
    let first = in_flight(&router, post_with("k", &[("x-delay-ms", "300")]), &counter).await;
    proxy.lose_next_commit_reply();
    let first = first.await.unwrap();
    assert_eq!(first.status, 201, "{:?}", first.body);
    assert_eq!(first.outcome, Some(Outcome::Executed));
    assert_eq!(first.json()["run"], 1);
    assert_eq!(proxy.commits() - commits, 1, "one COMMIT, the request's");
    assert_eq!(rows_in(&schema, &table).await, 1);
    let retry = send(&router, post_with("k", &[])).await;
    assert_eq!(retry.outcome, Some(Outcome::Replayed));
    assert_eq!(retry.body, first.body);
    assert_eq!(counter.runs(), 1);
}

/// When the check cannot be made either, the client is told the outcome is unknown,
/// and its retry with the same key replays what did commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_commit_in_doubt_that_cannot_be_checked_says_so() {
    let schema = TestSchema::new();
    // One connection: the check needs a new one, which the proxy refuses.
    let (proxy, store, table) = through_proxy(&schema, 1).await;
    let layer = IdempotencyLayer::transactional(store).store_timeout(Duration::from_secs(1));
    let (router, counter) = app(layer, &table);
    let first = in_flight(&router, post_with("k", &[("x-delay-ms", "300")]), &counter).await;
    proxy.lose_next_commit_reply();
    proxy.refuse(true);
    let first = first.await.unwrap();
    assert_eq!(first.status, 503);
    assert_eq!(first.problem(), "not-committed");
    let detail = first.json()["detail"].as_str().unwrap().to_owned();
    assert!(detail.contains("could not be checked"), "{detail}");
    proxy.refuse(false);
    let retry = common::retry_until_created_with(&router, || post_with("k", &[]), &[503]).await;
    assert_eq!(retry.outcome, Some(Outcome::Replayed));
    assert_eq!(retry.json()["run"], 1);
    assert_eq!(counter.runs(), 1);
}

/// 409 `in-progress` means another request holds the key. A claim cancelled by the
/// database's `statement_timeout` (the table locked by a migration, say) is a slow
/// database: 503, nothing run.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_claim_cancelled_by_statement_timeout_is_503_not_409() {
    let schema = TestSchema::new();
    let url = common::database_url();
    let sep = if url.contains('?') { '&' } else { '?' };
    let url = format!("{url}{sep}options=-c%20statement_timeout%3D300");
    let store = schema.store_at(&url, 2).await;
    let table = setup(&schema, &store).await;
    let layer = IdempotencyLayer::transactional(store).lock_timeout(Duration::from_secs(5));
    let (router, counter) = app(layer, &table);
    let (locker, conn) = tokio_postgres::connect(&common::database_url(), tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    locker
        .batch_execute(&format!(
            "BEGIN; LOCK TABLE \"{}\".idempotency_keys IN ACCESS EXCLUSIVE MODE",
            schema.name
        ))
        .await
        .unwrap();
    let during = send(&router, post_with("k", &[])).await;
    locker.batch_execute("ROLLBACK").await.unwrap();
    assert_eq!(during.status, 503, "{:?}", during.body);
    assert_eq!(during.problem(), "store-unavailable");
    assert_eq!(counter.runs(), 0);
    let after = send(&router, post_with("k", &[])).await;
    assert_eq!(after.status, 201);
    assert_eq!(counter.runs(), 1);
}

/// A `COMMIT` that never reached the server, its connection closed: the transaction
/// rolled back, and the duplicate that waited on its row ran instead. The check finds
/// the key completed, but by another claim (its token is not this one's), and tells
/// this client the truth: not committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_commit_lost_on_its_way_is_found_not_committed_though_a_duplicate_completed_the_key() {
    let schema = TestSchema::new();
    let (proxy, store, table) = through_proxy(&schema, 4).await;
    let layer = IdempotencyLayer::transactional(store).wait_for_running(Duration::from_secs(5));
    let (router, counter) = app(layer, &table);
    let first = in_flight(&router, post_with("k", &[("x-delay-ms", "500")]), &counter).await;
    // The duplicate waits on the first request's row.
    let duplicate = tokio::spawn({
        let router = router.clone();
        async move { send(&router, post_with("k", &[])).await }
    });
    proxy.drop_next_commit();
    let first = first.await.unwrap();
    assert_eq!(first.status, 503, "{:?}", first.body);
    assert_eq!(first.problem(), "not-committed");
    let detail = first.json()["detail"].as_str().unwrap().to_owned();
    assert!(detail.contains("had no effect"), "{detail}");
    let duplicate = duplicate.await.unwrap();
    assert_eq!(duplicate.status, 201, "{:?}", duplicate.body);
    assert_eq!(duplicate.json()["run"], 2);
    assert_eq!(counter.runs(), 2);
    assert_eq!(
        rows_in(&schema, &table).await,
        1,
        "only the duplicate's write is kept"
    );
}

/// The check reads the key's row as it is: a record whose TTL already ran out is still
/// this transaction's, committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_commit_in_doubt_is_found_committed_even_past_its_ttl() {
    let schema = TestSchema::new();
    let (proxy, store, table) = through_proxy(&schema, 2).await;
    let layer = IdempotencyLayer::transactional(store).ttl(Duration::from_millis(1));
    let (router, counter) = app(layer, &table);
    let first = in_flight(&router, post_with("k", &[("x-delay-ms", "300")]), &counter).await;
    proxy.lose_next_commit_reply();
    let first = first.await.unwrap();
    assert_eq!(first.status, 201, "{:?}", first.body);
    assert_eq!(first.outcome, Some(Outcome::Executed));
    assert_eq!(rows_in(&schema, &table).await, 1);
}

/// Writes the ledger row and answers `204` with no body, whatever the input: two
/// requests' answers are byte for byte the same.
async fn record_and_answer_204(
    State(app): State<App>,
    key: IdempotencyKey,
    tx: TransactionHandle,
    headers: HeaderMap,
    body: Bytes,
) -> StatusCode {
    let _ = create(State(app), key, tx, headers, body).await;
    StatusCode::NO_CONTENT
}

/// A record past its TTL may be taken over by any request with its key, and two
/// takeovers of the same row get the same token. A takeover whose `COMMIT` was lost
/// (rolled back), followed by another request's takeover with the same answer, is still
/// told the truth: its input was not the one that committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_commit_in_doubt_is_not_mistaken_for_another_takeover_of_the_same_expired_record() {
    let schema = TestSchema::new();
    let (proxy, store, table) = through_proxy(&schema, 4).await;
    // Keys forgotten with their responses: an expired record is taken over.
    let store = store.remember_keys_for(Duration::ZERO);
    let layer = IdempotencyLayer::transactional(store).ttl(Duration::from_millis(200));
    let (router, counter) = app_on(post(record_and_answer_204), layer, &table);
    let expired = send(&router, post_body("k", "{\"amount\":1}", &[])).await;
    assert_eq!(expired.status, 204);
    tokio::time::sleep(Duration::from_millis(400)).await;
    // Both take the expired record over; the first holds it while its handler runs.
    let first = in_flight(
        &router,
        post_body("k", "{\"amount\":2}", &[("x-delay-ms", "500")]),
        &counter,
    )
    .await;
    let other = tokio::spawn({
        let router = router.clone();
        async move { send(&router, post_body("k", "{\"amount\":3}", &[])).await }
    });
    proxy.drop_next_commit();
    let first = first.await.unwrap();
    assert_eq!(first.status, 503, "{:?}", first.body);
    assert_eq!(first.problem(), "not-committed");
    assert_eq!(other.await.unwrap().status, 204);
    let bodies = format!("SELECT string_agg(body, ',' ORDER BY run) FROM {table}");
    let kept: String = schema.query(&bodies).await[0].get(0);
    assert_eq!(
        kept, "{\"amount\":1},{\"amount\":3}",
        "the first takeover's write is gone"
    );
}

/// Two layers of different modes on one route over one table, as
/// `.route(a).route_layer(x).route(b).route_layer(y)` puts both on `a`: the inner one
/// would claim the key the outer one holds (and wait on its row, or find it running).
/// It answers a clear `500 misconfigured` at once, which neither layer stores; the
/// handler does not run, and nothing is left under the key.
#[tokio::test]
async fn two_layers_of_different_modes_on_one_table_answer_500_misconfigured_at_once() {
    let schema = TestSchema::new();
    let store = schema.store().await;
    let table = setup(&schema, &store).await;
    let counter = Counter::default();
    let lease = || IdempotencyLayer::new(store.clone()).store_timeout(Duration::from_secs(2));
    let tx =
        || IdempotencyLayer::transactional(store.clone()).store_timeout(Duration::from_secs(2));
    let state = App {
        counter: counter.clone(),
        table: table.clone(),
    };
    // Lease mode inside transactional mode, then the other way round.
    let routers = [
        Router::new()
            .route("/payments", post(create))
            .route_layer(lease())
            .route("/other", post(create))
            .route_layer(tx())
            .with_state(state.clone()),
        Router::new()
            .route("/payments", post(create))
            .route_layer(tx())
            .route("/other", post(create))
            .route_layer(lease())
            .with_state(state),
    ];
    for (i, router) in routers.iter().enumerate() {
        let key = format!("k{i}");
        for _ in 0..2 {
            let r = common::send_bounded(router, post_with(&key, &[])).await;
            assert_eq!(r.status, 500, "{}", String::from_utf8_lossy(&r.body));
            assert_eq!(r.problem(), "misconfigured");
            assert_eq!(r.header("idempotent-replayed"), None);
        }
        assert_eq!(counter.runs(), 0);
        assert_eq!(records_of(&schema, &key).await, 0);
    }
    // Two stores over the table with pools of their own (two replicas' worth, say, or
    // two `PostgresStore::connect` calls): the same records.
    let (own_pool, counter) = {
        let other_pool = schema.store().await;
        app(
            IdempotencyLayer::new(other_pool).store_timeout(Duration::from_secs(2)),
            &table,
        )
    };
    let router = own_pool.layer(tx());
    let r = common::send_bounded(&router, post_with("k-pools", &[])).await;
    assert_eq!(r.status, 500, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.problem(), "misconfigured");
    assert_eq!(counter.runs(), 0);
    assert_eq!(records_of(&schema, "k-pools").await, 0);
    // Over another table of the same pool, the two serve the route together.
    let other = store.clone().with_table_name("other_keys").unwrap();
    other.migrate().await.unwrap();
    let (router, counter) = app(tx(), &table);
    let router = router.layer(IdempotencyLayer::new(other));
    assert_eq!(send(&router, post_with("k", &[])).await.status, 201);
    let retry = send(&router, post_with("k", &[])).await;
    assert_eq!(retry.outcome, Some(Outcome::Replayed));
    assert_eq!(counter.runs(), 1);
    common::idle(&store).await;
}
/// Lets the held request go, closes the layer and drains it, bounded: a drain that
/// waits on a statement the database never answers fails the test rather than hangs.
async fn drain_while_held(
    shutdown: &tower_idempotency::ShutdownHandle,
    counter: &Counter,
    request: tokio::task::JoinHandle<common::Reply>,
) -> common::Reply {
    counter.let_go(1);
    shutdown.close();
    tokio::time::timeout(Duration::from_secs(30), shutdown.drain())
        .await
        .expect("the drain hangs");
    tokio::time::timeout(Duration::from_secs(30), request)
        .await
        .expect("no answer within 30 s: the request hangs")
        .unwrap()
}

/// A `COMMIT` that the database never answers (the link holds it: a partition, a
/// frozen server) is given up on after `store_timeout`, then checked on another
/// connection: the client gets a bounded `503 not-committed` saying the outcome is
/// unknown (the transaction, still open on the server, holds the row past the check's
/// wait), and a drain returns. Once the link lets the `COMMIT` through, the retry
/// replays what committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_commit_the_database_never_answers_is_a_bounded_503_unknown() {
    let schema = TestSchema::new();
    let (proxy, store, table) = through_proxy(&schema, 3).await;
    let layer = |store| {
        IdempotencyLayer::transactional(store)
            .store_timeout(Duration::from_millis(500))
            .lock_timeout(Duration::from_millis(500))
    };
    let first_layer = layer(store.clone());
    let shutdown = first_layer.shutdown_handle();
    let (router, counter) = app(first_layer, &table);
    let first = in_flight(&router, post_with("k", &[("x-held", "1")]), &counter).await;
    proxy.hold_next_commit();
    let first = drain_while_held(&shutdown, &counter, first).await;
    assert_eq!(first.status, 503, "{:?}", first.body);
    assert_eq!(first.problem(), "not-committed");
    let detail = first.json()["detail"].as_str().unwrap().to_owned();
    assert!(detail.contains("could not be checked"), "{detail}");
    assert_eq!(proxy.held(), 1);
    proxy.release_held();
    // Another replica, not shut down: the COMMIT went through once let go.
    let (other, other_counter) = app(layer(store), &table);
    let retry = common::retry_until_created_with(&other, || post_with("k", &[]), &[409]).await;
    assert_eq!(retry.outcome, Some(Outcome::Replayed));
    assert_eq!(retry.json()["run"], 1);
    assert_eq!(counter.runs() + other_counter.runs(), 1);
}

/// A `COMMIT` that reaches the database, whose answer never comes back: the check on
/// another connection finds it committed, and the client gets its answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_commit_whose_answer_never_comes_is_checked_and_answered() {
    let schema = TestSchema::new();
    let (proxy, store, table) = through_proxy(&schema, 3).await;
    let layer = IdempotencyLayer::transactional(store).store_timeout(Duration::from_millis(500));
    let shutdown = layer.shutdown_handle();
    let (router, counter) = app(layer, &table);
    let first = in_flight(&router, post_with("k", &[("x-held", "1")]), &counter).await;
    proxy.hold_after_next_commit();
    let first = drain_while_held(&shutdown, &counter, first).await;
    assert_eq!(first.status, 201, "{:?}", first.body);
    assert_eq!(first.outcome, Some(Outcome::Executed));
    assert_eq!(proxy.held(), 1);
    assert_eq!(rows_in(&schema, &table).await, 1);
    let completed = format!(
        "SELECT count(*) FROM \"{}\".idempotency_keys WHERE key = 'k' AND state = 'completed'",
        schema.name
    );
    assert_eq!(count(&schema, &completed).await, 1);
    assert_eq!(counter.runs(), 1);
    proxy.release_held();
}

/// A `ROLLBACK` the database never answers (the handler's 503, which the storage
/// policy does not keep) is given up on after `store_timeout`: its connection is
/// closed, the client gets the handler's answer, and a drain returns.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_rollback_the_database_never_answers_is_given_up_on() {
    let schema = TestSchema::new();
    let (proxy, store, table) = through_proxy(&schema, 3).await;
    let layer =
        IdempotencyLayer::transactional(store.clone()).store_timeout(Duration::from_millis(500));
    let shutdown = layer.shutdown_handle();
    let (router, counter) = app(layer, &table);
    let first = in_flight(
        &router,
        post_with("k", &[("x-held", "1"), ("x-status", "503")]),
        &counter,
    )
    .await;
    proxy.hold_next_rollback();
    let first = drain_while_held(&shutdown, &counter, first).await;
    assert_eq!(first.status, 503, "{:?}", first.body);
    assert_eq!(first.outcome, Some(Outcome::Released));
    assert_eq!(proxy.held(), 1);
    proxy.release_held();
    assert_eq!(rows_in(&schema, &table).await, 0);
}

/// The `ROLLBACK` of a replay's transaction runs in the background; one the database
/// never answers is given up on after `store_timeout` too, and its connection closed,
/// so it does not keep a pooled connection for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_background_rollback_the_database_never_answers_gives_its_connection_back() {
    let schema = TestSchema::new();
    let (proxy, store, table) = through_proxy(&schema, 1).await;
    let layer =
        IdempotencyLayer::transactional(store.clone()).store_timeout(Duration::from_millis(500));
    let (router, counter) = app(layer, &table);
    assert_eq!(send(&router, post_with("k", &[])).await.status, 201);
    proxy.hold_next_rollback();
    let replay = common::send_bounded(&router, post_with("k", &[])).await;
    assert_eq!(replay.outcome, Some(Outcome::Replayed));
    // The pool's one connection is held by the replay's ROLLBACK until it is given up.
    let next = tokio::time::timeout(
        Duration::from_secs(20),
        common::retry_until_created_with(&router, || post_with("other", &[]), &[503]),
    )
    .await
    .expect("the pool's connection never came back");
    assert_eq!(next.outcome, Some(Outcome::Executed));
    assert_eq!(proxy.held(), 1);
    assert_eq!(counter.runs(), 2);
    proxy.release_held();
}

/// Writes through a task that takes the request's transaction client and never lets
/// go of it (a careless app's background work), then answers 201.
async fn holds_its_client_for_good(
    State(app): State<App>,
    key: IdempotencyKey,
    tx: TransactionHandle,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if !headers.contains_key("x-hold-for-good") {
        return create(State(app), key, tx, headers, body).await;
    }
    app.counter.count_run();
    let (written, wrote) = tokio::sync::oneshot::channel();
    let table = app.table.clone();
    tokio::spawn(async move {
        let client = tx.client().await.expect("transaction");
        let insert = format!("INSERT INTO {table} (key, run, body) VALUES ($1, 0, 'kept')");
        client.execute(&insert, &[&key.as_str()]).await.unwrap();
        let _ = written.send(());
        std::future::pending::<()>().await;
        drop(client);
    });
    wrote.await.unwrap();
    (StatusCode::CREATED, "{}").into_response()
}

/// A task that keeps the transaction's client for good: when the layer gives up on it
/// (500 after `store_timeout`), it ends the transaction on the server, so nothing of it
/// commits and the key is free at once: the retry runs, rather than meeting 409 for as
/// long as the task lives.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_client_kept_for_good_past_the_request_does_not_hold_the_key() {
    let schema = TestSchema::new();
    let store = schema.store_at(&common::database_url(), 3).await;
    let table = setup(&schema, &store).await;
    // The retry may wait on the row for a moment while the ended backend exits.
    let layer = IdempotencyLayer::transactional(store)
        .store_timeout(Duration::from_millis(500))
        .lock_timeout(Duration::from_secs(5));
    let (router, counter) = app_on(post(holds_its_client_for_good), layer, &table);
    let first = common::send_bounded(&router, post_with("k", &[("x-hold-for-good", "1")])).await;
    assert_eq!(first.status, 500);
    assert_eq!(first.problem(), "handler-failed");
    let retry = common::send_bounded(&router, post_with("k", &[])).await;
    assert_eq!(retry.status, 201, "{:?}", retry.body);
    assert_eq!(retry.outcome, Some(Outcome::Executed));
    assert_eq!(counter.runs(), 2);
    let kept = format!("SELECT count(*) FROM {table} WHERE body = 'kept'");
    assert_eq!(
        count(&schema, &kept).await,
        0,
        "the kept write never commits"
    );
    assert_eq!(rows_in(&schema, &table).await, 1);
}

/// Where a handler that keeps its client (`keeps_its_client`) puts every other
/// connection of the pool (`x-exhaust`), until the test lets them go.
type Held = Arc<std::sync::Mutex<Vec<deadpool_postgres::Object>>>;

/// `POST /payments` whose handler, with `x-keep`, leaves its transaction's client with a task that
/// writes its ledger row, ends the transaction as `x-end` says (`commit`, `rollback`;
/// by default it leaves it open), and then keeps the client for good (with
/// `x-untracked`, its session stops reporting its activity first; with `x-untracked:
/// after`, once it has ended the transaction). With `x-kill`,
/// the handler then terminates the session that runs it, from a connection of its own,
/// and waits until it is gone; with `x-exhaust`, it checks out every other connection
/// of `store`'s pool into `held`. Then it answers 201.
fn keeps_its_client(store: &PostgresStore, held: &Held) -> MethodRouter<App> {
    let (store, held) = (store.clone(), held.clone());
    post(
        move |State(app): State<App>,
              key: IdempotencyKey,
              tx: TransactionHandle,
              headers: HeaderMap| {
            let (store, held) = (store.clone(), held.clone());
            async move {
                if !headers.contains_key("x-keep") {
                    let run = write_a_row(&app, &key, &tx).await;
                    return (StatusCode::CREATED, format!("{{\"run\":{run}}}")).into_response();
                }
                let run = app.counter.count_run();
                let end = headers
                    .get("x-end")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("")
                    .to_owned();
                let (wrote, written) = tokio::sync::oneshot::channel();
                let untracked = headers
                    .get("x-untracked")
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_owned);
                tokio::spawn(async move {
                    let client = tx.client().await.expect("transaction");
                    if untracked.as_deref() == Some("1") {
                        client
                            .batch_execute("SET track_activities = off")
                            .await
                            .unwrap();
                    }
                    let insert = format!(
                        "INSERT INTO {} (key, run, body) VALUES ($1, $2, 'kept')",
                        app.table
                    );
                    client
                        .execute(&insert, &[&key.as_str(), &(run as i32)])
                        .await
                        .unwrap();
                    match end.as_str() {
                        "commit" => client.batch_execute("COMMIT").await.unwrap(),
                        "rollback" => client.batch_execute("ROLLBACK").await.unwrap(),
                        _ => {}
                    }
                    if untracked.as_deref() == Some("after") {
                        client
                            .batch_execute("SET track_activities = off")
                            .await
                            .unwrap();
                    }
                    let pid: i32 = client
                        .query_one("SELECT pg_backend_pid()", &[])
                        .await
                        .unwrap()
                        .get(0);
                    let _ = wrote.send(pid);
                    std::future::pending::<()>().await;
                    drop(client);
                });
                let pid = written.await.unwrap();
                if headers.contains_key("x-kill") {
                    let (killer, connection) =
                        tokio_postgres::connect(&common::database_url(), tokio_postgres::NoTls)
                            .await
                            .unwrap();
                    tokio::spawn(connection);
                    killer
                        .execute("SELECT pg_terminate_backend($1)", &[&pid])
                        .await
                        .unwrap();
                    let gone = "SELECT count(*) FROM pg_stat_activity WHERE pid = $1";
                    for _ in 0..500 {
                        let left: i64 = killer.query_one(gone, &[&pid]).await.unwrap().get(0);
                        if left == 0 {
                            break;
                        }
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                }
                if headers.contains_key("x-exhaust") {
                    // Every connection but the transaction's, which the task keeps.
                    for _ in 1..store.pool().status().max_size {
                        let conn = store.pool().get().await.unwrap();
                        held.lock().unwrap().push(conn);
                    }
                }
                (StatusCode::CREATED, "{}").into_response()
            }
        },
    )
}

/// How many rows of work that kept its client (`keeps_its_client`) `table` holds.
async fn kept_rows(schema: &TestSchema, table: &str) -> i64 {
    count(
        schema,
        &format!("SELECT count(*) FROM {table} WHERE body = 'kept'"),
    )
    .await
}

/// A handler whose work kept the transaction's client (`x-keep`, with `headers`), on a
/// pool of three connections: its first answer, then the retries' (which keep nothing)
/// until one that is not a 409 (10 s at most), the pool's other connections let go
/// first.
async fn kept_and_retried(headers: &[(&str, &str)]) -> (TestSchema, String, Counter, Reply, Reply) {
    // A session that stops reporting its activity stays so: never through a pooler,
    // which would lend it to other tests' transactions.
    let direct = headers.iter().any(|(name, _)| *name == "x-untracked");
    kept_and_retried_on(direct, headers).await
}

/// [`kept_and_retried`], on connections straight to the database if `direct`, even
/// when the suite runs through a pooler.
async fn kept_and_retried_on(
    direct: bool,
    headers: &[(&str, &str)],
) -> (TestSchema, String, Counter, Reply, Reply) {
    let schema = TestSchema::new();
    let store = if direct {
        schema.store_direct(3).await
    } else {
        schema.store_at(&common::database_url(), 3).await
    };
    let table = setup(&schema, &store).await;
    let held = Held::default();
    // The retry may wait on the row for a moment while an ended backend exits. The
    // store timeout bounds how long the layer waits for the kept client and then each
    // step of ending its transaction, on a connection it may have to open: short
    // enough to keep the test quick, long enough for a connection on a busy machine.
    let layer = IdempotencyLayer::transactional(store.clone())
        .store_timeout(Duration::from_secs(2))
        .lock_timeout(Duration::from_secs(5));
    let (router, counter) = app_on(keeps_its_client(&store, &held), layer, &table);
    let kept: Vec<_> = [("x-keep", "1")].iter().chain(headers).copied().collect();
    let first = common::send_bounded(&router, post_with("k", &kept)).await;
    held.lock().unwrap().clear();
    let started = std::time::Instant::now();
    let mut statuses = Vec::new();
    let retry = loop {
        let r = common::send_bounded(&router, post_with("k", &[])).await;
        statuses.push(r.status.as_u16());
        if r.status != 409 || started.elapsed() > Duration::from_secs(10) {
            break r;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_ne!(retry.status, 409, "{statuses:?}");
    (schema, table, counter, first, retry)
}

/// What a kept client whose work committed the transaction ends in: the first request
/// `500 transaction-ended`, stored and replayed to the retry, one run, and the work's
/// own committed row.
async fn committed_and_ended_once(
    schema: &TestSchema,
    table: &str,
    counter: &Counter,
    first: &Reply,
    retry: &Reply,
) {
    assert_eq!(first.status, 500, "{:?}", first.body);
    assert_eq!(first.problem(), "transaction-ended");
    assert_eq!(retry.outcome, Some(Outcome::Replayed), "{:?}", retry.body);
    assert_eq!(retry.body, first.body);
    assert_eq!(counter.runs(), 1, "the handler ran once");
    assert_eq!(kept_rows(schema, table).await, 1, "its COMMIT stays");
}

/// Ends the sessions that stopped reporting their activity (`x-untracked`), which the
/// work keeps for good.
async fn end_hidden_sessions(schema: &TestSchema) {
    schema
        .query(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
             WHERE state = 'disabled' AND datname = current_database()",
        )
        .await;
}

/// The work committed the transaction, then kept its client: when the layer gives up
/// on it, the transaction had ended, with the claim committed `running`. That is a
/// transaction the handler ended, not one that left nothing held: `500
/// transaction-ended`, stored, and the handler does not run again. The pool is held by
/// other work meanwhile, and the layer still finds the transaction ended and finishes
/// the key, on connections that do not wait behind the pool.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_client_kept_after_the_handler_s_commit_gets_transaction_ended_and_runs_once() {
    let headers = [("x-end", "commit"), ("x-exhaust", "1")];
    let (schema, table, counter, first, retry) = kept_and_retried(&headers).await;
    committed_and_ended_once(&schema, &table, &counter, &first, &retry).await;
    let ended = format!(
        "SELECT count(*) FROM \"{}\".idempotency_keys WHERE key = 'k' AND state = 'completed' AND status = 500",
        schema.name
    );
    assert_eq!(count(&schema, &ended).await, 1);
}

/// The same after the work's `ROLLBACK`: what it wrote after that may have committed.
/// The layer tells so from the session that ran the transaction, living on outside
/// it: on a direct connection. (Behind a pooler the session serves other clients once
/// the transaction is over, and may be ended by them, the suite's own clean-up
/// included; a session found gone after a `ROLLBACK` cannot be told from one whose
/// end rolled the transaction back: `500 handler-failed`, docs/modes.md.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_client_kept_after_the_handler_s_rollback_gets_transaction_ended_and_runs_once() {
    let (schema, table, counter, first, retry) =
        kept_and_retried_on(true, &[("x-end", "rollback")]).await;
    assert_eq!(first.status, 500, "{:?}", first.body);
    assert_eq!(first.problem(), "transaction-ended", "{:?}", first.body);
    assert_eq!(retry.outcome, Some(Outcome::Replayed), "{:?}", retry.body);
    assert_eq!(counter.runs(), 1, "the handler ran once");
    assert_eq!(
        rows_in(&schema, &table).await,
        0,
        "its ROLLBACK took its write"
    );
}

/// A client kept for good while every other connection of the pool is checked out:
/// the layer still ends the transaction on the server, on a connection that does not
/// wait behind the pool, so the key is free once the pool is, rather than held for as
/// long as the work keeps the client.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_client_kept_while_the_pool_is_exhausted_does_not_hold_the_key() {
    let (schema, table, counter, first, retry) = kept_and_retried(&[("x-exhaust", "1")]).await;
    assert_eq!(first.status, 500, "{:?}", first.body);
    assert_eq!(first.problem(), "handler-failed");
    assert_eq!(retry.status, 201, "{:?}", retry.body);
    assert_eq!(retry.outcome, Some(Outcome::Executed));
    assert_eq!(counter.runs(), 2);
    let kept = kept_rows(&schema, &table).await;
    assert_eq!(kept, 0, "the kept write never commits");
    assert_eq!(rows_in(&schema, &table).await, 1);
}

/// A client kept on a session that does not report its transactions
/// (`track_activities` off): the layer cannot tell that its transaction is still open,
/// and must not take it for one the handler ended (finishing the key would wait on the
/// open transaction's row, and answer `transaction-ended` for a transaction that rolls
/// back): `500 handler-failed`, and nothing stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_client_kept_on_a_session_that_hides_its_transaction_is_not_taken_for_ended() {
    let schema = TestSchema::new();
    // Never through a pooler: the session it hides would serve other tests' transactions.
    let store = schema.store_direct(3).await;
    let table = setup(&schema, &store).await;
    let layer =
        IdempotencyLayer::transactional(store.clone()).store_timeout(Duration::from_millis(500));
    let (router, _) = app_on(keeps_its_client(&store, &Held::default()), layer, &table);
    let kept = [("x-keep", "1"), ("x-untracked", "1")];
    let first = common::send_bounded(&router, post_with("k", &kept)).await;
    assert_eq!(first.status, 500, "{:?}", first.body);
    assert_eq!(first.problem(), "handler-failed");
    assert_eq!(records_of(&schema, "k").await, 0, "nothing was stored");
    // The kept transaction rolls back once its session ends.
    end_hidden_sessions(&schema).await;
    let retry = common::retry_until_created_with(&router, || post_with("k", &[]), &[409]).await;
    assert_eq!(retry.outcome, Some(Outcome::Executed));
}

/// The work committed the transaction, then its session stopped reporting its
/// activity (a helper's `SET track_activities = off`; behind a pooler, the server
/// session handed to a client that did so): the layer cannot tell that the
/// transaction ended, and cannot end it, but the claim row committed `running` says
/// the handler committed it: `500 transaction-ended`, stored, and the handler does
/// not run again, rather than the key left running to be taken over once its lease
/// lapses.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_client_kept_after_the_handler_s_commit_on_a_hidden_session_runs_once() {
    let headers = [("x-end", "commit"), ("x-untracked", "after")];
    let (schema, table, counter, first, retry) = kept_and_retried(&headers).await;
    committed_and_ended_once(&schema, &table, &counter, &first, &retry).await;
    end_hidden_sessions(&schema).await;
}

/// A client kept by work whose session then ended (its connection failed): its
/// transaction rolled back with it, so nothing is held, and the retry runs. Had the
/// work committed first, the key is finished as for any transaction the handler ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_client_kept_by_a_session_that_ended_frees_the_key_unless_it_had_committed() {
    let (schema, table, counter, first, retry) = kept_and_retried(&[("x-kill", "1")]).await;
    assert_eq!(first.status, 500, "{:?}", first.body);
    assert_eq!(first.problem(), "handler-failed");
    assert_eq!(retry.status, 201, "{:?}", retry.body);
    assert_eq!(counter.runs(), 2);
    assert_eq!(kept_rows(&schema, &table).await, 0);

    let (schema, table, counter, first, retry) =
        kept_and_retried(&[("x-end", "commit"), ("x-kill", "1")]).await;
    assert_eq!(first.status, 500, "{:?}", first.body);
    assert_eq!(first.problem(), "transaction-ended");
    assert_eq!(retry.outcome, Some(Outcome::Replayed), "{:?}", retry.body);
    assert_eq!(counter.runs(), 1);
    assert_eq!(kept_rows(&schema, &table).await, 1);
}

/// Writes its ledger row, then ends the request's transaction itself, as a helper
/// written for a plain connection does, as `x-end` says: `commit` (`COMMIT`),
/// `begin-commit` (`BEGIN`, the write, `COMMIT`: its own transaction, it thinks),
/// `rollback` (`ROLLBACK`), `commit-begin` (`COMMIT`, then `BEGIN` again, leaving a
/// transaction of its own open), `commit-begin-fail` (the same, then a statement of a
/// second such helper fails on a unique key, which aborts the handler's own
/// transaction), or `none` (it leaves the transaction alone). With `x-held` it then
/// waits until the test lets it go. It then answers `x-status` (201 by default), or
/// panics with `x-panic`.
async fn ends_its_transaction(
    State(app): State<App>,
    key: IdempotencyKey,
    tx: TransactionHandle,
    headers: HeaderMap,
) -> Response {
    let end = headers
        .get("x-end")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("commit")
        .to_owned();
    let run = app.counter.count_run();
    let client = tx.client().await.expect("transaction");
    let insert = format!(
        "INSERT INTO {} (key, run, body) VALUES ($1, $2, '{end}')",
        app.table
    );
    if end == "begin-commit" {
        client.batch_execute("BEGIN").await.unwrap();
    }
    client
        .execute(&insert, &[&key.as_str(), &(run as i32)])
        .await
        .unwrap();
    let ending = match end.as_str() {
        "rollback" => "ROLLBACK",
        "commit-begin" | "commit-begin-fail" => "COMMIT; BEGIN",
        "none" => "",
        _ => "COMMIT",
    };
    client.batch_execute(ending).await.unwrap();
    if headers.contains_key("x-held") {
        // Runs on with the transaction ended, the client kept.
        app.counter.held().await;
    }
    if end == "commit-begin-fail" {
        let failed = client
            .batch_execute(
                "CREATE TEMP TABLE once (id int PRIMARY KEY) ON COMMIT DROP;
                 INSERT INTO once VALUES (1), (1)",
            )
            .await;
        assert_eq!(
            failed.err().and_then(|e| e.code().cloned()),
            Some(tokio_postgres::error::SqlState::UNIQUE_VIOLATION)
        );
    }
    drop(client);
    app.counter.count_finished();
    if headers.contains_key("x-panic") {
        panic!("handler panicked on purpose");
    }
    let status = headers
        .get("x-status")
        .and_then(|v| v.to_str().ok()?.parse().ok())
        .and_then(|s| StatusCode::from_u16(s).ok())
        .unwrap_or(StatusCode::CREATED);
    (status, format!("{{\"run\":{run}}}")).into_response()
}

/// A handler that ends the layer's transaction itself: its client is told so (500
/// `transaction-ended`), never "no effect", and the key is completed with that answer,
/// outside the ended transaction, so a retry replays it and the handler runs once.
async fn a_transaction_ended_by_the_handler(end: &str, kept: i64) {
    a_transaction_ended_by_a_handler_that_answers(&[("x-end", end)], kept).await;
}

/// [`a_transaction_ended_by_the_handler`], with the handler's headers: its answer, if
/// the storage policy does not keep it, or its panic, makes the layer roll back rather
/// than commit, and it finds out there.
async fn a_transaction_ended_by_a_handler_that_answers(headers: &[(&str, &str)], kept: i64) {
    let schema = TestSchema::new();
    let store = schema.store_at(&common::database_url(), 2).await;
    let table = setup(&schema, &store).await;
    let layer = IdempotencyLayer::transactional(store.clone());
    let (router, counter) = app_on(post(ends_its_transaction), layer, &table);
    let first = common::send_bounded(&router, post_with("k", headers)).await;
    assert_eq!(first.status, 500, "{:?}", first.body);
    assert_eq!(first.problem(), "transaction-ended");
    assert_eq!(counter.finished(), 1);
    let retry = common::send_bounded(&router, post_with("k", headers)).await;
    assert_eq!(retry.outcome, Some(Outcome::Replayed));
    assert_eq!(retry.status, 500);
    assert_eq!(retry.body, first.body);
    assert_eq!(counter.runs(), 1, "the handler ran once");
    let state = format!(
        "SELECT count(*) FROM \"{}\".idempotency_keys WHERE key = 'k' AND state = 'completed' AND status = 500",
        schema.name
    );
    assert_eq!(count(&schema, &state).await, 1);
    assert_eq!(rows_in(&schema, &table).await, kept);
    common::idle(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_handler_that_commits_the_transaction_gets_transaction_ended_and_runs_once() {
    a_transaction_ended_by_the_handler("commit", 1).await;
}

/// The key is completed with `500 transaction-ended` as the layer words its problems,
/// and replayed so.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_transaction_ended_by_the_handler_is_stored_in_the_app_s_wording() {
    let schema = TestSchema::new();
    let store = schema.store_at(&common::database_url(), 2).await;
    let table = setup(&schema, &store).await;
    let base = "https://api.example.com/problems/";
    let layer = IdempotencyLayer::transactional(store.clone()).problem_type_base(base);
    let (router, counter) = app_on(post(ends_its_transaction), layer, &table);
    let first = common::send_bounded(&router, post_with("k", &[("x-end", "commit")])).await;
    assert_eq!(first.status, 500, "{:?}", first.body);
    assert_eq!(first.json()["type"], format!("{base}transaction-ended"));
    let retry = common::send_bounded(&router, post_with("k", &[("x-end", "commit")])).await;
    assert_eq!(retry.outcome, Some(Outcome::Replayed));
    assert_eq!(retry.body, first.body);
    assert_eq!(counter.runs(), 1, "the handler ran once");
    common::idle(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_handler_that_begins_and_commits_gets_transaction_ended_and_runs_once() {
    a_transaction_ended_by_the_handler("begin-commit", 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_handler_that_commits_and_begins_again_gets_transaction_ended_and_runs_once() {
    a_transaction_ended_by_the_handler("commit-begin", 1).await;
}

/// `COMMIT; BEGIN` and then a failed statement: the transaction the layer finds
/// aborted is the handler's own, and its claim row was committed `running` by the
/// handler's `COMMIT`. Neither "unstored, the key free" for its answer nor "no effect"
/// is true then: the key is finished as for any transaction ended by its handler. With
/// `status`, the handler's answer, the layer commits (a 409, which the storage policy
/// keeps) or rolls back (a 500); on a pool of one connection, once before the layer's
/// statement for that is prepared on it and once after, since the failed statement
/// shows up in either.
async fn a_failed_statement_after_the_handler_s_commit(status: &str) {
    let schema = TestSchema::new();
    let store = schema.store_at(&common::database_url(), 1).await;
    let table = setup(&schema, &store).await;
    let layer = IdempotencyLayer::transactional(store.clone());
    let (router, counter) = app_on(post(ends_its_transaction), layer, &table);
    let failing = [("x-end", "commit-begin-fail"), ("x-status", status)];
    let first = common::send_bounded(&router, post_with("k1", &failing)).await;
    assert_eq!(first.status, 500, "{:?}", first.body);
    assert_eq!(first.problem(), "transaction-ended");
    // The same answer, stored, by a handler that leaves the transaction alone: the
    // layer's statement is now prepared on the connection.
    let plain = [("x-end", "none"), ("x-status", status)];
    let plain = common::send_bounded(&router, post_with("w", &plain)).await;
    assert_eq!(plain.status.as_str(), status);
    let second = common::send_bounded(&router, post_with("k2", &failing)).await;
    assert_eq!(second.status, 500, "{:?}", second.body);
    assert_eq!(second.problem(), "transaction-ended");
    for key in ["k1", "k2"] {
        let retry = common::send_bounded(&router, post_with(key, &failing)).await;
        assert_eq!(
            retry.outcome,
            Some(Outcome::Replayed),
            "{key}: {:?}",
            retry.body
        );
        assert_eq!(retry.problem(), "transaction-ended");
    }
    assert_eq!(counter.runs(), 3, "each key ran once");
    let ended = format!(
        "SELECT count(*) FROM \"{}\".idempotency_keys WHERE key IN ('k1', 'k2') AND state = 'completed' AND status = 500",
        schema.name
    );
    assert_eq!(count(&schema, &ended).await, 2);
    // What the handlers committed stays; the plain one's write too if it committed.
    let committed = if status == "409" { 3 } else { 2 };
    assert_eq!(rows_in(&schema, &table).await, committed);
    common::idle(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_handler_that_commits_begins_and_fails_a_statement_gets_transaction_ended() {
    a_failed_statement_after_the_handler_s_commit("409").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_handler_that_commits_begins_and_fails_then_answers_500_gets_transaction_ended() {
    a_failed_statement_after_the_handler_s_commit("500").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_handler_that_rolls_the_transaction_back_gets_transaction_ended_and_runs_once() {
    a_transaction_ended_by_the_handler("rollback", 0).await;
}

/// A handler that commits the layer's transaction and then runs on for several leases:
/// its claim row is committed `running`, with the lease its claim set, and no longer in
/// a transaction the layer holds. The layer keeps it from lapsing until it finishes the
/// key, so duplicates meanwhile get 409, never a takeover and a second run, and then
/// the stored `500 transaction-ended`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_handler_that_commits_and_runs_on_past_its_lease_is_not_taken_over() {
    let schema = TestSchema::new();
    let store = schema.store_at(&common::database_url(), 4).await;
    let table = setup(&schema, &store).await;
    // Renewed every 0.5 s from 0.5 s on, the lease outlasts a stall of a second.
    let lease = Duration::from_millis(1500);
    let layer = IdempotencyLayer::transactional(store.clone()).lease_duration(lease);
    let (router, counter) = app_on(post(ends_its_transaction), layer, &table);
    let first = in_flight(&router, post_with("k", &[("x-held", "1")]), &counter).await;
    let running = format!(
        "SELECT count(*) FROM \"{}\".idempotency_keys WHERE key = 'k' AND state = 'running'",
        schema.name
    );
    for _ in 0..500 {
        if count(&schema, &running).await == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(count(&schema, &running).await, 1, "the handler's COMMIT");
    let until = tokio::time::Instant::now() + 3 * lease;
    let mut duplicates = Vec::new();
    while tokio::time::Instant::now() < until {
        let duplicate = common::send_bounded(&router, post_with("k", &[])).await;
        duplicates.push(duplicate.status.as_u16());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    counter.let_go(1);
    let first = first.await.unwrap();
    assert_eq!(first.status, 500, "{:?}", first.body);
    assert_eq!(first.problem(), "transaction-ended");
    assert!(duplicates.iter().all(|s| *s == 409), "{duplicates:?}");
    let retry = common::send_bounded(&router, post_with("k", &[])).await;
    assert_eq!(retry.outcome, Some(Outcome::Replayed), "{:?}", retry.body);
    assert_eq!(retry.body, first.body);
    assert_eq!(counter.runs(), 1, "the handler ran once");
    assert_eq!(rows_in(&schema, &table).await, 1);
    common::idle(&store).await;
}

/// What the layer cannot prevent: a handler's `ROLLBACK` lets go of its claim row and
/// its lock, and nothing holds the key until the handler returns. A retry in that time
/// takes the key and runs the handler again; the first request's client then gets `500
/// transaction-ended` unstored, and the key keeps the retry's answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_retry_after_a_handler_s_rollback_runs_again_and_keeps_its_answer() {
    let schema = TestSchema::new();
    let store = schema.store_at(&common::database_url(), 4).await;
    let table = setup(&schema, &store).await;
    let layer = IdempotencyLayer::transactional(store.clone());
    let (router, counter) = app_on(post(ends_its_transaction), layer, &table);
    let rolled_back = [("x-end", "rollback"), ("x-held", "1")];
    let first = in_flight(&router, post_with("k", &rolled_back), &counter).await;
    let retry =
        common::retry_until_created_with(&router, || post_with("k", &[("x-end", "none")]), &[409])
            .await;
    assert_eq!(retry.outcome, Some(Outcome::Executed));
    counter.let_go(1);
    let first = first.await.unwrap();
    assert_eq!(first.status, 500, "{:?}", first.body);
    assert_eq!(first.problem(), "transaction-ended");
    let replay = common::send_bounded(&router, post_with("k", &[])).await;
    assert_eq!(replay.outcome, Some(Outcome::Replayed));
    assert_eq!(replay.body, retry.body);
    assert_eq!(counter.runs(), 2, "the retry ran it again");
    assert_eq!(records_of(&schema, "k").await, 1);
    common::idle(&store).await;
}

/// A handler that rolls back the takeover of an expired record: the record is left as
/// it was, free, and is taken over completed with the layer's answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_handler_that_rolls_back_a_takeover_gets_transaction_ended_and_runs_once() {
    let schema = TestSchema::new();
    // Keys forgotten with their responses: an expired record is taken over.
    let store = schema
        .store_at(&common::database_url(), 2)
        .await
        .remember_keys_for(Duration::ZERO);
    let table = setup(&schema, &store).await;
    // Records it completes expire at once, free to be taken over.
    let expiring = IdempotencyLayer::transactional(store.clone()).ttl(Duration::from_millis(1));
    let (expiring, _) = app_on(post(ends_its_transaction), expiring, &table);
    let done = common::send_bounded(&expiring, post_with("k", &[("x-end", "none")])).await;
    assert_eq!(done.status, 201);
    let expired = format!(
        "SELECT count(*) FROM \"{}\".idempotency_keys WHERE expires_at <= now()",
        schema.name
    );
    for _ in 0..500 {
        if count(&schema, &expired).await == 1 {
            break;
        }
    }
    assert_eq!(
        count(&schema, &expired).await,
        1,
        "the record never expired"
    );
    let layer = IdempotencyLayer::transactional(store.clone());
    let (router, counter) = app_on(post(ends_its_transaction), layer, &table);
    let rolled_back = [("x-end", "rollback")];
    let first = common::send_bounded(&router, post_with("k", &rolled_back)).await;
    assert_eq!(first.status, 500, "{:?}", first.body);
    assert_eq!(first.problem(), "transaction-ended");
    let retry = common::send_bounded(&router, post_with("k", &rolled_back)).await;
    assert_eq!(retry.outcome, Some(Outcome::Replayed));
    assert_eq!(retry.body, first.body);
    assert_eq!(counter.runs(), 1, "the handler ran once");
    assert_eq!(records_of(&schema, "k").await, 1);
    common::idle(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_handler_that_commits_then_answers_500_gets_transaction_ended_and_runs_once() {
    let headers = [("x-end", "commit"), ("x-status", "500")];
    a_transaction_ended_by_a_handler_that_answers(&headers, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_handler_that_rolls_back_then_panics_gets_transaction_ended_and_runs_once() {
    let headers = [("x-end", "rollback"), ("x-panic", "1")];
    a_transaction_ended_by_a_handler_that_answers(&headers, 0).await;
}

/// A duplicate not told to wait (`wait_for_running` zero, the default) gets its `409`
/// at once, whatever the handler's own `lock_timeout`: it waits on the first request's
/// row only a moment, then gives its pooled connection back.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_duplicate_not_told_to_wait_gets_409_at_once_whatever_the_lock_timeout() {
    let schema = TestSchema::new();
    let store = schema.store().await;
    let table = setup(&schema, &store).await;
    let layer =
        IdempotencyLayer::transactional(store.clone()).lock_timeout(Duration::from_secs(3600));
    let (router, counter) = app(layer, &table);
    let first = in_flight(&router, post_with("k", &[("x-held", "1")]), &counter).await;
    for _ in 0..3 {
        let duplicate = common::send_bounded(&router, post_with("k", &[])).await;
        assert_eq!(duplicate.status, 409, "{:?}", duplicate.body);
        assert_eq!(duplicate.problem(), "in-progress");
        assert_eq!(duplicate.header("retry-after"), Some("1"));
    }
    // Only the first request holds a connection now.
    eventually(|| {
        let status = store.pool().status();
        status.size - status.available == 1
    })
    .await;
    counter.let_go(1);
    assert_eq!(first.await.unwrap().status, 201);
    let replay = send(&router, post_with("k", &[])).await;
    assert_eq!(replay.outcome, Some(Outcome::Replayed));
    assert_eq!(counter.runs(), 1);
    common::idle(&store).await;
}

/// The claim waits on another request's row only a moment; the handler's own
/// statements get `lock_timeout`, set in the claim's round trip.
#[tokio::test]
async fn the_handler_s_lock_waits_keep_lock_timeout_not_the_claim_s() {
    let schema = TestSchema::new();
    let store = schema.store().await;
    let table = setup(&schema, &store).await;
    let handler = |tx: TransactionHandle| async move {
        let client = tx.client().await.expect("transaction");
        let row = client.query_one("SHOW lock_timeout", &[]).await.unwrap();
        (StatusCode::CREATED, row.get::<_, String>(0))
    };
    for (layer, expected) in [
        (IdempotencyLayer::transactional(store.clone()), "5s"),
        (
            IdempotencyLayer::transactional(store.clone()).lock_timeout(Duration::from_secs(42)),
            "42s",
        ),
    ] {
        let (router, _) = app_on(post(handler), layer, &table);
        let key = format!("k{expected}");
        let created = send(&router, post_with(&key, &[])).await;
        assert_eq!(created.status, 201);
        assert_eq!(created.body, expected);
    }
    common::idle(&store).await;
}

/// [`app`] behind the tests' authentication, outside the layer: `Bearer
/// <account>.<secret>` names the request's principal.
fn app_behind_auth(layer: IdempotencyLayer, table: &str) -> (Router, Counter) {
    let (router, counter) = app(layer, table);
    let router = router.layer(axum::middleware::from_fn(common::authenticate));
    (router, counter)
}

/// In transactional mode too, keys are scoped by the principal: a retry with a
/// refreshed token is replayed and writes nothing; another account's key is its own.
#[tokio::test]
async fn a_refreshed_token_is_replayed_in_transactional_mode() {
    let schema = TestSchema::new();
    let store = schema.store().await;
    let table = setup(&schema, &store).await;
    let layer = IdempotencyLayer::transactional(store.clone()).require_principal(true);
    let (router, counter) = app_behind_auth(layer, &table);
    let first = send(&router, common::post_as("acct7.first", "k", "{}")).await;
    assert_eq!(first.outcome, Some(Outcome::Executed));
    let refreshed = send(&router, common::post_as("acct7.second", "k", "{}")).await;
    assert_eq!(refreshed.outcome, Some(Outcome::Replayed));
    assert_eq!(refreshed.body, first.body);
    let other = send(&router, common::post_as("acct8.x", "k", "{}")).await;
    assert_eq!(other.outcome, Some(Outcome::Executed));
    assert_eq!(counter.runs(), 2);
    assert_eq!(rows_in(&schema, &table).await, 2);
    let scopes = schema
        .query(&format!(
            "SELECT scope FROM \"{}\".idempotency_keys WHERE key = 'k' ORDER BY scope",
            schema.name
        ))
        .await;
    let scopes: Vec<String> = scopes.iter().map(|r| r.get(0)).collect();
    assert_eq!(scopes, ["principal:acct7", "principal:acct8"]);
    common::idle(&store).await;
}

/// A deploy of transactional mode that starts scoping by principal where it scoped by
/// the `Authorization` hash: a retry of a request committed before is replayed, its
/// claim under the principal rolled back, and the handler writes nothing again; a key
/// the old scope never had runs. The transition costs a replay nothing: one read more
/// for a new key only.
#[tokio::test]
async fn an_upgrade_to_principals_replays_keys_committed_under_the_authorization_hash() {
    let schema = TestSchema::new();
    let (proxy, store, table) = through_proxy(&schema, 1).await;
    let (old, old_counter) = app(IdempotencyLayer::transactional(store.clone()), &table);
    let first = send(&old, common::post_as("acct7.first", "done", "{}")).await;
    assert_eq!(first.outcome, Some(Outcome::Executed));

    let layer = IdempotencyLayer::transactional(store.clone())
        .require_principal(true)
        .previous_scope_with(tower_idempotency::Scope::from_authorization);
    let (new, counter) = app_behind_auth(layer, &table);
    let commits = proxy.commits();
    let retry = send(&new, common::post_as("acct7.first", "done", "{}")).await;
    assert_eq!(retry.outcome, Some(Outcome::Replayed));
    assert_eq!(retry.body, first.body);
    let other = send(&new, common::post_as("acct7.first", "done", "{\"a\":1}")).await;
    assert_eq!(other.status, 422);
    assert_eq!(other.problem(), "key-reused");
    assert_eq!(counter.runs(), 0);
    assert_eq!(proxy.commits(), commits, "nothing committed");
    assert_eq!(rows_in(&schema, &table).await, 1);
    assert_eq!(
        records_of(&schema, "done").await,
        1,
        "the new claims rolled back"
    );

    // What a new key and a replay cost without the transition, on the old layer...
    let cost = |router: Router, token: &'static str, key: &'static str| {
        let proxy = &proxy;
        async move {
            let before = proxy.executes();
            let reply = send(&router, common::post_as(token, key, "{}")).await;
            (reply, proxy.executes() - before)
        }
    };
    let (_, new_key) = cost(old.clone(), "acct7.first", "before").await;
    let (_, replay) = cost(old.clone(), "acct7.first", "before").await;
    // ...and with it: one read more for a key new in both scopes (once its statement is
    // prepared on the connection), nothing for a replay.
    cost(new.clone(), "acct7.first", "warm-up").await;
    let (fresh, with_transition) = cost(new.clone(), "acct7.first", "fresh").await;
    assert_eq!(fresh.outcome, Some(Outcome::Executed));
    assert_eq!(with_transition, new_key + 1);
    let (again, with_transition) = cost(new.clone(), "acct7.second", "fresh").await;
    assert_eq!(again.outcome, Some(Outcome::Replayed));
    assert_eq!(again.body, fresh.body);
    assert_eq!(with_transition, replay);
    assert_eq!((counter.runs(), old_counter.runs()), (2, 2));
    assert_eq!(rows_in(&schema, &table).await, 4);
    common::idle(&store).await;
}

/// A lease-mode claim made before the upgrade to the JSON scheme (a bytes
/// fingerprint), its holder gone and its lease lapsed: a retry through a transactional
/// layer of the JSON scheme takes it over and runs once, then is replayed, instead of a
/// `409` until the record expires.
#[tokio::test]
async fn a_lapsed_claim_made_before_the_json_scheme_is_taken_over_in_a_transaction() {
    use axum::http::header::CONTENT_TYPE;
    use tower_idempotency::{
        FingerprintScheme, Scope,
        store::{Claim, ClaimRequest, Store},
    };
    let schema = TestSchema::new();
    let store = schema.store().await;
    let table = setup(&schema, &store).await;
    let (parts, body) = post_with("k", &[]).into_parts();
    let body = axum::body::to_bytes(body, usize::MAX).await.unwrap();
    let old = FingerprintScheme::Bytes.fingerprint(&parts, &[CONTENT_TYPE], &body);
    let (scope, lease) = (Scope::anonymous(), Duration::from_secs(1));
    let request = ClaimRequest {
        scope: &scope,
        key: "k",
        fingerprint: old,
        lease,
        ttl: Duration::from_secs(60),
    };
    let Claim::Acquired(held) = store.claim(&request).await.unwrap() else {
        panic!("the old claim must acquire")
    };
    tokio::time::sleep(lease * 2).await;

    let (router, counter) = app(IdempotencyLayer::transactional(store.clone()), &table);
    let retry = send(&router, post_with("k", &[])).await;
    assert_eq!(retry.status, 201, "{:?}", retry.body);
    assert_eq!(retry.outcome, Some(Outcome::Executed));
    let again = send(&router, post_with("k", &[])).await;
    assert_eq!(again.outcome, Some(Outcome::Replayed));
    assert_eq!(counter.runs(), 1);
    assert_eq!(rows_in(&schema, &table).await, 1);
    let record = store.look_up(&scope, "k").await.unwrap().unwrap();
    assert!(record.token > held.token);
}
