//! Rejections: RFC 9457 problem documents with stable `type` URIs.
//!
//! Every answer the layer gives instead of the handler's is an
//! `application/problem+json` body with `Cache-Control: no-store`. The `type` of each
//! is a stable URI naming a section of this page, so clients can branch on it.
//!
#![doc = include_str!("../docs/problems.md")]

use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode, header};
use serde::Serialize;

/// The default base of the problem types: this page, each problem an anchor on it.
pub const DEFAULT_TYPE_BASE: &str =
    "https://docs.rs/tower-idempotency/latest/tower_idempotency/rejection/index.html#";

/// A reason the layer answered instead of the handler.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Problem {
    /// 400: a key is required on this request and none was sent.
    KeyMissing,
    /// 400: the `Idempotency-Key` header is malformed or repeated.
    KeyMalformed,
    /// 413: the request body is over the configured limit, or a limit set in front of the
    /// layer.
    BodyTooLarge,
    /// 400: the request body could not be read.
    BodyUnreadable,
    /// 408: the request body did not arrive in time.
    BodyTimeout,
    /// 422: the key was already used with a different request.
    KeyReused,
    /// 409: a request with this key is still being processed.
    InProgress,
    /// 503: the idempotency store cannot be reached; nothing was run.
    StoreUnavailable,
    /// 503: this instance is shutting down and claims no new keys; nothing was run.
    ShuttingDown,
    /// 500: the request failed while being processed (the handler panicked, its
    /// response body failed under a status the storage policy does not keep or in
    /// transactional mode, or it kept its transaction's connection); nothing is held
    /// under the key: released, rolled back, or never claimed. Also the extractors'
    /// answer to a request no layer guarded as the handler needs (the app's wiring).
    HandlerFailed,
    /// 503: transactional mode could not commit; the request had no effect (or, when the
    /// connection died during `COMMIT` and a check could not tell, the detail says the
    /// outcome is unknown; a retry with the same key replays it if it committed).
    NotCommitted,
    /// 500: transactional mode: the handler ended the request's transaction itself (a
    /// `COMMIT` or `ROLLBACK` on its connection), so what it wrote may have committed
    /// without its response. The key is completed with this answer: the request is not
    /// run again under it.
    TransactionEnded,
    /// 500: the request ran, but its response was too large to store, its body did not
    /// end within `response_body_timeout`, or (in lease mode, under a status the storage
    /// policy keeps) its body failed while it was read, so it cannot be replayed.
    ResponseNotStored,
    /// 500: two layers of different modes guard the request over the same records (the
    /// app's wiring); nothing was processed, and nothing is stored.
    Misconfigured,
    /// 500: the key's stored response could not be opened (it is sealed under a key the
    /// layer does not have, or does not authenticate: changed, or copied from another
    /// record); the request ran once, and is not run again.
    ResponseUnreadable,
    /// 410: the request with this key was completed, and its stored response is gone
    /// (its retention ended), but the key is remembered: it is not run again. The
    /// document's members say when it was completed (`completed_at`), with what status
    /// (`response_status`), and until when the key is remembered (`remembered_until`).
    ResponseExpired,
}

#[derive(Serialize)]
struct Body<'a> {
    #[serde(rename = "type")]
    type_: &'a str,
    title: &'a str,
    status: u16,
    detail: &'a str,
    /// The problem's own members (RFC 9457 §3.2), after the standard ones.
    #[serde(flatten)]
    members: &'a serde_json::Map<String, serde_json::Value>,
}

