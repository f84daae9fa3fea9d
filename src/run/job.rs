//! What a job's run needs whichever mode runs it: its work started with a panic
//! caught, a claim's meaning for a job, and its result as a stored record.

use bytes::Bytes;
use http::StatusCode;

use crate::{
    StoredResponse,
    job::{JobContext, JobError, JobOutcome},
    run::{
        decision::{Decision, decide},
        sealing::Sealing,
    },
    store::{Claim, ClaimRequest, Lease, StoreError, StoreErrorKind},
};
/// Calls `work` for its future. A panic of the function itself, before the future
/// exists, is caught like a panic of the future (`None`), so that the key claimed for it
/// is released rather than held until its lease lapses.
pub(crate) fn started<F, Fut>(work: F, ctx: JobContext) -> Option<Fut>
where
    F: FnOnce(JobContext) -> Fut,
{
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| work(ctx))) {
        Ok(future) => Some(future),
        Err(panic) => {
            tracing::error!(
                panic = crate::catch_panic::message(&panic),
                "the job panicked before its work began"
            );
            None
        }
    }
}

/// A job's result as a stored record.
pub(crate) fn stored(result: &Bytes) -> StoredResponse {
    StoredResponse {
        status: StatusCode::OK,
        headers: http::HeaderMap::new(),
        body: result.clone(),
    }
}

/// What a claim means for a job ([`decide`]), once what it found is opened
/// ([`Sealing::opened`]; a stored result that cannot be is a [`Corrupt`] store error,
/// and nothing runs): `Ok(Ok(lease))` to run; `Ok(Err(outcome))` when there is nothing
/// to run. `key` is the caller's (`request` holds it as stored).
///
/// [`Corrupt`]: StoreErrorKind::Corrupt
pub(crate) fn found<E>(
    claim: Claim,
    request: &ClaimRequest<'_>,
    key: &str,
    sealing: &Sealing,
) -> Result<Result<Lease, JobOutcome>, JobError<E>> {
    let claim = sealing.opened(claim, request, key).map_err(|unreadable| {
        JobError::Store(StoreError::new(
            StoreErrorKind::Corrupt,
            format!(
                "the key's stored result could not be opened: {unreadable}; the work was not run"
            ),
        ))
    })?;
    match decide(claim, request.fingerprint) {
        Decision::Run(lease) => Ok(Ok(lease)),
        Decision::Mismatch => Err(JobError::Mismatch),
        // The work ended its transaction itself, and the key was completed so.
        #[cfg(feature = "postgres")]
        Decision::Replay(response)
            if crate::run::transactional::is_transaction_ended(&response) =>
        {
            Err(JobError::TransactionEnded)
        }
        Decision::Replay(response) => Ok(Err(JobOutcome::AlreadyDone(response.body))),
        Decision::Running { retry_after } => Ok(Err(JobOutcome::Running { retry_after })),
        Decision::Remembered {
            completed_at,
            remembered_until,
            ..
        } => Ok(Err(JobOutcome::ResultExpired {
            completed_at,
            remembered_until,
        })),
    }
}
