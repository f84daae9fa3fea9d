//! A job in transactional mode ([`JobRunner::transactional`](crate::job::JobRunner::transactional)):
//! the key claimed in the transaction the work writes in, the result stored and
//! committed with it, and every way that can end (the work fails, panics, keeps its
//! client, or ends the transaction itself) settled as the layer settles a request.

use std::{sync::Arc, time::Duration};

use bytes::Bytes;
use tracing::Instrument;

use super::{
    Committed, Opened, RolledBack, commit, finish_kept, keeping_claim, open,
    roll_back_unless_ended, take_back,
};
use crate::{
    IdempotencyKey, ShutdownHandle,
    job::{JobContext, JobError, JobOutcome},
    run::{
        job::{found, started, stored},
        previous::{Reader, job_answer},
        sealing::Sealing,
    },
    shutdown::InFlight,
    store::{ClaimRequest, StoreError, StoreErrorKind, transaction::TxStore},
    transactional::Slot,
};

/// Runs `work` once for the key of `request`, in the transaction that claims it, and
/// commits its result with what it wrote.
pub(crate) async fn run_job<F, Fut, E>(
    store: &TxStore,
    (lock_timeout, store_timeout): (Duration, Duration),
    shutdown: &ShutdownHandle,
    request: &ClaimRequest<'_>,
    (key, sealing): (IdempotencyKey, &Sealing),
    work: F,
    in_flight: InFlight,
) -> Result<JobOutcome, JobError<E>>
where
    F: FnOnce(JobContext) -> Fut,
    Fut: Future<Output = Result<Bytes, E>> + Send + 'static,
    E: Send + 'static,
{
    let (conn, claimed) = match open(
        store,
        request,
        (&Arc::default(), sealing),
        lock_timeout,
        lock_timeout,
        store_timeout,
    )
    .await
    {
        // A run that waited on another worker's row may get it after `close()`:
        // nothing is claimed after the close, so it lets the row go.
        Opened::Acquired(conn, _) if shutdown.is_closed() => {
            conn.roll_back_or_close(store_timeout).await;
            return Err(JobError::ShuttingDown);
        }
        Opened::Acquired(conn, claimed) => {
            // A record from before encryption, under the key in clear, read in the
            // transaction: answered from there, the transaction rolled back.
            let reader = Reader::in_transaction(store, &conn);
            let earlier = job_answer(sealing, reader, request, key.as_str(), store_timeout);
            if let Some(answer) = earlier.await {
                conn.roll_back_or_close(store_timeout).await;
                return answer;
            }
            (conn, claimed)
        }
        Opened::Found(claim) => {
            return match found(claim, request, key.as_str(), sealing)? {
                Ok(_) => Err(JobError::Store(StoreError::new(
                    StoreErrorKind::Other,
                    "claim returned outside its transaction",
                ))),
                Err(outcome) => Ok(outcome),
            };
        }
        Opened::Busy => {
            return Ok(JobOutcome::Running {
                retry_after: Duration::from_secs(1),
            });
        }
        Opened::Unavailable => {
            return Err(JobError::Store(StoreError::new(
                StoreErrorKind::Unavailable,
                "the transaction could not be opened",
            )));
        }
    };
    let slot = Slot::holding(conn);
    let mut key = key;
    key.set_steps(crate::run::steps::Steps(Some(claimed.steps.clone())));
    let ctx = JobContext {
        key,
        transaction: slot.deadpool_handle(),
        #[cfg(feature = "sqlx")]
        sqlx_transaction: slot.sqlx_handle(),
    };
    // Renewed should the work commit the claim itself (see `keeping_claim`).
    let run = async {
        let (joined, conn) = match started(work, ctx) {
            Some(work) => {
                // Counted while it runs, even if the run is dropped and rolls back: a
                // drain waits for work that may still call other systems. The task
                // takes the transaction back from the work's handle itself: if the run
                // was dropped meanwhile, the connection is dropped with the task's
                // output, which rolls back, whatever copies of the handle live on.
                // A panic is caught there too, so that it is taken back then as well.
                let counted = in_flight.clone();
                let (taken, held, backend) = (slot.clone(), store.clone(), claimed.backend);
                let work = async move {
                    let _counted = counted;
                    let result = crate::catch_panic::catch_panic(work).await.ok();
                    let conn = take_back(&taken, &held, &backend, store_timeout);
                    (result, conn.await)
                };
                match tokio::spawn(work.in_current_span()).await {
                    Ok((result, conn)) => (result.ok_or(()), conn),
                    // The task itself was cancelled (the runtime shutting down).
                    Err(_) => {
                        let conn = take_back(&slot, store, &claimed.backend, store_timeout);
                        (Err(()), conn.await)
                    }
                }
            }
            None => {
                let conn = take_back(&slot, store, &claimed.backend, store_timeout);
                // The work never began, so it kept nothing.
                if let Ok(conn) = conn.await {
                    conn.roll_back_or_close(store_timeout).await;
                }
                return Err(JobError::Panicked);
            }
        };
        let conn = match conn {
            Ok(conn) => conn,
            // The work still held the transaction's client: nothing can be committed,
            // and the transaction may have ended under the runner meanwhile. Otherwise
            // what became of the work says more than that.
            Err(kept) => {
                let settled = finish_kept(store, kept, &claimed, request, store_timeout);
                if settled.await == RolledBack::Ended {
                    return Err(JobError::TransactionEnded);
                }
                return Err(match joined {
                    Ok(Err(e)) => JobError::Failed(e),
                    Err(_) => JobError::Panicked,
                    Ok(Ok(_)) => JobError::NotCommitted,
                });
            }
        };
        match joined {
            Ok(Ok(result)) => {
                // A work that succeeded although one of its statements failed (and so
                // aborted the transaction) has had no effect either.
                let sent = stored(&result);
                let timeouts = (lock_timeout, store_timeout);
                match commit(
                    store, conn, &claimed, request, &sent, timeouts.0, timeouts.1,
                )
                .await
                {
                    Committed::Yes => Ok(JobOutcome::Ran(result)),
                    Committed::Aborted | Committed::No | Committed::Unknown => {
                        Err(JobError::NotCommitted)
                    }
                    Committed::Ended => Err(JobError::TransactionEnded),
                }
            }
            // Rolled back, unless the work ended the transaction itself.
            failed => {
                let rolled_back =
                    roll_back_unless_ended(store, conn, &claimed, request, store_timeout);
                if rolled_back.await == RolledBack::Ended {
                    return Err(JobError::TransactionEnded);
                }
                Err(match failed {
                    Ok(Err(e)) => JobError::Failed(e),
                    _ => JobError::Panicked,
                })
            }
        }
    };
    keeping_claim(store, &claimed, request, run).await
}
