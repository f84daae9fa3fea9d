//! Transactional mode: the claim, the handler's own writes and the stored response
//! commit together, or not at all.
//!
//! With [`IdempotencyLayer::transactional`](crate::IdempotencyLayer::transactional), a
//! guarded request opens a transaction, inserts its claim row in it, and hands the
//! transaction to the handler as a [`TransactionHandle`] (request extension and Axum
//! extractor). The handler does its writes there; the layer then writes the response
//! into the claim row and commits, pipelined, in one round trip. The effect is
//! exactly-once for the service's own database writes:
//!
//! - a crash, a dropped connection, a handler error or panic, or a response the storage
//!   policy does not keep rolls everything back, so a retry starts clean;
//! - a concurrent duplicate's claim waits on the uncommitted row (for
//!   [`wait_for_running`](crate::IdempotencyLayer::wait_for_running), or, by default,
//!   a moment), then sees the committed response and replays it, or gets 409 at the
//!   bound; one that gets the row after
//!   [`ShutdownHandle::close`](crate::ShutdownHandle::close) rolls back and answers
//!   `503 shutting-down`;
//! - a statement of the handler that fails aborts the transaction: a client error (4xx)
//!   the handler then answers goes to its client unstored, with nothing committed and
//!   the key free, and so does an answer the storage policy releases (5xx, 408, 429 by
//!   default); any other answer becomes `503 not-committed`. Run a statement that may
//!   fail under a `SAVEPOINT`, and roll back to it, to keep the transaction usable;
//! - a handler that ends the transaction itself (`COMMIT`, `ROLLBACK`, or `BEGIN …
//!   COMMIT` from a helper written for a plain connection) gets `500
//!   transaction-ended`, and so does every retry with its key: what it wrote may have
//!   committed without its response, so the layer completes the key with that answer,
//!   outside the ended transaction, rather than say "no effect" or run it again. The
//!   completion matches only a claim row written by the transaction still open (its
//!   `xmin`), which costs nothing on the way to a commit. A transaction found aborted
//!   by a failed statement may be one the handler began after its `COMMIT`: once it
//!   is rolled back, the claim row committed `running` tells. After a `COMMIT` of the
//!   handler's, that row's lease is renewed until the key is finished, so a handler
//!   that runs on is not taken over; after a `ROLLBACK`, nothing holds the key until
//!   the handler returns, and a retry in that time runs it again (its answer is the
//!   one kept);
//! - every statement the layer sends in the transaction (`BEGIN` with the claim, the
//!   completion with `COMMIT`, `ROLLBACK`, in the background too) is bounded by
//!   [`store_timeout`](crate::IdempotencyLayer::store_timeout): a `COMMIT` with no
//!   answer in time is in doubt, checked on another connection like one whose
//!   connection failed (`503 not-committed`, saying the outcome is unknown, if the check
//!   cannot tell); a `ROLLBACK` with none closes its connection, which rolls back. A
//!   database that stops answering holds neither the request nor
//!   [`ShutdownHandle::drain`](crate::ShutdownHandle::drain);
//! - work that keeps the [`TransactionClient`] past the response (a task the handler
//!   spawned) has `store_timeout` to let go of it; then the layer ends the transaction
//!   on the server from another connection (`pg_terminate_backend` on the session
//!   running it, only while it still runs that transaction, on a connection that does
//!   not wait behind the pool), so that nothing of it commits and its key is free, and
//!   answers `500 handler-failed`; if the work had committed or rolled back the
//!   transaction itself, `500 transaction-ended`, as above.
//!
//! Transactional mode needs PostgreSQL 13 or later (`pg_current_xact_id_if_assigned`),
//! and an app role that may signal its own sessions (any role may, unless its
//! connections run as another role).
//!
//! ```no_run
//! use axum::{Router, http::StatusCode, routing::post};
//! use tower_idempotency::{IdempotencyKey, IdempotencyLayer, store::PostgresStore, transactional::TransactionHandle};
//!
//! async fn create_payment(
//!     key: IdempotencyKey,
//!     tx: TransactionHandle,
//! ) -> Result<(StatusCode, String), (StatusCode, String)> {
//!     let failed = |e: tokio_postgres::Error| (StatusCode::CONFLICT, e.to_string());
//!     let client = tx.client().await.map_err(|e| (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
//!     // A failed INSERT aborts the transaction: the 409 goes to the client, unstored,
//!     // and a retry runs again.
//!     client
//!         .execute("INSERT INTO payments (id) VALUES ($1)", &[&key.derive("payment")])
//!         .await
//!         .map_err(failed)?;
//!     Ok((StatusCode::CREATED, "created".into())) // committed with the stored response
//! }
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let store = PostgresStore::connect("postgres://postgres@127.0.0.1/postgres")?;
//! store.migrate().await?;
//! let app: Router = Router::new()
//!     .route("/payments", post(create_payment))
//!     .layer(IdempotencyLayer::transactional(store));
//! # Ok(()) }
//! ```
//!
//! The connection is held from the claim to the commit, so at most the pool's size of
//! transactional handlers run at once. Duplicates waiting on a row hold a connection
//! too, but at most half of the pool's: the others queue in-process until a permit
//! frees, so the handler they wait for always finds a connection.

