//! The drivers transactional mode runs on, behind one engine (`run::transactional`):
//! the store ([`TxStore`]) and the connection that holds a request's transaction
//! ([`TxConn`]), of tokio-postgres (a deadpool [`Checkout`]) or of sqlx (a
//! [`SqlxConn`] of the app's `PgPool`).
//!
//! A closed set of two, so an enum: each operation of the engine's is one `match` that
//! hands it to its driver, which sends the shared statements its own way (pipelined on
//! tokio-postgres, one after the other on sqlx); the engine's decisions (what a failed,
//! lost or refused `COMMIT` means, when the key is finished as ended) are made once,
//! from the driver-neutral answers below ([`CommitEnd`], [`Checked`]). No SQL here.
//!
//! A connection comes only from its own store's [`TxStore::connection`]: an operation
//! of one driver never meets a connection of the other.

use std::{sync::Arc, time::Duration};

use deadpool_postgres::ClientWrapper;
use tokio::time::{Instant, timeout, timeout_at};

#[cfg(feature = "sqlx")]
use super::sqlx_store::{SqlxConn, SqlxStore, lost_its_connection, roll_back};
use super::{
    Checkout, PostgresStore,
    errors::{again_if_it_lost_a_race, connection_lost, describe, in_an_aborted_transaction},
    tx::{Backend, Ending, Resolution, commit_on, kept_if_rolled_back},
};
use crate::{
    Fingerprint, StoredResponse,
    run::{sealing::Sealing, steps::StepLog},
    store::{Claim, ClaimRequest, Fenced, FencingToken, Lease, RecordedStep, StoreError},
};

/// The store of a layer or job runner in transactional mode.
// Not boxed: a request clones its store as it did before there were two, and
// boxing would add an allocation to that clone.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug)]
pub(crate) enum TxStore {
    /// tokio-postgres, over deadpool.
    Postgres(PostgresStore),
    /// sqlx, over the app's `PgPool`.
    #[cfg(feature = "sqlx")]
    Sqlx(SqlxStore),
}

/// A connection holding a transaction of the layer's: given back to its pool once
/// [`done`](Self::done); dropped before, closed, which rolls the transaction back.
// Not boxed: moved a few times per request, where boxing would allocate once per
// request on the tokio-postgres path.
#[allow(clippy::large_enum_variant)]
pub(crate) enum TxConn {
    /// A deadpool connection (its statements given up on are cancelled too).
    Deadpool(Checkout),
    /// A connection of the app's sqlx pool.
    #[cfg(feature = "sqlx")]
    Sqlx(SqlxConn),
}

/// What the completion and `COMMIT` of a transaction came to
/// ([`TxStore::complete_and_commit`]).
pub(crate) enum CommitEnd {
    /// Committed, the response stored; the connection is back in the pool.
    Committed,
    /// The completion matched nothing: the transaction had ended under the layer. The
    /// connection if it is fit for use (the server answered).
    NotOurs(Option<TxConn>),
    /// The transaction was aborted by a failed statement, and is rolled back now: the
    /// connection if the `ROLLBACK` answered.
    Aborted(Option<TxConn>),
    /// No answer to the `COMMIT`: it may have committed. The connection is closed.
    InDoubt(String),
    /// Not committed; the connection is given back or closed.
    Failed(String),
}

/// What a `ROLLBACK` that checks whether the transaction was still the claim's found
/// ([`TxStore::roll_back_checking`]).
pub(crate) enum Checked {
    /// Rolled back, or closed, which rolls back: nothing of it committed.
    RolledBack,
    /// The claim row was not the transaction's any more: it had ended under the layer.
    /// Rolled back since; the connection if the `ROLLBACK` answered.
    NotOurs(Option<TxConn>),
    /// The transaction was aborted by a failed statement, which hides whether it was
    /// still the claim's; rolled back since. The connection if the `ROLLBACK` answered.
    Aborted(Option<TxConn>),
}

