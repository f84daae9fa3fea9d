//! Properties, over generated inputs: the key parser accepts exactly its grammar,
//! never panics, and reads sf-strings as `sfv` does; fingerprints are stable and
//! change with any input; stored responses round-trip byte for byte, through each
//! store.
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

/// Checks the parser against `sfv`, an implementation of RFC 8941 of its own, for the
/// sf-string form of the key. Where they differ, the difference is deliberate:
///
/// - a key is 1 to 255 visible ASCII characters: an sf-string may also be empty, longer,
///   or hold spaces, and such a value is no key (the IETF draft's own limit, and a key
///   with a space in it is one a log or a client mangles);
/// - a quoted key takes no parameters (`"k";a=1`): sfv reads them, the layer rejects
///   the field rather than ignore what a client meant by them;
/// - the bare form (`order-42`, what many clients send) is opaque: all of it is the key,
///   where sfv reads a token, an integer, parameters, or nothing at all. They agree
///   where sfv reads a bare value as a token without parameters;
/// - optional whitespace (SP or HTAB) around the value is HTTP's, removed before any
///   parser sees the value; sfv is given the value without it.
mod against_sfv {
    use super::*;
    use sfv::{BareItem, Item, Parser, Version};

    /// Whether an sf-string's value is a key.
    pub(super) fn keyable(value: &str) -> bool {
        (1..=MAX_KEY_LEN).contains(&value.len()) && !value.contains(' ')
    }

    /// What sfv reads from a field value, with HTTP's optional whitespace removed.
    pub(super) fn sfv_item(field: &[u8]) -> Option<Item> {
        let is_ows = |b: &u8| *b == b' ' || *b == b'\t';
        let start = field.iter().position(|b| !is_ows(b)).unwrap_or(field.len());
        let end = field
            .iter()
            .rposition(|b| !is_ows(b))
            .map_or(start, |e| e + 1);
        Parser::new(&field[start..end])
            .with_version(Version::Rfc8941)
            .parse::<Item>()
            .ok()
    }

    /// Any sf-string value (SP to `~`), mostly the characters that need care: quotes,
    /// backslashes, spaces; from empty to past the longest key.
    pub(super) fn sf_string_value() -> impl Strategy<Value = String> {
        let c = prop_oneof![
            3 => Just('"'),
            3 => Just('\\'),
            1 => Just(' '),
            20 => proptest::char::range('!', '~'),
        ];
        prop::collection::vec(c, 0..300).prop_map(|cs| cs.into_iter().collect())
    }

    /// Field values around an sf-string or a bare value: optional whitespace, and
    /// now and then parameters or other trailing matter; or any bytes at all.
    pub(super) fn fields() -> impl Strategy<Value = Vec<u8>> {
        let ows = prop_oneof![Just(""), Just(" "), Just("  "), Just("\t ")];
        let after = prop_oneof![
            6 => Just(""),
            1 => Just(";a=1"),
            1 => Just(";b"),
            1 => Just(", \"c\""),
            1 => Just("x"),
        ];
        let quoted = (ows.clone(), sf_string_value(), after.clone(), ows.clone())
            .prop_map(|(a, v, t, b)| format!("{a}{}{t}{b}", quote(&v)).into_bytes());
        let bare = (ows.clone(), "[!-~]{1,40}", after, ows)
            .prop_map(|(a, v, t, b)| format!("{a}{v}{t}{b}").into_bytes());
        prop_oneof![2 => quoted, 1 => bare, 1 => field_bytes()]
    }

    pub(super) fn string_of(item: &Item) -> Option<&str> {
        match &item.bare_item {
            BareItem::String(s) if item.params.is_empty() => Some(s.as_str()),
            _ => None,
        }
    }

    pub(super) fn token_of(item: &Item) -> Option<&str> {
        match &item.bare_item {
            BareItem::Token(t) if item.params.is_empty() => Some(t.as_str()),
            _ => None,
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    /// Every sf-string, as sfv writes it, is read as the same key, unless its value is
    /// no key (empty, over 255 characters, or with a space), which is rejected.
    #[test]
    fn every_sf_string_sfv_writes_is_read_as_the_same_key(
        value in against_sfv::sf_string_value(),
    ) {
        let string = sfv::StringRef::from_str(&value).unwrap();
        let field = sfv::ItemSerializer::new().bare_item(string).finish();
        let ours = parse_key(field.as_bytes());
        if against_sfv::keyable(&value) {
            prop_assert_eq!(ours, Ok(value));
        } else {
            prop_assert!(ours.is_err(), "{value:?} is no key, and was taken for one");
        }
    }

    /// A key read from a quoted field is the sf-string sfv reads there (without
    /// parameters); a key read bare is the token sfv reads, where it reads a token
    /// without parameters; a field whose sf-string sfv reads is rejected only if that
    /// value is no key.
    #[test]
    fn keys_read_are_the_values_sfv_reads(field in against_sfv::fields()) {
        let sf = against_sfv::sfv_item(&field);
        let quoted = field.iter().find(|b| **b != b' ' && **b != b'\t') == Some(&b'"');
        match parse_key(&field) {
            Ok(key) if quoted => {
                let read = sf.as_ref().and_then(against_sfv::string_of);
                prop_assert_eq!(read, Some(key.as_str()), "sfv reads {:?}", sf);
            }
            Ok(key) => {
                if let Some(token) = sf.as_ref().and_then(against_sfv::token_of) {
                    prop_assert_eq!(token, key.as_str());
                }
            }
            Err(e) => {
                if let Some(value) = sf.as_ref().and_then(against_sfv::string_of) {
                    prop_assert!(!against_sfv::keyable(value), "sfv reads {value:?}; we: {e}");
                }
            }
        }
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
        fingerprint: Fingerprint::new([7; 32]),
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
