//! Recorded steps: a handler's calls to other systems, each run once per key and its
//! result recorded under the key's lease, so that a later run of the key (a retry after
//! a crash, a takeover) gets the result instead of making the call again
//! ([`IdempotencyKey::step`]).
//!
//! A run reads the key's recorded steps once, at its first step, and then takes them in
//! order: a step whose place is recorded is answered from the record (its name must be
//! the one recorded), the first one past them runs, and its result is recorded, under
//! the lease's fencing token, before it is returned.

use std::{fmt, future::Future, sync::Arc, time::Duration};

use serde::{Serialize, de::DeserializeOwned};

use crate::{
    IdempotencyKey,
    store::{Lease, RecordedStep, Store, StoreError, StoreErrorKind},
};

/// The steps of one run of a key: its store and lease, and how far the run has come.
/// Shared by every clone of the run's [`IdempotencyKey`].
pub(crate) struct StepLog {
    recorder: Recorder,
    lease: Lease,
    store_timeout: Duration,
    /// Seals the results, if the layer or runner has keys.
    sealing: super::sealing::Sealing,
    progress: tokio::sync::Mutex<Progress>,
}

impl fmt::Debug for StepLog {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StepLog")
            .field("lease", &self.lease)
            .finish_non_exhaustive()
    }
}

/// Where a run's steps are recorded.
enum Recorder {
    /// Lease mode: the store, fencing by the lease's token.
    Lease(Arc<dyn Store>),
    /// Transactional mode: apart from the claim's transaction (which may roll back),
    /// while that transaction runs, for the request of `fingerprint`.
    #[cfg(feature = "postgres")]
    Transaction(Box<InTransaction>),
}

/// Where transactional mode records a run's steps.
#[cfg(feature = "postgres")]
struct InTransaction {
    store: crate::store::transaction::TxStore,
    backend: crate::store::transaction::Backend,
    fingerprint: crate::Fingerprint,
}

impl Recorder {
    async fn steps(&self, lease: &Lease) -> Result<Option<Vec<RecordedStep>>, StoreError> {
        match self {
            Self::Lease(store) => store.steps(lease).await,
            #[cfg(feature = "postgres")]
            Self::Transaction(t) => t.store.steps_apart(lease, &t.fingerprint).await.map(Some),
        }
    }

    async fn record(
        &self,
        lease: &Lease,
        step: &RecordedStep,
    ) -> Result<crate::store::Fenced, StoreError> {
        match self {
            Self::Lease(store) => store.record_step(lease, step).await,
            #[cfg(feature = "postgres")]
            Self::Transaction(t) => {
                let recording = t
                    .store
                    .record_step_apart(lease, &t.backend, &t.fingerprint, step);
                recording.await
            }
        }
    }
}

/// How far a run has come: the steps recorded when it began (read at its first step),
/// and the place of its next step.
#[derive(Default)]
struct Progress {
    recorded: Option<Vec<RecordedStep>>,
    next: u32,
}

impl StepLog {
    /// The steps of a run under `lease`, recorded in `store`.
    fn new(leased: &super::Leased, lease: Lease) -> Self {
        Self {
            recorder: Recorder::Lease(leased.store.clone()),
            lease,
            store_timeout: leased.store_timeout,
            sealing: leased.sealing.clone(),
            progress: tokio::sync::Mutex::default(),
        }
    }

    /// Whether the run read or recorded any step: in transactional mode its steps are
    /// then forgotten in its transaction, which commits with the response.
    /// A step still under way (in a task the handler left running) counts.
    #[cfg(feature = "postgres")]
    pub(crate) fn has_steps(&self) -> bool {
        let Ok(progress) = self.progress.try_lock() else {
            return true;
        };
        progress.next > 0 || progress.recorded.as_ref().is_some_and(|r| !r.is_empty())
    }
}

/// The steps of a run in transactional mode, in the transaction of `backend`.
#[cfg(feature = "postgres")]
pub(crate) fn in_transaction(
    store: &crate::store::transaction::TxStore,
    claimed: (
        &Lease,
        crate::store::transaction::Backend,
        crate::Fingerprint,
    ),
    sealing: &super::sealing::Sealing,
    store_timeout: Duration,
) -> Arc<StepLog> {
    let (lease, backend, fingerprint) = claimed;
    Arc::new(StepLog {
        recorder: Recorder::Transaction(Box::new(InTransaction {
            store: store.clone(),
            backend,
            fingerprint,
        })),
        lease: lease.clone(),
        store_timeout,
        sealing: sealing.clone(),
        progress: tokio::sync::Mutex::default(),
    })
}

/// A key's steps, if it has any: what a layer or job runner leaves in the key it hands
/// over. Never part of the key's identity (equality, hash).
#[derive(Clone, Default)]
pub(crate) struct Steps(pub(crate) Option<Arc<StepLog>>);

