//! What a layer leaves in a request's extensions besides its key: that it guards the
//! request (so that a layer inside it lets the request through), or that it would have,
//! had the request carried a key (so that the extractors tell a client without a key
//! from a route no layer guards).

use std::sync::Arc;

use crate::{IdempotencyKey, layer::Config, rejection::Problems, store::ClaimRequest};

/// Hands a claimed request over to its handler: its [`IdempotencyKey`] (`key`, the
/// client's, not the hash the store may hold), and the mark that it is guarded, in this
/// mode, over this layer's records.
pub(crate) fn hand_over(
    extensions: &mut http::Extensions,
    request: &ClaimRequest<'_>,
    key: &str,
    config: &Config,
    transactional: bool,
) {
    let key = Arc::<str>::from(key);
    extensions.insert(IdempotencyKey::new(request.scope.clone(), key.clone()));
    extensions.insert(Guarded {
        key,
        transactional,
        location: config.store.records_location(),
    });
    mark_problems(extensions, config);
}

/// Left in a request's extensions by a layer that words its problems its own way
/// ([`problem_type_base`](crate::IdempotencyLayer::problem_type_base),
/// [`rejection_with`](crate::IdempotencyLayer::rejection_with)), for the extractors'
/// rejections to be worded the same.
#[derive(Clone, Debug)]
#[cfg_attr(not(feature = "axum"), allow(dead_code))]
pub(crate) struct LayerProblems(pub(crate) Arc<Problems>);

/// Marks `extensions` with the layer's own wording of problems, if it has one (the
/// default costs the request nothing).
pub(crate) fn mark_problems(extensions: &mut http::Extensions, config: &Config) {
    if !config.problems.is_default() {
        extensions.insert(LayerProblems(config.problems.clone()));
    }
}

/// How the layer that saw the request words its problems.
#[cfg(feature = "axum")]
pub(crate) fn problems_in(extensions: &http::Extensions) -> Option<Arc<Problems>> {
    extensions.get::<LayerProblems>().map(|p| p.0.clone())
}

/// Left in a request's extensions by the layer that guards it, beside its
/// [`IdempotencyKey`], with the key it claimed and its mode: a layer of the same mode
/// inside that one lets the request through if it carries that same key, and so it does
/// a copy of the request (a retry or a mirror in between clones its extensions). A copy
/// of the key alone, or of the extensions into a request with another key (a call to an
/// inner service), is guarded; so is the request by a layer of the other mode (a
/// transactional route inside a router-wide lease-mode layer), which opens the
/// transaction its handler needs, unless the two keep their records in the same place
/// (`location`, [`Store::records_location`](crate::store::Store::records_location)):
/// the inner one would then claim the key the outer one holds, and it answers
/// `500 misconfigured` instead.
#[derive(Clone, Debug)]
pub(crate) struct Guarded {
    pub(crate) key: Arc<str>,
    pub(crate) transactional: bool,
    pub(crate) location: Option<Arc<str>>,
}

/// Left in a request's extensions by a layer that would have guarded it, had it carried
/// a key in `Idempotency-Key`: the extractors tell a client without a key from a route
/// no layer guards. (A unit: it costs the request no allocation.)
#[derive(Clone, Copy, Debug)]
pub(crate) struct Unkeyed;

/// [`Unkeyed`], from a layer that reads its key from another field, named here.
#[derive(Clone, Debug)]
#[cfg_attr(not(feature = "axum"), allow(dead_code))]
pub(crate) struct UnkeyedIn(pub(crate) http::HeaderName);

/// Marks `extensions` as those of a request a layer reading the key from `header`
/// would have guarded, had it carried one.
pub(crate) fn mark_unkeyed(extensions: &mut http::Extensions, header: &http::HeaderName) {
    if *header == crate::IDEMPOTENCY_KEY {
        extensions.insert(Unkeyed);
    } else {
        extensions.insert(UnkeyedIn(header.clone()));
    }
}

/// The field a layer looked for the key in, if one saw the request without it.
#[cfg(feature = "axum")]
pub(crate) fn unkeyed_in(extensions: &http::Extensions) -> Option<String> {
    if extensions.get::<Unkeyed>().is_some() {
        return Some(header_label(&crate::IDEMPOTENCY_KEY).to_owned());
    }
    extensions
        .get::<UnkeyedIn>()
        .map(|u| header_label(&u.0).to_owned())
}

/// The key's field as the problem documents name it: `Idempotency-Key` as the draft
/// spells it, or the name the layer was given.
pub(crate) fn header_label(header: &http::HeaderName) -> &str {
    if *header == crate::IDEMPOTENCY_KEY {
        "Idempotency-Key"
    } else {
        header.as_str()
    }
}
