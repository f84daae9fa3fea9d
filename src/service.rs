//! [`Idempotency`]: the service that claims, runs, stores and replays.

use std::{
    future::Future,
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    task::{Context, Poll},
    time::Duration,
};

use bytes::{Bytes, BytesMut};
use http::{HeaderValue, Request, Response, header};
use http_body::Body;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use pin_project_lite::pin_project;
use tower_service::Service;
use tracing::{Instrument, Span, field};

use crate::{
    IdempotencyKey, Outcome, StoredResponse,
    body::{BoxError, ResponseBody},
    catch_panic::CatchPanic,
    key::{KeyError, key_from_headers},
    layer::{Config, IDEMPOTENT_REPLAYED},
    rejection::Problem,
    renewal::Renewal,
    shutdown::InFlight,
    store::{BoxFuture, Claim, ClaimRequest, Fenced, Lease},
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

type Answer<B, E> = Result<Response<ResponseBody<B>>, E>;

pin_project! {
    /// The response future of [`Idempotency`].
    ///
    /// Dropping it before it is done (the client hung up, or a timeout outside this layer
    /// gave up) does not cancel a request whose claim may be in flight or held: the rest
    /// of it moves to a task of its own, which finishes the claim, runs the handler to
    /// the end and stores or releases its result. Dropped while it holds no claim
    /// (before its first poll, while the body is being read, while a duplicate waits
    /// for the running request), the request is simply dropped; so is a duplicate
    /// whose client went while its claim was on the way, once the claim finds the key
    /// still running: it does not wait to run the handler for nobody. Outside a Tokio
    /// runtime the work cannot move, and the key then frees when its lease lapses, as
    /// after a crash.
    pub struct ResponseFuture<F, B, E> {
        #[pin]
        kind: Kind<F, B, E>,
    }

    impl<F, B, E> PinnedDrop for ResponseFuture<F, B, E> {
        fn drop(this: Pin<&mut Self>) {
            if let KindProj::Guarded { future, detach, handoff } = this.project().kind.project()
                && let Some(future) = future.take()
                    && handoff.detach() {
                        detach(future);
                    }
        }
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<F, B, E> {
        PassThrough { #[pin] future: F },
        Answered { res: Option<Response<ResponseBody<B>>> },
        Guarded {
            // `None` once it has returned its answer.
            future: Option<BoxFuture<'static, Answer<B, E>>>,
            // Spawns an unfinished `future`; built where its bounds are known.
            detach: fn(BoxFuture<'static, Answer<B, E>>),
            // Whether the future must finish even if dropped, and whether it was.
            handoff: Arc<Handoff>,
        },
    }
}

impl<F, B, E> Future for ResponseFuture<F, B, E>
where
    F: Future<Output = Result<Response<B>, E>>,
{
    type Output = Answer<B, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().kind.project() {
            KindProj::PassThrough { future } => future.poll(cx).map_ok(|res| {
                let mut res = res.map(ResponseBody::inner);
                res.extensions_mut().insert(Outcome::PassedThrough);
                res
            }),
            KindProj::Answered { res } => match res.take() {
                Some(res) => Poll::Ready(Ok(res)),
                None => panic!("ResponseFuture polled after completion"),
            },
            KindProj::Guarded { future, .. } => {
                let Some(running) = future.as_mut() else {
                    panic!("ResponseFuture polled after completion");
                };
                let answer = std::task::ready!(running.as_mut().poll(cx));
                *future = None;
                Poll::Ready(answer)
            }
        }
    }
}

/// Shared by a guarded request's future and its [`ResponseFuture`]: whether the request
/// must finish if its client goes (a claim may be on its way to the store, or held),
/// and whether its client has gone.
#[derive(Debug, Default)]
pub(crate) struct Handoff {
    claiming: AtomicBool,
    detached: AtomicBool,
}

impl Handoff {
    /// From now on the request finishes even if its response future is dropped.
    pub(crate) fn hold(&self) {
        self.claiming.store(true, Ordering::Release);
    }

    /// From now on the request holds nothing: dropping its response future drops it.
    /// False if it was already moved to a task of its own because its client had gone:
    /// it then has nobody to answer, and stops.
    fn let_go(&self) -> bool {
        self.claiming.store(false, Ordering::Release);
        !self.detached.load(Ordering::Acquire)
    }

    /// Called as the response future is dropped: whether the rest must run in a task.
    fn detach(&self) -> bool {
        let holding = self.claiming.load(Ordering::Acquire);
        self.detached.store(holding, Ordering::Release);
        holding
    }
}

/// Hands a guarded request's unfinished work to a task of its own.
fn detach<B: Send + 'static, E: Send + 'static>(future: BoxFuture<'static, Answer<B, E>>) {
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) => drop(runtime.spawn(future)),
        Err(_) => tracing::warn!(
            "a guarded request was dropped outside a Tokio runtime before it finished; its key frees when its lease lapses"
        ),
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
        let key = match key_from_headers(req.headers(), &config.header) {
            Ok(Some(key)) => key,
            Ok(None) if !config.require_key => {
                crate::key::mark_unkeyed(req.extensions_mut(), &config.header);
                return pass_through(self.inner.call(req));
            }
            Ok(None) => {
                let detail = KeyError::Missing.naming(crate::key::header_label(&config.header));
                return answered(reject(Problem::KeyMissing, &detail));
            }
            Err(e) => {
                let detail = e.naming(crate::key::header_label(&config.header));
                return answered(reject(Problem::KeyMalformed, &detail));
            }
        };
        // So is one an outer layer guards already under this key (a copy of it too):
        // guarded again, it would find its own claim running and answer 409, which the
        // outer layer would store. An outer layer of the other mode over the same
        // records is the app's wiring gone wrong: claimed again here, the key would wait
        // on the outer claim's row, or find it running.
        let transactional = config.is_transactional();
        if let Some(outer) = req.extensions().get::<crate::key::Guarded>()
            && *outer.key == *key
        {
            if outer.transactional == transactional {
                return pass_through(self.inner.call(req));
            }
            if outer.location.is_some() && outer.location == config.store.records_location() {
                return answered(nested_on_one_table());
            }
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
            outcome = field::Empty,
        );
        if span.is_disabled() {
            // Nobody records it: no hashing either.
        } else if config.hash_keys_in_traces {
            span.record("key", short_hash(key.as_bytes()).as_str());
        } else {
            span.record("key", key.as_str());
        }
        let config = config.clone();
        let handoff = Arc::new(Handoff::default());
        let started = handoff.clone();
        let future = async move {
            // Whatever panics before the claim (a scope or fingerprint function, a
            // store) or in transactional mode (where dropping the transaction rolls it
            // back) answers 500 too, and leaves nothing behind to be resumed.
            let res = match CatchPanic::new(guarded(config, inner, req, key, &started)).await {
                Ok(res) => res,
                Err(panic) => {
                    tracing::error!(
                        panic = crate::catch_panic::message(&panic),
                        "the request panicked"
                    );
                    Ok(handler_failed())
                }
            };
            if let Ok(res) = &res
                && let Some(outcome) = res.extensions().get::<Outcome>()
            {
                Span::current().record("outcome", outcome.as_str());
            }
            res
        };
        ResponseFuture {
            kind: Kind::Guarded {
                future: Some(Box::pin(future.instrument(span))),
                detach: detach::<ResBody, S::Error>,
                handoff,
            },
        }
    }
}

fn pass_through<F, B, E>(future: F) -> ResponseFuture<F, B, E> {
    ResponseFuture {
        kind: Kind::PassThrough { future },
    }
}

fn answered<F, B, E>(res: Response<ResponseBody<B>>) -> ResponseFuture<F, B, E> {
    ResponseFuture {
        kind: Kind::Answered { res: Some(res) },
    }
}

/// The first 16 hex digits of the SHA-256 of `bytes`: enough to correlate, not to recover.
pub(crate) fn short_hash(bytes: &[u8]) -> ShortHash {
    use sha2::Digest;
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let digest = sha2::Sha256::digest(bytes);
    let mut hex = [0u8; 16];
    for (i, b) in digest[..8].iter().enumerate() {
        hex[2 * i] = DIGITS[usize::from(b >> 4)];
        hex[2 * i + 1] = DIGITS[usize::from(b & 0xf)];
    }
    ShortHash(hex)
}

/// [`short_hash`]'s 16 hex digits, on the stack: recorded in every request's span, they
/// cost no allocation.
#[derive(Clone, Copy)]
pub(crate) struct ShortHash([u8; 16]);

impl ShortHash {
    pub(crate) fn as_str(&self) -> &str {
        // Hex digits only: always UTF-8.
        std::str::from_utf8(&self.0).unwrap_or_default()
    }
}

impl std::fmt::Display for ShortHash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A rejection before anything was claimed.
fn reject<B>(problem: Problem, detail: &str) -> Response<ResponseBody<B>> {
    with_outcome(
        problem.response(detail).map(ResponseBody::full),
        Outcome::Rejected,
    )
}

/// `500 misconfigured`: two layers of different modes guard the request over the same
/// records. Marked [`NoStore`](crate::NoStore): the outer layer releases (or rolls back)
/// its claim, whatever its policy.
fn nested_on_one_table<B>() -> Response<ResponseBody<B>> {
    tracing::error!(
        "two idempotency layers of different modes (lease and transactional) guard this request over the same table; the inner one would claim the key the outer one holds. Give them different tables, or keep one of them on the route (in axum, a route_layer applies to every route added before it)"
    );
    let mut res = reject(
        Problem::Misconfigured,
        "this request is guarded by two idempotency layers of different modes over the same table; the server's configuration must change, nothing was processed",
    );
    res.extensions_mut().insert(crate::NoStore);
    res
}

pub(crate) fn with_outcome<B>(mut res: Response<B>, outcome: Outcome) -> Response<B> {
    res.extensions_mut().insert(outcome);
    res
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
    let limit = config.request_body_limit;
    let (mut parts, body) = req.into_parts();
    let declared = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|len| len > limit as u64) {
        return Ok(too_large(limit));
    }
    // Bounded in size and in time: a body that never ends, or trickles in, is cut off
    // before anything is claimed.
    let read = tokio::time::timeout(
        config.request_body_timeout,
        Limited::new(body, limit).collect(),
    );
    let body = match read.await {
        Ok(Ok(collected)) => collected.to_bytes(),
        Ok(Err(e)) if e.downcast_ref::<LengthLimitError>().is_some() => {
            return Ok(too_large(limit));
        }
        // A limit set in front of the layer (a `Limited` body, wrapped on its way).
        Ok(Err(e)) if over_a_limit(&*e) => {
            return Ok(reject(
                Problem::BodyTooLarge,
                &format!("the request body is over a size limit: {e}"),
            ));
        }
        Ok(Err(e)) => {
            return Ok(reject(
                Problem::BodyUnreadable,
                &format!("the request body could not be read: {e}"),
            ));
        }
        Err(_) => {
            return Ok(reject(
                Problem::BodyTimeout,
                &format!(
                    "the request body did not arrive within {} ms; nothing was processed",
                    config.request_body_timeout.as_millis()
                ),
            ));
        }
    };

    let Some(in_flight) = config.shutdown.enter() else {
        return Ok(shutting_down());
    };
    let scope = (config.scope)(&parts);
    // A tenant or user id may be personal data: traces carry its hash, computed only
    // when someone records the span.
    let span = Span::current();
    if !span.is_disabled() {
        span.record("scope", short_hash(scope.as_str().as_bytes()).as_str());
    }
    let fingerprint = config.fingerprinter.compute(&parts, &body);
    let claim_request = ClaimRequest {
        scope: &scope,
        key: &key,
        fingerprint,
        lease: config.lease,
        ttl: config.ttl,
    };
    #[cfg(feature = "postgres")]
    if let Some(store) = &config.transactional {
        let store = store.clone();
        // Boxed: its large state machine would otherwise be embedded in this one, making
        // every request's future as large, and as costly to move.
        return Box::pin(crate::transactional::guarded(
            config,
            store,
            inner,
            parts,
            body,
            claim_request,
            in_flight,
            handoff,
        ))
        .await;
    }
    let lease = match claim(&config, &claim_request, handoff, &in_flight).await {
        Ok(lease) => lease,
        Err(answer) => return Ok(answer),
    };

    let key = Arc::<str>::from(key);
    parts
        .extensions
        .insert(IdempotencyKey::new(scope, key.clone()));
    parts.extensions.insert(crate::key::Guarded {
        key,
        transactional: false,
        location: config.store.records_location(),
    });
    let req = Request::from_parts(parts, ReqBody::from(body));
    // Runs here, in the connection's task, like the app's own handlers; a client that
    // hangs up does not cancel it: `ResponseFuture` then moves it to a task of its own.
    // A panic (the handler's, the storage policy's, a store's) releases the key; the
    // request counts as in flight for a graceful shutdown until it has.
    let (held, counted) = (lease.clone(), in_flight.clone());
    // Boxed, like the transactional path: embedded, the handler's future and the
    // storing would double the size of every request's future, replays and rejections
    // included, and every move of it (3.6 KB against 1.8 KB with axum's handlers).
    let executing = Box::pin(execute(config.clone(), inner, req, lease, in_flight));
    match CatchPanic::new(executing).await {
        Ok(answer) => answer,
        Err(panic) => {
            tracing::error!(
                panic = crate::catch_panic::message(&panic),
                "the request panicked; releasing the key"
            );
            release(&config, &held, counted).await;
            Ok(handler_failed())
        }
    }
}

