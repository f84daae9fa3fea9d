//! Properties, over generated inputs: the key parser accepts exactly its grammar and
//! never panics; fingerprints are stable and change with any input; stored responses
//! round-trip byte for byte, through each store.
#![allow(clippy::unwrap_used)] // unwrap in test helpers: a failure is the test failing

mod common;

use std::time::Duration;

use axum::http::{HeaderMap, HeaderName, HeaderValue, Method, Request, StatusCode};
use bytes::Bytes;
use proptest::prelude::*;
use tower_idempotency::{
    Fingerprint, MAX_KEY_LEN, Scope, StoredResponse, fingerprint, parse_key,
    store::{Claim, ClaimRequest, MemoryStore, Store},
};

/// The grammar, written out independently of the parser: optional SP/HTAB around
/// either a bare value of visible ASCII without `"`, or a quoted string whose
/// characters are visible ASCII with `\"` and `\\` as the only escapes; the value has
/// 1 to 255 characters.
fn model(field: &[u8]) -> Option<String> {
    let trimmed: &[u8] = {
        let s = field
            .iter()
            .position(|b| *b != b' ' && *b != b'\t')
            .unwrap_or(field.len());
        let e = field
            .iter()
            .rposition(|b| *b != b' ' && *b != b'\t')
            .map_or(s, |e| e + 1);
        &field[s..e]
    };
    let visible = |b: u8| (0x21..=0x7e).contains(&b);
    let value: Vec<u8> = if let Some(rest) = trimmed.strip_prefix(b"\"") {
        let mut out = Vec::new();
        let mut i = 0;
        loop {
            match *rest.get(i)? {
                b'"' => {
                    if i + 1 != rest.len() {
                        return None;
                    }
                    break;
                }
                b'\\' => match *rest.get(i + 1)? {
                    c @ (b'"' | b'\\') => {
                        out.push(c);
                        i += 2;
                    }
                    _ => return None,
                },
                c if visible(c) => {
                    out.push(c);
                    i += 1;
                }
                _ => return None,
            }
        }
        out
    } else {
        if !trimmed.iter().all(|&b| visible(b) && b != b'"') {
            return None;
        }
        trimmed.to_vec()
    };
    (1..=MAX_KEY_LEN)
        .contains(&value.len())
        .then(|| String::from_utf8(value).unwrap())
}

/// Bytes that are mostly the interesting ones: quotes, backslashes, spaces, tabs,
/// visible ASCII, and now and then anything.
fn field_bytes() -> impl Strategy<Value = Vec<u8>> {
    let byte = prop_oneof![
        4 => Just(b'"'),
        3 => Just(b'\\'),
        2 => Just(b' '),
        1 => Just(b'\t'),
        20 => 0x21u8..=0x7e,
        2 => any::<u8>(),
    ];
    prop::collection::vec(byte, 0..300)
}

fn quote(key: &str) -> String {
    let mut s = String::from("\"");
    for c in key.chars() {
        if c == '"' || c == '\\' {
            s.push('\\');
        }
        s.push(c);
    }
    s.push('"');
    s
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn the_parser_accepts_exactly_the_grammar(field in field_bytes()) {
        prop_assert_eq!(parse_key(&field).ok(), model(&field));
    }

    #[test]
    fn every_valid_key_parses_back_quoted_and_bare(key in "[!-~]{1,255}") {
        prop_assert_eq!(parse_key(quote(&key).as_bytes()).unwrap(), key.clone());
        if !key.contains('"') {
            prop_assert_eq!(parse_key(key.as_bytes()).unwrap(), key);
        }
    }

    #[test]
    fn fingerprints_are_stable_and_change_with_any_input(
        method in prop_oneof![Just(Method::POST), Just(Method::PATCH), Just(Method::PUT)],
        path in "/[a-z]{1,8}",
        query in proptest::option::of("[a-z]=[0-9]{1,3}"),
        content_type in proptest::option::of("[a-z]{1,6}/[a-z]{1,6}"),
        body in prop::collection::vec(any::<u8>(), 0..200),
        which in 0usize..5,
    ) {
        let uri = |path: &str, query: &Option<String>| match query {
            Some(q) => format!("{path}?{q}"),
            None => path.to_owned(),
        };
        let parts = |method: Method, uri: String, ct: Option<String>| {
            let mut b = Request::builder().method(method).uri(uri);
            if let Some(ct) = ct {
                b = b.header("content-type", ct);
            }
            b.body(()).unwrap().into_parts().0
        };
        let headers = [axum::http::header::CONTENT_TYPE];
        let base = parts(method.clone(), uri(&path, &query), content_type.clone());
        let a = fingerprint(&base, &headers, &body);
        prop_assert_eq!(a, fingerprint(&base, &headers, &body));
        let mut body2 = body.clone();
        let changed = match which {
            0 => parts(if method == Method::POST { Method::PATCH } else { Method::POST }, uri(&path, &query), content_type.clone()),
            1 => parts(method.clone(), uri(&format!("{path}x"), &query), content_type.clone()),
            2 => parts(method.clone(), uri(&path, &Some(format!("{}0", query.clone().unwrap_or_default()))), content_type.clone()),
            3 => parts(method.clone(), uri(&path, &query), Some(format!("{}x", content_type.clone().unwrap_or_default()))),
            _ => {
                body2.push(0);
                base.clone()
            }
        };
        prop_assert_ne!(a, fingerprint(&changed, &headers, &body2));
    }
}