impl PartialEq for Steps {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl Eq for Steps {}

impl std::hash::Hash for Steps {
    fn hash<H: std::hash::Hasher>(&self, _: &mut H) {}
}

impl fmt::Debug for Steps {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.0.is_some() { "recorded" } else { "none" })
    }
}

/// Gives the key a layer handed over in `extensions` the steps of its run under
/// `lease`.
pub(crate) fn attach(extensions: &mut http::Extensions, leased: &super::Leased, lease: &Lease) {
    attach_log(extensions, log(leased, lease));
}

/// Gives the key a layer handed over in `extensions` these steps.
pub(crate) fn attach_log(extensions: &mut http::Extensions, steps: Steps) {
    if let Some(key) = extensions.get_mut::<IdempotencyKey>() {
        key.set_steps(steps);
    }
}

/// The steps of a run under `lease`.
pub(crate) fn log(leased: &super::Leased, lease: &Lease) -> Steps {
    Steps(Some(Arc::new(StepLog::new(leased, lease.clone()))))
}

/// Why a step of [`IdempotencyKey::step`] or [`IdempotencyKey::try_step`] returned no
/// result. `E`: the error of a fallible step ([`try_step`](IdempotencyKey::try_step)).
///
/// Each variant says whether the step ran. In Axum, the one of
/// [`step`](IdempotencyKey::step) answers for itself: `500 handler-failed`, which the
/// layer does not store by default, so the key is released.
#[derive(Debug)]
#[non_exhaustive]
pub enum StepError<E = std::convert::Infallible> {
    /// The step ran and failed with this: nothing was recorded, and a later run of the
    /// key runs it again.
    Failed(E),
    /// The run asked for a step other than the one recorded in its place: the handler
    /// takes its steps in another order, or under other names, than the run that
    /// recorded them. Nothing ran.
    OutOfOrder {
        /// The step's place, from 0.
        n: u32,
        /// The name asked for.
        asked: String,
        /// The name recorded in that place.
        recorded: String,
    },
    /// The recorded result could not be read as the type asked for (the handler
    /// changed the step's result type since it was recorded): nothing ran. Or the
    /// result of a step that ran could not be written as JSON: nothing was recorded.
    Unreadable {
        /// The step's name.
        name: String,
        /// What the reader said.
        error: serde_json::Error,
    },
    /// The run's lease no longer holds the key (another run took it over): the step's
    /// result, if it ran, was not recorded, and is not returned.
    LeaseLost {
        /// The step's name.
        name: String,
    },
    /// The store failed to read or record the steps; a step that ran may or may not
    /// be recorded, and its result is not returned.
    Store(StoreError),
    /// The key has no record to keep steps in: it was not handed over by an
    /// [`IdempotencyLayer`](crate::IdempotencyLayer) or a
    /// [`JobRunner`](crate::job::JobRunner) (a key made by hand). Nothing ran.
    Unrecorded {
        /// The step's name.
        name: String,
    },
}

impl<E: fmt::Display> fmt::Display for StepError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Failed(e) => write!(f, "the step failed: {e}"),
            Self::OutOfOrder { n, asked, recorded } => write!(
                f,
                "step {n} was asked for as {asked:?}, and is recorded as {recorded:?}: the handler takes its steps in another order than the run that recorded them; nothing ran"
            ),
            Self::Unreadable { name, error } => write!(
                f,
                "the result of step {name:?} could not be read or written as JSON: {error}"
            ),
            Self::LeaseLost { name } => write!(
                f,
                "the key was taken over by another run: step {name:?}'s result was not recorded"
            ),
            Self::Store(e) => write!(f, "the steps could not be read or recorded: {e}"),
            Self::Unrecorded { name } => write!(
                f,
                "step {name:?} has no record to be kept in: the key was not handed over by a layer or job runner; nothing ran"
            ),
        }
    }
}

impl<E: std::error::Error + 'static> std::error::Error for StepError<E> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Failed(e) => Some(e),
            Self::Unreadable { error, .. } => Some(error),
            Self::Store(e) => Some(e),
            _ => None,
        }
    }
}

