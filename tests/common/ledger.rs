//! The transactional mode's test app: `POST /payments` whose handler writes a row per
//! run into a ledger table of the test's schema, in the request's transaction; and the
//! checks run on it over plain TCP and over TLS.

use std::time::Duration;

use axum::{
    Router,
    body::{Body, Bytes},
    extract::State,
    http::{HeaderMap, StatusCode},
    response::{IntoResponse, Response},
    routing::{MethodRouter, post},
};
use tower_idempotency::{
    IdempotencyKey, IdempotencyLayer, store::PostgresStore, transactional::TransactionHandle,
};

use super::{Counter, TestSchema, database_url, req, send};

/// The handlers' state: their runs, and the table they write to.
#[derive(Clone)]
pub struct App {
    pub counter: Counter,
    pub table: String,
}

/// Writes one row per run into `<schema>.ledger` inside the request's transaction.
/// Headers steer it: `x-held` (after the write, until the test lets it go),
/// `x-delay-ms` (after the write), `x-status`, `x-panic`.
pub async fn create(
    State(app): State<App>,
    key: IdempotencyKey,
    tx: TransactionHandle,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let run = app.counter.count_run();
    {
        let client = tx.client().await.expect("transaction");
        let inserted = client
            .execute(
                &format!(
                    "INSERT INTO {} (key, run, body) VALUES ($1, $2, $3)",
                    app.table
                ),
                &[
                    &key.as_str(),
                    &(run as i32),
                    &String::from_utf8_lossy(&body).as_ref(),
                ],
            )
            .await;
        if let Err(e) = inserted {
            // The connection died under the handler: its error, and the layer rolls back.
            return (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response();
        }
    }
    if headers.contains_key("x-held") {
        app.counter.held().await;
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
    (status, format!("{{\"run\":{run}}}")).into_response()
}

/// Creates the ledger table (`<schema>.ledger`) and returns its name.
pub async fn setup(schema: &TestSchema, store: &PostgresStore) -> String {
    let table = format!("\"{}\".ledger", schema.name);
    store
        .pool()
        .get()
        .await
        .expect("a connection")
        .batch_execute(&format!(
            "CREATE TABLE {table} (key text NOT NULL, run int NOT NULL, body text NOT NULL)"
        ))
        .await
        .expect("the ledger table");
    table
}

/// `POST /payments` served by [`create`], behind `layer`, writing to `table`.
pub fn app(layer: IdempotencyLayer, table: &str) -> (Router, Counter) {
    app_on(post(create), layer, table)
}

/// `POST /payments` served by `route`, behind `layer`, writing to `table`.
pub fn app_on(route: MethodRouter<App>, layer: IdempotencyLayer, table: &str) -> (Router, Counter) {
    let counter = Counter::default();
    let router = Router::new()
        .route("/payments", route)
        .layer(layer)
        .with_state(App {
            counter: counter.clone(),
            table: table.to_owned(),
        });
    (router, counter)
}

/// `POST /payments` with `key`, a small JSON body, and the `extra` headers.
pub fn post_with(key: &str, extra: &[(&str, &str)]) -> axum::http::Request<Body> {
    post_body(key, "{\"amount\":1}", extra)
}

/// [`post_with`] with `body`.
pub fn post_body(key: &str, body: &str, extra: &[(&str, &str)]) -> axum::http::Request<Body> {
    let mut b = req("POST").header("idempotency-key", key);
    for (k, v) in extra {
        b = b.header(*k, *v);
    }
    b.body(Body::from(body.to_owned())).expect("request")
}

/// A duplicate on `store` whose client hangs up while its claim waits on a lock the
/// test holds: asserts that its statement stops waiting on the server.
pub async fn abandoned_claim_stops_waiting(schema: &TestSchema, store: PostgresStore) {
    let table = setup(schema, &store).await;
    let layer = IdempotencyLayer::transactional(store).wait_for_running(Duration::from_secs(600));
    let (router, _) = app(layer, &table);
    // Every claim waits while the test holds the keys table.
    let lock = format!(
        "BEGIN; LOCK TABLE \"{}\".idempotency_keys IN ACCESS EXCLUSIVE MODE",
        schema.name
    );
    let (holder, conn) = tokio_postgres::connect(&database_url(), tokio_postgres::NoTls)
        .await
        .expect("connect");
    tokio::spawn(conn);
    holder.batch_execute(&lock).await.expect("LOCK TABLE");
    let client = tokio::spawn({
        let router = router.clone();
        async move { send(&router, post_with("k", &[])).await }
    });
    schema.wait_for_lock_waiters(1).await;
    client.abort();
    let mut waiting = 1;
    for _ in 0..500 {
        waiting = schema.lock_waiters().await;
        if waiting == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(waiting, 0, "the abandoned claim still waits on the server");
    holder.batch_execute("ROLLBACK").await.expect("ROLLBACK");
}
