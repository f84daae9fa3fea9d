//! Request fingerprints: is a retry really the same request?
//!
//! A key reused with a different request is a client bug, answered with 422 instead of
//! replaying a response that belongs to another payload. The fingerprint is SHA-256 over
//! the method, the path and query, the selected headers (`Content-Type` by default) and
//! the body, each framed with its length so that no two different requests hash the
//! same input.
//!
//! How the body and `Content-Type` count is the layer's [`FingerprintScheme`]: by
//! default a JSON body counts as what any JSON reader sees ([`json`]) and a media type
//! as what any reader of it sees ([`media_type`]); [`FingerprintScheme::Bytes`]
//! compares both byte for byte. A fingerprint says which scheme made it (the stored
//! bytes: 32 for the bytes scheme, as every record before the JSON scheme holds, 33 for
//! the JSON scheme, its first byte the scheme's tag), so that a record is always
//! compared with a retry the way it was made ([`Fingerprint::as_recorded`]).

mod json;
mod media_type;

use std::{fmt, sync::Arc};

use bytes::Bytes;
use http::{HeaderName, header::CONTENT_TYPE, request::Parts};
use sha2::{Digest, Sha256};

/// The tag of a JSON-scheme fingerprint, its first stored byte.
const JSON_TAG: u8 = 1;

/// A SHA-256 digest identifying a request's content, and the [`FingerprintScheme`]
/// that computed it.
///
/// A store keeps [`as_bytes`](Self::as_bytes): the 32 bytes of the digest for the
/// bytes scheme and for a fingerprint function of the app's own
/// ([`Fingerprint::new`]), as every record made before the JSON scheme holds; 33
/// bytes, a tag first, for the JSON scheme.
///
/// ```
/// use tower_idempotency::{Fingerprint, FingerprintScheme};
///
/// let mine = Fingerprint::new([7; 32]);
/// assert_eq!(mine.scheme(), FingerprintScheme::Bytes);
/// assert_eq!(Fingerprint::from_slice(mine.as_bytes()), Some(mine));
/// assert_eq!(Fingerprint::from_slice(&[7; 31]), None);
/// ```
#[derive(Clone, Copy)]
pub struct Fingerprint {
    /// The scheme's tag (0 for the bytes scheme, stored without it), then the digest.
    tagged: [u8; 33],
    /// For a JSON-scheme fingerprint computed from a request: what the bytes scheme
    /// makes of that request, to compare it with records made under the bytes scheme.
    bytes: Option<[u8; 32]>,
}

impl Fingerprint {
    /// A fingerprint of this digest, stored as its 32 bytes: what a fingerprint
    /// function of the app's own returns ([`IdempotencyLayer::fingerprint_with`](crate::IdempotencyLayer::fingerprint_with)),
    /// and what the bytes scheme computes.
    pub const fn new(digest: [u8; 32]) -> Self {
        let mut tagged = [0; 33];
        let mut i = 0;
        while i < 32 {
            tagged[i + 1] = digest[i];
            i += 1;
        }
        Self {
            tagged,
            bytes: None,
        }
    }

    fn json(digest: [u8; 32], bytes: [u8; 32]) -> Self {
        let mut tagged = [JSON_TAG; 33];
        tagged[1..].copy_from_slice(&digest);
        Self {
            tagged,
            bytes: Some(bytes),
        }
    }

    /// The SHA-256 digest.
    pub fn digest(&self) -> &[u8; 32] {
        self.tagged[1..].try_into().unwrap_or(&[0; 32])
    }

    /// The scheme that computed it.
    pub fn scheme(&self) -> FingerprintScheme {
        match self.tagged[0] {
            JSON_TAG => FingerprintScheme::Json,
            _ => FingerprintScheme::Bytes,
        }
    }

    /// The bytes a store keeps: the digest (32 bytes) for the bytes scheme, the
    /// scheme's tag and the digest (33 bytes) for the JSON scheme.
    pub fn as_bytes(&self) -> &[u8] {
        match self.scheme() {
            FingerprintScheme::Bytes => &self.tagged[1..],
            FingerprintScheme::Json => &self.tagged,
        }
    }

    /// Builds a fingerprint from stored bytes ([`as_bytes`](Self::as_bytes)); `None`
    /// unless they are one.
    pub fn from_slice(bytes: &[u8]) -> Option<Self> {
        match bytes.len() {
            32 => bytes.try_into().ok().map(Self::new),
            33 if bytes[0] == JSON_TAG => {
                let mut tagged = [0; 33];
                tagged.copy_from_slice(bytes);
                Some(Self {
                    tagged,
                    bytes: None,
                })
            }
            _ => None,
        }
    }