/// The record of a response to store: its status, its storable headers, its body.
pub(crate) fn to_store(
    config: &Config,
    parts: &http::response::Parts,
    body: &Bytes,
) -> StoredResponse {
    StoredResponse {
        status: parts.status,
        headers: StoredResponse::storable_headers(&parts.headers, &config.unreplayed_headers),
        body: body.clone(),
    }
}

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
    let (p, body) = Problem::ResponseNotStored.response(&detail).into_parts();
    StoredResponse {
        status: p.status,
        headers: p.headers,
        body,
    }
}

/// How long past a running key's lease a waiting duplicate looks again, so that it does
/// not find the key a moment before the lease lapses and claim in a loop.
const LAPSE_MARGIN: Duration = Duration::from_millis(10);

/// How often a waiting duplicate whose registration failed looks again, as it does
/// while the store has no notification connection.
const UNREGISTERED_RECHECK: Duration = Duration::from_millis(250);

/// Claims the key in lease mode, waiting (up to `wait_for_running`) for a running
/// holder to finish. `Err` is the answer when the key is not ours to run.
///
/// The request holds on (`Handoff::hold`) while a claim may be on its way to the store:
/// it then finishes even if its client goes, so that no claim is left behind with
/// nobody to run or release it. It lets go before it waits, holding nothing; a request
/// whose client went while its claim was on the way stops there instead of waiting to
/// run the handler for nobody.
async fn claim<B>(
    config: &Config,
    request: &ClaimRequest<'_>,
    handoff: &Handoff,
    in_flight: &InFlight,
) -> Result<Lease, Response<ResponseBody<B>>> {
    let wait_until = (!config.wait.is_zero()).then(|| tokio::time::Instant::now() + config.wait);
    loop {
        // After `close()` nothing new is claimed, not even by a request that was waiting
        // when it came.
        if config.shutdown.is_closed() {
            return Err(shutting_down());
        }
        // Subscribed before the claim, so a completion in between is not missed.
        let changed = wait_until.map(|_| config.store.changed(request.scope, request.key));
        handoff.hold();
        let claim = crate::store::claim_within(
            &config.store,
            config.store_timeout,
            request,
            in_flight.clone(),
        )
        .await;
        match claim {
            Ok(Ok(Claim::Running {
                fingerprint,
                retry_after,
            })) if fingerprint == request.fingerprint
                && wait_until.is_some_and(|until| tokio::time::Instant::now() < until) =>
            {
                // Registering and waiting hold nothing: a client that goes now takes the
                // request along, and one that has gone already is not waited for.
                if !handoff.let_go() {
                    return Err(in_progress(retry_after, config.in_progress_retry_after));
                }
                let registered = tokio::time::timeout(
                    config.store_timeout,
                    config.store.register_waiter(request.scope, request.key),
                )
                .await;
                // Finished between the claim and the registration: look again.
                if matches!(registered, Ok(Ok(false))) {
                    continue;
                }
                // Not registered (the store failed or was slow): the completion may
                // notify nobody, so look again soon on our own.
                let unregistered = !matches!(registered, Ok(Ok(true)));
                // Until the key changes, or its lease lapses: a holder that crashed
                // sends no notification, and its key is ours to take over then.
                // A `close()` ends the wait too: the next turn answers 503.
                if let (Some(until), Some(changed)) = (wait_until, changed) {
                    let now = tokio::time::Instant::now();
                    let mut wake = until.min(now + retry_after + LAPSE_MARGIN);
                    if unregistered {
                        wake = wake.min(now + UNREGISTERED_RECHECK);
                    }
                    let woken = async {
                        tokio::select! {
                            () = changed => {}
                            () = config.shutdown.closed() => {}
                        }
                    };
                    let _ = tokio::time::timeout_at(wake, woken).await;
                }
                continue;
            }
            Ok(Ok(claim)) => {
                return settle(claim, request.fingerprint, config.in_progress_retry_after);
            }
            Ok(Err(e)) => {
                tracing::error!(error = %e, "claim failed; the handler was not run");
                return Err(unavailable());
            }
            Err(_) => {
                tracing::error!(timeout = ?config.store_timeout, "claim timed out; the handler was not run");
                return Err(unavailable());
            }
        }
    }
}