mod ended;
mod lifecycle;

use std::{ops::Deref, sync::Arc, time::Duration};

use bytes::Bytes;
use deadpool_postgres::ClientWrapper;
use http::{Request, Response, request::Parts};
use http_body::Body;
use tokio::sync::{Mutex, OwnedMutexGuard};
use tower_service::Service;

use crate::{
    IdempotencyKey, Outcome, StoredResponse,
    body::{BoxError, ResponseBody},
    catch_panic::CatchPanic,
    layer::Config,
    rejection::Problem,
    service::{
        Produced, handler_failed, in_progress, run_inner, settle, shutting_down, unavailable,
        with_outcome,
    },
    shutdown::InFlight,
    store::{Backend, Checkout, ClaimRequest, Ending, PostgresStore, roll_back_or_close},
};

pub(crate) use ended::{
    RolledBack, is_stored as is_transaction_ended, keeping_claim, kept as settle_kept,
    roll_back_unless_ended,
};
pub(crate) use lifecycle::{Claimed, Committed, Opened, commit, open};

type Answer<B, E> = Result<Response<ResponseBody<B>>, E>;

/// The request's open transaction, for the handler's own writes.
///
/// Cloning is cheap; every clone is the same transaction. Do not keep it beyond the
/// handler: once the layer commits or rolls back, [`client`](Self::client) fails. Work
/// that still holds the [`TransactionClient`] when the response is ready (a task the
/// handler spawned, say) has until the layer's `store_timeout` to let go of it; past
/// that, the layer ends the transaction on the server (it terminates the session
/// running it, from another connection), so nothing of it commits and its key is
/// free, and the request answers `500 handler-failed` (or `500 transaction-ended` if
/// the work had ended the transaction itself by then); the client's connection is
/// closed once the work drops it.
#[derive(Clone)]
pub struct TransactionHandle {
    slot: Arc<Mutex<Option<Checkout>>>,
}

/// The transaction's connection, locked for one handler at a time; derefs to the pooled
/// client (`prepare_cached`, `execute`, `query`, …).
///
/// Do not run `COMMIT`, `ROLLBACK` or `BEGIN` on it (nor a helper written for a plain
/// connection that does): the layer ends the transaction. If the handler ends it
/// anyway, the layer finds out when it completes or rolls back, and answers `500
/// transaction-ended` (so does every retry with the key: it is completed with that
/// answer, and the handler does not run again under it), since what the handler wrote
/// may then have committed without its response. After a `ROLLBACK`, though, nothing
/// holds the key until the handler returns: a retry in that time runs it again.
/// `ROLLBACK TO SAVEPOINT` is fine.
pub struct TransactionClient {
    guard: OwnedMutexGuard<Option<Checkout>>,
}

/// What became of a transaction whose work kept its client past the response, when the
/// layer gave up waiting for it ([`TransactionHandle::take`]).
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
}

/// [`TransactionHandle::client`] after the transaction ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TransactionClosed;

impl std::fmt::Display for TransactionClosed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the request's transaction has already ended")
    }
}

impl std::error::Error for TransactionClosed {}

impl TransactionHandle {
    /// A handle over an open transaction, and the slot to take it back from.
    pub(crate) fn holding(conn: Checkout) -> (Self, Arc<Mutex<Option<Checkout>>>) {
        let slot = Arc::new(Mutex::new(Some(conn)));
        (Self { slot: slot.clone() }, slot)
    }