    /// This request's fingerprint computed the way `recorded` was: itself when the
    /// schemes agree; its bytes-scheme fingerprint for a record made under the bytes
    /// scheme (before an upgrade to the JSON scheme, say). A record and a retry are
    /// the same request when `request.as_recorded(&recorded) == recorded`.
    pub(crate) fn as_recorded(&self, recorded: &Fingerprint) -> Fingerprint {
        match (self.bytes, recorded.scheme()) {
            (Some(bytes), FingerprintScheme::Bytes) if self.scheme() != recorded.scheme() => {
                Self::new(bytes)
            }
            _ => *self,
        }
    }

    /// Whether this request's fingerprint, computed the way `recorded` was, is it.
    pub(crate) fn matches(&self, recorded: &Fingerprint) -> bool {
        self.as_recorded(recorded) == *recorded
    }
}

/// Equal when stored alike: the scheme and the digest.
impl PartialEq for Fingerprint {
    fn eq(&self, other: &Self) -> bool {
        self.tagged == other.tagged
    }
}

impl Eq for Fingerprint {}

impl std::hash::Hash for Fingerprint {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.tagged.hash(state);
    }
}

impl From<[u8; 32]> for Fingerprint {
    fn from(digest: [u8; 32]) -> Self {
        Self::new(digest)
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let scheme = match self.scheme() {
            FingerprintScheme::Bytes => "",
            FingerprintScheme::Json => "json:",
        };
        write!(
            f,
            "Fingerprint({scheme}{})",
            crate::hex::encode(&self.digest()[..8])
        )
    }
}

/// How a request's body and `Content-Type` count in its fingerprint
/// ([`IdempotencyLayer::fingerprint_scheme`](crate::IdempotencyLayer::fingerprint_scheme)).
///
/// ```
/// use bytes::Bytes;
/// use http::{header::CONTENT_TYPE, Request};
/// use tower_idempotency::FingerprintScheme;
///
/// let parts = |content_type| {
///     let request = Request::post("/payments").header(CONTENT_TYPE, content_type);
///     request.body(()).unwrap().into_parts().0
/// };
/// let (plain, utf8) = (parts("application/json"), parts("application/json; charset=UTF-8"));
/// let json = |parts, body: &str| FingerprintScheme::Json.fingerprint(parts, &[CONTENT_TYPE], body.as_bytes());
/// let bytes = |parts, body: &str| FingerprintScheme::Bytes.fingerprint(parts, &[CONTENT_TYPE], body.as_bytes());
///
/// let sent = r#"{"amount":1000,"currency":"EUR"}"#;
/// let resent = r#"{ "currency" : "EUR", "amount" : 1000 }"#;
/// assert_eq!(json(&plain, sent), json(&utf8, resent));
/// assert_ne!(json(&plain, sent), json(&plain, r#"{"amount":1001,"currency":"EUR"}"#));
/// assert_ne!(bytes(&plain, sent), bytes(&plain, resent));
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum FingerprintScheme {
    /// The default. A JSON body (`application/json`, or any `+json` type) counts as
    /// what any JSON reader sees: insignificant whitespace, the order of an object's
    /// members and how a string's characters are escaped do not count; numbers count
    /// exactly as written (`9007199254740993` is not `9007199254740992`, though a
    /// double cannot tell them apart). A body that every reader may not read alike
    /// (a member name twice, invalid JSON, nesting over 128 deep) and any other body
    /// count byte for byte. `Content-Type` counts as a media type: the case of its
    /// type and parameter names and spaces do not count, nor `charset=utf-8` on JSON.
    /// Stored as 33 bytes: a record made under the bytes scheme (by a layer before
    /// this scheme existed) is compared with a retry the bytes' way.
    #[default]
    Json,
    /// The body and every selected header byte for byte, as before the JSON scheme.
    Bytes,
}

impl FingerprintScheme {
    /// The fingerprint of a request: its method, path and query, the values of
    /// `headers` (in the order given, every value of each), and its body, counted as
    /// this scheme says.
    pub fn fingerprint(self, parts: &Parts, headers: &[HeaderName], body: &[u8]) -> Fingerprint {
        match self {
            Self::Bytes => sha256(parts, headers, body),
            Self::Json => json_scheme(parts, headers, body),
        }
    }
}

/// A fingerprint function of the app's own.
pub(crate) type FingerprintFn = Arc<dyn Fn(&Parts, &Bytes) -> Fingerprint + Send + Sync>;

