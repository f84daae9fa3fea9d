//! Graceful shutdown: stop claiming, let running handlers finish and store their results.

use std::sync::Arc;

use tokio_util::{
    sync::CancellationToken,
    task::{TaskTracker, task_tracker::TaskTrackerToken},
};

/// Stops a layer from claiming new keys and waits for the requests it is running.
///
/// Get it from [`IdempotencyLayer::shutdown_handle`](crate::IdempotencyLayer::shutdown_handle)
/// (or, for work without HTTP, [`JobRunner::shutdown_handle`](crate::job::JobRunner::shutdown_handle)).
/// After [`close`](Self::close) (or during [`drain`](Self::drain)), guarded requests are
/// answered `503 shutting-down` with `Retry-After` before anything is claimed, so a
/// load balancer can send the retry to another replica; requests already claimed run to
/// the end and store their responses. Requests that pass through are not affected.
///
/// ```
/// use tower_idempotency::{IdempotencyLayer, store::MemoryStore};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let layer = IdempotencyLayer::new(MemoryStore::new());
/// let shutdown = layer.shutdown_handle();
/// // ... serve with `layer`; on SIGTERM, after the server stops accepting:
/// shutdown.drain().await;
/// assert_eq!(shutdown.in_flight(), 0);
/// # }
/// ```
///
/// **One shutdown for the whole app.** Give one handle to every layer and job runner
/// ([`IdempotencyLayer::shutdown_with`](crate::IdempotencyLayer::shutdown_with),
/// [`JobRunner::shutdown_with`](crate::job::JobRunner::shutdown_with)): one
/// [`drain`](Self::drain) closes them all and waits for the requests and jobs of each.
/// Built with [`closed_by`](Self::closed_by), the handle also closes when the app's
/// own `CancellationToken` is cancelled:
///
/// ```
/// use axum::{Router, routing::post};
/// use tokio_util::sync::CancellationToken;
/// use tower_idempotency::{IdempotencyLayer, ShutdownHandle, job::JobRunner, store::MemoryStore};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let cancel = CancellationToken::new(); // the app's, cancelled on SIGTERM
/// let shutdown = ShutdownHandle::closed_by(&cancel);
/// let payments = IdempotencyLayer::new(MemoryStore::new()).shutdown_with(shutdown.clone());
/// let refunds = IdempotencyLayer::new(MemoryStore::new())
///     .require_key(true)
///     .shutdown_with(shutdown.clone());
/// let app: Router = Router::new()
///     .route("/payments", post(|| async { "paid" }).route_layer(payments))
///     .route("/refunds", post(|| async { "refunded" }).route_layer(refunds));
/// let runner = JobRunner::new(MemoryStore::new()).shutdown_with(shutdown.clone());
///
/// cancel.cancel(); // from the signal handler: every layer and the runner stop claiming
/// assert!(shutdown.is_closed());
/// // ... once the server has stopped accepting (`axum::serve(…).with_graceful_shutdown(
/// // cancel.cancelled_owned())`), wait for what all of them still run:
/// shutdown.drain().await;
/// # }
/// ```
#[derive(Clone, Default)]
pub struct ShutdownHandle {
    /// Counts the requests in flight, and is closed first thing by `close`.
    requests: TaskTracker,
    /// Cancelled by `close`, after `requests` is closed: wakes the requests waiting for
    /// a running key, so that they answer at once.
    closed: CancellationToken,
}

/// Held while a claimed request runs and stores its result. Its clones (the tasks that
/// finish the request's work in the background) share its one count: the request stays
/// in flight until every clone is dropped, even once the handle is closing.
#[derive(Clone)]
pub(crate) struct InFlight {
    _request: Arc<TaskTrackerToken>,
}

impl ShutdownHandle {
    /// A new handle, open: to share among several layers and job runners
    /// (`shutdown_with`), so that one [`drain`](Self::drain) shuts them all down.
    pub fn new() -> Self {
        Self::default()
    }

    /// A new handle, open until [`close`](Self::close) (or [`drain`](Self::drain)) or
    /// until `token` is cancelled: the app's own shutdown signal closes every layer
    /// and job runner given this handle, at once. Cancelling the token does not wait
    /// for anything: [`drain`](Self::drain) still does. Closing the handle does not
    /// cancel the token.
    pub fn closed_by(token: &CancellationToken) -> Self {
        Self {
            requests: TaskTracker::new(),
            closed: token.child_token(),
        }
    }

