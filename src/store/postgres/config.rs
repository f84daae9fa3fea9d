//! Building a store: its constructors and `with_*` settings, all held in one
//! [`Options`] value so that no setting resets another, and the checks on names.

use std::{fmt, sync::Arc, time::Duration};

use deadpool_postgres::Pool;
use tokio_postgres::{
    Socket,
    tls::{MakeTlsConnect, TlsConnect},
};

use super::{
    PostgresStore,
    batch::Batcher,
    listener::Listener,
    liveness::Liveness,
    purge::{self, BackgroundPurge},
    reserve::{self, SessionSetup, Setup},
    shared::{Opened, Shared},
    sql::Sql,
    tls::Connector,
    url::{parse_url, pool_for_url, pool_for_url_with_tls},
};
use crate::store::BoxFuture;

/// What a [`PostgresStore`] is built with besides its pool (see `PostgresStore::build`).
pub(super) struct Options {
    schema: String,
    table: String,
    listen_config: Option<tokio_postgres::Config>,
    connector: Connector,
    /// Shared claim connections; 0: none.
    shared: usize,
    purge_every: Option<Duration>,
    transaction_pooling: bool,
    /// The period of the table's generations, if it has them.
    generations: Option<Duration>,
    /// Batched claims as set (`with_batched_claims`): connections at most (0: off) and
    /// claims per statement; `None`, the default (`default_batching`).
    batching: Option<(usize, usize)>,
    /// Liveness, if there is a notification connection to hold its lock on.
    liveness: bool,
    /// What the app runs on each connection the store makes outside its pool to write
    /// the table (`with_session_setup`): the reserve's, and liveness's.
    session_setup: Option<SessionSetup>,
    /// How long a completed key is remembered once its response expired.
    remember: Duration,
}

/// A rejected store setting.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError(pub(super) String);

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ConfigError {}

/// The database a store's table is in, as far as the store can tell: the hosts, ports
/// and database name of its notification connection's configuration (the URL given to
/// `connect`, or to `with_notifications`), else its pool (whose manager lives as long
/// as the pool, at one address). Two stores over one table of one database, with pools
/// of their own, claim the same keys.
pub(super) fn database(config: Option<&tokio_postgres::Config>, pool: &Pool) -> String {
    match config {
        Some(config) => format!(
            "postgres {:?} {:?} {:?}",
            config.get_hosts(),
            config.get_ports(),
            config.get_dbname().unwrap_or_default()
        ),
        None => format!("pool {:p}", pool.manager()),
    }
}

/// Checks a schema or table name: 1–50 characters of `a-z`, `0-9`, `_`, not starting
/// with a digit. Names are still quoted in SQL; the check keeps them unambiguous.
pub(super) fn validate_identifier(what: &str, name: &str) -> Result<(), ConfigError> {
    let ok = (1..=50).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
        && !name.as_bytes()[0].is_ascii_digit();
    if ok {
        Ok(())
    } else {
        Err(ConfigError(format!(
            "invalid {what} name {name:?}: use 1-50 characters of a-z, 0-9 and _, not starting with a digit"
        )))
    }
}

/// Claims (and completions) per batch statement by default.
const DEFAULT_MAX_CLAIMS: usize = 64;

/// Batching by default (`with_batched_claims`): up to as many batches in flight at once
/// as the pool has connections, so that batching never has fewer statements in flight
/// than claims sent alone would (`adapt`), 64 claims per statement.
fn default_batching(pool: &Pool) -> (usize, usize) {
    (pool.status().max_size.max(1), DEFAULT_MAX_CLAIMS)
}

impl PostgresStore {
    /// A store over `pool`, using the table `public.idempotency_keys`.
    ///
    /// Run [`migrate`](Self::migrate) once before serving (it is safe to run from every
    /// replica at start-up). A pool without a wait timeout gets one of 5 s from the
    /// store, so that an exhausted pool answers 503 instead of hanging; give it a create
    /// timeout too, for an unreachable database ([`connect`](Self::connect) sets both).
    ///
    /// Waiting for running requests ([`IdempotencyLayer::wait_for_running`](crate::IdempotencyLayer::wait_for_running))
    /// wakes on notifications through a `LISTEN` connection of its own, which a pool
    /// cannot lend: give its configuration with [`with_notifications`](Self::with_notifications),
    /// or build the store with [`connect`](Self::connect), which does. Without one, a
    /// waiter looks again every 250 ms.
    pub fn new(pool: Pool) -> Self {
        Self::build(
            pool,
            Options {
                schema: "public".into(),
                table: "idempotency_keys".into(),
                listen_config: None,
                connector: Connector::default(),
                shared: 0,
                purge_every: Some(purge::DEFAULT_EVERY),
                transaction_pooling: false,
                generations: None,
                batching: None,
                liveness: true,
                session_setup: None,
                remember: crate::store::DEFAULT_REMEMBER,
            },
        )
    }

