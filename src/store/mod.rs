//! Where claims and stored responses live.
//!
//! A [`Store`] does four things, each atomic: [`claim`](Store::claim) a key (or report
//! what holds it), [`complete`](Store::complete) it with a response,
//! [`release`](Store::release) it after a failure, and [`renew`](Store::renew) the lease
//! of a running handler. Completion, release and renewal carry the fencing token the
//! claim returned: a holder whose lease was taken over can no longer touch the key.
//!
//! [`PostgresStore`] is the product; [`MemoryStore`] serves a single process (examples,
//! demos, tests of layer logic). Neither needs HTTP: a job runner can claim, run and
//! complete directly.
//!
//! ```
//! use std::time::Duration;
//! use tower_idempotency::{store::{Claim, ClaimRequest, MemoryStore, Store}, Fingerprint, Scope};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let store = MemoryStore::new();
//! let scope = Scope::new("billing-worker");
//! let request = ClaimRequest {
//!     scope: &scope,
//!     key: "message-1",
//!     fingerprint: Fingerprint::new([0; 32]),
//!     lease: Duration::from_secs(30),
//!     ttl: Duration::from_secs(24 * 3600),
//! };
//! let Claim::Acquired(lease) = store.claim(&request).await? else { panic!("new key") };
//! // ... run the job ...
//! let response = tower_idempotency::StoredResponse {
//!     status: http::StatusCode::OK, headers: Default::default(), body: "done".into(),
//! };
//! assert!(store.complete(&lease, &response, request.ttl).await?.is_kept());
//! assert!(matches!(store.claim(&request).await?, Claim::Completed { .. }));
//! # Ok(()) }
//! ```

use std::{
    borrow::Cow,
    fmt,
    future::Future,
    pin::Pin,
    sync::Arc,
    time::{Duration, SystemTime},
};

use crate::{Fingerprint, Scope, StoredResponse};

mod lookup;
mod memory;
mod operator;
#[cfg(feature = "postgres")]
mod postgres;
mod steps;
mod waiters;

pub use lookup::{KeyRecord, KeyState};
pub use memory::MemoryStore;
pub use operator::{Operator, Removal, RunningKey};
#[cfg(feature = "sqlx")]
pub use postgres::sqlx_store::SqlxStore;
#[cfg(feature = "postgres")]
pub(crate) use postgres::transaction;
#[cfg(feature = "postgres")]
pub use postgres::{
    ConfigError, GenerationRotation, Migration, PostgresStore, StoreMetrics, TransactionalStore,
    pool_for_url, pool_for_url_with_tls,
};
pub use steps::{Orphan, RecordedStep};

/// A boxed future, as returned by [`Store`] methods (so stores can be trait objects).
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Claims on `store`, bounded by `timeout`. A claim still in flight at the bound, or
/// when the caller drops this future, may yet commit: it is handed to a task of its own
/// that releases it as soon as it returns, so a caller that gave up (a request answered
/// 503, a job that failed or was cancelled) does not leave its key blocked for a lease,
/// nor a shared connection's count of claims in flight wrong.
pub(crate) async fn claim_within(
    store: &Arc<dyn Store>,
    timeout: Duration,
    request: &ClaimRequest<'_>,
    in_flight: crate::shutdown::InFlight,
) -> Result<Result<Claim, StoreError>, tokio::time::error::Elapsed> {
    let owned = store.clone();
    let (scope, key) = (request.scope.clone(), request.key.to_owned());
    let (fingerprint, lease, ttl) = (request.fingerprint, request.lease, request.ttl);
    let mut claim = Unfinished {
        claim: Some(Box::pin(async move {
            let request = ClaimRequest {
                scope: &scope,
                key: &key,
                fingerprint,
                lease,
                ttl,
            };
            owned.claim(&request).await
        })),
        store: store.clone(),
        in_flight: Some(in_flight),
        lease: request.lease,
        release_within: timeout,
    };
    let running = claim.claim.as_mut().expect("the claim was just set");
    let timer = crate::observe::Timer::start();
    let claimed = tokio::time::timeout(timeout, running).await;
    timer.claimed(crate::observe::Mode::Lease);
    if !matches!(claimed, Ok(Ok(_))) {
        crate::observe::store_failed("claim");
    }
    let claimed = claimed?;
    claim.claim = None;
    Ok(claimed)
}

