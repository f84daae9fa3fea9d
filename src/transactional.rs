//! Transactional mode: the claim, the handler's own writes and the stored response
//! commit together, or not at all.
//!
//! With [`IdempotencyLayer::transactional`](crate::IdempotencyLayer::transactional), a
//! guarded request opens a transaction, inserts its claim row in it, and hands the
//! transaction to the handler as a [`TransactionHandle`] (request extension and Axum
//! extractor; on sqlx, a [`SqlxTransaction`]). The handler does its writes there; the
//! layer then writes the response into the claim row and commits, pipelined, in one
//! round trip (two on sqlx). The effect is exactly-once for the service's own database
//! writes:
//!
//! - a crash, a dropped connection, a handler error or panic, or a response the storage
//!   policy does not keep rolls everything back, so a retry starts clean;
//! - a concurrent duplicate's claim waits on the uncommitted row (for
//!   [`wait_for_running`](crate::IdempotencyLayer::wait_for_running), or, by default,
//!   a moment), then sees the committed response and replays it, or gets 409 at the
//!   bound; one that gets the row after
//!   [`ShutdownHandle::close`](crate::ShutdownHandle::close) rolls back and answers
//!   `503 shutting-down`;
//! - a statement of the handler that fails aborts the transaction: a client error (4xx)
//!   the handler then answers goes to its client unstored, with nothing committed and
//!   the key free, and so does an answer the storage policy releases (5xx, 408, 429 by
//!   default); any other answer becomes `503 not-committed`. Run a statement that may
//!   fail under a `SAVEPOINT`, and roll back to it, to keep the transaction usable;
//! - a handler that ends the transaction itself (`COMMIT`, `ROLLBACK`, or `BEGIN …
//!   COMMIT` from a helper written for a plain connection) gets `500
//!   transaction-ended`, and so does every retry with its key: what it wrote may have
//!   committed without its response, so the layer completes the key with that answer,
//!   outside the ended transaction, rather than say "no effect" or run it again. The
//!   completion matches only a claim row written by the transaction still open (its
//!   `xmin`), which costs nothing on the way to a commit. A transaction found aborted
//!   by a failed statement may be one the handler began after its `COMMIT`: once it
//!   is rolled back, the claim row committed `running` tells. After a `COMMIT` of the
//!   handler's, that row's lease is renewed until the key is finished, so a handler
//!   that runs on is not taken over; after a `ROLLBACK`, nothing holds the key until
//!   the handler returns, and a retry in that time runs it again (its answer is the
//!   one kept);
//! - every statement the layer sends in the transaction (`BEGIN` with the claim, the
//!   completion with `COMMIT`, `ROLLBACK`, in the background too) is bounded by
//!   [`store_timeout`](crate::IdempotencyLayer::store_timeout): a `COMMIT` with no
//!   answer in time is in doubt, checked on another connection like one whose
//!   connection failed (`503 not-committed`, saying the outcome is unknown, if the check
//!   cannot tell); a `ROLLBACK` with none closes its connection, which rolls back. A
//!   database that stops answering holds neither the request nor
//!   [`ShutdownHandle::drain`](crate::ShutdownHandle::drain);
//! - work that keeps the [`TransactionClient`] past the response (a task the handler
//!   spawned) has `store_timeout` to let go of it; then the layer ends the transaction
//!   on the server from another connection (`pg_terminate_backend` on the session
//!   running it, only while it still runs that transaction, on a connection that does
//!   not wait behind the pool), so that nothing of it commits and its key is free, and
//!   answers `500 handler-failed`; if the work had committed or rolled back the
//!   transaction itself, `500 transaction-ended`, as above.
//!
//! The same holds on sqlx (the `sqlx` feature): a layer over the app's `sqlx::PgPool`
//! (or a [`SqlxStore`](crate::store::SqlxStore)) hands the handler a
//! [`SqlxTransaction`], whose [`connection`](SqlxTransaction::connection) derefs to
//! the `sqlx::PgConnection` running the transaction. sqlx does not pipeline: there the
//! claim takes two round trips and the commit two.
//!
//! Transactional mode needs PostgreSQL 13 or later (`pg_current_xact_id_if_assigned`),
//! and an app role that may signal its own sessions (any role may, unless its
//! connections run as another role).
//!
//! ```no_run
//! use axum::{Router, http::StatusCode, routing::post};
//! use tower_idempotency::{IdempotencyKey, IdempotencyLayer, store::PostgresStore, transactional::TransactionHandle};
//!
//! async fn create_payment(
//!     key: IdempotencyKey,
//!     tx: TransactionHandle,
//! ) -> Result<(StatusCode, String), (StatusCode, String)> {
//!     let failed = |e: tokio_postgres::Error| (StatusCode::CONFLICT, e.to_string());
//!     let client = tx.client().await.map_err(|e| (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
//!     // A failed INSERT aborts the transaction: the 409 goes to the client, unstored,
//!     // and a retry runs again.
//!     client
//!         .execute("INSERT INTO payments (id) VALUES ($1)", &[&key.derive("payment")])
//!         .await
//!         .map_err(failed)?;
//!     Ok((StatusCode::CREATED, "created".into())) // committed with the stored response
//! }
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let store = PostgresStore::connect("postgres://postgres@127.0.0.1/postgres")?;
//! store.migrate().await?;
//! let app: Router = Router::new()
//!     .route("/payments", post(create_payment))
//!     .layer(IdempotencyLayer::transactional(store));
//! # Ok(()) }
//! ```
//!
//! The connection is held from the claim to the commit, so at most the pool's size of
//! transactional handlers run at once. Duplicates waiting on a row hold a connection
//! too, but at most half of the pool's: the others queue in-process until a permit
//! frees, so the handler they wait for always finds a connection.

