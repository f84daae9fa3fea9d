//! The PostgreSQL store: one table, single-row statements on its primary key.

mod adapt;
mod batch;
mod batch_complete;
mod checkout;
mod claim;
mod config;
mod driver;
mod errors;
mod generations;
mod holder;
mod hosts;
mod in_doubt;
mod lead;
mod listener;
mod liveness;
mod look_up;
mod migrate;
mod operator;
mod purge;
mod reserve;
mod rotate;
mod row;
mod shared;
mod slots;
mod sql;
/// The sqlx driver, in a directory of its own beside this one: a child of this module,
/// so that it shares the statements and the reading of rows, not copies of them.
#[cfg(feature = "sqlx")]
#[path = "../sqlx/mod.rs"]
pub(crate) mod sqlx_store;
mod steps;
mod tls;
mod tx;
mod url;
mod verify;

use std::{
    fmt,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use deadpool_postgres::Pool;
use sha2::{Digest, Sha256};
use tokio_postgres::types::ToSql;

use checkout::Checkout;
use claim::ms;
pub use config::ConfigError;
pub use driver::TransactionalStore;
use errors::again_if_it_lost_a_race;
pub use generations::GenerationRotation;
use in_doubt::ABANDONED_CLAIM_WAIT;
use listener::Listener;
use liveness::Liveness;
pub use migrate::Migration;
use purge::BackgroundPurge;
use shared::Shared;
use sql::Sql;
use tls::Connector;
pub use url::{pool_for_url, pool_for_url_with_tls};

use super::{
    BoxFuture, Claim, ClaimRequest, Fenced, FencingToken, KeyRecord, Lease, Orphan, RecordedStep,
    Removal, RunningKey, Store, StoreError, StoreErrorKind,
};
use crate::{Scope, StoredResponse};

/// What transactional mode runs on: a claim taken in the transaction the handler
/// writes in, that transaction committed or rolled back, and what a failure of it
/// means. The statements themselves stay here; the engine (`run::transactional`)
/// holds a [`Checkout`] in a transaction and calls these.
/// The id of `key` in `scope` of table `qualified` that a completion's notification
/// carries, whichever driver sent it.
fn key_id(qualified: &str, scope: &Scope, key: &str) -> String {
    let mut h = Sha256::new();
    for part in [qualified, scope.as_str(), key] {
        h.update((part.len() as u64).to_be_bytes());
        h.update(part.as_bytes());
    }
    crate::hex::encode(&h.finalize()[..16])
}

pub(crate) mod transaction {
    #[cfg(feature = "sqlx")]
    pub(crate) use super::sqlx_store::SqlxConn;
    pub(crate) use super::{
        checkout::Checkout,
        driver::{Checked, CommitEnd, TxConn, TxStore},
        errors::statement_cancelled,
        tx::{Backend, Ending, Resolution},
    };
}

/// A [`Store`] in PostgreSQL, shared by every replica of the app.
///
/// Every statement is a single-row statement on the primary key `(scope, key)`, prepared
/// once per connection (`prepare_cached`):
///
/// | step | statements |
/// |---|---|
/// | claim of a new key | 1 (a primary-key read that, finding no row, inserts one with `INSERT … ON CONFLICT DO NOTHING`) |
/// | replay, 409, 422 | 1 (the same statement) |
/// | completion | 1 (`UPDATE … WHERE token = $lease`) |
/// | takeover of a lapsed lease, or of a claim whose holder is gone ([`with_liveness`](Self::with_liveness)) | 2 (the claim, then a token-checked `UPDATE`) |
///
/// The statements of a running claim (its lease renewals, its completion, its release)
/// never queue for a connection behind the handlers' checkouts, which would let its
/// lease lapse under a live handler and a retry run the handler again: they take an
/// idle pooled connection if there is one, without waiting, and otherwise go over a
/// reserve of two connections that the store makes with the pool's manager, outside
/// its `max_size` (up to four while broken ones are replaced), and shares among them,
/// pipelined. Count them against the server's `max_connections`
/// ([`StoreMetrics::reserve_statements`] says how often they serve). The pool's hooks
/// do not run on them: a pool whose `post_create` hook sets its sessions up (`SET
/// ROLE`) gives the store the same setup with
/// [`with_session_setup`](Self::with_session_setup); a reserve connection whose role
/// may not write the table is refused, loudly, rather than used.
///
/// ```no_run
/// use tower_idempotency::{IdempotencyLayer, store::PostgresStore};
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let store = PostgresStore::connect("postgres://postgres@127.0.0.1/postgres")?
///     .with_schema_name("billing")?
///     .with_table_name("idempotency_keys")?;
/// store.migrate().await?;
/// let layer = IdempotencyLayer::new(store);
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct PostgresStore {
    pool: Pool,
    schema: String,
    table: String,
    sql: Arc<Sql>,
    statements: Arc<AtomicU64>,
    listen_config: Option<tokio_postgres::Config>,
    listener: Arc<Listener>,
    /// The TLS of the connections made outside the pool (`with_tls`).
    connector: Connector,
    /// Transactional claims in progress hold a connection each, possibly blocked on
    /// another request's row: at most half the pool may, so that the handlers they wait
    /// for always find connections.
    tx_claims: Arc<tokio::sync::Semaphore>,
    /// Connections shared by claims, if any (`with_shared_claim_connections`).
    shared: Option<Arc<Shared>>,
    /// Claims sent in batches, if on (`with_batched_claims`, on by default).
    batcher: Option<Arc<batch::Batcher>>,
    /// Batching as set with `with_batched_claims`; `None`: the default.
    batching: Option<(usize, usize)>,
    /// The pool and the table: stores over one pool and one table claim the same keys
    /// (`Store::records_location`).
    location: Arc<str>,
    /// Deletes expired rows in the background, once started by a claim.
    purge: Arc<BackgroundPurge>,
    /// Whether the connections go through a transaction pooler
    /// (`with_transaction_pooling`): statements unnamed, no cancel requests.
    transaction_pooling: bool,
    /// Connections outside the pool for the statements of running claims when the
    /// pool has no idle one (`reserve`).
    reserve: Arc<Shared>,
    /// This store as the holder of its lease-mode claims, if it has liveness
    /// (`with_liveness`, on by default with a notification connection).
    liveness: Option<Arc<Liveness>>,
    /// Whether liveness is on (`with_liveness`), kept for a notification connection
    /// given later.
    liveness_on: bool,
}

/// What a [`PostgresStore`] (and its clones) has done so far; see
/// [`PostgresStore::metrics`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct StoreMetrics {
    /// Statements executed (migrations aside).
    pub statements: u64,
    /// Notifications received on the `LISTEN` connection.
    pub notifications: u64,
    /// Waiters woken by a notification (not those woken, with every other, by the
    /// listener connecting or losing its connection).
    pub notified_wakeups: u64,
    /// Waiters woken by the fallback timer (while the listener was not connected).
    pub timer_wakeups: u64,
    /// Claims given a shared connection
    /// ([`with_shared_claim_connections`](PostgresStore::with_shared_claim_connections)),
    /// those that then failed or were cancelled included; not those sent to a pooled
    /// connection because the shared ones were full or could not be opened.
    pub shared_claims: u64,
    /// Of those, claims that met a row lock there and ran again on a pooled connection.
    pub shared_claims_moved: u64,
    /// Renewals, completions and releases of running claims sent over the store's
    /// reserve connections because the pool had no idle connection for them (see
    /// [`PostgresStore`]); those that then failed or were given up on included.
    pub reserve_statements: u64,
    /// Batch statements of claims sent
    /// ([`with_batched_claims`](PostgresStore::with_batched_claims)).
    pub claim_batches: u64,
    /// Claims sent in them (a claim read again after a concurrent insert counts again).
    pub batched_claims: u64,
    /// Running claims taken over because their holder's process was gone, before their
    /// lease lapsed ([`with_liveness`](PostgresStore::with_liveness)).
    pub gone_holder_takeovers: u64,
    /// Renewals of this store's sign of life, sent while it runs claims
    /// ([`with_liveness`](PostgresStore::with_liveness)); not among `statements`.
    pub liveness_heartbeats: u64,
}

