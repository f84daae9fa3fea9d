//! A transaction's life in transactional mode, every statement bounded by the store
//! timeout: opened with the claim, then committed with the completion, or rolled back;
//! a `COMMIT` with no answer is in doubt, and checked on another connection.

use std::{sync::Arc, time::Duration};

use tokio::time::{Instant, timeout, timeout_at};

use super::ended;
use crate::{
    StoredResponse,
    observe::{Mode, Timer, store_failed},
    rejection::Problems,
    run::{sealing::Sealing, steps::StepLog},
    store::{
        Claim, ClaimRequest, Fenced, Lease, PostgresStore, StoreErrorKind,
        transaction::{
            Backend, Checkout, Resolution, again_if_it_lost_a_race, commit_on, connection_lost,
            describe, in_an_aborted_transaction, roll_back_keeping, roll_back_or_close,
            statement_cancelled,
        },
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
    Acquired(Checkout, Claimed),
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
/// `claim_wait`; the transaction then goes on with `lock_timeout`, set again in the
/// same round trip where the two differ.
pub(crate) async fn open(
    store: &PostgresStore,
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
    store: &PostgresStore,
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
    let Ok(_permit) = timeout(store_timeout + claim_wait, store.tx_claim_permit()).await else {
        tracing::error!("too many transactional claims waiting; nothing was run");
        return Opened::Unavailable;
    };
    let conn = match timeout(store_timeout, store.client()).await {
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
    let claimed = timeout(store_timeout + claim_wait, async {
        let client = &*conn;
        // Where transactions default to repeatable read or serializable, a duplicate
        // that waited on the first request's row fails so once that row commits: it
        // looks again, in a new transaction.
        let mut again = false;
        again_if_it_lost_a_race(|| {
            let retry = std::mem::replace(&mut again, true);
            async move {
                if retry {
                    store.send_rollback(client).await?;
                }
                let token = crate::store::FencingToken::fresh();
                let then = (claim_wait != lock_timeout).then_some(lock_timeout);
                store
                    .begin_and_claim(client, claim_wait, request, token, then)
                    .await
            }
        })
        .await
    })
    .await;
    match claimed {
        Ok(Ok((Claim::Acquired(lease), backend))) => {
            let claim = (&lease, backend, request.fingerprint);
            let steps = crate::run::steps::in_transaction(store, claim, sealing, store_timeout);
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
            tokio::spawn(roll_back_or_close(conn, store_timeout));
            Opened::Found(found)
        }
        // A lock timeout on the first request's row, or a key that kept changing under
        // the claim: another request is at work on it. A statement cancelled by
        // `statement_timeout` is a slow database, like any other store failure.
        Ok(Err(e)) if e.kind() == StoreErrorKind::Timeout && !statement_cancelled(&e) => {
            roll_back_or_close(conn, store_timeout).await;
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
    store: &PostgresStore,
    conn: Option<Checkout>,
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
/// ([`PostgresStore::committed_on`]).
async fn resolve(
    store: &PostgresStore,
    claimed: &Claimed,
    request: &ClaimRequest<'_>,
    sent: &StoredResponse,
    lock_timeout: Duration,
    store_timeout: Duration,
) -> Option<Resolution> {
    timeout(store_timeout + lock_timeout, async {
        let conn = store.client().await.ok()?;
        // Read committed whatever the database's default: the read must see what
        // committed while the insert waited.
        store.begin_read_committed(&conn, lock_timeout).await.ok()?;
        let resolved = store
            .committed_on(
                &conn,
                &claimed.lease,
                &claimed.backend,
                &request.fingerprint,
                sent,
            )
            .await;
        roll_back_or_close(conn, store_timeout).await;
        resolved.ok()
    })
    .await
    .ok()
    .flatten()
}

/// Writes the response into the claim row and commits, pipelined: one round trip, one
/// commit, bounded by `store_timeout`. The completion matches only a row this
/// transaction wrote: if it matches nothing, the transaction had ended under the layer
/// ([`Committed::Ended`]). If the connection fails during the `COMMIT`, or no answer
/// comes in time, finds out on another connection whether it committed ([`resolve`]).
pub(crate) async fn commit(
    store: &PostgresStore,
    conn: Checkout,
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
    if claimed.steps.has_steps() {
        let forgetting = store.forget_steps_on(&conn, &claimed.lease);
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
    store: &PostgresStore,
    conn: Checkout,
    claimed: &Claimed,
    request: &ClaimRequest<'_>,
    stored: &StoredResponse,
    lock_timeout: Duration,
    store_timeout: Duration,
) -> Committed {
    let client = &*conn;
    // Prepared first, so that its Execute is on the wire before the COMMIT. Given up
    // on, the connection is closed with the transaction open, which rolls it back: no
    // COMMIT was sent.
    match timeout(store_timeout, store.prepare_completion(client)).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) if in_an_aborted_transaction(&e) => {
            let conn = roll_back_keeping(conn, store_timeout).await;
            return aborted(store, conn, claimed, request, store_timeout).await;
        }
        Ok(Err(e)) => {
            tracing::error!(error = %e, "the transaction was not committed");
            return Committed::No;
        }
        Err(_) => {
            tracing::error!(
                "no answer in time to preparing the completion; the transaction was not committed, and its connection is closed"
            );
            return Committed::No;
        }
    }
    let deadline = Instant::now() + store_timeout;
    let (completed, committed) = tokio::join!(
        timeout_at(
            deadline,
            store.complete_in_transaction(client, &claimed.lease, stored, request.ttl)
        ),
        timeout_at(deadline, commit_on(client)),
    );
    // The server answered the COMMIT, or refused it (a serialization failure, say): the
    // transaction is over and the connection fit for the pool.
    let answered = match &committed {
        Ok(Ok(())) => true,
        Ok(Err(e)) => e.as_db_error().is_some(),
        Err(_) => false,
    };
    let lost = match &committed {
        Ok(Err(e)) => connection_lost(e),
        Ok(Ok(())) => false,
        Err(_) => true,
    };
    match completed {
        Ok(Ok(Fenced::Kept)) if matches!(committed, Ok(Ok(()))) => {
            conn.done();
            return Committed::Yes;
        }
        // Nothing matched: the claim row is not this transaction's any more, so the
        // completion ran outside it. Whatever the COMMIT then did, it was not ours.
        Ok(Ok(Fenced::LeaseLost)) => {
            let conn = answered.then_some(conn);
            ended::finish(store, conn, claimed, request, store_timeout).await;
            return Committed::Ended;
        }
        // The COMMIT of an aborted transaction rolls it back, and succeeds at that.
        Ok(Err(ref e)) if in_an_aborted_transaction(e) && matches!(committed, Ok(Ok(()))) => {
            return aborted(store, Some(conn), claimed, request, store_timeout).await;
        }
        _ => {}
    }
    let completed = match completed {
        Ok(completed) => completed.map_err(|e| e.to_string()),
        Err(_) => Err("no answer in time".to_owned()),
    };
    let committed = match committed {
        Ok(committed) => committed.map_err(|e| describe(&e)),
        Err(_) => Err("no answer in time".to_owned()),
    };
    if lost {
        // No answer from the server to the COMMIT (the connection failed, the server
        // ended the session, or it did not answer in time): it may have committed all
        // the same. Dropped, the connection is closed.
        tracing::error!(
            ?completed,
            ?committed,
            "no answer to COMMIT; checking whether it committed"
        );
        drop(conn);
        return match resolve(store, claimed, request, stored, lock_timeout, store_timeout).await {
            Some(Resolution::Committed) => Committed::Yes,
            Some(Resolution::NotCommitted) => Committed::No,
            Some(Resolution::ClaimAlone) => {
                ended::finish(store, None, claimed, request, store_timeout).await;
                Committed::Ended
            }
            None => Committed::Unknown,
        };
    }
    // A failed statement aborts the transaction, and COMMIT then rolls it back.
    tracing::error!(?completed, ?committed, "the transaction was not committed");
    if answered {
        conn.done();
    }
    Committed::No
}