#[cfg(feature = "axum")]
pub use crate::extract::MissingTransaction;

use std::{ops::Deref, sync::Arc};

use deadpool_postgres::ClientWrapper;
use tokio::sync::{Mutex, OwnedMutexGuard};

use crate::store::transaction::{Checkout, TxConn};

/// The request's open transaction, for the handler's own writes.
///
/// Cloning is cheap; every clone is the same transaction. Do not keep it beyond the
/// handler: once the layer commits or rolls back, [`client`](Self::client) fails. Work
/// that still holds the [`TransactionClient`] when the response is ready (a task the
/// handler spawned, say) has until the layer's `store_timeout` to let go of it; past
/// that, the layer ends the transaction on the server (it terminates the session
/// running it, from another connection), so nothing of it commits and its key is
/// free, and the request answers `500 handler-failed` (or `500 transaction-ended` if
/// the work had ended the transaction itself by then); the client's connection is
/// closed once the work drops it.
#[derive(Clone)]
pub struct TransactionHandle {
    slot: Arc<Mutex<Option<Checkout>>>,
}

/// The transaction's connection, locked for one handler at a time; derefs to the pooled
/// client (`prepare_cached`, `execute`, `query`, …).
///
/// Repository code written against a `GenericClient` takes it through
/// [`as_deadpool`](Self::as_deadpool) (`deadpool_postgres::GenericClient`, with
/// `prepare_cached`) or [`as_tokio_postgres`](Self::as_tokio_postgres)
/// (`tokio_postgres::GenericClient`): both traits are sealed, so the client cannot
/// implement them itself, and these hand out the connection as the types that do. Its
/// statements run in the request's transaction all the same.
///
/// ```no_run
/// use tower_idempotency::{deadpool_postgres::GenericClient, transactional::TransactionHandle};
///
/// /// The app's repository, written for any client or transaction.
/// async fn charge(
///     db: &impl GenericClient,
///     payment: &str,
///     amount: i64,
/// ) -> Result<u64, tower_idempotency::tokio_postgres::Error> {
///     let insert = db.prepare_cached("INSERT INTO charges (payment, amount) VALUES ($1, $2)").await?;
///     db.execute(&insert, &[&payment, &amount]).await
/// }
///
/// async fn handler(tx: TransactionHandle) -> Result<(), Box<dyn std::error::Error>> {
///     let client = tx.client().await?;
///     charge(client.as_deadpool(), "p-1", 1250).await?; // commits with the response
///     Ok(())
/// }
/// ```
///
/// Do not run `COMMIT`, `ROLLBACK` or `BEGIN` on it (nor a helper written for a plain
/// connection that does): the layer ends the transaction. If the handler ends it
/// anyway, the layer finds out when it completes or rolls back, and answers `500
/// transaction-ended` (so does every retry with the key: it is completed with that
/// answer, and the handler does not run again under it), since what the handler wrote
/// may then have committed without its response. After a `ROLLBACK`, though, nothing
/// holds the key until the handler returns: a retry in that time runs it again.
/// `ROLLBACK TO SAVEPOINT` is fine.
pub struct TransactionClient {
    guard: OwnedMutexGuard<Option<Checkout>>,
}