/// The lease when the claim is ours to run; otherwise the answer: 422 for another
/// request's key, the replay, or 409 while it runs, telling the client to retry after
/// `retry_hint`, or sooner if the running request's lease lapses sooner. Both modes
/// answer through here.
// The `Err` is the response itself, returned to the client at once, not an error to box.
#[allow(clippy::result_large_err)]
pub(crate) fn settle<B>(
    claim: Claim,
    fingerprint: crate::Fingerprint,
    retry_hint: Duration,
) -> Result<Lease, Response<ResponseBody<B>>> {
    match claim {
        Claim::Acquired(lease) => Ok(lease),
        Claim::Completed { fingerprint: f, .. } | Claim::Running { fingerprint: f, .. }
            if f != fingerprint =>
        {
            Err(mismatch())
        }
        Claim::Completed { response, .. } => Err(replay(response)),
        Claim::Running { retry_after, .. } => Err(in_progress(retry_after, retry_hint)),
    }
}

/// `409 in-progress`, telling the client to look again after `hint`, or sooner if the
/// running request's lease, `lease_left`, lapses sooner.
pub(crate) fn in_progress<B>(lease_left: Duration, hint: Duration) -> Response<ResponseBody<B>> {
    let res = Problem::InProgress.response_retry_after(
        "a request with this Idempotency-Key is still being processed; retry after the time given",
        lease_left.min(hint),
    );
    with_outcome(res.map(ResponseBody::full), Outcome::Conflict)
}