/// A store transactional mode runs on: what
/// [`IdempotencyLayer::transactional`](crate::IdempotencyLayer::transactional) and
/// [`JobRunner::transactional`](crate::job::JobRunner::transactional) take. Made from a
/// [`PostgresStore`] or the app's `deadpool_postgres::Pool` (tokio-postgres), or, with
/// the `sqlx` feature, a [`SqlxStore`](crate::store::SqlxStore) or the app's
/// `sqlx::PgPool`.
#[derive(Clone, Debug)]
pub struct TransactionalStore(pub(crate) TxStore);

impl From<PostgresStore> for TransactionalStore {
    fn from(store: PostgresStore) -> Self {
        Self(TxStore::Postgres(store))
    }
}

impl From<deadpool_postgres::Pool> for TransactionalStore {
    fn from(pool: deadpool_postgres::Pool) -> Self {
        PostgresStore::from(pool).into()
    }
}

#[cfg(feature = "sqlx")]
impl From<SqlxStore> for TransactionalStore {
    fn from(store: SqlxStore) -> Self {
        Self(TxStore::Sqlx(store))
    }
}

#[cfg(feature = "sqlx")]
impl From<::sqlx::PgPool> for TransactionalStore {
    fn from(pool: ::sqlx::PgPool) -> Self {
        SqlxStore::new(pool).into()
    }
}

impl TxConn {
    /// The work is done: the connection goes back to its pool.
    pub(crate) fn done(self) {
        match self {
            Self::Deadpool(conn) => conn.done(),
            #[cfg(feature = "sqlx")]
            Self::Sqlx(conn) => conn.done(),
        }
    }

    /// The tokio-postgres client of a deadpool connection.
    fn deadpool(&self) -> &ClientWrapper {
        match self {
            Self::Deadpool(conn) => conn,
            #[cfg(feature = "sqlx")]
            Self::Sqlx(_) => unreachable!("a sqlx connection given to the tokio-postgres driver"),
        }
    }

    /// The deadpool connection itself.
    fn into_deadpool(self) -> Checkout {
        match self {
            Self::Deadpool(conn) => conn,
            #[cfg(feature = "sqlx")]
            Self::Sqlx(_) => unreachable!("a sqlx connection given to the tokio-postgres driver"),
        }
    }

    /// The sqlx connection.
    #[cfg(feature = "sqlx")]
    fn sqlx(&mut self) -> &mut SqlxConn {
        match self {
            Self::Sqlx(conn) => conn,
            Self::Deadpool(_) => unreachable!("a deadpool connection given to the sqlx driver"),
        }
    }

    /// `ROLLBACK`, and the connection given back outside any transaction; `None` if
    /// the server does not answer within `bound`, or fails (it is closed then, which
    /// rolls back).
    pub(crate) async fn roll_back_keeping(self, bound: Duration) -> Option<Self> {
        match self {
            Self::Deadpool(conn) => super::tx::roll_back_keeping(conn, bound)
                .await
                .map(Self::Deadpool),
            #[cfg(feature = "sqlx")]
            Self::Sqlx(mut conn) => {
                let rolled_back = timeout(bound, roll_back(&mut conn)).await;
                kept_if_rolled_back(Self::Sqlx(conn), rolled_back)
            }
        }
    }

    /// [`roll_back_keeping`](Self::roll_back_keeping), then the connection back to its
    /// pool.
    pub(crate) async fn roll_back_or_close(self, bound: Duration) {
        if let Some(conn) = self.roll_back_keeping(bound).await {
            conn.done();
        }
    }
}

impl TxStore {
    /// The store's lease-mode face, for the look-ups of earlier forms of a key.
    #[cfg(feature = "sqlx")]
    pub(crate) fn as_store(&self) -> &dyn crate::store::Store {
        match self {
            Self::Postgres(store) => store,
            #[cfg(feature = "sqlx")]
            Self::Sqlx(store) => store,
        }
    }

    /// A permit to claim in a transaction (see `PostgresStore::tx_claim_permit`).
    pub(crate) async fn claim_permit(&self) -> tokio::sync::OwnedSemaphorePermit {
        match self {
            Self::Postgres(store) => store.tx_claim_permit().await,
            #[cfg(feature = "sqlx")]
            Self::Sqlx(store) => store.tx_claim_permit().await,
        }
    }

