//! The store over TLS (`connect_with_tls`, `pool_for_url_with_tls`, `with_tls`,
//! `sslmode=require`): its pool, its `LISTEN` connection and its cancel requests; and
//! `SqlxStore` over an app's sqlx pool with `sslmode=require` (sqlx's rustls): the
//! pool's sessions and every connection the store makes itself, checked encrypted on
//! the server (`pg_stat_ssl`). A crate of its own, so that the crate's other tests and
//! examples do not build a TLS stack; it shares their support (`tests/common`). The
//! server must offer TLS (`ssl = on`, as Debian's package sets it, with a self-signed
//! certificate).

#![allow(clippy::unwrap_used)] // unwrap in test helpers: a failure is the test failing

#[path = "../common/mod.rs"]
mod common;
mod connector;

use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex},
    time::Duration,
};

use axum::http::StatusCode;
use common::{
    TestSchema, app, in_flight, ledger::abandoned_claim_stops_waiting, post,
    replicas::woken_by_a_notification, retry_until_created, send, wait_for_state,
};
use connector::{store_over_tls, tls, tls_connections, tls_url};
use tower_idempotency::{
    IdempotencyLayer, Outcome,
    store::{PostgresStore, SqlxStore},
    transactional::SqlxTransaction,
};

/// Over TLS (`connect_with_tls`, `sslmode=require`), the `LISTEN` connection is
/// encrypted like the pool's, and wakes a duplicate on another replica.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_duplicate_on_another_replica_is_woken_over_tls() {
    let schema = TestSchema::new();
    let (a, b) = (store_over_tls(&schema).await, store_over_tls(&schema).await);
    b.listen().await.expect("LISTEN over TLS");
    let (open, encrypted, listening) = tls_connections(&schema).await;
    assert!(open >= 3, "two pools and a listener: {open}");
    assert_eq!(encrypted, open, "a connection in the clear");
    assert_eq!(listening, 1, "the LISTEN connection");
    woken_by_a_notification(a, b).await;
}

/// Transactional mode over TLS (`sslmode=require`): a claim whose client hung up while
/// it waited on a lock stops waiting on the server, as over plain TCP
/// (`transactional.rs`): the cancel request goes over TLS too, as the driver will not
/// send it in the clear.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_abandoned_claim_stops_waiting_on_the_server_over_tls() {
    let schema = TestSchema::new();
    let store = store_over_tls(&schema).await;
    abandoned_claim_stops_waiting(&schema, store).await;
}

/// A claim given up on while it waits on the server for a row lock, whose cancel
/// request cannot be sent (a TLS pool whose store was not given the connector), lands
/// only after the first releases in doubt have found nothing. A later release, spaced
/// out while its lease holds, still finds it: the retry runs long before the lease
/// lapses.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_claim_that_lands_late_on_a_lock_is_still_released() {
    let schema = TestSchema::new();
    schema.store().await;
    let url = tls_url(&schema.name);
    let store = PostgresStore::new(
        tower_idempotency::store::pool_for_url_with_tls(&url, 4, tls()).unwrap(),
    )
    .with_schema_name(&schema.name)
    .unwrap();
    let layer = IdempotencyLayer::new(store.clone())
        .store_timeout(Duration::from_millis(300))
        .lease_duration(Duration::from_secs(600));
    let (router, counter) = app(layer);
    assert_eq!(send(&router, post("warm", "{}")).await.status, 201);
    // Another transaction holds the key's row, uncommitted: a claim waits on it.
    let (holder, connection) =
        tokio_postgres::connect(&common::database_url(), tokio_postgres::NoTls)
            .await
            .unwrap();
    tokio::spawn(connection);
    holder
        .batch_execute(&format!(
            "BEGIN; INSERT INTO \"{}\".idempotency_keys
                 (scope, key, fingerprint, state, token, locked_until, expires_at)
             VALUES ('', 'k', '\\x00', 'running', 1, now() + interval '1 hour',
                     now() + interval '1 hour')",
            schema.name
        ))
        .await
        .unwrap();
    let before = store.metrics().statements;
    assert_eq!(send(&router, post("k", "{}")).await.status, 503);
    schema.wait_for_lock_waiters(1).await;
    // Dropped after the store's 5 s, its connection closed (the cancel request cannot
    // go over plain TCP to a server that requires TLS), the claim still waits there.
    // Its first three releases in doubt, at once, 1 s and 5 s after that, find nothing.
    for _ in 0..400 {
        if store.metrics().statements >= before + 4 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        store.metrics().statements >= before + 4,
        "the claim and its three releases: {:?}",
        store.metrics()
    );
    assert_eq!(schema.lock_waiters().await, 1, "the claim no longer waits");
    holder.batch_execute("ROLLBACK").await.unwrap();
    // Now it lands: the key is held, though nobody runs it.
    wait_for_state(&schema, "k", "running").await;
    let mut answers = Vec::new();
    for _ in 0..60 {
        let reply = send(&router, post("k", "{}")).await;
        answers.push(reply.status.as_u16());
        if reply.status == 201 {
            break;
        }
        assert_eq!(reply.status, 409, "{answers:?}");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert_eq!(answers.last(), Some(&201), "{answers:?}");
    assert_eq!(counter.runs_of("k"), 1);
}

