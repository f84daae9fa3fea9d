//! The sqlx driver: lease mode and transactional mode (`tx`) over the app's own
//! [`sqlx::PgPool`]. The table, its
//! migrations, the statements, the claim's decision, the reading of rows and the
//! classification of errors by SQLSTATE are the PostgreSQL store's (`store/postgres`);
//! this driver owns its connections (the app's pool), the binding of parameters and the
//! conversion of sqlx's rows and errors.

use std::{
    borrow::Cow,
    fmt,
    sync::{Arc, Mutex, PoisonError, Weak},
    time::{Duration, SystemTime},
};

mod kept;
mod tx;

use tx::Via as _;
pub(crate) use tx::{SqlxConn, roll_back};

use ::sqlx::{
    Connection as _, Executor as _, PgPool, Postgres, Row as _, ValueRef as _,
    postgres::{PgArguments, PgListener, PgRow, PgValueFormat},
    query::Query,
};
use tokio_postgres::error::SqlState;

mod generations;
mod liveness;
mod orphans;

use super::{
    ConfigError,
    claim::{CLAIM_ATTEMPTS, Found, ms},
    config::validate_identifier,
    errors::{again_if_it_lost_a_race, classified, corrupt, serving_hint},
    in_doubt::{ABANDONED_CLAIM_WAIT, release_in_doubt},
    look_up::record,
    migrate::{MIGRATION_LOCK, scripts},
    operator::{refused, removed, running_key},
    purge::DEFAULT_EVERY,
    row::{Columns, need},
    sql::Sql,
    steps::{place, step},
};
use crate::{
    Scope, StoredResponse,
    store::{
        BoxFuture, Claim, ClaimRequest, Fenced, FencingToken, KeyRecord, Lease, RecordedStep,
        Removal, RunningKey, Store, StoreError, StoreErrorKind, waiters::Waiters,
    },
};

/// What a statement of the store's answered: its rows, or the count of rows it changed.
enum Answer {
    Rows(Vec<PgRow>),
    Changed(u64),
}

impl Answer {
    async fn of(
        query: Query<'_, Postgres, PgArguments>,
        conn: &mut ::sqlx::PgConnection,
        rows: bool,
    ) -> Result<Self, ::sqlx::Error> {
        if rows {
            query.fetch_all_via(conn).await.map(Self::Rows)
        } else {
            let done = query.execute_via(conn).await?;
            Ok(Self::Changed(done.rows_affected()))
        }
    }
}

/// How often a waiter looks again while no notification connection listens.
const FALLBACK_RECHECK: Duration = Duration::from_millis(250);

/// Records purged per statement by the background purge.
const PURGE_BATCH: i64 = 1000;

/// The PostgreSQL store over an app's own [`sqlx::PgPool`], in lease mode: the same
/// table, migrations, statements and guarantees as
/// [`PostgresStore`](crate::store::PostgresStore)'s (claims fenced by token, lapsed
/// leases taken over, leases renewed by the layer, waiters woken by `LISTEN`, expired
/// records purged in the background), for an app that talks to PostgreSQL through sqlx.
/// Both stores may serve the same table at once. With
/// [`with_liveness`](Self::with_liveness), a dead holder's keys are taken over within
/// about a second, and a completer ([`IdempotencyLayer::spawn_completer`](crate::IdempotencyLayer::spawn_completer))
/// finishes the keys of resumable routes whose holder died.
///
/// With [`with_generations`](Self::with_generations), the table is kept in
/// generations, rotated in place of the purge, as the PostgreSQL store's.
///
/// Not on sqlx: batched or shared claims, which rest on tokio-postgres's pipelining
/// (docs/postgres.md, "The sqlx driver", says why). TLS is the pool's own (one of
/// sqlx's TLS features, e.g. `tls-rustls-ring-webpki`, and `sslmode` in its options);
/// the connections the store makes itself (`LISTEN`'s, liveness's, transactional
/// mode's apart from the pool) take the pools' options, TLS included.
///
/// A pool handed to [`IdempotencyLayer::new`](crate::IdempotencyLayer::new) or
/// [`JobRunner::new`](crate::job::JobRunner::new) becomes a `SqlxStore` with its
/// defaults (schema `public`, table `idempotency_keys`).
///
/// sqlx's pool tests each connection given back to it with a round trip, and by default
/// each one it hands out as well: build the pool with `test_before_acquire(false)` to
/// leave the second out, and let the store keep connections of its own
/// ([`with_kept_connections`](Self::with_kept_connections)) to leave the first out of
/// its statements (docs/postgres.md, "CPU per request on sqlx").
///
/// Behind a transaction-pooling PgBouncer, turn the store's prepared statements off
/// ([`with_transaction_pooling`](Self::with_transaction_pooling)) and the app's own
/// (`PgConnectOptions::statement_cache_capacity(0)`); waiters then need a pool whose
/// connections go straight to the database for `LISTEN`
/// ([`with_notification_pool`](Self::with_notification_pool)).
///
/// ```no_run
/// use sqlx::postgres::PgPoolOptions;
/// use tower_idempotency::{IdempotencyLayer, store::SqlxStore};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let pool = PgPoolOptions::new()
///     .test_before_acquire(false)
///     .connect("postgres://app@db/app")
///     .await?;
/// let store = SqlxStore::new(pool);
/// store.migrate().await?;
/// let layer = IdempotencyLayer::new(store);
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct SqlxStore {
    pool: PgPool,
    schema: String,
    table: String,
    remember: Duration,
    persistent: bool,
    purge_every: Option<Duration>,
    sql: Arc<Sql>,
    listener: Arc<Listener>,
    purge: Arc<Purge>,
    /// This store as the holder of its claims, if it has liveness (`with_liveness`).
    liveness: Option<Arc<liveness::Liveness>>,
    /// Transactional mode: the claims that may wait on another request's row at once
    /// (half of the pool's connections; see `tx_claim_permit`).
    tx_claims: Arc<tokio::sync::Semaphore>,
    /// The period of the table's generations, if it has them (`with_generations`).
    generations: Option<Duration>,
    rotator: Option<Arc<super::generations::Rotator>>,
    /// The connections the store keeps out of the pool (`with_kept_connections`).
    kept: Option<Arc<kept::Kept>>,
}