    /// A store over a new pool for `url` (16 connections; 5 s to connect or wait for
    /// one), listening for completions on a connection of its own.
    ///
    /// # Errors
    ///
    /// A [`ConfigError`] for a URL that does not parse. Nothing connects yet: an
    /// unreachable database shows in the first statement, or in [`migrate`](Self::migrate).
    pub fn connect(url: &str) -> Result<Self, ConfigError> {
        Ok(Self::new(pool_for_url(url, 16)?).with_notifications(parse_url(url)?))
    }

    /// [`connect`](Self::connect) over TLS: a pool for `url` whose connections use
    /// `tls`, and the store's own connections (the `LISTEN` connection, the cancel
    /// requests) too, as [`with_tls`](Self::with_tls) sets. Ask for TLS in the URL
    /// (`sslmode=require`), or the driver falls back to plain TCP where the server
    /// offers no TLS.
    ///
    /// # Errors
    ///
    /// As [`connect`](Self::connect): a [`ConfigError`] for a URL that does not parse.
    ///
    /// `tls` is the app's connector: tokio-postgres-rustls's `MakeRustlsConnect` over a
    /// rustls `ClientConfig` that trusts the CA which signed the database's
    /// certificate, or postgres-native-tls's `MakeTlsConnector` (the guide,
    /// [security](crate::guide::security), shows the first).
    ///
    /// ```no_run
    /// # use tokio_postgres::{Socket, tls::{MakeTlsConnect, TlsConnect}};
    /// use tower_idempotency::store::PostgresStore;
    ///
    /// # fn store<T>(tls: T) -> Result<PostgresStore, Box<dyn std::error::Error>>
    /// # where
    /// #     T: MakeTlsConnect<Socket> + Clone + Send + Sync + 'static,
    /// #     T::Stream: Send + Sync + 'static,
    /// #     T::TlsConnect: Send + Sync,
    /// #     <T::TlsConnect as TlsConnect<Socket>>::Future: Send,
    /// # {
    /// let store = PostgresStore::connect_with_tls(
    ///     "postgres://app@db.internal/payments?sslmode=require",
    ///     tls,
    /// )?;
    /// # Ok(store) }
    /// ```
    pub fn connect_with_tls<T>(url: &str, tls: T) -> Result<Self, ConfigError>
    where
        T: MakeTlsConnect<Socket> + Clone + Send + Sync + 'static,
        T::Stream: Send + Sync + 'static,
        T::TlsConnect: Send + Sync,
        <T::TlsConnect as TlsConnect<Socket>>::Future: Send,
    {
        let pool = pool_for_url_with_tls(url, 16, tls.clone())?;
        Ok(Self::new(pool)
            .with_notifications(parse_url(url)?)
            .with_tls(tls))
    }

    /// The settings this store was built with, to build it again with one changed.
    pub(super) fn options(&self) -> Options {
        Options {
            schema: self.schema.clone(),
            table: self.table.clone(),
            listen_config: self.listen_config.clone(),
            connector: self.connector.clone(),
            shared: self.shared.as_ref().map_or(0, |s| s.len()),
            purge_every: self.purge.every(),
            transaction_pooling: self.transaction_pooling,
            generations: self.purge.generations(),
            batching: self.batching,
            liveness: self.liveness_on,
            session_setup: self.reserve.session_setup(),
            remember: self.sql.remember,
        }
    }

