//! [`Idempotency`]: the service that claims, runs, stores and replays.

use std::{
    sync::Arc,
    task::{Context, Poll},
};

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use tower_service::Service;
use tracing::{Instrument, Span, field};

use crate::{
    Outcome,
    answers::{handler_failed, nested_on_one_table, no_principal, reject, shutting_down},
    body::{BoxError, ResponseBody},
    catch_panic::catch_panic,
    future::{Answer, Handoff, ResponseFuture, answered, detach, pass_through},
    layer::Config,
    observe::{Mode, Seen},
    rejection::Problem,
    request::{
        key::{KeyError, key_from_headers},
        short_hash,
    },
    store::ClaimRequest,
};

/// The middleware built by [`IdempotencyLayer`](crate::IdempotencyLayer).
///
/// The inner service must accept a request body built from bytes (`ReqBody: From<Bytes>`),
/// as `axum::body::Body` and `http_body_util::Full<Bytes>` are: a guarded request's body
/// is read (to fingerprint it) and handed on rebuilt. With hyper's `Incoming`, map the
/// body first (e.g. `axum::body::Body::new`).
///
/// A guarded request lets go of what the inner service's readiness reserved (a
/// `ConcurrencyLimit` permit, a `Buffer` slot) and asks a clone for readiness again
/// later: in lease mode once its key is claimed, just before the handler runs, so that
/// requests that read their body, wait for a running duplicate or replay hold no
/// capacity of the service inside; in transactional mode just before its transaction
/// opens, so that waiting for readiness holds no connection (a duplicate then holds the
/// capacity while it waits on the first request's row, and a replay needs it too).
#[derive(Clone)]
pub struct Idempotency<S> {
    pub(crate) inner: S,
    pub(crate) config: Arc<Config>,
}

impl<S> std::fmt::Debug for Idempotency<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Idempotency").finish_non_exhaustive()
    }
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for Idempotency<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: Body + From<Bytes> + Send + 'static,
    ReqBody::Data: Send,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future, ResBody, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        let config = &self.config;
        // A request passed through calls the ready instance where it is: no clone.
        if !config.methods.contains(req.method()) {
            return pass_through(self.inner.call(req));
        }
        let mut req = req;
        let transactional = config.is_transactional();
        let mode = Mode::of(transactional);
        let key = match key_from_headers(req.headers(), &config.header) {
            Ok(Some(key)) => key,
            Ok(None) if !config.require_key => {
                crate::observe::count_request(Outcome::PassedThrough, mode, &req, None);
                crate::request::mark_unkeyed(req.extensions_mut(), &config.header);
                crate::request::mark_problems(req.extensions_mut(), config);
                return pass_through(self.inner.call(req));
            }
            Ok(None) => {
                let detail = KeyError::Missing.naming(crate::request::header_label(&config.header));
                Seen::of(&req, mode).refused(Problem::KeyMissing, &detail);
                return answered(reject(&config.problems, Problem::KeyMissing, &detail));
            }
            Err(e) => {
                let detail = e.naming(crate::request::header_label(&config.header));
                Seen::of(&req, mode).refused(Problem::KeyMalformed, &detail);
                return answered(reject(&config.problems, Problem::KeyMalformed, &detail));
            }
        };
        // So is one an outer layer guards already under this key (a copy of it too):
        // guarded again, it would find its own claim running and answer 409, which the
        // outer layer would store. An outer layer of the other mode over the same
        // records is the app's wiring gone wrong: claimed again here, the key would wait
        // on the outer claim's row, or find it running.
        if let Some(outer) = req.extensions().get::<crate::request::Guarded>()
            && *outer.key == *key
        {
            if outer.transactional == transactional {
                crate::observe::count_request(Outcome::PassedThrough, mode, &req, None);
                return pass_through(self.inner.call(req));
            }
            if outer.location.is_some() && outer.location == config.store.records_location() {
                // Logged at `error` as it is answered.
                let res = nested_on_one_table(&config.problems);
                crate::observe::count_request(Outcome::Rejected, mode, &req, Some(res.status()));
                return answered(res);
            }
        }
        // A request that must come with a principal and came without one: the
        // authentication is not in front of this layer (or lets this route through).
        if config.scoping.lacks_principal(req.extensions()) {
            // Logged at `error` as it is answered.
            let (parts, body) = req.into_parts();
            let res = no_principal(&config.problems, &parts);
            let req = Request::from_parts(parts, body);
            crate::observe::count_request(Outcome::Rejected, mode, &req, Some(res.status()));
            return answered(res);
        }
        // A guarded request's future owns an instance of its own (it may finish in a task
        // of its own), and a fresh clone stays for the next call. The ready one is let
        // go, and readiness asked for again later (see `Idempotency`): in `run_inner`,
        // or in transactional mode before the transaction opens.
        let inner = self.inner.clone();
        self.inner = inner.clone();
        let span = tracing::info_span!(
            "idempotency",
            key = field::Empty,
            scope = field::Empty,
            idempotency.outcome = field::Empty,
        );
        if span.is_disabled() {
            // Nobody records it: no hashing either.
        } else if config.hash_keys_in_traces {
            span.record("key", short_hash(key.as_bytes()).as_str());
        } else {
            span.record("key", key.as_str());
        }
        let seen = Seen::of(&req, mode);
        let config = config.clone();
        let problems = config.problems.clone();
        let handoff = Arc::new(Handoff::default());
        let started = handoff.clone();
        let future = async move {
            // Whatever panics before the claim (a scope or fingerprint function, a
            // store) or in transactional mode (where dropping the transaction rolls it
            // back) answers 500 too, and leaves nothing behind to be resumed.
            let res = match catch_panic(guarded(config, inner, req, key, &started)).await {
                Ok(res) => res,
                Err(panic) => {
                    tracing::error!(
                        panic = crate::catch_panic::message(&panic),
                        "the request panicked"
                    );
                    Ok(handler_failed(&problems))
                }
            };
            // The event first: recorded in the span before it, the outcome would be
            // printed twice on its line.
            let outcome = res
                .as_ref()
                .ok()
                .and_then(|r| r.extensions().get::<Outcome>());
            seen.answered(outcome.copied(), res.as_ref().ok().map(|r| r.status()));
            if let Some(outcome) = outcome {
                Span::current().record("idempotency.outcome", outcome.as_str());
            }
            res
        };
        ResponseFuture::guarded(
            Box::pin(future.instrument(span)),
            detach::<ResBody, S::Error>,
            handoff,
        )
    }
}