impl fmt::Debug for SqlxStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqlxStore")
            .field("table", &self.sql.qualified)
            .finish_non_exhaustive()
    }
}

impl From<PgPool> for SqlxStore {
    fn from(pool: PgPool) -> Self {
        Self::new(pool)
    }
}

impl SqlxStore {
    /// A store over `pool`, on table `public.idempotency_keys`, purging expired records
    /// every minute, listening for completions on a connection of `pool`.
    pub fn new(pool: PgPool) -> Self {
        Self::build(
            pool.clone(),
            "public".into(),
            "idempotency_keys".into(),
            crate::store::DEFAULT_REMEMBER,
            true,
            Some(DEFAULT_EVERY),
            None,
            pool,
            0,
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn build(
        pool: PgPool,
        schema: String,
        table: String,
        remember: Duration,
        persistent: bool,
        purge_every: Option<Duration>,
        generations: Option<Duration>,
        listen_pool: PgPool,
        kept: usize,
    ) -> Self {
        let sql = Arc::new(Sql::new(&schema, &table, generations.is_some(), remember));
        let waiting = (pool.options().get_max_connections() / 2).max(1) as usize;
        Self {
            tx_claims: Arc::new(tokio::sync::Semaphore::new(waiting)),
            rotator: generations::rotator(generations, &sql),
            generations,
            listener: Arc::new(Listener::new(listen_pool, format!("{table}_done"))),
            purge: Arc::new(Purge::default()),
            liveness: None,
            kept: (kept > 0).then(|| kept::Kept::new(pool.clone(), kept)),
            pool,
            schema,
            table,
            remember,
            persistent,
            purge_every,
            sql,
        }
    }

    fn rebuilt(self, change: impl FnOnce(&mut Self)) -> Self {
        let listen_pool = self.listener.pool.clone();
        let live = self.liveness.is_some();
        let mut s = self;
        change(&mut s);
        let kept = s.kept_most();
        Self::build(
            s.pool,
            s.schema,
            s.table,
            s.remember,
            s.persistent,
            s.purge_every,
            s.generations,
            listen_pool,
            kept,
        )
        .with_liveness(live)
    }

    /// Uses the schema `name` (created by [`migrate`](Self::migrate) if absent).
    ///
    /// # Errors
    ///
    /// A [`ConfigError`] unless `name` is 1 to 50 characters of `a-z`, `0-9` and `_`, not
    /// starting with a digit.
    pub fn with_schema_name(self, name: &str) -> Result<Self, ConfigError> {
        validate_identifier("schema", name)?;
        Ok(self.rebuilt(|s| s.schema = name.to_owned()))
    }

    /// Uses the table `name`.
    ///
    /// # Errors
    ///
    /// A [`ConfigError`] unless `name` is 1 to 50 characters of `a-z`, `0-9` and `_`, not
    /// starting with a digit.
    pub fn with_table_name(self, name: &str) -> Result<Self, ConfigError> {
        validate_identifier("table", name)?;
        Ok(self.rebuilt(|s| s.table = name.to_owned()))
    }

    /// Sends every statement unnamed (sqlx's `persistent(false)`), for a pool behind a
    /// transaction-pooling PgBouncer, where a statement prepared in one transaction is
    /// gone in the next. The app's own queries need the same of its pool:
    /// `PgConnectOptions::statement_cache_capacity(0)`.
    #[must_use]
    pub fn with_transaction_pooling(self, pooling: bool) -> Self {
        self.rebuilt(|s| s.persistent = !pooling)
    }

    /// Listens for completions on a connection of `pool` rather than of the store's
    /// own: a pool straight to the database when the store's goes through a
    /// transaction pooler, where `LISTEN` does not hold.
    #[must_use]
    pub fn with_notification_pool(self, pool: PgPool) -> Self {
        let live = self.liveness.is_some();
        let kept = self.kept_most();
        Self::build(
            self.pool,
            self.schema,
            self.table,
            self.remember,
            self.persistent,
            self.purge_every,
            self.generations,
            pool,
            kept,
        )
        .with_liveness(live)
    }

    /// Purges expired records every `every` in a task of the store's own, started at
    /// its first claim (`None`: never; purge with [`Store::purge`] instead).
    #[must_use]
    pub fn with_background_purge(self, every: Option<Duration>) -> Self {
        self.rebuilt(|s| s.purge_every = every)
    }

    /// How long a completed key is remembered once its response expired, as
    /// [`PostgresStore::remember_keys_for`](crate::store::PostgresStore::remember_keys_for).
    #[must_use]
    pub fn remember_keys_for(self, window: Duration) -> Self {
        self.rebuilt(|s| s.remember = window.min(crate::settings::TEN_YEARS))
    }

    /// Keeps up to `n` connections out of the pool for the store's own statements
    /// (claims, completions, replays, renewals; in transactional mode, the request's
    /// transaction), so that none of them pays the round trip sqlx's pool makes to test
    /// every connection given back to it. `0` turns them off.
    ///
    /// They are made by the pool, with its `after_connect` hook, and then detached from
    /// it: the store may have up to `n` connections open beyond the pool's
    /// `max_connections` (count them against the server's), and the pool's
    /// `before_acquire` and `after_release` hooks do not run on them. They are opened as
    /// statements find none idle. With all `n` lent out, a statement takes an idle
    /// connection of the pool if there is one, else waits for a kept one: in
    /// transactional mode, where a request holds its connection while its handler
    /// runs, `n` bounds the requests running at once beyond the pool's idle
    /// connections. One is closed rather than kept when its statement ends
    /// without the server's answer (a lost connection, a timeout, a request dropped),
    /// when it is left in a transaction, once it is older than the pool's
    /// `max_lifetime`, and once the pool is closed (docs/postgres.md, "CPU per request
    /// on sqlx").
    ///
    /// ```no_run
    /// use sqlx::postgres::PgPoolOptions;
    /// use tower_idempotency::{IdempotencyLayer, store::SqlxStore};
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let pool = PgPoolOptions::new()
    ///     .max_connections(16)
    ///     .connect("postgres://app@db/app")
    ///     .await?;
    /// let layer = IdempotencyLayer::new(SqlxStore::new(pool).with_kept_connections(8));
    /// # Ok(()) }
    /// ```
    #[must_use]
    pub fn with_kept_connections(self, n: usize) -> Self {
        self.rebuilt(|s| s.kept = (n > 0).then(|| kept::Kept::new(s.pool.clone(), n)))
    }

    fn kept_most(&self) -> usize {
        self.kept.as_ref().map_or(0, |kept| kept.most())
    }

    /// How many connections the store keeps out of the pool now, idle or in use
    /// ([`with_kept_connections`](Self::with_kept_connections)).
    pub fn kept_connections(&self) -> usize {
        self.kept.as_ref().map_or(0, |kept| kept.open())
    }

    /// The pool the store runs its statements on.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The table, schema-qualified and quoted.
    pub fn table(&self) -> &str {
        &self.sql.qualified
    }

    /// Whether the store listens for completions now.
    pub fn is_listening(&self) -> bool {
        *self.listener.connected.borrow()
    }

    /// Starts listening for completions, and waits until it listens (at most 5 s).
    ///
    /// # Errors
    ///
    /// [`Unavailable`](StoreErrorKind::Unavailable) when it does not listen within 5 s.
    pub async fn listen(&self) -> Result<(), StoreError> {
        self.listener.ensure_started();
        let mut rx = self.listener.connected.subscribe();
        match tokio::time::timeout(Duration::from_secs(5), rx.wait_for(|up| *up)).await {
            Ok(Ok(_)) => Ok(()),
            _ => Err(StoreError::new(
                StoreErrorKind::Unavailable,
                "the LISTEN connection did not come up",
            )),
        }
    }

    /// Creates the schema (if it is missing), the table and its functions, and applies
    /// pending migrations: the same migrations as
    /// [`PostgresStore::migrate`](crate::store::PostgresStore::migrate), serialised by
    /// the same advisory lock and recorded in the same `<table>_migrations`, in one
    /// read committed transaction.
    ///
    /// # Errors
    ///
    /// The database could not be reached, or the role may not create what is missing.
    pub async fn migrate(&self) -> Result<(), StoreError> {
        let mut tx = self.pool.begin().await.map_err(classify)?;
        let applying = |e: ::sqlx::Error| classify_with(e, |_| None);
        tx.execute(::sqlx::raw_sql(
            "SET TRANSACTION ISOLATION LEVEL READ COMMITTED;
             SET LOCAL client_min_messages = warning;
             SELECT set_config(name, '0', true) FROM pg_settings
             WHERE name IN ('lock_timeout', 'statement_timeout', 'transaction_timeout')",
        ))
        .await
        .map_err(applying)?;
        self.query("SELECT pg_advisory_xact_lock($1)")
            .bind(MIGRATION_LOCK)
            .execute(&mut *tx)
            .await
            .map_err(applying)?;
        let schema_exists: bool =
            ::sqlx::query_scalar("SELECT EXISTS (SELECT FROM pg_namespace WHERE nspname = $1)")
                .persistent(self.persistent)
                .bind(&self.schema)
                .fetch_one(&mut *tx)
                .await
                .map_err(applying)?;
        if !schema_exists {
            tx.execute(::sqlx::raw_sql(&format!(
                "CREATE SCHEMA IF NOT EXISTS \"{}\"",
                self.schema
            )))
            .await
            .map_err(applying)?;
        }
        tx.execute(::sqlx::raw_sql(&super::migrate::create_migrations_table(
            &self.sql,
        )))
        .await
        .map_err(applying)?;
        let applied: Vec<i32> = ::sqlx::query_scalar(&format!(
            "SELECT version FROM {}",
            self.sql.migrations_table
        ))
        .persistent(self.persistent)
        .fetch_all(&mut *tx)
        .await
        .map_err(applying)?;
        self.create_generations_if_absent(&mut tx).await?;
        for (version, sql) in scripts(&self.sql) {
            if applied.contains(&version) {
                continue;
            }
            tx.execute(::sqlx::raw_sql(&sql)).await.map_err(applying)?;
            self.query(&format!(
                "INSERT INTO {} (version) VALUES ($1)",
                self.sql.migrations_table
            ))
            .bind(version)
            .execute(&mut *tx)
            .await
            .map_err(applying)?;
        }
        tx.commit().await.map_err(applying)
    }

    /// A statement of the store's, prepared once per connection unless the store is
    /// behind a transaction pooler.
    fn query<'q>(&self, sql: &'q str) -> Query<'q, Postgres, PgArguments> {
        ::sqlx::query(sql).persistent(self.persistent)
    }

