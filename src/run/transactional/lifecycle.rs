//! A transaction's life in transactional mode, every statement bounded by the store
//! timeout: opened with the claim, then committed with the completion, or rolled back;
//! a `COMMIT` with no answer is in doubt, and checked on another connection.

use std::{sync::Arc, time::Duration};

use tokio::time::timeout;

use super::ended;
use crate::{
    StoredResponse,
    observe::{Mode, Timer, store_failed},
    rejection::Problems,
    run::{sealing::Sealing, steps::StepLog},
    store::{
        Claim, ClaimRequest, Lease, StoreErrorKind,
        transaction::{Backend, CommitEnd, Resolution, TxConn, TxStore, statement_cancelled},
    },
};

/// A key claimed in an open transaction.
#[derive(Debug)]
pub(crate) struct Claimed {
    /// The claim row's lease: the key, and the token the row carries.
    pub(crate) lease: Lease,
    /// The session and transaction that hold the row.
    pub(crate) backend: Backend,
    /// How the layer words its problems: the key is completed with one if the
    /// transaction ends under it.
    pub(crate) problems: Arc<Problems>,
    /// Seals what the key is completed with, if the layer has keys.
    pub(crate) sealing: Sealing,
    /// The steps of the run (recorded apart from the transaction), forgotten in it
    /// when it commits.
    pub(crate) steps: Arc<StepLog>,
}

/// The result of opening a transaction and claiming the key in it.
pub(crate) enum Opened {
    /// The claim row is ours, uncommitted, in this transaction.
    Acquired(TxConn, Claimed),
    /// Completed or running under another request (the transaction is rolled back).
    Found(Claim),
    /// The first request held its row past the lock timeout (or the key kept changing
    /// under the claim).
    Busy,
    /// No connection, or the database failed.
    Unavailable,
}

/// Takes a connection, then sends BEGIN and the claim together: one round trip on
/// tokio-postgres, two on sqlx (`TxStore::begin_and_claim`). A duplicate's claim
/// waits here on the first request's uncommitted row, up to `claim_wait`; the
/// transaction then goes on with `lock_timeout`, which the claim sets once it has run
/// where the two differ.
pub(crate) async fn open(
    store: &TxStore,
    request: &ClaimRequest<'_>,
    (problems, sealing): (&Arc<Problems>, &Sealing),
    claim_wait: Duration,
    lock_timeout: Duration,
    store_timeout: Duration,
) -> Opened {
    let timer = Timer::start();
    let opened = claim_in(
        store,
        request,
        (problems, sealing),
        claim_wait,
        lock_timeout,
        store_timeout,
    )
    .await;
    timer.claimed(Mode::Transactional);
    if matches!(opened, Opened::Unavailable) {
        store_failed("claim");
    }
    opened
}

