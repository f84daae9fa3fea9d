//! Hostile and broken input: every case gets its own problem document, runs nothing and
//! leaves no row behind.
#![allow(clippy::unwrap_used)] // unwrap in test helpers: a failure is the test failing

mod common;

use std::time::Duration;

use axum::body::Body;
use common::{TestSchema, Trickle, app, post, post_with_headers, req, send};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tower_idempotency::{IdempotencyLayer, Outcome};

async fn rows(schema: &TestSchema) -> i64 {
    schema
        .query(&format!(
            "SELECT count(*) FROM \"{}\".idempotency_keys",
            schema.name
        ))
        .await[0]
        .get(0)
}

#[tokio::test]
async fn every_bad_key_is_a_specific_400_and_leaves_no_row() {
    let schema = TestSchema::new();
    let (router, counter) = app(IdempotencyLayer::new(schema.store().await));
    let long = "k".repeat(256);
    let cases: Vec<(&[u8], &str)> = vec![
        (b"", "empty"),
        (b"\"\"", "empty"),
        (long.as_bytes(), "256 characters"),
        (b"a b", "invalid character"),
        (b"caf\xc3\xa9", "invalid character"),
        (b"\xff\xfe", "invalid character"),
        (b"\"abc", "no closing quote"),
        (b"\"a\\x\"", "invalid escape"),
        (b"\"a\";p=1", "after its closing quote"),
        (b"a\"b", "invalid character"),
    ];
    for (raw, expected) in cases {
        let r = send(
            &router,
            req("POST")
                .header(
                    "idempotency-key",
                    axum::http::HeaderValue::from_bytes(raw).unwrap(),
                )
                .body(Body::from("{}"))
                .unwrap(),
        )
        .await;
        assert_eq!(r.status, 400, "{raw:?}");
        assert_eq!(r.problem(), "key-malformed");
        let detail = r.json()["detail"].as_str().unwrap().to_owned();
        assert!(detail.contains(expected), "{raw:?}: {detail}");
    }
    let two = post_with_headers("a", &[("idempotency-key", "b")]);
    let r = send(&router, two).await;
    assert!(
        r.json()["detail"]
            .as_str()
            .unwrap()
            .contains("more than one")
    );
    assert_eq!(counter.runs(), 0);
    assert_eq!(rows(&schema).await, 0);
}

#[tokio::test]
async fn a_body_that_never_ends_is_408_and_claims_nothing() {
    let schema = TestSchema::new();
    let layer = IdempotencyLayer::new(schema.store().await)
        .request_body_timeout(Duration::from_millis(200));
    let (router, counter) = app(layer);
    let endless = Trickle {
        left: None,
        every: Duration::from_millis(20),
        sleep: None,
    };
    let r = send(
        &router,
        req("POST")
            .header("idempotency-key", "k")
            .body(Body::new(endless))
            .unwrap(),
    )
    .await;
    assert_eq!(r.status, 408);
    assert_eq!(r.problem(), "body-timeout");
    assert_eq!(r.outcome, Some(Outcome::Rejected));
    assert_eq!(counter.runs(), 0);
    assert_eq!(rows(&schema).await, 0);
    // The key is free: a complete request with it runs.
    assert_eq!(send(&router, post("k", "{}")).await.status, 201);
}

#[tokio::test]
async fn a_slow_client_is_408() {
    let schema = TestSchema::new();
    let layer = IdempotencyLayer::new(schema.store().await)
        .request_body_timeout(Duration::from_millis(200));
    let (router, counter) = app(layer);
    // 50 bytes at one per 20 ms: under the size limit, over the time limit.
    let slow = Trickle {
        left: Some(50),
        every: Duration::from_millis(20),
        sleep: None,
    };
    let r = send(
        &router,
        req("POST")
            .header("idempotency-key", "k")
            .body(Body::new(slow))
            .unwrap(),
    )
    .await;
    assert_eq!(r.status, 408);
    assert_eq!(counter.runs(), 0);
    assert_eq!(rows(&schema).await, 0);
}