    /// A connection for a transaction.
    pub(crate) async fn connection(&self) -> Result<TxConn, StoreError> {
        match self {
            Self::Postgres(store) => store.client().await.map(TxConn::Deadpool),
            #[cfg(feature = "sqlx")]
            Self::Sqlx(store) => store.tx_connection().await.map(TxConn::Sqlx),
        }
    }

    /// `BEGIN` and the claim in the transaction it opens, on `conn`, the claim waiting
    /// on another request's row for `claim_wait`, the transaction's `lock_timeout` then
    /// set to `then_lock_timeout`; sent again, in a new transaction, after a lost race
    /// (see `PostgresStore::begin_and_claim`).
    pub(crate) async fn begin_and_claim(
        &self,
        conn: &mut TxConn,
        claim_wait: Duration,
        request: &ClaimRequest<'_>,
        then_lock_timeout: Option<Duration>,
    ) -> Result<(Claim, Backend), StoreError> {
        match self {
            Self::Postgres(store) => {
                let client = conn.deadpool();
                let mut again = false;
                again_if_it_lost_a_race(|| {
                    let retry = std::mem::replace(&mut again, true);
                    async move {
                        if retry {
                            store.send_rollback(client).await?;
                        }
                        let token = FencingToken::fresh();
                        let then = then_lock_timeout;
                        store
                            .begin_and_claim(client, claim_wait, request, token, then)
                            .await
                    }
                })
                .await
            }
            #[cfg(feature = "sqlx")]
            Self::Sqlx(store) => {
                store
                    .begin_and_claim(conn.sqlx(), claim_wait, request, then_lock_timeout)
                    .await
            }
        }
    }

    /// The log of a run's steps, recorded apart from the claim's transaction.
    pub(crate) fn steps(
        &self,
        claim: (&Lease, Backend, Fingerprint),
        sealing: &Sealing,
        store_timeout: Duration,
    ) -> Arc<StepLog> {
        crate::run::steps::in_transaction(self, claim, sealing, store_timeout)
    }

    /// The steps recorded for the request of `fingerprint` under the key of a claim in
    /// a transaction, read apart from it.
    pub(crate) async fn steps_apart(
        &self,
        lease: &Lease,
        fingerprint: &Fingerprint,
    ) -> Result<Vec<RecordedStep>, StoreError> {
        match self {
            Self::Postgres(store) => store.steps_apart(lease, fingerprint).await,
            #[cfg(feature = "sqlx")]
            Self::Sqlx(store) => store.steps_apart(lease, fingerprint).await,
        }
    }

    /// Records `step` apart from the claim's transaction of `backend`, while it runs.
    pub(crate) async fn record_step_apart(
        &self,
        lease: &Lease,
        backend: &Backend,
        fingerprint: &Fingerprint,
        step: &RecordedStep,
    ) -> Result<Fenced, StoreError> {
        match self {
            Self::Postgres(store) => {
                store
                    .record_step_apart(lease, backend, fingerprint, step)
                    .await
            }
            #[cfg(feature = "sqlx")]
            Self::Sqlx(store) => {
                store
                    .record_step_apart(lease, backend, fingerprint, step)
                    .await
            }
        }
    }

    /// Forgets the steps of `lease` in the transaction on `conn`.
    pub(crate) async fn forget_steps(
        &self,
        conn: &mut TxConn,
        lease: &Lease,
    ) -> Result<(), StoreError> {
        match self {
            Self::Postgres(store) => store.forget_steps_on(conn.deadpool(), lease).await,
            #[cfg(feature = "sqlx")]
            Self::Sqlx(store) => store.forget_steps_on(conn.sqlx(), lease).await,
        }
    }

    /// Writes `stored` into the claim row of `lease` and commits, bounded by
    /// `store_timeout`: pipelined, one round trip, on tokio-postgres; one after the
    /// other on sqlx. The completion matches only a row this transaction wrote.
    pub(crate) async fn complete_and_commit(
        &self,
        conn: TxConn,
        lease: &Lease,
        stored: &StoredResponse,
        ttl: Duration,
        store_timeout: Duration,
    ) -> CommitEnd {
        match self {
            Self::Postgres(store) => {
                let conn = conn.into_deadpool();
                postgres_commit(store, conn, lease, stored, ttl, store_timeout).await
            }
            #[cfg(feature = "sqlx")]
            Self::Sqlx(store) => sqlx_commit(store, conn, lease, stored, ttl, store_timeout).await,
        }
    }

