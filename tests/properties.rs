//! Properties, over generated inputs: the key parser accepts exactly its grammar,
//! never panics, and reads sf-strings as `sfv` does; fingerprints are stable and
//! change with any input, JSON bodies counting as any JSON reader sees them (any
//! spelling of one value is one request, any change of it another); stored responses
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

/// A JSON value, its objects' member names unique, its numbers as written.
#[derive(Clone, Debug)]
enum Json {
    Null,
    Bool(bool),
    Number(String),
    String(String),
    Array(Vec<Json>),
    Object(Vec<(String, Json)>),
}

/// Characters that have several spellings in a JSON string, and some that do not.
fn json_string() -> impl Strategy<Value = String> {
    let c = prop_oneof![
        3 => any::<char>(),
        1 => Just('"'),
        1 => Just('\\'),
        1 => Just('/'),
        1 => Just('\n'),
        1 => Just('\u{1}'),
        1 => Just('A'),
        1 => Just('é'),
        1 => Just('\u{1f600}'),
    ];
    prop::collection::vec(c, 0..8).prop_map(|cs| cs.into_iter().collect())
}

fn json_value() -> impl Strategy<Value = Json> {
    let number = "-?(0|[1-9][0-9]{0,20})(\\.[0-9]{1,6})?([eE][+-]?[0-9]{1,3})?";
    let leaf = prop_oneof![
        Just(Json::Null),
        any::<bool>().prop_map(Json::Bool),
        number.prop_map(Json::Number),
        json_string().prop_map(Json::String),
    ];
    leaf.prop_recursive(4, 40, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Json::Array),
            prop::collection::btree_map(json_string(), inner, 0..6)
                .prop_map(|members| Json::Object(members.into_iter().collect())),
        ]
    })
}

/// The choices of one spelling: xorshift, seeded by the case.
struct Choices(u64);

impl Choices {
    fn new(seed: u64) -> Self {
        Self(seed | 1)
    }

    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n as u64) as usize
    }
}

