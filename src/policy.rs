//! Which responses are stored for replay.
//!
//! A stored response is replayed to every retry for the TTL; a response that is not
//! stored releases the key, so the next retry runs the handler again. The default
//! stores every 2xx, 3xx and 4xx (the handler decided; running it again gives the same
//! answer or, worse, a different one) except:
//!
//! - 408 and 429, and every 5xx: transient, the client is expected to retry, and
//!   should be allowed to;
//! - 400, 415 and 422: the request was refused before the endpoint began its work (a
//!   body that does not parse, a wrong `Content-Type`, a field that fails validation,
//!   as axum's extractors answer), so the client may correct it and send it again under
//!   the same key. Stripe likewise stores a result only once the endpoint began to
//!   execute.
//!
//! A handler that refuses with one of those statuses *after* it has had effects keeps
//! it stored with a policy of the app's own, or answers another status (409).
//!
//! A handler marks any one response as not to be stored, whatever the policy, with the
//! [`NoStore`] response extension: the key is released, and a retry runs again.
//!
//! `Cache-Control: no-store` does not keep a response from being stored: it speaks to
//! HTTP caches, and payment APIs send it on every response (OWASP recommends it for
//! sensitive ones), so honouring it would quietly turn the layer off for them, and a
//! retry would charge again. A policy of the app's own decides over statuses and
//! headers:
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

use http::{HeaderMap, StatusCode, response::Parts};

pub(crate) type PolicyFn = Arc<dyn Fn(StatusCode, &HeaderMap) -> bool + Send + Sync>;

/// The default storage policy: store 2xx, 3xx and 4xx except 400, 408, 415, 422 and
/// 429, whatever the response's `Cache-Control` says (see the module's docs).
///
/// ```
/// use http::{HeaderMap, StatusCode};
/// use tower_idempotency::default_storage_policy;
///
/// let none = HeaderMap::new();
/// assert!(default_storage_policy(StatusCode::CREATED, &none));
/// assert!(default_storage_policy(StatusCode::CONFLICT, &none));
/// // A request refused before the endpoint began: the client may correct it.
/// assert!(!default_storage_policy(StatusCode::UNPROCESSABLE_ENTITY, &none));
/// assert!(!default_storage_policy(StatusCode::TOO_MANY_REQUESTS, &none));
/// assert!(!default_storage_policy(StatusCode::BAD_GATEWAY, &none));
/// ```
pub fn default_storage_policy(status: StatusCode, _headers: &HeaderMap) -> bool {
    !status.is_server_error()
        && !status.is_informational()
        && !matches!(
            status,
            StatusCode::BAD_REQUEST
                | StatusCode::REQUEST_TIMEOUT
                | StatusCode::UNSUPPORTED_MEDIA_TYPE
                | StatusCode::UNPROCESSABLE_ENTITY
                | StatusCode::TOO_MANY_REQUESTS
        )
}

/// A response extension that keeps the response from being stored, whatever the
/// storage policy says: the key is released (in transactional mode, the transaction
/// rolled back), so a retry with it runs the handler again.
///
/// For a refusal the handler makes before it has had any effect, under a status the
/// policy would store (a `409` for a resource in the wrong state, a `404`). With the
/// `axum` feature, return it in a handler's response parts:
///
/// ```
/// # #[cfg(feature = "axum")] {
/// use axum::{Router, http::StatusCode, routing::post};
/// use tower_idempotency::{IdempotencyLayer, NoStore, store::MemoryStore};
///
/// async fn refund() -> (StatusCode, NoStore, &'static str) {
///     // Nothing was done: the client may retry with the same key once the
///     // payment has settled.
///     (StatusCode::CONFLICT, NoStore, "the payment has not settled yet")
/// }
///
/// let app: Router = Router::new()
///     .route("/refunds", post(refund))
///     .layer(IdempotencyLayer::new(MemoryStore::new()));
/// # }
/// ```
///
/// Any Tower service can insert it into its response's extensions instead.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NoStore;

#[cfg(feature = "axum")]
impl axum_core::response::IntoResponseParts for NoStore {
    type Error = std::convert::Infallible;

    fn into_response_parts(
        self,
        mut res: axum_core::response::ResponseParts,
    ) -> Result<axum_core::response::ResponseParts, Self::Error> {
        res.extensions_mut().insert(self);
        Ok(res)
    }
}

/// Whether a response with this head is stored: not marked [`NoStore`], and kept by
/// `policy`.
pub(crate) fn is_stored(policy: &PolicyFn, head: &Parts) -> bool {
    head.extensions.get::<NoStore>().is_none() && policy(head.status, &head.headers)
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
        for s in [200, 201, 204, 302, 401, 403, 404, 409, 410] {
            assert!(
                default_storage_policy(StatusCode::from_u16(s).unwrap(), &h),
                "{s}"
            );
        }
        for s in [400, 408, 415, 422, 429, 500, 502, 503, 504] {
            assert!(
                !default_storage_policy(StatusCode::from_u16(s).unwrap(), &h),
                "{s}"
            );
        }
    }
}