/// Whether `e`, or an error it wraps, is a body over a size limit.
fn over_a_limit(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cause = Some(e);
    while let Some(e) = cause {
        if e.is::<LengthLimitError>() {
            return true;
        }
        cause = e.source();
    }
    false
}

fn too_large<B>(limit: usize) -> Response<ResponseBody<B>> {
    reject(
        Problem::BodyTooLarge,
        &format!("the request body is over the limit of {limit} bytes"),
    )
}

pub(crate) fn mismatch<B>() -> Response<ResponseBody<B>> {
    let res = Problem::KeyReused.response(
        "this Idempotency-Key was already used with a different request (method, path, query, headers or body)",
    );
    with_outcome(res.map(ResponseBody::full), Outcome::Mismatch)
}

pub(crate) fn unavailable<B>() -> Response<ResponseBody<B>> {
    let res = Problem::StoreUnavailable.response_retry_after(
        "the idempotency store could not be reached; the request was not processed",
        Duration::from_secs(1),
    );
    with_outcome(res.map(ResponseBody::full), Outcome::StoreError)
}

pub(crate) fn shutting_down<B>() -> Response<ResponseBody<B>> {
    let res = Problem::ShuttingDown.response_retry_after(
        "this server is shutting down and takes no new requests; retry, another instance will serve it",
        Duration::from_secs(1),
    );
    with_outcome(res.map(ResponseBody::full), Outcome::Rejected)
}

