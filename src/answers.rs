//! Every answer the layer gives in the handler's stead: the rejections, the replay,
//! the 409, 422 and 503s, and the problems stored when a response cannot be.

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Response};

/// The header set on replayed responses, `Idempotent-Replayed: true`.
pub const IDEMPOTENT_REPLAYED: http::HeaderName =
    http::HeaderName::from_static("idempotent-replayed");

use crate::{
    Outcome, StoredResponse,
    body::ResponseBody,
    layer::Config,
    rejection::{Problem, Problems},
};

/// A rejection before anything was claimed.
pub(crate) fn reject<B>(
    problems: &Problems,
    problem: Problem,
    detail: &str,
) -> Response<ResponseBody<B>> {
    with_outcome(
        problems.response(problem, detail).map(ResponseBody::full),
        Outcome::Rejected,
    )
}

/// `500 misconfigured`: two layers of different modes guard the request over the same
/// records. Marked [`NoStore`](crate::NoStore): the outer layer releases (or rolls back)
/// its claim, whatever its policy.
pub(crate) fn nested_on_one_table<B>(problems: &Problems) -> Response<ResponseBody<B>> {
    tracing::error!(
        "two idempotency layers of different modes (lease and transactional) guard this request over the same table; the inner one would claim the key the outer one holds. Give them different tables, or keep one of them on the route (in axum, a route_layer applies to every route added before it)"
    );
    let mut res = reject(
        problems,
        Problem::Misconfigured,
        "this request is guarded by two idempotency layers of different modes over the same table; the server's configuration must change, nothing was processed",
    );
    res.extensions_mut().insert(crate::NoStore);
    res
}

/// `500 misconfigured`: the layer requires a principal (`require_principal`), and the
/// request reached it without one. Marked [`NoStore`](crate::NoStore), as
/// [`nested_on_one_table`].
pub(crate) fn no_principal<B>(
    problems: &Problems,
    parts: &http::request::Parts,
) -> Response<ResponseBody<B>> {
    tracing::error!(
        route = crate::request::scoping::route(parts),
        "a guarded request reached the idempotency layer without a Principal, which it requires (require_principal); nothing was run. The app's authentication middleware must insert the tower_idempotency::Principal, and be outside the idempotency layer (in axum, a .layer added after it), on every guarded route"
    );
    let mut res = reject(
        problems,
        Problem::Misconfigured,
        "this request reached the idempotency layer without the authenticated principal it requires; the server's configuration must change, nothing was processed",
    );
    res.extensions_mut().insert(crate::NoStore);
    res
}

pub(crate) fn with_outcome<B>(mut res: Response<B>, outcome: Outcome) -> Response<B> {
    res.extensions_mut().insert(outcome);
    res
}

/// The record of a response to store: its status, its storable headers, its body; or,
/// when the layer stores no bodies, no body and none of the headers that describe it.
pub(crate) fn to_store(
    config: &Config,
    parts: &http::response::Parts,
    body: &Bytes,
) -> StoredResponse {
    let mut headers = StoredResponse::storable_headers(&parts.headers, &*config.unreplayed_headers);
    if !config.store_bodies {
        for name in ABOUT_THE_BODY {
            headers.remove(name);
        }
    }
    StoredResponse {
        status: parts.status,
        headers,
        body: if config.store_bodies {
            body.clone()
        } else {
            Bytes::new()
        },
    }
}

/// The headers that describe a response's body, not stored without it
/// ([`store_response_bodies(false)`](crate::IdempotencyLayer::store_response_bodies)):
/// an empty replay must not claim a type, encoding or digest of content it does not
/// carry. `Location`, `Content-Location`, `ETag` and the rest, about the resource, stay.
const ABOUT_THE_BODY: [&str; 8] = [
    "content-type",
    "content-encoding",
    "content-language",
    "content-range",
    "content-md5",
    "content-digest",
    "repr-digest",
    "digest",
];

/// Why a response could not be read whole, to be stored.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Unbuffered {
    /// Over `response_body_limit`.
    TooLarge,
    /// Its body did not end within `response_body_timeout`.
    TooSlow,
    /// Its body failed while it was read.
    Failed,
}

/// The problem a response that could not be stored is replayed as.
pub(crate) fn not_stored_problem(config: &Config, why: Unbuffered) -> StoredResponse {
    let detail = match why {
        Unbuffered::TooLarge => format!(
            "the request was processed once, but its response was over the {}-byte storage limit and cannot be replayed",
            config.response_body_limit
        ),
        Unbuffered::TooSlow => format!(
            "the request was processed once, but its response body did not end within {} ms and cannot be replayed",
            config.response_body_timeout.as_millis()
        ),
        Unbuffered::Failed => {
            "the request was processed once, but its response body failed while it was read and cannot be replayed".to_owned()
        }
    };
    let (p, body) = config
        .problems
        .response(Problem::ResponseNotStored, &detail)
        .into_parts();
    StoredResponse {
        status: p.status,
        headers: p.headers,
        body,
    }
}