/// A claim that may still be on its way to the store; if it is dropped unfinished, the
/// rest of it runs in a task that releases the key if the claim lands, counted in flight
/// meanwhile, so that a drain waits for that release (not for one the store starts
/// itself when the claim is dropped: `PostgresStore` releases in doubt). The task waits for the claim's
/// answer at most [`Store::abandoned_claim_wait`] (one lease by default): past it, the
/// claim is dropped, which closes a connection that may be dead, and a claim that
/// landed frees its key with its lease, or sooner where the store sees to it. The
/// release is bounded by the store timeout, as every other release is, so that a drain
/// does not wait on a store that stopped answering.
struct Unfinished {
    claim: Option<BoxFuture<'static, Result<Claim, StoreError>>>,
    store: Arc<dyn Store>,
    in_flight: Option<crate::shutdown::InFlight>,
    lease: Duration,
    release_within: Duration,
}

impl Drop for Unfinished {
    fn drop(&mut self) {
        use tracing::Instrument;
        let Some(claim) = self.claim.take() else {
            return;
        };
        // Without a runtime (it is shutting down) the claim cannot be finished here;
        // its lease then lapses as a crashed process's would.
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let store = self.store.clone();
        let in_flight = self.in_flight.take();
        let bound = self.store.abandoned_claim_wait(self.lease).min(self.lease);
        let release_within = self.release_within;
        let finish = async move {
            let _in_flight = in_flight;
            match tokio::time::timeout(bound, claim).await {
                Ok(Ok(Claim::Acquired(lease))) => {
                    tracing::warn!(
                        token = %lease.token,
                        "a claim given up on landed late; releasing it"
                    );
                    let released = tokio::time::timeout(release_within, store.release(&lease));
                    if !matches!(released.await, Ok(Ok(_))) {
                        tracing::warn!(
                            token = %lease.token,
                            "the release of a claim that landed late failed; its key frees as its lease lapses"
                        );
                    }
                }
                Ok(_) => {}
                Err(_) => tracing::warn!(
                    "a claim given up on went unanswered; dropped it (if it landed, its key frees as its lease lapses, or sooner where the store releases it)"
                ),
            }
        };
        runtime.spawn(finish.in_current_span());
    }
}

/// What [`Store::claim`] is asked for.
#[derive(Debug, Clone)]
pub struct ClaimRequest<'a> {
    /// The scope the key lives in.
    pub scope: &'a Scope,
    /// The key.
    pub key: &'a str,
    /// The fingerprint of the request claiming it.
    pub fingerprint: Fingerprint,
    /// How long the claim holds before another request may take it over.
    pub lease: Duration,
    /// How long the record is kept.
    pub ttl: Duration,
}

/// A claim's fencing token: what a holder shows to complete, release or renew its
/// claim, so that one whose lease was taken over can no longer touch the key.
///
/// A fresh claim's token is random, in `1..2^62`; a takeover's is one more than the
/// token it took over. So a key's tokens only grow while its record lives, and because
/// a fresh record starts at a random token, a holder whose record was deleted
/// (released, purged) and claimed anew cannot act on the new claim (the chance of a
/// collision is 2^-62).
///
/// ```
/// use tower_idempotency::store::FencingToken;
///
/// let token = FencingToken::new(41);
/// assert_eq!(token.next().get(), 42);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FencingToken(i64);

impl FencingToken {
    /// A token of this value, as a store reads it back.
    pub const fn new(value: i64) -> Self {
        Self(value)
    }

    /// Its value, as a store writes it.
    pub const fn get(self) -> i64 {
        self.0
    }

    /// A fresh claim's token: random, in `1..2^62`.
    pub fn fresh() -> Self {
        Self(((crate::random::u64() >> 2) as i64).max(1))
    }

    /// The token of a takeover of the claim that holds this one: one more.
    #[must_use]
    pub const fn next(self) -> Self {
        Self(self.0 + 1)
    }
}

impl fmt::Display for FencingToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

