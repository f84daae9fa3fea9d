//! The principal: who a request is from, as the app's authentication established it.
//!
//! A key is scoped by its principal (the account, tenant or user), never by the bytes
//! of the credential that proved it: an OAuth access token is refreshed every hour, and
//! a retry sent with the new one is the same request. The app's authentication
//! middleware inserts a [`Principal`] into the request once it has checked the
//! credential; the layer, inside that middleware, reads it before anything else.

use std::fmt;

use crate::Scope;

/// What a principal's scope starts with, so that no principal's scope is ever one of
/// the fallbacks' (`auth:` and the hash of a credential, or the anonymous `""`).
const PREFIX: &str = "principal:";

/// Who a request is from (an account, a tenant, a user), as the app's authentication
/// established it: the scope its keys live in.
///
/// The app's authentication middleware inserts it into the request's extensions, in one
/// line, once it has checked the credential. The idempotency layer reads it before
/// anything else: before [`scope_with`](crate::IdempotencyLayer::scope_with), and before
/// the fallbacks (a hash of `Authorization`, or the anonymous scope). The same account
/// with a refreshed token is then the same scope, and its retry is replayed, not run
/// again.
///
/// Name the principal by what does not change while a client retries: an account id,
/// not a session or token id. Two callers with one principal share their keys.
///
/// **The authentication middleware goes outside the idempotency layer**, so that it
/// runs first. In axum a `.layer` call wraps the layers before it: add the idempotency
/// layer first and the authentication after it, on the router or on the route (a
/// `route_layer` of the idempotency layer works the same under an authentication
/// `.layer`). A layer placed the other way round sees no principal: it warns once
/// (`warn`) when it falls back on a request that carries credentials, and with
/// [`require_principal(true)`](crate::IdempotencyLayer::require_principal) it answers
/// `500 misconfigured` instead, running nothing.
///
/// ```
/// use axum::{
///     Router, extract::Request, http::StatusCode, middleware::{self, Next},
///     response::Response, routing::post,
/// };
/// use tower_idempotency::{IdempotencyKey, IdempotencyLayer, Principal, store::MemoryStore};
///
/// /// The app's authentication: checks the token, and names its account.
/// async fn authenticate(mut req: Request, next: Next) -> Result<Response, StatusCode> {
///     let account = verify_token(req.headers()).ok_or(StatusCode::UNAUTHORIZED)?;
///     req.extensions_mut().insert(Principal::new(account));
///     Ok(next.run(req).await)
/// }
/// # fn verify_token(_: &axum::http::HeaderMap) -> Option<String> { Some("acct_42".into()) }
///
/// async fn create_payment(key: IdempotencyKey) -> String {
///     assert_eq!(key.scope().as_str(), "principal:acct_42");
///     format!("payment for {key}")
/// }
///
/// let app: Router = Router::new()
///     .route("/payments", post(create_payment))
///     // Inside: added first.
///     .layer(IdempotencyLayer::new(MemoryStore::new()).require_principal(true))
///     // Outside: added after, so it runs first.
///     .layer(middleware::from_fn(authenticate));
/// ```
///
/// Its scope is `principal:` followed by its name, apart from every scope the
/// fallbacks make.
///
/// ```
/// use tower_idempotency::Principal;
///
/// let principal = Principal::new("acct_42");
/// assert_eq!(principal.as_str(), "acct_42");
/// assert_eq!(principal.scope().as_str(), "principal:acct_42");
/// ```
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Principal {
    /// The scope, whole: built once, when the app's authentication names the principal,
    /// and handed to each claim as it is.
    scope: Scope,
}

impl Principal {
    /// The principal named `name` (an account id, say).
    ///
    /// Keep it short: with the `principal:` before it, it is the scope, which
    /// `PostgresStore` keeps in its primary key (see [`Scope::new`]).
    pub fn new(name: impl AsRef<str>) -> Self {
        Self {
            scope: Scope::new(format!("{PREFIX}{}", name.as_ref())),
        }
    }

    /// The principal's name, as given.
    pub fn as_str(&self) -> &str {
        &self.scope.as_str()[PREFIX.len()..]
    }

    /// The scope its keys live in: `principal:` and its name.
    pub fn scope(&self) -> &Scope {
        &self.scope
    }
}

impl From<Principal> for Scope {
    fn from(principal: Principal) -> Self {
        principal.scope
    }
}

impl fmt::Debug for Principal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Principal").field(&self.as_str()).finish()
    }
}

impl fmt::Display for Principal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_principal_s_scope_is_never_a_fallback_s() {
        let parts = http::Request::post("/")
            .header("authorization", "Bearer x")
            .body(())
            .unwrap()
            .into_parts()
            .0;
        let hashed = Scope::from_authorization(&parts);
        // A principal named like the fallbacks' scopes is not one of them.
        assert_ne!(Principal::new(hashed.as_str()).scope(), &hashed);
        assert_ne!(Principal::new("").scope(), &Scope::anonymous());
        assert_eq!(Principal::new("").as_str(), "");
    }
}