impl fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresStore")
            .field("table", &self.sql.qualified)
            .finish_non_exhaustive()
    }
}

impl PostgresStore {
    /// Counters of what this store has done, for tests and dashboards.
    pub fn metrics(&self) -> StoreMetrics {
        StoreMetrics {
            statements: self.statements.load(Ordering::Relaxed),
            notifications: self.listener.notifications.load(Ordering::Relaxed),
            notified_wakeups: self.listener.notified_wakeups.load(Ordering::Relaxed),
            timer_wakeups: self.listener.timer_wakeups.load(Ordering::Relaxed),
            shared_claims: self.shared.as_ref().map_or(0, |s| s.dealt_count()),
            reserve_statements: self.reserve.dealt_count(),
            shared_claims_moved: self.shared.as_ref().map_or(0, |s| s.moved()),
            claim_batches: self.batcher.as_ref().map_or(0, |b| b.batches()),
            batched_claims: self.batcher.as_ref().map_or(0, |b| b.batched()),
            gone_holder_takeovers: self
                .liveness
                .as_ref()
                .map_or(0, |l| l.activity.takeovers.load(Ordering::Relaxed)),
            liveness_heartbeats: self
                .liveness
                .as_ref()
                .map_or(0, |l| l.activity.heartbeats.load(Ordering::Relaxed)),
        }
    }