/// How requests are fingerprinted; set with
/// [`IdempotencyLayer::fingerprint_headers`](crate::IdempotencyLayer::fingerprint_headers)
/// and [`IdempotencyLayer::fingerprint_scheme`](crate::IdempotencyLayer::fingerprint_scheme),
/// or replaced with [`IdempotencyLayer::fingerprint_with`](crate::IdempotencyLayer::fingerprint_with).
#[derive(Clone)]
pub(crate) enum Fingerprinter {
    /// SHA-256 over method, path and query, these headers, and the body, as the
    /// scheme says.
    Sha256 {
        headers: Arc<[HeaderName]>,
        scheme: FingerprintScheme,
    },
    /// A function of the app's own.
    Custom(FingerprintFn),
}

impl Default for Fingerprinter {
    fn default() -> Self {
        Self::Sha256 {
            headers: Arc::from([CONTENT_TYPE]),
            scheme: FingerprintScheme::default(),
        }
    }
}

impl Fingerprinter {
    pub(crate) fn compute(&self, parts: &Parts, body: &Bytes) -> Fingerprint {
        match self {
            Self::Sha256 { headers, scheme } => scheme.fingerprint(parts, headers, body),
            Self::Custom(f) => f(parts, body),
        }
    }
}

/// The bytes scheme's fingerprint: SHA-256 over method, path and query, the values of
/// `headers` (in the order given, every value of each), and the body, byte for byte.
///
/// ```
/// use bytes::Bytes;
/// use http::{header::CONTENT_TYPE, Request};
/// use tower_idempotency::fingerprint;
///
/// let parts = |uri| Request::post(uri).body(()).unwrap().into_parts().0;
/// let body = Bytes::from_static(b"{\"amount\":100}");
/// let a = fingerprint(&parts("/payments"), &[CONTENT_TYPE], &body);
/// assert_eq!(a, fingerprint(&parts("/payments"), &[CONTENT_TYPE], &body));
/// assert_ne!(a, fingerprint(&parts("/payments?x=1"), &[CONTENT_TYPE], &body));
/// ```
pub fn fingerprint(parts: &Parts, headers: &[HeaderName], body: &[u8]) -> Fingerprint {
    sha256(parts, headers, body)
}

fn field(h: &mut Sha256, bytes: &[u8]) {
    h.update((bytes.len() as u64).to_be_bytes());
    h.update(bytes);
}

fn method_and_target(h: &mut Sha256, parts: &Parts) {
    field(h, parts.method.as_str().as_bytes());
    let path_and_query = parts.uri.path_and_query().map_or("/", |pq| pq.as_str());
    field(h, path_and_query.as_bytes());
}

fn sha256(parts: &Parts, headers: &[HeaderName], body: &[u8]) -> Fingerprint {
    let mut h = Sha256::new();
    method_and_target(&mut h, parts);
    for name in headers {
        field(&mut h, name.as_str().as_bytes());
        let values = parts.headers.get_all(name);
        h.update((values.iter().count() as u64).to_be_bytes());
        for value in values {
            field(&mut h, value.as_bytes());
        }
    }
    field(&mut h, body);
    Fingerprint::new(h.finalize().into())
}

/// The JSON scheme: as [`sha256`], with `Content-Type`'s values normalised and a JSON
/// body (its one `Content-Type` a JSON type) in its canonical form; and
/// the bytes scheme's fingerprint beside it, for records made under that scheme.
fn json_scheme(parts: &Parts, headers: &[HeaderName], body: &[u8]) -> Fingerprint {
    let mut h = Sha256::new();
    h.update(b"json-v1");
    method_and_target(&mut h, parts);
    for name in headers {
        field(&mut h, name.as_str().as_bytes());
        let values = parts.headers.get_all(name);
        h.update((values.iter().count() as u64).to_be_bytes());
        for value in values {
            if name == CONTENT_TYPE {
                field(&mut h, &media_type::normalise(value.as_bytes()).0);
            } else {
                field(&mut h, value.as_bytes());
            }
        }
    }
    let mut types = parts.headers.get_all(CONTENT_TYPE).iter();
    let json_type = match (types.next(), types.next()) {
        (Some(value), None) => media_type::normalise(value.as_bytes()).1,
        _ => false,
    };
    // Unmarked: a canonical form is a JSON text that no body compared by its bytes
    // under a JSON type can be (those are not JSON, or name a member twice, hold an
    // unpaired surrogate or nest too deep), and a body of another type spelt as the
    // canonical form is the same JSON, which differs by its `Content-Type` whenever
    // that counts.
    match json_type.then(|| json::canonical(body)).flatten() {
        Some(canonical) => field(&mut h, &canonical),
        None => field(&mut h, body),
    }
    let bytes = sha256(parts, headers, body);
    Fingerprint::json(h.finalize().into(), *bytes.digest())
}