/// [`open`], untimed.
async fn claim_in(
    store: &TxStore,
    request: &ClaimRequest<'_>,
    (problems, sealing): (&Arc<Problems>, &Sealing),
    claim_wait: Duration,
    lock_timeout: Duration,
    store_timeout: Duration,
) -> Opened {
    // Duplicates block on the first request's row while holding a connection; the
    // permit keeps them from taking the connections its handler needs. Waiting for one
    // past the bound is this process's overload, not a running duplicate: 503, like a
    // pool with no connection to give.
    let Ok(_permit) = timeout(store_timeout + claim_wait, store.claim_permit()).await else {
        tracing::error!("too many transactional claims waiting; nothing was run");
        return Opened::Unavailable;
    };
    let mut conn = match timeout(store_timeout, store.connection()).await {
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
    // Where transactions default to repeatable read or serializable, a duplicate that
    // waited on the first request's row fails so once that row commits: it looks
    // again, in a new transaction.
    let then = (claim_wait != lock_timeout).then_some(lock_timeout);
    let claiming = store.begin_and_claim(&mut conn, claim_wait, request, then);
    let claimed = timeout(store_timeout + claim_wait, claiming).await;
    match claimed {
        Ok(Ok((Claim::Acquired(lease), backend))) => {
            let claim = (&lease, backend, request.fingerprint);
            let steps = store.steps(claim, sealing, store_timeout);
            Opened::Acquired(
                conn,
                Claimed {
                    lease,
                    backend,
                    problems: problems.clone(),
                    sealing: sealing.clone(),
                    steps,
                },
            )
        }
        Ok(Ok((found, _))) => {
            // Nothing was written: the answer need not wait for the ROLLBACK; the
            // connection goes back to the pool when it is done, or is closed if the
            // database does not answer it in time.
            tokio::spawn(conn.roll_back_or_close(store_timeout));
            Opened::Found(found)
        }
        // A lock timeout on the first request's row, or a key that kept changing under
        // the claim: another request is at work on it. A statement cancelled by
        // `statement_timeout` is a slow database, like any other store failure.
        Ok(Err(e)) if e.kind() == StoreErrorKind::Timeout && !statement_cancelled(&e) => {
            conn.roll_back_or_close(store_timeout).await;
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
    /// The database did not answer the `COMMIT` (the connection failed, or no answer
    /// came within the store timeout), and whether it committed could not be checked
    /// in time either.
    Unknown,
    /// The transaction had ended before the layer's `COMMIT`: the handler committed or
    /// rolled it back itself. The key is finished with `500 transaction-ended`
    /// ([`ended::finish`]).
    Ended,
}

/// A transaction found aborted by a failed statement, and rolled back (on `conn`, back
/// outside any transaction): [`Committed::Aborted`], unless the aborted transaction was
/// one the handler began after committing the layer's ([`ended::finish_if_claim_committed`]).
async fn aborted(
    store: &TxStore,
    conn: Option<TxConn>,
    claimed: &Claimed,
    request: &ClaimRequest<'_>,
    store_timeout: Duration,
) -> Committed {
    match ended::finish_if_claim_committed(store, conn, claimed, request, store_timeout).await {
        ended::RolledBack::Yes => Committed::Aborted,
        ended::RolledBack::Ended => Committed::Ended,
    }
}

/// Finds out how a transaction whose `COMMIT` was in doubt ended (`None`: the
/// database could not tell in time), on another connection, in a transaction of its own
/// that it rolls back: it waits for the first transaction to end if the server is still
/// running it (up to `lock_timeout`), then reads the key's row
/// (`PostgresStore::committed_on`).
async fn resolve(
    store: &TxStore,
    claimed: &Claimed,
    request: &ClaimRequest<'_>,
    sent: &StoredResponse,
    lock_timeout: Duration,
    store_timeout: Duration,
) -> Option<Resolution> {
    let resolving = store.committed_elsewhere(
        &claimed.lease,
        &claimed.backend,
        &request.fingerprint,
        sent,
        (lock_timeout, store_timeout),
    );
    timeout(store_timeout + lock_timeout, resolving)
        .await
        .ok()
        .flatten()
}

/// Writes the response into the claim row and commits (pipelined on tokio-postgres: one
/// round trip; two on sqlx), one commit, bounded by `store_timeout`. The completion
/// matches only a row this transaction wrote: if it matches nothing, the transaction had ended under the layer
/// ([`Committed::Ended`]). If the connection fails during the `COMMIT`, or no answer
/// comes in time, finds out on another connection whether it committed ([`resolve`]).
pub(crate) async fn commit(
    store: &TxStore,
    conn: TxConn,
    claimed: &Claimed,
    request: &ClaimRequest<'_>,
    stored: &StoredResponse,
    lock_timeout: Duration,
    store_timeout: Duration,
) -> Committed {
    let timer = Timer::start();
    // The steps recorded on the way, of no use once the response is stored, go with
    // the commit; a rollback keeps them for a retry. Failed, the transaction is aborted,
    // which the completion finds.
    let mut conn = conn;
    if claimed.steps.has_steps() {
        let forgetting = store.forget_steps(&mut conn, &claimed.lease);
        match timeout(store_timeout, forgetting).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!(error = %e, "the steps could not be forgotten"),
            Err(_) => {
                tracing::error!(
                    "no answer in time to forgetting the steps; the transaction was not committed, and its connection is closed"
                );
                return Committed::No;
            }
        }
    }
    // Sealed once: the check of a COMMIT in doubt compares what was sent.
    let sealed = (claimed.sealing).seal(&claimed.lease.scope, &claimed.lease.key, stored.clone());
    let committed = complete_and_commit(
        store,
        conn,
        claimed,
        request,
        &sealed,
        lock_timeout,
        store_timeout,
    )
    .await;
    timer.completed(Mode::Transactional);
    if matches!(committed, Committed::No | Committed::Unknown) {
        store_failed("commit");
    }
    committed
}

/// [`commit`], untimed.
async fn complete_and_commit(
    store: &TxStore,
    conn: TxConn,
    claimed: &Claimed,
    request: &ClaimRequest<'_>,
    stored: &StoredResponse,
    lock_timeout: Duration,
    store_timeout: Duration,
) -> Committed {
    let committing =
        store.complete_and_commit(conn, &claimed.lease, stored, request.ttl, store_timeout);
    match committing.await {
        CommitEnd::Committed => Committed::Yes,
        // Nothing matched: the claim row is not this transaction's any more, so the
        // completion ran outside it. Whatever the COMMIT then did, it was not ours.
        CommitEnd::NotOurs(conn) => {
            ended::finish(store, conn, claimed, request, store_timeout).await;
            Committed::Ended
        }
        CommitEnd::Aborted(conn) => aborted(store, conn, claimed, request, store_timeout).await,
        CommitEnd::InDoubt(what) => {
            // No answer from the server to the COMMIT (the connection failed, the
            // server ended the session, or it did not answer in time): it may have
            // committed all the same. The connection is closed.
            tracing::error!(what, "no answer to COMMIT; checking whether it committed");
            let resolved = resolve(store, claimed, request, stored, lock_timeout, store_timeout);
            match resolved.await {
                Some(Resolution::Committed) => Committed::Yes,
                Some(Resolution::NotCommitted) => Committed::No,
                Some(Resolution::ClaimAlone) => {
                    ended::finish(store, None, claimed, request, store_timeout).await;
                    Committed::Ended
                }
                None => Committed::Unknown,
            }
        }
        CommitEnd::Failed(what) => {
            // A failed statement aborts the transaction, and COMMIT then rolls it back.
            tracing::error!(what, "the transaction was not committed");
            Committed::No
        }
    }
}