    /// Claims and completions queued behind a statement in flight (a batch, or a lone
    /// claim or completion sent by its caller) and not sent yet
    /// ([`with_batched_claims`](Self::with_batched_claims)), for tests that hold a batch
    /// to fill the next one. Not part of the stable API.
    #[doc(hidden)]
    pub fn waiting_for_a_batch(&self) -> usize {
        self.batcher
            .as_ref()
            .map_or(0, |b| b.waiting() + b.completions().waiting())
    }

    /// Starts the `LISTEN` connection and waits (up to 5 s) until it listens, so that
    /// the first waiters are woken by notifications rather than by the fallback timer.
    /// Call it at start-up when waiting for running requests is on; without it, the
    /// listener starts with the first waiter.
    ///
    /// # Errors
    ///
    /// [`Misconfigured`](crate::store::StoreErrorKind::Misconfigured) when the store has no
    /// notification connection to listen on; [`Unavailable`](crate::store::StoreErrorKind::Unavailable)
    /// when it did not come up within 5 s (it keeps trying in the background).
    pub async fn listen(&self) -> Result<(), StoreError> {
        if self.listener.listening(Duration::from_secs(5)).await {
            Ok(())
        } else if self.listen_config.is_none() {
            Err(StoreError::new(
                StoreErrorKind::Misconfigured,
                "no notification connection: build the store with connect() or with_notifications()",
            ))
        } else {
            Err(StoreError::new(
                StoreErrorKind::Unavailable,
                "the LISTEN connection did not come up",
            ))
        }
    }

    /// Whether the `LISTEN` connection is up and hears its own notifications.
    pub fn is_listening(&self) -> bool {
        self.listener.is_connected()
    }

    /// Starts the liveness connection and waits (up to 5 s) until it holds the store's
    /// lock and has registered it ([`with_liveness`](Self::with_liveness)), so that
    /// the keys of this process are taken over within a second of its death from its
    /// first claim on. Call it at start-up; without it, the connection starts with the
    /// first claim, and a claim made before it holds its lock is judged by its lease
    /// alone.
    ///
    /// # Errors
    ///
    /// [`Misconfigured`](crate::store::StoreErrorKind::Misconfigured) when the store has
    /// no liveness (no notification connection, or turned off);
    /// when it did not hold its lock within 5 s (it keeps trying in the background), the
    /// error its connection last failed with, with the database's message: of kind
    /// [`Misconfigured`](crate::store::StoreErrorKind::Misconfigured) for a table not
    /// migrated or a right missing (the role needs `SELECT`, `INSERT`, `UPDATE` and
    /// `DELETE` on `<table>_holders`), [`Unavailable`](crate::store::StoreErrorKind::Unavailable)
    /// for a database that cannot be reached.
    pub async fn start_liveness(&self) -> Result<(), StoreError> {
        let Some(liveness) = &self.liveness else {
            return Err(StoreError::new(
                StoreErrorKind::Misconfigured,
                "no liveness: build the store with connect() or with_notifications(), and leave with_liveness on",
            ));
        };
        holder::started(liveness).await
    }

    /// Whether the liveness connection holds the store's lock and has registered it:
    /// while it does, the keys this process runs are taken over within a second of its
    /// death ([`with_liveness`](Self::with_liveness)).
    pub fn is_live(&self) -> bool {
        self.liveness.as_ref().is_some_and(|l| l.holding.is_held())
    }

    /// The holder id this store's lease-mode claims carry (the `holder` column), if it
    /// has liveness. Not part of the stable API.
    #[doc(hidden)]
    pub fn holder_id(&self) -> Option<i64> {
        self.liveness.as_ref().map(|l| l.holder())
    }

    /// The holder id this store's lease-mode claims carry, starting its liveness
    /// connection if it has not started.
    fn holder(&self) -> Option<i64> {
        self.liveness.as_ref().map(|l| {
            l.start();
            l.holder()
        })
    }

    /// The id a key's notifications carry: unique per table, scope and key, and free of
    /// anything the client sent.
    fn key_id(&self, scope: &Scope, key: &str) -> String {
        key_id(&self.sql.qualified, scope, key)
    }

