//! The Axum extractors of what the layer hands a handler: its [`IdempotencyKey`], and in
//! transactional mode its [`TransactionHandle`](crate::transactional::TransactionHandle);
//! and their rejections.

use axum_core::{
    extract::{FromRequestParts, OptionalFromRequestParts},
    response::{IntoResponse, Response},
};
use bytes::Bytes;
use http::{StatusCode, request::Parts};
use std::sync::Arc;

use crate::IdempotencyKey;
use crate::rejection::{DEFAULT_TYPE_BASE, Problem, Problems, Rejection};

/// Rejection of the [`IdempotencyKey`] extractor: the layer in front of the route saw
/// no key in the request (`400 key-missing`), or no
/// [`IdempotencyLayer`](crate::IdempotencyLayer) guarded the request (`500
/// handler-failed`: the layer is not in front of the route, or does not guard its
/// method; the client is not to blame).
///
/// Like axum's own rejections, it answers for itself ([`IntoResponse`], worded as the
/// layer in front words its problems), or tells what it is ([`status`](Self::status),
/// [`body_text`](Self::body_text), [`rejection`](Self::rejection), `Display`) for a
/// handler that answers in a format of its own.
///
/// ```
/// use axum::{Router, http::StatusCode, routing::post};
/// use tower_idempotency::{IdempotencyKey, IdempotencyLayer, MissingIdempotencyKey};
/// # use tower_idempotency::store::MemoryStore;
///
/// async fn create(key: Result<IdempotencyKey, MissingIdempotencyKey>) -> (StatusCode, String) {
///     match key {
///         Ok(key) => (StatusCode::CREATED, format!("created under {key}")),
///         Err(rejection) => (rejection.status(), rejection.to_string()),
///     }
/// }
///
/// let app: Router = Router::new()
///     .route("/things", post(create))
///     .layer(IdempotencyLayer::new(MemoryStore::new()));
/// ```
#[derive(Debug, Clone)]
pub struct MissingIdempotencyKey {
    /// The field a layer looked for the key in; `None`: no layer guarded the request.
    header: Option<String>,
    /// How that layer words its problems, if not by default.
    problems: Option<Arc<Problems>>,
}

impl MissingIdempotencyKey {
    /// What is rejected, and why: `key-missing`, or `handler-failed` where no layer
    /// guarded the request.
    pub fn rejection(&self) -> Rejection {
        match &self.header {
            Some(header) => Rejection::new(
                Problem::KeyMissing,
                format!("this handler needs an {header}, and the request had none"),
            ),
            None => Rejection::new(
                Problem::HandlerFailed,
                "this handler needs its request guarded by the idempotency layer, and none guarded it; nothing was processed",
            ),
        }
    }

    /// The status it answers: `400`, or `500` where no layer guarded the request.
    pub fn status(&self) -> StatusCode {
        self.rejection().status()
    }

    /// The body it answers (the problem document, unless the layer words its problems
    /// its own way).
    pub fn body_text(&self) -> String {
        body_text(&render(&self.rejection(), self.problems.as_deref()))
    }
}

impl std::fmt::Display for MissingIdempotencyKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.rejection().fmt(f)
    }
}

impl std::error::Error for MissingIdempotencyKey {}

impl IntoResponse for MissingIdempotencyKey {
    fn into_response(self) -> Response {
        if self.header.is_none() {
            tracing::error!(
                "a handler that takes an IdempotencyKey got a request no IdempotencyLayer guarded; is the layer in front of the route, for its method?"
            );
        }
        into_axum(render(&self.rejection(), self.problems.as_deref()))
    }
}

/// `rejection`, worded as the layer that saw the request words its problems, or by
/// default.
fn render(rejection: &Rejection, problems: Option<&Problems>) -> http::Response<Bytes> {
    match problems {
        Some(problems) => problems.render(rejection),
        None => rejection.to_response(DEFAULT_TYPE_BASE),
    }
}

fn body_text(res: &http::Response<Bytes>) -> String {
    String::from_utf8_lossy(res.body()).into_owned()
}

fn into_axum(res: http::Response<Bytes>) -> Response {
    res.map(axum_core::body::Body::from)
}

/// A handler may pass on [`IdempotencyKey::step`]'s error with `?`: `500
/// handler-failed`, as the problem document by default, saying why (map it to a
/// response of your own where the app words its errors otherwise). The layer does not
/// store a 5xx by default: the key is released, and a retry runs anew.
impl IntoResponse for crate::StepError {
    fn into_response(self) -> Response {
        tracing::error!(error = %self, "a step of the handler failed");
        let rejection = Rejection::new(Problem::HandlerFailed, self.to_string());
        into_axum(rejection.to_response(DEFAULT_TYPE_BASE))
    }
}

impl<S: Send + Sync> FromRequestParts<S> for IdempotencyKey {
    type Rejection = MissingIdempotencyKey;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        parts
            .extensions
            .get::<IdempotencyKey>()
            .cloned()
            .ok_or_else(|| MissingIdempotencyKey {
                header: crate::request::unkeyed_in(&parts.extensions),
                problems: crate::request::problems_in(&parts.extensions),
            })
    }
}

impl<S: Send + Sync> OptionalFromRequestParts<S> for IdempotencyKey {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Option<Self>, Self::Rejection> {
        Ok(parts.extensions.get::<IdempotencyKey>().cloned())
    }
}

