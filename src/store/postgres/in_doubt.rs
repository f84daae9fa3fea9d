//! Claims in doubt: a claim whose connection was lost, or that its caller gave up on,
//! before its answer came may have committed; it is released by its token, on another
//! connection, now and again later, until its lease would have lapsed.

use std::{sync::Arc, time::Duration};

use super::{Checkout, PostgresStore, errors::lost_its_connection};
use crate::store::{
    Claim, ClaimRequest, Fenced, FencingToken, Lease, Store, StoreError, StoreErrorKind,
};

/// When a claim in doubt is released, counted from the one before: at once, then again
/// in case the server was still running the claim when its connection went.
pub(super) const IN_DOUBT_RELEASES: [Duration; 3] = [
    Duration::ZERO,
    Duration::from_secs(1),
    Duration::from_secs(5),
];

/// After those, while the lease holds, each gap three times the one before: a claim
/// that waited on the server (for a row lock, say) and whose cancel request could not
/// be sent lands late.
pub(super) const IN_DOUBT_LATER: Duration = Duration::from_secs(15);

/// How soon a release in doubt that failed (the database still away) is tried again,
/// until the claim's lease would have lapsed.
pub(super) const IN_DOUBT_RETRY: Duration = Duration::from_secs(1);

/// How long one attempt to release a claim in doubt may take: the pool may hand it a
/// connection as dead as the one that lost the claim (given up on, it is closed).
pub(super) const IN_DOUBT_ATTEMPT: Duration = Duration::from_secs(5);

/// How long a claim on a pooled connection, given up on by its caller, is still waited
/// for (`Store::abandoned_claim_wait`): dropped unanswered, it closes its connection
/// and releases in doubt what may have landed (`InDoubt`), so a claim stuck on a dead
/// connection need not hold it for a lease.
pub(super) const ABANDONED_CLAIM_WAIT: Duration = Duration::from_secs(5);

/// A claim on its way on a pooled connection. Dropped before its answer (its caller
/// gave up, and then stopped waiting), it closes the connection (and cancels what it
/// runs on the server: `Checkout`), after which the claim can land only from what the
/// server had already received; then it releases in doubt, by its token, what may
/// have landed.
pub(super) struct InDoubt<'a> {
    store: &'a PostgresStore,
    request: &'a ClaimRequest<'a>,
    token: FencingToken,
    client: Option<Checkout>,
    /// The answer came, and it was not a lost connection.
    settled: bool,
}

impl<'a> InDoubt<'a> {
    /// The claim of `request` with `token`, about to be sent on `client`.
    pub(super) fn new(
        store: &'a PostgresStore,
        request: &'a ClaimRequest<'a>,
        token: FencingToken,
        client: Checkout,
    ) -> Self {
        Self {
            store,
            request,
            token,
            client: Some(client),
            settled: false,
        }
    }

    pub(super) fn client(&self) -> &Checkout {
        self.client
            .as_ref()
            .expect("the connection stays until the claim is settled")
    }

    /// The answer came: the connection goes back to the pool, and nothing is in
    /// doubt, unless the answer is that the connection was lost.
    pub(super) fn settle(mut self, claimed: &Result<Claim, StoreError>) {
        if let Some(client) = self.client.take() {
            client.done();
        }
        self.settled = !matches!(claimed, Err(e) if lost_its_connection(e));
    }
}

impl Drop for InDoubt<'_> {
    fn drop(&mut self) {
        drop(self.client.take());
        if !self.settled {
            self.store.release_in_doubt(self.request, self.token);
        }
    }
}

impl PostgresStore {
    /// A claim whose connection was lost before its answer came may have committed: its
    /// row would hold the key as running, with nobody to run or release it, and every
    /// retry would get 409 until the lease lapsed. The row of a fresh claim carries the
    /// token sent with it, so it is released by that token, on another connection, in
    /// a task of its own; if the claim did not commit, nothing matches. The server may
    /// still have been running the claim when the connection went (on a lock, or a
    /// commit waiting for a synchronous standby), so the release is tried again a
    /// moment later, and later again. (A takeover in doubt took the old row's token plus
    /// one, unknown here: it lapses with its lease.)
    pub(super) fn release_in_doubt(&self, request: &ClaimRequest<'_>, token: FencingToken) {
        release_in_doubt(self.clone(), request, token);
    }
}

/// [`PostgresStore::release_in_doubt`] for `store`, of either driver.
pub(super) fn release_in_doubt<S: Store + Clone>(
    store: S,
    request: &ClaimRequest<'_>,
    token: FencingToken,
) {
    use tracing::Instrument;
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    let lease = Lease {
        scope: request.scope.clone(),
        key: Arc::from(request.key),
        token,
    };
    // Past the lease, the row frees itself: no release is worth trying then.
    let lapses = tokio::time::Instant::now() + request.lease.min(crate::settings::TEN_YEARS);
    runtime.spawn(
            async move {
                let mut schedule = IN_DOUBT_RELEASES.into_iter().chain(std::iter::successors(
                    Some(IN_DOUBT_LATER),
                    |gap| gap.checked_mul(3),
                ));
                let mut next = schedule.next();
                while let Some(wait) = next {
                    tokio::time::sleep(wait).await;
                    let released = tokio::time::timeout(IN_DOUBT_ATTEMPT, store.release(&lease))
                        .await
                        .unwrap_or_else(|_| {
                            Err(StoreError::new(
                                StoreErrorKind::Timeout,
                                "no answer to the release of a claim in doubt",
                            ))
                        });
                    match released {
                        Ok(Fenced::Kept) => {
                            tracing::warn!(
                                token = %token,
                                "a claim whose answer was lost had committed; released it"
                            );
                            return;
                        }
                        // Past the lease, the row frees itself.
                        Ok(Fenced::LeaseLost) => {
                            next = schedule
                                .next()
                                .filter(|gap| tokio::time::Instant::now() + *gap < lapses);
                        }
                        // The database that lost the answer is often still away (a
                        // crash, a failover): try again until it is back.
                        Err(e) if tokio::time::Instant::now() + IN_DOUBT_RETRY < lapses => {
                            tracing::debug!(token = %token, error = %e, "could not release a claim in doubt yet");
                            next = Some(IN_DOUBT_RETRY);
                        }
                        Err(e) => {
                            tracing::warn!(
                                token = %token,
                                error = %e,
                                "a claim whose answer was lost may have committed and could not be released; it frees when its lease lapses"
                            );
                            return;
                        }
                    }
                }
            }
            .in_current_span(),
        );
}