/// What a step taken under a lease found: a completion, a release, a renewal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use]
pub enum Fenced {
    /// The lease still held the key: the step was taken.
    Kept,
    /// The lease no longer held the key (taken over, released, completed): nothing was
    /// changed.
    LeaseLost,
}

impl Fenced {
    /// `Kept` if `kept`, `LeaseLost` otherwise: a store's row count, say.
    pub fn kept_if(kept: bool) -> Self {
        if kept { Self::Kept } else { Self::LeaseLost }
    }

    /// Whether the lease still held the key.
    pub fn is_kept(self) -> bool {
        self == Self::Kept
    }
}

/// `future`, bounded by `bound`: an answer that does not come in time is a
/// [`Timeout`](StoreErrorKind::Timeout) store error, saying what was waited for.
pub(crate) async fn within<T>(
    bound: Duration,
    what: &'static str,
    future: impl Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    match tokio::time::timeout(bound, future).await {
        Ok(answer) => answer,
        Err(_) => Err(StoreError::new(
            StoreErrorKind::Timeout,
            format!("no answer to {what} within {} ms", bound.as_millis()),
        )),
    }
}

/// The right to run the handler for one key, until the lease lapses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    /// The scope of the key.
    pub scope: Scope,
    /// The key.
    pub key: Arc<str>,
    /// The fencing token: random for a fresh claim, one more on each takeover.
    pub token: FencingToken,
}

/// The result of a claim.
#[derive(Debug, Clone)]
pub enum Claim {
    /// The key is ours: run the handler, then complete or release.
    Acquired(Lease),
    /// Another request holds the key and is still running.
    Running {
        /// The holder's fingerprint.
        fingerprint: Fingerprint,
        /// Time left on the holder's lease.
        retry_after: Duration,
    },
    /// The key has a stored response.
    Completed {
        /// The fingerprint of the request that produced it.
        fingerprint: Fingerprint,
        /// The response to replay.
        response: StoredResponse,
    },
    /// The key was completed, and its response is gone (its retention, the TTL, has
    /// ended), but the key is remembered ([`DEFAULT_REMEMBER`]): the request was done,
    /// and is not run again. The layer answers `410 response-expired`.
    Remembered {
        /// The fingerprint of the request that completed it.
        fingerprint: Fingerprint,
        /// The status of the response it was completed with.
        status: http::StatusCode,
        /// When it was completed, by the store's clock.
        completed_at: SystemTime,
        /// Until when the key is remembered: past it, the key is claimed as new.
        remembered_until: SystemTime,
    },
}

/// How long a store remembers a completed key once its response is gone, by default:
/// 7 days.
///
/// Longer than the retry budgets clients commonly have (hours: mobile apps that queue
/// requests while offline, SDKs with exponential backoff, a client's own retry budget
/// longer than the server's 24 h TTL) and than the time messages commonly wait in a
/// dead-letter queue before an operator replays them (days; a week covers a weekend and
/// a slow reaction to it), while a remembered key costs only its row without headers
/// or body (docs/benchmarks.md). `Duration::ZERO` turns remembering off: a key is then
/// forgotten when its response is, and a retry after that runs as a new request.
pub const DEFAULT_REMEMBER: Duration = Duration::from_secs(7 * 24 * 3600);

/// What went wrong talking to a store.
///
/// Its `Display` says what happened and why: the class of the error, the cause (for
/// [`PostgresStore`], the database's message and SQLSTATE, with its detail and hint if
/// it gave them), and, where the store can tell the likely cause, what to do about it
/// ([`hint`](Self::hint)):
///
/// ```text
/// idempotency store misconfigured: permission denied for table idempotency_keys (SQLSTATE 42501); the app's role needs …
/// ```
#[derive(Debug)]
pub struct StoreError {
    kind: StoreErrorKind,
    source: Box<dyn std::error::Error + Send + Sync>,
    hint: Option<Cow<'static, str>>,
}

