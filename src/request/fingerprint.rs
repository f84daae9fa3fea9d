//! Request fingerprints: is a retry really the same request?
//!
//! A key reused with a different request is a client bug, answered with 422 instead of
//! replaying a response that belongs to another payload. The fingerprint is SHA-256 over
//! the method, the path and query, the selected headers (`Content-Type` by default) and
//! the body bytes, each framed with its length so that no two different requests hash the
//! same input.

use std::{fmt, sync::Arc};

use bytes::Bytes;
use http::{HeaderName, header::CONTENT_TYPE, request::Parts};
use sha2::{Digest, Sha256};

/// A SHA-256 digest identifying a request's content.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint(pub [u8; 32]);

impl Fingerprint {
    /// The digest bytes.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// Builds a fingerprint from stored bytes; `None` unless exactly 32 bytes.
    pub fn from_slice(bytes: &[u8]) -> Option<Self> {
        bytes.try_into().ok().map(Self)
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({})", crate::hex::encode(&self.0[..8]))
    }
}

/// A fingerprint function of the app's own.
pub(crate) type FingerprintFn = Arc<dyn Fn(&Parts, &Bytes) -> Fingerprint + Send + Sync>;

/// How requests are fingerprinted; set with
/// [`IdempotencyLayer::fingerprint_headers`](crate::IdempotencyLayer::fingerprint_headers)
/// or replaced with [`IdempotencyLayer::fingerprint_with`](crate::IdempotencyLayer::fingerprint_with).
#[derive(Clone)]
pub(crate) enum Fingerprinter {
    /// SHA-256 over method, path and query, these headers, and the body.
    Sha256 { headers: Arc<[HeaderName]> },
    /// A function of the app's own.
    Custom(FingerprintFn),
}

impl Default for Fingerprinter {
    fn default() -> Self {
        Self::Sha256 {
            headers: Arc::from([CONTENT_TYPE]),
        }
    }
}

impl Fingerprinter {
    pub(crate) fn compute(&self, parts: &Parts, body: &Bytes) -> Fingerprint {
        match self {
            Self::Sha256 { headers } => sha256(parts, headers, body),
            Self::Custom(f) => f(parts, body),
        }
    }
}

/// The default fingerprint: SHA-256 over method, path and query, the values of
/// `headers` (in the order given, every value of each), and the body.
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

fn sha256(parts: &Parts, headers: &[HeaderName], body: &[u8]) -> Fingerprint {
    fn field(h: &mut Sha256, bytes: &[u8]) {
        h.update((bytes.len() as u64).to_be_bytes());
        h.update(bytes);
    }
    let mut h = Sha256::new();
    field(&mut h, parts.method.as_str().as_bytes());
    let path_and_query = parts.uri.path_and_query().map_or("/", |pq| pq.as_str());
    field(&mut h, path_and_query.as_bytes());
    for name in headers {
        field(&mut h, name.as_str().as_bytes());
        let values = parts.headers.get_all(name);
        h.update((values.iter().count() as u64).to_be_bytes());
        for value in values {
            field(&mut h, value.as_bytes());
        }
    }
    field(&mut h, body);
    Fingerprint(h.finalize().into())
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
    fn hex_is_lowercase() {
        assert_eq!(crate::hex::encode(&[0x00, 0xab, 0x7f]), "00ab7f");
    }
}