#[cfg(feature = "postgres")]
pub use transaction::MissingTransaction;

#[cfg(feature = "postgres")]
mod transaction {
    use axum_core::{
        extract::{FromRequestParts, OptionalFromRequestParts},
        response::{IntoResponse, Response},
    };
    use http::{StatusCode, request::Parts};
    use std::sync::Arc;

    use super::{body_text, into_axum, render};
    use crate::{
        rejection::{DEFAULT_TYPE_BASE, Problem, Problems, Rejection},
        transactional::{TransactionClosed, TransactionHandle},
    };

    /// Rejection of the [`TransactionHandle`] extractor: the layer in front of the route
    /// saw no key in the request (`400 key-missing`), or the request was guarded in
    /// lease mode, or not at all (`500 handler-failed`: the route needs
    /// [`IdempotencyLayer::transactional`](crate::IdempotencyLayer::transactional) in
    /// front of it, and the client is not to blame; behind a lease-mode layer the answer
    /// is stored only under a storage policy that keeps 5xx, which the default does not).
    ///
    /// Like axum's own rejections: [`IntoResponse`], [`status`](Self::status),
    /// [`body_text`](Self::body_text), [`rejection`](Self::rejection), `Display`.
    #[derive(Debug, Clone)]
    pub struct MissingTransaction {
        /// The field a layer looked for the key in; `None`: the app's wiring is wrong.
        header: Option<String>,
        /// How that layer words its problems, if not by default.
        problems: Option<Arc<Problems>>,
    }

    impl MissingTransaction {
        /// What is rejected, and why: `key-missing`, or `handler-failed` where no
        /// transactional layer guarded the request.
        pub fn rejection(&self) -> Rejection {
            match &self.header {
                Some(header) => Rejection::new(
                    Problem::KeyMissing,
                    format!(
                        "this handler runs in the request's idempotency transaction, and the request had no {header}"
                    ),
                ),
                None => Rejection::new(
                    Problem::HandlerFailed,
                    "this handler runs in an idempotency transaction, and none was opened for the request; nothing was processed",
                ),
            }
        }

        /// The status it answers: `400`, or `500` where no transactional layer guarded
        /// the request.
        pub fn status(&self) -> StatusCode {
            self.rejection().status()
        }

        /// The body it answers (the problem document, unless the layer words its
        /// problems its own way).
        pub fn body_text(&self) -> String {
            body_text(&render(&self.rejection(), self.problems.as_deref()))
        }
    }

    impl std::fmt::Display for MissingTransaction {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            self.rejection().fmt(f)
        }
    }

    impl std::error::Error for MissingTransaction {}

    impl IntoResponse for MissingTransaction {
        fn into_response(self) -> Response {
            if self.header.is_none() {
                tracing::error!(
                    "a handler that takes a TransactionHandle (or a SqlxTransaction) got a request that no IdempotencyLayer::transactional over its driver guarded; is one in front of the route, for its method?"
                );
            }
            into_axum(render(&self.rejection(), self.problems.as_deref()))
        }
    }

    /// A handler may pass on [`TransactionHandle::client`]'s error with `?`: `500
    /// handler-failed`, as the problem document by default (map it to a response of
    /// your own where the app words its errors otherwise). The layer rolls back.
    impl IntoResponse for TransactionClosed {
        fn into_response(self) -> Response {
            into_axum(self.rejection().to_response(DEFAULT_TYPE_BASE))
        }
    }

    impl<S: Send + Sync> FromRequestParts<S> for TransactionHandle {
        type Rejection = MissingTransaction;

        async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
            parts
                .extensions
                .get::<TransactionHandle>()
                .cloned()
                .ok_or_else(|| MissingTransaction {
                    // A layer saw no key, and so opened no transaction: the client's
                    // doing. Anything else is the app's wiring.
                    header: crate::request::unkeyed_in(&parts.extensions),
                    problems: crate::request::problems_in(&parts.extensions),
                })
        }
    }

    impl<S: Send + Sync> OptionalFromRequestParts<S> for TransactionHandle {
        type Rejection = std::convert::Infallible;

        async fn from_request_parts(
            parts: &mut Parts,
            _: &S,
        ) -> Result<Option<Self>, Self::Rejection> {
            Ok(parts.extensions.get::<TransactionHandle>().cloned())
        }
    }

    #[cfg(feature = "sqlx")]
    impl<S: Send + Sync> FromRequestParts<S> for crate::transactional::SqlxTransaction {
        type Rejection = MissingTransaction;

        async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
            parts
                .extensions
                .get::<Self>()
                .cloned()
                .ok_or_else(|| MissingTransaction {
                    // As for `TransactionHandle`: a layer that saw no key is the
                    // client's doing, anything else the app's wiring (a layer over
                    // tokio-postgres in front of a handler written for sqlx, say).
                    header: crate::request::unkeyed_in(&parts.extensions),
                    problems: crate::request::problems_in(&parts.extensions),
                })
        }
    }

    #[cfg(feature = "sqlx")]
    impl<S: Send + Sync> OptionalFromRequestParts<S> for crate::transactional::SqlxTransaction {
        type Rejection = std::convert::Infallible;

        async fn from_request_parts(
            parts: &mut Parts,
            _: &S,
        ) -> Result<Option<Self>, Self::Rejection> {
            Ok(parts.extensions.get::<Self>().cloned())
        }
    }
}