#[tokio::test]
async fn a_body_over_the_limit_is_413_with_or_without_content_length() {
    let schema = TestSchema::new();
    let layer = IdempotencyLayer::new(schema.store().await).request_body_limit(16);
    let (router, counter) = app(layer);
    // Declared over the limit: refused before reading.
    let declared = post_with_headers("k", &[("content-length", "1000000")]);
    assert_eq!(send(&router, declared).await.problem(), "body-too-large");
    // Declared under the limit, but the body is larger: the reader counts the bytes.
    let lying = req("POST")
        .header("idempotency-key", "k")
        .header("content-length", "2")
        .body(Body::from("x".repeat(100)))
        .unwrap();
    assert_eq!(send(&router, lying).await.problem(), "body-too-large");
    // No length at all.
    let chunked = Trickle {
        left: Some(20),
        every: Duration::from_millis(1),
        sleep: None,
    };
    let r = send(
        &router,
        req("POST")
            .header("idempotency-key", "k")
            .body(Body::new(chunked))
            .unwrap(),
    )
    .await;
    assert_eq!(r.status, 413);
    assert_eq!(counter.runs(), 0);
    assert_eq!(rows(&schema).await, 0);
}

/// A size limit set in front of the layer, whose error reaches it wrapped, is a 413 too.
#[tokio::test]
async fn a_body_over_a_limit_in_front_of_the_layer_is_413() {
    let schema = TestSchema::new();
    let (router, counter) = app(IdempotencyLayer::new(schema.store().await));
    let limited = http_body_util::Limited::new(
        common::Chunked::new(&["{\"amount\":".into(), "12345678}".into()]),
        10,
    );
    let r = send(
        &router,
        req("POST")
            .header("idempotency-key", "k")
            .body(Body::new(limited))
            .unwrap(),
    )
    .await;
    assert_eq!(r.status, 413, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.problem(), "body-too-large");
    assert_eq!(counter.runs(), 0);
    assert_eq!(rows(&schema).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_content_length_that_lies_on_the_wire_is_408() {
    let schema = TestSchema::new();
    let layer = IdempotencyLayer::new(schema.store().await)
        .request_body_timeout(Duration::from_millis(300));
    let (router, counter) = app(layer);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(async move { axum::serve(listener, router).await });
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    // Promises 100 bytes, sends 2, and waits.
    conn.write_all(
        format!(
            "POST /payments HTTP/1.1\r\nhost: {addr}\r\nidempotency-key: k\r\n\
             content-type: application/json\r\ncontent-length: 100\r\n\r\n{{}}"
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    let mut answer = vec![0u8; 4096];
    let n = conn.read(&mut answer).await.unwrap();
    let answer = String::from_utf8_lossy(&answer[..n]);
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("application/problem+json"), "{answer}");
    assert_eq!(counter.runs(), 0);
    assert_eq!(rows(&schema).await, 0);
    server.abort();
}

#[tokio::test]
async fn credentials_are_never_stored_in_clear() {
    let schema = TestSchema::new();
    let (router, _) = app(IdempotencyLayer::new(schema.store().await));
    let r = send(
        &router,
        post_with_headers("k", &[("authorization", "Bearer sk_live_very_secret")]),
    )
    .await;
    assert_eq!(r.status, 201);
    let stored = schema
        .query(&format!(
            "SELECT scope || encode(headers, 'escape') || encode(body, 'escape') FROM \"{}\".idempotency_keys",
            schema.name
        ))
        .await;
    let everything: String = stored[0].get(0);
    assert!(everything.starts_with("auth:"), "{everything}");
    assert!(!everything.contains("sk_live"), "{everything}");
    assert!(
        !everything.contains("session="),
        "Set-Cookie must not be stored: {everything}"
    );
}