    /// A connection for one of the store's statements: a kept one if one is idle or
    /// may be opened (`with_kept_connections`), else one of the pool's.
    async fn lend(&self) -> Result<kept::Lent, StoreError> {
        kept::Lent::from(self.kept.as_ref(), &self.pool).await
    }

    /// `conn` after its statement ended with `result`: back for the next statement if
    /// its answer was read in full, closed (a kept one) otherwise. An error the server
    /// answered leaves a connection ready, unless it was in a transaction of the
    /// store's (behind a transaction pooler), whose `ROLLBACK` is still to be sent.
    fn handed_back<T>(
        &self,
        conn: kept::Lent,
        result: Result<T, ::sqlx::Error>,
    ) -> Result<T, StoreError> {
        match result {
            Ok(done) => {
                conn.done();
                Ok(done)
            }
            Err(e) => {
                if self.persistent && kept::leaves_it_ready(&e) {
                    conn.done();
                }
                Err(classify(e))
            }
        }
    }

    /// Sends `query` on a connection [`lend`](Self::lend) gives, for its rows or for
    /// the count of rows it changed (`rows`). Behind a transaction pooler, in a
    /// transaction of its own: sqlx sends an unnamed statement's parse and its execution
    /// in two exchanges, which the pooler may give to two server sessions unless a
    /// transaction holds one.
    async fn send(
        &self,
        query: Query<'_, Postgres, PgArguments>,
        rows: bool,
    ) -> Result<Answer, StoreError> {
        let mut conn = self.lend().await?;
        let answer = if self.persistent {
            Answer::of(query, &mut conn, rows).await
        } else {
            async {
                let mut tx = conn.begin().await?;
                let answer = Answer::of(query, &mut tx, rows).await?;
                tx.commit().await.map(|()| answer)
            }
            .await
        };
        self.handed_back(conn, answer)
    }