impl Problem {
    /// The anchor of this problem on the documentation page, e.g. `key-reused`.
    pub fn slug(self) -> &'static str {
        match self {
            Self::KeyMissing => "key-missing",
            Self::KeyMalformed => "key-malformed",
            Self::BodyTooLarge => "body-too-large",
            Self::BodyUnreadable => "body-unreadable",
            Self::BodyTimeout => "body-timeout",
            Self::KeyReused => "key-reused",
            Self::InProgress => "in-progress",
            Self::StoreUnavailable => "store-unavailable",
            Self::ShuttingDown => "shutting-down",
            Self::HandlerFailed => "handler-failed",
            Self::NotCommitted => "not-committed",
            Self::ResponseNotStored => "response-not-stored",
            Self::Misconfigured => "misconfigured",
            Self::TransactionEnded => "transaction-ended",
            Self::ResponseUnreadable => "response-unreadable",
            Self::ResponseExpired => "response-expired",
        }
    }

    /// The stable `type` URI.
    ///
    /// ```
    /// use tower_idempotency::rejection::Problem;
    /// assert!(Problem::KeyReused.type_uri().ends_with("#key-reused"));
    /// ```
    pub fn type_uri(self) -> String {
        format!("{DEFAULT_TYPE_BASE}{}", self.slug())
    }

    /// The HTTP status.
    pub fn status(self) -> StatusCode {
        match self {
            Self::KeyMissing | Self::KeyMalformed | Self::BodyUnreadable => StatusCode::BAD_REQUEST,
            Self::BodyTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Self::BodyTimeout => StatusCode::REQUEST_TIMEOUT,
            Self::KeyReused => StatusCode::UNPROCESSABLE_ENTITY,
            Self::InProgress => StatusCode::CONFLICT,
            // Not 409 (a conflict with the key's current state that a retry may
            // resolve) nor 422 (another request under the key), as the IETF
            // Idempotency-Key draft uses them; RFC 9110 §15.5.11: the target's state is
            // gone and this is likely permanent. docs/clients.md says more.
            Self::ResponseExpired => StatusCode::GONE,
            Self::StoreUnavailable | Self::ShuttingDown | Self::NotCommitted => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            Self::HandlerFailed
            | Self::ResponseNotStored
            | Self::Misconfigured
            | Self::TransactionEnded
            | Self::ResponseUnreadable => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// A short human-readable summary; the same for every occurrence.
    pub fn title(self) -> &'static str {
        match self {
            Self::KeyMissing => "Idempotency-Key required",
            Self::KeyMalformed => "Malformed Idempotency-Key",
            Self::BodyTooLarge => "Request body too large",
            Self::BodyUnreadable => "Request body unreadable",
            Self::BodyTimeout => "Request body timed out",
            Self::KeyReused => "Idempotency-Key reused with a different request",
            Self::InProgress => "Request with this Idempotency-Key in progress",
            Self::StoreUnavailable => "Idempotency store unavailable",
            Self::ShuttingDown => "Shutting down",
            Self::HandlerFailed => "Request failed",
            Self::NotCommitted => "Request not committed",
            Self::ResponseNotStored => "Response not replayable",
            Self::Misconfigured => "Idempotency layers misconfigured",
            Self::TransactionEnded => "Transaction ended by the handler",
            Self::ResponseUnreadable => "Stored response unreadable",
            Self::ResponseExpired => "Request done; its stored response has expired",
        }
    }

    /// The problem document with `detail` as a response.
    pub fn response(self, detail: &str) -> Response<Bytes> {
        self.document(DEFAULT_TYPE_BASE, detail, &serde_json::Map::new())
    }

    /// The problem document with `detail` and the problem's own `members`, its `type`
    /// the slug under `base`.
    fn document(
        self,
        base: &str,
        detail: &str,
        members: &serde_json::Map<String, serde_json::Value>,
    ) -> Response<Bytes> {
        let type_uri = format!("{base}{}", self.slug());
        let body = Body {
            type_: &type_uri,
            title: self.title(),
            status: self.status().as_u16(),
            detail,
            members,
        };
        let bytes = serde_json::to_vec(&body)
            .map(Bytes::from)
            .unwrap_or_default();
        let mut res = Response::new(bytes);
        *res.status_mut() = self.status();
        let h = res.headers_mut();
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
        res.extensions_mut().insert(self);
        res
    }

    /// Like [`response`](Self::response), with `Retry-After` in whole seconds (at least 1).
    pub fn response_retry_after(self, detail: &str, after: std::time::Duration) -> Response<Bytes> {
        let mut res = self.response(detail);
        let secs = after.as_millis().div_ceil(1000).max(1);
        res.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from(secs as u64));
        res
    }
}

/// The layer answering in the handler's stead: which [`Problem`], the detail for this
/// request, and when to look again. What an app's own error format is made from
/// ([`IdempotencyLayer::rejection_with`](crate::IdempotencyLayer::rejection_with)).
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency::rejection::{Problem, Rejection};
///
/// let rejection = Rejection::new(Problem::InProgress, "still running")
///     .with_retry_after(Duration::from_secs(1));
/// assert_eq!(rejection.status(), 409);
/// let res = rejection.to_response("https://api.example.com/problems/");
/// assert_eq!(res.headers()["retry-after"], "1");
/// # let doc: serde_json::Value = serde_json::from_slice(res.body()).unwrap();
/// # assert_eq!(doc["type"], "https://api.example.com/problems/in-progress");
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    problem: Problem,
    detail: String,
    retry_after: Option<std::time::Duration>,
    members: serde_json::Map<String, serde_json::Value>,
}

impl Rejection {
    /// `problem`, with `detail` saying what it means for this request.
    pub fn new(problem: Problem, detail: impl Into<String>) -> Self {
        Self {
            problem,
            detail: detail.into(),
            retry_after: None,
            members: serde_json::Map::new(),
        }
    }

