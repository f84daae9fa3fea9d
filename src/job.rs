//! The same guarantees without HTTP: run a piece of work at most once per key.
//!
//! A queue consumer that may see a message twice (redelivery after a timeout, a
//! producer's retry) runs it through a [`JobRunner`] keyed by the message id: the first
//! delivery runs the work and stores its result; later ones get the stored result
//! without running anything. Lease mode works on any [`Store`]; transactional mode
//! ([`JobRunner::transactional`]) also commits the work's own writes together with the
//! result.
//!
//! ```
//! use bytes::Bytes;
//! use tower_idempotency::{Scope, job::{JobOutcome, JobRunner}, store::MemoryStore};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let runner = JobRunner::new(MemoryStore::new());
//! let scope = Scope::new("billing-consumer");
//! let mut outcomes = Vec::new();
//! for _delivery in 0..2 {
//!     let outcome = runner
//!         .run(&scope, "msg-42", b"credit 100", |_ctx| async {
//!             // ... apply the message ...
//!             Ok::<_, std::io::Error>(Bytes::from_static(b"credited"))
//!         })
//!         .await?;
//!     outcomes.push(outcome);
//! }
//! // The first delivery ran the work; the redelivery got its result, running nothing.
//! assert!(matches!(&outcomes[..], [JobOutcome::Ran(r), JobOutcome::AlreadyDone(d)] if r == "credited" && d == "credited"));
//! # Ok(()) }
//! ```

use std::{fmt, future::Future, sync::Arc, time::Duration};

use bytes::Bytes;
use sha2::{Digest, Sha256};
use tracing::Instrument;

use crate::{
    Fingerprint, IdempotencyKey, Outcome, Scope, ShutdownHandle,
    observe::Mode,
    run::{
        Leased,
        job::{found, started, stored},
        previous::{Reader, job_answer},
        renewal::{Renewal, Renewals},
        sealing::Sealing,
        storing::Completion,
    },
    settings::{self, MILLISECOND, SHORTEST_LEASE},
    shutdown::InFlight,
    store::{ClaimRequest, IntoStore, Lease, Store, StoreError},
};
#[cfg(feature = "postgres")]
use crate::{run::transactional::run_job, settings::LONGEST_LOCK_TIMEOUT};

/// Runs work at most once per (scope, key).
#[derive(Clone)]
pub struct JobRunner {
    store: Arc<dyn Store>,
    lease: Duration,
    ttl: Duration,
    store_timeout: Duration,
    shutdown: ShutdownHandle,
    sealing: Sealing,
    renewals: Renewals,
    #[cfg(feature = "postgres")]
    transactional: Option<(crate::store::transaction::TxStore, Duration)>,
}

/// What the work gets.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct JobContext {
    /// The key, with its scope; `key.derive(label)` for the systems the work calls.
    pub key: IdempotencyKey,
    /// The open transaction, in transactional mode: write here, and it commits with the
    /// result.
    #[cfg(feature = "postgres")]
    pub transaction: Option<crate::transactional::TransactionHandle>,
    /// The open transaction, in transactional mode on sqlx (a runner over a
    /// `sqlx::PgPool` or a [`SqlxStore`](crate::store::SqlxStore)): write here, and it
    /// commits with the result.
    #[cfg(feature = "sqlx")]
    pub sqlx_transaction: Option<crate::transactional::SqlxTransaction>,
}

/// How a [`JobRunner::run`] ended, when nothing failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JobOutcome {
    /// The work ran now; its result is stored, or, if the first attempt failed, is
    /// still being stored in the background for up to one more lease (a redelivery
    /// meanwhile gets [`Running`](Self::Running)).
    Ran(Bytes),
    /// The work had already run; this is its stored result.
    AlreadyDone(Bytes),
    /// Another worker is running it now: do not acknowledge the message; deliver it
    /// again later (that worker may still fail and release the key). In transactional
    /// mode: the other worker's transaction held the key past the runner's
    /// `lock_timeout`, or that worker's work committed the transaction itself and runs
    /// on (see [`JobError::TransactionEnded`]).
    Running {
        /// Time left on that worker's lease, or less where the store may find that
        /// worker gone sooner ([`Store::running_recheck`]: 1 s on a `PostgresStore`
        /// with liveness); transactional mode: 1 s.
        retry_after: Duration,
    },
    /// The work had already run, and its stored result is gone (its TTL ended), but
    /// the key is remembered ([`DEFAULT_REMEMBER`](crate::store::DEFAULT_REMEMBER)):
    /// it is not run again. Acknowledge the message; its result is not available.
    ResultExpired {
        /// When the work completed, by the store's clock.
        completed_at: std::time::SystemTime,
        /// Until when the key is remembered: a delivery after it runs the work anew.
        remembered_until: std::time::SystemTime,
    },
}

