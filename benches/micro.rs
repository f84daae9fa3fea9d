//! Micro-benchmarks of the layer's own work per request: parsing the key,
//! fingerprinting the request (and what each fingerprint scheme costs a JSON body), encoding and decoding stored headers, a request
//! without a key passed through an Axum router, and what sealing stored responses costs
//! a replay and a completion.
//!
//! `cargo bench -p benches --bench micro`
#![allow(missing_docs)] // criterion_group! generates an undocumented function

use std::hint::black_box;

use bytes::Bytes;
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use http::{HeaderMap, HeaderValue, Request, header::CONTENT_TYPE};
use tower::ServiceExt;
use tower_idempotency::{
    FingerprintScheme, IdempotencyLayer, StoredResponse, fingerprint, parse_key, store::MemoryStore,
};

fn key_parsing(c: &mut Criterion) {
    let mut g = c.benchmark_group("parse_key");
    g.bench_function("bare uuid", |b| {
        b.iter(|| parse_key(black_box(b"8e03978e-40d5-43e8-bc93-6894a57f9324")))
    });
    g.bench_function("sf-string uuid", |b| {
        b.iter(|| parse_key(black_box(b"\"8e03978e-40d5-43e8-bc93-6894a57f9324\"")))
    });
    g.finish();
}

fn fingerprinting(c: &mut Criterion) {
    let (parts, ()) = Request::post("/payments?currency=EUR")
        .header(CONTENT_TYPE, "application/json")
        .body(())
        .expect("request")
        .into_parts();
    let mut g = c.benchmark_group("fingerprint");
    for (name, size) in [("1 KiB", 1024), ("1 MiB", 1024 * 1024)] {
        let body = Bytes::from(vec![b'x'; size]);
        g.throughput(Throughput::Bytes(size as u64));
        g.bench_function(name, |b| {
            b.iter(|| fingerprint(black_box(&parts), &[CONTENT_TYPE], black_box(&body)))
        });
    }
    g.finish();
}

/// A JSON body of about `size` bytes: an object of payments, as an API receives them.
fn json_body(size: usize) -> Bytes {
    let mut body = String::from("{\"payments\":[");
    let mut n = 0;
    while body.len() + 100 < size {
        if n > 0 {
            body.push(',');
        }
        body.push_str(&format!(
            "{{\"id\":\"pay_{n:06}\",\"amount\":{},\"currency\":\"EUR\",\"note\":\"order \\u00e9 {n}\"}}",
            1000 + n
        ));
        n += 1;
    }
    body.push_str("],\"customer\":\"cus_42\"}");
    Bytes::from(body)
}

/// The cost of comparing JSON as JSON: each scheme over the same JSON bodies.
fn fingerprint_schemes(c: &mut Criterion) {
    let (parts, ()) = Request::post("/payments?currency=EUR")
        .header(CONTENT_TYPE, "application/json; charset=utf-8")
        .body(())
        .expect("request")
        .into_parts();
    let mut g = c.benchmark_group("fingerprint_scheme");
    for (name, size) in [("1 KiB", 1024), ("64 KiB", 64 * 1024)] {
        let body = json_body(size);
        g.throughput(Throughput::Bytes(body.len() as u64));
        for scheme in [FingerprintScheme::Json, FingerprintScheme::Bytes] {
            g.bench_function(format!("{scheme:?}, JSON {name}"), |b| {
                b.iter(|| scheme.fingerprint(black_box(&parts), &[CONTENT_TYPE], black_box(&body)))
            });
        }
    }
    // A body that is not JSON: compared by its bytes, and hashed a second time for
    // records of the bytes scheme.
    let body = Bytes::from(vec![b'x'; 1024]);
    g.throughput(Throughput::Bytes(1024));
    g.bench_function("Json, 1 KiB not JSON", |b| {
        let scheme = FingerprintScheme::Json;
        b.iter(|| scheme.fingerprint(black_box(&parts), &[CONTENT_TYPE], black_box(&body)))
    });
    g.finish();
}

