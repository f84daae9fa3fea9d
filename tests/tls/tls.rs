//! The store over TLS (`connect_with_tls`, `pool_for_url_with_tls`, `with_tls`,
//! `sslmode=require`): its pool, its `LISTEN` connection and its cancel requests. A
//! crate of its own, so that the crate's other tests and examples do not build a TLS
//! stack; it shares their support (`tests/common`). The server must offer TLS
//! (`ssl = on`, as Debian's package sets it, with a self-signed certificate).

#![allow(clippy::unwrap_used)] // unwrap in test helpers: a failure is the test failing

#[path = "../common/mod.rs"]
mod common;
mod connector;

use std::time::Duration;

use common::{
    TestSchema, app, ledger::abandoned_claim_stops_waiting, post,
    replicas::woken_by_a_notification, send, wait_for_state,
};
use connector::{store_over_tls, tls, tls_connections, tls_url};
use tower_idempotency::{IdempotencyLayer, store::PostgresStore};

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
