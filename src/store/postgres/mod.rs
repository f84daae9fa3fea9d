//! The PostgreSQL store: one table, single-row statements on its primary key.

mod generations;
mod hosts;
mod listener;
mod purge;
mod reserve;
mod shared;
mod sql;
mod tls;
mod tx;

use std::{
    fmt,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, SystemTime},
};

use bytes::Bytes;
use deadpool_postgres::{
    Client, ClientWrapper, Manager, ManagerConfig, Pool, PoolError, RecyclingMethod, Runtime,
};
use http::StatusCode;
use tokio_postgres::{
    NoTls, Row, Socket,
    error::SqlState,
    tls::{MakeTlsConnect, TlsConnect},
    types::ToSql,
};

pub use generations::GenerationRotation;
use listener::Listener;
use purge::BackgroundPurge;
use sha2::{Digest, Sha256};
use shared::{Opened, Shared};
use sql::{Statement, params};
use tls::Connector;
pub(crate) use tx::{
    Backend, Ending, Resolution, begin, commit_on, roll_back_keeping, roll_back_or_close,
};

use super::{
    BoxFuture, Claim, ClaimRequest, Fenced, FencingToken, Lease, Store, StoreError, StoreErrorKind,
};
use crate::{Fingerprint, Scope, StoredResponse};

/// The migrations, in order, embedded from `migrations/`.
const MIGRATIONS: &[(i32, &str)] = &[
    (
        1,
        include_str!("../../../migrations/0001_create_idempotency_keys.sql"),
    ),
    (2, include_str!("../../../migrations/0002_waiters.sql")),
    (3, include_str!("../../../migrations/0003_claim_insert.sql")),
];

/// An advisory lock id shared by every process migrating this crate's tables.
const MIGRATION_LOCK: i64 = 0x7469_6465_6d70_6f74; // "tidempot"

/// How long a migration waits to lock the table, and how many times it tries (see
/// `migrate`).
const MIGRATION_LOCK_TIMEOUT: Duration = Duration::from_secs(1);
const MIGRATION_ATTEMPTS: u32 = 3;

/// Why an attempt to migrate failed.
enum Migration {
    /// This migration could not lock the table within `MIGRATION_LOCK_TIMEOUT`.
    TableBusy(i32),
    Failed(StoreError),
}

impl From<StoreError> for Migration {
    fn from(e: StoreError) -> Self {
        Self::Failed(e)
    }
}

/// How long a statement waits for a connection from a pool that sets no wait timeout.
const POOL_WAIT: Duration = Duration::from_secs(5);

/// A connection from `pool`, waiting at most the pool's wait timeout, or `POOL_WAIT`
/// if it sets none (see `PostgresStore::client`).
async fn pooled(pool: &Pool) -> Result<Client, StoreError> {
    if pool.timeouts().wait.is_some() {
        return pool.get().await.map_err(classify_pool);
    }
    match tokio::time::timeout(POOL_WAIT, pool.get()).await {
        Ok(got) => got.map_err(classify_pool),
        Err(_) => Err(StoreError::new(
            StoreErrorKind::Timeout,
            "no connection from the pool within 5 s (the pool sets no wait timeout)",
        )),
    }
}

/// How long a cancel request for an abandoned statement may take (see `Checkout`).
const CANCEL_WAIT: Duration = Duration::from_secs(5);

/// A pooled connection that goes back to the pool only once its work is done
/// ([`done`](Self::done)). Dropped before that, it is closed instead, and what it may
/// still be running on the server cancelled: its caller gave up in the middle of a
/// statement (a timeout, a client gone), and a connection whose answer never came may
/// be dead without a word, its next user waiting behind that answer for as long as TCP
/// takes to give up; or a transaction was left open on it, which closing rolls back.
/// (Behind a transaction pooler, no cancel request is sent: `None`; see
/// `PostgresStore::with_transaction_pooling`.)
pub(crate) struct Checkout(Option<Client>, Option<Connector>);

impl Checkout {
    /// The work is done: the connection goes back to the pool.
    pub(crate) fn done(mut self) {
        drop(self.0.take());
    }
}

impl std::ops::Deref for Checkout {
    type Target = Client;

    fn deref(&self) -> &Client {
        match &self.0 {
            Some(conn) => conn,
            None => unreachable!("the connection leaves a Checkout only when it is done"),
        }
    }
}

impl Drop for Checkout {
    fn drop(&mut self) {
        if let Some(conn) = self.0.take() {
            // Out of the pool for good: it is closed, not handed to the next user.
            let conn = deadpool_postgres::Object::take(conn);
            // The server does not notice a closed connection while a statement waits
            // (on a lock, say): it is told to cancel it, or it would wait on, holding
            // a backend, for as long as the statement's own bound allows. Over the
            // store's TLS, if it has one (`PostgresStore::with_tls`). The connection is
            // closed once the cancel request has gone, not before: a PgBouncer (1.18)
            // that receives a cancel request for a client that has just gone can crash,
            // taking every client's connection with it.
            if let (Ok(runtime), Some(connector)) =
                (tokio::runtime::Handle::try_current(), self.1.take())
            {
                let cancel = conn.cancel_token();
                // Bounded: a server that stopped answering (a primary frozen or cut off
                // in a failover) would hold the request, and its socket, for ever.
                runtime.spawn(async move {
                    match tokio::time::timeout(CANCEL_WAIT, connector.cancel(cancel)).await {
                        Ok(Ok(())) => {}
                        Ok(Err(e)) => {
                            tracing::debug!(error = %e, "could not cancel an abandoned statement");
                        }
                        Err(_) => tracing::debug!(
                            "no answer to the cancel request of an abandoned statement"
                        ),
                    }
                    drop(conn);
                });
            }
        }
    }
}

/// How many times a claim is re-read when the row changes under it.
const CLAIM_ATTEMPTS: usize = 16;

/// When a claim in doubt is released, counted from the one before: at once, then again
/// in case the server was still running the claim when its connection went.
const IN_DOUBT_RELEASES: [Duration; 3] = [
    Duration::ZERO,
    Duration::from_secs(1),
    Duration::from_secs(5),
];

/// After those, while the lease holds, each gap three times the one before: a claim
/// that waited on the server (for a row lock, say) and whose cancel request could not
/// be sent lands late.
const IN_DOUBT_LATER: Duration = Duration::from_secs(15);

/// How soon a release in doubt that failed (the database still away) is tried again,
/// until the claim's lease would have lapsed.
const IN_DOUBT_RETRY: Duration = Duration::from_secs(1);

/// How long one attempt to release a claim in doubt may take: the pool may hand it a
/// connection as dead as the one that lost the claim (given up on, it is closed).
const IN_DOUBT_ATTEMPT: Duration = Duration::from_secs(5);

/// How long a claim on a pooled connection, given up on by its caller, is still waited
/// for (`Store::abandoned_claim_wait`): dropped unanswered, it closes its connection
/// and releases in doubt what may have landed (`InDoubt`), so a claim stuck on a dead
/// connection need not hold it for a lease.
const ABANDONED_CLAIM_WAIT: Duration = Duration::from_secs(5);

/// A claim on its way on a pooled connection. Dropped before its answer (its caller
/// gave up, and then stopped waiting), it closes the connection (and cancels what it
/// runs on the server: `Checkout`), after which the claim can land only from what the
/// server had already received; then it releases in doubt, by its token, what may
/// have landed.
struct InDoubt<'a> {
    store: &'a PostgresStore,
    request: &'a ClaimRequest<'a>,
    token: FencingToken,
    client: Option<Checkout>,
    /// The answer came, and it was not a lost connection.
    settled: bool,
}