/// The class of a [`StoreError`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum StoreErrorKind {
    /// The database could not be reached or dropped the connection; or a
    /// [`MemoryStore`] at its bound holds only running claims, and takes no new key
    /// until one of them finishes.
    Unavailable,
    /// No answer within the bound (pool wait, lock wait, statement timeout).
    Timeout,
    /// The store cannot serve as it is set up: its table or functions missing or of
    /// another shape, a right its role lacks, a transaction pooler it is not built for.
    /// The error says which, and what to do where the store can tell.
    Misconfigured,
    /// A stored record could not be decoded.
    Corrupt,
    /// Anything else the database reported.
    Other,
}

impl StoreError {
    /// An error of `kind` caused by `source`.
    pub fn new(
        kind: StoreErrorKind,
        source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> Self {
        Self {
            kind,
            source: source.into(),
            hint: None,
        }
    }

    /// This error, with what to do about it: for a store that can tell the likely
    /// cause. `Display` shows it after the cause.
    ///
    /// ```
    /// use tower_idempotency::store::{StoreError, StoreErrorKind};
    ///
    /// let e = StoreError::new(StoreErrorKind::Misconfigured, "no such table: keys")
    ///     .with_hint("create it first");
    /// assert_eq!(e.hint(), Some("create it first"));
    /// assert_eq!(e.to_string(), "idempotency store misconfigured: no such table: keys; create it first");
    /// ```
    #[must_use]
    pub fn with_hint(mut self, hint: impl Into<Cow<'static, str>>) -> Self {
        self.hint = Some(hint.into());
        self
    }

    /// The class of the error.
    pub fn kind(&self) -> StoreErrorKind {
        self.kind
    }

    /// What to do about it, where the store could tell the likely cause (run
    /// `migrate()`, the rights a role lacks, a transaction pooler to configure for).
    pub fn hint(&self) -> Option<&str> {
        self.hint.as_deref()
    }

    /// A copy of this error, for a second caller that failed with it (errors are not
    /// `Clone`): its kind, its hint, and its source as text, so that it reads the same.
    #[cfg(feature = "postgres")]
    pub(crate) fn copied(&self) -> Self {
        Self {
            kind: self.kind,
            source: self.source.to_string().into(),
            hint: self.hint.clone(),
        }
    }
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let what = match self.kind {
            StoreErrorKind::Unavailable => "idempotency store unavailable",
            StoreErrorKind::Timeout => "idempotency store timed out",
            StoreErrorKind::Misconfigured => "idempotency store misconfigured",
            StoreErrorKind::Corrupt => "idempotency record corrupt",
            StoreErrorKind::Other => "idempotency store error",
        };
        write!(f, "{what}: {}", self.source)?;
        match &self.hint {
            Some(hint) => write!(f, "; {hint}"),
            None => Ok(()),
        }
    }
}

impl std::error::Error for StoreError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&*self.source)
    }
}

