//! Scopes: whose keys are whose.
//!
//! Keys are unique per scope, never globally: two callers that happen to pick the same
//! key get two executions and each sees only its own response. A request's scope is
//! its [`Principal`](crate::Principal)'s, which the app's authentication inserts; the
//! app's own function's ([`IdempotencyLayer::scope_with`](crate::IdempotencyLayer::scope_with));
//! or, as fallbacks, derived from the `Authorization` header (its SHA-256, never the
//! credential itself), or the anonymous scope `""` that requests without one share.
//!
//! The hash is unsalted: whoever reads the table can test guesses of a credential
//! against it. Random API keys and tokens are beyond guessing; for passwords (`Basic`
//! authentication), scope by the authenticated principal instead.
//!
//! Mind that a refreshed or rotated token changes the `Authorization` scope: a retry
//! sent with a new token is then a new request and runs again. For payments, scope by
//! the principal (account, user, API key id); see docs/security.md.

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
        // One `Arc` for every request without a principal: a clone of it is a count
        // raised, where `Arc::from("")` allocated for each.
        static ANONYMOUS: std::sync::LazyLock<Arc<str>> =
            std::sync::LazyLock::new(|| Arc::from(""));
        Self(ANONYMOUS.clone())
    }

    /// The scope's name, as stored.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The fallback scope of a request without a [`Principal`](crate::Principal):
    /// `auth:` and the hex SHA-256 of its `Authorization` header, or
    /// [`Scope::anonymous`] without one. A refreshed token is a new scope. Given to
    /// [`scope_with`](crate::IdempotencyLayer::scope_with), it keeps this scope on
    /// purpose (for credentials that never change), without the layer's warning; given
    /// to [`previous_scope_with`](crate::IdempotencyLayer::previous_scope_with), it
    /// names the scope a layer used before scoping by principal.
    ///
    /// The header is hashed as one credential, whatever its spelling: the
    /// authentication scheme is case-insensitive (RFC 9110, section 11.1), so
    /// `Bearer x`, `bearer x` and `BEARER  x` are one scope. The scheme is hashed
    /// capitalised (`Bearer`, `Basic`), the whitespace around the header and between
    /// scheme and credentials taken as one space; the credentials themselves are
    /// case-sensitive and hashed as sent.
    ///
    /// ```
    /// use tower_idempotency::Scope;
    ///
    /// let parts = |auth: &str| {
    ///     http::Request::post("/").header("authorization", auth).body(()).unwrap().into_parts().0
    /// };
    /// let alice = Scope::from_authorization(&parts("Bearer alice"));
    /// assert_ne!(alice, Scope::from_authorization(&parts("Bearer bob")));
    /// assert!(!alice.as_str().contains("alice"));
    /// // One credential, however the scheme is spelt.
    /// assert_eq!(alice, Scope::from_authorization(&parts("bearer  alice")));
    /// // The credential itself is case-sensitive.
    /// assert_ne!(alice, Scope::from_authorization(&parts("Bearer Alice")));
    /// ```
    pub fn from_authorization(parts: &Parts) -> Self {
        match parts.headers.get(AUTHORIZATION) {
            None => Self::anonymous(),
            Some(value) => {
                let mut digest = Sha256::new();
                canonical_credentials(value.as_bytes(), |part| digest.update(part));
                Self::new(format!("auth:{}", crate::hex::encode(&digest.finalize())))
            }
        }
    }
}

/// Writes an `Authorization` value, in parts, to `write` as one spelling of its
/// credentials: surrounding whitespace dropped, the scheme capitalised (its first letter
/// upper case, the rest lower case: `Bearer` and `Basic`, the usual spellings, hash as
/// they always did), and one space between scheme and credentials. In parts, so that
/// hashing it allocates nothing.
fn canonical_credentials(value: &[u8], mut write: impl FnMut(&[u8])) {
    let is_space = |b: &u8| *b == b' ' || *b == b'\t';
    let start = value
        .iter()
        .position(|b| !is_space(b))
        .unwrap_or(value.len());
    let end = value
        .iter()
        .rposition(|b| !is_space(b))
        .map_or(start, |i| i + 1);
    let value = &value[start..end];
    let scheme_end = value.iter().position(is_space).unwrap_or(value.len());
    let (scheme, rest) = value.split_at(scheme_end);
    let mut buf = [0u8; 32];
    for (n, chunk) in scheme.chunks(buf.len()).enumerate() {
        for (i, b) in chunk.iter().enumerate() {
            buf[i] = if n == 0 && i == 0 {
                b.to_ascii_uppercase()
            } else {
                b.to_ascii_lowercase()
            };
        }
        write(&buf[..chunk.len()]);
    }
    let credentials = &rest[rest.iter().position(|b| !is_space(b)).unwrap_or(rest.len())..];
    if !credentials.is_empty() {
        write(b" ");
        write(credentials);
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

#[cfg(test)]
mod tests {
    /// The canonical spelling, whole.
    fn canonical_credentials(value: &[u8]) -> Vec<u8> {
        let mut whole = Vec::new();
        super::canonical_credentials(value, |part| whole.extend_from_slice(part));
        whole
    }

    #[test]
    fn one_credential_has_one_spelling() {
        for spelt in [
            "Bearer abc.DEF",
            "bearer abc.DEF",
            "BEARER abc.DEF",
            " Bearer \t abc.DEF\t ",
        ] {
            assert_eq!(
                canonical_credentials(spelt.as_bytes()),
                b"Bearer abc.DEF",
                "{spelt:?}"
            );
        }
        // Credentials keep their case, and what is inside them.
        assert_eq!(
            canonical_credentials(b"Basic QWxh ZGRp"),
            b"Basic QWxh ZGRp"
        );
        assert_ne!(
            canonical_credentials(b"Bearer abc"),
            canonical_credentials(b"Bearer ABC")
        );
        assert_eq!(canonical_credentials(b"Negotiate"), b"Negotiate");
        assert_eq!(canonical_credentials(b"  "), b"");
        assert_eq!(canonical_credentials(b""), b"");
        // A scheme longer than the buffer it is lowered in.
        let long = format!("{} x", "AbC".repeat(30));
        let expected = format!("Abc{} x", "abc".repeat(29));
        assert_eq!(canonical_credentials(long.as_bytes()), expected.as_bytes());
    }
}
