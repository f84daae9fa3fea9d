//! Releasing a claim whose run ended without a result to store.
//!
//! A failed handler (an error, a panic, an answer the storage policy does not keep)
//! releases its key, so that the client's retry runs again at once. A release that
//! fails, because the store is away (the database restarting, a failover), is tried
//! again in the background until the store answers: otherwise the key would stay
//! claimed until its lease lapsed, and every retry until then would get `409`.

use std::time::Duration;

use tracing::Instrument;

use super::Leased;
use crate::store::Lease;

/// The first wait before a release is tried again, doubled after each failure up to
/// `LONGEST_WAIT`.
const FIRST_WAIT: Duration = Duration::from_millis(100);
const LONGEST_WAIT: Duration = Duration::from_secs(1);

impl Leased {
    /// Releases `lease`. The first attempt is awaited (bounded by the store timeout);
    /// if it fails, the attempts go on in a task of their own, with backoff, holding
    /// `keep` (a count in flight for a graceful shutdown) until the key is released,
    /// is found no longer held by this lease, or one lease has passed.
    pub(crate) async fn release(&self, lease: &Lease, keep: impl Send + 'static) {
        if self.attempt(lease).await {
            return;
        }
        tracing::warn!(
            token = %lease.token,
            "releasing the key failed; trying again in the background until the store answers"
        );
        let (this, lease) = (self.clone(), lease.clone());
        let retrying = async move {
            let _keep = keep;
            let gives_up = tokio::time::Instant::now() + this.lease;
            let mut wait = FIRST_WAIT;
            while tokio::time::Instant::now() + wait < gives_up {
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(LONGEST_WAIT);
                if this.attempt(&lease).await {
                    tracing::info!(token = %lease.token, "the key was released after all");
                    return;
                }
            }
            tracing::warn!(
                token = %lease.token,
                "the key could not be released; it frees when its lease lapses"
            );
        };
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => drop(runtime.spawn(retrying.in_current_span())),
            Err(_) => {
                tracing::warn!("outside a Tokio runtime; the key frees when its lease lapses")
            }
        }
    }

    /// One attempt: whether the store answered (the key released, or no longer held by
    /// this lease: nothing left to do).
    async fn attempt(&self, lease: &Lease) -> bool {
        let releasing = self.store.release(lease);
        match crate::store::within(self.store_timeout, "a release", releasing).await {
            Ok(_) => true,
            Err(e) => {
                crate::observe::store_failed("release");
                tracing::debug!(token = %lease.token, error = %e, "releasing the key failed");
                false
            }
        }
    }
}