    /// [`send`](Self::send)s `query` for its rows.
    async fn fetch_all(
        &self,
        query: Query<'_, Postgres, PgArguments>,
    ) -> Result<Vec<PgRow>, StoreError> {
        match self.send(query, true).await? {
            Answer::Rows(rows) => Ok(rows),
            Answer::Changed(_) => Ok(Vec::new()),
        }
    }

    /// [`fetch_all`](Self::fetch_all), for a statement of one row at most.
    async fn fetch_optional(
        &self,
        query: Query<'_, Postgres, PgArguments>,
    ) -> Result<Option<PgRow>, StoreError> {
        Ok(self.fetch_all(query).await?.into_iter().next())
    }

    /// [`send`](Self::send)s `query` for the count of rows it changed.
    async fn execute(&self, query: Query<'_, Postgres, PgArguments>) -> Result<u64, StoreError> {
        match self.send(query, false).await? {
            Answer::Changed(n) => Ok(n),
            Answer::Rows(rows) => Ok(rows.len() as u64),
        }
    }

    /// What an operator's removal did: the token of the row its statement returned, or
    /// why it removed nothing, from the key read again.
    async fn removal(
        &self,
        row: Option<PgRow>,
        scope: &Scope,
        key: &str,
    ) -> Result<Removal, StoreError> {
        if let Some(token) = row.and_then(|row| SqlxRow(row).int8(0)) {
            return Ok(removed(token));
        }
        Ok(refused(Store::look_up(self, scope, key).await?))
    }