    /// A store over `pool` with `options`: every setting at once, so that a builder
    /// method that changes one keeps the others.
    pub(super) fn build(pool: Pool, options: Options) -> Self {
        let Options {
            schema,
            table,
            listen_config,
            connector,
            shared,
            purge_every,
            transaction_pooling,
            generations,
            batching,
            liveness,
            session_setup,
            remember,
        } = options;
        // Batching is on by default, unless shared claim connections are asked for (and
        // can be had: not behind a transaction pooler); asked for both, batching wins.
        let batching_set = batching;
        let batching = match batching {
            Some(set) => set,
            None if shared > 0 && !transaction_pooling => (0, 0),
            None => default_batching(&pool),
        };
        // A shared claim connection sets `lock_timeout` for its session, which a
        // transaction pooler would hand to other clients' transactions. With batching,
        // claims go in batches: a store takes one path for its claims, and the wait for
        // a claim given up on (`Store::abandoned_claim_wait`) follows it.
        let shared = if shared == 0 {
            0
        } else if transaction_pooling {
            tracing::warn!(
                "shared claim connections are off behind a transaction pooler: their session setting would leak to other clients"
            );
            0
        } else if batching.0 > 0 {
            tracing::warn!(
                "shared claim connections are off with batched claims: claims go in batches"
            );
            0
        } else {
            shared
        };
        let channel = format!("{table}_done");
        let tx_claims = Arc::new(tokio::sync::Semaphore::new(
            (pool.status().max_size / 2).max(1),
        ));
        let sql = Sql::new(&schema, &table, generations.is_some(), remember);
        let location = Arc::from(format!(
            "{} {}",
            database(listen_config.as_ref(), &pool),
            sql.qualified
        ));
        let purge = Arc::new(BackgroundPurge::new(
            purge_every,
            pool.clone(),
            (!transaction_pooling).then(|| connector.clone()),
            (sql.purge_in_turn.clone(), sql.steps.forget_stale.clone()),
            !transaction_pooling,
            purge::lock_id(&sql.qualified),
            generations
                .zip(sql.generations.clone())
                .map(|(period, names)| {
                    let orphans = sql.steps.forget_orphans.clone();
                    super::generations::Rotator::new(period, names, &sql, orphans)
                }),
        ));
        let liveness_of = listen_config.as_ref().filter(|_| liveness).map(|config| {
            Arc::new(Liveness::new(
                config,
                connector.clone(),
                pool.clone(),
                session_setup.clone(),
                &sql,
            ))
        });
        Self {
            location,
            purge,
            liveness: liveness_of,
            liveness_on: liveness,
            transaction_pooling,
            tx_claims,
            listener: Arc::new(Listener::new(
                listen_config.clone(),
                channel,
                connector.clone(),
            )),
            connector,
            listen_config,
            pool,
            schema,
            table,
            statements: Arc::default(),
            shared: (shared > 0).then(|| Arc::new(Shared::new(shared, Opened::ForClaims))),
            batcher: (batching.0 > 0).then(|| Arc::new(Batcher::new(batching.0, batching.1))),
            batching: batching_set,
            reserve: Arc::new(Shared::new(
                reserve::RESERVE,
                Opened::Reserve(Setup::new(session_setup, sql.reserve_check.clone())),
            )),
            sql: Arc::new(sql),
        }
    }

    /// Uses the schema `name` (created by [`migrate`](Self::migrate) if absent).
    ///
    /// # Errors
    ///
    /// A [`ConfigError`] unless `name` is 1 to 50 characters of `a-z`, `0-9` and `_`, not
    /// starting with a digit.
    pub fn with_schema_name(self, name: &str) -> Result<Self, ConfigError> {
        validate_identifier("schema", name)?;
        let options = Options {
            schema: name.to_owned(),
            ..self.options()
        };
        Ok(Self::build(self.pool, options))
    }

    /// Uses the table `name`.
    ///
    /// # Errors
    ///
    /// A [`ConfigError`] unless `name` is 1 to 50 characters of `a-z`, `0-9` and `_`, not
    /// starting with a digit.
    pub fn with_table_name(self, name: &str) -> Result<Self, ConfigError> {
        validate_identifier("table", name)?;
        let options = Options {
            table: name.to_owned(),
            ..self.options()
        };
        Ok(Self::build(self.pool, options))
    }

