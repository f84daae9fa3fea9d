//! Lease mode: the key claimed (and, if told to, waited for while another request
//! runs it), the handler run under a lease renewed meanwhile, its response stored, or
//! its key released.

use std::{sync::Arc, time::Duration};

use bytes::Bytes;
use http::{Request, Response, header};
use http_body::Body;
use tower_service::Service;

use super::{
    decision::opened_or_answer,
    handler::{Produced, run_inner},
    renewal::Renewal,
};
use crate::{
    Outcome,
    answers::{
        Unbuffered, handler_failed, in_progress, not_stored_problem, shutting_down, to_store,
        unavailable, with_outcome,
    },
    body::{BoxError, ResponseBody},
    catch_panic::catch_panic,
    future::{Answer, Handoff},
    layer::Config,
    shutdown::InFlight,
    store::{Claim, ClaimRequest, Lease},
};

/// The guarded path of a request in lease mode, once its body is read and its claim
/// request made: claims the key (waiting for a running holder if told to), runs the
/// handler under its lease, and stores or releases its result.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn serve<S, ReqBody, ResBody>(
    config: Arc<Config>,
    inner: S,
    mut parts: http::request::Parts,
    body: Bytes,
    request: ClaimRequest<'_>,
    key: &str,
    in_flight: InFlight,
    handoff: &Handoff,
) -> Answer<ResBody, S::Error>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: From<Bytes> + Send + 'static,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let lease = match claim(&config, &request, key, handoff, &in_flight).await {
        Ok(lease) => lease,
        Err(answer) => return Ok(answer),
    };
    // Taken new under this scope and key; the layer's earlier settings (the scope it
    // used before a deploy, the key in clear before encryption) may have stored it.
    let earlier =
        super::previous::answer_in_lease(&config, &parts, &request, key, &lease, &in_flight);
    if let Some(answer) = earlier.await {
        return Ok(answer);
    }

    // A resumable layer's request is kept for a completer, should this process die.
    super::completer::record(&config, &lease, &parts, &body, key).await;
    crate::request::hand_over(&mut parts.extensions, &request, key, &config, false);
    super::steps::attach(&mut parts.extensions, &config.leased(), &lease);
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
    match catch_panic(executing).await {
        Ok(answer) => answer,
        Err(panic) => {
            tracing::error!(
                panic = crate::catch_panic::message(&panic),
                "the request panicked; releasing the key"
            );
            config.leased().release(&held, counted).await;
            Ok(handler_failed(&config.problems))
        }
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
    key: &str,
    handoff: &Handoff,
    in_flight: &InFlight,
) -> Result<Lease, Response<ResponseBody<B>>> {
    // Claims with the fingerprint a running record was made with, when it is this
    // request's computed another way (a record from before an upgrade of the scheme):
    // its lapsed lease is then taken over, its run waited for, as the record's own.
    // What a claim finds is still compared with the request's own fingerprint, which
    // knows each way.
    let mut claiming = request.clone();
    let wait_until = (!config.wait.is_zero()).then(|| tokio::time::Instant::now() + config.wait);
    // Counted once it first waits, and among those waiting until it returns (or is
    // dropped).
    let mut waiting = None;
    loop {
        // After `close()` nothing new is claimed, not even by a request that was waiting
        // when it came.
        if config.shutdown.is_closed() {
            return Err(shutting_down(&config.problems));
        }
        // Subscribed before the claim, so a completion in between is not missed.
        let changed = wait_until.map(|_| config.store.changed(request.scope, request.key));
        handoff.hold();
        let claim = crate::store::claim_within(
            &config.store,
            config.store_timeout,
            &claiming,
            in_flight.clone(),
        )
        .await;
        match claim {
            Ok(Ok(Claim::Running { fingerprint, .. }))
                if fingerprint != claiming.fingerprint
                    && request.fingerprint.matches(&fingerprint) =>
            {
                claiming.fingerprint = request.fingerprint.as_recorded(&fingerprint);
                continue;
            }
            Ok(Ok(Claim::Running {
                fingerprint,
                retry_after,
            })) if fingerprint == claiming.fingerprint
                && wait_until.is_some_and(|until| tokio::time::Instant::now() < until) =>
            {
                // Registering and waiting hold nothing: a client that goes now takes the
                // request along, and one that has gone already is not waited for.
                if !handoff.let_go() {
                    return Err(in_progress(
                        &config.problems,
                        retry_after,
                        config.in_progress_retry_after,
                    ));
                }
                waiting.get_or_insert_with(crate::observe::waiting);
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
                // Until the key changes, or its lease lapses (or the store may have
                // found its holder gone): a holder that crashed sends no notification,
                // and its key is ours to take over then.
                // A `close()` ends the wait too: the next turn answers 503.
                if let (Some(until), Some(changed)) = (wait_until, changed) {
                    let now = tokio::time::Instant::now();
                    let mut wake = until.min(now + retry_after + LAPSE_MARGIN);
                    if unregistered {
                        wake = wake.min(now + UNREGISTERED_RECHECK);
                    }
                    // A store that takes over a dead holder's key before its lease
                    // lapses is asked again that often: nothing notifies of a death.
                    if let Some(recheck) = config.store.running_recheck() {
                        wake = wake.min(now + recheck);
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
                return opened_or_answer(claim, request, key, config);
            }
            Ok(Err(e)) => {
                tracing::error!(error = %e, "claim failed; the handler was not run");
                return Err(unavailable(&config.problems));
            }
            Err(_) => {
                tracing::error!(timeout = ?config.store_timeout, "claim timed out; the handler was not run");
                return Err(unavailable(&config.problems));
            }
        }
    }
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
    // over. Its lease is renewed by a task of its own, so that a handler that blocks
    // its thread keeps it too, through the first attempt to store its result.
    let leased = config.leased();
    let mut renewal = Renewal::start(&leased.renewals, &leased.store, &lease, leased.lease);
    let produced = renewal.watch(run_inner(inner, req, &config)).await;
    match produced {
        Produced::ServiceFailed(e) => {
            drop(renewal);
            leased.release(&lease, in_flight).await;
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
                leased.store(&lease, stored, in_flight, renewal).await;
                let mut res = Response::new(ResponseBody::full(answer.body));
                *res.status_mut() = answer.status;
                *res.headers_mut() = answer.headers;
                Ok(with_outcome(res, Outcome::Executed))
            } else {
                tracing::error!(error = %e, "the response body failed; releasing the key");
                drop(renewal);
                leased.release(&lease, in_flight).await;
                Ok(handler_failed(&config.problems))
            }
        }
        Produced::Buffered(parts, body) => {
            let outcome = if crate::policy::is_stored(&config.policy, &parts) {
                let stored = to_store(&config, &parts, &body);
                leased.store(&lease, stored, in_flight, renewal).await;
                Outcome::Executed
            } else {
                drop(renewal);
                leased.release(&lease, in_flight).await;
                Outcome::Released
            };
            let mut res = Response::from_parts(parts, ResponseBody::full(body));
            res.headers_mut().remove(header::CONTENT_LENGTH);
            Ok(with_outcome(res, outcome))
        }
        Produced::Unbuffered(parts, prefix, rest, why) => {
            let outcome = if crate::policy::is_stored(&config.policy, &parts) {
                tracing::warn!(
                    ?why,
                    "the response could not be read whole; retries will get response-not-stored"
                );
                let stored = not_stored_problem(&config, why);
                leased.store(&lease, stored, in_flight, renewal).await;
                Outcome::Executed
            } else {
                // Not to be stored in any size: the key is free for a retry.
                drop(renewal);
                leased.release(&lease, in_flight).await;
                Outcome::Released
            };
            let res = Response::from_parts(parts, ResponseBody::prefixed(prefix, rest));
            Ok(with_outcome(res, outcome))
        }
    }
}
