//! Which responses are stored for replay.
//!
//! A stored response is replayed to every retry for the TTL; a response that is not
//! stored releases the key, so the next retry runs the handler again. The default
//! stores every 2xx, 3xx and 4xx (the handler decided; running it again gives the same
//! answer or, worse, a different one) and releases 5xx, 408 and 429 (transient: the
//! client is expected to retry, and should be allowed to).
//!
//! `Cache-Control: no-store` does not keep a response from being stored: it speaks to
//! HTTP caches, and payment APIs send it on every response (OWASP recommends it for
//! sensitive ones), so honouring it would quietly turn the layer off for them, and a
//! retry would charge again. A handler that must opt one response out of storage says
//! so through its own policy, with a header of the app's choosing:
//!
//! ```
//! use tower_idempotency::{IdempotencyLayer, default_storage_policy, store::MemoryStore};
//!
//! let layer = IdempotencyLayer::new(MemoryStore::new()).store_response_if(|status, headers| {
//!     default_storage_policy(status, headers) && !headers.contains_key("x-not-replayable")
//! });
//! ```
//!
//! The trade-off: Stripe stores 5xx too, so a retry never re-runs a request that may have
//! had effects before failing; that is safest when the handler's effects are not
//! themselves idempotent. Releasing (the AWS Powertools default, and this crate's) lets a
//! client recover from a transient failure with the same key, which is right when the
//! handler's downstream calls carry derived keys of their own.

use std::sync::Arc;

use http::{HeaderMap, StatusCode};

pub(crate) type PolicyFn = Arc<dyn Fn(StatusCode, &HeaderMap) -> bool + Send + Sync>;

/// The default storage policy: store 2xx, 3xx and 4xx except 408 and 429, whatever
/// the response's `Cache-Control` says (see the module's docs).
///
/// ```
/// use http::{HeaderMap, StatusCode};
/// use tower_idempotency::default_storage_policy;
///
/// let none = HeaderMap::new();
/// assert!(default_storage_policy(StatusCode::CREATED, &none));
/// assert!(default_storage_policy(StatusCode::UNPROCESSABLE_ENTITY, &none));
/// assert!(!default_storage_policy(StatusCode::TOO_MANY_REQUESTS, &none));
/// assert!(!default_storage_policy(StatusCode::BAD_GATEWAY, &none));
/// ```
pub fn default_storage_policy(status: StatusCode, _headers: &HeaderMap) -> bool {
    !status.is_server_error()
        && !status.is_informational()
        && status != StatusCode::REQUEST_TIMEOUT
        && status != StatusCode::TOO_MANY_REQUESTS
}

#[cfg(test)]
mod tests {
    use http::{HeaderValue, header::CACHE_CONTROL};

    use super::*;

    #[test]
    fn cache_control_does_not_decide() {
        let mut h = HeaderMap::new();
        h.insert(CACHE_CONTROL, HeaderValue::from_static("private, No-Store"));
        assert!(default_storage_policy(StatusCode::CREATED, &h));
        assert!(!default_storage_policy(StatusCode::BAD_GATEWAY, &h));
    }

    #[test]
    fn statuses() {
        let h = HeaderMap::new();
        for s in [200, 201, 204, 302, 400, 404, 409, 422] {
            assert!(
                default_storage_policy(StatusCode::from_u16(s).unwrap(), &h),
                "{s}"
            );
        }
        for s in [408, 429, 500, 502, 503, 504] {
            assert!(
                !default_storage_policy(StatusCode::from_u16(s).unwrap(), &h),
                "{s}"
            );
        }
    }
}
