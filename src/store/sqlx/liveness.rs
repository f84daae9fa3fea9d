//! Liveness on sqlx (`SqlxStore::with_liveness`): the keys of a holder whose process
//! is gone taken over in a second, not after their lease; never a live holder's.
//!
//! The rules are the PostgreSQL store's (`store/postgres/liveness.rs` says why a live
//! holder is never taken over): the same holder id, registration, session settings,
//! grace and heartbeat schedule (`store/postgres/holder.rs`), the same statements, and
//! migration 0004's function judging a holder gone in the claim and again in the
//! takeover. This driver owns its two connections:
//!
//! - the lock's: a [`PgListener`] on a pool of one connection of its own, made with
//!   the notification pool's options (a direct connection, never a transaction
//!   pooler's), set never to time out, holding `pg_advisory_lock(holder)`, then
//!   registering the holder; it waits on the socket for the session to end, and then
//!   connects, locks and registers again;
//! - the heartbeat's: a [`PgConnection`] made with the store pool's options outside
//!   the pool (which the handlers may hold entirely), kept between bursts of claims.
//!
//! The pools' `after_connect` hooks do not run on these connections: sqlx keeps them
//! in the pool, not in its connect options.

use std::{
    sync::{Arc, Mutex, PoisonError, Weak, atomic::Ordering},
    time::Duration,
};

use ::sqlx::{
    Connection as _, Executor as _, PgConnection, PgPool,
    postgres::{PgConnectOptions, PgListener, PgPoolOptions},
};

use super::super::{
    holder::{
        self, Activity, Beat, CONNECT_TIMEOUT, Hold, Holding, SETTINGS, backoff_after,
        heartbeat_statement, new_holder_id,
    },
    sql::Sql,
};
use super::classify;
use crate::store::{BoxFuture, ClaimRequest, Fenced, StoreError, StoreErrorKind};

/// One store's liveness: its holder id, its lock's connection, and its heartbeat.
pub(super) struct Liveness {
    holder: i64,
    /// One connection, made with the notification pool's options, for the lock.
    lock_pool: PgPool,
    /// The store pool's options, for the heartbeat's connection.
    beat_options: PgConnectOptions,
    register: String,
    forget: String,
    /// The heartbeat, a simple query (the id is the store's own number).
    heartbeat: String,
    beat_on: Mutex<Option<PgConnection>>,
    /// The task that holds the lock: whether it runs, whether the lock is held.
    holding: Holding,
    pub(super) activity: Activity,
}

impl Liveness {
    pub(super) fn new(listen_pool: &PgPool, pool: &PgPool, sql: &Sql) -> Self {
        let holder = new_holder_id();
        let lock_options = (*listen_pool.connect_options()).clone();
        Self {
            holder,
            lock_pool: PgPoolOptions::new()
                .max_connections(1)
                .min_connections(0)
                .acquire_timeout(CONNECT_TIMEOUT)
                .idle_timeout(None)
                .max_lifetime(None)
                .connect_lazy_with(lock_options),
            beat_options: (*pool.connect_options()).clone(),
            register: sql.register_holder.to_string(),
            forget: sql.forget_holders.to_string(),
            heartbeat: heartbeat_statement(&sql.holders, holder),
            beat_on: Mutex::new(None),
            holding: Holding::default(),
            activity: Activity::default(),
        }
    }

    /// The holder id the store's lease-mode claims carry.
    pub(super) fn holder(&self) -> i64 {
        self.holder
    }

    /// Starts the task that holds the lock, if it is not running.
    pub(super) fn start(self: &Arc<Self>) {
        holder::start(self);
    }

    /// A claim of `lease` was acquired: the heartbeat runs while it does.
    pub(super) fn acquired(self: &Arc<Self>, lease: Duration) {
        holder::acquired(self, lease);
    }

    /// A claim was renewed for `lease`.
    pub(super) fn renewed(self: &Arc<Self>, lease: Duration) {
        holder::renewed(self, lease);
    }

    /// A claim was completed or released (or found lost).
    pub(super) fn ended(&self) {
        self.activity.ended();
    }