fn stored_headers(c: &mut Criterion) {
    let mut headers = HeaderMap::new();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    headers.insert("location", HeaderValue::from_static("/payments/pay_123"));
    headers.insert(
        "x-request-id",
        HeaderValue::from_static("0f0e0d0c-0b0a-0908-0706-050403020100"),
    );
    let encoded = StoredResponse::encode_headers(&headers);
    let mut g = c.benchmark_group("stored headers");
    g.bench_function("encode", |b| {
        b.iter(|| StoredResponse::encode_headers(black_box(&headers)))
    });
    g.bench_function("decode", |b| {
        b.iter(|| StoredResponse::decode_headers(black_box(&encoded)))
    });
    g.finish();
}

/// A request without a key, through an Axum router with and without the layer: what
/// the layer adds to every request it does not guard. The handler answers at once, so
/// the difference is the layer's own work.
fn pass_through(c: &mut Criterion) {
    use axum::{Router, body::Body, routing::post};
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("runtime");
    let bare = Router::new().route("/payments", post(|| async { "{}" }));
    let layered = bare
        .clone()
        .layer(IdempotencyLayer::new(MemoryStore::new()));
    let request = || {
        Request::post("/payments")
            .header(CONTENT_TYPE, "application/json")
            .body(Body::from("{}"))
            .expect("request")
    };
    let mut g = c.benchmark_group("no key");
    for (name, router) in [("router alone", &bare), ("router with the layer", &layered)] {
        g.bench_function(name, |b| {
            b.iter(|| {
                rt.block_on(router.clone().oneshot(request()))
                    .expect("response")
            })
        });
    }
    g.finish();
}

/// What sealing costs a request (`encrypt_responses`): a replay and a completion of a
/// response of 1 KiB and of 64 KiB through the layer on the memory store, with and
/// without keys. The difference is the sealing (per completion: the key's HMAC and one
/// seal) or the opening (per replay: the key's HMAC and one open).
fn sealing(c: &mut Criterion) {
    use axum::{Router, body::Body, routing::post};
    use tower_idempotency::encryption::EncryptionKeys;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("runtime");
    let request = |key: &str| {
        Request::post("/payments")
            .header(CONTENT_TYPE, "application/json")
            .header("idempotency-key", key)
            .body(Body::from("{}"))
            .expect("request")
    };
    for size in [1024, 64 * 1024] {
        let body = Bytes::from(vec![b'x'; size]);
        let router = |keys: Option<EncryptionKeys>| {
            let layer = IdempotencyLayer::new(MemoryStore::new());
            let layer = match keys {
                Some(keys) => layer.encrypt_responses(keys),
                None => layer,
            };
            let body = body.clone();
            Router::new()
                .route("/payments", post(move || async move { body.clone() }))
                .layer(layer)
        };
        let configs = [
            ("clear", router(None)),
            ("sealed", router(Some(EncryptionKeys::new(1, [7; 32])))),
        ];
        let mut g = c.benchmark_group(format!("sealing {} KiB", size / 1024));
        for (name, router) in &configs {
            rt.block_on(router.clone().oneshot(request("replayed")))
                .expect("response");
            g.bench_function(format!("replay, {name}"), |b| {
                b.iter(|| {
                    rt.block_on(router.clone().oneshot(request("replayed")))
                        .expect("response")
                })
            });
            let mut n = 0u64;
            g.bench_function(format!("completion, {name}"), |b| {
                b.iter(|| {
                    n += 1;
                    rt.block_on(router.clone().oneshot(request(&format!("new-{n}"))))
                        .expect("response")
                })
            });
        }
        g.finish();
    }
}

criterion_group!(
    benches,
    key_parsing,
    fingerprinting,
    fingerprint_schemes,
    stored_headers,
    pass_through,
    sealing
);
criterion_main!(benches);