    /// Listens for completions on a connection made with `config`, so that requests
    /// waiting for a running key wake as soon as it completes, in any process.
    ///
    /// With several hosts (a primary and its standbys, `target_session_attrs=read-write`),
    /// it connects as the pools of [`pool_for_url`] do, and finds the promoted standby
    /// after a failover.
    ///
    /// The connection needs a session of its own: a direct one, or session pooling,
    /// never a transaction-pooling PgBouncer. After `LISTEN`, and every 10 s, the
    /// listener sends itself a notification (a small transaction, on a channel of its
    /// own that no other listener hears) and counts as listening only while it comes
    /// back within 5 s; a connection that hears nothing is replaced, and waiters poll
    /// meanwhile. Through transaction pooling the check
    /// may still pass, when the pooler hands back the server connection that listens,
    /// so it does not make such a connection safe to use.
    ///
    /// The store's liveness connection ([`with_liveness`](Self::with_liveness)) is made
    /// with the same configuration, and needs a session of its own just as much.
    pub fn with_notifications(self, config: tokio_postgres::Config) -> Self {
        let options = Options {
            listen_config: Some(config),
            ..self.options()
        };
        Self::build(self.pool, options)
    }

    /// Makes the connections the store opens outside its pool with `tls`: the
    /// `LISTEN` connection ([`with_notifications`](Self::with_notifications)), and the
    /// cancel requests sent for statements given up on (a client gone while its
    /// transactional claim waits on a lock, say). Without it they are plain TCP: with
    /// `sslmode=require` the `LISTEN` connection cannot connect and cancel requests are
    /// not sent. Give it the connector your pool uses.
    ///
    /// With `tls` the app's connector (as for [`connect_with_tls`](Self::connect_with_tls)):
    ///
    /// ```no_run
    /// # use tokio_postgres::{Socket, tls::{MakeTlsConnect, TlsConnect}};
    /// use tower_idempotency::store::PostgresStore;
    ///
    /// # fn store<T>(tls: T) -> Result<PostgresStore, Box<dyn std::error::Error>>
    /// # where
    /// #     T: MakeTlsConnect<Socket> + Clone + Send + Sync + 'static,
    /// #     T::Stream: Send + Sync + 'static,
    /// #     T::TlsConnect: Send + Sync,
    /// #     <T::TlsConnect as TlsConnect<Socket>>::Future: Send,
    /// # {
    /// let url = "postgres://app@db.internal/payments?sslmode=require";
    /// let config: tokio_postgres::Config = url.parse()?;
    /// let manager = deadpool_postgres::Manager::new(config.clone(), tls.clone());
    /// let pool = deadpool_postgres::Pool::builder(manager).max_size(16).build()?;
    /// let store = PostgresStore::new(pool)
    ///     .with_notifications(config)
    ///     .with_tls(tls);
    /// # Ok(store) }
    /// ```
    #[must_use]
    pub fn with_tls<T>(self, tls: T) -> Self
    where
        T: MakeTlsConnect<Socket> + Clone + Send + Sync + 'static,
        T::Stream: Send + Sync + 'static,
        T::TlsConnect: Send + Sync,
        <T::TlsConnect as TlsConnect<Socket>>::Future: Send,
    {
        let options = Options {
            connector: Connector::with(tls),
            ..self.options()
        };
        Self::build(self.pool, options)
    }