/// Storage for idempotency records. Every method is one atomic step.
pub trait Store: Send + Sync + 'static {
    /// Claims `request.key` in its scope, atomically: acquire it when absent, expired, or
    /// held by a lapsed lease with the same fingerprint; otherwise say what holds it.
    fn claim<'a>(
        &'a self,
        request: &'a ClaimRequest<'a>,
    ) -> BoxFuture<'a, Result<Claim, StoreError>>;

    /// Stores `response` for the key if `lease` still holds it.
    /// [`LeaseLost`](Fenced::LeaseLost): the lease was lost (taken over or released)
    /// and nothing was written. A store whose answers can be lost (over a network)
    /// answers [`Kept`](Fenced::Kept) to the same completion (lease and response) sent
    /// again after it completed the key: the first, whose answer was lost, stored it.
    ///
    /// # Errors
    ///
    /// The store could not be reached, or failed; the response may or may not be
    /// stored.
    fn complete<'a>(
        &'a self,
        lease: &'a Lease,
        response: &'a StoredResponse,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Fenced, StoreError>>;

    /// Deletes the running claim so that a retry runs again.
    /// [`LeaseLost`](Fenced::LeaseLost): the lease no longer held the key.
    ///
    /// # Errors
    ///
    /// The store could not be reached, or failed; the claim may still be there.
    fn release<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, Result<Fenced, StoreError>>;

    /// Reads the record of `key` in `scope`, changing nothing: `None` when it has none
    /// (never claimed, released, or purged). A record past its TTL that is not purged
    /// yet is read as it is ([`KeyRecord::is_free`] says whether a claim would take it
    /// afresh).
    ///
    /// What a layer in transition looks for under the scope it used before
    /// ([`previous_scope_with`](crate::IdempotencyLayer::previous_scope_with)), and what
    /// an operator asks about a client's key. [`PostgresStore`] reads it in one
    /// primary-key read (committed rows only: a claim still uncommitted in a
    /// transactional request is not seen). The default answers an error of kind
    /// [`Misconfigured`](StoreErrorKind::Misconfigured), for stores that cannot: a
    /// layer that needs it then answers `503` rather than run a request it cannot
    /// look up.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::{Fingerprint, Scope, store::{Claim, ClaimRequest, KeyState, MemoryStore, Store}};
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let store = MemoryStore::new();
    /// let scope = Scope::new("acct_42");
    /// assert!(store.look_up(&scope, "order-1").await?.is_none());
    /// let request = ClaimRequest {
    ///     scope: &scope,
    ///     key: "order-1",
    ///     fingerprint: Fingerprint::new([1; 32]),
    ///     lease: Duration::from_secs(30),
    ///     ttl: Duration::from_secs(3600),
    /// };
    /// let Claim::Acquired(lease) = store.claim(&request).await? else { panic!("a new key") };
    /// let record = store.look_up(&scope, "order-1").await?.expect("claimed");
    /// assert_eq!(record.token, lease.token);
    /// assert!(matches!(record.state, KeyState::Running { .. }));
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// The store could not be reached, failed, or cannot look keys up.
    fn look_up<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a str,
    ) -> BoxFuture<'a, Result<Option<KeyRecord>, StoreError>> {
        let _ = (scope, key);
        Box::pin(std::future::ready(Err(StoreError::new(
            StoreErrorKind::Misconfigured,
            "this store cannot look a key up (Store::look_up)",
        ))))
    }

    /// The running keys claimed at least `older_than` ago (a takeover counts from
    /// itself), oldest first, at most `limit`: what an operator looks for when keys are
    /// left running by a bug (a handler that hangs while its lease is renewed). Changes
    /// nothing. [`Operator::running`] is the same, logged.
    ///
    /// [`PostgresStore`] reads them in one statement with no index to serve it on a
    /// plain table: a sequential scan of the whole table, whatever `limit` (a table in
    /// generations has an index of its running rows). It takes no lock a claim waits
    /// for; on a table of millions of rows run it from an operator's tool, not on a
    /// timer (docs/postgres.md, "A key's life on demand", measures it). The default
    /// answers an error of kind [`Misconfigured`](StoreErrorKind::Misconfigured), for
    /// stores that cannot.
    ///
    /// # Errors
    ///
    /// The store could not be reached, failed, or cannot list running keys.
    fn running_keys(
        &self,
        older_than: Duration,
        limit: usize,
    ) -> BoxFuture<'_, Result<Vec<RunningKey>, StoreError>> {
        let _ = (older_than, limit);
        Box::pin(std::future::ready(Err(StoreError::new(
            StoreErrorKind::Misconfigured,
            "this store cannot list running keys (Store::running_keys)",
        ))))
    }

    /// Deletes the running claim of `key` in `scope`, whatever its lease (and, if
    /// `holder` is given, only if that token holds it): an operator freeing a key a bug
    /// left running. Fenced as a release is: its holder's later completion, renewal and
    /// release find no claim under their token and get [`LeaseLost`](Fenced::LeaseLost),
    /// so nothing it does lands; a retry then claims the key afresh and runs. A layer
    /// whose handler still runs under the key answers that handler's own response to
    /// its client when it ends, stored nowhere (as after a takeover), and logs that its
    /// lease was lost. Those waiting for the key are woken.
    ///
    /// The handler may then run twice (the one still running, and the retry's): free a
    /// key whose holder is known dead or stuck. Pass the `holder` token a look-up showed,
    /// so that a key completed or taken over since is left alone
    /// ([`Removal::Refused`]). A claim in transactional mode is not committed while it
    /// runs, and is not seen ([`Removal::Absent`]): it ends with its transaction.
    /// [`Operator::release`] is the same, logged. The default answers an error of kind
    /// [`Misconfigured`](StoreErrorKind::Misconfigured), for stores that cannot.
    ///
    /// # Errors
    ///
    /// The store could not be reached, failed, or cannot release keys this way; the
    /// claim may still be there.
    fn release_running<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a str,
        holder: Option<FencingToken>,
    ) -> BoxFuture<'a, Result<Removal, StoreError>> {
        let _ = (scope, key, holder);
        Box::pin(std::future::ready(Err(StoreError::new(
            StoreErrorKind::Misconfigured,
            "this store cannot release a running key (Store::release_running)",
        ))))
    }

    /// Deletes the record of `key` in `scope` if it is not running (completed): a
    /// retry with the key then runs again, as a new key. For a response that must not
    /// be replayed (stored by mistake, or to be redone once the cause is fixed). A
    /// running key is left alone ([`Removal::Refused`]; see
    /// [`release_running`](Self::release_running)). [`Operator::delete`] is the same,
    /// logged. The default answers an error of kind
    /// [`Misconfigured`](StoreErrorKind::Misconfigured), for stores that cannot.
    ///
    /// # Errors
    ///
    /// The store could not be reached, failed, or cannot delete keys this way; the
    /// record may still be there.
    fn delete_completed<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a str,
    ) -> BoxFuture<'a, Result<Removal, StoreError>> {
        let _ = (scope, key);
        Box::pin(std::future::ready(Err(StoreError::new(
            StoreErrorKind::Misconfigured,
            "this store cannot delete a key (Store::delete_completed)",
        ))))
    }

    /// The steps recorded under `lease`'s key, in their order (`n` from 0), for a run of
    /// the key to replay ([`IdempotencyKey::step`](crate::IdempotencyKey::step)).
    /// `None`: the lease no longer holds the key. The default answers an error of kind
    /// [`Misconfigured`](StoreErrorKind::Misconfigured), for stores that cannot record
    /// steps.
    ///
    /// # Errors
    ///
    /// The store could not be reached, failed, or cannot record steps.
    fn steps<'a>(
        &'a self,
        lease: &'a Lease,
    ) -> BoxFuture<'a, Result<Option<Vec<RecordedStep>>, StoreError>> {
        let _ = lease;
        Box::pin(std::future::ready(Err(no_steps())))
    }

    /// Records `step` under `lease`'s key, durably before it returns, if the lease
    /// still holds the key: [`LeaseLost`](Fenced::LeaseLost) records nothing. A step of
    /// the same place recorded before by the same lease (an answer lost) is written
    /// over. The steps of a key are forgotten when it completes, is released or
    /// deleted. The default answers an error of kind
    /// [`Misconfigured`](StoreErrorKind::Misconfigured).
    ///
    /// # Errors
    ///
    /// The store could not be reached, failed, or cannot record steps; the step may or
    /// may not be recorded.
    fn record_step<'a>(
        &'a self,
        lease: &'a Lease,
        step: &'a RecordedStep,
    ) -> BoxFuture<'a, Result<Fenced, StoreError>> {
        let _ = (lease, step);
        Box::pin(std::future::ready(Err(no_steps())))
    }

    /// Records the request of a resumable key (`name`: what the layer was registered
    /// as, [`IdempotencyLayer::resumable`](crate::IdempotencyLayer::resumable)) under
    /// `lease`, if it still holds the key, for a completer to run it should the holder
    /// die; forgotten with the key's steps. The default keeps nothing and answers
    /// [`Kept`](Fenced::Kept): a store whose holders die with it (as
    /// [`MemoryStore`]'s) has no key for another process to finish.
    ///
    /// # Errors
    ///
    /// The store could not be reached, or failed.
    fn record_request<'a>(
        &'a self,
        lease: &'a Lease,
        name: &'a str,
        request: &'a bytes::Bytes,
    ) -> BoxFuture<'a, Result<Fenced, StoreError>> {
        let _ = (lease, name, request);
        Box::pin(std::future::ready(Ok(Fenced::Kept)))
    }

    /// Up to `limit` running keys registered as `name` whose holder is known to be
    /// gone (its process dead, by liveness: not a lease that lapsed), with their
    /// stored requests: what a completer takes over and finishes. Changes nothing.
    /// The default finds none.
    ///
    /// # Errors
    ///
    /// The store could not be reached, or failed.
    fn orphans<'a>(
        &'a self,
        name: &'a str,
        limit: usize,
    ) -> BoxFuture<'a, Result<Vec<Orphan>, StoreError>> {
        let _ = (name, limit);
        Box::pin(std::future::ready(Ok(Vec::new())))
    }

    /// Deletes up to `batch` records past their TTL whose lease (if running) has lapsed;
    /// returns how many. Never touches a live claim.
    fn purge<'a>(&'a self, batch: usize) -> BoxFuture<'a, Result<u64, StoreError>>;

    /// Records that a request waits for the running key, so that its completion or
    /// release notifies (stores that always notify need not do anything). `Ok(false)`:
    /// the key is no longer running; claim again at once.
    fn register_waiter<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a str,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        let _ = (scope, key);
        Box::pin(std::future::ready(Ok(true)))
    }

    /// A future that resolves when the key may have been completed or released, so that
    /// a request waiting for a running key can claim again. Call it *before* the claim
    /// that finds the key running: a change in between still resolves it. It may also
    /// resolve spuriously; the caller claims again either way and bounds its wait.
    ///
    /// The default never resolves (a store without notifications): waiters then look
    /// again only when the holder's lease lapses, or at their bound.
    fn changed(&self, scope: &Scope, key: &str) -> BoxFuture<'static, ()> {
        let _ = (scope, key);
        Box::pin(std::future::pending())
    }

    /// How often a request waiting for a running key claims again even though nothing
    /// told it the key changed, in case its holder's process is gone: no notification
    /// comes from a process killed mid-handler, and a store that takes such a key over
    /// before its lease lapses ([`PostgresStore`] with liveness: within a second) gives
    /// the waiter the key only if it asks.
    ///
    /// The default, `None`: the waiter looks again when the holder's lease lapses, or at
    /// its bound (a store whose holders die with it, as [`MemoryStore`]'s).
    fn running_recheck(&self) -> Option<Duration> {
        None
    }

    /// How long a claim its caller gave up on (at the store timeout) is still waited
    /// for, so that if it lands its key is released at once. Past this its future is
    /// dropped.
    ///
    /// The default is the claim's `lease`: a claim that lands later holds its key as
    /// running until its lease lapses, as a crashed holder's would. A store whose claim,
    /// dropped unanswered, releases by itself what may have landed returns less, so
    /// that a claim stuck on a connection that died without a word (a failover, a NAT)
    /// gives that connection back sooner ([`PostgresStore`]: 5 s on pooled
    /// connections; a lease with shared claim connections, which a dropped claim does
    /// not close).
    fn abandoned_claim_wait(&self, lease: Duration) -> Duration {
        lease
    }

    /// Where the store keeps its records, if another store may keep them in the same
    /// place: two stores with the same location claim the same keys. Layers nested on
    /// one route compare it, so that a layer of one mode inside a layer of the other over
    /// the same records answers `500 misconfigured` at once, instead of claiming a key
    /// its outer layer holds (docs/security.md). The default, `None`, is never the same
    /// as another's.
    fn records_location(&self) -> Option<Arc<str>> {
        None
    }

    /// Creates, or brings up to date, what the store keeps its records in, so that it
    /// can serve: [`PostgresStore`] runs its [`migrate`](PostgresStore::migrate) (safe
    /// from every replica at start-up). The default does nothing: a store that needs
    /// nothing set up, as [`MemoryStore`].
    ///
    /// [`IdempotencyLayer::migrate`](crate::IdempotencyLayer::migrate) and
    /// [`JobRunner::migrate`](crate::job::JobRunner::migrate) call it, so that an app
    /// that handed them a bare pool needs no store of its own to migrate.
    ///
    /// # Errors
    ///
    /// The store could not be reached, or could not be set up.
    fn migrate(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(std::future::ready(Ok(())))
    }

    /// Extends the lease to `duration` from now. [`LeaseLost`](Fenced::LeaseLost): the
    /// lease no longer held the key.
    ///
    /// # Errors
    ///
    /// The store could not be reached, or failed; the lease may not be extended.
    fn renew<'a>(
        &'a self,
        lease: &'a Lease,
        duration: Duration,
    ) -> BoxFuture<'a, Result<Fenced, StoreError>>;
}

