//! How the layer finds a guarded request's scope: the [`Principal`] the app's
//! authentication put in it, before anything else; else the app's own function
//! (`scope_with`); else the fallbacks, a hash of `Authorization` or the anonymous
//! scope, which say so, once per layer, when they ignore what a request carries. And
//! the scope the layer used before a deploy changed how it finds them
//! (`previous_scope_with`).

use std::sync::{
    Arc,
    atomic::{AtomicBool, Ordering},
};

use http::{
    Extensions, HeaderMap, HeaderName,
    header::{AUTHORIZATION, COOKIE},
    request::Parts,
};

use super::scope::ScopeFn;
use crate::{Principal, Scope};

/// The credential headers a request may carry besides `Authorization` by default.
const X_API_KEY: HeaderName = HeaderName::from_static("x-api-key");

/// A layer's settings for scopes, and the warnings it has given.
#[derive(Clone)]
pub(crate) struct Scoping {
    /// `scope_with`: the app's function, for a request without a principal.
    pub(crate) custom: Option<ScopeFn>,
    /// `previous_scope_with`: where a key new in its scope is also looked for.
    pub(crate) previous: Option<ScopeFn>,
    /// `credential_headers`: what the anonymous fallback warns it ignores.
    pub(crate) credential_headers: Arc<[HeaderName]>,
    /// `require_principal`: a guarded request without a principal is refused.
    pub(crate) require_principal: bool,
    /// The anonymous scope taken for a request that carried credentials.
    ignored_credentials: WarnOnce,
    /// The `Authorization` hash taken by default.
    hashed_authorization: WarnOnce,
}

impl Default for Scoping {
    fn default() -> Self {
        Self {
            custom: None,
            previous: None,
            credential_headers: Arc::from([COOKIE, X_API_KEY]),
            require_principal: false,
            ignored_credentials: WarnOnce::default(),
            hashed_authorization: WarnOnce::default(),
        }
    }
}

impl Scoping {
    /// Whether a guarded request with these extensions is refused for want of a
    /// principal (`require_principal`).
    pub(crate) fn lacks_principal(&self, extensions: &Extensions) -> bool {
        self.require_principal && extensions.get::<Principal>().is_none()
    }

    /// The scope of a guarded request: its principal's; else the app's function's;
    /// else the hash of its `Authorization`; else anonymous. A fallback warns, once
    /// per layer, of what it ignores.
    pub(crate) fn scope_of(&self, parts: &Parts) -> Scope {
        if let Some(principal) = parts.extensions.get::<Principal>() {
            return principal.scope().clone();
        }
        let scope = match &self.custom {
            Some(custom) => custom(parts),
            None if parts.headers.contains_key(AUTHORIZATION) => {
                if self.hashed_authorization.first() {
                    tracing::warn!(
                        route = route(parts),
                        "no Principal in a guarded request: its keys are scoped by a hash of its Authorization header, so a refreshed or rotated token is a new scope, and a retry sent with one runs again. Insert a tower_idempotency::Principal (the account) in the app's authentication middleware, outside the idempotency layer (in axum, a .layer added after it); or keep this scope on purpose, for credentials that never change, with scope_with(Scope::from_authorization). Said once per layer"
                    );
                }
                return Scope::from_authorization(parts);
            }
            None => Scope::anonymous(),
        };
        if scope.as_str().is_empty()
            && let Some(header) = self.carried_credentials(&parts.headers)
            && self.ignored_credentials.first()
        {
            tracing::warn!(
                route = route(parts),
                header = header.as_str(),
                "a guarded request carries credentials the idempotency layer does not scope by (its {header} header), and no Principal: its key is in the anonymous scope, which every such caller shares, so one caller's retry can get another's stored response. Insert a tower_idempotency::Principal (the account) in the app's authentication middleware, outside the idempotency layer (in axum, a .layer added after it); require_principal(true) refuses requests without one. Said once per layer"
            );
        }
        scope
    }

    /// The scope `previous_scope_with` gives the request, where it differs from
    /// `scope`, its own: where its key is also looked for when it is new.
    pub(crate) fn previous_of(&self, parts: &Parts, scope: &Scope) -> Option<Scope> {
        let previous = (self.previous.as_ref()?)(parts);
        (previous != *scope).then_some(previous)
    }

    /// The first of the credential headers the request carries.
    fn carried_credentials(&self, headers: &HeaderMap) -> Option<&HeaderName> {
        self.credential_headers
            .iter()
            .find(|name| headers.contains_key(*name))
    }
}

/// The route a request matched, for the warnings: axum's `MatchedPath` (the route's
/// template) when the layer is inside the router, or else the request's path.
pub(crate) fn route(parts: &Parts) -> &str {
    #[cfg(feature = "axum")]
    if let Some(matched) = parts.extensions.get::<axum::extract::MatchedPath>() {
        return matched.as_str();
    }
    parts.uri.path()
}

/// A warning given once: by the layer whose settings hold it, and its clones (a
/// setting changed on a copy of the layer makes a layer of its own, which warns anew).
#[derive(Default)]
struct WarnOnce(AtomicBool);

impl WarnOnce {
    /// Whether this is the first time.
    fn first(&self) -> bool {
        !self.0.load(Ordering::Relaxed) && !self.0.swap(true, Ordering::Relaxed)
    }
}

impl Clone for WarnOnce {
    fn clone(&self) -> Self {
        Self::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(headers: &[(&str, &str)]) -> Parts {
        let mut req = http::Request::post("/payments");
        for (name, value) in headers {
            req = req.header(*name, *value);
        }
        req.body(()).unwrap().into_parts().0
    }

    #[test]
    fn the_principal_comes_before_the_app_s_function_and_the_fallbacks() {
        let scoping = Scoping {
            custom: Some(Arc::new(|_: &Parts| Scope::new("custom"))),
            ..Scoping::default()
        };
        let mut with = parts(&[("authorization", "Bearer t")]);
        with.extensions.insert(Principal::new("acct"));
        assert_eq!(scoping.scope_of(&with).as_str(), "principal:acct");
        assert_eq!(
            scoping.scope_of(&parts(&[("authorization", "Bearer t")])),
            Scope::new("custom")
        );
        let fallback = Scoping::default();
        let hashed = parts(&[("authorization", "Bearer t")]);
        assert_eq!(
            fallback.scope_of(&hashed),
            Scope::from_authorization(&hashed)
        );
        assert_eq!(fallback.scope_of(&parts(&[])), Scope::anonymous());
    }

    #[test]
    fn a_previous_scope_is_one_that_differs() {
        let scoping = Scoping {
            previous: Some(Arc::new(Scope::from_authorization)),
            ..Scoping::default()
        };
        let mut req = parts(&[("authorization", "Bearer t")]);
        req.extensions.insert(Principal::new("acct"));
        let scope = scoping.scope_of(&req);
        assert_eq!(
            scoping.previous_of(&req, &scope),
            Some(Scope::from_authorization(&req))
        );
        // Without a principal and a credential, both are anonymous: nothing to look for.
        let anonymous = parts(&[]);
        assert_eq!(scoping.previous_of(&anonymous, &Scope::anonymous()), None);
        assert_eq!(Scoping::default().previous_of(&req, &scope), None);
    }

    #[test]
    fn a_warning_is_given_once_per_layer_and_anew_by_a_copy_set_otherwise() {
        let once = WarnOnce::default();
        assert!(once.first());
        assert!(!once.first());
        assert!(once.clone().first());
    }
}
