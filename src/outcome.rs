//! What the layer did with a request, for metrics and logs.

use std::fmt;

/// The layer's decision for one request, put in the response extensions and recorded
/// as the `idempotency.outcome` field of the `idempotency` tracing span.
///
/// ```
/// use tower_idempotency::Outcome;
///
/// # let response = http::Response::new(());
/// match response.extensions().get::<Outcome>() {
///     Some(Outcome::Replayed) => { /* count a replay */ }
///     Some(other) => println!("{other}"),
///     None => { /* the layer did not see this request */ }
/// }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Outcome {
    /// Not a guarded request (method not guarded, or no key and none required), or one
    /// an outer layer of the same mode guards already under the same key.
    PassedThrough,
    /// The key was claimed, the inner service ran, and its answer is stored (or is
    /// being stored: a retry replays it).
    Executed,
    /// The key was claimed and the inner service ran, but its answer was not stored and
    /// the key was released (in transactional mode, rolled back with the handler's
    /// writes): a retry runs again. An answer of a status the storage policy does not
    /// keep (by default 5xx, 408, 429, 400, 415 and 422) or marked
    /// [`NoStore`](crate::NoStore); the inner service's error; a handler that panicked
    /// or whose body failed (`500 handler-failed`); or a request that failed on its way
    /// to running it (a panic of the scope or fingerprint function, say), with nothing
    /// held under the key. Counted apart from `Executed`, so that a `5xx` that freed
    /// its key for a retry is not read as a success.
    Released,
    /// A stored response was returned.
    Replayed,
    /// The key is held by a request still running (409).
    Conflict,
    /// The key was used with a different request (422).
    Mismatch,
    /// The request was refused before running anything: bad or missing key, body too
    /// large or too slow to arrive, the layer shutting down (400, 408, 413, 503).
    Rejected,
    /// The store could not be reached; the inner service did not run (503). Also, in
    /// transactional mode, a transaction that could not be committed
    /// (`503 not-committed`): the handler ran, and nothing it wrote was kept (or,
    /// when the connection died during `COMMIT` and no check could tell, that is
    /// unknown, and the problem's detail says so).
    StoreError,
    /// The key was completed and its response is gone, but the key is remembered: the
    /// request was refused, not run again (`410 response-expired`).
    Expired,
}

impl Outcome {
    /// A short lowercase name, stable for metrics labels.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::PassedThrough => "passed_through",
            Self::Executed => "executed",
            Self::Released => "released",
            Self::Replayed => "replayed",
            Self::Conflict => "conflict",
            Self::Mismatch => "mismatch",
            Self::Rejected => "rejected",
            Self::StoreError => "store_error",
            Self::Expired => "expired",
        }
    }
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}