    fn key_id(&self, scope: &Scope, key: &str) -> String {
        super::key_id(&self.sql.qualified, scope, key)
    }

    /// One read of the claim statement and its decision: `None` to look again.
    async fn claim_once(
        &self,
        req: &ClaimRequest<'_>,
        token: FencingToken,
    ) -> Result<Option<Claim>, StoreError> {
        let row = again_if_it_lost_a_race(|| {
            self.fetch_optional(
                self.query(&self.sql.claim)
                    .bind(req.scope.as_str())
                    .bind(req.key)
                    .bind(req.fingerprint.as_bytes())
                    .bind(ms(req.lease))
                    .bind(ms(req.ttl))
                    .bind(token.get())
                    .bind(self.holder()),
            )
        })
        .await?
        .ok_or_else(|| corrupt("the claim returned no row"))?;
        match super::claim::found(&SqlxRow(row), req, self.sql.remember)?.0 {
            Found::Claim(claim) => Ok(claim),
            Found::TakeOver(seen) => {
                let taken = again_if_it_lost_a_race(|| {
                    self.fetch_optional(
                        self.query(&self.sql.takeover)
                            .bind(req.scope.as_str())
                            .bind(req.key)
                            .bind(seen.token)
                            .bind(req.fingerprint.as_bytes())
                            .bind(ms(req.lease))
                            .bind(ms(req.ttl))
                            .bind(self.holder()),
                    )
                })
                .await?
                .map(|row| need(SqlxRow(row).int8(0), 0))
                .transpose()?;
                if seen.holder_gone && taken.is_some() {
                    self.took_over_from_a_gone_holder(req);
                }
                Ok(taken.map(|token| {
                    Claim::Acquired(Lease {
                        scope: req.scope.clone(),
                        key: Arc::from(req.key),
                        token: FencingToken::new(token),
                    })
                }))
            }
        }
    }

    /// Whether `lease`'s own token completed its row with `response` already: a
    /// completion sent again after its answer was lost.
    async fn completed_by(
        &self,
        lease: &Lease,
        response: &StoredResponse,
        headers: &[u8],
    ) -> Result<bool, StoreError> {
        let rows = self
            .fetch_all(
                self.query(&self.sql.completed_by)
                    .bind(lease.scope.as_str())
                    .bind(&*lease.key)
                    .bind(lease.token.get())
                    .bind(response.status.as_u16() as i16)
                    .bind(headers)
                    .bind(&response.body[..]),
            )
            .await?;
        Ok(!rows.is_empty())
    }

    /// Deletes up to `batch` expired records.
    ///
    /// # Errors
    ///
    /// The database could not be reached, or failed.
    pub async fn purge_expired(&self, batch: i64) -> Result<u64, StoreError> {
        let batch = batch.max(1);
        again_if_it_lost_a_race(|| self.execute(self.query(&self.sql.purge).bind(batch))).await
    }