    /// The pool this store uses.
    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    /// The quoted, schema-qualified table name, for the app's own queries and reports.
    pub fn table(&self) -> &str {
        &self.sql.qualified
    }

    /// The claim and the completion statements exactly as this store sends them, so that
    /// a benchmark can issue them directly (the database floor of `benches/e2e.rs`).
    /// Not part of the stable API.
    #[doc(hidden)]
    pub fn claim_and_completion_sql(&self) -> (&str, &str) {
        (&self.sql.claim, &self.sql.complete)
    }

    /// How many statements this store (and its clones) has executed, migrations aside.
    pub fn statements_executed(&self) -> u64 {
        self.statements.load(Ordering::Relaxed)
    }

    /// Deletes up to `batch` expired records; returns how many. Run it in a loop (or on
    /// a timer) until it returns less than `batch`. Rows locked by a concurrent purge are
    /// skipped, so several purgers never wait on each other; a row is deleted only if
    /// it is still expired then. Runs again after a serialization failure. A `batch`
    /// below 1 is taken as 1 (a loop over it then runs until it returns 0), where it
    /// deleted nothing (0) or failed (a negative batch).
    ///
    /// # Errors
    ///
    /// A [`StoreError`] when no connection could be had or the statement failed; nothing
    /// is deleted then (the batch is one statement).
    pub async fn purge_expired(&self, batch: i64) -> Result<u64, StoreError> {
        let batch = batch.max(1);
        // Under repeatable read or serializable, locking a row changed since the
        // statement's snapshot (a takeover of an expired key) fails: look again.
        self.execute_pooled(&self.sql.purge, &[&batch]).await
    }

    /// A claim of this store's was completed or released, or found lost: one fewer
    /// for its liveness heartbeat to keep alive.
    fn ended(&self, answer: &Result<Fenced, StoreError>) {
        if let (Ok(_), Some(liveness)) = (answer, &self.liveness) {
            liveness.ended();
        }
    }

    /// A permit to hold a connection for a transactional claim (see `tx_claims`).
    pub(crate) async fn tx_claim_permit(&self) -> tokio::sync::OwnedSemaphorePermit {
        match self.tx_claims.clone().acquire_owned().await {
            Ok(permit) => permit,
            // The semaphore is never closed.
            Err(_) => unreachable!("the claim semaphore is never closed"),
        }
    }
}