/// Why a [`JobRunner::run`] failed. Except for [`Mismatch`](Self::Mismatch), which no
/// redelivery can fix, and [`TakenOver`](Self::TakenOver) and
/// [`TransactionEnded`](Self::TransactionEnded), where the work ran, the work
/// either did not run, or its claim was released
/// (transactional mode: rolled back, or, if something the work spawned still holds its
/// client `store_timeout` after the work returned, ended on the server), or it may
/// have committed ([`NotCommitted`] when the check could not tell):
/// a later delivery runs it, or finds it done.
///
/// [`NotCommitted`]: Self::NotCommitted
#[derive(Debug)]
#[non_exhaustive]
pub enum JobError<E> {
    /// The work returned an error.
    Failed(E),
    /// The work panicked (its future, or the function that makes it), or the store did
    /// while it renewed the lease (the work is then stopped at its next `.await`) or
    /// made its first attempt to store the result; the key was released, so a
    /// redelivery runs it again.
    Panicked,
    /// The key was already used with a different input.
    Mismatch,
    /// The store failed (unreachable, slow, or in a state the runner cannot use: its
    /// [`kind`](StoreError::kind) says which); the work did not run.
    Store(StoreError),
    /// The runner's [`shutdown_handle`](JobRunner::shutdown_handle) is closed: nothing
    /// was claimed, and the work did not run. Leave the message for another consumer.
    ShuttingDown,
    /// Transactional mode: the work's transaction was not committed, so it had no
    /// effect; or the connection failed during its `COMMIT` and whether it committed
    /// could not be checked. Either way, run it again with the same key: it returns
    /// [`JobOutcome::AlreadyDone`] if it did commit.
    NotCommitted,
    /// Transactional mode: the work ended the runner's transaction itself (a `COMMIT` or
    /// `ROLLBACK` on its client), so what it wrote may have committed without its
    /// result. The key is completed with this outcome, so a redelivery returns it too
    /// rather than running the work again: acknowledge the message, and raise an alarm.
    /// After the work's `ROLLBACK`, though, nothing holds the key until the work
    /// returns: a redelivery in that time runs it again, and the key keeps that run's
    /// outcome.
    TransactionEnded,
    /// Lease mode: the work ran and returned this result, but meanwhile its lease was
    /// taken over (the store was out of reach for longer than a lease, and a redelivery
    /// claimed the key). That delivery may have run the work too, and its result, not
    /// this one, is what the key holds. Acknowledge the message, and raise an alarm:
    /// the work may have run twice.
    TakenOver(Bytes),
}

impl<E: fmt::Display> fmt::Display for JobError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Failed(e) => write!(f, "the job failed: {e}"),
            Self::Panicked => f.write_str("the job panicked"),
            Self::Mismatch => f.write_str("the key was already used with a different input"),
            Self::Store(e) => write!(f, "{e}"),
            Self::ShuttingDown => f.write_str("the job runner is shutting down; nothing was run"),
            Self::NotCommitted => f.write_str("the job's transaction was not committed"),
            Self::TransactionEnded => f.write_str(
                "the job ended its transaction itself; what it wrote may have committed without its result",
            ),
            Self::TakenOver(_) => f.write_str(
                "the job ran, but its key was taken over meanwhile; another run may have run it too",
            ),
        }
    }
}

impl<E: fmt::Debug + fmt::Display> std::error::Error for JobError<E> {}

