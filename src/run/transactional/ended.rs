//! A transaction that ended under the layer: the handler sent `COMMIT` or `ROLLBACK`
//! (or `BEGIN … COMMIT`, from a helper written for a plain connection) on the
//! transaction's client.
//!
//! The claim row is then committed `running` with nobody to complete it, or rolled
//! back with the handler's writes up to that point, while what the handler wrote
//! after it may have committed on its own. Neither "no effect" nor running the key
//! again is then true or safe: the layer completes the key with `500
//! transaction-ended`, outside the ended transaction, and answers that.
//!
//! Found out at no extra cost on the path of a transaction that commits: the completion
//! matches only a claim row the open transaction wrote
//! (`PostgresStore::complete_in_transaction`). Where the layer rolls back instead, the
//! same check goes with the `ROLLBACK`, pipelined on tokio-postgres ([`roll_back_unless_ended`]).

use std::{task::Poll, time::Duration};

use bytes::Bytes;
use http::Response;
use tokio::{sync::oneshot, time::timeout};

use super::{Kept, lifecycle::Claimed};
use crate::{
    Outcome, StoredResponse,
    answers::with_outcome,
    body::ResponseBody,
    rejection::{Problem, Problems},
    store::{
        ClaimRequest, Lease,
        transaction::{Backend, Checked, TxConn, TxStore},
    },
};

/// The `detail` of `500 transaction-ended`.
const DETAIL: &str = "the request's handler ended its idempotency transaction itself (a COMMIT or ROLLBACK on its connection), so what it wrote may have been committed, in part or in whole, without its response; it is not run again under this key, and a retry with it gets this answer";

/// `500 transaction-ended`, as its client gets it.
fn problem(problems: &Problems) -> Response<Bytes> {
    problems.response(Problem::TransactionEnded, DETAIL)
}

/// `500 transaction-ended`, as the key stores it.
fn stored(problems: &Problems) -> StoredResponse {
    let (parts, body) = problem(problems).into_parts();
    StoredResponse {
        status: parts.status,
        headers: parts.headers,
        body,
    }
}

/// `500 transaction-ended`, for the client of the request whose transaction ended.
pub(crate) fn response<B>(problems: &Problems) -> Response<ResponseBody<B>> {
    with_outcome(problem(problems).map(ResponseBody::full), Outcome::Executed)
}

/// Whether `response` is a stored `500 transaction-ended`: a result of no job (whose
/// problems are the default documents).
pub(crate) fn is_stored(response: &StoredResponse) -> bool {
    response.status == Problem::TransactionEnded.status()
        && serde_json::from_slice::<serde_json::Value>(&response.body)
            .is_ok_and(|doc| doc["type"] == Problem::TransactionEnded.type_uri())
}

/// Completes the key of `claimed` with `500 transaction-ended`, outside its transaction,
/// which ended under the layer: the claim row if the handler committed it, or the key
/// afresh if the handler's `ROLLBACK` left it free; never a key another request holds
/// (`PostgresStore::finish_ended`). On `conn` if it is fit for it (its transaction
/// over), else on a connection that does not wait behind the pool; bounded by
/// `store_timeout`. Logged at `error`, with a hash of the key.
pub(crate) async fn finish(
    store: &TxStore,
    conn: Option<TxConn>,
    claimed: &Claimed,
    request: &ClaimRequest<'_>,
    store_timeout: Duration,
) {
    let key_hash = crate::request::short_hash(request.key.as_bytes());
    let key_hash = key_hash.as_str();
    let token = claimed.lease.token;
    let mut conn = conn;
    let finished = timeout(store_timeout, async {
        let finished = store
            .finish_ended(
                conn.as_mut(),
                &claimed.lease,
                &claimed.backend,
                &request.fingerprint,
                &(claimed.sealing).seal(
                    &claimed.lease.scope,
                    &claimed.lease.key,
                    stored(&claimed.problems),
                ),
                request.ttl,
            )
            .await;
        if let (Ok(_), Some(conn)) = (&finished, conn.take()) {
            conn.done();
        }
        finished
    })
    .await;
    const ENDED: &str = "the handler ended the request's transaction itself (COMMIT or ROLLBACK on its client): what it wrote may have committed without its response";
    match finished {
        Ok(Ok(true)) => tracing::error!(
            key_hash,
            token = %token,
            "{ENDED}; the key is completed with 500 transaction-ended, so it is not run again"
        ),
        Ok(Ok(false)) => tracing::error!(
            key_hash,
            token = %token,
            "{ENDED}; another request holds the key now, and its client gets 500 transaction-ended unstored"
        ),
        Ok(Err(e)) => tracing::error!(
            key_hash,
            token = %token,
            error = %e,
            "{ENDED}; the key could not be completed with 500 transaction-ended, and if the handler committed the claim, it runs again once its lease lapses"
        ),
        Err(_) => tracing::error!(
            key_hash,
            token = %token,
            "{ENDED}; the key could not be completed with 500 transaction-ended in time, and if the handler committed the claim, it runs again once its lease lapses"
        ),
    }
}