    /// Starts the background purge at the first claim.
    fn start_purge(&self) {
        let Some(every) = self.purge_every else {
            return;
        };
        let mut started = self.purge.started.lock();
        if started.is_some() {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let me = Arc::downgrade(&self.purge);
        let store = self.clone_without_purge();
        let every = every.max(Duration::from_millis(1));
        *started = Some(
            runtime
                .spawn(async move {
                    loop {
                        tokio::time::sleep(every).await;
                        if me.strong_count() == 0 {
                            return;
                        }
                        // A table in generations rotates instead.
                        if store.rotator.is_some() {
                            if let Err(e) = store.rotate_generations().await {
                                tracing::warn!(error = %e, "the idempotency rotation failed; trying again next round");
                            }
                            continue;
                        }
                        loop {
                            match store.purge_expired(PURGE_BATCH).await {
                                Ok(n) if n as i64 >= PURGE_BATCH => continue,
                                Ok(_) => break,
                                Err(e) => {
                                    tracing::warn!(error = %e, "the idempotency purge failed; trying again next round");
                                    break;
                                }
                            }
                        }
                    }
                })
                .abort_handle(),
        );
    }

    /// The store as its purge task holds it: without the purge, so that the task does
    /// not keep itself alive.
    fn clone_without_purge(&self) -> Self {
        Self {
            purge: Arc::new(Purge::default()),
            purge_every: None,
            ..self.clone()
        }
    }
}

impl Store for SqlxStore {
    fn claim<'a>(
        &'a self,
        request: &'a ClaimRequest<'a>,
    ) -> BoxFuture<'a, Result<Claim, StoreError>> {
        Box::pin(async move {
            self.start_purge();
            // One token for every attempt: only one of them can insert the row. A claim
            // dropped before its answer (its caller gave up), or whose connection was
            // lost, may have committed: it is released by that token.
            let mut doubt = InDoubt {
                store: self,
                request,
                token: FencingToken::fresh(),
                settled: false,
            };
            let claimed = async {
                for _ in 0..CLAIM_ATTEMPTS {
                    if let Some(claim) = self.claim_once(request, doubt.token).await? {
                        return Ok(claim);
                    }
                }
                Err(StoreError::new(
                    StoreErrorKind::Timeout,
                    "the key kept changing while it was being claimed",
                ))
            }
            .await;
            doubt.settled = !matches!(&claimed, Err(e) if lost_its_connection(e));
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
            let headers = StoredResponse::encode_headers(&response.headers);
            let id = self.key_id(&lease.scope, &lease.key);
            let rows = self
                .fetch_all(
                    self.query(&self.sql.complete)
                        .bind(lease.scope.as_str())
                        .bind(&*lease.key)
                        .bind(lease.token.get())
                        .bind(response.status.as_u16() as i16)
                        .bind(&headers[..])
                        .bind(&response.body[..])
                        .bind(ms(ttl))
                        .bind(&self.listener.channel)
                        .bind(&id),
                )
                .await?;
            if rows.len() == 1 {
                return Ok(self.ended(Fenced::Kept));
            }
            let kept = self.completed_by(lease, response, &headers).await?;
            Ok(self.ended(Fenced::kept_if(kept)))
        })
    }

    fn release<'a>(&'a self, lease: &'a Lease) -> BoxFuture<'a, Result<Fenced, StoreError>> {
        Box::pin(async move {
            let id = self.key_id(&lease.scope, &lease.key);
            let rows = again_if_it_lost_a_race(|| {
                self.fetch_all(
                    self.query(&self.sql.release)
                        .bind(lease.scope.as_str())
                        .bind(&*lease.key)
                        .bind(lease.token.get())
                        .bind(&self.listener.channel)
                        .bind(&id),
                )
            })
            .await?;
            Ok(self.ended(Fenced::kept_if(rows.len() == 1)))
        })
    }

    fn renew<'a>(
        &'a self,
        lease: &'a Lease,
        duration: Duration,
    ) -> BoxFuture<'a, Result<Fenced, StoreError>> {
        Box::pin(async move {
            let done = again_if_it_lost_a_race(|| {
                self.execute(
                    self.query(&self.sql.renew)
                        .bind(lease.scope.as_str())
                        .bind(&*lease.key)
                        .bind(lease.token.get())
                        .bind(ms(duration)),
                )
            })
            .await?;
            if let (1, Some(liveness)) = (done, &self.liveness) {
                liveness.renewed(duration);
            }
            Ok(Fenced::kept_if(done == 1))
        })
    }

    fn look_up<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a str,
    ) -> BoxFuture<'a, Result<Option<KeyRecord>, StoreError>> {
        Box::pin(async move {
            let row = self
                .fetch_optional(self.query(&self.sql.look_up).bind(scope.as_str()).bind(key))
                .await?;
            row.map(|row| record(&SqlxRow(row), self.sql.remember))
                .transpose()
        })
    }

    fn running_keys(
        &self,
        older_than: Duration,
        limit: usize,
    ) -> BoxFuture<'_, Result<Vec<RunningKey>, StoreError>> {
        Box::pin(async move {
            let limit = i64::try_from(limit).unwrap_or(i64::MAX);
            let rows = self
                .fetch_all(
                    self.query(&self.sql.running_keys)
                        .bind(ms(older_than))
                        .bind(limit),
                )
                .await?;
            rows.into_iter()
                .map(|row| running_key(&SqlxRow(row), self.sql.remember))
                .collect()
        })
    }

    fn release_running<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a str,
        holder: Option<FencingToken>,
    ) -> BoxFuture<'a, Result<Removal, StoreError>> {
        Box::pin(async move {
            let id = self.key_id(scope, key);
            let row = self
                .fetch_optional(
                    self.query(&self.sql.release_running)
                        .bind(scope.as_str())
                        .bind(key)
                        .bind(holder.map(FencingToken::get))
                        .bind(&self.listener.channel)
                        .bind(&id),
                )
                .await?;
            self.removal(row, scope, key).await
        })
    }

    fn delete_completed<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a str,
    ) -> BoxFuture<'a, Result<Removal, StoreError>> {
        Box::pin(async move {
            let row = self
                .fetch_optional(
                    self.query(&self.sql.delete_done)
                        .bind(scope.as_str())
                        .bind(key),
                )
                .await?;
            self.removal(row, scope, key).await
        })
    }

    fn steps<'a>(
        &'a self,
        lease: &'a Lease,
    ) -> BoxFuture<'a, Result<Option<Vec<RecordedStep>>, StoreError>> {
        Box::pin(async move {
            let rows = again_if_it_lost_a_race(|| {
                self.fetch_all(
                    self.query(&self.sql.steps.read)
                        .bind(lease.scope.as_str())
                        .bind(&*lease.key)
                        .bind(lease.token.get()),
                )
            })
            .await?;
            if rows.is_empty() {
                return Ok(None);
            }
            // A claim without steps: one row, of NULLs.
            rows.into_iter()
                .map(SqlxRow)
                .filter(|row| row.int4(0).is_some())
                .map(|row| step(&row))
                .collect::<Result<_, _>>()
                .map(Some)
        })
    }

    fn record_step<'a>(
        &'a self,
        lease: &'a Lease,
        recorded: &'a RecordedStep,
    ) -> BoxFuture<'a, Result<Fenced, StoreError>> {
        Box::pin(async move {
            let n = place(recorded)?;
            let rows = again_if_it_lost_a_race(|| {
                self.fetch_all(
                    self.query(&self.sql.steps.record)
                        .bind(lease.scope.as_str())
                        .bind(&*lease.key)
                        .bind(lease.token.get())
                        .bind(n)
                        .bind(recorded.name.as_str())
                        .bind(&recorded.result[..]),
                )
            })
            .await?;
            Ok(Fenced::kept_if(rows.len() == 1))
        })
    }

    fn purge<'a>(&'a self, batch: usize) -> BoxFuture<'a, Result<u64, StoreError>> {
        Box::pin(self.purge_expired(i64::try_from(batch).unwrap_or(i64::MAX)))
    }

    fn register_waiter<'a>(
        &'a self,
        scope: &'a Scope,
        key: &'a str,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(async move {
            let row = self
                .fetch_optional(self.query(&self.sql.wait).bind(scope.as_str()).bind(key))
                .await?;
            let running = row.and_then(|row| SqlxRow(row).boolean(0));
            Ok(running == Some(true))
        })
    }

    fn changed(&self, scope: &Scope, key: &str) -> BoxFuture<'static, ()> {
        self.listener.changed(self.key_id(scope, key))
    }

    fn running_recheck(&self) -> Option<Duration> {
        // A holder gone is found so a grace after its last sign of life.
        self.liveness.as_ref().map(|_| super::holder::GRACE)
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
    ) -> BoxFuture<'a, Result<Vec<crate::store::Orphan>, StoreError>> {
        Box::pin(self.orphans_of(name, limit))
    }

    fn abandoned_claim_wait(&self, lease: Duration) -> Duration {
        // A claim dropped unanswered is released in doubt (`InDoubt`).
        lease.min(ABANDONED_CLAIM_WAIT)
    }

    fn records_location(&self) -> Option<Arc<str>> {
        let options = self.pool.connect_options();
        Some(Arc::from(format!(
            "sqlx {:?} {} {:?} {}",
            options.get_host(),
            options.get_port(),
            options.get_database(),
            self.sql.qualified
        )))
    }

    fn migrate(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(SqlxStore::migrate(self))
    }
}

