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
//! - a concurrent duplicate's claim waits on the uncommitted row (bounded by
//!   [`lock_timeout`](crate::IdempotencyLayer::lock_timeout), or by
//!   [`wait_for_running`](crate::IdempotencyLayer::wait_for_running) if that is
//!   longer), then sees the committed
//!   response and replays it, or gets 409 at the bound; one that gets the row after
//!   [`ShutdownHandle::close`](crate::ShutdownHandle::close) rolls back and answers
//!   `503 shutting-down`;
//! - a statement of the handler that fails aborts the transaction: a client error (4xx)
//!   the handler then answers goes to its client unstored, with nothing committed and
//!   the key free, and so does an answer the storage policy releases (5xx, 408, 429 by
//!   default); any other answer becomes `503 not-committed`. Run a statement that may
//!   fail under a `SAVEPOINT`, and roll back to it, to keep the transaction usable.
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
    store::{
        Checkout, Claim, ClaimRequest, Lease, PostgresStore, StoreErrorKind, connection_lost,
        in_an_aborted_transaction, statement_cancelled,
    },
};

type Answer<B, E> = Result<Response<ResponseBody<B>>, E>;

/// The request's open transaction, for the handler's own writes.
///
/// Cloning is cheap; every clone is the same transaction. Do not keep it beyond the
/// handler: once the layer commits or rolls back, [`client`](Self::client) fails. Work
/// that still holds the [`TransactionClient`] when the response is ready (a task the
/// handler spawned, say) has until the layer's `store_timeout` to let go of it; past
/// that, the request answers `500 handler-failed`, and the transaction is rolled back
/// and its connection closed as soon as the client is dropped.
#[derive(Clone)]
pub struct TransactionHandle {
    slot: Arc<Mutex<Option<Checkout>>>,
}

/// The transaction's connection, locked for one handler at a time; derefs to the pooled
/// client (`prepare_cached`, `execute`, `query`, …). Do not run `COMMIT` or `ROLLBACK`
/// on it: the layer ends the transaction.
pub struct TransactionClient {
    guard: OwnedMutexGuard<Option<Checkout>>,
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