impl InDoubt<'_> {
    fn client(&self) -> &Checkout {
        self.client
            .as_ref()
            .expect("the connection stays until the claim is settled")
    }

    /// The answer came: the connection goes back to the pool, and nothing is in
    /// doubt, unless the answer is that the connection was lost.
    fn settle(mut self, claimed: &Result<Claim, StoreError>) {
        if let Some(client) = self.client.take() {
            client.done();
        }
        self.settled = !matches!(claimed, Err(e) if lost_its_connection(e));
    }
}

impl Drop for InDoubt<'_> {
    fn drop(&mut self) {
        drop(self.client.take());
        if !self.settled {
            self.store.release_in_doubt(self.request, self.token);
        }
    }
}

/// The bound on the first wait after a serialization failure; it doubles with each
/// further loss, up to `RACE_BACKOFF_CAP`. Sixteen attempts wait 0.35 s at most in all,
/// well within a store timeout.
const RACE_BACKOFF_FIRST: Duration = Duration::from_millis(1);
const RACE_BACKOFF_CAP: Duration = Duration::from_millis(32);

/// The claim statement's columns, by position (`Sql::new` lists them in this order):
/// read by index, a replay does not search the columns by name ten times over.
mod col {
    pub(super) const TOKEN: usize = 0;
    pub(super) const FINGERPRINT: usize = 1;
    pub(super) const STATE: usize = 2;
    pub(super) const LOCKED_UNTIL: usize = 3;
    pub(super) const EXPIRES_AT: usize = 4;
    pub(super) const STATUS: usize = 5;
    pub(super) const HEADERS: usize = 6;
    pub(super) const BODY: usize = 7;
    pub(super) const NOW: usize = 8;
    pub(super) const CLAIMED: usize = 9;
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
/// | takeover of a lapsed lease | 2 (the claim, then a token-checked `UPDATE`) |
///
/// The statements of a running claim (its lease renewals, its completion, its release)
/// never queue for a connection behind the handlers' checkouts, which would let its
/// lease lapse under a live handler and a retry run the handler again: they take an
/// idle pooled connection if there is one, without waiting, and otherwise go over a
/// reserve of two connections that the store makes with the pool's manager, outside
/// its `max_size` (up to four while broken ones are replaced), and shares among them,
/// pipelined. Count them against the server's `max_connections`
/// ([`StoreMetrics::reserve_statements`] says how often they serve).
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
}

/// What a [`PostgresStore`] is built with besides its pool (see `PostgresStore::build`).
struct Options {
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
}

/// A rejected store setting.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError(String);

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ConfigError {}

struct Sql {
    claim: Statement,
    takeover: Statement,
    complete: Statement,
    release: Statement,
    renew: Statement,
    wait: Statement,
    in_doubt_wait: Statement,
    in_doubt_read: Statement,
    purge: Statement,
    purge_in_turn: Statement,
    /// Transactional mode's own.
    tx: tx::Statements,
    qualified: String,
    expires_index: String,
    migrations_table: String,
    claim_function: String,
    /// The names of a table in generations, if it is one (`with_generations`).
    generations: Option<generations::Names>,
}

impl Sql {
    fn new(schema: &str, table: &str, in_generations: bool) -> Self {
        let names = in_generations.then(|| generations::Names::new(schema, table));
        let t = format!("\"{schema}\".\"{table}\"");
        let claim_function = format!("\"{schema}\".\"{table}_claim\"");
        let ms = "$ms::bigint * interval '1 millisecond'";
        // The notification is delivered when, and only if, the change commits. The
        // TTL counts from this statement: in transactional mode `now()` would be the
        // transaction's start, before the handler ran.
        let complete = |only: &str| {
            format!(
                "WITH done AS (
                    UPDATE {t} SET state = 'completed', locked_until = NULL, status = $4,
                           headers = $5, body = $6, completed_at = statement_timestamp(),
                           expires_at = statement_timestamp() + {e}
                    WHERE scope = $1 AND key = $2 AND token = $3 AND state = 'running'{only}
                    RETURNING waiters)
                 SELECT CASE WHEN waiters THEN pg_notify($8, $9) END FROM done",
                e = ms.replace("$ms", "$7"),
            )
        };
        Self {
            // A primary-key read that inserts only when the key has no row: the insert
            // is a function (migration 0003) called from a branch that an existing key
            // never takes, so a replay, a 409 or a 422 costs PostgreSQL about what a plain
            // read does (0.9x its rate, docs/postgres.md). Two requests that both find
            // nothing race on the insert, and its `ON CONFLICT` settles it; the loser gets
            // neither a row nor a token and reads again (`claim_on`). Times are compared
            // in Rust against the database's `now()`, which is cheaper than numeric
            // arithmetic in SQL.
            // The columns are read by position: keep them in the order of `col`.
            claim: Statement::new(
                format!(
                    "SELECT f.token, f.fingerprint, f.state, f.locked_until, f.expires_at,
                            f.status, f.headers, f.body, now() AS now,
                            CASE WHEN f.token IS NULL THEN {claim_function}($1, $2, $3, $4, $5, $6) END AS claimed
                     FROM (VALUES (1)) AS one LEFT JOIN {t} AS f ON f.scope = $1 AND f.key = $2"
                ),
                params::CLAIM,
            ),
            // A record taken over after it completed starts with nobody waiting on it
            // (the old value of `state` is read): a lapsed running one keeps its waiters.
            takeover: Statement::new(
                format!(
                    "UPDATE {t} SET token = token + 1, state = 'running', fingerprint = $4,
                            locked_until = now() + {l}, expires_at = now() + {e}, created_at = now(),
                            completed_at = NULL, status = NULL, headers = NULL, body = NULL,
                            waiters = (state = 'running' AND waiters)
                     WHERE scope = $1 AND key = $2 AND token = $3
                       AND (state = 'completed' OR locked_until <= now())
                       AND (expires_at <= now() OR (state = 'running' AND fingerprint = $4))
                     RETURNING token",
                    l = ms.replace("$ms", "$5"),
                    e = ms.replace("$ms", "$6"),
                ),
                params::TAKEOVER,
            ),
            complete: Statement::new(complete(""), params::COMPLETE),
            tx: tx::Statements::new(
                &t,
                Statement::new(complete(tx::WRITTEN_BY_THIS_TRANSACTION), params::COMPLETE),
                names.as_ref().map(|n| n.insert_completed_function.as_str()),
            ),
            release: Statement::new(
                format!(
                    "WITH done AS (
                        DELETE FROM {t} WHERE scope = $1 AND key = $2 AND token = $3 AND state = 'running'
                        RETURNING waiters)
                     SELECT CASE WHEN waiters THEN pg_notify($4, $5) END FROM done"
                ),
                params::RELEASE,
            ),
            renew: Statement::new(
                format!(
                    "UPDATE {t} SET locked_until = now() + {l}, expires_at = greatest(expires_at, now() + {l})
                     WHERE scope = $1 AND key = $2 AND token = $3 AND state = 'running'",
                    l = ms.replace("$ms", "$4"),
                ),
                params::RENEW,
            ),
            // Whether the key is still running, setting its `waiters` flag only where it
            // is not set yet: a retry storm on one key re-registers on every turn, and a
            // write each time would take the row lock and make a new row version each
            // time. A flag already set is read, not written (the outer read sees the
            // row as it was before the update, which never touches such a row).
            wait: Statement::new(
                format!(
                    "WITH flagged AS (
                        UPDATE {t} SET waiters = true
                        WHERE scope = $1 AND key = $2 AND state = 'running' AND NOT waiters
                        RETURNING 1)
                     SELECT EXISTS (SELECT 1 FROM flagged)
                         OR EXISTS (SELECT 1 FROM {t}
                                    WHERE scope = $1 AND key = $2 AND state = 'running' AND waiters)"
                ),
                params::KEY,
            ),
            // For a COMMIT in doubt (`committed_on`): an insert of the key, rolled back
            // after, waits for a transaction still inserting or updating its row (the
            // unique check waits on it); the read, in a snapshot taken after, sees how
            // that transaction ended. Not `FOR SHARE`: that would wait for a duplicate
            // that took the row since, through its whole handler.
            // In generations, the insert waits only for a transaction that inserted the
            // key (it holds the key's lock); one that took an existing row over is
            // waited for by locking that row, after.
            in_doubt_wait: Statement::new(
                if in_generations {
                    format!(
                        "SELECT {claim_function}($1, $2, $3, 1, 1, 0),
                                (SELECT count(*) FROM (SELECT 1 FROM {t} WHERE scope = $1 AND key = $2
                                                       FOR NO KEY UPDATE) AS held)"
                    )
                } else {
                    format!("SELECT {claim_function}($1, $2, $3, 1, 1, 0)")
                },
                params::KEY_AND_FINGERPRINT,
            ),
            in_doubt_read: Statement::new(
                format!(
                    "SELECT token, state, fingerprint, status, headers, body, created_at FROM {t}
                     WHERE scope = $1 AND key = $2"
                ),
                params::KEY,
            ),
            // The outer condition repeats the inner one: a ctid names a row only within
            // one table, so on a partitioned table it could name a live row elsewhere.
            purge: Statement::new(
                format!(
                    "DELETE FROM {t} WHERE ctid = ANY(ARRAY(
                        SELECT ctid FROM {t}
                        WHERE expires_at <= now() AND (state = 'completed' OR locked_until <= now())
                        LIMIT $1 FOR UPDATE SKIP LOCKED))
                     AND expires_at <= now() AND (state = 'completed' OR locked_until <= now())"
                ),
                params::PURGE,
            ),
            // The background purge's batch: the same, in this replica's turn only (an
            // advisory lock of the table's own, `$2`, tried once per statement and held
            // until it commits; another replica's batch holding it deletes nothing).
            purge_in_turn: Statement::new(
                format!(
                    "DELETE FROM {t} WHERE ctid = ANY(ARRAY(
                        SELECT ctid FROM {t}
                        WHERE (SELECT pg_try_advisory_xact_lock($2))
                          AND expires_at <= now() AND (state = 'completed' OR locked_until <= now())
                        LIMIT $1 FOR UPDATE SKIP LOCKED))
                     AND expires_at <= now() AND (state = 'completed' OR locked_until <= now())"
                ),
                params::PURGE_IN_TURN,
            ),
            migrations_table: format!("\"{schema}\".\"{table}_migrations\""),
            claim_function,
            expires_index: format!("\"{table}_expires_at\""),
            qualified: t,
            generations: names,
        }
    }
}