async fn guarded<S, ReqBody, ResBody>(
    config: Arc<Config>,
    inner: S,
    req: Request<ReqBody>,
    key: String,
    handoff: &Handoff,
) -> Answer<ResBody, S::Error>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: Body + From<Bytes> + Send + 'static,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let (parts, body) = req.into_parts();
    let body = match crate::request::read_body(&config, &parts.headers, body).await {
        Ok(body) => body,
        Err(refused) => return Ok(refused),
    };

    let Some(in_flight) = config.shutdown.enter() else {
        return Ok(shutting_down(&config.problems));
    };
    let scope = config.scoping.scope_of(&parts);
    // A tenant or user id may be personal data: traces carry its hash, computed only
    // when someone records the span.
    let span = Span::current();
    if !span.is_disabled() {
        span.record("scope", short_hash(scope.as_str().as_bytes()).as_str());
    }
    let fingerprint = config.fingerprinter.compute(&parts, &body);
    // Hashed once the layer has encryption keys: the store never sees the key itself.
    let stored_key = config.sealing.stored_key(&key);
    let claim_request = ClaimRequest {
        scope: &scope,
        key: &stored_key,
        fingerprint,
        lease: config.lease,
        ttl: config.ttl,
    };
    #[cfg(feature = "postgres")]
    if let Some(store) = &config.transactional {
        let store = store.clone();
        // Boxed: its large state machine would otherwise be embedded in this one, making
        // every request's future as large, and as costly to move.
        return Box::pin(crate::run::transactional::serve(
            config,
            store,
            inner,
            parts,
            body,
            claim_request,
            &key,
            in_flight,
            handoff,
        ))
        .await;
    }
    // Boxed: its large state machine would otherwise be embedded in this one, making
    // every request's future as large, and as costly to move.
    Box::pin(crate::run::lease::serve(
        config,
        inner,
        parts,
        body,
        claim_request,
        &key,
        in_flight,
        handoff,
    ))
    .await
}