    /// With a member of the problem's own, `name` (not one of RFC 9457's: `type`,
    /// `title`, `status`, `detail`, `instance`), after the standard ones.
    ///
    /// ```
    /// use tower_idempotency::rejection::{Problem, Rejection};
    ///
    /// let rejection = Rejection::new(Problem::ResponseExpired, "done, response gone")
    ///     .with_member("response_status", 201);
    /// assert_eq!(rejection.status(), 410);
    /// assert_eq!(rejection.members()["response_status"], 201);
    /// ```
    #[must_use]
    pub fn with_member(mut self, name: &str, value: impl Into<serde_json::Value>) -> Self {
        self.members.insert(name.to_owned(), value.into());
        self
    }

    /// The problem's own members ([`with_member`](Self::with_member)): what an app's
    /// own format may carry over.
    pub fn members(&self) -> &serde_json::Map<String, serde_json::Value> {
        &self.members
    }

    /// With a `Retry-After` of `after` (whole seconds, rounded up, at least 1).
    #[must_use]
    pub fn with_retry_after(mut self, after: std::time::Duration) -> Self {
        self.retry_after = Some(after);
        self
    }

    /// The problem.
    pub fn problem(&self) -> Problem {
        self.problem
    }

    /// Its HTTP status.
    pub fn status(&self) -> StatusCode {
        self.problem.status()
    }

    /// What it means for this request.
    pub fn detail(&self) -> &str {
        &self.detail
    }

    /// When the client should look again, if it should.
    pub fn retry_after(&self) -> Option<std::time::Duration> {
        self.retry_after
    }

    /// The RFC 9457 problem document, its `type` the problem's slug under `base` (the
    /// default: [`DEFAULT_TYPE_BASE`]), with `Retry-After` if set.
    pub fn to_response(&self, base: &str) -> Response<Bytes> {
        let mut res = self.problem.document(base, &self.detail, &self.members);
        if let Some(after) = self.retry_after {
            let secs = after.as_millis().div_ceil(1000).max(1);
            res.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs as u64));
        }
        res
    }
}

impl std::fmt::Display for Rejection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.problem.title(), self.detail)
    }
}

impl std::error::Error for Rejection {}

/// How a layer words its rejections: the base of the problem types, or the app's own
/// format in their place.
#[derive(Clone, Default)]
pub(crate) struct Problems {
    /// `None`: [`DEFAULT_TYPE_BASE`].
    base: Option<std::sync::Arc<str>>,
    hook: Option<Hook>,
}

/// The app's format: a response for each rejection, or `None` where it could not make
/// one (an `IntoResponse` body not ready at once, or too large), for the default
/// document to answer in its place.
type Hook = std::sync::Arc<dyn Fn(&Rejection) -> Option<Response<Bytes>> + Send + Sync>;

/// The most bytes of a body that
/// [`rejection_into_response`](crate::IdempotencyLayer::rejection_into_response) reads
/// from what the app's error type renders.
#[cfg(feature = "axum")]
pub(crate) const RENDERED_LIMIT: usize = 64 * 1024;

/// `res`, an axum response the app's error type rendered for `rejection`, with its
/// body read whole: it must be ready at once (a body made of bytes, a string or JSON
/// is) and within [`RENDERED_LIMIT`]. `None`, logged at `error`, otherwise.
#[cfg(feature = "axum")]
pub(crate) fn rendered(
    rejection: &Rejection,
    res: axum_core::response::Response,
) -> Option<Response<Bytes>> {
    use futures_util::FutureExt;
    use http_body_util::BodyExt;
    let (parts, body) = res.into_parts();
    let read = http_body_util::Limited::new(body, RENDERED_LIMIT).collect();
    let why = match read.now_or_never() {
        Some(Ok(body)) => return Some(Response::from_parts(parts, body.to_bytes())),
        Some(Err(e)) => e.to_string(),
        None => "its body was not ready at once (a stream?)".to_owned(),
    };
    tracing::error!(
        problem = rejection.problem.slug(),
        why,
        limit = RENDERED_LIMIT,
        "the app's rendering of a rejection (rejection_into_response) could not be read; answered the default problem document instead"
    );
    None
}

impl Problems {
    pub(crate) fn with_base(mut self, base: std::sync::Arc<str>) -> Self {
        self.base = Some(base);
        self
    }

    pub(crate) fn with_hook(mut self, hook: Hook) -> Self {
        self.hook = Some(hook);
        self
    }

    /// Whether rejections are the default documents.
    pub(crate) fn is_default(&self) -> bool {
        self.base.is_none() && self.hook.is_none()
    }