/// `409 in-progress`, telling the client to look again after `hint`, or sooner if the
/// running request's lease, `lease_left`, lapses sooner.
pub(crate) fn in_progress<B>(
    problems: &Problems,
    lease_left: Duration,
    hint: Duration,
) -> Response<ResponseBody<B>> {
    let res = problems.response_retry_after(
        Problem::InProgress,
        "a request with this Idempotency-Key is still being processed; retry after the time given",
        lease_left.min(hint),
    );
    with_outcome(res.map(ResponseBody::full), Outcome::Conflict)
}

pub(crate) fn too_large<B>(problems: &Problems, limit: usize) -> Response<ResponseBody<B>> {
    reject(
        problems,
        Problem::BodyTooLarge,
        &format!("the request body is over the limit of {limit} bytes"),
    )
}

pub(crate) fn mismatch<B>(problems: &Problems) -> Response<ResponseBody<B>> {
    let res = problems.response(
        Problem::KeyReused,
        "this Idempotency-Key was already used with a different request (method, path, query, headers or body)",
    );
    with_outcome(res.map(ResponseBody::full), Outcome::Mismatch)
}

pub(crate) fn unavailable<B>(problems: &Problems) -> Response<ResponseBody<B>> {
    let res = problems.response_retry_after(
        Problem::StoreUnavailable,
        "the idempotency store could not be reached; the request was not processed",
        Duration::from_secs(1),
    );
    with_outcome(res.map(ResponseBody::full), Outcome::StoreError)
}

pub(crate) fn shutting_down<B>(problems: &Problems) -> Response<ResponseBody<B>> {
    let res = problems.response_retry_after(
        Problem::ShuttingDown,
        "this server is shutting down and takes no new requests; retry, another instance will serve it",
        Duration::from_secs(1),
    );
    with_outcome(res.map(ResponseBody::full), Outcome::Rejected)
}

pub(crate) fn handler_failed<B>(problems: &Problems) -> Response<ResponseBody<B>> {
    let res = problems.response(
        Problem::HandlerFailed,
        "the request failed while being processed; nothing is held under its Idempotency-Key, so it may be retried",
    );
    with_outcome(res.map(ResponseBody::full), Outcome::Released)
}

/// `500 response-unreadable`: the key's stored response could not be opened (logged
/// where it was found out).
pub(crate) fn unreadable<B>(problems: &Problems) -> Response<ResponseBody<B>> {
    let res = problems.response(
        Problem::ResponseUnreadable,
        "the request with this Idempotency-Key was processed, but its stored response could not be read back; it is not processed again",
    );
    with_outcome(res.map(ResponseBody::full), Outcome::StoreError)
}

/// `410 response-expired`: the key was completed with a response of `status` at
/// `completed_at`, that response is gone, and the key is remembered until
/// `remembered_until`: the request is not run again. The times are RFC 3339, in UTC;
/// the stored response's status is `response_status` (a problem's `status` member is
/// its own, RFC 9457 §3.1.4).
pub(crate) fn response_expired<B>(
    problems: &Problems,
    status: http::StatusCode,
    completed_at: std::time::SystemTime,
    remembered_until: std::time::SystemTime,
) -> Response<ResponseBody<B>> {
    let rejection = crate::rejection::Rejection::new(
        Problem::ResponseExpired,
        "the request with this Idempotency-Key was processed, and its stored response has expired; it is not processed again. Use a new key for a new request",
    )
    .with_member("completed_at", crate::rfc3339::format(completed_at))
    .with_member("response_status", status.as_u16())
    .with_member("remembered_until", crate::rfc3339::format(remembered_until));
    let res = problems.render(&rejection);
    with_outcome(res.map(ResponseBody::full), Outcome::Expired)
}

pub(crate) fn replay<B>(stored: StoredResponse) -> Response<ResponseBody<B>> {
    let mut res = Response::new(ResponseBody::full(stored.body));
    *res.status_mut() = stored.status;
    *res.headers_mut() = stored.headers;
    res.headers_mut()
        .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    with_outcome(res, Outcome::Replayed)
}

/// `503 not-committed`: nothing was kept.
#[cfg(feature = "postgres")]
pub(crate) const NOT_COMMITTED: &str = "the request's transaction could not be committed, so it had no effect; retry with the same key";

/// `503 not-committed` when the outcome is unknown.
#[cfg(feature = "postgres")]
pub(crate) const COMMIT_UNKNOWN: &str = "the database did not answer the commit (the connection failed, or no answer came in time), and whether it took effect could not be checked; retry with the same key: it replays the response if it did, and runs afresh if not";

#[cfg(feature = "postgres")]
pub(crate) fn not_committed<B>(problems: &Problems, detail: &str) -> Response<ResponseBody<B>> {
    let res = problems.response_retry_after(Problem::NotCommitted, detail, Duration::from_secs(1));
    with_outcome(res.map(ResponseBody::full), Outcome::StoreError)
}