impl JobRunner {
    /// A runner in lease mode over `store` (30 s lease, renewed while the work runs;
    /// results kept 24 h).
    pub fn new(store: impl IntoStore) -> Self {
        Self {
            store: store.into_store(),
            lease: Duration::from_secs(30),
            ttl: Duration::from_secs(24 * 3600),
            store_timeout: Duration::from_secs(5),
            shutdown: ShutdownHandle::default(),
            sealing: Sealing::default(),
            renewals: Renewals::default(),
            #[cfg(feature = "postgres")]
            transactional: None,
        }
    }

    /// A runner in transactional mode: the work gets the open transaction in
    /// [`JobContext::transaction`] (or, on sqlx, [`JobContext::sqlx_transaction`]), and
    /// its writes commit with the result. `store` is a
    /// [`PostgresStore`](crate::store::PostgresStore), or the app's
    /// `deadpool_postgres::Pool`, or, with the `sqlx` feature, a
    /// [`SqlxStore`](crate::store::SqlxStore) or the app's `sqlx::PgPool` (a pool: the
    /// table `public.idempotency_keys`); run [`migrate`](Self::migrate) once before the
    /// first job.
    #[cfg(feature = "postgres")]
    pub fn transactional(store: impl Into<crate::store::TransactionalStore>) -> Self {
        use crate::store::transaction::TxStore;
        let store = store.into().0;
        let mut runner = match &store {
            TxStore::Postgres(store) => Self::new(store.clone()),
            #[cfg(feature = "sqlx")]
            TxStore::Sqlx(store) => Self::new(store.clone()),
        };
        runner.transactional = Some((store, Duration::from_secs(5)));
        runner
    }

    /// The lease (lease mode; default 30 s; from 10 ms to 10 years).
    #[must_use]
    pub fn lease_duration(mut self, lease: Duration) -> Self {
        self.lease = settings::duration(lease, SHORTEST_LEASE);
        self
    }

