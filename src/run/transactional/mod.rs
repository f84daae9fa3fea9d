//! Transactional mode's engine: the transaction opened with the claim in it
//! ([`lifecycle::open`]), the handler run with its [`TransactionHandle`], the response
//! written into the claim row and committed with the handler's writes
//! ([`lifecycle::commit`]), or everything rolled back; and what is done when the handler
//! ends or keeps the transaction itself ([`ended`]); and a job run so ([`job`]).

mod ended;
mod job;
mod lifecycle;

use std::{sync::Arc, time::Duration};

use bytes::Bytes;
use http::{Request, Response, request::Parts};
use http_body::Body;
use tower_service::Service;

pub(crate) use ended::{
    RolledBack, is_stored as is_transaction_ended, keeping_claim, kept as finish_kept,
    roll_back_unless_ended,
};
pub(crate) use job::run_job;
pub(crate) use lifecycle::{Claimed, Committed, Opened, commit, open};

use super::{
    decision::opened_or_answer,
    handler::{Produced, run_inner},
};
use crate::{
    Outcome, StoredResponse,
    answers::{
        COMMIT_UNKNOWN, NOT_COMMITTED, handler_failed, in_progress, not_committed, shutting_down,
        unavailable, with_outcome,
    },
    body::{BoxError, ResponseBody},
    catch_panic::catch_panic,
    future::{Answer, Handoff},
    layer::Config,
    shutdown::InFlight,
    store::{
        ClaimRequest,
        transaction::{Backend, Ending, TxConn, TxStore},
    },
    transactional::Slot,
};

/// What became of a transaction whose work kept its client past the response, when the
/// layer gave up waiting for it ([`take_back`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kept {
    /// Nothing of it commits: it was ended on the server, or, if it could not be, it
    /// rolls back once the work lets go of its client.
    RolledBack,
    /// It had ended before, on a session that lives on: the handler committed or rolled
    /// it back on its client.
    Ended,
    /// Its session had ended, and the transaction with it: rolled back, unless the
    /// handler had committed it before.
    SessionGone,
    /// Its session could be neither told apart nor ended (it does not report its
    /// transactions, or this role may not signal it; behind a pooler, the server
    /// session may serve another client by now, one that hides its transactions): it
    /// rolls back once the work lets go of its client, unless the handler had
    /// committed it before.
    Hidden,
}

/// Takes the transaction back from its handle's `slot` once the work is done; [`Kept`] if the work still
/// holds the connection after `bound`. The transaction is then ended on the server
/// at once, from another connection (`backend`'s session is terminated, each step
/// bounded by `bound`, on a connection that does not wait behind the pool), so that
/// nothing of it commits and its row lock, and so its key, is let go, whatever the
/// work does with its [`TransactionClient`]; the connection is closed as soon as the
/// work lets go of the client, even if it keeps a clone of the handle. If the
/// transaction had ended before (the handler committed or rolled it back on its
/// client, or its session ended), [`Kept`] says so, for the caller to settle the
/// key (`ended::kept`).
pub(crate) async fn take_back(
    slot: &Slot,
    store: &TxStore,
    backend: &Backend,
    bound: Duration,
) -> Result<TxConn, Kept> {
    // Empty only if taken back already, and then dropped, which rolled back.
    if let Some(taken) = slot.take_within(bound).await {
        return taken.ok_or(Kept::RolledBack);
    }
    const KEPT: &str = "the work kept the transaction's connection past the response";
    match tokio::time::timeout(bound, store.end_transaction(backend)).await {
        Ok(Ok(Ending::Terminated)) => {
            tracing::error!(
                "{KEPT}; the transaction was ended on the server, so nothing of it commits"
            );
            Err(Kept::RolledBack)
        }
        Ok(Ok(Ending::AlreadyEnded)) => {
            tracing::error!(
                "{KEPT}; its transaction had already ended, on a session that lives on"
            );
            Err(Kept::Ended)
        }
        Ok(Ok(Ending::SessionGone)) => {
            tracing::error!("{KEPT}; its session had already ended, and its transaction with it");
            Err(Kept::SessionGone)
        }
        Ok(Ok(Ending::CannotEnd)) => {
            tracing::error!(
                "{KEPT}, and the transaction could not be ended on the server (may this role see and signal its own sessions?); it rolls back once the work lets the connection go, unless the handler had committed it"
            );
            Err(Kept::Hidden)
        }
        Ok(Err(e)) => {
            tracing::error!(
                error = %e,
                "{KEPT}, and the transaction could not be ended on the server; it rolls back once the work lets the connection go"
            );
            Err(Kept::RolledBack)
        }
        Err(_) => {
            tracing::error!(
                "{KEPT}, and the transaction could not be ended on the server in time; it rolls back once the work lets the connection go"
            );
            Err(Kept::RolledBack)
        }
    }
}

/// How long a duplicate not told to wait (`wait_for_running` zero) waits on the first
/// request's uncommitted row before its `409`: long enough for a claim that merely
/// crosses another's commit, short enough that its client gets its answer at once.
const DUPLICATE_LOCK_WAIT: Duration = Duration::from_millis(50);

