//! The Axum extractors of what the layer hands a handler: its [`IdempotencyKey`], and in
//! transactional mode its [`TransactionHandle`](crate::transactional::TransactionHandle);
//! and their rejections.

use axum_core::{
    extract::{FromRequestParts, OptionalFromRequestParts},
    response::{IntoResponse, Response},
};
use http::request::Parts;

use crate::IdempotencyKey;
use crate::rejection::Problem;

/// Rejection of the [`IdempotencyKey`] extractor: the layer in front of the route saw
/// no key in the request (`400 key-missing`), or no
/// [`IdempotencyLayer`](crate::IdempotencyLayer) guarded the request (`500
/// handler-failed`: the layer is not in front of the route, or does not guard its
/// method; the client is not to blame).
#[derive(Debug, Clone)]
pub struct MissingIdempotencyKey {
    /// The field a layer looked for the key in; `None`: no layer guarded the request.
    header: Option<String>,
}

impl IntoResponse for MissingIdempotencyKey {
    fn into_response(self) -> Response {
        let res = if let Some(header) = &self.header {
            Problem::KeyMissing.response(&format!(
                "this handler needs an {header}, and the request had none"
            ))
        } else {
            tracing::error!(
                "a handler that takes an IdempotencyKey got a request no IdempotencyLayer guarded; is the layer in front of the route, for its method?"
            );
            Problem::HandlerFailed.response(
                "this handler needs its request guarded by the idempotency layer, and none guarded it; nothing was processed",
            )
        };
        let (parts, body) = res.into_parts();
        Response::from_parts(parts, axum_core::body::Body::from(body))
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
    use http::request::Parts;

    use crate::{rejection::Problem, transactional::TransactionHandle};
    /// Rejection of the [`TransactionHandle`] extractor: the layer in front of the route
    /// saw no key in the request (`400 key-missing`), or the request was guarded in
    /// lease mode, or not at all (`500 handler-failed`: the route needs
    /// [`IdempotencyLayer::transactional`](crate::IdempotencyLayer::transactional) in
    /// front of it, and the client is not to blame; behind a lease-mode layer the answer
    /// is stored only under a storage policy that keeps 5xx, which the default does not).
    #[derive(Debug, Clone)]
    pub struct MissingTransaction {
        /// The field a layer looked for the key in; `None`: the app's wiring is wrong.
        header: Option<String>,
    }

    impl IntoResponse for MissingTransaction {
        fn into_response(self) -> Response {
            let res = if let Some(header) = &self.header {
                Problem::KeyMissing.response(&format!(
                    "this handler runs in the request's idempotency transaction, and the request had no {header}"
                ))
            } else {
                tracing::error!(
                    "a handler that takes a TransactionHandle got a request that no IdempotencyLayer::transactional guarded; is one in front of the route, for its method?"
                );
                Problem::HandlerFailed.response(
                    "this handler runs in an idempotency transaction, and none was opened for the request; nothing was processed",
                )
            };
            let (parts, body) = res.into_parts();
            Response::from_parts(parts, axum_core::body::Body::from(body))
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
}