/// The connector docs/security.md shows, trusting only the roots it is given: a server
/// whose certificate they did not sign (the test server's, self-signed) is refused,
/// and the store's error says why.
#[tokio::test]
async fn a_server_certificate_the_roots_did_not_sign_is_refused() {
    let schema = TestSchema::new();
    let roots = rustls::RootCertStore::empty();
    let config = rustls::ClientConfig::builder()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let tls = tokio_postgres_rustls::MakeRustlsConnect::new(config);
    let store = PostgresStore::connect_with_tls(&tls_url(&schema.name), tls)
        .unwrap()
        .with_schema_name(&schema.name)
        .unwrap();
    let error = store.migrate().await.unwrap_err().to_string();
    assert!(error.contains("certificate"), "{error}");
}

/// A sqlx pool of `size` connections requiring TLS (`sslmode=require`: sqlx's rustls,
/// the feature `tls-rustls-ring-webpki`, takes the test server's self-signed
/// certificate), named after the schema; and a migrated `SqlxStore` on it.
async fn sqlx_store_over_tls(schema: &TestSchema, size: u32) -> (SqlxStore, sqlx::PgPool) {
    let ssl: String = schema.query("SHOW ssl").await[0].get(0);
    assert_eq!(ssl, "on", "the TLS tests need a PostgreSQL that offers TLS");
    let options: sqlx::postgres::PgConnectOptions = tls_url(&schema.name).parse().unwrap();
    assert!(matches!(
        options.get_ssl_mode(),
        sqlx::postgres::PgSslMode::Require
    ));
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(size)
        .connect_with(options)
        .await
        .expect("a sqlx pool over TLS");
    let store = SqlxStore::new(pool.clone())
        .with_schema_name(&schema.name)
        .unwrap();
    store.migrate().await.expect("migrate over TLS");
    (store, pool)
}

/// The sessions named after `schema` open now, read on the server: (how many, how
/// many of them encrypted, how many of them meet `condition`, SQL on `a`, their row
/// of `pg_stat_activity`).
async fn sessions(schema: &TestSchema, condition: &str) -> (i64, i64, i64) {
    let row = &schema
        .query(&format!(
            "SELECT count(*), count(*) FILTER (WHERE s.ssl),
                    count(*) FILTER (WHERE {condition})
             FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid)
             WHERE a.application_name = '{}'",
            schema.name
        ))
        .await[0];
    (row.get(0), row.get(1), row.get(2))
}

/// Lease mode on sqlx over the app's TLS pool: a request executes, then replays; the
/// pool's sessions and the store's `LISTEN` connection (made with the pool's options)
/// are all encrypted.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlx_lease_mode_runs_over_tls_on_every_session() {
    let schema = TestSchema::new();
    let (store, _pool) = sqlx_store_over_tls(&schema, 2).await;
    store.listen().await.expect("LISTEN over TLS");
    let (router, counter) = app(IdempotencyLayer::new(store));
    let first = send(&router, post("k", "{}")).await;
    assert_eq!(first.status, 201);
    assert_eq!(first.outcome, Some(Outcome::Executed));
    let again = send(&router, post("k", "{}")).await;
    assert_eq!(again.outcome, Some(Outcome::Replayed));
    assert_eq!(again.body, first.body);
    assert_eq!(counter.runs_of("k"), 1);
    let (open, encrypted, listening) = sessions(&schema, "a.query LIKE 'LISTEN%'").await;
    assert!(open >= 2, "the pool and the listener: {open}");
    assert_eq!(encrypted, open, "a session in the clear");
    assert_eq!(listening, 1, "the LISTEN connection");
}

/// Liveness on sqlx over TLS: the lock's connection and the heartbeat's, both the
/// store's own (made with the pools' options), are encrypted.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlx_liveness_connections_are_over_tls() {
    let schema = TestSchema::new();
    let (store, _pool) = sqlx_store_over_tls(&schema, 2).await;
    let store = store.with_liveness(true);
    store.start_liveness().await.expect("liveness over TLS");
    let (router, counter) = app(IdempotencyLayer::new(store));
    // The heartbeat's connection is made while a claim runs (its first renewal comes
    // a quarter of a second after the claim), and kept: a handler held until it is.
    let held = with_header(post("k", "{}"), "x-held");
    let running = in_flight(&router, held, &counter).await;
    let mut beat = (0, 0, 0);
    for _ in 0..200 {
        beat = sessions(&schema, "a.query LIKE 'UPDATE % SET seen_at = now()%'").await;
        if beat.2 >= 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    counter.let_go(1);
    assert_eq!(running.await.unwrap().status, 201);
    assert!(beat.2 >= 1, "no heartbeat connection: {beat:?}");
    let (open, encrypted, locking) = sessions(
        &schema,
        "EXISTS (SELECT FROM pg_locks l
                 WHERE l.pid = a.pid AND l.locktype = 'advisory' AND l.granted)",
    )
    .await;
    assert_eq!(locking, 1, "the lock's connection");
    assert!(
        open >= 3,
        "the pool, the lock's and the heartbeat's: {open}"
    );
    assert_eq!(encrypted, open, "a session in the clear");
}

