//! What a claim means for the request, or job, that made it: run the work under the
//! lease it got; replay the stored result; wait for, or refuse, a request still
//! running; or refuse a request whose fingerprint differs from the key's.

use std::time::Duration;

use http::Response;

use crate::{
    Fingerprint, StoredResponse,
    answers::{in_progress, mismatch, replay, response_expired, unreadable},
    body::ResponseBody,
    layer::Config,
    store::{Claim, ClaimRequest, Lease},
};

/// What a claim means for its claimant.
pub(crate) enum Decision {
    /// The key is ours: run the work under this lease.
    Run(Lease),
    /// The key was completed by a request with the same fingerprint: its result.
    Replay(StoredResponse),
    /// A request with the same fingerprint holds the key and still runs; its lease
    /// lapses after `retry_after`.
    Running { retry_after: Duration },
    /// The key belongs to a request with another fingerprint, running, done or
    /// remembered.
    Mismatch,
    /// The key was completed by a request with the same fingerprint, and its result is
    /// gone: remembered only. Nothing runs.
    Remembered {
        status: http::StatusCode,
        completed_at: std::time::SystemTime,
        remembered_until: std::time::SystemTime,
    },
}

/// `claim`, made with `fingerprint`, decided; a record is compared with the request
/// the way its fingerprint was computed ([`Fingerprint::as_recorded`]).
pub(crate) fn decide(claim: Claim, fingerprint: Fingerprint) -> Decision {
    match claim {
        Claim::Acquired(lease) => Decision::Run(lease),
        // A remembered key met with another request is refused as it was while its
        // response was kept (422, key-reused): that the key belongs to another request
        // is what the client must fix, and the more precise answer; neither runs.
        Claim::Completed { fingerprint: f, .. }
        | Claim::Running { fingerprint: f, .. }
        | Claim::Remembered { fingerprint: f, .. }
            if !fingerprint.matches(&f) =>
        {
            Decision::Mismatch
        }
        Claim::Completed { response, .. } => Decision::Replay(response),
        Claim::Running { retry_after, .. } => Decision::Running { retry_after },
        Claim::Remembered {
            status,
            completed_at,
            remembered_until,
            ..
        } => Decision::Remembered {
            status,
            completed_at,
            remembered_until,
        },
    }
}

/// The lease when the claim is ours to run; otherwise the answer: 422 for another
/// request's key, the replay, or 409 while it runs, telling the client to retry after
/// `in_progress_retry_after`, or sooner if the running request's lease lapses sooner. Both modes
/// answer through here.
// The `Err` is the response itself, returned to the client at once, not an error to box.
#[allow(clippy::result_large_err)]
pub(crate) fn lease_or_answer<B>(
    claim: Claim,
    fingerprint: Fingerprint,
    config: &Config,
) -> Result<Lease, Response<ResponseBody<B>>> {
    match decide(claim, fingerprint) {
        Decision::Run(lease) => Ok(lease),
        Decision::Mismatch => Err(mismatch(&config.problems)),
        Decision::Replay(response) => Err(replay(response)),
        Decision::Remembered {
            status,
            completed_at,
            remembered_until,
        } => Err(response_expired(
            &config.problems,
            status,
            completed_at,
            remembered_until,
        )),
        Decision::Running { retry_after } => Err(in_progress(
            &config.problems,
            retry_after,
            config.in_progress_retry_after,
        )),
    }
}

/// [`lease_or_answer`] for `claim`, made by `request` with the client's `key`, once
/// what it found is opened ([`Sealing::opened`](super::sealing::Sealing::opened)):
/// `500 response-unreadable` if it cannot be.
#[allow(clippy::result_large_err)]
pub(crate) fn opened_or_answer<B>(
    claim: Claim,
    request: &ClaimRequest<'_>,
    key: &str,
    config: &Config,
) -> Result<Lease, Response<ResponseBody<B>>> {
    match config.sealing.opened(claim, request, key) {
        Ok(claim) => lease_or_answer(claim, request.fingerprint, config),
        Err(_) => Err(unreadable(&config.problems)),
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, SystemTime};

    use super::*;

    fn remembered(fingerprint: Fingerprint) -> Claim {
        let completed_at = SystemTime::now();
        Claim::Remembered {
            fingerprint,
            status: http::StatusCode::CREATED,
            completed_at,
            remembered_until: completed_at + Duration::from_secs(60),
        }
    }

    #[test]
    fn a_remembered_key_refuses_its_own_request_as_expired_and_another_as_reused() {
        let (mine, other) = (Fingerprint::new([1; 32]), Fingerprint::new([2; 32]));
        assert!(matches!(
            decide(remembered(mine), mine),
            Decision::Remembered { status, .. } if status == 201
        ));
        assert!(matches!(
            decide(remembered(mine), other),
            Decision::Mismatch
        ));
    }
}