    /// How a transaction whose `COMMIT` was in doubt ended, read on another connection
    /// (see `PostgresStore::committed_on`); unbounded, the caller bounds it.
    pub(crate) async fn committed_elsewhere(
        &self,
        lease: &Lease,
        backend: &Backend,
        fingerprint: &Fingerprint,
        sent: &StoredResponse,
        (lock_timeout, store_timeout): (Duration, Duration),
    ) -> Option<Resolution> {
        match self {
            Self::Postgres(store) => {
                let conn = store.client().await.ok()?;
                // Read committed whatever the database's default: the read must see what
                // committed while the insert waited.
                store.begin_read_committed(&conn, lock_timeout).await.ok()?;
                let resolved = store
                    .committed_on(&conn, lease, backend, fingerprint, sent)
                    .await;
                TxConn::Deadpool(conn)
                    .roll_back_or_close(store_timeout)
                    .await;
                resolved.ok()
            }
            #[cfg(feature = "sqlx")]
            Self::Sqlx(store) => store
                .committed_elsewhere(lease, backend, fingerprint, sent, lock_timeout)
                .await
                .ok(),
        }
    }

    /// Rolls back the transaction on `conn`, bounded by `store_timeout`, checking in
    /// the same go whether the claim row of `lease` was still the transaction's.
    pub(crate) async fn roll_back_checking(
        &self,
        conn: TxConn,
        lease: &Lease,
        store_timeout: Duration,
    ) -> Checked {
        let deadline = Instant::now() + store_timeout;
        let left = || deadline.saturating_duration_since(Instant::now());
        match self {
            Self::Postgres(store) => {
                let client = conn.deadpool();
                // Prepared first, so that its Execute is on the wire before the ROLLBACK.
                match timeout_at(deadline, store.prepare_ours(client)).await {
                    Ok(Ok(())) => {}
                    // In a transaction aborted by a statement of the handler's, say.
                    Ok(Err(e)) if in_an_aborted_transaction(&e) => {
                        return Checked::Aborted(conn.roll_back_keeping(left()).await);
                    }
                    Ok(Err(_)) => {
                        conn.roll_back_or_close(left()).await;
                        return Checked::RolledBack;
                    }
                    Err(_) => {
                        tracing::warn!("no answer in time before ROLLBACK; closing the connection");
                        return Checked::RolledBack;
                    }
                }
                let (ours, rolled_back) = tokio::join!(
                    timeout_at(deadline, store.still_ours(client, lease)),
                    timeout_at(deadline, store.send_rollback(client)),
                );
                let conn = kept_if_rolled_back(conn, rolled_back);
                checked(ours, conn)
            }
            #[cfg(feature = "sqlx")]
            Self::Sqlx(store) => {
                let mut conn = conn;
                let ours = timeout_at(deadline, store.still_ours(conn.sqlx(), lease)).await;
                if ours.is_err() {
                    tracing::warn!("no answer in time before ROLLBACK; closing the connection");
                    return Checked::RolledBack;
                }
                let conn = conn.roll_back_keeping(left()).await;
                checked(ours, conn)
            }
        }
    }

    /// Whether the claim of `lease`, made on `backend`, is committed `running` with
    /// nothing else (see `PostgresStore::claim_committed_alone`): on `conn`, or, with
    /// `None`, on a connection that does not wait behind the pool.
    pub(crate) async fn claim_committed_alone(
        &self,
        conn: Option<&mut TxConn>,
        lease: &Lease,
        backend: &Backend,
    ) -> Result<bool, StoreError> {
        match self {
            Self::Postgres(store) => {
                let client = conn.map(|conn| conn.deadpool());
                store.claim_committed_alone(client, lease, backend).await
            }
            #[cfg(feature = "sqlx")]
            Self::Sqlx(store) => {
                let conn = conn.map(|conn| &mut **conn.sqlx());
                store.claim_committed_alone(conn, lease, backend).await
            }
        }
    }

