//! A deploy that changed how the layer computes scopes (`previous_scope_with`): a key
//! new in its request's scope is looked for under the scope the layer used before, so
//! that a request that ran, or runs, there is not run again.
//!
//! Only a claim that took its key runs this: a request whose claim found its key (a
//! replay, a `409`, a `422`) costs nothing more, nor does a layer without the setting.

use http::{Response, request::Parts};

use super::decision::opened_or_answer;
use crate::{
    Fingerprint, Scope,
    answers::unavailable,
    body::ResponseBody,
    layer::Config,
    shutdown::InFlight,
    store::{Claim, ClaimRequest, KeyRecord, KeyState, Lease, StoreError},
};

/// Lease mode: `lease` took the request's key in its scope. If the previous scope
/// holds the key, the answer in the handler's stead (a replay, a `409`, a `422`; a
/// `503` if the store did not answer), the lease then released; `None`: run it.
pub(crate) async fn answer_in_lease<B>(
    config: &Config,
    parts: &Parts,
    request: &ClaimRequest<'_>,
    key: &str,
    lease: &Lease,
    in_flight: &InFlight,
) -> Option<Response<ResponseBody<B>>> {
    let previous = config.scoping.previous_of(parts, request.scope)?;
    let looking = config.store.look_up(&previous, request.key);
    // The lease is not renewed yet: a read slower than a renewal's bound would leave it
    // to lapse before the handler starts, and a retry could take the key over.
    let bound = config.store_timeout.min(config.lease / 3);
    let looked = crate::store::within(bound, "a look-up", looking).await;
    let answer = answer(config, looked, &previous, request, key)?;
    config.leased().release(lease, in_flight.clone()).await;
    Some(answer)
}

/// Transactional mode: the request's key was claimed in the transaction on `conn`.
/// If the previous scope holds the key (a committed record: one still uncommitted in
/// another transaction is not seen), the answer in the handler's stead, for the caller
/// to roll the transaction back; `None`: run it.
#[cfg(feature = "postgres")]
pub(crate) async fn answer_in_transaction<B>(
    config: &Config,
    store: &crate::store::PostgresStore,
    conn: &crate::store::transaction::Checkout,
    parts: &Parts,
    request: &ClaimRequest<'_>,
    key: &str,
) -> Option<Response<ResponseBody<B>>> {
    let previous = config.scoping.previous_of(parts, request.scope)?;
    let looking = store.look_up_on(conn, &previous, request.key);
    let looked = crate::store::within(config.store_timeout, "a look-up", looking).await;
    answer(config, looked, &previous, request, key)
}

/// The answer a look-up under the previous scope calls for, if any: what it found
/// opened as the record of the key in `previous` (a sealed one is bound to its scope).
fn answer<B>(
    config: &Config,
    looked: Result<Option<KeyRecord>, StoreError>,
    previous: &Scope,
    request: &ClaimRequest<'_>,
    key: &str,
) -> Option<Response<ResponseBody<B>>> {
    match looked {
        Ok(record) => {
            let claim = standing(record, request.fingerprint)?;
            tracing::debug!(
                "the key is held under the layer's previous scope; answered from there"
            );
            // Never a lease: the record is another claim's.
            let there = ClaimRequest {
                scope: previous,
                ..request.clone()
            };
            Some(
                opened_or_answer(claim, &there, key, config)
                    .err()
                    .unwrap_or_else(|| unavailable(&config.problems)),
            )
        }
        Err(e) => {
            crate::observe::store_failed("look_up");
            tracing::error!(
                error = %e,
                "looking the key up under the layer's previous scope failed; the handler was not run"
            );
            Some(unavailable(&config.problems))
        }
    }
}

/// What a record found under the previous scope means for a request of `fingerprint`,
/// as a claim that found it would say; `None` when nothing stops the request from
/// running: no record, one a claim would take afresh (past its TTL), or a lapsed lease
/// of the same request, which a claim would take over and run again.
fn standing(record: Option<KeyRecord>, fingerprint: Fingerprint) -> Option<Claim> {
    let record = record?;
    if record.is_free() {
        return None;
    }
    match record.state {
        KeyState::Running { lease_left }
            if lease_left.is_zero() && record.fingerprint == fingerprint =>
        {
            None
        }
        KeyState::Running { lease_left } => Some(Claim::Running {
            fingerprint: record.fingerprint,
            retry_after: lease_left,
        }),
        KeyState::Completed { response } => Some(Claim::Completed {
            fingerprint: record.fingerprint,
            response,
        }),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::{StoredResponse, store::FencingToken};

    const MINE: Fingerprint = Fingerprint([1; 32]);
    const OTHER: Fingerprint = Fingerprint([2; 32]);
    const LIVE: Duration = Duration::from_secs(60);

    fn running(fingerprint: Fingerprint, lease_left: Duration, expires_in: Duration) -> KeyRecord {
        KeyRecord::running(FencingToken::new(1), fingerprint, lease_left, expires_in)
    }

    fn completed(fingerprint: Fingerprint, expires_in: Duration) -> KeyRecord {
        let response = StoredResponse {
            status: http::StatusCode::CREATED,
            headers: http::HeaderMap::new(),
            body: "done".into(),
        };
        KeyRecord::completed(FencingToken::new(1), fingerprint, response, expires_in)
    }

    #[test]
    fn a_record_stands_as_a_claim_that_found_it_would_take_it() {
        assert!(standing(None, MINE).is_none());
        assert!(matches!(
            standing(Some(completed(MINE, LIVE)), MINE),
            Some(Claim::Completed {
                fingerprint: MINE,
                ..
            })
        ));
        assert!(matches!(
            standing(Some(completed(OTHER, LIVE)), MINE),
            Some(Claim::Completed {
                fingerprint: OTHER,
                ..
            })
        ));
        assert!(matches!(
            standing(Some(running(MINE, LIVE, LIVE)), MINE),
            Some(Claim::Running {
                retry_after: LIVE,
                ..
            })
        ));
        // A lapsed lease: the same request would take it over; another is refused.
        assert!(standing(Some(running(MINE, Duration::ZERO, LIVE)), MINE).is_none());
        assert!(matches!(
            standing(Some(running(OTHER, Duration::ZERO, LIVE)), MINE),
            Some(Claim::Running {
                fingerprint: OTHER,
                ..
            })
        ));
        // Past its TTL: as if there were none.
        assert!(standing(Some(completed(OTHER, Duration::ZERO)), MINE).is_none());
        assert!(standing(Some(running(OTHER, Duration::ZERO, Duration::ZERO)), MINE).is_none());
        // A live lease keeps its record past the TTL.
        assert!(standing(Some(running(MINE, LIVE, Duration::ZERO)), MINE).is_some());
    }
}