pub(crate) fn handler_failed<B>() -> Response<ResponseBody<B>> {
    let res = Problem::HandlerFailed.response(
        "the request failed while being processed; nothing is held under its Idempotency-Key, so it may be retried",
    );
    with_outcome(res.map(ResponseBody::full), Outcome::Executed)
}

pub(crate) fn replay<B>(stored: StoredResponse) -> Response<ResponseBody<B>> {
    let mut res = Response::new(ResponseBody::full(stored.body));
    *res.status_mut() = stored.status;
    *res.headers_mut() = stored.headers;
    res.headers_mut()
        .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    with_outcome(res, Outcome::Replayed)
}

/// What the inner service produced, read up to the storage limit and the body deadline.
pub(crate) enum Produced<B, E> {
    Buffered(http::response::Parts, Bytes),
    /// The head, the body read so far, and the rest of it.
    Unbuffered(http::response::Parts, Bytes, Pin<Box<B>>, Unbuffered),
    /// The head, and what the body failed with.
    BodyFailed(http::response::Parts, BoxError),
    ServiceFailed(E),
}

pub(crate) async fn run_inner<S, ReqBody, ResBody>(
    mut inner: S,
    req: Request<ReqBody>,
    config: &Config,
) -> Produced<ResBody, S::Error>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    ResBody: Body<Data = Bytes>,
    ResBody::Error: Into<BoxError>,
{
    // Ready only now that the key is ours (see `call`); in transactional mode, ready
    // already, since before the transaction opened, and this returns at once.
    if let Err(e) = std::future::poll_fn(|cx| inner.poll_ready(cx)).await {
        return Produced::ServiceFailed(e);
    }
    let res = match inner.call(req).await {
        Ok(res) => res,
        Err(e) => return Produced::ServiceFailed(e),
    };
    let (parts, body) = res.into_parts();
    let mut body = Box::pin(body);
    let mut chunks: Vec<Bytes> = Vec::new();
    let mut len = 0;
    let limit = config.response_body_limit;
    let ends_by = tokio::time::Instant::now() + config.response_body_timeout;
    // A timer only for a body that has to wait: most bodies are ready at once.
    let mut deadline: Option<Pin<Box<tokio::time::Sleep>>> = None;
    loop {
        let next = std::future::poll_fn(|cx| {
            if let Poll::Ready(frame) = body.as_mut().poll_frame(cx) {
                return Poll::Ready(Some(frame));
            }
            let timer = deadline.get_or_insert_with(|| Box::pin(tokio::time::sleep_until(ends_by)));
            timer.as_mut().poll(cx).map(|()| None)
        });
        let frame = match next.await {
            Some(Some(Ok(frame))) => frame,
            Some(Some(Err(e))) => return Produced::BodyFailed(parts, e.into()),
            Some(None) => break,
            None => {
                let read = concat(chunks, len);
                return Produced::Unbuffered(parts, read, body, Unbuffered::TooSlow);
            }
        };
        // Trailers are not stored.
        let Ok(data) = frame.into_data() else {
            continue;
        };
        len += data.len();
        chunks.push(data);
        if len > limit {
            return Produced::Unbuffered(parts, concat(chunks, len), body, Unbuffered::TooLarge);
        }
    }
    // Trailers are not passed on with a buffered response either: it must not announce
    // them (RFC 9110 section 6.6.2).
    let mut parts = parts;
    parts.headers.remove(http::header::TRAILER);
    Produced::Buffered(parts, concat(chunks, len))
}