    /// Takes the transaction back once the work is done; [`Kept`] if the work still
    /// holds the connection after `bound`. The transaction is then ended on the server
    /// at once, from another connection (`backend`'s session is terminated, each step
    /// bounded by `bound`, on a connection that does not wait behind the pool), so that
    /// nothing of it commits and its row lock, and so its key, is let go, whatever the
    /// work does with its [`TransactionClient`]; the connection is closed as soon as the
    /// work lets go of the client, even if it keeps a clone of the handle. If the
    /// transaction had ended before (the handler committed or rolled it back on its
    /// client, or its session ended), [`Kept`] says so, for the caller to settle the
    /// key (`ended::kept`).
    pub(crate) async fn take(
        slot: &Arc<Mutex<Option<Checkout>>>,
        store: &PostgresStore,
        backend: &Backend,
        bound: Duration,
    ) -> Result<Checkout, Kept> {
        if let Ok(mut taken) = tokio::time::timeout(bound, slot.lock()).await {
            // Empty only if taken back already, and then dropped, which rolled back.
            return taken.take().ok_or(Kept::RolledBack);
        }
        // Queued on the lock behind the work's client: the handle's later calls queue
        // behind this and find the transaction ended.
        let queued = slot.clone();
        tokio::spawn(async move { drop(queued.lock().await.take()) });
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
                tracing::error!(
                    "{KEPT}; its session had already ended, and its transaction with it"
                );
                Err(Kept::SessionGone)
            }
            Ok(Ok(Ending::CannotEnd)) => {
                tracing::error!(
                    "{KEPT}, and the transaction could not be ended on the server (may this role see and signal its own sessions?); it rolls back once the work lets the connection go"
                );
                Err(Kept::RolledBack)
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

    /// The transaction's connection.
    pub async fn client(&self) -> Result<TransactionClient, TransactionClosed> {
        let guard = self.slot.clone().lock_owned().await;
        if guard.is_none() {
            return Err(TransactionClosed);
        }
        Ok(TransactionClient { guard })
    }
}

impl Deref for TransactionClient {
    type Target = ClientWrapper;

    fn deref(&self) -> &ClientWrapper {
        match self.guard.as_ref() {
            Some(tx) => tx,
            // `client()` checked, and the slot only empties under this lock.
            None => unreachable!("TransactionClient over an ended transaction"),
        }
    }
}

impl std::fmt::Debug for TransactionHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransactionHandle").finish_non_exhaustive()
    }
}

#[cfg(feature = "axum")]
mod extract {
    use axum_core::{
        extract::{FromRequestParts, OptionalFromRequestParts},
        response::{IntoResponse, Response},
    };
    use http::request::Parts;