impl IdempotencyKey {
    /// Runs `step` once for this key, as the step named `name` in the handler's order,
    /// and returns its result, recorded in the store under the key's lease before it
    /// returns. A later run of the same key (a retry after a crash, a takeover of a
    /// holder gone) gets the recorded result without running `step` again.
    ///
    /// Steps are taken in order: a run asks for its steps in the order the first run
    /// did, under the same names ([`StepError::OutOfOrder`] otherwise, and nothing
    /// runs). A step that ran but whose result was not recorded (the process died
    /// inside it) runs again: give the system it calls [`derive`](Self::derive)d keys,
    /// so that it does the work once however often it is asked. The steps are
    /// forgotten when the key completes, or is released (a response the layer does not
    /// store, as a 5xx).
    ///
    /// ```
    /// use axum::{Router, http::StatusCode, routing::post};
    /// use tower_idempotency::{IdempotencyKey, IdempotencyLayer, StepError};
    /// # use tower_idempotency::store::MemoryStore;
    /// # async fn charge(_key: String, _cents: u64) -> String { "ch_1".into() }
    ///
    /// async fn pay(key: IdempotencyKey) -> Result<(StatusCode, String), StepError> {
    ///     let psp_key = key.derive("psp");
    ///     let charge: String = key.step("charge", || charge(psp_key, 1999)).await?;
    ///     Ok((StatusCode::CREATED, charge))
    /// }
    ///
    /// let app: Router = Router::new()
    ///     .route("/payments", post(pay))
    ///     .layer(IdempotencyLayer::new(MemoryStore::new()));
    /// ```
    ///
    /// # Errors
    ///
    /// [`StepError`]: each variant says whether the step ran.
    pub async fn step<T, F, Fut>(&self, name: &str, step: F) -> Result<T, StepError>
    where
        T: Serialize + DeserializeOwned,
        F: FnOnce() -> Fut,
        Fut: Future<Output = T>,
    {
        self.try_step(name, || async { Ok(step().await) }).await
    }

    /// [`step`](Self::step), for a step that may fail: its error is returned as
    /// [`StepError::Failed`], and nothing is recorded, so that a later run of the key
    /// runs it again.
    ///
    /// ```
    /// use tower_idempotency::{IdempotencyKey, StepError};
    ///
    /// # async fn run(key: IdempotencyKey) -> Result<(), Box<dyn std::error::Error>> {
    /// let shipped: Result<u64, StepError<std::io::Error>> = key
    ///     .try_step("ship", || async { Ok(42) })
    ///     .await;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// [`StepError`]: each variant says whether the step ran.
    pub async fn try_step<T, E, F, Fut>(&self, name: &str, step: F) -> Result<T, StepError<E>>
    where
        T: Serialize + DeserializeOwned,
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        let Some(log) = self.steps().0.clone() else {
            return Err(StepError::Unrecorded { name: name.into() });
        };
        let timeout = log.store_timeout;
        // Held through the step: steps of one run are taken one at a time, in one order.
        let mut progress = log.progress.lock().await;
        if progress.recorded.is_none() {
            let read =
                crate::store::within(timeout, "reading steps", log.recorder.steps(&log.lease));
            match read.await {
                Ok(Some(recorded)) => progress.recorded = Some(recorded),
                Ok(None) => return Err(StepError::LeaseLost { name: name.into() }),
                Err(e) => return Err(StepError::Store(e)),
            }
        }
        let n = progress.next;
        let recorded = progress
            .recorded
            .as_ref()
            .and_then(|steps| steps.iter().find(|s| s.n == n));
        if let Some(recorded) = recorded {
            if recorded.name != name {
                return Err(StepError::OutOfOrder {
                    n,
                    asked: name.into(),
                    recorded: recorded.name.clone(),
                });
            }
            let (scope, key) = (&log.lease.scope, &log.lease.key);
            let opened = log
                .sealing
                .open_step(scope, key, n, recorded.result.clone());
            let opened = opened.map_err(|unreadable| {
                StepError::Store(StoreError::new(
                    StoreErrorKind::Corrupt,
                    format!("the recorded result of step {name:?} could not be opened: {unreadable}; nothing ran"),
                ))
            })?;
            let value = serde_json::from_slice(&opened).map_err(|error| StepError::Unreadable {
                name: name.into(),
                error,
            })?;
            progress.next += 1;
            tracing::debug!(step = name, n, "a recorded step's result replayed");
            return Ok(value);
        }
        let value = step().await.map_err(StepError::Failed)?;
        let result = serde_json::to_vec(&value).map_err(|error| StepError::Unreadable {
            name: name.into(),
            error,
        })?;
        let record = RecordedStep {
            n,
            name: name.into(),
            result: log
                .sealing
                .seal_step(&log.lease.scope, &log.lease.key, n, result),
        };
        let recording = log.recorder.record(&log.lease, &record);
        match crate::store::within(timeout, "recording a step", recording).await {
            Ok(fenced) if fenced.is_kept() => {
                progress.next += 1;
                Ok(value)
            }
            Ok(_) => {
                tracing::warn!(
                    step = name,
                    n,
                    "a step ran, and its result was not recorded: the key was taken over"
                );
                Err(StepError::LeaseLost { name: name.into() })
            }
            Err(e) => {
                tracing::error!(step = name, n, error = %e, "a step ran, and recording its result failed");
                Err(StepError::Store(e))
            }
        }
    }
}