/// What a store that cannot record steps answers.
fn no_steps() -> StoreError {
    StoreError::new(
        StoreErrorKind::Misconfigured,
        "this store cannot record steps (Store::steps, Store::record_step)",
    )
}

/// Purges expired records from `store` in the background: every `every` (at least
/// 1 ms), batches of `batch` until a batch comes back short. Errors are logged and
/// retried next time. Abort the handle to stop it: as with any Tokio task, dropping the
/// handle leaves the purger running. Several replicas may each run one: PostgreSQL
/// purgers skip each other's rows.
///
/// ```
/// use std::{sync::Arc, time::Duration};
/// use tower_idempotency::store::{MemoryStore, spawn_purger};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let purger = spawn_purger(Arc::new(MemoryStore::new()), Duration::from_secs(60), 10_000);
/// purger.abort();
/// # }
/// ```
pub fn spawn_purger(
    store: Arc<dyn Store>,
    every: Duration,
    batch: usize,
) -> tokio::task::JoinHandle<()> {
    let batch = batch.max(1);
    // A zero period would panic inside the task, where nobody sees it.
    let every = crate::settings::duration(every, crate::settings::MILLISECOND);
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            loop {
                match store.purge(batch).await {
                    Ok(n) => {
                        crate::observe::purged(n);
                        if (n as usize) < batch {
                            break;
                        }
                    }
                    Err(e) => {
                        crate::observe::store_failed("purge");
                        tracing::warn!(error = %e, "purging expired idempotency records failed");
                        break;
                    }
                }
            }
        }
    })
}