    use super::TransactionHandle;
    use crate::rejection::Problem;

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
                    header: crate::key::unkeyed_in(&parts.extensions),
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

#[cfg(feature = "axum")]
pub use extract::MissingTransaction;

/// How long a duplicate not told to wait (`wait_for_running` zero) waits on the first
/// request's uncommitted row before its `409`: long enough for a claim that merely
/// crosses another's commit, short enough that its client gets its answer at once.
const DUPLICATE_LOCK_WAIT: Duration = Duration::from_millis(50);

/// `503 not-committed`: nothing was kept.
const NOT_COMMITTED: &str = "the request's transaction could not be committed, so it had no effect; retry with the same key";

/// `503 not-committed` when the outcome is unknown.
const COMMIT_UNKNOWN: &str = "the database did not answer the commit (the connection failed, or no answer came in time), and whether it took effect could not be checked; retry with the same key: it replays the response if it did, and runs afresh if not";

fn not_committed<B>(detail: &str) -> Response<ResponseBody<B>> {
    let res = Problem::NotCommitted.response_retry_after(detail, Duration::from_secs(1));
    with_outcome(res.map(ResponseBody::full), Outcome::StoreError)
}

/// The guarded path of a request in transactional mode, after its body was read.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn guarded<S, ReqBody, ResBody>(
    config: Arc<Config>,
    store: PostgresStore,
    inner: S,
    mut parts: Parts,
    body: Bytes,
    request: ClaimRequest<'_>,
    in_flight: InFlight,
    handoff: &crate::service::Handoff,
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
        config.wait.min(crate::layer::LONGEST_LOCK_TIMEOUT)
    };
    let opened = open(
        &store,
        &request,
        claim_wait,
        config.lock_timeout,
        config.store_timeout,
    );
    // A close ends the wait on another request's row: dropped, the claim is cancelled
    // and rolled back, and nothing was run.
    let opened = tokio::select! {
        biased;
        opened = opened => opened,
        () = config.shutdown.closed() => return Ok(shutting_down()),
    };
    let store_timeout = config.store_timeout;
    let (conn, claimed) = match opened {
        // A duplicate that waited on the first request's row may get it after
        // `close()`: nothing is claimed after the close, so it lets the row go.
        Opened::Acquired(conn, _) if config.shutdown.is_closed() => {
            roll_back_or_close(conn, store_timeout).await;
            return Ok(shutting_down());
        }
        Opened::Acquired(conn, claimed) => {
            // Until now, dropping the request dropped its connection, which rolled
            // back anything claimed; from now on it finishes even if its client goes.
            handoff.hold();
            (conn, claimed)
        }
        Opened::Found(found) => {
            // Found is never ours to run: a replay, a 409 or a 422.
            return Ok(
                settle(found, request.fingerprint, config.in_progress_retry_after)
                    .err()
                    .unwrap_or_else(unavailable),
            );
        }
        Opened::Unavailable => return Ok(unavailable()),
        // The running request's lease is not known here: its row is locked, unread.
        Opened::Busy => {
            let hint = config.in_progress_retry_after;
            return Ok(in_progress(hint, hint));
        }
    };

    let (handle, slot) = TransactionHandle::holding(conn);
    parts.extensions.insert(handle);
    let key = Arc::<str>::from(request.key);
    parts
        .extensions
        .insert(IdempotencyKey::new(request.scope.clone(), key.clone()));
    parts.extensions.insert(crate::key::Guarded {
        key,
        transactional: true,
        location: config.store.records_location(),
    });
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
    store: &PostgresStore,
    inner: S,
    req: Request<ReqBody>,
    slot: &Arc<Mutex<Option<Checkout>>>,
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
    let produced = CatchPanic::new(run_inner(inner, req, config)).await;
    let taken = TransactionHandle::take(slot, store, &claimed.backend, store_timeout);
    let conn = match taken.await {
        Ok(conn) => conn,
        // The work kept its client: nothing can be committed, and the transaction may
        // have ended under the layer meanwhile.
        Err(kept) => {
            let settled = ended::kept(store, kept, claimed, request, store_timeout);
            return Ok(match settled.await {
                RolledBack::Yes => handler_failed(),
                RolledBack::Ended => ended::response(),
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
                RolledBack::Ended => Ok(ended::response()),
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
            Ok(with_outcome(res, Outcome::Executed))
        }
        Committed::Aborted => {
            tracing::error!(
                status = res.status().as_u16(),
                "the handler answered although a statement of its transaction failed, which aborted it; nothing was committed"
            );
            Ok(not_committed(NOT_COMMITTED))
        }
        Committed::No => Ok(not_committed(NOT_COMMITTED)),
        Committed::Unknown => Ok(not_committed(COMMIT_UNKNOWN)),
        Committed::Ended => Ok(ended::response()),
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
            return Decision::RollBack(Ok(handler_failed()));
        }
    };
    match produced {
        Produced::ServiceFailed(e) => Decision::RollBack(Err(e)),
        Produced::BodyFailed(_, e) => {
            tracing::error!(error = %e, "the response body failed; rolling back");
            Decision::RollBack(Ok(handler_failed()))
        }
        // Not kept: neither are the handler's writes.
        Produced::Buffered(parts, body) if !crate::policy::is_stored(&config.policy, &parts) => {
            let res = Response::from_parts(parts, ResponseBody::full(body));
            Decision::RollBack(Ok(with_outcome(res, Outcome::Executed)))
        }
        Produced::Buffered(parts, body) => {
            let stored = crate::service::to_store(config, &parts, &body);
            let mut res = Response::from_parts(parts, ResponseBody::full(body));
            res.headers_mut().remove(http::header::CONTENT_LENGTH);
            Decision::Commit(stored, res)
        }
        Produced::Unbuffered(parts, prefix, rest, _)
            if !crate::policy::is_stored(&config.policy, &parts) =>
        {
            let res = Response::from_parts(parts, ResponseBody::prefixed(prefix, rest));
            Decision::RollBack(Ok(with_outcome(res, Outcome::Executed)))
        }
        Produced::Unbuffered(parts, prefix, rest, why) => {
            let stored = crate::service::not_stored_problem(config, why);
            let res = Response::from_parts(parts, ResponseBody::prefixed(prefix, rest));
            Decision::Commit(stored, res)
        }
    }
}