    /// Renews the lease of a claim the handler committed `running` (see
    /// `PostgresStore::renew_committed_claim`).
    pub(crate) async fn renew_committed_claim(
        &self,
        lease: &Lease,
        backend: &Backend,
        duration: Duration,
    ) -> Result<bool, StoreError> {
        match self {
            Self::Postgres(store) => store.renew_committed_claim(lease, backend, duration).await,
            #[cfg(feature = "sqlx")]
            Self::Sqlx(store) => store.renew_committed_claim(lease, backend, duration).await,
        }
    }

    /// Completes the key of `lease` with `response` outside its transaction, which
    /// ended under the layer (see `PostgresStore::finish_ended`).
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn finish_ended(
        &self,
        conn: Option<&mut TxConn>,
        lease: &Lease,
        backend: &Backend,
        fingerprint: &Fingerprint,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        match self {
            Self::Postgres(store) => {
                let client = conn.map(|conn| conn.deadpool());
                let finishing =
                    store.finish_ended(client, lease, backend, fingerprint, response, ttl);
                finishing.await
            }
            #[cfg(feature = "sqlx")]
            Self::Sqlx(store) => {
                let conn = conn.map(|conn| &mut **conn.sqlx());
                let finishing =
                    store.finish_ended(conn, lease, backend, fingerprint, response, ttl);
                finishing.await
            }
        }
    }

    /// Ends the transaction `backend` runs, from another session (see
    /// `PostgresStore::end_transaction`).
    pub(crate) async fn end_transaction(&self, backend: &Backend) -> Result<Ending, StoreError> {
        match self {
            Self::Postgres(store) => store.end_transaction(backend).await,
            #[cfg(feature = "sqlx")]
            Self::Sqlx(store) => store.end_transaction(backend).await,
        }
    }
}

/// [`Checked`] from the answer to the check that the claim row was still the
/// transaction's, and the connection after its `ROLLBACK`.
fn checked<E>(ours: Result<Result<bool, StoreError>, E>, conn: Option<TxConn>) -> Checked {
    match ours {
        Ok(Ok(false)) => Checked::NotOurs(conn),
        Ok(Err(e)) if in_an_aborted_transaction(&e) => Checked::Aborted(conn),
        _ => {
            if let Some(conn) = conn {
                conn.done();
            }
            Checked::RolledBack
        }
    }
}