/// [`TransactionHandle::client`] after the transaction ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TransactionClosed;

impl std::fmt::Display for TransactionClosed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the request's transaction has already ended")
    }
}

impl std::error::Error for TransactionClosed {}

impl TransactionClosed {
    /// What it answers: `500 handler-failed`.
    pub fn rejection(&self) -> crate::rejection::Rejection {
        crate::rejection::Rejection::new(
            crate::rejection::Problem::HandlerFailed,
            "the request's idempotency transaction had already ended when its handler asked for its connection",
        )
    }

    /// The status it answers: `500`.
    pub fn status(&self) -> http::StatusCode {
        self.rejection().status()
    }

    /// The body it answers: the problem document.
    pub fn body_text(&self) -> String {
        let res = self
            .rejection()
            .to_response(crate::rejection::DEFAULT_TYPE_BASE);
        String::from_utf8_lossy(res.body()).into_owned()
    }
}

/// Where the engine takes a request's transaction back from once its handler is
/// done: the one its handle hands out, typed for its driver.
#[derive(Clone)]
pub(crate) enum Slot {
    Deadpool(Arc<Mutex<Option<Checkout>>>),
    #[cfg(feature = "sqlx")]
    Sqlx(Arc<Mutex<Option<crate::store::transaction::SqlxConn>>>),
}

impl Slot {
    /// A slot holding the open transaction on `conn`.
    pub(crate) fn holding(conn: TxConn) -> Self {
        match conn {
            TxConn::Deadpool(conn) => Self::Deadpool(Arc::new(Mutex::new(Some(conn)))),
            #[cfg(feature = "sqlx")]
            TxConn::Sqlx(conn) => Self::Sqlx(Arc::new(Mutex::new(Some(conn)))),
        }
    }

    /// Gives the handler the transaction: its handle, of its driver's type, in
    /// `extensions`.
    pub(crate) fn hand_to(&self, extensions: &mut http::Extensions) {
        match self {
            Self::Deadpool(slot) => {
                extensions.insert(TransactionHandle { slot: slot.clone() });
            }
            #[cfg(feature = "sqlx")]
            Self::Sqlx(slot) => {
                extensions.insert(SqlxTransaction { slot: slot.clone() });
            }
        }
    }

    /// The handle of a deadpool transaction, for a job's work.
    pub(crate) fn deadpool_handle(&self) -> Option<TransactionHandle> {
        match self {
            Self::Deadpool(slot) => Some(TransactionHandle { slot: slot.clone() }),
            #[cfg(feature = "sqlx")]
            Self::Sqlx(_) => None,
        }
    }

    /// The handle of a sqlx transaction, for a job's work.
    #[cfg(feature = "sqlx")]
    pub(crate) fn sqlx_handle(&self) -> Option<SqlxTransaction> {
        match self {
            Self::Sqlx(slot) => Some(SqlxTransaction { slot: slot.clone() }),
            Self::Deadpool(_) => None,
        }
    }

