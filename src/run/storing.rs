//! A finished run's result, stored under its lease: the first attempt before the answer
//! goes out, the next ones in the background while the store is away.

use std::time::Duration;

use tracing::Instrument;

use super::{Leased, renewal::Renewal};
use crate::{
    StoredResponse,
    observe::{Mode, Timer, store_failed},
    store::{Fenced, Lease},
};

impl Leased {
    /// Stores the result. The first attempt is made before answering, with the lease
    /// still renewed by `renewal`, the one that renewed it while the handler ran; if it
    /// fails or outlasts the store timeout, the caller gets its answer then, and the
    /// attempts go on in the background, with backoff, for one more lease, holding
    /// `keep` meanwhile: completion is token-checked, so a late attempt can never
    /// overwrite a successor's result.
    ///
    /// `Fenced` when the first attempt found the lease taken over: another run holds
    /// the key, and this result is not stored.
    pub(crate) async fn store(
        &self,
        lease: &Lease,
        stored: StoredResponse,
        keep: impl Send + 'static,
        mut renewal: Renewal,
    ) -> Completion {
        // Sealed once: every attempt sends the same bytes, so a completion sent again
        // after its answer was lost is told from another by comparing them.
        let stored = self.sealing.seal(&lease.scope, &lease.key, stored);
        // A slow store must not let the lease lapse under a result about to be stored:
        // a retry would take the key over and run the handler again.
        renewal.storing();
        let first = renewal.watch(self.try_complete(lease, &stored, 1)).await;
        // The attempts in the background renew the lease themselves, one at a time.
        drop(renewal);
        match first {
            Attempt::Stored => return Completion::Stored,
            Attempt::Fenced => return Completion::Fenced,
            Attempt::Failed => {}
        }
        let (this, lease) = (self.clone(), lease.clone());
        tokio::spawn(
            async move {
                let _keep = keep;
                let deadline = tokio::time::Instant::now() + this.lease;
                let mut backoff = Duration::from_millis(50);
                let mut attempt = 2;
                while tokio::time::Instant::now() < deadline {
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(1));
                    // Hold on to the key while trying: a lapsed lease would let a retry
                    // run the handler again although it succeeded.
                    let renewed = tokio::time::timeout(
                        this.store_timeout,
                        this.store.renew(&lease, this.lease),
                    )
                    .await;
                    // Lost means fenced, unless an attempt whose answer was lost stored
                    // the result: the completion, sent once more, tells them apart.
                    let lost = matches!(renewed, Ok(Ok(Fenced::LeaseLost)));
                    match this.try_complete(&lease, &stored, attempt).await {
                        Attempt::Failed if lost => {
                            tracing::warn!(
                                token = %lease.token,
                                "the lease was taken over while storing the result"
                            );
                            return;
                        }
                        Attempt::Failed => {}
                        Attempt::Stored | Attempt::Fenced => return,
                    }
                    attempt += 1;
                }
                tracing::error!(
                    token = %lease.token,
                    "the result could not be stored; the key stays claimed until its lease lapses, then a retry runs again"
                );
            }
            .in_current_span(),
        );
        Completion::Pending
    }

    /// One completion attempt.
    async fn try_complete(&self, lease: &Lease, stored: &StoredResponse, attempt: u32) -> Attempt {
        let timer = Timer::start();
        let completed = tokio::time::timeout(
            self.store_timeout,
            self.store.complete(lease, stored, self.ttl),
        )
        .await;
        timer.completed(Mode::Lease);
        if !matches!(completed, Ok(Ok(_))) {
            store_failed("complete");
        }
        match completed {
            Ok(Ok(Fenced::Kept)) => Attempt::Stored,
            Ok(Ok(Fenced::LeaseLost)) => {
                tracing::warn!(
                    token = %lease.token,
                    "the lease was lost (taken over by another run, or released by an operator); this result went to its own caller and was not stored"
                );
                Attempt::Fenced
            }
            Ok(Err(e)) => {
                tracing::warn!(token = %lease.token, attempt, error = %e, "storing the result failed");
                Attempt::Failed
            }
            Err(_) => {
                tracing::warn!(token = %lease.token, attempt, "storing the result timed out");
                Attempt::Failed
            }
        }
    }
}

/// What one attempt to store a result did.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Attempt {
    Stored,
    /// The lease was taken over: nothing to store, ever.
    Fenced,
    /// The store failed or was slow: worth another attempt.
    Failed,
}

/// What became of a result given to [`Storing::store`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Completion {
    Stored,
    /// The lease had been taken over: another run holds the key; this result is not
    /// stored.
    Fenced,
    /// Still being stored, in the background.
    Pending,
}