fn concat(mut chunks: Vec<Bytes>, len: usize) -> Bytes {
    if chunks.len() == 1 {
        return chunks.pop().unwrap_or_default();
    }
    let mut buf = BytesMut::with_capacity(len);
    for c in chunks {
        buf.extend_from_slice(&c);
    }
    buf.freeze()
}

/// Runs the handler under `lease`, renewing it, then stores or releases.
async fn execute<S, ReqBody, ResBody>(
    config: Arc<Config>,
    inner: S,
    req: Request<ReqBody>,
    lease: Lease,
    in_flight: InFlight,
) -> Answer<ResBody, S::Error>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: Send + 'static,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    // The handler is polled inline, not spawned: no second task to hand the result
    // over. Its lease is renewed in a task of its own, so that a handler that blocks
    // its thread keeps it too, through the first attempt to store its result.
    let mut renewal = Renewal::start(&config.store, &lease, config.lease);
    let produced = renewal.watch(run_inner(inner, req, &config)).await;
    match produced {
        Produced::ServiceFailed(e) => {
            drop(renewal);
            release(&config, &lease, in_flight).await;
            Err(e)
        }
        Produced::BodyFailed(parts, e) => {
            // The handler ran to its answer: a head the policy keeps may stand for effects
            // (a charge), so the key is not freed for them to happen again. The client and
            // every retry get the same problem.
            if crate::policy::is_stored(&config.policy, &parts) {
                tracing::error!(
                    error = %e,
                    status = parts.status.as_u16(),
                    "the response body failed; retries will get response-not-stored"
                );
                let stored = not_stored_problem(&config, Unbuffered::Failed);
                let answer = stored.clone();
                store_result(&config, &lease, stored, in_flight, renewal).await;
                let mut res = Response::new(ResponseBody::full(answer.body));
                *res.status_mut() = answer.status;
                *res.headers_mut() = answer.headers;
                Ok(with_outcome(res, Outcome::Executed))
            } else {
                tracing::error!(error = %e, "the response body failed; releasing the key");
                drop(renewal);
                release(&config, &lease, in_flight).await;
                Ok(handler_failed())
            }
        }
        Produced::Buffered(parts, body) => {
            if crate::policy::is_stored(&config.policy, &parts) {
                let stored = to_store(&config, &parts, &body);
                store_result(&config, &lease, stored, in_flight, renewal).await;
            } else {
                drop(renewal);
                release(&config, &lease, in_flight).await;
            }
            let mut res = Response::from_parts(parts, ResponseBody::full(body));
            res.headers_mut().remove(header::CONTENT_LENGTH);
            Ok(with_outcome(res, Outcome::Executed))
        }
        Produced::Unbuffered(parts, prefix, rest, why) => {
            if crate::policy::is_stored(&config.policy, &parts) {
                tracing::warn!(
                    ?why,
                    "the response could not be read whole; retries will get response-not-stored"
                );
                let stored = not_stored_problem(&config, why);
                store_result(&config, &lease, stored, in_flight, renewal).await;
            } else {
                // Not to be stored in any size: the key is free for a retry.
                drop(renewal);
                release(&config, &lease, in_flight).await;
            }
            let res = Response::from_parts(parts, ResponseBody::prefixed(prefix, rest));
            Ok(with_outcome(res, Outcome::Executed))
        }
    }
}