    /// The transaction taken back, once the handler's connection is let go within
    /// `bound` (`Some(None)`: taken back and dropped before, which rolled back). `None`
    /// if the work still holds it: the slot is then emptied as soon as it lets go (a
    /// task queued on its lock), so that the handle's later calls find it ended.
    pub(crate) async fn take_within(&self, bound: std::time::Duration) -> Option<Option<TxConn>> {
        match self {
            Self::Deadpool(slot) => taken_within(slot, bound)
                .await
                .map(|taken| taken.map(TxConn::Deadpool)),
            #[cfg(feature = "sqlx")]
            Self::Sqlx(slot) => taken_within(slot, bound)
                .await
                .map(|taken| taken.map(TxConn::Sqlx)),
        }
    }
}

/// [`Slot::take_within`] for one driver's connection.
async fn taken_within<C: Send + 'static>(
    slot: &Arc<Mutex<Option<C>>>,
    bound: std::time::Duration,
) -> Option<Option<C>> {
    if let Ok(mut taken) = tokio::time::timeout(bound, slot.lock()).await {
        return Some(taken.take());
    }
    // Queued on the lock behind the work's connection: the handle's later calls queue
    // behind this and find the transaction ended.
    let queued = slot.clone();
    tokio::spawn(async move { drop(queued.lock().await.take()) });
    None
}

impl TransactionHandle {
    /// The transaction's connection.
    ///
    /// # Errors
    ///
    /// [`TransactionClosed`] once the request's response has been produced (the layer has
    /// taken the transaction back to commit or roll it back), or when the transaction was
    /// given up on: nothing more can be written in it.
    pub async fn client(&self) -> Result<TransactionClient, TransactionClosed> {
        let guard = self.slot.clone().lock_owned().await;
        if guard.is_none() {
            return Err(TransactionClosed);
        }
        Ok(TransactionClient { guard })
    }
}

impl TransactionClient {
    /// The connection as `deadpool_postgres` hands it out of its pool, for code written
    /// against [`deadpool_postgres::GenericClient`]: what a helper that takes
    /// `&impl GenericClient` is passed. It is the request's connection, inside its
    /// transaction.
    pub fn as_deadpool(&self) -> &deadpool_postgres::Client {
        match self.guard.as_ref() {
            Some(tx) => tx,
            // `client()` checked, and the slot only empties under this lock.
            None => unreachable!("TransactionClient over an ended transaction"),
        }
    }

    /// The connection as a [`tokio_postgres::Client`], for code written against
    /// [`tokio_postgres::GenericClient`]. It is the request's connection, inside its
    /// transaction.
    pub fn as_tokio_postgres(&self) -> &tokio_postgres::Client {
        self.as_deadpool()
    }
}

impl Deref for TransactionClient {
    type Target = ClientWrapper;

    fn deref(&self) -> &ClientWrapper {
        self.as_deadpool()
    }
}

impl std::fmt::Debug for TransactionHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransactionHandle").finish_non_exhaustive()
    }
}