    /// Runs `setup` on each connection the store makes outside its pool, before the
    /// connection serves: give it what the pool's `post_create` hook runs on the
    /// pool's connections (`SET ROLE`, say), so that the statements of running claims
    /// run as the pool's do.
    ///
    /// When every pooled connection is checked out, a running claim's renewals, its
    /// completion and its release go over the store's reserve (see [`PostgresStore`]):
    /// connections made by the pool's manager, with its configuration and TLS, but
    /// without its hooks, which deadpool runs only on connections it makes for the pool.
    /// A login role with no rights of its own, whose pool's hook takes on a role that
    /// has them, would then renew as the login role, fail, and lose the lease under a
    /// live handler: a retry would run it again. Pass the same function to both. The
    /// connections of [`with_liveness`](Self::with_liveness) (the one that holds the
    /// store's lock, and the heartbeat's), which write `<table>_holders`, run it too.
    ///
    /// Each reserve connection is checked before it serves, set up or not: its role
    /// (`current_user`) must be allowed to read and write the table. One that is not is
    /// closed, the reserve is refused from then on with an error in the log, and those
    /// statements wait for the pool as they would without a reserve, failing with
    /// [`Misconfigured`](crate::store::StoreErrorKind::Misconfigured) if none comes. A
    /// setup that fails fails the connection in the same way. Behind a transaction
    /// pooler a session setting does not hold, on the pool's connections nor on these:
    /// give the role to the pooler's user instead.
    ///
    /// ```no_run
    /// use deadpool_postgres::{Hook, HookError, Manager, Pool};
    /// use tower_idempotency::store::{BoxFuture, PostgresStore};
    ///
    /// /// The pool's connections log in as `app_login`, which has no rights of its
    /// /// own, and act as `app_writer`.
    /// fn act_as_writer(
    ///     client: &tokio_postgres::Client,
    /// ) -> BoxFuture<'_, Result<(), tokio_postgres::Error>> {
    ///     Box::pin(client.batch_execute("SET ROLE app_writer"))
    /// }
    ///
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let config: tokio_postgres::Config = "postgres://app_login@db.internal/payments".parse()?;
    /// let pool = Pool::builder(Manager::new(config, tokio_postgres::NoTls))
    ///     .max_size(16)
    ///     .post_create(Hook::async_fn(|client, _| {
    ///         Box::pin(async move { act_as_writer(client).await.map_err(HookError::Backend) })
    ///     }))
    ///     .build()?;
    /// let store = PostgresStore::new(pool).with_session_setup(act_as_writer);
    /// # Ok(()) }
    /// ```
    #[must_use]
    pub fn with_session_setup<F>(self, setup: F) -> Self
    where
        F: for<'c> Fn(
                &'c tokio_postgres::Client,
            ) -> BoxFuture<'c, Result<(), tokio_postgres::Error>>
            + Send
            + Sync
            + 'static,
    {
        let options = Options {
            session_setup: Some(Arc::new(setup)),
            ..self.options()
        };
        Self::build(self.pool, options)
    }

    /// Runs lease mode's claims (and so its replays, 409s and 422s) on `n` connections
    /// shared by all requests, instead of on a pooled connection each; `0`, the
    /// default, turns sharing off.
    ///
    /// Concurrent claims on a shared connection are pipelined: written back to back,
    /// each still its own autocommit statement, which costs PostgreSQL less per
    /// statement than a connection each. Replays gain most. A shared connection runs
    /// its claims one after another, and a claim that inserts a new key waits there for
    /// its commit to reach the disk, so each claim goes to the connection with the
    /// fewest in flight (the first on a tie: light load stays on one connection), and
    /// past 8 on each to a pooled connection. At low concurrency new keys are slower
    /// (1–6 % at concurrency 1 in the latest measurements, shared cores): turn it on
    /// where duplicates are a large share of the traffic at high concurrency (client
    /// retries, at-least-once queues), and measure. See `docs/postgres.md`.
    ///
    /// The connections are taken from the pool when first needed and kept (the pool
    /// may open others in their place, and does not see or close these); one that
    /// loses its connection, or stops answering for a second, is replaced when next
    /// used, with at most `2n` shared connections open at once. A claim that would wait there
    /// on a row lock gives up after 50 ms (`lock_timeout`), having changed nothing, and
    /// runs again on a pooled connection of its own, so that it does not hold up the
    /// claims queued behind it. Purges, migrations and all of transactional mode use
    /// pooled connections, and so do completions, releases and renewals, or the
    /// store's reserve when the pool has no idle connection (see [`PostgresStore`]).
    ///
    /// The `lock_timeout` is a session setting: connect directly or through session
    /// pooling. Behind PgBouncer's transaction pooling it would leak to other clients'
    /// transactions and not hold for the claims; leave sharing off there.
    ///
    /// Batching ([`with_batched_claims`](Self::with_batched_claims)), on by default,
    /// gives way: claims take the shared connections and are not batched. With both set
    /// explicitly, claims go in batches, and shared claim connections are off (a
    /// warning says so).
    ///
    /// ```no_run
    /// use tower_idempotency::store::PostgresStore;
    ///
    /// let store = PostgresStore::connect("postgres://postgres@127.0.0.1/postgres")?
    ///     .with_shared_claim_connections(4);
    /// # Ok::<(), tower_idempotency::store::ConfigError>(())
    /// ```
    pub fn with_shared_claim_connections(self, n: usize) -> Self {
        let options = Options {
            shared: n,
            ..self.options()
        };
        Self::build(self.pool, options)
    }

    /// Sets how lease mode's claims (and so its replays, 409s and 422s) go in batches:
    /// up to `max_claims` claims in one statement, and up to `connections` batches in
    /// flight at once; `0` connections turns batching off. On by default, with up to
    /// as many batches in flight as the pool has connections and 64 claims per
    /// statement.
    ///
    /// The batching is natural: a claim that finds a batching connection with nothing
    /// in flight is sent at once, alone, by its own caller, with no timer and no added
    /// wait; the claims that arrive while a batch is in flight queue up and go together
    /// as one statement when it returns (up to `max_claims`, and 1 MiB of keys). One
    /// statement reads every key of a batch and inserts the missing ones, in one
    /// commit: under load the database does a fraction of the work per claim, and a
    /// busy app needs fewer connections. Each claim gets the answer it would have had
    /// alone (two claims of one key in one batch: the first runs, the second finds it
    /// running), and a failed batch gives each claim the error it would have had alone,
    /// or runs each again alone; docs/postgres.md, "Batched claims", says how, and
    /// docs/benchmarks.md when it pays.
    ///
    /// How many batches are in flight follows the load, between one and `connections`.
    /// It starts at `connections`: a claim that finds one of them idle goes alone, so
    /// while fewer claims wait than that, as many statements are in flight as without
    /// batching, and only those that find every one busy queue (where without batching
    /// they would have waited for a pooled connection). While batches form, or claims
    /// find every pooled connection checked out, it tries fewer, bigger batches, and
    /// keeps them while that makes claims faster (the database's CPU is the bound),
    /// stepping back up while more side by side do (each batch waits on a slow commit,
    /// a distant database, a busy machine, and commits in flight together are flushed
    /// together). It halves or doubles every 128 claims and completions, and goes back
    /// up when batches thin out.
    ///
    /// Lease mode's completions are batched the same way (one `UPDATE … FROM unnest(…)`,
    /// each row checked by its own fencing token), on the connections a completion
    /// takes alone. Each batch of claims is sent on a pooled connection, checked out
    /// for it, so this works behind a transaction pooler too. Transactional mode,
    /// releases and renewals are sent as before. With shared claim connections
    /// ([`with_shared_claim_connections`](Self::with_shared_claim_connections)) asked
    /// for, and batching left as it is by default, claims take the shared connections
    /// and are not batched; with both set, in either order, claims go in batches and no
    /// shared claim connection is opened (a warning says so), so that a claim given up
    /// on is waited for, and released if it lands, as a batched claim is.
    ///
    /// `with_batched_claims(0, 1)` sends every claim and completion alone on a pooled
    /// connection, as before batching: for a comparison, or a database that should see
    /// one statement per request.
    ///
    /// ```no_run
    /// use tower_idempotency::store::PostgresStore;
    ///
    /// // Up to 4 batches in flight, up to 64 claims each.
    /// let store = PostgresStore::connect("postgres://postgres@127.0.0.1/postgres")?
    ///     .with_batched_claims(4, 64);
    /// // Batching off.
    /// let unbatched = PostgresStore::connect("postgres://postgres@127.0.0.1/postgres")?
    ///     .with_batched_claims(0, 1);
    /// # Ok::<(), tower_idempotency::store::ConfigError>(())
    /// ```
    #[must_use]
    pub fn with_batched_claims(self, connections: usize, max_claims: usize) -> Self {
        let options = Options {
            batching: Some((connections, max_claims.max(1))),
            ..self.options()
        };
        Self::build(self.pool, options)
    }

    /// How often this store deletes its expired rows in the background (default every
    /// 60 s, give or take a fifth; at least 10 ms); `None` turns it off.
    ///
    /// The purger starts with the store's first claim (a layer's or a `JobRunner`'s),
    /// runs on the runtime that made it, and ends with the last clone of the store. Each
    /// round deletes expired rows in batches of 1 000, one statement each (resting between
    /// batches as long as the last took, each bounded to 30 s), until a batch
    /// comes back short. Replicas take turns: a batch first tries an advisory lock of
    /// the table's own, held until it commits, and deletes nothing while another
    /// replica's batch holds it. Turn it off where something else purges the table
    /// (a cron job calling [`purge_expired`](Self::purge_expired), a partition drop).
    ///
    /// ```no_run
    /// use std::time::Duration;
    /// use tower_idempotency::store::PostgresStore;
    ///
    /// let store = PostgresStore::connect("postgres://postgres@127.0.0.1/postgres")?
    ///     .with_background_purge(Some(Duration::from_secs(300)));
    /// # Ok::<(), tower_idempotency::store::ConfigError>(())
    /// ```
    #[must_use]
    pub fn with_background_purge(self, every: Option<Duration>) -> Self {
        let options = Options {
            purge_every: every,
            ..self.options()
        };
        Self::build(self.pool, options)
    }

    /// Remembers a completed key for `window` once its response expired (its TTL, the
    /// layer's `ttl`, passed): the purge then drops the row's headers and body (the
    /// TTL's promise holds: no response outlives it in the table, past the purge's
    /// next round) and keeps its fingerprint, status and completion time, until
    /// `window` has passed, when it deletes the row. A retry in that window gets `410
    /// response-expired` and runs nothing. [`DEFAULT_REMEMBER`](crate::store::DEFAULT_REMEMBER)
    /// (7 days) by default; `Duration::ZERO` turns it off (a key is then forgotten with
    /// its response, as before). Every replica over one table should say the same.
    ///
    /// ```no_run
    /// use std::time::Duration;
    /// use tower_idempotency::store::PostgresStore;
    ///
    /// let store = PostgresStore::connect("postgres://postgres@127.0.0.1/postgres")?
    ///     .remember_keys_for(Duration::from_secs(30 * 24 * 3600));
    /// # Ok::<(), tower_idempotency::store::ConfigError>(())
    /// ```
    #[must_use]
    pub fn remember_keys_for(self, window: Duration) -> Self {
        let options = Options {
            remember: window.min(crate::settings::TEN_YEARS),
            ..self.options()
        };
        Self::build(self.pool, options)
    }

    /// How long a completed key is remembered once its response expired.
    pub fn remembers_keys_for(&self) -> Duration {
        self.sql.remember
    }

    /// Whether the store's pooled connections go through a transaction-pooling
    /// PgBouncer (`pool_mode = transaction`, as managed databases' poolers run; default
    /// `false`: connections of their own, or session pooling).
    ///
    /// Such a pooler lends a server session to a client for one transaction at a time,
    /// so nothing may outlive a transaction on it. With `true`, the store:
    ///
    /// - sends its statements unnamed, parsed with each execution in the same round trip
    ///   (a statement prepared in one transaction is missing, or another client's, in
    ///   the next); they cost the database a parse each (docs/benchmarks.md measures it);
    /// - turns shared claim connections
    ///   ([`with_shared_claim_connections`](Self::with_shared_claim_connections)) off:
    ///   they set `lock_timeout` for their session, which the pooler would hand on;
    /// - sends no cancel request for a statement it gives up on, and only closes its
    ///   connection: PgBouncer 1.18 (Debian 12's) can crash when a cancel request's
    ///   connection closes as soon as it is sent, taking every client's connections
    ///   with it. The statement then runs to its own bound.
    ///
    /// Also give [`with_notifications`](Self::with_notifications) a direct connection to
    /// the server, not the pooler: `LISTEN` needs a session of its own (without one,
    /// waiting duplicates look again every 250 ms). In transactional mode the handler's
    /// own statements must not be cached across requests either: use `query`/`execute`
    /// with the SQL text on the [`TransactionHandle`](crate::transactional::TransactionHandle)'s
    /// client (prepared and closed inside the transaction), never `prepare_cached`.
    ///
    /// Everything else the store does holds there: transactional mode's `SET LOCAL`,
    /// migrations in one transaction, the background purge's transaction-scoped lock.
    ///
    /// ```no_run
    /// use tower_idempotency::store::{PostgresStore, pool_for_url};
    ///
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let pooler = "postgres://app@pgbouncer.internal:6432/payments";
    /// let direct = "postgres://app@db.internal:5432/payments";
    /// let store = PostgresStore::new(pool_for_url(pooler, 16)?)
    ///     .with_transaction_pooling(true)
    ///     .with_notifications(direct.parse()?);
    /// # Ok(()) }
    /// ```
    #[must_use]
    pub fn with_transaction_pooling(self, pooling: bool) -> Self {
        let options = Options {
            transaction_pooling: pooling,
            ..self.options()
        };
        Self::build(self.pool, options)
    }

    /// Keeps the table in generations of `period`, and lets its expired rows go a
    /// generation at a time instead of row by row (default: off, one plain table
    /// purged in batches, [`with_background_purge`](Self::with_background_purge)). For
    /// tables of hundreds of millions of keys, where deleting them one by one costs
    /// more WAL and vacuum than the claims themselves.
    ///
    /// The table is then partitioned by a `generation` column, one partition per
    /// generation; new keys go to the newest. [`migrate`](Self::migrate) creates it so
    /// when it does not exist yet, and refuses a plain table of that name (see
    /// docs/postgres.md to move one). Every store over the table must be built with
    /// generations.
    ///
    /// The background purge, at its period, rotates instead of deleting: it starts a
    /// new generation once the newest is `period` old, and empties an older one
    /// (`TRUNCATE`) once none of its rows is live, neither unexpired nor running under a
    /// live lease; then it detaches and drops its partition. A row taken over or
    /// renewed stays in its generation and holds it until it expires. Emptying waits at
    /// most 50 ms for a lock of the partition, in which time claims queue behind it; a
    /// generation that a transaction keeps busy throughout is tried again next round.
    /// Choose `period` about the TTL: a generation goes about a TTL after it ends.
    ///
    /// A key stays unique across generations because the insert of a new key takes a
    /// transaction-scoped advisory lock of the key first and looks for it in every
    /// generation after (claims of existing keys, replays, completions are unchanged).
    /// That look must see what was committed before it: claims run under read
    /// committed (the default) or serializable; under repeatable read they fail as
    /// [`Misconfigured`](crate::store::StoreErrorKind::Misconfigured).
    ///
    /// ```no_run
    /// use std::time::Duration;
    /// use tower_idempotency::store::PostgresStore;
    ///
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// let store = PostgresStore::connect("postgres://postgres@127.0.0.1/postgres")?
    ///     .with_generations(Duration::from_secs(24 * 60 * 60));
    /// store.migrate().await?;
    /// # Ok(()) }
    /// ```
    #[must_use]
    pub fn with_generations(self, period: Duration) -> Self {
        let options = Options {
            generations: Some(period.min(crate::settings::TEN_YEARS)),
            ..self.options()
        };
        Self::build(self.pool, options)
    }

    /// Whether a running claim whose holder's process is gone is taken over as soon as
    /// PostgreSQL sees it gone, instead of when its lease lapses (default `true`, for a
    /// store with a notification connection: [`connect`](Self::connect) or
    /// [`with_notifications`](Self::with_notifications); without one, claims are judged
    /// by their lease alone, as with `false`).
    ///
    /// The store holds a session-level advisory lock of its own on a connection made
    /// with the notification connection's configuration (a direct one: never a
    /// transaction-pooling PgBouncer), and its lease-mode claims name it as their
    /// holder. A duplicate that finds a running claim takes it over, with the next
    /// fencing token as after a lapsed lease, once the holder's lock is free and the
    /// holder has shown no sign of life for a second: a process killed (`kill -9`, the
    /// OOM killer) frees its keys about a second after its connections close, not a
    /// lease later. A live holder is never taken over so, through a database restart,
    /// a failover, a stalled runtime or a lost liveness connection: docs/postgres.md,
    /// "Liveness", says why, and what it cannot see (a network partition, where the
    /// lease stays the bound, as without it). Transactional mode does not need it: a
    /// dead holder's transaction rolls back, and its key is free at once.
    ///
    /// It costs two more connections per store: one held, idle, with the lock, and one
    /// made by the pool's manager for the heartbeat once the store runs claims past
    /// 250 ms; a few reads on the path of a claim that finds its key running; and,
    /// while the store runs claims, a statement every 250 ms that renews its sign of
    /// life in an unlogged table (no WAL). A duplicate waiting for a running key
    /// ([`wait_for_running`](crate::IdempotencyLayer::wait_for_running)) looks again
    /// every second. [`migrate`](Self::migrate) creates what it needs (migration 0004).
    ///
    /// ```no_run
    /// use tower_idempotency::store::PostgresStore;
    ///
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// let store = PostgresStore::connect("postgres://postgres@127.0.0.1/postgres")?;
    /// store.migrate().await?;
    /// // Its lock held from the start, rather than from the first claim.
    /// store.start_liveness().await?;
    /// // Or, every key judged by its lease alone:
    /// let by_lease_alone = store.clone().with_liveness(false);
    /// # Ok(()) }
    /// ```
    #[must_use]
    pub fn with_liveness(self, on: bool) -> Self {
        let options = Options {
            liveness: on,
            ..self.options()
        };
        Self::build(self.pool, options)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identifiers_are_validated() {
        for ok in ["idempotency_keys", "a", "t_1", "_x"] {
            assert!(validate_identifier("table", ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "1abc",
            "Keys",
            "a-b",
            "a\"b",
            "a b",
            "x;drop table y",
            &"a".repeat(51),
        ] {
            assert!(validate_identifier("table", bad).is_err(), "{bad}");
        }
    }
}