/// `value` spelt one of the ways a JSON writer may spell it, as `choices` say:
/// whitespace, member order, each character's escape.
fn spell(value: &Json, choices: &mut Choices, out: &mut String) {
    fn ws(choices: &mut Choices, out: &mut String) {
        out.push_str(["", "", " ", "\n", "\t", "\r\n  "][choices.below(6)]);
    }
    fn hex(u: u32, choices: &mut Choices) -> String {
        if choices.below(2) == 0 {
            format!("\\u{u:04x}")
        } else {
            format!("\\u{u:04X}")
        }
    }
    fn string(s: &str, choices: &mut Choices, out: &mut String) {
        out.push('"');
        for c in s.chars() {
            let escaped = choices.below(3) == 0;
            match c {
                '"' if !escaped => out.push_str("\\\""),
                '\\' if !escaped => out.push_str("\\\\"),
                '/' if !escaped => out.push_str(["/", "\\/"][choices.below(2)]),
                '\n' if !escaped => out.push_str("\\n"),
                c if (c as u32) < 0x20 || escaped => {
                    let mut units = [0u16; 2];
                    for unit in c.encode_utf16(&mut units) {
                        out.push_str(&hex(u32::from(*unit), choices));
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }
    ws(choices, out);
    match value {
        Json::Null => out.push_str("null"),
        Json::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Json::Number(n) => out.push_str(n),
        Json::String(s) => string(s, choices, out),
        Json::Array(items) => {
            out.push('[');
            ws(choices, out);
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                spell(item, choices, out);
            }
            out.push(']');
        }
        Json::Object(members) => {
            let mut order: Vec<usize> = (0..members.len()).collect();
            for i in (1..order.len()).rev() {
                order.swap(i, choices.below(i + 1));
            }
            out.push('{');
            ws(choices, out);
            for (n, i) in order.into_iter().enumerate() {
                if n > 0 {
                    out.push(',');
                }
                ws(choices, out);
                string(&members[i].0, choices, out);
                ws(choices, out);
                out.push(':');
                spell(&members[i].1, choices, out);
            }
            out.push('}');
        }
    }
    ws(choices, out);
}

fn spelt(value: &Json, seed: u64) -> String {
    let mut out = String::new();
    spell(value, &mut Choices::new(seed), &mut out);
    out
}

/// `value` changed in one place, as `choices` say: the last digit of a number, a
/// string one character longer, a boolean flipped, a member or an element added.
fn changed(value: &Json, choices: &mut Choices) -> Json {
    match value {
        Json::Null => Json::Bool(false),
        Json::Bool(b) => Json::Bool(!b),
        Json::Number(n) => {
            let mut digits = n.clone().into_bytes();
            let last = digits.last_mut().unwrap();
            *last = b'0' + (*last - b'0' + 1) % 10;
            Json::Number(String::from_utf8(digits).unwrap())
        }
        Json::String(s) => Json::String(format!("{s}x")),
        Json::Array(items) if items.is_empty() => Json::Array(vec![Json::Null]),
        Json::Array(items) => {
            let mut items = items.clone();
            let i = choices.below(items.len());
            items[i] = changed(&items[i], choices);
            Json::Array(items)
        }
        Json::Object(members) if members.is_empty() => Json::Object(vec![("a".into(), Json::Null)]),
        Json::Object(members) => {
            let mut members = members.clone();
            let i = choices.below(members.len());
            members[i].1 = changed(&members[i].1, choices);
            Json::Object(members)
        }
    }
}

/// `Content-Type` spelt one of the ways that name JSON in UTF-8.
fn json_type(choice: usize) -> &'static str {
    [
        "application/json",
        "Application/JSON; charset=UTF-8",
        "application/json;charset=\"utf-8\"",
        "application/json ; Charset = utf-8",
    ][choice % 4]
}

fn json_fingerprint(content_type: &str, body: &str) -> Fingerprint {
    let parts = Request::post("/payments")
        .header("content-type", content_type)
        .body(())
        .unwrap()
        .into_parts()
        .0;
    let headers = [axum::http::header::CONTENT_TYPE];
    tower_idempotency::FingerprintScheme::Json.fingerprint(&parts, &headers, body.as_bytes())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// A JSON value spelt any way, sent with any spelling of its media type, is one
    /// request.
    #[test]
    fn json_re_spelt_is_the_same_request(
        value in json_value(),
        (a, b) in (any::<u64>(), any::<u64>()),
        (ta, tb) in (0usize..4, 0usize..4),
    ) {
        let (first, second) = (spelt(&value, a), spelt(&value, b));
        prop_assert_eq!(
            json_fingerprint(json_type(ta), &first),
            json_fingerprint(json_type(tb), &second),
            "{} and {}", first, second
        );
    }

    /// Any value changed, a digit of a number included, is another request, however
    /// it is spelt.
    #[test]
    fn json_changed_is_another_request(
        value in json_value(),
        (a, b, c) in (any::<u64>(), any::<u64>(), any::<u64>()),
    ) {
        let other = changed(&value, &mut Choices::new(c));
        prop_assert_ne!(
            json_fingerprint("application/json", &spelt(&value, a)),
            json_fingerprint("application/json", &spelt(&other, b)),
            "{:?} and {:?}", value, other
        );
    }

    /// A member name twice, or text that is not JSON, counts byte for byte: the same
    /// bytes are the same request, a re-spelling is not.
    #[test]
    fn what_readers_may_read_apart_counts_byte_for_byte(
        value in json_value(),
        seed in any::<u64>(),
        broken in 0usize..4,
    ) {
        let v = spelt(&value, seed);
        let (body, respelt) = match broken {
            0 => (format!("{{\"a\":{v},\"a\":{v}}}"), format!("{{ \"a\":{v},\"a\":{v}}}")),
            1 => (format!("{{\"a\":{v},\"\\u0061\":{v}}}"), format!("{{\"a\" :{v},\"\\u0061\":{v}}}")),
            2 => (format!("[{v},]"), format!("[ {v},]")),
            _ => (format!("{v} x"), format!(" {v} x")),
        };
        prop_assert_eq!(
            json_fingerprint("application/json", &body),
            json_fingerprint("application/json", &body)
        );
        prop_assert_ne!(
            json_fingerprint("application/json", &body),
            json_fingerprint("application/json", &respelt)
        );
    }
}

/// The digit a double cannot see: `9007199254740993` rounds to `9007199254740992`.
#[test]
fn a_long_number_counts_to_its_last_digit() {
    assert_eq!(9007199254740993_u64 as f64, 9007199254740992_u64 as f64);
    assert_ne!(
        json_fingerprint("application/json", r#"{"amount":9007199254740993}"#),
        json_fingerprint("application/json", r#"{"amount":9007199254740992}"#)
    );
    assert_eq!(
        json_fingerprint("application/json", r#"{"amount":9007199254740993}"#),
        json_fingerprint(
            "application/json; charset=utf-8",
            r#"{ "amount" : 9007199254740993 }"#
        )
    );
}