/// The guarded path of a request in transactional mode, after its body was read.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn serve<S, ReqBody, ResBody>(
    config: Arc<Config>,
    store: TxStore,
    inner: S,
    mut parts: Parts,
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
    // Ready before the transaction opens: what readiness waits for (a concurrency
    // permit, say) is waited for holding no connection, no open transaction and no row
    // lock. A duplicate then holds the permit while it waits on the first request's
    // row, as it holds a connection.
    let mut inner = inner;
    std::future::poll_fn(|cx| inner.poll_ready(cx)).await?;
    // A duplicate waits on the first request's row for as long as `wait_for_running`
    // lets it wait, or, not told to wait, a moment: its 409 comes at once, and it holds
    // a pooled connection no longer than that.
    let claim_wait = if config.wait.is_zero() {
        DUPLICATE_LOCK_WAIT
    } else {
        config.wait.min(crate::settings::LONGEST_LOCK_TIMEOUT)
    };
    // A running record whose fingerprint is this request's computed another way (from
    // before an upgrade of the scheme) is claimed again with its fingerprint, so that
    // its lapsed lease is taken over as the record's own.
    let opened = async {
        let (problems, sealing) = (&config.problems, &config.sealing);
        let (lock_timeout, store_timeout) = (config.lock_timeout, config.store_timeout);
        let first = open(
            &store,
            &request,
            (problems, sealing),
            claim_wait,
            lock_timeout,
            store_timeout,
        )
        .await;
        let recorded = match &first {
            Opened::Found(crate::store::Claim::Running { fingerprint, .. })
                if *fingerprint != request.fingerprint
                    && request.fingerprint.matches(fingerprint) =>
            {
                request.fingerprint.as_recorded(fingerprint)
            }
            _ => return first,
        };
        let as_recorded = ClaimRequest {
            fingerprint: recorded,
            ..request.clone()
        };
        open(
            &store,
            &as_recorded,
            (problems, sealing),
            claim_wait,
            lock_timeout,
            store_timeout,
        )
        .await
    };
    // A close ends the wait on another request's row: dropped, the claim is cancelled
    // and rolled back, and nothing was run.
    let opened = tokio::select! {
        biased;
        opened = opened => opened,
        () = config.shutdown.closed() => return Ok(shutting_down(&config.problems)),
    };
    let store_timeout = config.store_timeout;
    let (conn, claimed) = match opened {
        // A duplicate that waited on the first request's row may get it after
        // `close()`: nothing is claimed after the close, so it lets the row go.
        Opened::Acquired(conn, _) if config.shutdown.is_closed() => {
            conn.roll_back_or_close(store_timeout).await;
            return Ok(shutting_down(&config.problems));
        }
        Opened::Acquired(conn, claimed) => {
            // Claimed new under this scope and key; the layer's earlier settings (the
            // scope it used before a deploy, the key in clear before encryption) may
            // have stored it. Rolled back, the claim is let go.
            let on = (&store, &conn);
            let earlier =
                super::previous::answer_in_transaction(&config, on, &parts, &request, key);
            if let Some(answer) = earlier.await {
                conn.roll_back_or_close(store_timeout).await;
                return Ok(answer);
            }
            // Until now, dropping the request dropped its connection, which rolled
            // back anything claimed; from now on it finishes even if its client goes.
            handoff.hold();
            (conn, claimed)
        }
        Opened::Found(found) => {
            // Found is never ours to run: a replay, a 409 or a 422.
            return Ok(opened_or_answer(found, &request, key, &config)
                .err()
                .unwrap_or_else(|| unavailable(&config.problems)));
        }
        Opened::Unavailable => return Ok(unavailable(&config.problems)),
        // The running request's lease is not known here: its row is locked, unread.
        Opened::Busy => {
            let hint = config.in_progress_retry_after;
            return Ok(in_progress(&config.problems, hint, hint));
        }
    };

    let slot = Slot::holding(conn);
    slot.hand_to(&mut parts.extensions);
    crate::request::hand_over(&mut parts.extensions, &request, key, &config, true);
    let steps = super::steps::Steps(Some(claimed.steps.clone()));
    super::steps::attach_log(&mut parts.extensions, steps);
    let req = Request::from_parts(parts, ReqBody::from(body));
    // Runs here, in the connection's task; a client that hangs up does not cancel it
    // (`ResponseFuture` moves it to a task of its own), and a panic rolls back.
    let _in_flight = in_flight;
    let run = run_and_end(&config, &store, inner, req, &slot, &claimed, &request);
    ended::keeping_claim(&store, &claimed, &request, run).await
}