impl fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresStore")
            .field("table", &self.sql.qualified)
            .finish_non_exhaustive()
    }
}

/// The database a store's table is in, as far as the store can tell: the hosts, ports
/// and database name of its notification connection's configuration (the URL given to
/// `connect`, or to `with_notifications`), else its pool (whose manager lives as long
/// as the pool, at one address). Two stores over one table of one database, with pools
/// of their own, claim the same keys.
fn database(config: Option<&tokio_postgres::Config>, pool: &Pool) -> String {
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
fn validate_identifier(what: &str, name: &str) -> Result<(), ConfigError> {
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

/// What is left of a lease at the database's `now`, rounded up to the millisecond.
fn lease_left(locked_until: Option<SystemTime>, now: SystemTime) -> Duration {
    let left = locked_until
        .and_then(|until| until.duration_since(now).ok())
        .unwrap_or_default();
    Duration::from_millis(u64::try_from(left.as_nanos().div_ceil(1_000_000)).unwrap_or(u64::MAX))
}

/// Milliseconds for SQL, at most ten years (as the layer's settings): PostgreSQL's
/// timestamps end in 294276 AD, and `now()` plus more fails the statement.
fn ms(d: Duration) -> i64 {
    i64::try_from(d.min(crate::settings::TEN_YEARS).as_millis()).unwrap_or(i64::MAX)
}

/// Classifies a database error by its SQLSTATE, never by its message.
fn classify(e: tokio_postgres::Error) -> StoreError {
    let kind = match e.code() {
        None => StoreErrorKind::Unavailable,
        Some(code) if code.code().starts_with("08") => StoreErrorKind::Unavailable,
        Some(code) => match *code {
            SqlState::ADMIN_SHUTDOWN
            | SqlState::CRASH_SHUTDOWN
            | SqlState::CANNOT_CONNECT_NOW
            | SqlState::TOO_MANY_CONNECTIONS
            | SqlState::T_R_SERIALIZATION_FAILURE
            | SqlState::T_R_DEADLOCK_DETECTED
            | SqlState::READ_ONLY_SQL_TRANSACTION => StoreErrorKind::Unavailable,
            SqlState::QUERY_CANCELED | SqlState::LOCK_NOT_AVAILABLE => StoreErrorKind::Timeout,
            SqlState::UNDEFINED_TABLE
            | SqlState::UNDEFINED_COLUMN
            | SqlState::UNDEFINED_FUNCTION
            | SqlState::INVALID_SCHEMA_NAME
            | SqlState::INSUFFICIENT_PRIVILEGE
            // A table in generations claimed under repeatable read.
            | SqlState::FEATURE_NOT_SUPPORTED => StoreErrorKind::Misconfigured,
            _ => StoreErrorKind::Other,
        },
    };
    StoreError::new(kind, e)
}

fn classify_pool(e: PoolError) -> StoreError {
    match e {
        PoolError::Backend(e) => classify(e),
        PoolError::Timeout(_) => StoreError::new(StoreErrorKind::Timeout, e),
        PoolError::NoRuntimeSpecified => StoreError::new(StoreErrorKind::Misconfigured, e),
        _ => StoreError::new(StoreErrorKind::Unavailable, e),
    }
}

/// The SQLSTATE of the database error behind `e`, if there is one.
fn sqlstate(e: &StoreError) -> Option<&SqlState> {
    e.source
        .downcast_ref::<tokio_postgres::Error>()
        .and_then(tokio_postgres::Error::code)
}

/// Whether `e` is a statement refused because an earlier one failed in its transaction
/// (which PostgreSQL has then aborted: its `COMMIT` rolls back).
pub(crate) fn in_an_aborted_transaction(e: &StoreError) -> bool {
    sqlstate(e) == Some(&SqlState::IN_FAILED_SQL_TRANSACTION)
}

/// Whether `e` is PostgreSQL cancelling the statement (`statement_timeout`, or a
/// cancel request): a slow database, not a row held by another request.
pub(crate) fn statement_cancelled(e: &StoreError) -> bool {
    sqlstate(e) == Some(&SqlState::QUERY_CANCELED)
}

/// Whether `e` is PostgreSQL giving up on a row lock (`lock_timeout`).
fn waited_for_a_lock(e: &StoreError) -> bool {
    sqlstate(e) == Some(&SqlState::LOCK_NOT_AVAILABLE)
}

/// Whether `e` is a serialization failure: where transactions default to repeatable read
/// or serializable, a statement that meets a row committed after its snapshot (the key
/// inserted by a concurrent claim, the row changed by a concurrent takeover) fails so
/// rather than seeing it. A statement with a snapshot of its own can look again.
fn lost_a_race(e: &StoreError) -> bool {
    sqlstate(e) == Some(&SqlState::T_R_SERIALIZATION_FAILURE)
}

/// Runs `statement` again while it loses a race under repeatable read or serializable,
/// up to `CLAIM_ATTEMPTS` times in all. Each attempt must take a snapshot of its own:
/// one autocommit statement, or a transaction begun anew.
///
/// Under serializable, the statements that lost are the ones still running when another
/// committed, and they all run again together: at once, they would meet each other again,
/// and a burst of completions could lose sixteen times in a row. So each one waits a
/// random time first, up to a bound that doubles with every loss (`race_backoff`).
pub(crate) async fn again_if_it_lost_a_race<T, Fut>(
    mut statement: impl FnMut() -> Fut,
) -> Result<T, StoreError>
where
    Fut: Future<Output = Result<T, StoreError>>,
{
    let mut attempts = 1;
    loop {
        match statement().await {
            Err(e) if lost_a_race(&e) && attempts < CLAIM_ATTEMPTS => {
                tokio::time::sleep(race_backoff(attempts, crate::random::u64())).await;
                attempts += 1;
            }
            done => return done,
        }
    }
}

/// The wait before running a statement again after its `losses`-th serialization
/// failure: `random` scaled into `0..=bound`, where the bound starts at 1 ms and
/// doubles with each loss up to `RACE_BACKOFF_CAP` ("full jitter": the statements that
/// lost together spread out instead of meeting again).
fn race_backoff(losses: usize, random: u64) -> Duration {
    let bound = RACE_BACKOFF_FIRST
        .saturating_mul(1 << (losses - 1).min(16))
        .min(RACE_BACKOFF_CAP);
    let micros = u64::try_from(bound.as_micros()).unwrap_or(u64::MAX);
    Duration::from_micros(random % (micros + 1))
}

/// Whether `e` ended its connection ([`connection_lost`]).
fn lost_its_connection(e: &StoreError) -> bool {
    e.source
        .downcast_ref::<tokio_postgres::Error>()
        .is_some_and(connection_lost)
}

/// Whether `e` ended the connection: an I/O error or a closed connection (no
/// SQLSTATE), a connection exception (class `08`), or the server shutting the session
/// down.
pub(crate) fn connection_lost(e: &tokio_postgres::Error) -> bool {
    match e.code() {
        None => true,
        Some(code) => {
            code.code().starts_with("08")
                || [
                    SqlState::ADMIN_SHUTDOWN,
                    SqlState::CRASH_SHUTDOWN,
                    SqlState::CANNOT_CONNECT_NOW,
                ]
                .contains(code)
        }
    }
}

fn corrupt(what: &str) -> StoreError {
    StoreError::new(StoreErrorKind::Corrupt, what.to_owned())
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
            },
        )
    }

    /// A store over a new pool for `url` (16 connections; 5 s to connect or wait for
    /// one), listening for completions on a connection of its own.
    pub fn connect(url: &str) -> Result<Self, ConfigError> {
        Ok(Self::new(pool_for_url(url, 16)?).with_notifications(parse_url(url)?))
    }

    /// [`connect`](Self::connect) over TLS: a pool for `url` whose connections use
    /// `tls`, and the store's own connections (the `LISTEN` connection, the cancel
    /// requests) too, as [`with_tls`](Self::with_tls) sets. Ask for TLS in the URL
    /// (`sslmode=require`), or the driver falls back to plain TCP where the server
    /// offers no TLS.
    ///
    /// ```no_run
    /// use tower_idempotency::store::PostgresStore;
    ///
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let mut roots = rustls::RootCertStore::empty();
    /// // roots.add(…): the certificate of the CA that signed the database's
    /// let config = rustls::ClientConfig::builder()
    ///     .with_root_certificates(roots)
    ///     .with_no_client_auth();
    /// let tls = tokio_postgres_rustls::MakeRustlsConnect::new(config);
    /// let store = PostgresStore::connect_with_tls(
    ///     "postgres://app@db.internal/payments?sslmode=require",
    ///     tls,
    /// )?;
    /// # Ok(()) }
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
    fn options(&self) -> Options {
        Options {
            schema: self.schema.clone(),
            table: self.table.clone(),
            listen_config: self.listen_config.clone(),
            connector: self.connector.clone(),
            shared: self.shared.as_ref().map_or(0, |s| s.len()),
            purge_every: self.purge.every(),
            transaction_pooling: self.transaction_pooling,
            generations: self.purge.generations(),
        }
    }

    /// A store over `pool` with `options`: every setting at once, so that a builder
    /// method that changes one keeps the others.
    fn build(pool: Pool, options: Options) -> Self {
        let Options {
            schema,
            table,
            listen_config,
            connector,
            shared,
            purge_every,
            transaction_pooling,
            generations,
        } = options;
        // A shared claim connection sets `lock_timeout` for its session, which a
        // transaction pooler would hand to other clients' transactions.
        let shared = if !transaction_pooling || shared == 0 {
            shared
        } else {
            tracing::warn!(
                "shared claim connections are off behind a transaction pooler: their session setting would leak to other clients"
            );
            0
        };
        let channel = format!("{table}_done");
        let tx_claims = Arc::new(tokio::sync::Semaphore::new(
            (pool.status().max_size / 2).max(1),
        ));
        let sql = Sql::new(&schema, &table, generations.is_some());
        let location = Arc::from(format!(
            "{} {}",
            database(listen_config.as_ref(), &pool),
            sql.qualified
        ));
        let purge = Arc::new(BackgroundPurge::new(
            purge_every,
            pool.clone(),
            (!transaction_pooling).then(|| connector.clone()),
            sql.purge_in_turn.clone(),
            !transaction_pooling,
            purge::lock_id(&sql.qualified),
            generations
                .zip(sql.generations.clone())
                .map(|(period, names)| generations::Rotator::new(period, names)),
        ));
        Self {
            location,
            purge,
            transaction_pooling,
            tx_claims,
            sql: Arc::new(sql),
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
            reserve: Arc::new(Shared::new(reserve::RESERVE, Opened::Reserve)),
        }
    }

    /// Uses the schema `name` (created by [`migrate`](Self::migrate) if absent).
    pub fn with_schema_name(self, name: &str) -> Result<Self, ConfigError> {
        validate_identifier("schema", name)?;
        let options = Options {
            schema: name.to_owned(),
            ..self.options()
        };
        Ok(Self::build(self.pool, options))
    }

    /// Uses the table `name`.
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
    /// ```no_run
    /// use tower_idempotency::store::PostgresStore;
    ///
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let roots = rustls::RootCertStore::empty();
    /// let url = "postgres://app@db.internal/payments?sslmode=require";
    /// let config = rustls::ClientConfig::builder()
    ///     .with_root_certificates(roots)
    ///     .with_no_client_auth();
    /// let tls = tokio_postgres_rustls::MakeRustlsConnect::new(config);
    /// let config: tokio_postgres::Config = url.parse()?;
    /// let manager = deadpool_postgres::Manager::new(config.clone(), tls.clone());
    /// let pool = deadpool_postgres::Pool::builder(manager).max_size(16).build()?;
    /// let store = PostgresStore::new(pool)
    ///     .with_notifications(config)
    ///     .with_tls(tls);
    /// # Ok(()) }
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
        }
    }

    /// Starts the `LISTEN` connection and waits (up to 5 s) until it listens, so that
    /// the first waiters are woken by notifications rather than by the fallback timer.
    /// Call it at start-up when waiting for running requests is on; without it, the
    /// listener starts with the first waiter.
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

    /// The id a key's notifications carry: unique per table, scope and key, and free of
    /// anything the client sent.
    fn key_id(&self, scope: &Scope, key: &str) -> String {
        let mut h = Sha256::new();
        for part in [self.sql.qualified.as_str(), scope.as_str(), key] {
            h.update((part.len() as u64).to_be_bytes());
            h.update(part.as_bytes());
        }
        crate::hex::encode(&h.finalize()[..16])
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

    /// Creates the schema and table and applies pending migrations.
    ///
    /// Safe to run from several processes at once: migrations are serialised by a
    /// transaction-scoped advisory lock, in a read committed transaction whatever the
    /// database's default isolation and timeouts, and recorded in `<table>_migrations`.
    /// Once everything is applied it only reads that record, so a role that may not
    /// create objects can run it (docs/postgres.md lists the grants).
    ///
    /// A migration that must lock the table waits at most 1 s for it (`lock_timeout`),
    /// well within the claims' store timeout, and is tried three times, a second or two
    /// apart; then it fails with a [`Timeout`](crate::store::StoreErrorKind::Timeout)
    /// that says so, and applies nothing. Waiting on behind a long transaction on the
    /// table, it would hold up every claim queued behind its lock request. Run it again
    /// when the table is quiet.
    pub async fn migrate(&self) -> Result<(), StoreError> {
        let mut attempt = 1;
        loop {
            match self.migrate_once().await {
                Err(Migration::TableBusy(version)) if attempt < MIGRATION_ATTEMPTS => {
                    tracing::warn!(
                        version,
                        table = %self.sql.qualified,
                        "a migration could not lock the table; trying again"
                    );
                    attempt += 1;
                    let wait = 1000 + crate::random::u64() % 1000;
                    tokio::time::sleep(Duration::from_millis(wait)).await;
                }
                Err(Migration::TableBusy(version)) => {
                    return Err(StoreError::new(
                        StoreErrorKind::Timeout,
                        format!(
                            "migration {version} could not lock {} within {} ms, {MIGRATION_ATTEMPTS} times: a long transaction holds the table; nothing was applied, run migrate() again when the table is quiet",
                            self.sql.qualified,
                            MIGRATION_LOCK_TIMEOUT.as_millis()
                        ),
                    ));
                }
                Err(Migration::Failed(e)) => return Err(e),
                Ok(()) => return Ok(()),
            }
        }
    }

    /// Whether the table exists and `<table>_migrations` records every migration: then
    /// `migrate` has nothing to do, and needs no privilege beyond reading the record (an
    /// app role that may not create objects, its tables made by an owner role).
    async fn migrated(
        &self,
        client: &impl deadpool_postgres::GenericClient,
    ) -> Result<bool, StoreError> {
        let found = client
            .query_one(
                "SELECT to_regclass($1) IS NOT NULL, to_regclass($2) IS NOT NULL",
                &[&self.sql.qualified, &self.sql.migrations_table],
            )
            .await
            .map_err(classify)?;
        let (table, record): (bool, bool) = (found.get(0), found.get(1));
        if !(table && record) {
            return Ok(false);
        }
        let applied = self.applied(client).await?;
        Ok(MIGRATIONS.iter().all(|(v, _)| applied.contains(v))
            && (self.sql.generations.is_none() || applied.contains(&generations::VERSION)))
    }

    /// The versions `<table>_migrations` records.
    async fn applied(
        &self,
        client: &impl deadpool_postgres::GenericClient,
    ) -> Result<Vec<i32>, StoreError> {
        let sql = format!("SELECT version FROM {}", self.sql.migrations_table);
        let rows = client.query(&sql, &[]).await.map_err(classify)?;
        Ok(rows.iter().map(|r| r.get(0)).collect())
    }

    /// One attempt of [`migrate`](Self::migrate), in one transaction.
    async fn migrate_once(&self) -> Result<(), Migration> {
        let mut client = pooled(&self.pool).await?;
        // Everything in one transaction, the check too: its statements, prepared and
        // closed inside it, stay on one server session behind a transaction pooler.
        // Read committed whatever the database's default: a replica that waited on the
        // lock must see the versions the one before it applied. Under repeatable read or
        // serializable its snapshot, taken before the wait, would not, and it would apply
        // them again and fail on their rows.
        let tx = client
            .build_transaction()
            .isolation_level(tokio_postgres::IsolationLevel::ReadCommitted)
            .start()
            .await
            .map_err(classify)?;
        if self.migrated(&tx).await? {
            return Ok(tx.commit().await.map_err(classify)?);
        }
        // A lock_timeout, statement_timeout or (PostgreSQL 17) transaction_timeout of the
        // role or database would end the wait for another replica's migrations, which
        // may take as long as they take. Only the settings this server has are set.
        // `IF NOT EXISTS` on what exists (a schema made by hand, what another replica
        // just made) draws a notice, which tokio-postgres logs at `info`: expected, so
        // not sent.
        tx.batch_execute(
            "SET LOCAL client_min_messages = warning;
             SELECT set_config(name, '0', true) FROM pg_settings
             WHERE name IN ('lock_timeout', 'statement_timeout', 'transaction_timeout')",
        )
        .await
        .map_err(classify)?;
        tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK])
            .await
            .map_err(classify)?;
        tx.batch_execute(&format!(
            "CREATE SCHEMA IF NOT EXISTS \"{}\";
             CREATE TABLE IF NOT EXISTS {} (
                 version integer PRIMARY KEY,
                 applied_at timestamptz NOT NULL DEFAULT now())",
            self.schema, self.sql.migrations_table
        ))
        .await
        .map_err(classify)?;
        let applied = self.applied(&tx).await?;
        // Recorded, but gone (dropped by hand): the migrations cannot be applied again
        // over what they left (its function, say) without knowing what is left.
        let table: bool = tx
            .query_one("SELECT to_regclass($1) IS NOT NULL", &[&self.sql.qualified])
            .await
            .map_err(classify)?
            .get(0);
        if !applied.is_empty() && !table {
            return Err(Migration::Failed(StoreError::new(
                StoreErrorKind::Misconfigured,
                format!(
                    "{} is missing, but {} records migrations {applied:?}: it was dropped by hand; drop {} too, and {} (its function), then run migrate() again to create them afresh",
                    self.sql.qualified,
                    self.sql.migrations_table,
                    self.sql.migrations_table,
                    self.sql.claim_function,
                ),
            )));
        }
        // Set once the advisory lock is held, for the migrations alone: replicas wait
        // for each other's migrations as long as they take, but none waits long on the
        // table itself.
        tx.batch_execute(&format!(
            "SET LOCAL lock_timeout = {}",
            MIGRATION_LOCK_TIMEOUT.as_millis()
        ))
        .await
        .map_err(classify)?;
        self.create_generations_if_absent(&tx).await?;
        for (version, sql) in MIGRATIONS {
            if applied.contains(version) {
                continue;
            }
            let sql = sql
                .replace("{{table}}", &self.sql.qualified)
                .replace("{{expires_index}}", &self.sql.expires_index)
                .replace("{{claim_function}}", &self.sql.claim_function);
            tx.batch_execute(&sql).await.map_err(|e| {
                if e.code() == Some(&SqlState::LOCK_NOT_AVAILABLE) {
                    Migration::TableBusy(*version)
                } else {
                    Migration::Failed(classify(e))
                }
            })?;
            tx.execute(
                &format!(
                    "INSERT INTO {} (version) VALUES ($1)",
                    self.sql.migrations_table
                ),
                &[version],
            )
            .await
            .map_err(classify)?;
        }
        self.migrate_generations(&tx, &applied).await?;
        Ok(tx.commit().await.map_err(classify)?)
    }

    /// Deletes up to `batch` expired records; returns how many. Run it in a loop (or on
    /// a timer) until it returns less than `batch`. Rows locked by a concurrent purge are
    /// skipped, so several purgers never wait on each other; a row is deleted only if
    /// it is still expired then. Runs again after a serialization failure. A `batch`
    /// below 1 is taken as 1 (a loop over it then runs until it returns 0), where it
    /// deleted nothing (0) or failed (a negative batch).
    pub async fn purge_expired(&self, batch: i64) -> Result<u64, StoreError> {
        let batch = batch.max(1);
        // Under repeatable read or serializable, locking a row changed since the
        // statement's snapshot (a takeover of an expired key) fails: look again.
        self.execute_pooled(&self.sql.purge, &[&batch]).await
    }

    /// A permit to hold a connection for a transactional claim (see `tx_claims`).
    pub(crate) async fn tx_claim_permit(&self) -> tokio::sync::OwnedSemaphorePermit {
        match self.tx_claims.clone().acquire_owned().await {
            Ok(permit) => permit,
            // The semaphore is never closed.
            Err(_) => unreachable!("the claim semaphore is never closed"),
        }
    }

    /// A pooled connection. A pool with no wait timeout of its own (deadpool's default)
    /// gets one of `POOL_WAIT`, as the pools of `pool_for_url` have: a claim whose caller
    /// gave up on it is finished in a task of its own, and under overload such tasks
    /// would otherwise queue for a connection without end, ahead of new requests.
    pub(crate) async fn client(&self) -> Result<Checkout, StoreError> {
        pooled(&self.pool).await.map(|conn| self.checkout(conn))
    }

    /// `conn`, checked out of the pool (see `Checkout`).
    fn checkout(&self, conn: Client) -> Checkout {
        Checkout(Some(conn), self.canceller())
    }

    /// Runs `sql` on a pooled connection, again after a lost race, then gives the
    /// connection back (given up on midway, it is closed instead: `Checkout`).
    async fn execute_pooled(
        &self,
        sql: &Statement,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<u64, StoreError> {
        let client = self.client().await?;
        let done = again_if_it_lost_a_race(|| self.execute_on(&client, sql, params)).await;
        client.done();
        done
    }

    /// [`execute_pooled`](Self::execute_pooled) for a statement that returns rows.
    async fn query_pooled(
        &self,
        sql: &Statement,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<Row>, StoreError> {
        let client = self.client().await?;
        let rows = again_if_it_lost_a_race(|| self.query_on(&client, sql, params)).await;
        client.done();
        rows
    }

    /// How a connection given up on in the middle of a statement has it cancelled: over
    /// the store's TLS, and not at all behind a transaction pooler (see `Checkout`).
    fn canceller(&self) -> Option<Connector> {
        (!self.transaction_pooling).then(|| self.connector.clone())
    }

    /// Runs `sql` on `client`: prepared once per connection, or, behind a transaction
    /// pooler ([`with_transaction_pooling`](Self::with_transaction_pooling)), unnamed,
    /// parsed in the same round trip as it runs.
    async fn query_on(
        &self,
        client: &ClientWrapper,
        sql: &Statement,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<Row>, StoreError> {
        if self.transaction_pooling {
            self.statements.fetch_add(1, Ordering::Relaxed);
            let typed = sql::typed(sql, params);
            return client.query_typed(sql, &typed).await.map_err(classify);
        }
        let stmt = client.prepare_cached(sql).await.map_err(classify)?;
        self.statements.fetch_add(1, Ordering::Relaxed);
        client.query(&stmt, params).await.map_err(classify)
    }

    /// [`query_on`](Self::query_on) for a statement whose rows are not read: how many
    /// it changed.
    async fn execute_on(
        &self,
        client: &ClientWrapper,
        sql: &Statement,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<u64, StoreError> {
        if self.transaction_pooling {
            self.statements.fetch_add(1, Ordering::Relaxed);
            let typed = sql::typed(sql, params);
            return client.execute_typed(sql, &typed).await.map_err(classify);
        }
        let stmt = client.prepare_cached(sql).await.map_err(classify)?;
        self.statements.fetch_add(1, Ordering::Relaxed);
        client.execute(&stmt, params).await.map_err(classify)
    }

    /// Prepares `sql` on `client` (a no-op once cached, and behind a transaction
    /// pooler), so that its execution can be pipelined behind another's.
    async fn prepare_on(&self, client: &ClientWrapper, sql: &Statement) -> Result<(), StoreError> {
        if self.transaction_pooling {
            return Ok(());
        }
        client.prepare_cached(sql).await.map(drop).map_err(classify)
    }

    /// Claims on a shared connection if there is one with room, else on a pooled one.
    /// A claim whose connection is lost once its statement was sent is released in doubt.
    async fn claim_with(
        &self,
        request: &ClaimRequest<'_>,
        token: FencingToken,
    ) -> Result<Claim, StoreError> {
        if let Some(shared) = &self.shared
            && let Some(mut client) = shared.get(&self.pool).await?
        {
            let claimed = {
                let mut claiming = std::pin::pin!(again_if_it_lost_a_race(|| {
                    self.claim_on(&client, request, token)
                }));
                match tokio::time::timeout(shared::STALLED, claiming.as_mut()).await {
                    Ok(claimed) => claimed,
                    Err(_) => {
                        // The next claims go to another connection; this one waits on
                        // (its caller's own bound answers its client).
                        shared.evict(&client);
                        claiming.await
                    }
                }
            };
            client.answered();
            match claimed {
                Err(e) if waited_for_a_lock(&e) => shared.moved_off(),
                Err(e) => {
                    if lost_its_connection(&e) {
                        shared.evict(&client);
                        self.release_in_doubt(request, token);
                    }
                    return Err(e);
                }
                claimed => return claimed,
            }
        }
        let claiming = InDoubt {
            store: self,
            request,
            token,
            client: Some(self.client().await?),
            settled: false,
        };
        let claimed =
            again_if_it_lost_a_race(|| self.claim_on(claiming.client(), request, token)).await;
        claiming.settle(&claimed);
        claimed
    }

    /// A claim whose connection was lost before its answer came may have committed: its
    /// row would hold the key as running, with nobody to run or release it, and every
    /// retry would get 409 until the lease lapsed. The row of a fresh claim carries the
    /// token sent with it, so it is released by that token, on another connection, in
    /// a task of its own; if the claim did not commit, nothing matches. The server may
    /// still have been running the claim when the connection went (on a lock, or a
    /// commit waiting for a synchronous standby), so the release is tried again a
    /// moment later, and later again. (A takeover in doubt took the old row's token plus
    /// one, unknown here: it lapses with its lease.)
    fn release_in_doubt(&self, request: &ClaimRequest<'_>, token: FencingToken) {
        use tracing::Instrument;
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let store = self.clone();
        let lease = Lease {
            scope: request.scope.clone(),
            key: Arc::from(request.key),
            token,
        };
        // Past the lease, the row frees itself: no release is worth trying then.
        let lapses = tokio::time::Instant::now() + request.lease.min(crate::settings::TEN_YEARS);
        runtime.spawn(
            async move {
                let mut schedule = IN_DOUBT_RELEASES.into_iter().chain(std::iter::successors(
                    Some(IN_DOUBT_LATER),
                    |gap| gap.checked_mul(3),
                ));
                let mut next = schedule.next();
                while let Some(wait) = next {
                    tokio::time::sleep(wait).await;
                    let released = tokio::time::timeout(IN_DOUBT_ATTEMPT, store.release(&lease))
                        .await
                        .unwrap_or_else(|_| {
                            Err(StoreError::new(
                                StoreErrorKind::Timeout,
                                "no answer to the release of a claim in doubt",
                            ))
                        });
                    match released {
                        Ok(Fenced::Kept) => {
                            tracing::warn!(
                                token = %token,
                                "a claim whose answer was lost had committed; released it"
                            );
                            return;
                        }
                        // Past the lease, the row frees itself.
                        Ok(Fenced::LeaseLost) => {
                            next = schedule
                                .next()
                                .filter(|gap| tokio::time::Instant::now() + *gap < lapses);
                        }
                        // The database that lost the answer is often still away (a
                        // crash, a failover): try again until it is back.
                        Err(e) if tokio::time::Instant::now() + IN_DOUBT_RETRY < lapses => {
                            tracing::debug!(token = %token, error = %e, "could not release a claim in doubt yet");
                            next = Some(IN_DOUBT_RETRY);
                        }
                        Err(e) => {
                            tracing::warn!(
                                token = %token,
                                error = %e,
                                "a claim whose answer was lost may have committed and could not be released; it frees when its lease lapses"
                            );
                            return;
                        }
                    }
                }
            }
            .in_current_span(),
        );
    }

    /// Claims on `client`, which may be inside a transaction (a conflicting row that
    /// another transaction has not committed yet is then waited for). A fresh row gets
    /// `token`; the caller keeps it to release a claim in doubt.
    pub(crate) async fn claim_on(
        &self,
        client: &ClientWrapper,
        req: &ClaimRequest<'_>,
        token: FencingToken,
    ) -> Result<Claim, StoreError> {
        self.claim_at(client, req, token)
            .await
            .map(|(claim, _)| claim)
    }

    /// [`claim_on`](Self::claim_on), with the database's `now()` as the claim read it:
    /// inside a transaction, the time it started, which a claim row inserted or taken
    /// over in it carries as `created_at`.
    pub(crate) async fn claim_at(
        &self,
        client: &ClientWrapper,
        req: &ClaimRequest<'_>,
        token: FencingToken,
    ) -> Result<(Claim, SystemTime), StoreError> {
        // A store in use purges what it expires (`with_background_purge`).
        self.purge.start();
        for _ in 0..CLAIM_ATTEMPTS {
            if let (Some(claim), now) = self.claim_once(client, req, token).await? {
                return Ok((claim, now));
            }
        }
        Err(StoreError::new(
            StoreErrorKind::Timeout,
            "the key kept changing while it was being claimed",
        ))
    }

    /// Stores `response` under `lease` on `client`; `Ok(false)` when the lease is lost.
    pub(crate) async fn complete_on(
        &self,
        client: &ClientWrapper,
        lease: &Lease,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<Fenced, StoreError> {
        self.complete_with(&self.sql.complete, client, lease, response, ttl)
            .await
    }

    /// Stores `response` under `lease` on `client` with `sql`, a completion statement.
    async fn complete_with(
        &self,
        sql: &Statement,
        client: &ClientWrapper,
        lease: &Lease,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<Fenced, StoreError> {
        let status = response.status.as_u16() as i16;
        let headers = StoredResponse::encode_headers(&response.headers);
        let (h, b): (&[u8], &[u8]) = (&headers, &response.body);
        let id = self.key_id(&lease.scope, &lease.key);
        let rows = self
            .query_on(
                client,
                sql,
                &[
                    &lease.scope.as_str(),
                    &&*lease.key,
                    &lease.token,
                    &status,
                    &h,
                    &b,
                    &ms(ttl),
                    &self.listener.channel(),
                    &id,
                ],
            )
            .await?;
        Ok(Fenced::kept_if(rows.len() == 1))
    }

    async fn claim_once(
        &self,
        client: &ClientWrapper,
        req: &ClaimRequest<'_>,
        token: FencingToken,
    ) -> Result<(Option<Claim>, SystemTime), StoreError> {
        let lease_ms = ms(req.lease);
        let ttl_ms = ms(req.ttl);
        let fp: &[u8] = req.fingerprint.as_bytes();
        let rows = self
            .query_on(
                client,
                &self.sql.claim,
                &[
                    &req.scope.as_str(),
                    &req.key,
                    &fp,
                    &lease_ms,
                    &ttl_ms,
                    &token,
                ],
            )
            .await?;
        let row = rows
            .first()
            .ok_or_else(|| corrupt("the claim returned no row"))?;
        let lease = |token| Lease {
            scope: req.scope.clone(),
            key: Arc::from(req.key),
            token,
        };
        let now: SystemTime = row.get(col::NOW);
        let Some(token) = row.get::<_, Option<i64>>(col::TOKEN) else {
            // No row for the key. A token: ours, inserted. None: a concurrent request
            // inserted it after this statement's snapshot (or it was released in
            // between); either way, look again.
            let claimed = row.get::<_, Option<i64>>(col::CLAIMED);
            return Ok((
                claimed.map(|token| Claim::Acquired(lease(FencingToken::new(token)))),
                now,
            ));
        };
        let fingerprint = Fingerprint::from_slice(row.get(col::FINGERPRINT))
            .ok_or_else(|| corrupt("fingerprint is not 32 bytes"))?;
        let locked_until: Option<SystemTime> = row.get(col::LOCKED_UNTIL);
        let expires_at: SystemTime = row.get(col::EXPIRES_AT);
        let state: &str = row.get(col::STATE);
        let lapsed = locked_until.is_some_and(|until| until <= now);
        let expired = expires_at <= now && (state == "completed" || lapsed);
        let take_over = expired || (state == "running" && lapsed && fingerprint == req.fingerprint);
        if take_over {
            let rows = self
                .query_on(
                    client,
                    &self.sql.takeover,
                    &[
                        &req.scope.as_str(),
                        &req.key,
                        &token,
                        &fp,
                        &lease_ms,
                        &ttl_ms,
                    ],
                )
                .await?;
            let taken = rows
                .first()
                .map(|r| Claim::Acquired(lease(FencingToken::new(r.get("token")))));
            return Ok((taken, now));
        }
        let found = match state {
            "running" => Claim::Running {
                fingerprint,
                retry_after: lease_left(locked_until, now),
            },
            "completed" => {
                let status: i16 = row
                    .try_get(col::STATUS)
                    .map_err(|_| corrupt("completed record without status"))?;
                let status = u16::try_from(status)
                    .ok()
                    .and_then(|s| StatusCode::from_u16(s).ok())
                    .ok_or_else(|| corrupt("stored status out of range"))?;
                let headers = row
                    .try_get::<_, &[u8]>(col::HEADERS)
                    .ok()
                    .and_then(StoredResponse::decode_headers)
                    .ok_or_else(|| corrupt("stored headers undecodable"))?;
                let body: &[u8] = row
                    .try_get(col::BODY)
                    .map_err(|_| corrupt("completed record without body"))?;
                Claim::Completed {
                    fingerprint,
                    response: StoredResponse {
                        status,
                        headers,
                        body: Bytes::copy_from_slice(body),
                    },
                }
            }
            other => return Err(corrupt(&format!("unknown state {other:?}"))),
        };
        Ok((Some(found), now))
    }
}

/// A pool for `url` with bounded waits: 5 s to connect, 5 s to wait for a connection.
/// Unless the URL sets them otherwise, its connections send TCP keepalives after a
/// minute of silence (every 10 s, failing after 3 unanswered), so that a NAT or a load
/// balancer keeps them, or they are found out, and fail when data they sent goes
/// unacknowledged for 30 s (`tcp_user_timeout`).
///
/// A URL may name a primary and its standbys, to follow a failover:
/// `postgres://app@db1,db2/payments?target_session_attrs=read-write`. A new connection
/// then starts with the host that gave the last one, and a host that has given none
/// within half a second is raced by the next, so that a primary gone without a word
/// (frozen, or cut off: connections accepted and never answered) does not keep the
/// pool from the promoted standby. (tokio-postgres alone tries the hosts in order, each
/// until it answers.)
///
/// ```
/// let pool = tower_idempotency::store::pool_for_url("postgres://postgres@127.0.0.1/postgres", 8)?;
/// assert_eq!(pool.status().max_size, 8);
/// # Ok::<(), tower_idempotency::store::ConfigError>(())
/// ```
pub fn pool_for_url(url: &str, max_size: usize) -> Result<Pool, ConfigError> {
    pool_for_url_with_tls(url, max_size, NoTls)
}

/// [`pool_for_url`] with connections made with `tls` (ask for it in the URL:
/// `sslmode=require`). A store over it needs the connector too, for the connections
/// it makes outside the pool: [`PostgresStore::with_tls`], or build both with
/// [`PostgresStore::connect_with_tls`].
pub fn pool_for_url_with_tls<T>(url: &str, max_size: usize, tls: T) -> Result<Pool, ConfigError>
where
    T: MakeTlsConnect<Socket> + Clone + Send + Sync + 'static,
    T::Stream: Send + Sync + 'static,
    T::TlsConnect: Send + Sync,
    <T::TlsConnect as TlsConnect<Socket>>::Future: Send,
{
    let config = parse_url(url)?;
    let connect = hosts::PoolConnect {
        hosts: hosts::Hosts::new(&config),
        tls,
    };
    let manager = Manager::from_connect(
        config,
        connect,
        ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        },
    );
    Pool::builder(manager)
        .max_size(max_size)
        .runtime(Runtime::Tokio1)
        .wait_timeout(Some(Duration::from_secs(5)))
        .create_timeout(Some(Duration::from_secs(5)))
        .recycle_timeout(Some(Duration::from_secs(5)))
        .build()
        .map_err(|e| ConfigError(format!("cannot build the pool: {e}")))
}

/// TCP keepalive settings of `parse_url`, and the idle time tokio-postgres defaults to.
const KEEPALIVES_IDLE: Duration = Duration::from_secs(60);
const KEEPALIVES_INTERVAL: Duration = Duration::from_secs(10);
const KEEPALIVES_RETRIES: u32 = 3;
const DRIVER_KEEPALIVES_IDLE: Duration = Duration::from_secs(2 * 60 * 60);
/// How long sent data may go unacknowledged before the connection fails.
const TCP_USER_TIMEOUT: Duration = Duration::from_secs(30);

/// Parses a database URL. Where the URL does not say otherwise: a 5 s connect timeout;
/// TCP keepalives after a minute of silence, every 10 s, the connection failing after
/// 3 unanswered ones (a NAT or a load balancer then keeps idle pooled connections, and
/// one that forgets them anyway is found out within two minutes, not two hours); and
/// a `tcp_user_timeout` of 30 s, so that a connection whose statements go
/// unacknowledged fails then, not after the kernel's retransmissions (about 15 min).
fn parse_url(url: &str) -> Result<tokio_postgres::Config, ConfigError> {
    let mut config: tokio_postgres::Config = url
        .parse()
        .map_err(|e| ConfigError(format!("invalid database URL: {e}")))?;
    if config.get_connect_timeout().is_none() {
        config.connect_timeout(Duration::from_secs(5));
    }
    if config.get_keepalives() && config.get_keepalives_idle() == DRIVER_KEEPALIVES_IDLE {
        config.keepalives_idle(KEEPALIVES_IDLE);
    }
    if config.get_keepalives_interval().is_none() {
        config.keepalives_interval(KEEPALIVES_INTERVAL);
    }
    if config.get_keepalives_retries().is_none() {
        config.keepalives_retries(KEEPALIVES_RETRIES);
    }
    if config.get_tcp_user_timeout().is_none() {
        config.tcp_user_timeout(TCP_USER_TIMEOUT);
    }
    Ok(config)
}

impl Store for PostgresStore {
    fn claim<'a>(
        &'a self,
        request: &'a ClaimRequest<'a>,
    ) -> BoxFuture<'a, Result<Claim, StoreError>> {
        Box::pin(async move {
            // One token for every attempt: only one of them can insert the row.
            self.claim_with(request, FencingToken::fresh()).await
        })
    }

    fn complete<'a>(
        &'a self,
        lease: &'a Lease,
        response: &'a StoredResponse,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Fenced, StoreError>> {
        Box::pin(async move {
            let client = self.running_client().await?;
            let completing =
                again_if_it_lost_a_race(|| self.complete_on(&client, lease, response, ttl));
            let completed = client.answer(completing).await;
            client.done(&completed);
            completed
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
            released.map(|rows| Fenced::kept_if(rows.len() == 1))
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
            renewed.map(|n| Fenced::kept_if(n == 1))
        })
    }

    fn purge<'a>(&'a self, batch: usize) -> BoxFuture<'a, Result<u64, StoreError>> {
        Box::pin(self.purge_expired(i64::try_from(batch).unwrap_or(i64::MAX)))
    }

    fn abandoned_claim_wait(&self, lease: Duration) -> Duration {
        // A claim on a shared connection is not closed with it when dropped (the
        // connection carries others'), and may land later than a release in doubt
        // would look: it is waited for, as before, for a lease.
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

    fn records_location(&self) -> Option<Arc<str>> {
        Some(self.location.clone())
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parsed_urls_notice_dead_connections_unless_they_say_otherwise() {
        let config = parse_url("postgres://u@h/db").expect("a URL");
        assert!(config.get_keepalives());
        assert_eq!(config.get_keepalives_idle(), Duration::from_secs(60));
        assert_eq!(
            config.get_keepalives_interval(),
            Some(Duration::from_secs(10))
        );
        assert_eq!(config.get_keepalives_retries(), Some(3));
        assert_eq!(
            config.get_tcp_user_timeout(),
            Some(&Duration::from_secs(30))
        );
        assert_eq!(config.get_connect_timeout(), Some(&Duration::from_secs(5)));

        let own = parse_url(
            "postgres://u@h/db?keepalives_idle=300&keepalives_interval=5&keepalives_retries=9&tcp_user_timeout=7&connect_timeout=2",
        )
        .expect("a URL");
        assert_eq!(own.get_keepalives_idle(), Duration::from_secs(300));
        assert_eq!(own.get_keepalives_interval(), Some(Duration::from_secs(5)));
        assert_eq!(own.get_keepalives_retries(), Some(9));
        assert_eq!(own.get_tcp_user_timeout(), Some(&Duration::from_secs(7)));
        assert_eq!(own.get_connect_timeout(), Some(&Duration::from_secs(2)));
    }

    #[test]
    fn claim_columns_are_read_in_the_order_the_statement_lists_them() {
        let sql = Sql::new("s", "t", false).claim;
        let select_list = &sql[..sql.find(" FROM ").expect("a FROM clause")];
        // Split at the commas outside parentheses (the insert's call has its own).
        let mut depth = 0;
        let names: Vec<&str> = select_list
            .trim_start_matches("SELECT")
            .split(|c: char| {
                match c {
                    '(' => depth += 1,
                    ')' => depth -= 1,
                    _ => {}
                }
                c == ',' && depth == 0
            })
            .map(|c| c.split_whitespace().last().expect("a column"))
            .map(|c| c.rsplit('.').next().unwrap_or(c))
            .collect();
        let expected = [
            (col::TOKEN, "token"),
            (col::FINGERPRINT, "fingerprint"),
            (col::STATE, "state"),
            (col::LOCKED_UNTIL, "locked_until"),
            (col::EXPIRES_AT, "expires_at"),
            (col::STATUS, "status"),
            (col::HEADERS, "headers"),
            (col::BODY, "body"),
            (col::NOW, "now"),
            (col::CLAIMED, "claimed"),
        ];
        assert_eq!(names.len(), expected.len(), "{names:?}");
        for (index, name) in expected {
            assert_eq!(names[index], name, "column {index} of {names:?}");
        }
    }

    #[test]
    fn waits_after_a_lost_race_are_spread_and_bounded() {
        let (us, ms) = (Duration::from_micros, Duration::from_millis);
        // The bound doubles with each loss from 1 ms, up to the cap.
        assert_eq!(race_backoff(1, 1_000), ms(1));
        assert_eq!(race_backoff(1, 1_001), ms(0));
        assert_eq!(race_backoff(3, 4_000), ms(4));
        assert_eq!(race_backoff(3, 4_001), ms(0));
        assert_eq!(race_backoff(6, 32_000), ms(32));
        assert_eq!(race_backoff(15, 32_000), ms(32));
        assert_eq!(race_backoff(15, 32_001), ms(0));
        assert_eq!(race_backoff(usize::MAX, 7), us(7));
        for losses in 1..CLAIM_ATTEMPTS {
            assert!(race_backoff(losses, u64::MAX) <= RACE_BACKOFF_CAP);
        }
        // Statements that lost together draw different waits.
        let waits: std::collections::HashSet<_> = (0..32)
            .map(|_| race_backoff(6, crate::random::u64()))
            .collect();
        assert!(waits.len() > 16, "{waits:?}");
    }

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