impl Store for PostgresStore {
    fn claim<'a>(
        &'a self,
        request: &'a ClaimRequest<'a>,
    ) -> BoxFuture<'a, Result<Claim, StoreError>> {
        Box::pin(async move {
            // One token for every attempt: only one of them can insert the row.
            let claimed = self.claim_with(request, FencingToken::fresh()).await;
            if let (Ok(Claim::Acquired(_)), Some(liveness)) = (&claimed, &self.liveness) {
                liveness.acquired(request.lease);
            }
            claimed
        })
    }

    fn complete<'a>(
        &'a self,
        lease: &'a Lease,
        response: &'a StoredResponse,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Fenced, StoreError>> {
        Box::pin(async move {
            let fenced = match &self.batcher {
                Some(batcher) => {
                    self.complete_batched(batcher.completions(), lease, response, ttl)
                        .await
                }
                None => self.complete_alone(lease, response, ttl).await,
            };
            let fenced = self.kept_already(lease, response, fenced).await;
            self.ended(&fenced);
            fenced
        })
    }

    fn release<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, Result<Fenced, StoreError>> {
        let id = self.key_id(&lease.scope, &lease.key);
        Box::pin(async move {
            let client = self.running_client().await?;
            let params: [&(dyn ToSql + Sync); 5] = [
                &lease.scope.as_str(),
                &&*lease.key,
                &lease.token,
                &self.listener.channel(),
                &id,
            ];
            // A query: the notification comes back as a row.
            let releasing =
                again_if_it_lost_a_race(|| self.query_on(&client, &self.sql.release, &params));
            let released = client.answer(releasing).await;
            client.done(&released);
            let released = released.map(|rows| Fenced::kept_if(rows.len() == 1));
            self.ended(&released);
            released
        })
    }

    fn renew<'a>(
        &'a self,
        lease: &'a Lease,
        duration: Duration,
    ) -> BoxFuture<'a, Result<Fenced, StoreError>> {
        Box::pin(async move {
            let params: [&(dyn ToSql + Sync); 4] = [
                &lease.scope.as_str(),
                &&*lease.key,
                &lease.token,
                &ms(duration),
            ];
            let client = self.running_client().await?;
            let renewing =
                again_if_it_lost_a_race(|| self.execute_on(&client, &self.sql.renew, &params));
            let renewed = client.answer(renewing).await;
            client.done(&renewed);
            let renewed = renewed.map(|n| Fenced::kept_if(n == 1));
            if let (Ok(Fenced::Kept), Some(liveness)) = (&renewed, &self.liveness) {
                liveness.renewed(duration);
            }
            renewed
        })
    }

    fn purge<'a>(&'a self, batch: usize) -> BoxFuture<'a, Result<u64, StoreError>> {
        Box::pin(self.purge_expired(i64::try_from(batch).unwrap_or(i64::MAX)))
    }

    fn abandoned_claim_wait(&self, lease: Duration) -> Duration {
        // The path claims take (`claim_with`): shared connections if the store has
        // them (never with batching: `build` turns them off), else a batch or a pooled
        // connection. A claim on a shared connection is not closed with it when
        // dropped (the connection carries others'), and may land later than a release
        // in doubt would look: it is waited for, as before, for a lease. A batched
        // claim dropped unanswered is released by its batch, or, sent alone by its
        // caller, in doubt as without batching (`batch`).
        debug_assert!(self.shared.is_none() || self.batcher.is_none());
        if self.shared.is_some() {
            lease
        } else {
            lease.min(ABANDONED_CLAIM_WAIT)
        }
    }

    fn register_waiter<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a str,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(async move {
            // Without a notification connection nothing can hear the completion's
            // NOTIFY: the waiter looks again on the store's timer, and registering would
            // only write the row every turn and make the completion notify nobody.
            if self.listen_config.is_none() {
                return Ok(true);
            }
            let params: [&(dyn ToSql + Sync); 2] = [&scope.as_str(), &key];
            let rows = self.query_pooled(&self.sql.wait, &params).await?;
            let running = rows.first().and_then(|row| row.get::<_, Option<bool>>(0));
            Ok(running == Some(true))
        })
    }

    fn changed(&self, scope: &Scope, key: &str) -> BoxFuture<'static, ()> {
        self.listener.changed(self.key_id(scope, key))
    }

    fn running_recheck(&self) -> Option<Duration> {
        // A holder gone is found so a grace after its last sign of life.
        self.liveness.as_ref().map(|_| liveness::GRACE)
    }

    fn look_up<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a str,
    ) -> BoxFuture<'a, Result<Option<KeyRecord>, StoreError>> {
        Box::pin(self.look_up_pooled(scope, key))
    }

    fn running_keys(
        &self,
        older_than: Duration,
        limit: usize,
    ) -> BoxFuture<'_, Result<Vec<RunningKey>, StoreError>> {
        Box::pin(self.running_keys_pooled(older_than, limit))
    }

    fn release_running<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a str,
        holder: Option<FencingToken>,
    ) -> BoxFuture<'a, Result<Removal, StoreError>> {
        Box::pin(self.release_running_pooled(scope, key, holder))
    }

    fn delete_completed<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a str,
    ) -> BoxFuture<'a, Result<Removal, StoreError>> {
        Box::pin(self.delete_completed_pooled(scope, key))
    }

    fn records_location(&self) -> Option<Arc<str>> {
        Some(self.location.clone())
    }

    fn steps<'a>(
        &'a self,
        lease: &'a Lease,
    ) -> BoxFuture<'a, Result<Option<Vec<RecordedStep>>, StoreError>> {
        Box::pin(self.steps_of(lease))
    }

    fn record_step<'a>(
        &'a self,
        lease: &'a Lease,
        step: &'a RecordedStep,
    ) -> BoxFuture<'a, Result<Fenced, StoreError>> {
        Box::pin(self.record_step_held(lease, step))
    }

    fn record_request<'a>(
        &'a self,
        lease: &'a Lease,
        name: &'a str,
        request: &'a bytes::Bytes,
    ) -> BoxFuture<'a, Result<Fenced, StoreError>> {
        Box::pin(self.record_request_held(lease, name, request))
    }

    fn orphans<'a>(
        &'a self,
        name: &'a str,
        limit: usize,
    ) -> BoxFuture<'a, Result<Vec<Orphan>, StoreError>> {
        Box::pin(self.orphans_of(name, limit))
    }

    fn migrate(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(PostgresStore::migrate(self))
    }
}

/// A store over the pool, with the default table: [`PostgresStore::new`]. What lets
/// [`IdempotencyLayer::transactional`](crate::IdempotencyLayer::transactional) and
/// [`JobRunner::transactional`](crate::job::JobRunner::transactional) take a bare pool.
impl From<Pool> for PostgresStore {
    fn from(pool: Pool) -> Self {
        Self::new(pool)
    }
}