/// The handler of the transactional test: a statement in the request's transaction;
/// with `x-keep`, a task keeps the transaction's connection past the response (in
/// `pg_sleep(1.5)`), so that the pool of one has none idle when the layer ends that
/// transaction from another session.
async fn in_transaction(
    tx: SqlxTransaction,
    headers: axum::http::HeaderMap,
) -> (StatusCode, &'static str) {
    let mut conn = tx.connection().await.unwrap();
    sqlx::query("SELECT 1").execute(&mut *conn).await.unwrap();
    if headers.contains_key("x-keep") {
        tokio::spawn(async move {
            let _ = sqlx::query("SELECT pg_sleep(1.5)")
                .execute(&mut *conn)
                .await;
            drop(conn);
            tokio::time::sleep(Duration::from_secs(600)).await;
            drop(tx);
        });
    }
    (StatusCode::CREATED, "{}")
}

/// Transactional mode on sqlx over the app's TLS pool of one connection. A handler
/// keeps its connection past the response: the layer ends its transaction
/// (`pg_terminate_backend`) on a connection of the store's own, as the pool has none
/// idle, made with the pool's options; then a retry runs. A sampler of the server's
/// sessions named after the schema, all along, sees that connection (tried again on
/// another key until it does: it lives a few milliseconds) and every other: all are
/// encrypted.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlx_transactional_mode_runs_over_tls_with_the_stores_own_connection() {
    let schema = TestSchema::new();
    let (store, _pool) = sqlx_store_over_tls(&schema, 1).await;
    let layer = IdempotencyLayer::transactional(store)
        .store_timeout(Duration::from_millis(500))
        .lock_timeout(Duration::from_millis(200));
    let router = axum::Router::new()
        .route("/payments", axum::routing::post(in_transaction))
        .layer(layer);
    let sampler = Sampler::start(&schema).await;
    let mut ended_apart = None;
    for n in 0..20 {
        let key = format!("k{n}");
        let kept = send(&router, with_header(post(&key, "{}"), "x-keep")).await;
        assert_eq!(kept.status, 500, "{:?}", kept.body);
        let retry = retry_until_created(&router, &key, &[409]).await;
        assert_eq!(retry.outcome, Some(Outcome::Executed));
        ended_apart = sampler.seen().into_iter().find(|s| s.2);
        if ended_apart.is_some() {
            break;
        }
    }
    let seen = sampler.stop().await;
    assert!(
        ended_apart.is_some(),
        "the store's own connection, ending the kept transaction, never seen: {seen:?}"
    );
    assert!(seen.iter().all(|s| s.1), "a session in the clear: {seen:?}");
}

/// Every session named after a schema the server shows while it runs, sampled as
/// fast as one connection can ask: (pid, encrypted, seen ending another session's
/// transaction).
struct Sampler {
    seen: Arc<Mutex<BTreeMap<i32, (bool, bool)>>>,
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<()>,
}

impl Sampler {
    async fn start(schema: &TestSchema) -> Self {
        let seen = Arc::new(Mutex::new(BTreeMap::new()));
        let (stop, mut stopped) = tokio::sync::oneshot::channel::<()>();
        let (client, connection) =
            tokio_postgres::connect(&common::database_url(), tokio_postgres::NoTls)
                .await
                .unwrap();
        tokio::spawn(connection);
        let sample = client
            .prepare(
                "SELECT a.pid, s.ssl, a.query LIKE '%pg_terminate_backend%'
                 FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid)
                 WHERE a.application_name = $1",
            )
            .await
            .unwrap();
        let name = schema.name.clone();
        let task = tokio::spawn({
            let seen = seen.clone();
            async move {
                while stopped.try_recv().is_err() {
                    for row in client.query(&sample, &[&name]).await.unwrap() {
                        let (pid, ssl, ending): (i32, bool, bool) =
                            (row.get(0), row.get(1), row.get(2));
                        let mut seen = seen.lock().unwrap();
                        let entry = seen.entry(pid).or_insert((ssl, false));
                        entry.0 &= ssl;
                        entry.1 |= ending;
                    }
                }
            }
        });
        Self { seen, stop, task }
    }

    fn seen(&self) -> Vec<(i32, bool, bool)> {
        let seen = self.seen.lock().unwrap();
        seen.iter()
            .map(|(&pid, &(ssl, ending))| (pid, ssl, ending))
            .collect()
    }

    async fn stop(self) -> Vec<(i32, bool, bool)> {
        self.stop.send(()).unwrap();
        self.task.await.unwrap();
        let seen = self.seen.lock().unwrap();
        seen.iter()
            .map(|(&pid, &(ssl, ending))| (pid, ssl, ending))
            .collect()
    }
}

/// `request` with the header `name` set (to `1`).
fn with_header(
    mut request: axum::http::Request<axum::body::Body>,
    name: &'static str,
) -> axum::http::Request<axum::body::Body> {
    request
        .headers_mut()
        .insert(name, axum::http::HeaderValue::from_static("1"));
    request
}