/// Runs the handler in the transaction of `claimed`, then ends that transaction:
/// commits it with the response, or rolls it back, or finds it ended under the layer.
async fn run_and_end<S, ReqBody, ResBody>(
    config: &Config,
    store: &TxStore,
    inner: S,
    req: Request<ReqBody>,
    slot: &Slot,
    claimed: &Claimed,
    request: &ClaimRequest<'_>,
) -> Answer<ResBody, S::Error>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: From<Bytes> + Send + 'static,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let store_timeout = config.store_timeout;
    let produced = catch_panic(run_inner(inner, req, config)).await;
    let taken = take_back(slot, store, &claimed.backend, store_timeout);
    let conn = match taken.await {
        Ok(conn) => conn,
        // The work kept its client: nothing can be committed, and the transaction may
        // have ended under the layer meanwhile.
        Err(kept) => {
            let settled = ended::kept(store, kept, claimed, request, store_timeout);
            return Ok(match settled.await {
                RolledBack::Yes => handler_failed(&config.problems),
                RolledBack::Ended => ended::response(&config.problems),
            });
        }
    };
    let (stored, res) = match decide(config, produced) {
        Decision::Commit(stored, res) => (stored, res),
        // Rolled back, unless the handler ended the transaction itself: then the key is
        // completed with `500 transaction-ended`, which is the answer.
        Decision::RollBack(answer) => {
            let rolled_back =
                ended::roll_back_unless_ended(store, conn, claimed, request, store_timeout);
            return match rolled_back.await {
                RolledBack::Yes => answer,
                RolledBack::Ended => Ok(ended::response(&config.problems)),
            };
        }
    };
    let committed = commit(
        store,
        conn,
        claimed,
        request,
        &stored,
        config.lock_timeout,
        store_timeout,
    );
    match committed.await {
        Committed::Yes => Ok(with_outcome(res, Outcome::Executed)),
        // The handler met a failed statement (a unique violation, say) and answered a
        // client error: its answer stands, nothing was committed, and the key is free.
        Committed::Aborted if res.status().is_client_error() => {
            tracing::warn!(
                status = res.status().as_u16(),
                "a statement of the handler failed and aborted its transaction; its answer was not stored, and a retry runs again"
            );
            Ok(with_outcome(res, Outcome::Released))
        }
        Committed::Aborted => {
            tracing::error!(
                status = res.status().as_u16(),
                "the handler answered although a statement of its transaction failed, which aborted it; nothing was committed"
            );
            Ok(not_committed(&config.problems, NOT_COMMITTED))
        }
        Committed::No => Ok(not_committed(&config.problems, NOT_COMMITTED)),
        Committed::Unknown => Ok(not_committed(&config.problems, COMMIT_UNKNOWN)),
        Committed::Ended => Ok(ended::response(&config.problems)),
    }
}

/// What the layer does with the transaction once the handler has produced its answer.
enum Decision<B, E> {
    /// Commit it, with the response to store, and answer the response.
    Commit(StoredResponse, Response<ResponseBody<B>>),
    /// Roll it back, and answer this.
    RollBack(Answer<B, E>),
}

/// Decides what becomes of the transaction after the handler `produced` its answer
/// (or panicked): an answer the storage policy keeps commits, with it stored; a panic,
/// a service error, a failed body and an answer the policy does not keep roll back.
fn decide<B, E>(
    config: &Config,
    produced: Result<Produced<B, E>, crate::catch_panic::Panicked>,
) -> Decision<B, E>
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let produced = match produced {
        Ok(produced) => produced,
        Err(panic) => {
            tracing::error!(
                panic = crate::catch_panic::message(&panic),
                "the handler panicked; rolling back"
            );
            return Decision::RollBack(Ok(handler_failed(&config.problems)));
        }
    };
    match produced {
        Produced::ServiceFailed(e) => Decision::RollBack(Err(e)),
        Produced::BodyFailed(_, e) => {
            tracing::error!(error = %e, "the response body failed; rolling back");
            Decision::RollBack(Ok(handler_failed(&config.problems)))
        }
        // Not kept: neither are the handler's writes.
        Produced::Buffered(parts, body) if !crate::policy::is_stored(&config.policy, &parts) => {
            let res = Response::from_parts(parts, ResponseBody::full(body));
            Decision::RollBack(Ok(with_outcome(res, Outcome::Released)))
        }
        Produced::Buffered(parts, body) => {
            let stored = crate::answers::to_store(config, &parts, &body);
            let mut res = Response::from_parts(parts, ResponseBody::full(body));
            res.headers_mut().remove(http::header::CONTENT_LENGTH);
            Decision::Commit(stored, res)
        }
        Produced::Unbuffered(parts, prefix, rest, _)
            if !crate::policy::is_stored(&config.policy, &parts) =>
        {
            let res = Response::from_parts(parts, ResponseBody::prefixed(prefix, rest));
            Decision::RollBack(Ok(with_outcome(res, Outcome::Released)))
        }
        Produced::Unbuffered(parts, prefix, rest, why) => {
            let stored = crate::answers::not_stored_problem(config, why);
            let res = Response::from_parts(parts, ResponseBody::prefixed(prefix, rest));
            Decision::Commit(stored, res)
        }
    }
}
