//! Scopes: whose keys are whose.
//!
//! Keys are unique per scope, never globally: two callers that happen to pick the same
//! key get two executions and each sees only its own response. The default scope is
//! derived from the `Authorization` header (its SHA-256, never the credential itself);
//! requests without one share the anonymous scope `""`. Apps with tenants or users set
//! their own with [`IdempotencyLayer::scope_with`](crate::IdempotencyLayer::scope_with).
//!
//! The hash is unsalted: whoever reads the table can test guesses of a credential
//! against it. Random API keys and tokens are beyond guessing; for passwords (`Basic`
//! authentication), scope by the authenticated principal instead.
//!
//! Mind that a refreshed or rotated token changes the default scope: a retry sent with
//! a new token is then a new request and runs again. For payments, scope by a stable
//! principal (account, user, API key id) instead; see docs/security.md.

use std::{fmt, sync::Arc};

use http::{header::AUTHORIZATION, request::Parts};
use sha2::{Digest, Sha256};

/// The namespace a key lives in (a tenant, a user, an API credential).
///
/// ```
/// use tower_idempotency::Scope;
///
/// let scope = Scope::new("tenant-42");
/// assert_eq!(scope.as_str(), "tenant-42");
/// assert_eq!(Scope::anonymous().as_str(), "");
/// ```
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Scope(Arc<str>);

impl Scope {
    /// A scope with this name.
    ///
    /// Keep it short (an id, or a hash): `PostgresStore`'s primary key holds the scope
    /// and the key together, and PostgreSQL's index takes at most about 2.7 KB of them
    /// once compressed, so a long scope that does not compress fails every claim
    /// (`503 store-unavailable`).
    pub fn new(name: impl Into<Arc<str>>) -> Self {
        Self(name.into())
    }

    /// The scope of requests with no principal.
    pub fn anonymous() -> Self {
        Self(Arc::from(""))
    }

    /// The scope's name, as stored.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The default scope of a request: `auth:` and the hex SHA-256 of its
    /// `Authorization` header, or [`Scope::anonymous`] without one.
    ///
    /// ```
    /// use tower_idempotency::Scope;
    ///
    /// let (alice, _) = http::Request::post("/").header("authorization", "Bearer alice")
    ///     .body(()).unwrap().into_parts();
    /// let (bob, _) = http::Request::post("/").header("authorization", "Bearer bob")
    ///     .body(()).unwrap().into_parts();
    /// assert_ne!(Scope::from_authorization(&alice), Scope::from_authorization(&bob));
    /// assert!(!Scope::from_authorization(&alice).as_str().contains("alice"));
    /// ```
    pub fn from_authorization(parts: &Parts) -> Self {
        match parts.headers.get(AUTHORIZATION) {
            None => Self::anonymous(),
            Some(value) => {
                let digest = Sha256::digest(value.as_bytes());
                Self::new(format!("auth:{}", crate::fingerprint::hex(&digest)))
            }
        }
    }
}

impl fmt::Debug for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

impl fmt::Display for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Computes the scope of a request.
pub(crate) type ScopeFn = Arc<dyn Fn(&Parts) -> Scope + Send + Sync>;