    /// Renews `seen_at` once, on the heartbeat's connection (made first if need be,
    /// and dropped if the renewal fails, to be made again next time).
    async fn renew_seen_at(&self) -> Result<(), StoreError> {
        let kept = self
            .beat_on
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        let mut conn = match kept {
            Some(conn) => conn,
            None => tokio::time::timeout(
                CONNECT_TIMEOUT,
                PgConnection::connect_with(&self.beat_options),
            )
            .await
            .map_err(|_| {
                StoreError::new(
                    StoreErrorKind::Timeout,
                    "no heartbeat connection within 5 s",
                )
            })?
            .map_err(classify)?,
        };
        conn.execute(::sqlx::raw_sql(&self.heartbeat))
            .await
            .map_err(classify)?;
        *self.beat_on.lock().unwrap_or_else(PoisonError::into_inner) = Some(conn);
        Ok(())
    }
}

impl Beat for Liveness {
    fn activity(&self) -> &Activity {
        &self.activity
    }

    fn renew_seen_at(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(Liveness::renew_seen_at(self))
    }
}

impl Hold for Liveness {
    fn holding(&self) -> &Holding {
        &self.holding
    }

    fn hold(me: Weak<Self>) -> BoxFuture<'static, ()> {
        Box::pin(hold(me))
    }
}

/// The lock's session, set up: never timed out, the lock held (waiting for it while
/// an earlier session of this holder still has it on the server), the holder
/// registered.
async fn lock_and_register(
    pool: &PgPool,
    holder: i64,
    register: &str,
    forget: &str,
) -> Result<PgListener, ::sqlx::Error> {
    let mut session = PgListener::connect_with(pool).await?;
    // It ends when its connection does (`hold`): neither the pool's closing nor a
    // silent reconnection, which would have lost the lock, stands in for that.
    session.ignore_pool_close_event(true);
    session.eager_reconnect(false);
    session.execute(::sqlx::raw_sql(SETTINGS)).await?;
    ::sqlx::query("SELECT pg_advisory_lock($1)")
        .bind(holder)
        .execute(&mut session)
        .await?;
    ::sqlx::query(register)
        .bind(holder)
        .execute(&mut session)
        .await?;
    // Best effort: holders long gone are forgotten by the next registration.
    if let Err(e) = ::sqlx::query(forget)
        .bind(holder)
        .execute(&mut session)
        .await
    {
        tracing::debug!(error = %e, "could not forget holders long gone");
    }
    Ok(session)
}

/// Holds the holder's lock on a connection of its own, for as long as the store
/// lives: connects, takes the lock, registers, and waits for the connection to end;
/// then connects again, at once the first time.
async fn hold(me: Weak<Liveness>) {
    let mut backoff = Duration::ZERO;
    loop {
        if !backoff.is_zero() {
            tokio::time::sleep(backoff).await;
        }
        let Some(liveness) = me.upgrade() else { return };
        let pool = liveness.lock_pool.clone();
        let (holder, register, forget) = (
            liveness.holder,
            liveness.register.clone(),
            liveness.forget.clone(),
        );
        // Not kept across the wait: the store may go meanwhile.
        drop(liveness);
        let mut session = match lock_and_register(&pool, holder, &register, &forget).await {
            Ok(session) => session,
            Err(e) => {
                tracing::warn!(error = %e, "the idempotency liveness connection could not hold its lock");
                if let Some(me) = me.upgrade() {
                    me.holding.failed(classify(e));
                }
                backoff = backoff_after(backoff);
                continue;
            }
        };
        if let Some(me) = me.upgrade() {
            me.holding.held();
        }
        // Nothing is listened for: this returns when the connection ends.
        let ended = loop {
            match session.try_recv().await {
                Ok(Some(_)) => {}
                Ok(None) => break "closed by the server".to_owned(),
                Err(e) => break e.to_string(),
            }
        };
        drop(session);
        let Some(liveness) = me.upgrade() else { return };
        liveness.holding.lost();
        drop(liveness);
        tracing::warn!(error = %ended, "the idempotency liveness connection was lost; reconnecting");
        backoff = Duration::ZERO;
    }
}