/// Anything [`IdempotencyLayer::new`](crate::IdempotencyLayer::new) and
/// [`JobRunner::new`](crate::job::JobRunner::new) accept as a store: a [`Store`], an
/// `Arc<dyn Store>`, or a `deadpool_postgres::Pool` (a [`PostgresStore`] over it, with
/// the default table `public.idempotency_keys`).
pub trait IntoStore {
    /// The store, shared.
    fn into_store(self) -> Arc<dyn Store>;
}

impl<S: Store> IntoStore for S {
    fn into_store(self) -> Arc<dyn Store> {
        Arc::new(self)
    }
}

impl IntoStore for Arc<dyn Store> {
    fn into_store(self) -> Arc<dyn Store> {
        self
    }
}

/// The app's own sqlx pool, as a [`SqlxStore`] with its defaults.
#[cfg(feature = "sqlx")]
impl IntoStore for ::sqlx::PgPool {
    fn into_store(self) -> Arc<dyn Store> {
        Arc::new(SqlxStore::new(self))
    }
}

#[cfg(feature = "postgres")]
impl IntoStore for deadpool_postgres::Pool {
    fn into_store(self) -> Arc<dyn Store> {
        Arc::new(PostgresStore::new(self))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_purger_with_a_zero_period_keeps_purging() {
        let store = Arc::new(MemoryStore::new());
        let claim = |key| {
            let store = store.clone();
            async move {
                let scope = Scope::anonymous();
                let request = ClaimRequest {
                    scope: &scope,
                    key,
                    fingerprint: crate::Fingerprint::new([0; 32]),
                    lease: Duration::ZERO,
                    ttl: Duration::ZERO,
                };
                let claimed = store.claim(&request).await;
                assert!(matches!(claimed, Ok(Claim::Acquired(_))));
            }
        };
        let purger = spawn_purger(store.clone(), Duration::ZERO, 10);
        // Records whose lease and TTL have lapsed, claimed after the purger's first
        // tick: only a purger that is still running removes them.
        tokio::time::sleep(Duration::from_millis(20)).await;
        claim("a").await;
        claim("b").await;
        for _ in 0..1000 {
            if store.is_empty() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(store.is_empty(), "the purger stopped purging (it panicked)");
        purger.abort();
    }
}