fn response() -> impl Strategy<Value = StoredResponse> {
    let name = "x-[a-z0-9-]{1,20}".prop_map(|n| HeaderName::from_bytes(n.as_bytes()).unwrap());
    // Any field-value byte: visible ASCII, SP, HTAB and obs-text, not at the ends.
    let value = prop::collection::vec(
        prop_oneof![0x21u8..=0x7e, Just(b' '), Just(b'\t'), 0x80u8..=0xff],
        0..40,
    )
    .prop_map(|mut v| {
        while v.first().is_some_and(|b| *b == b' ' || *b == b'\t') {
            v.remove(0);
        }
        while v.last().is_some_and(|b| *b == b' ' || *b == b'\t') {
            v.pop();
        }
        HeaderValue::from_bytes(&v).unwrap()
    });
    (
        200u16..600,
        prop::collection::vec((name, value), 0..8),
        prop::collection::vec(any::<u8>(), 0..4096),
    )
        .prop_map(|(status, headers, body)| {
            let mut map = HeaderMap::new();
            for (n, v) in headers {
                map.append(n, v);
            }
            StoredResponse {
                status: StatusCode::from_u16(status).unwrap(),
                headers: map,
                body: Bytes::from(body),
            }
        })
}

/// Completes a fresh key with `response` and reads it back with a second claim.
async fn round_trip(store: &dyn Store, key: &str, response: &StoredResponse) -> StoredResponse {
    let scope = Scope::new("props");
    let request = ClaimRequest {
        scope: &scope,
        key,
        fingerprint: Fingerprint([7; 32]),
        lease: Duration::from_secs(30),
        ttl: Duration::from_secs(60),
    };
    let Claim::Acquired(lease) = store.claim(&request).await.unwrap() else {
        panic!("fresh key")
    };
    assert!(
        store
            .complete(&lease, response, request.ttl)
            .await
            .unwrap()
            .is_kept()
    );
    match store.claim(&request).await.unwrap() {
        Claim::Completed { response, .. } => response,
        other => panic!("{other:?}"),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn stored_headers_round_trip(response in response()) {
        let encoded = StoredResponse::encode_headers(&response.headers);
        prop_assert_eq!(StoredResponse::decode_headers(&encoded), Some(response.headers));
    }

    #[test]
    fn responses_round_trip_through_the_memory_store(response in response()) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let store = MemoryStore::new();
        prop_assert_eq!(rt.block_on(round_trip(&store, "k", &response)), response);
    }
}

#[test]
fn responses_round_trip_through_postgres_byte_for_byte() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let schema = common::TestSchema::new();
    let store = rt.block_on(schema.store());
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases: 64,
        ..ProptestConfig::default()
    });
    let n = std::sync::atomic::AtomicUsize::new(0);
    runner
        .run(&response(), |response| {
            let key = format!("k{}", n.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
            let back = rt.block_on(round_trip(&store, &key, &response));
            prop_assert_eq!(back, response);
            Ok(())
        })
        .unwrap();
    drop(store);
    drop(schema);
}