impl super::SqlxStore {
    /// Turns liveness on or off (off by default): with it, the store is a holder with
    /// a random id, its claims name it, and it holds an advisory lock of that id on a
    /// connection of its own, made with the notification pool's options, so that a
    /// duplicate takes a running key over within about a second of its holder's
    /// process dying, not after its lease; a live holder's key never so. The same
    /// rules, statements and table (`<table>_holders`, migration 0004) as
    /// [`PostgresStore::with_liveness`](crate::store::PostgresStore::with_liveness),
    /// whose docs say why a live holder is never taken over; both stores may hold keys
    /// of one table at once. It costs the database two connections per store (its
    /// clones share them): the lock's, and its heartbeat's while claims run. The
    /// notification pool must reach the database directly (not a transaction pooler:
    /// [`with_notification_pool`](Self::with_notification_pool)); the pools'
    /// `after_connect` hooks do not run on either connection.
    ///
    /// ```no_run
    /// use sqlx::postgres::PgPoolOptions;
    /// use tower_idempotency::store::SqlxStore;
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let pool = PgPoolOptions::new().connect("postgres://app@db/app").await?;
    /// let store = SqlxStore::new(pool).with_liveness(true);
    /// store.migrate().await?;
    /// store.start_liveness().await?;
    /// # Ok(()) }
    /// ```
    #[must_use]
    pub fn with_liveness(mut self, on: bool) -> Self {
        self.liveness =
            on.then(|| Arc::new(Liveness::new(&self.listener.pool, &self.pool, &self.sql)));
        self
    }

    /// Starts the liveness connection and waits (up to 5 s) until it holds the store's
    /// lock and has registered it, so that the keys of this process are taken over
    /// within a second of its death from its first claim on, as
    /// [`PostgresStore::start_liveness`](crate::store::PostgresStore::start_liveness).
    ///
    /// # Errors
    ///
    /// [`Misconfigured`](StoreErrorKind::Misconfigured) when the store has no liveness
    /// ([`with_liveness`](Self::with_liveness) off); when it did not hold its lock
    /// within 5 s (it keeps trying in the background), the error its connection last
    /// failed with: [`Misconfigured`](StoreErrorKind::Misconfigured) for a table not
    /// migrated or a right missing on `<table>_holders`,
    /// [`Unavailable`](StoreErrorKind::Unavailable) for a database out of reach.
    pub async fn start_liveness(&self) -> Result<(), StoreError> {
        let Some(liveness) = &self.liveness else {
            return Err(StoreError::new(
                StoreErrorKind::Misconfigured,
                "no liveness: turn it on with with_liveness(true)",
            ));
        };
        holder::started(liveness).await
    }

    /// Whether the liveness connection holds the store's lock and has registered it.
    pub fn is_live(&self) -> bool {
        self.liveness.as_ref().is_some_and(|l| l.holding.is_held())
    }

    /// The holder id this store's claims carry (the `holder` column), if it has
    /// liveness. Not part of the stable API.
    #[doc(hidden)]
    pub fn holder_id(&self) -> Option<i64> {
        self.liveness.as_ref().map(|l| l.holder())
    }

    /// Running claims this store took over because their holder's process was gone,
    /// before their lease lapsed.
    pub fn gone_holder_takeovers(&self) -> u64 {
        self.liveness
            .as_ref()
            .map_or(0, |l| l.activity.takeovers.load(Ordering::Relaxed))
    }

    /// The holder id this store's claims carry, starting its liveness connection if it
    /// has not started.
    pub(super) fn holder(&self) -> Option<i64> {
        self.liveness.as_ref().map(|l| {
            l.start();
            l.holder()
        })
    }

    /// `answer`, a completion's or a release's: one claim fewer for the heartbeat to
    /// keep alive once it is known.
    pub(super) fn ended(&self, answer: Fenced) -> Fenced {
        if let Some(liveness) = &self.liveness {
            liveness.ended();
        }
        answer
    }

    pub(super) fn took_over_from_a_gone_holder(&self, req: &ClaimRequest<'_>) {
        if let Some(liveness) = &self.liveness {
            liveness.activity.takeovers.fetch_add(1, Ordering::Relaxed);
        }
        tracing::info!(
            key = req.key,
            "took over a running key whose holder's process is gone (its lease had not lapsed)"
        );
    }
}