    /// Takes the transaction back once the work is done; `None` if the work still holds
    /// the connection after `bound`. The connection is then closed, which rolls back,
    /// as soon as the work lets go of its [`TransactionClient`], even if it keeps a
    /// clone of the handle: a handle kept beyond the request must not hold its row
    /// lock, and so its key, for as long as the handle lives.
    pub(crate) async fn take(
        slot: &Arc<Mutex<Option<Checkout>>>,
        bound: Duration,
    ) -> Option<Checkout> {
        match tokio::time::timeout(bound, slot.lock()).await {
            Ok(mut slot) => slot.take(),
            Err(_) => {
                tracing::error!(
                    "the work kept the transaction's connection; it is closed, which rolls back, once the work lets it go"
                );
                // Queued on the lock behind the work's client: the handle's later calls
                // queue behind this and find the transaction ended.
                let slot = slot.clone();
                tokio::spawn(async move { drop(slot.lock().await.take()) });
                None
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

pub(crate) async fn rollback(tx: Checkout) {
    match tx.batch_execute("ROLLBACK").await {
        Ok(()) => tx.done(),
        // Dropping the Checkout closes the connection, which rolls back.
        Err(e) => tracing::warn!(error = %e, "rollback failed; closing the connection"),
    }
}

/// `503 not-committed`: nothing was kept.
const NOT_COMMITTED: &str = "the request's transaction could not be committed, so it had no effect; retry with the same key";

/// `503 not-committed` when the outcome is unknown.
const COMMIT_UNKNOWN: &str = "the connection to the database failed during the commit, and whether it took effect could not be checked; retry with the same key: it replays the response if it did, and runs afresh if not";

fn not_committed<B>(detail: &str) -> Response<ResponseBody<B>> {
    let res = Problem::NotCommitted.response_retry_after(detail, Duration::from_secs(1));
    with_outcome(res.map(ResponseBody::full), Outcome::StoreError)
}

/// The result of opening a transaction and claiming the key in it.
pub(crate) enum Opened {
    /// The claim row is ours, uncommitted, in this transaction.
    Acquired(Checkout, Lease),
    /// Completed or running under another request (the transaction is rolled back).
    Found(Claim),
    /// The first request held its row past the lock timeout (or the key kept changing
    /// under the claim).
    Busy,
    /// No connection, or the database failed.
    Unavailable,
}

/// Takes a connection, then sends BEGIN and the claim together: one round trip. A
/// duplicate's claim waits here on the first request's uncommitted row, up to
/// `claim_wait`; the transaction then goes on with `lock_timeout` (one more round
/// trip where the two differ).
pub(crate) async fn open(
    store: &PostgresStore,
    request: &ClaimRequest<'_>,
    claim_wait: Duration,
    lock_timeout: Duration,
    store_timeout: Duration,
) -> Opened {
    // Duplicates block on the first request's row while holding a connection; the
    // permit keeps them from taking the connections its handler needs. Waiting for one
    // past the bound is this process's overload, not a running duplicate: 503, like a
    // pool with no connection to give.
    let Ok(_permit) =
        tokio::time::timeout(store_timeout + lock_timeout, store.tx_claim_permit()).await
    else {
        tracing::error!("too many transactional claims waiting; nothing was run");
        return Opened::Unavailable;
    };
    let conn = match tokio::time::timeout(store_timeout, store.client()).await {
        Ok(Ok(conn)) => conn,
        Ok(Err(e)) => {
            tracing::error!(error = %e, "no connection for the transaction; nothing was run");
            return Opened::Unavailable;
        }
        Err(_) => {
            tracing::error!("no connection for the transaction in time; nothing was run");
            return Opened::Unavailable;
        }
    };
    let begin = begin("", claim_wait);
    let claimed = tokio::time::timeout(store_timeout + claim_wait, async {
        let client = &*conn;
        let failed = |e| crate::store::StoreError::new(StoreErrorKind::Unavailable, e);
        // Where transactions default to repeatable read or serializable, a duplicate
        // that waited on the first request's row fails so once that row commits: it
        // looks again, in a new transaction.
        let mut again = false;
        crate::store::again_if_it_lost_a_race(|| {
            let retry = std::mem::replace(&mut again, true);
            let begin = &begin;
            async move {
                if retry {
                    client.batch_execute("ROLLBACK").await.map_err(failed)?;
                }
                let (begun, claim) = tokio::join!(
                    client.batch_execute(begin),
                    store.claim_on(client, request, crate::store::fresh_token())
                );
                begun.map_err(failed)?;
                claim
            }
        })
        .await
    })
    .await;
    let claimed = match claimed {
        Ok(Ok(Claim::Acquired(lease))) if claim_wait != lock_timeout => {
            // The handler's own lock waits are bounded by `lock_timeout`, not by how
            // long a duplicate may wait for the key.
            let reset = tokio::time::timeout(
                store_timeout,
                conn.batch_execute(&set_lock_timeout(lock_timeout)),
            )
            .await;
            match reset {
                Ok(Ok(())) => Ok(Ok(Claim::Acquired(lease))),
                Ok(Err(e)) => Ok(Err(crate::store::StoreError::new(
                    StoreErrorKind::Unavailable,
                    e,
                ))),
                Err(elapsed) => Err(elapsed),
            }
        }
        claimed => claimed,
    };
    match claimed {
        Ok(Ok(Claim::Acquired(lease))) => Opened::Acquired(conn, lease),
        Ok(Ok(found)) => {
            // Nothing was written: the answer need not wait for the ROLLBACK; the
            // connection goes back to the pool when it is done.
            tokio::spawn(rollback(conn));
            Opened::Found(found)
        }
        // A lock timeout on the first request's row, or a key that kept changing under
        // the claim: another request is at work on it. A statement cancelled by
        // `statement_timeout` is a slow database, like any other store failure.
        Ok(Err(e)) if e.kind() == StoreErrorKind::Timeout && !statement_cancelled(&e) => {
            rollback(conn).await;
            Opened::Busy
        }
        Ok(Err(e)) => {
            tracing::error!(error = %e, "claim failed; nothing was run");
            Opened::Unavailable
        }
        Err(_) => {
            tracing::error!("claim timed out; nothing was run");
            Opened::Unavailable
        }
    }
}

/// What became of a transaction at its end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Committed {
    /// The handler's writes and the stored response are committed.
    Yes,
    /// A statement of the handler failed, so PostgreSQL had aborted the transaction:
    /// nothing was committed, and the connection is back in the pool, clean.
    Aborted,
    /// Nothing was committed.
    No,
    /// The connection failed during `COMMIT`, and whether the server committed could
    /// not be checked in time either.
    Unknown,
}

/// `BEGIN` with the transaction's `lock_timeout`, sent as one simple query.
fn begin(isolation: &str, lock_timeout: Duration) -> String {
    format!("BEGIN{isolation}; {}", set_lock_timeout(lock_timeout))
}

/// `SET LOCAL lock_timeout`, in milliseconds (at least 1: zero would mean no bound).
fn set_lock_timeout(lock_timeout: Duration) -> String {
    format!(
        "SET LOCAL lock_timeout = {}",
        lock_timeout.as_millis().max(1)
    )
}

/// Finds out whether a transaction whose `COMMIT` was in doubt committed (`None`: the
/// database could not tell in time), on another connection, in a transaction of its own
/// that it rolls back: it waits for the first transaction to end if the server is still
/// running it (up to `lock_timeout`), then reads the key's row
/// ([`PostgresStore::committed_on`]).
async fn resolve(
    store: &PostgresStore,
    lease: &Lease,
    request: &ClaimRequest<'_>,
    sent: &StoredResponse,
    lock_timeout: Duration,
    store_timeout: Duration,
) -> Option<bool> {
    tokio::time::timeout(store_timeout + lock_timeout, async {
        let conn = store.client().await.ok()?;
        // Read committed whatever the database's default: the read must see what
        // committed while the insert waited.
        let begin = begin(" ISOLATION LEVEL READ COMMITTED", lock_timeout);
        conn.batch_execute(&begin).await.ok()?;
        let committed = store
            .committed_on(&conn, lease, &request.fingerprint, sent)
            .await;
        rollback(conn).await;
        committed.ok()
    })
    .await
    .ok()
    .flatten()
}

/// Writes the response into the claim row and commits, pipelined: one round trip, one
/// commit. If the connection fails during the `COMMIT`, finds out on another whether
/// it committed ([`resolve`]).
pub(crate) async fn commit(
    store: &PostgresStore,
    conn: Checkout,
    lease: &Lease,
    request: &ClaimRequest<'_>,
    stored: &StoredResponse,
    lock_timeout: Duration,
    store_timeout: Duration,
) -> Committed {
    let client = &*conn;
    // Prepared first, so that its Execute is on the wire before the COMMIT.
    if let Err(e) = store.prepare_completion(client).await {
        if in_an_aborted_transaction(&e) {
            rollback(conn).await;
            return Committed::Aborted;
        }
        tracing::error!(error = %e, "the transaction was not committed");
        return Committed::No;
    }
    let (completed, committed) = tokio::join!(
        store.complete_on(client, lease, stored, request.ttl),
        client.batch_execute("COMMIT"),
    );
    match (completed, committed) {
        (Ok(true), Ok(())) => {
            conn.done();
            Committed::Yes
        }
        // The COMMIT of an aborted transaction rolls it back, and succeeds at that.
        (Err(e), Ok(())) if in_an_aborted_transaction(&e) => {
            conn.done();
            Committed::Aborted
        }
        // No answer from the server to the COMMIT (the connection failed, or the server
        // ended the session): it may have committed all the same.
        (completed, Err(e)) if connection_lost(&e) => {
            tracing::error!(
                completed = ?completed.as_ref().map_err(ToString::to_string),
                committed = %e,
                "the connection failed during COMMIT; checking whether it committed"
            );
            drop(conn);
            match resolve(store, lease, request, stored, lock_timeout, store_timeout).await {
                Some(true) => Committed::Yes,
                Some(false) => Committed::No,
                None => Committed::Unknown,
            }
        }
        (completed, committed) => {
            // A failed statement aborts the transaction, and COMMIT then rolls it back.
            tracing::error!(
                completed = ?completed.as_ref().map_err(ToString::to_string),
                committed = ?committed.as_ref().map_err(ToString::to_string),
                "the transaction was not committed"
            );
            // The server answered the COMMIT (a serialization failure, say): the
            // transaction is over and the connection fit for the pool.
            if committed.is_ok() || committed.as_ref().is_err_and(|e| e.as_db_error().is_some()) {
                conn.done();
            }
            Committed::No
        }
    }
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
    // A duplicate waits on the first request's row for `lock_timeout`, or for as long
    // as `wait_for_running` lets it wait if that is longer.
    let claim_wait = config
        .lock_timeout
        .max(config.wait.min(crate::layer::LONGEST_LOCK_TIMEOUT));
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
    let (conn, lease) = match opened {
        // A duplicate that waited on the first request's row may get it after
        // `close()`: nothing is claimed after the close, so it lets the row go.
        Opened::Acquired(conn, _) if config.shutdown.is_closed() => {
            rollback(conn).await;
            return Ok(shutting_down());
        }
        Opened::Acquired(conn, lease) => {
            // Until now, dropping the request dropped its connection, which rolled
            // back anything claimed; from now on it finishes even if its client goes.
            handoff.hold();
            (conn, lease)
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
        Opened::Busy => return Ok(in_progress(config.in_progress_retry_after)),
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
        location: config.store.records_location().map(Arc::from),
    });
    let req = Request::from_parts(parts, ReqBody::from(body));
    // Runs here, in the connection's task; a client that hangs up does not cancel it
    // (`ResponseFuture` moves it to a task of its own), and a panic rolls back.
    let _in_flight = in_flight;
    let produced = CatchPanic::new(run_inner(inner, req, &config)).await;
    let Some(conn) = TransactionHandle::take(&slot, config.store_timeout).await else {
        return Ok(handler_failed());
    };
    let produced = match produced {
        Ok(produced) => produced,
        Err(panic) => {
            tracing::error!(
                panic = crate::catch_panic::message(&panic),
                "the handler panicked; rolling back"
            );
            rollback(conn).await;
            return Ok(handler_failed());
        }
    };
    let (stored, res) = match produced {
        Produced::ServiceFailed(e) => {
            rollback(conn).await;
            return Err(e);
        }
        Produced::BodyFailed(_, e) => {
            tracing::error!(error = %e, "the response body failed; rolling back");
            rollback(conn).await;
            return Ok(handler_failed());
        }
        Produced::Buffered(parts, body) => {
            if !crate::policy::is_stored(&config.policy, &parts) {
                // Not kept: neither are the handler's writes.
                rollback(conn).await;
                let res = Response::from_parts(parts, ResponseBody::full(body));
                return Ok(with_outcome(res, Outcome::Executed));
            }
            let stored = crate::service::to_store(&config, &parts, &body);
            let mut res = Response::from_parts(parts, ResponseBody::full(body));
            res.headers_mut().remove(http::header::CONTENT_LENGTH);
            (stored, res)
        }
        Produced::Unbuffered(parts, prefix, rest, why) => {
            if !crate::policy::is_stored(&config.policy, &parts) {
                rollback(conn).await;
                let res = Response::from_parts(parts, ResponseBody::prefixed(prefix, rest));
                return Ok(with_outcome(res, Outcome::Executed));
            }
            let stored = crate::service::not_stored_problem(&config, why);
            (
                stored,
                Response::from_parts(parts, ResponseBody::prefixed(prefix, rest)),
            )
        }
    };
    let (lock_timeout, store_timeout) = (config.lock_timeout, config.store_timeout);
    let committed = commit(
        &store,
        conn,
        &lease,
        &request,
        &stored,
        lock_timeout,
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
    }
}