#[cfg(test)]
mod tests {
    use http::{HeaderValue, Request};

    use super::*;

    fn parts(method: &str, uri: &str, ct: Option<&'static str>) -> Parts {
        let mut b = Request::builder().method(method).uri(uri);
        if let Some(ct) = ct {
            b = b.header(CONTENT_TYPE, ct);
        }
        b.body(()).unwrap().into_parts().0
    }

    #[test]
    fn every_input_changes_the_fingerprint() {
        let h = [CONTENT_TYPE];
        let base = fingerprint(
            &parts("POST", "/p?a=1", Some("application/json")),
            &h,
            b"{}",
        );
        assert_eq!(
            base,
            fingerprint(
                &parts("POST", "/p?a=1", Some("application/json")),
                &h,
                b"{}"
            )
        );
        assert_ne!(
            base,
            fingerprint(
                &parts("PATCH", "/p?a=1", Some("application/json")),
                &h,
                b"{}"
            )
        );
        assert_ne!(
            base,
            fingerprint(
                &parts("POST", "/q?a=1", Some("application/json")),
                &h,
                b"{}"
            )
        );
        assert_ne!(
            base,
            fingerprint(
                &parts("POST", "/p?a=2", Some("application/json")),
                &h,
                b"{}"
            )
        );
        assert_ne!(
            base,
            fingerprint(&parts("POST", "/p?a=1", Some("text/plain")), &h, b"{}")
        );
        assert_ne!(base, fingerprint(&parts("POST", "/p?a=1", None), &h, b"{}"));
        assert_ne!(
            base,
            fingerprint(
                &parts("POST", "/p?a=1", Some("application/json")),
                &h,
                b"{ }"
            )
        );
        // Headers not selected do not count.
        assert_eq!(
            fingerprint(&parts("POST", "/p", Some("application/json")), &[], b"{}"),
            fingerprint(&parts("POST", "/p", Some("text/html")), &[], b"{}"),
        );
    }

    #[test]
    fn repeated_header_values_are_framed() {
        let mut a = parts("POST", "/", None);
        a.headers
            .append(CONTENT_TYPE, HeaderValue::from_static("ab"));
        let mut b = parts("POST", "/", None);
        b.headers
            .append(CONTENT_TYPE, HeaderValue::from_static("a"));
        b.headers
            .append(CONTENT_TYPE, HeaderValue::from_static("b"));
        assert_ne!(
            fingerprint(&a, &[CONTENT_TYPE], b""),
            fingerprint(&b, &[CONTENT_TYPE], b"")
        );
    }

    #[test]
    fn a_record_is_compared_the_way_it_was_made() {
        let (h, body) = ([CONTENT_TYPE], br#"{"a":1}"#);
        let request = parts("POST", "/p", Some("application/json"));
        let json = FingerprintScheme::Json.fingerprint(&request, &h, body);
        let bytes = FingerprintScheme::Bytes.fingerprint(&request, &h, body);
        assert_eq!((json.as_bytes().len(), bytes.as_bytes().len()), (33, 32));
        assert_eq!(json.as_bytes()[0], JSON_TAG);
        // As a store reads them back.
        let (json_stored, bytes_stored) = (
            Fingerprint::from_slice(json.as_bytes()).unwrap(),
            Fingerprint::from_slice(bytes.as_bytes()).unwrap(),
        );
        assert_eq!((json_stored, bytes_stored), (json, bytes));
        assert_eq!(json_stored.scheme(), FingerprintScheme::Json);
        assert!(json.matches(&json_stored));
        assert!(
            json.matches(&bytes_stored),
            "a record from before the JSON scheme"
        );
        assert_eq!(json.as_recorded(&bytes_stored), bytes);
        let other = FingerprintScheme::Bytes.fingerprint(&request, &h, br#"{"a":2}"#);
        assert!(!json.matches(&other));
        // A bytes-scheme request cannot tell what a JSON record's request would make.
        assert!(!bytes.matches(&json_stored));
        assert_eq!(Fingerprint::from_slice(&[2; 33]), None);
    }

    #[test]
    fn hex_is_lowercase() {
        assert_eq!(crate::hex::encode(&[0x00, 0xab, 0x7f]), "00ab7f");
    }
}