    /// How long results are kept (default 24 h; from 1 ms to 10 years).
    #[must_use]
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = settings::duration(ttl, MILLISECOND);
        self
    }

    /// How long to wait for the store (default 5 s; from 1 ms to 10 years): on the claim (then
    /// the run fails with [`JobError::Store`] and the work does not run), and in lease
    /// mode on each attempt to store the result (the lease is renewed meanwhile; `run`
    /// returns after the first, and the others go on in the background for one more
    /// lease) and on a release; in transactional mode, on every statement the runner
    /// sends in the transaction (opening it with the claim, the completion with its
    /// `COMMIT`, which is checked on another connection if no answer comes in time, a
    /// `ROLLBACK`), and on the work's hold on its client once it has returned (then
    /// its transaction is ended on the server). A claim that lands after the bound,
    /// or after the run was dropped, is released at once, so that a redelivery can run
    /// the work rather than wait out the lease; on a pooled PostgreSQL connection it
    /// is waited for 5 s more, then its connection is closed and it is released in
    /// doubt, by its token, at once, 1 s later, 5 s after that, then at growing gaps
    /// while its lease holds (a takeover in doubt frees its key when its lease lapses).
    #[must_use]
    pub fn store_timeout(mut self, timeout: Duration) -> Self {
        self.store_timeout = settings::duration(timeout, MILLISECOND);
        self
    }

    /// Transactional mode: how long to wait on another worker's uncommitted claim
    /// before answering [`JobOutcome::Running`] (default 5 s; from 1 ms to 24.8 days).
    #[cfg(feature = "postgres")]
    #[must_use]
    pub fn lock_timeout(mut self, timeout: Duration) -> Self {
        if let Some((_, t)) = &mut self.transactional {
            *t = timeout.clamp(MILLISECOND, LONGEST_LOCK_TIMEOUT);
        }
        self
    }

    /// Seals every result the runner stores with `keys`, and stores keys hashed, as
    /// [`IdempotencyLayer::encrypt_responses`](crate::IdempotencyLayer::encrypt_responses)
    /// does for responses (see [`encryption`](crate::encryption)). A stored result that
    /// cannot be opened (a key dropped too soon, a record changed or copied onto another
    /// key) is a [`JobError::Store`] of kind [`Corrupt`](crate::store::StoreErrorKind::Corrupt),
    /// and the work does not run.
    ///
    /// ```
    /// use tower_idempotency::{encryption::EncryptionKeys, job::JobRunner, store::MemoryStore};
    ///
    /// let runner = JobRunner::new(MemoryStore::new()).encrypt_results(EncryptionKeys::new(1, [7; 32]));
    /// ```
    #[must_use]
    pub fn encrypt_results(mut self, keys: crate::encryption::EncryptionKeys) -> Self {
        self.sealing = Sealing::new(keys);
        self
    }

    /// Stops this runner (and its clones) from starting work, and waits for the work it
    /// has started: [`close`](ShutdownHandle::close) makes later runs return
    /// [`JobError::ShuttingDown`] before they claim anything, and
    /// [`drain`](ShutdownHandle::drain) waits until every run has ended, its result
    /// stored or its key released, including results still being stored in the
    /// background after `run` returned and work whose run its caller dropped. Drain
    /// before the process exits, so that no result is lost to leave its key claimed
    /// until the lease lapses.
    ///
    /// ```
    /// use tower_idempotency::{job::JobRunner, store::MemoryStore};
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let runner = JobRunner::new(MemoryStore::new());
    /// let shutdown = runner.shutdown_handle();
    /// // ... consume messages with `runner`; on SIGTERM, stop consuming, then:
    /// shutdown.drain().await;
    /// # }
    /// ```
    pub fn shutdown_handle(&self) -> ShutdownHandle {
        self.shutdown.clone()
    }

    /// Makes `handle` this runner's shutdown handle (default: one of its own), so that
    /// one [`drain`](ShutdownHandle::drain) shuts it down with the app's layers and
    /// other runners given the same handle. See [`ShutdownHandle`].
    #[must_use]
    pub fn shutdown_with(mut self, handle: ShutdownHandle) -> Self {
        self.shutdown = handle;
        self
    }

    /// Sets up the runner's store so that it can serve
    /// ([`Store::migrate`]): for PostgreSQL, creates the
    /// table and applies pending migrations (safe from every consumer at start-up); for
    /// the memory store, nothing.
    ///
    /// # Errors
    ///
    /// The store could not be reached, or could not be set up.
    pub async fn migrate(&self) -> Result<(), StoreError> {
        self.store.migrate().await
    }

    /// Runs `work` for (`scope`, `key`) unless it already ran. `input` is fingerprinted:
    /// the same key with another input is [`JobError::Mismatch`].
    ///
    /// Dropping the returned future (a timeout of the caller's, a `select!`) does not
    /// cancel work that has started. In lease mode it runs to the end, with its lease
    /// renewed, and its result is stored (or its key released), so a redelivery gets
    /// [`JobOutcome::AlreadyDone`]; in transactional mode its transaction is rolled back
    /// when the work ends, and a redelivery runs it anew, so a work that always outlasts
    /// its caller's timeout never completes there. Nothing bounds the work itself: a
    /// work that hangs is renewed, and holds its key, for as long as it hangs; bound
    /// the calls it makes. (A store that panics while it renews the lease stops the
    /// work, as the layer drops its handler: see [`JobError::Panicked`].)
    ///
    /// The run, and what it leaves running, is in a `job` tracing span with the key.
    ///
    /// # Errors
    ///
    /// [`JobError::Mismatch`] for another input under the key; [`JobError::Store`] when the
    /// claim fails or times out (the work did not run); [`JobError::Failed`] or
    /// [`JobError::Panicked`] when the work did (its key is released); [`JobError::TakenOver`]
    /// when its lease was lost before its result could be stored; [`JobError::ShuttingDown`]
    /// after [`ShutdownHandle::close`](crate::ShutdownHandle::close); in transactional mode,
    /// [`JobError::NotCommitted`] and [`JobError::TransactionEnded`]. Each variant says
    /// whether the work ran.
    pub async fn run<F, Fut, E>(
        &self,
        scope: &Scope,
        key: &str,
        input: &[u8],
        work: F,
    ) -> Result<JobOutcome, JobError<E>>
    where
        F: FnOnce(JobContext) -> Fut,
        Fut: Future<Output = Result<Bytes, E>> + Send + 'static,
        E: Send + 'static,
    {
        let span = tracing::info_span!("job", key);
        let running = async move {
            let Some(in_flight) = self.shutdown.enter() else {
                return Err(JobError::ShuttingDown);
            };
            // Hashed once the runner has encryption keys: the store never sees the key.
            let stored_key = self.sealing.stored_key(key);
            let request = ClaimRequest {
                scope,
                key: &stored_key,
                fingerprint: Fingerprint::new(Sha256::digest(input).into()),
                lease: self.lease,
                ttl: self.ttl,
            };
            let ctx_key = IdempotencyKey::new(scope.clone(), Arc::<str>::from(key));
            #[cfg(feature = "postgres")]
            if let Some((store, lock_timeout)) = &self.transactional {
                let timeouts = (*lock_timeout, self.store_timeout);
                let shutdown = &self.shutdown;
                let keyed = (ctx_key, &self.sealing);
                return run_job(store, timeouts, shutdown, &request, keyed, work, in_flight).await;
            }
            let claim = crate::store::claim_within(
                &self.store,
                self.store_timeout,
                &request,
                in_flight.clone(),
            )
            .await
            .map_err(|_| {
                tracing::error!(timeout = ?self.store_timeout, "claim timed out; the work was not run");
                JobError::Store(StoreError::new(
                    crate::store::StoreErrorKind::Timeout,
                    "claim timed out",
                ))
            })?
            .map_err(|e| {
                tracing::error!(error = %e, "claim failed; the work was not run");
                JobError::Store(e)
            })?;
            let lease = match found(claim, &request, key, &self.sealing)? {
                Ok(lease) => lease,
                // A store that finds a dead worker's key gone before its lease lapses
                // has it for a redelivery that soon.
                Err(JobOutcome::Running { retry_after }) => {
                    let recheck = self.store.running_recheck().unwrap_or(retry_after);
                    return Ok(JobOutcome::Running {
                        retry_after: retry_after.min(recheck),
                    });
                }
                Err(outcome) => return Ok(outcome),
            };
            // A record from before encryption, under the key in clear: answered from
            // there, the lease released (the lease is not renewed yet, hence the bound).
            let bound = self.store_timeout.min(self.lease / 3);
            let reader = Reader::Store(&*self.store);
            let earlier = job_answer(&self.sealing, reader, &request, key, bound);
            if let Some(answer) = earlier.await {
                self.release(&lease, in_flight).await;
                return answer;
            }
            let mut ctx_key = ctx_key;
            ctx_key.set_steps(crate::run::steps::log(&self.leased(), &lease));
            let ctx = JobContext {
                key: ctx_key,
                #[cfg(feature = "postgres")]
                transaction: None,
                #[cfg(feature = "sqlx")]
                sqlx_transaction: None,
            };
            let Some(work) = started(work, ctx) else {
                // In a task of its own, so that a caller that drops the run meanwhile
                // does not leave the key claimed for a lease.
                let runner = self.clone();
                let _ = tokio::spawn(
                    async move {
                        runner.release(&lease, in_flight).await;
                    }
                    .in_current_span(),
                )
                .await;
                return Err(JobError::Panicked);
            };
            // The work signals its end, however it ends (returns, panics, is aborted), by
            // dropping `ended`.
            let (ended, work_ended) = tokio::sync::oneshot::channel::<()>();
            let task = tokio::spawn(
                async move {
                    let _ended = ended;
                    work.await
                }
                .in_current_span(),
            );
            let work_handle = task.abort_handle();
            // The rest runs in a task of its own: a caller that drops the run (its own
            // timeout, a `select!`) leaves the work running, and then its lease is still
            // renewed and its result stored, or its key released, rather than the key left
            // claimed, unrenewed, for a redelivery to take over while the work still runs.
            // A store that panics while it renews or stores ends that part: the work is
            // stopped (as the layer drops its handler) and, once it has ended, the key is
            // released, as the layer does, counted in flight until it is.
            let runner = self.clone();
            tokio::spawn(
                async move {
                    let (held, holding) = (lease.clone(), in_flight.clone());
                    let finishing = crate::catch_panic::catch_panic(runner.finish(lease, task, in_flight));
                    match finishing.await {
                        Ok(result) => result,
                        Err(panic) => {
                            tracing::error!(
                                panic = crate::catch_panic::message(&panic),
                                "the store panicked while the work ran or its result was stored; releasing the key"
                            );
                            work_handle.abort();
                            let _ = work_ended.await;
                            runner.release(&held, holding).await;
                            Err(JobError::Panicked)
                        }
                    }
                }
                .in_current_span(),
            )
            .await
            .unwrap_or(Err(JobError::Panicked))
        };
        let mode = self.mode();
        async move {
            let result = running.await;
            let (outcome, name) = outcome_of(&result);
            crate::observe::job_ended(outcome, name, mode);
            result
        }
        .instrument(span)
        .await
    }

    fn mode(&self) -> Mode {
        #[cfg(feature = "postgres")]
        return Mode::of(self.transactional.is_some());
        #[cfg(not(feature = "postgres"))]
        Mode::Lease
    }

    /// Renews `lease` while `task` runs, then stores its result or releases the key.
    async fn finish<E>(
        &self,
        lease: Lease,
        task: tokio::task::JoinHandle<Result<Bytes, E>>,
        in_flight: InFlight,
    ) -> Result<JobOutcome, JobError<E>> {
        let mut renewal = Renewal::start(&self.renewals, &self.store, &lease, self.lease);
        let joined = renewal.watch(task).await;
        match joined {
            Ok(Ok(result)) => {
                // As the layer stores a response: renewed while the first attempt runs,
                // then retried in the background for one more lease, so that a brief
                // outage does not leave the key to lapse and a redelivery to run again.
                match self
                    .leased()
                    .store(&lease, stored(&result), in_flight, renewal)
                    .await
                {
                    Completion::Fenced => Err(JobError::TakenOver(result)),
                    Completion::Stored | Completion::Pending => Ok(JobOutcome::Ran(result)),
                }
            }
            Ok(Err(e)) => {
                drop(renewal);
                self.release(&lease, in_flight).await;
                Err(JobError::Failed(e))
            }
            Err(_) => {
                drop(renewal);
                self.release(&lease, in_flight).await;
                Err(JobError::Panicked)
            }
        }
    }

    /// Releases the key, as the layer does: again in the background while the store is
    /// away, counted in flight (`keep`) meanwhile.
    async fn release(&self, lease: &Lease, keep: InFlight) {
        self.leased().release(lease, keep).await;
    }

    /// What a run under a lease needs from this runner: its store and timing.
    fn leased(&self) -> Leased {
        Leased {
            store: self.store.clone(),
            lease: self.lease,
            ttl: self.ttl,
            store_timeout: self.store_timeout,
            sealing: self.sealing.clone(),
            renewals: self.renewals.clone(),
        }
    }
}