/// What became of a transaction the layer rolled back after its handler ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use]
pub(crate) enum RolledBack {
    /// Rolled back (or its connection closed, which rolls it back): nothing of it
    /// committed, and the key is free.
    Yes,
    /// It had ended under the layer; the key is finished with `500 transaction-ended`
    /// ([`finish`]), which is the answer.
    Ended,
}

/// Rolls back the transaction of `claimed` after its handler ran, bounded by
/// `store_timeout`, unless it had already ended under the layer: then the key is
/// finished ([`finish`]). One round trip: the check that the claim row is still the
/// transaction's goes with the `ROLLBACK` (and, the first time on a connection, one
/// more to prepare it). A transaction aborted by a failed statement cannot be checked
/// so; once rolled back, [`finish_if_claim_committed`] tells.
pub(crate) async fn roll_back_unless_ended(
    store: &TxStore,
    conn: TxConn,
    claimed: &Claimed,
    request: &ClaimRequest<'_>,
    store_timeout: Duration,
) -> RolledBack {
    match store
        .roll_back_checking(conn, &claimed.lease, store_timeout)
        .await
    {
        Checked::RolledBack => RolledBack::Yes,
        Checked::NotOurs(conn) => {
            finish(store, conn, claimed, request, store_timeout).await;
            RolledBack::Ended
        }
        // In a transaction aborted by a statement of the handler's, say.
        Checked::Aborted(conn) => {
            finish_if_claim_committed(store, conn, claimed, request, store_timeout).await
        }
    }
}

/// Finishes the key ([`finish`]) if the handler had committed the layer's transaction,
/// which then ended in a way that could not tell: the claim row is committed `running`,
/// as the claim wrote it (`PostgresStore::claim_committed_alone`). For a transaction
/// found aborted by a failed statement, and rolled back since (on `conn`, back outside
/// any transaction, or `None` if the `ROLLBACK` got no answer): it may be one the
/// handler began after its `COMMIT` (`COMMIT; BEGIN` and then a failed statement, from
/// helpers written for a plain connection). For one whose session ended while its work
/// kept the client (`conn` is `None`). One read of one row, on these paths only;
/// bounded by `store_timeout`. If the read fails, the transaction is taken as rolled
/// back, as it usually is.
pub(crate) async fn finish_if_claim_committed(
    store: &TxStore,
    conn: Option<TxConn>,
    claimed: &Claimed,
    request: &ClaimRequest<'_>,
    store_timeout: Duration,
) -> RolledBack {
    let mut conn = conn;
    let alone = store.claim_committed_alone(conn.as_mut(), &claimed.lease, &claimed.backend);
    let alone = timeout(store_timeout, alone).await;
    match alone {
        Ok(Ok(true)) => {
            finish(store, conn, claimed, request, store_timeout).await;
            RolledBack::Ended
        }
        Ok(Ok(false)) => {
            if let Some(conn) = conn {
                conn.done();
            }
            RolledBack::Yes
        }
        Ok(Err(e)) => {
            tracing::error!(
                error = %e,
                "whether the handler had committed the request's transaction could not be checked; taken as not committed"
            );
            RolledBack::Yes
        }
        Err(_) => {
            tracing::error!(
                "whether the handler had committed the request's transaction could not be checked in time; taken as not committed"
            );
            RolledBack::Yes
        }
    }
}