/// What storing a result needs: the store, and the lease, timeout and TTL to store it
/// with (the layer's, or a `JobRunner`'s).
#[derive(Clone)]
pub(crate) struct Storing {
    pub(crate) store: Arc<dyn crate::store::Store>,
    pub(crate) lease: Duration,
    pub(crate) store_timeout: Duration,
    pub(crate) ttl: Duration,
}

impl Storing {
    fn of(config: &Config) -> Self {
        Self {
            store: config.store.clone(),
            lease: config.lease,
            store_timeout: config.store_timeout,
            ttl: config.ttl,
        }
    }
}

async fn store_result(
    config: &Arc<Config>,
    lease: &Lease,
    stored: StoredResponse,
    in_flight: InFlight,
    renewal: Renewal,
) {
    Storing::of(config)
        .store(lease, stored, in_flight, renewal)
        .await;
}

impl Storing {
    /// Stores the result. The first attempt is made before answering, with the lease
    /// still renewed by `renewal`, the one that renewed it while the handler ran; if it
    /// fails or outlasts the store timeout, the caller gets its answer then, and the
    /// attempts go on in the background, with backoff, for one more lease, holding
    /// `keep` meanwhile: completion is token-checked, so a late attempt can never
    /// overwrite a successor's result.
    ///
    /// `Fenced` when the first attempt found the lease taken over: another run holds
    /// the key, and this result is not stored.
    pub(crate) async fn store(
        &self,
        lease: &Lease,
        stored: StoredResponse,
        keep: impl Send + 'static,
        mut renewal: Renewal,
    ) -> Completed {
        // A slow store must not let the lease lapse under a result about to be stored:
        // a retry would take the key over and run the handler again.
        renewal.storing();
        let first = renewal.watch(self.try_complete(lease, &stored, 1)).await;
        // The attempts in the background renew the lease themselves, one at a time.
        drop(renewal);
        match first {
            Attempt::Stored => return Completed::Stored,
            Attempt::Fenced => return Completed::Fenced,
            Attempt::Failed => {}
        }
        let (this, lease) = (self.clone(), lease.clone());
        tokio::spawn(
            async move {
                let _keep = keep;
                let deadline = tokio::time::Instant::now() + this.lease;
                let mut backoff = Duration::from_millis(50);
                let mut attempt = 2;
                while tokio::time::Instant::now() < deadline {
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(1));
                    // Hold on to the key while trying: a lapsed lease would let a retry
                    // run the handler again although it succeeded. Lost means fenced: stop.
                    let renewed = tokio::time::timeout(
                        this.store_timeout,
                        this.store.renew(&lease, this.lease),
                    )
                    .await;
                    if matches!(renewed, Ok(Ok(Fenced::LeaseLost))) {
                        tracing::warn!(
                            token = %lease.token,
                            "the lease was taken over while storing the result"
                        );
                        return;
                    }
                    if this.try_complete(&lease, &stored, attempt).await != Attempt::Failed {
                        return;
                    }
                    attempt += 1;
                }
                tracing::error!(
                    token = %lease.token,
                    "the result could not be stored; the key stays claimed until its lease lapses, then a retry runs again"
                );
            }
            .in_current_span(),
        );
        Completed::Pending
    }

    /// One completion attempt.
    async fn try_complete(&self, lease: &Lease, stored: &StoredResponse, attempt: u32) -> Attempt {
        match tokio::time::timeout(
            self.store_timeout,
            self.store.complete(lease, stored, self.ttl),
        )
        .await
        {
            Ok(Ok(Fenced::Kept)) => Attempt::Stored,
            Ok(Ok(Fenced::LeaseLost)) => {
                tracing::warn!(
                    token = %lease.token,
                    "the lease was taken over by another run; this result went to its own caller and was not stored"
                );
                Attempt::Fenced
            }
            Ok(Err(e)) => {
                tracing::warn!(token = %lease.token, attempt, error = %e, "storing the result failed");
                Attempt::Failed
            }
            Err(_) => {
                tracing::warn!(token = %lease.token, attempt, "storing the result timed out");
                Attempt::Failed
            }
        }
    }
}

/// What one attempt to store a result did.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Attempt {
    Stored,
    /// The lease was taken over: nothing to store, ever.
    Fenced,
    /// The store failed or was slow: worth another attempt.
    Failed,
}

/// What became of a result given to [`Storing::store`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Completed {
    Stored,
    /// The lease had been taken over: another run holds the key; this result is not
    /// stored.
    Fenced,
    /// Still being stored, in the background.
    Pending,
}

/// Releases the key (see [`Releasing`](crate::release::Releasing)), counted in flight
/// (`keep`) until it is released or given up on.
async fn release(config: &Config, lease: &Lease, keep: InFlight) {
    let releasing = crate::release::Releasing {
        store: config.store.clone(),
        store_timeout: config.store_timeout,
        lease: config.lease,
    };
    releasing.release(lease, keep).await;
}