    /// Registers a request about to claim a key; `None` once closing.
    pub(crate) fn enter(&self) -> Option<InFlight> {
        let counted = self.requests.token();
        // Checked after counting, so `drain` cannot miss a request that got in: the
        // count and the closed mark are one atomic word in the tracker, so either
        // `close` marked it before this request counted itself, and the check below
        // sees the mark, or after, and `drain` sees the count. (The app's token, if
        // any, only closes earlier: `drain` closes the tracker itself.)
        (!self.is_closed()).then(|| InFlight {
            _request: Arc::new(counted),
        })
    }

    /// Stops claiming new keys. Idempotent. Requests waiting for a running key
    /// (`wait_for_running`) stop waiting and answer `503 shutting-down` too.
    pub fn close(&self) {
        self.requests.close();
        self.closed.cancel();
    }

    /// Resolves once [`close`](Self::close) is called (or the token of
    /// [`closed_by`](Self::closed_by) cancelled).
    pub(crate) async fn closed(&self) {
        self.closed.cancelled().await;
    }

    /// Whether [`close`](Self::close) was called (or the token of
    /// [`closed_by`](Self::closed_by) cancelled).
    pub fn is_closed(&self) -> bool {
        self.requests.is_closed() || self.closed.is_cancelled()
    }

    /// How many guarded requests are still in progress: claiming, waiting, running, or
    /// storing their results.
    pub fn in_flight(&self) -> usize {
        self.requests.len()
    }

    /// Closes, then waits until every claimed request has finished and its result is
    /// stored (or its key released). Bound it with `tokio::time::timeout` if needed:
    /// whatever is cut short is recovered by lease expiry. A claim given up on at the
    /// store timeout is waited for as the store says (`Store::abandoned_claim_wait`:
    /// 5 s on a pooled PostgreSQL connection); the release in doubt that the store
    /// then starts for it is not waited for.
    pub async fn drain(&self) {
        self.close();
        self.requests.wait().await;
    }
}

impl std::fmt::Debug for ShutdownHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShutdownHandle")
            .field("closed", &self.is_closed())
            .field("in_flight", &self.in_flight())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_counts_once_however_many_tasks_hold_it() {
        let handle = ShutdownHandle::default();
        let request = handle.enter().expect("open");
        let background = request.clone();
        let other = handle.enter().expect("open");
        assert_eq!(handle.in_flight(), 2);
        drop(request);
        assert_eq!(handle.in_flight(), 2, "its background task still holds it");
        drop(background);
        assert_eq!(handle.in_flight(), 1);
        drop(other);
        assert_eq!(handle.in_flight(), 0);
    }

    #[tokio::test]
    async fn the_app_s_token_closes_the_handle_and_a_close_leaves_the_token_alone() {
        let app = CancellationToken::new();
        let handle = ShutdownHandle::closed_by(&app);
        let running = handle.enter().expect("open");
        let waiting = tokio::spawn({
            let handle = handle.clone();
            async move { handle.closed().await }
        });
        app.cancel();
        waiting
            .await
            .expect("a waiter wakes when the app's token is cancelled");
        assert!(handle.is_closed());
        assert!(
            handle.enter().is_none(),
            "closed handles refuse new requests"
        );
        assert_eq!(
            handle.in_flight(),
            1,
            "the running request is still counted"
        );
        drop(running);
        handle.drain().await;

        let app = CancellationToken::new();
        let handle = ShutdownHandle::closed_by(&app);
        handle.drain().await;
        assert!(
            !app.is_cancelled(),
            "the app's token is the app's to cancel"
        );
    }

    #[tokio::test]
    async fn drain_waits_for_every_guard() {
        let handle = ShutdownHandle::default();
        let a = handle.enter().expect("open");
        let b = handle.enter().expect("open");
        let drained = tokio::spawn({
            let handle = handle.clone();
            async move { handle.drain().await }
        });
        tokio::task::yield_now().await;
        assert!(
            handle.enter().is_none(),
            "closed handles refuse new requests"
        );
        drop(a);
        tokio::task::yield_now().await;
        assert!(!drained.is_finished());
        drop(b);
        drained.await.expect("drained");
        assert_eq!(handle.in_flight(), 0);
    }
}