    /// The base of the problem types.
    pub(crate) fn base(&self) -> &str {
        self.base.as_deref().unwrap_or(DEFAULT_TYPE_BASE)
    }

    /// `rejection` as this layer answers it: the app's format, or the problem document
    /// under this base; marked with its [`Problem`] either way.
    pub(crate) fn render(&self, rejection: &Rejection) -> Response<Bytes> {
        let mut res = match self.hook.as_ref().and_then(|hook| hook(rejection)) {
            Some(res) => res,
            None => return rejection.to_response(self.base()),
        };
        res.extensions_mut().insert(rejection.problem);
        res
    }

    /// `problem` with `detail`, as [`render`](Self::render) answers it.
    pub(crate) fn response(&self, problem: Problem, detail: &str) -> Response<Bytes> {
        if self.is_default() {
            return problem.response(detail);
        }
        self.render(&Rejection::new(problem, detail))
    }

    /// Like [`response`](Self::response), with a `Retry-After` of `after`.
    pub(crate) fn response_retry_after(
        &self,
        problem: Problem,
        detail: &str,
        after: std::time::Duration,
    ) -> Response<Bytes> {
        if self.is_default() {
            return problem.response_retry_after(detail, after);
        }
        self.render(&Rejection::new(problem, detail).with_retry_after(after))
    }
}

impl std::fmt::Debug for Problems {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Problems")
            .field("base", &self.base())
            .field("hook", &self.hook.is_some())
            .finish()
    }
}

/// A handler may answer with a problem of its own kind: its document, with the title
/// as its detail.
#[cfg(feature = "axum")]
impl axum_core::response::IntoResponse for Problem {
    fn into_response(self) -> axum_core::response::Response {
        Rejection::new(self, self.title()).into_response()
    }
}

#[cfg(feature = "axum")]
impl axum_core::response::IntoResponse for Rejection {
    fn into_response(self) -> axum_core::response::Response {
        self.to_response(DEFAULT_TYPE_BASE)
            .map(axum_core::body::Body::from)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn problem_documents_are_rfc9457() {
        let res = Problem::InProgress
            .response_retry_after("busy", std::time::Duration::from_millis(1500));
        assert_eq!(res.status(), 409);
        assert_eq!(res.headers()["content-type"], "application/problem+json");
        assert_eq!(res.headers()["cache-control"], "no-store");
        assert_eq!(res.headers()["retry-after"], "2");
        let v: serde_json::Value = serde_json::from_slice(res.body()).unwrap();
        assert_eq!(
            v["type"],
            "https://docs.rs/tower-idempotency/latest/tower_idempotency/rejection/index.html#in-progress"
        );
        assert_eq!(v["status"], 409);
        assert_eq!(v["title"], "Request with this Idempotency-Key in progress");
        assert_eq!(v["detail"], "busy");
    }

    #[test]
    fn slugs_are_unique() {
        // A new variant fails to compile here until it is listed below.
        let listed = |p: Problem| match p {
            Problem::KeyMissing
            | Problem::KeyMalformed
            | Problem::BodyTooLarge
            | Problem::BodyUnreadable
            | Problem::BodyTimeout
            | Problem::KeyReused
            | Problem::InProgress
            | Problem::StoreUnavailable
            | Problem::ShuttingDown
            | Problem::HandlerFailed
            | Problem::NotCommitted
            | Problem::ResponseNotStored
            | Problem::Misconfigured
            | Problem::TransactionEnded
            | Problem::ResponseUnreadable
            | Problem::ResponseExpired => p,
        };
        let all = [
            Problem::KeyMissing,
            Problem::KeyMalformed,
            Problem::BodyTooLarge,
            Problem::BodyUnreadable,
            Problem::BodyTimeout,
            Problem::KeyReused,
            Problem::InProgress,
            Problem::StoreUnavailable,
            Problem::ShuttingDown,
            Problem::HandlerFailed,
            Problem::NotCommitted,
            Problem::ResponseNotStored,
            Problem::Misconfigured,
            Problem::TransactionEnded,
            Problem::ResponseUnreadable,
            Problem::ResponseExpired,
        ];
        let all = all.map(listed);
        let page = include_str!("../docs/problems.md");
        for p in all {
            assert!(
                page.contains(&format!("<a id=\"{}\"></a>", p.slug())),
                "{} is not described in docs/problems.md",
                p.slug()
            );
        }
        let mut slugs: Vec<_> = all.iter().map(|p| p.slug()).collect();
        slugs.sort_unstable();
        slugs.dedup();
        assert_eq!(slugs.len(), all.len());
    }
}