/// The request's open transaction on sqlx, for the handler's own writes: what a
/// layer in transactional mode over the app's `sqlx::PgPool` (or a
/// [`SqlxStore`](crate::store::SqlxStore)) hands the handler, as a request extension
/// and an Axum extractor, and a job's work in
/// [`JobContext::sqlx_transaction`](crate::job::JobContext::sqlx_transaction).
///
/// [`connection`](Self::connection) locks the transaction's connection, a
/// [`sqlx::PgConnection`] inside the transaction: pass `&mut *conn` to
/// `sqlx::query(..).execute(..)` and to the app's own functions taking
/// `&mut PgConnection` or an `Executor`. Everything [`TransactionHandle`] says holds
/// here: cloning is cheap, every clone is the same transaction, and work that keeps
/// the connection past the response has `store_timeout` to let go of it.
///
/// ```no_run
/// use axum::{Router, http::StatusCode, routing::post};
/// use sqlx::{PgConnection, PgPool};
/// use tower_idempotency::{IdempotencyKey, IdempotencyLayer, transactional::SqlxTransaction};
///
/// /// The app's repository, written for any connection or transaction.
/// async fn insert_payment(db: &mut PgConnection, id: &str) -> sqlx::Result<()> {
///     sqlx::query("INSERT INTO payments (id) VALUES ($1)").bind(id).execute(db).await?;
///     Ok(())
/// }
///
/// async fn create_payment(
///     key: IdempotencyKey,
///     tx: SqlxTransaction,
/// ) -> Result<(StatusCode, String), (StatusCode, String)> {
///     let mut conn = tx.connection().await.map_err(|e| (e.status(), e.to_string()))?;
///     // A failed INSERT aborts the transaction: the 409 goes to the client, unstored,
///     // and a retry runs again.
///     insert_payment(&mut conn, &key.derive("payment"))
///         .await
///         .map_err(|e| (StatusCode::CONFLICT, e.to_string()))?;
///     Ok((StatusCode::CREATED, "created".into())) // committed with the stored response
/// }
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let pool = PgPool::connect("postgres://postgres@127.0.0.1/postgres").await?;
/// let layer = IdempotencyLayer::transactional(pool.clone()); // the app keeps `pool`
/// layer.migrate().await?;
/// let app: Router = Router::new()
///     .route("/payments", post(create_payment))
///     .layer(layer);
/// # Ok(()) }
/// ```
#[cfg(feature = "sqlx")]
#[derive(Clone)]
pub struct SqlxTransaction {
    slot: Arc<Mutex<Option<crate::store::transaction::SqlxConn>>>,
}

/// The connection of a [`SqlxTransaction`], locked for one user at a time: derefs
/// (mutably) to the [`sqlx::PgConnection`] that runs the request's transaction.
///
/// The transaction is sqlx's own: code that calls `begin()` on the connection (`Acquire`,
/// `Connection::begin`) gets a `SAVEPOINT` inside the request's transaction, and its
/// `commit()` releases it, so helpers that open a transaction of their own write in
/// the request's. Do not send `COMMIT`, `ROLLBACK` or `BEGIN` as statements: the layer
/// ends the transaction, and one the handler ends itself answers `500
/// transaction-ended`, as [`TransactionClient`] says. Call sqlx through the
/// connection's own `Executor` (`conn.execute("…")`, `query.execute(&mut *conn)`):
/// `sqlx::raw_sql(..).execute(..)`'s future is not proven `Send` inside a handler.
#[cfg(feature = "sqlx")]
pub struct SqlxTransactionConnection {
    guard: OwnedMutexGuard<Option<crate::store::transaction::SqlxConn>>,
}

#[cfg(feature = "sqlx")]
impl SqlxTransaction {
    /// The transaction's connection.
    ///
    /// # Errors
    ///
    /// [`TransactionClosed`] once the request's response has been produced (the layer
    /// has taken the transaction back to commit or roll it back), or when the
    /// transaction was given up on: nothing more can be written in it.
    pub async fn connection(&self) -> Result<SqlxTransactionConnection, TransactionClosed> {
        let guard = self.slot.clone().lock_owned().await;
        if guard.is_none() {
            return Err(TransactionClosed);
        }
        Ok(SqlxTransactionConnection { guard })
    }
}

#[cfg(feature = "sqlx")]
impl Deref for SqlxTransactionConnection {
    type Target = sqlx::PgConnection;

    fn deref(&self) -> &sqlx::PgConnection {
        match self.guard.as_ref() {
            Some(conn) => conn,
            // `connection()` checked, and the slot only empties under this lock.
            None => unreachable!("SqlxTransactionConnection over an ended transaction"),
        }
    }
}

#[cfg(feature = "sqlx")]
impl std::ops::DerefMut for SqlxTransactionConnection {
    fn deref_mut(&mut self) -> &mut sqlx::PgConnection {
        match self.guard.as_mut() {
            Some(conn) => conn,
            // `connection()` checked, and the slot only empties under this lock.
            None => unreachable!("SqlxTransactionConnection over an ended transaction"),
        }
    }
}

#[cfg(feature = "sqlx")]
impl std::fmt::Debug for SqlxTransaction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqlxTransaction").finish_non_exhaustive()
    }
}