/// A run's result as the layer's [`Outcome`] (the work ran, its stored result was
/// returned, another worker runs it, ...), and the name of its variant, for its event
/// and metrics.
fn outcome_of<E>(result: &Result<JobOutcome, JobError<E>>) -> (Outcome, &'static str) {
    match result {
        Ok(JobOutcome::Ran(_)) => (Outcome::Executed, "ran"),
        Ok(JobOutcome::AlreadyDone(_)) => (Outcome::Replayed, "already_done"),
        Ok(JobOutcome::Running { .. }) => (Outcome::Conflict, "running"),
        Ok(JobOutcome::ResultExpired { .. }) => (Outcome::Expired, "result_expired"),
        Err(JobError::Failed(_)) => (Outcome::Released, "failed"),
        Err(JobError::Panicked) => (Outcome::Released, "panicked"),
        Err(JobError::TakenOver(_)) => (Outcome::Executed, "taken_over"),
        Err(JobError::TransactionEnded) => (Outcome::Executed, "transaction_ended"),
        Err(JobError::Mismatch) => (Outcome::Mismatch, "mismatch"),
        Err(JobError::ShuttingDown) => (Outcome::Rejected, "shutting_down"),
        Err(JobError::Store(_)) => (Outcome::StoreError, "store"),
        Err(JobError::NotCommitted) => (Outcome::StoreError, "not_committed"),
    }
}

impl fmt::Debug for JobRunner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JobRunner")
            .field("lease", &self.lease)
            .field("ttl", &self.ttl)
            .finish_non_exhaustive()
    }
}