/// A claim under way: dropped before it settled (its caller gave up on it), or settled
/// with its connection lost, it may have committed unanswered, and is released by its
/// token in the background (`in_doubt`), as the tokio-postgres driver's are.
struct InDoubt<'a> {
    store: &'a SqlxStore,
    request: &'a ClaimRequest<'a>,
    token: FencingToken,
    settled: bool,
}

impl Drop for InDoubt<'_> {
    fn drop(&mut self) {
        if !self.settled {
            release_in_doubt(self.store.clone(), self.request, self.token);
        }
    }
}

/// Whether `e` is a sqlx error of a connection lost, or unusable, once a statement
/// may have been sent on it.
pub(crate) fn lost_its_connection(e: &StoreError) -> bool {
    use std::error::Error as _;
    matches!(
        e.source().and_then(|e| e.downcast_ref::<::sqlx::Error>()),
        Some(::sqlx::Error::Io(_) | ::sqlx::Error::Protocol(_) | ::sqlx::Error::WorkerCrashed)
    )
}

/// A background task of the store's, once started; aborted when its owner is dropped.
#[derive(Default)]
struct Task(Mutex<Option<tokio::task::AbortHandle>>);

impl Task {
    fn lock(&self) -> std::sync::MutexGuard<'_, Option<tokio::task::AbortHandle>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Drop for Task {
    fn drop(&mut self) {
        if let Some(task) = self
            .0
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
        {
            task.abort();
        }
    }
}

/// The background purge's task, stopped with the last clone of the store.
#[derive(Default)]
struct Purge {
    started: Task,
}

/// Completions heard on a `LISTEN` connection of a pool ([`PgListener`]), each waking
/// the requests that wait for its key.
struct Listener {
    pool: PgPool,
    channel: String,
    waiters: Arc<Waiters<String>>,
    connected: tokio::sync::watch::Sender<bool>,
    started: Task,
}

impl Listener {
    fn new(pool: PgPool, channel: String) -> Self {
        Self {
            pool,
            channel,
            waiters: Arc::default(),
            connected: tokio::sync::watch::channel(false).0,
            started: Task::default(),
        }
    }