/// [`TxStore::complete_and_commit`] on tokio-postgres: the completion prepared first,
/// so that its Execute is on the wire before the `COMMIT`, then both in one round trip.
async fn postgres_commit(
    store: &PostgresStore,
    conn: Checkout,
    lease: &Lease,
    stored: &StoredResponse,
    ttl: Duration,
    store_timeout: Duration,
) -> CommitEnd {
    let client = &*conn;
    // Given up on, the connection is closed with the transaction open, which rolls it
    // back: no COMMIT was sent.
    match timeout(store_timeout, store.prepare_completion(client)).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) if in_an_aborted_transaction(&e) => {
            return CommitEnd::Aborted(
                TxConn::Deadpool(conn)
                    .roll_back_keeping(store_timeout)
                    .await,
            );
        }
        Ok(Err(e)) => return CommitEnd::Failed(e.to_string()),
        Err(_) => {
            return CommitEnd::Failed(
                "no answer in time to preparing the completion; its connection is closed".into(),
            );
        }
    }
    let deadline = Instant::now() + store_timeout;
    let (completed, committed) = tokio::join!(
        timeout_at(
            deadline,
            store.complete_in_transaction(client, lease, stored, ttl)
        ),
        timeout_at(deadline, commit_on(client)),
    );
    // The server answered the COMMIT, or refused it (a serialization failure, say): the
    // transaction is over and the connection fit for the pool.
    let answered = match &committed {
        Ok(Ok(())) => true,
        Ok(Err(e)) => e.as_db_error().is_some(),
        Err(_) => false,
    };
    let lost = match &committed {
        Ok(Err(e)) => connection_lost(e),
        Ok(Ok(())) => false,
        Err(_) => true,
    };
    let conn = TxConn::Deadpool(conn);
    match completed {
        Ok(Ok(Fenced::Kept)) if matches!(committed, Ok(Ok(()))) => {
            conn.done();
            return CommitEnd::Committed;
        }
        // Nothing matched: the claim row is not this transaction's any more, so the
        // completion ran outside it. Whatever the COMMIT then did, it was not ours.
        Ok(Ok(Fenced::LeaseLost)) => return CommitEnd::NotOurs(answered.then_some(conn)),
        // The COMMIT of an aborted transaction rolls it back, and succeeds at that.
        Ok(Err(ref e)) if in_an_aborted_transaction(e) && matches!(committed, Ok(Ok(()))) => {
            return CommitEnd::Aborted(Some(conn));
        }
        _ => {}
    }
    let completed = match completed {
        Ok(completed) => completed.map(drop).map_err(|e| e.to_string()),
        Err(_) => Err("no answer in time".to_owned()),
    };
    let committed = match committed {
        Ok(committed) => committed.map_err(|e| describe(&e)),
        Err(_) => Err("no answer in time".to_owned()),
    };
    let what = format!("completion: {completed:?}; COMMIT: {committed:?}");
    if lost {
        // Dropped, the connection is closed.
        return CommitEnd::InDoubt(what);
    }
    if answered {
        conn.done();
    }
    CommitEnd::Failed(what)
}

/// [`TxStore::complete_and_commit`] on sqlx: the completion, then the `COMMIT`, within
/// one `store_timeout`.
#[cfg(feature = "sqlx")]
async fn sqlx_commit(
    store: &SqlxStore,
    mut conn: TxConn,
    lease: &Lease,
    stored: &StoredResponse,
    ttl: Duration,
    store_timeout: Duration,
) -> CommitEnd {
    let deadline = Instant::now() + store_timeout;
    let completing = store.complete_in_transaction(conn.sqlx(), lease, stored, ttl);
    let completed = match timeout_at(deadline, completing).await {
        Ok(Ok(completed)) => completed,
        // A failed statement of the handler's aborted the transaction.
        Ok(Err(e)) if in_an_aborted_transaction(&e) => {
            let left = deadline.saturating_duration_since(Instant::now());
            return CommitEnd::Aborted(conn.roll_back_keeping(left).await);
        }
        // No COMMIT was sent: closed, the connection rolls the transaction back.
        Ok(Err(e)) if lost_its_connection(&e) => return CommitEnd::Failed(e.to_string()),
        Ok(Err(e)) => {
            let left = deadline.saturating_duration_since(Instant::now());
            conn.roll_back_or_close(left).await;
            return CommitEnd::Failed(e.to_string());
        }
        Err(_) => {
            return CommitEnd::Failed(
                "no answer in time to the completion; its connection is closed".into(),
            );
        }
    };
    // Sent whatever the completion matched, as the pipelined COMMIT of tokio-postgres is:
    // a completion that matched nothing ran outside the claim's transaction, and this
    // COMMIT is not ours either.
    let committed = timeout_at(deadline, store.send_commit(conn.sqlx())).await;
    let answered = match &committed {
        Ok(Ok(())) => true,
        Ok(Err(e)) => !lost_its_connection(e),
        Err(_) => false,
    };
    match (completed, committed) {
        (Fenced::Kept, Ok(Ok(()))) => {
            conn.done();
            CommitEnd::Committed
        }
        (Fenced::LeaseLost, _) => CommitEnd::NotOurs(answered.then_some(conn)),
        (Fenced::Kept, Ok(Err(e))) if answered => {
            conn.done();
            CommitEnd::Failed(format!("COMMIT: {e}"))
        }
        (Fenced::Kept, Ok(Err(e))) => CommitEnd::InDoubt(format!("COMMIT: {e}")),
        (Fenced::Kept, Err(_)) => CommitEnd::InDoubt("COMMIT: no answer in time".into()),
    }
}
