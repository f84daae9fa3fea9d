//! Which responses are stored for replay.
//!
//! A stored response is replayed to every retry for the TTL; a response that is not
//! stored releases the key, so the next retry runs the handler again. The default
//! stores every 2xx, 3xx and 4xx (the handler decided; running it again gives the same
//! answer or, worse, a different one) and releases 5xx, 408 and 429 (transient: the
//! client is expected to retry, and should be allowed to). A handler can always opt out
//! of storage for one response with `Cache-Control: no-store`.
//!
//! The trade-off: Stripe stores 5xx too, so a retry never re-runs a request that may have
//! had effects before failing; that is safest when the handler's effects are not
//! themselves idempotent. Releasing (the AWS Powertools default, and this crate's) lets a
//! client recover from a transient failure with the same key, which is right when the
//! handler's downstream calls carry derived keys of their own.

use std::sync::Arc;

use http::{HeaderMap, StatusCode, header::CACHE_CONTROL};

pub(crate) type PolicyFn = Arc<dyn Fn(StatusCode, &HeaderMap) -> bool + Send + Sync>;

/// The default storage policy: store 2xx, 3xx and 4xx except 408 and 429, unless the
/// response says `Cache-Control: no-store`.
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
pub fn default_storage_policy(status: StatusCode, headers: &HeaderMap) -> bool {
    !status.is_server_error()
        && !status.is_informational()
        && status != StatusCode::REQUEST_TIMEOUT
        && status != StatusCode::TOO_MANY_REQUESTS
        && !says_no_store(headers)
}

/// Whether `Cache-Control` carries the `no-store` directive.
pub(crate) fn says_no_store(headers: &HeaderMap) -> bool {
    headers
        .get_all(CACHE_CONTROL)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|d| d.trim().eq_ignore_ascii_case("no-store"))
}

#[cfg(test)]
mod tests {
    use http::HeaderValue;

    use super::*;

    #[test]
    fn no_store_from_the_handler_releases() {
        let mut h = HeaderMap::new();
        h.insert(CACHE_CONTROL, HeaderValue::from_static("private, No-Store"));
        assert!(!default_storage_policy(StatusCode::OK, &h));
        h.insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
        assert!(default_storage_policy(StatusCode::OK, &h));
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