/// Settles a transaction whose work kept its client past the response
/// ([`TransactionHandle::take`](super::TransactionHandle::take) gave up on it): one that
/// had ended under the layer, its session living on, was ended by the handler
/// ([`finish`]); one whose session is gone was rolled back with it, and one whose
/// session cannot be told apart rolls back once the work lets go, unless in either case
/// the handler had committed it before ([`finish_if_claim_committed`]).
pub(crate) async fn kept(
    store: &TxStore,
    kept: Kept,
    claimed: &Claimed,
    request: &ClaimRequest<'_>,
    store_timeout: Duration,
) -> RolledBack {
    match kept {
        Kept::RolledBack => RolledBack::Yes,
        Kept::Ended => {
            finish(store, None, claimed, request, store_timeout).await;
            RolledBack::Ended
        }
        // Gone, or not to be told apart: whether the handler had committed the claim
        // says whether the key is finished or free.
        Kept::SessionGone | Kept::Hidden => {
            finish_if_claim_committed(store, None, claimed, request, store_timeout).await
        }
    }
}

/// Runs `future`, the rest of a request whose key `claimed` holds (its handler, and the
/// end of its transaction), keeping the claim from lapsing should the handler commit
/// it. A `COMMIT` of the handler's commits the claim row `running`, with the lease the
/// claim gave it (`request.lease`, from the transaction's start), outside any
/// transaction the layer holds; nothing else renews it, and a handler that ran on past that lease would
/// be taken over by a retry and run again before the layer finishes the key. So from a
/// third of the lease on, a task of its own renews the lease of the claim row every
/// third of the lease, if it is committed `running` as the claim wrote it
/// (`PostgresStore::renew_committed_claim`), until `future` is done. While the
/// transaction is open, which is always unless the handler ends it, that statement
/// matches nothing and waits on nothing. A request that ends within a third of the
/// lease costs a timer and nothing more. The task is started when this future is
/// polled after a third of the lease: a handler that blocks its thread from before then
/// starts it only when it yields.
pub(crate) async fn keeping_claim<F: Future>(
    store: &TxStore,
    claimed: &Claimed,
    request: &ClaimRequest<'_>,
    future: F,
) -> F::Output {
    let mut future = std::pin::pin!(future);
    let mut due = std::pin::pin!(tokio::time::sleep(request.lease / 3));
    let mut renewing: Option<oneshot::Sender<()>> = None;
    std::future::poll_fn(|cx| {
        if let Poll::Ready(output) = future.as_mut().poll(cx) {
            return Poll::Ready(output);
        }
        if renewing.is_none() && due.as_mut().poll(cx).is_ready() {
            let (stop, stopped) = oneshot::channel();
            let key_hash = crate::request::short_hash(request.key.as_bytes());
            let renewal = renew(
                store.clone(),
                claimed.lease.clone(),
                claimed.backend,
                request.lease,
                key_hash,
                stopped,
            );
            tokio::spawn(renewal);
            renewing = Some(stop);
        }
        Poll::Pending
    })
    .await
    // Dropping `renewing` stops the task.
}

/// The renewal task of [`keeping_claim`]: renews at once, then every third of `lease`,
/// until `stopped` (its sender dropped).
async fn renew(
    store: TxStore,
    claim: Lease,
    backend: Backend,
    lease: Duration,
    key_hash: crate::request::ShortHash,
    mut stopped: oneshot::Receiver<()>,
) {
    let period = lease / 3;
    let mut told = false;
    loop {
        // Not raced against the stop: a renewal on its way finishes (dropped midway, it
        // would close its connection).
        let renewed = timeout(period, store.renew_committed_claim(&claim, &backend, lease));
        match renewed.await {
            Ok(Ok(true)) if !told => {
                told = true;
                tracing::error!(
                    key_hash = key_hash.as_str(),
                    token = %claim.token,
                    "the handler committed the request's transaction itself and runs on; its claim is kept running until the layer finishes the key"
                );
            }
            Ok(Ok(_)) => {}
            Ok(Err(e)) => tracing::warn!(
                key_hash = key_hash.as_str(),
                error = %e,
                "could not renew the lease of a claim its handler may have committed"
            ),
            Err(_) => tracing::warn!(
                key_hash = key_hash.as_str(),
                "no answer in time to the renewal of a claim its handler may have committed"
            ),
        }
        tokio::select! {
            biased;
            _ = &mut stopped => return,
            () = tokio::time::sleep(period) => {}
        }
    }
}