    fn ensure_started(self: &Arc<Self>) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let mut started = self.started.lock();
        if started
            .as_ref()
            .is_none_or(tokio::task::AbortHandle::is_finished)
        {
            let task = runtime.spawn(listen(Arc::downgrade(self), self.pool.clone()));
            *started = Some(task.abort_handle());
        }
    }

    fn changed(self: &Arc<Self>, id: String) -> BoxFuture<'static, ()> {
        self.ensure_started();
        let notified = self.waiters.wait(id);
        let connected = *self.connected.borrow();
        Box::pin(async move {
            if connected {
                notified.await;
                return;
            }
            tokio::select! {
                () = notified => {}
                () = tokio::time::sleep(FALLBACK_RECHECK) => {}
            }
        })
    }

    /// Nothing was heard for a while (the connection was lost): every waiter looks
    /// again.
    fn down(&self) {
        self.connected.send_replace(false);
        self.waiters.wake_all();
    }
}

async fn listen(me: Weak<Listener>, pool: PgPool) {
    let mut backoff = Duration::from_millis(100);
    loop {
        let Some(channel) = me.upgrade().map(|me| me.channel.clone()) else {
            return;
        };
        let listening = async {
            let mut listener = PgListener::connect_with(&pool).await?;
            listener.listen(&channel).await?;
            Ok::<_, ::sqlx::Error>(listener)
        };
        match listening.await {
            Ok(mut listener) => {
                if let Some(me) = me.upgrade() {
                    me.connected.send_replace(true);
                    me.waiters.wake_all();
                }
                backoff = Duration::from_millis(100);
                loop {
                    let heard = listener.try_recv().await;
                    let Some(me) = me.upgrade() else { return };
                    match heard {
                        Ok(Some(n)) => me.waiters.wake(n.payload()),
                        // The connection was lost and is made again at the next call
                        // (`PgListener`), listening again: what was sent meanwhile is
                        // lost, so everyone looks again.
                        Ok(None) => me.waiters.wake_all(),
                        Err(e) => {
                            tracing::warn!(error = %e, "the idempotency listener connection failed");
                            me.down();
                            break;
                        }
                    }
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "the idempotency listener cannot LISTEN");
                if let Some(me) = me.upgrade() {
                    me.down();
                }
            }
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(5));
    }
}

/// A row of sqlx's, read as the store reads rows ([`Columns`]).
struct SqlxRow(PgRow);

impl Columns for SqlxRow {
    fn int8(&self, i: usize) -> Option<i64> {
        self.0.try_get(i).ok().flatten()
    }
    fn int2(&self, i: usize) -> Option<i16> {
        self.0.try_get(i).ok().flatten()
    }
    fn int4(&self, i: usize) -> Option<i32> {
        self.0.try_get(i).ok().flatten()
    }
    fn boolean(&self, i: usize) -> Option<bool> {
        self.0.try_get(i).ok().flatten()
    }
    fn text(&self, i: usize) -> Option<&str> {
        self.0.try_get(i).ok().flatten()
    }
    fn bytes(&self, i: usize) -> Option<&[u8]> {
        self.0.try_get(i).ok().flatten()
    }
    fn time(&self, i: usize) -> Option<SystemTime> {
        // A `timestamptz` in binary: microseconds since 2000-01-01 UTC (sqlx decodes
        // it only with its chrono or time features).
        let value = self.0.try_get_raw(i).ok()?;
        if value.is_null() || value.format() != PgValueFormat::Binary {
            return None;
        }
        let micros = i64::from_be_bytes(value.as_bytes().ok()?.try_into().ok()?);
        let epoch_2000 = SystemTime::UNIX_EPOCH + Duration::from_secs(946_684_800);
        let delta = Duration::from_micros(micros.unsigned_abs());
        if micros >= 0 {
            epoch_2000.checked_add(delta)
        } else {
            epoch_2000.checked_sub(delta)
        }
    }
}

/// The SQLSTATE of a database error of sqlx's.
pub(super) fn sqlstate(e: &::sqlx::Error) -> Option<SqlState> {
    e.as_database_error()
        .and_then(|db| db.code())
        .map(|code| SqlState::from_code(&code))
}

/// A sqlx error as the store reports it, classified as the PostgreSQL store's are.
fn classify(e: ::sqlx::Error) -> StoreError {
    classify_with(e, serving_hint)
}

fn classify_with(
    e: ::sqlx::Error,
    hint: impl FnOnce(&SqlState) -> Option<Cow<'static, str>>,
) -> StoreError {
    match e {
        ::sqlx::Error::PoolTimedOut => StoreError::new(StoreErrorKind::Timeout, e),
        ::sqlx::Error::Configuration(_) => StoreError::new(StoreErrorKind::Misconfigured, e),
        e => {
            let code = sqlstate(&e);
            classified(code.as_ref(), hint, e)
        }
    }
}
