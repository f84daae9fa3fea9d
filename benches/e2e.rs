//! End to end: an Axum app served on loopback, driven by a keep-alive HTTP client with N
//! concurrent workers, with and without the layer, side by side with the database floor
//! (the layer's own statements issued directly with tokio-postgres).
//!
//! Beside them, the peer: `axum-idempotent` over `ruts`' PostgreSQL session store, on the
//! same app, client and database; and the race: concurrent duplicates of one key, with the
//! handler's runs counted, through each.
//!
//! `cargo bench -p benches --bench e2e`; the settings are environment variables,
//! described in `docs/benchmarks.md`. The results are printed as markdown tables and
//! written to `target/bench/e2e.csv` and `target/bench/e2e-race.csv`.
#![allow(missing_docs)]

#[path = "support/delay.rs"]
mod delay;
mod support;
#[path = "support/wire.rs"]
mod wire;

use std::{
    collections::BTreeMap,
    future::Future,
    net::SocketAddr,
    path::PathBuf,
    pin::Pin,
    str::FromStr,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use axum::{
    Router,
    body::Bytes,
    extract::State,
    http::{HeaderMap, HeaderValue, StatusCode, header::CONTENT_TYPE},
    response::{IntoResponse, Response},
    routing::{MethodRouter, post},
    serve::ListenerExt,
};
use axum_idempotent::{IdempotentLayer, IdempotentOptions};
use deadpool_postgres::Pool;
use http_body_util::{BodyExt, Full};
use hyper_util::{
    client::legacy::{Client, connect::HttpConnector},
    rt::TokioExecutor,
};
use ruts::{
    CookieOptions, Session, SessionLayer,
    store::{
        Ttl,
        postgres::{PostgresStore as SessionPgStore, PostgresStoreBuilder},
    },
};
use sha2::{Digest, Sha256};
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use tokio::sync::Barrier;
use tokio_postgres::NoTls;
use tower_cookies::CookieManagerLayer;
use tower_idempotency::{
    IdempotencyKey, IdempotencyLayer, StoredResponse,
    store::{MemoryStore, PostgresStore, SqlxStore, pool_for_url},
    transactional::{SqlxTransaction, TransactionHandle},
};

// ---------------------------------------------------------------------------------------
// The statements of the floor.
//
// The claim and the completion are the store's own (`claim_and_completion_sql`); the
// others are written here, with `{t}` standing for the quoted, schema-qualified table
// and `{s}` for the schema. The transactional BEGIN is the one src/transactional.rs
// sends with the default lock timeout.
// ---------------------------------------------------------------------------------------

/// The completion without any `pg_notify` (a diagnostic floor).
const COMPLETE_NO_NOTIFY_SQL: &str = "WITH done AS (
                    UPDATE {t} SET state = 'completed', locked_until = NULL, status = $4,
                           headers = $5, body = $6, completed_at = now(), expires_at = now() + $7::bigint * interval '1 millisecond'
                    WHERE scope = $1 AND key = $2 AND token = $3 AND state = 'running'
                    RETURNING 1)
                 SELECT 1 FROM done";

/// A plain read by primary key (the other replay floor).
const SELECT_SQL: &str = "SELECT token, fingerprint, state, status, headers, body FROM {t} WHERE scope = $1 AND key = $2";

/// Transactional mode's BEGIN, as `transactional::open` sends it (default lock timeout 5 s).
const BEGIN_SQL: &str = "BEGIN; SET LOCAL lock_timeout = 5000";

/// The handler's own write in transactional mode (and in its floor).
const INSERT_SQL: &str = "INSERT INTO {s}.payments (id, amount, currency) VALUES ($1, $2, $3)";

const LEASE_MS: i64 = 30_000;
const TTL_MS: i64 = 24 * 3600 * 1000;

const REQUEST_BODY: &[u8] =
    br#"{"amount":1250,"currency":"EUR","description":"order 42","customer":"cus_8e03978e40d5"}"#;
const RESPONSE_BODY: &[u8] = br#"{"payment_id":"pay_8e03978e40d543e8","amount":1250,"currency":"EUR","status":"succeeded","created":1700000000}"#;

/// The application name of every connection a row opens to the benchmark database.
const ROW_APP: &str = "tower_idempotency_bench";

// ---------------------------------------------------------------------------------------
// Settings
// ---------------------------------------------------------------------------------------

struct Settings {
    secs: f64,
    warmup: f64,
    repeat: usize,
    concurrency: Vec<usize>,
    pool_size: usize,
    /// `with_shared_claim_connections` of rows (c′) and (e′).
    shared_claim_connections: usize,
    /// `with_batched_claims` of rows (c-b) and (e-b): connections, claims per batch.
    batch_connections: usize,
    batch_max: usize,
    /// `SqlxStore::with_kept_connections` of the sqlx rows (`BENCH_SQLX_KEPT`; the
    /// pool's size unless set).
    sqlx_kept: usize,
    rows: Option<Vec<String>>,
    replay_keys: usize,
    url: String,
    out_dir: PathBuf,
    /// Added to each direction of every connection to PostgreSQL but the observer's
    /// (`support/delay.rs`): a database across a network. Zero: connected directly.
    db_delay: Duration,
    /// `commit_delay` (µs) of every connection of the rows, with `commit_siblings = 0`
    /// (`BENCH_COMMIT_DELAY_US`): slow commits. Each WAL flush waits this long first,
    /// and the commits that arrive meanwhile are flushed with it (group commit), as on
    /// a slow disk. Zero: the server's own.
    commit_delay: Duration,
    /// `wire` (one connection per worker, see `support/wire.rs`) or `hyper` (the
    /// hyper-util pooled client).
    client: String,
    /// Rounds of the race, and the duplicates of one key sent at once in each.
    race_trials: usize,
    race_duplicates: usize,
}

fn env_or<T: FromStr>(name: &str, default: T) -> T {
    match std::env::var(name) {
        Ok(v) if !v.trim().is_empty() => v
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("{name}={v:?} does not parse")),
        _ => default,
    }
}

fn env_list(name: &str) -> Option<Vec<String>> {
    std::env::var(name)
        .ok()
        .filter(|v| !v.trim().is_empty())
        .map(|v| v.split(',').map(|s| s.trim().to_owned()).collect())
}

impl Settings {
    fn from_env() -> Self {
        Self {
            secs: env_or("BENCH_SECS", 2.0),
            warmup: env_or("BENCH_WARMUP_SECS", 0.5),
            repeat: env_or("BENCH_REPEAT", 3usize).max(1),
            concurrency: env_list("BENCH_CONCURRENCY").map_or(vec![1, 16, 64], |l| {
                l.iter()
                    .map(|c| c.parse().expect("BENCH_CONCURRENCY: numbers"))
                    .collect()
            }),
            pool_size: env_or("BENCH_POOL_SIZE", 16),
            shared_claim_connections: env_or("BENCH_SHARED_CLAIM_CONNECTIONS", 4),
            batch_connections: env_or("BENCH_BATCH_CONNECTIONS", 2),
            batch_max: env_or("BENCH_BATCH_MAX", 64),
            sqlx_kept: env_or("BENCH_SQLX_KEPT", env_or("BENCH_POOL_SIZE", 16)),
            rows: env_list("BENCH_ROWS"),
            replay_keys: env_or("BENCH_REPLAY_KEYS", 2000),
            url: env_or(
                "BENCH_DATABASE_URL",
                "postgres://postgres@127.0.0.1:5432/tower_idempotency_bench".to_owned(),
            ),
            out_dir: support::in_repository(env_or("BENCH_OUT_DIR", "target/bench".to_owned())),
            db_delay: Duration::from_micros(env_or("BENCH_DB_DELAY_US", 0)),
            commit_delay: Duration::from_micros(env_or("BENCH_COMMIT_DELAY_US", 0)),
            client: match env_or("BENCH_CLIENT", "wire".to_owned()).as_str() {
                c @ ("wire" | "hyper") => c.to_owned(),
                other => panic!("BENCH_CLIENT={other:?}: wire or hyper"),
            },
            race_trials: env_or("BENCH_RACE_TRIALS", 5usize),
            race_duplicates: env_or("BENCH_RACE_DUPLICATES", 64usize).max(2),
        }
    }
}

// ---------------------------------------------------------------------------------------
// The rows
// ---------------------------------------------------------------------------------------

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    Bare,
    PassThrough,
    Lease,
    LeaseShared,
    Tx,
    SqlxTx,
    Replay,
    ReplayShared,
    Dup,
    Memory,
    FloorLease,
    FloorTx,
    FloorReplay,
    FloorSelect,
    FloorReplayShared,
    FloorLeaseNoNotify,
    HttpFloorLease,
    HttpFloorTx,
    HttpFloorReplay,
    HttpFloorSelect,
    LeaseUnnamed,
    ReplayUnnamed,
    Peer,
    PeerReplay,
    LeaseBatched,
    ReplayBatched,
    SqlxLease,
    SqlxReplay,
    LeaseUnbatched,
    ReplayUnbatched,
}

const KINDS: [Kind; 30] = [
    Kind::Bare,
    Kind::PassThrough,
    Kind::Lease,
    Kind::LeaseShared,
    Kind::Tx,
    Kind::SqlxTx,
    Kind::Replay,
    Kind::ReplayShared,
    Kind::Dup,
    Kind::Memory,
    Kind::FloorLease,
    Kind::FloorTx,
    Kind::FloorReplay,
    Kind::FloorSelect,
    Kind::FloorReplayShared,
    Kind::FloorLeaseNoNotify,
    Kind::HttpFloorLease,
    Kind::HttpFloorTx,
    Kind::HttpFloorReplay,
    Kind::HttpFloorSelect,
    Kind::LeaseUnnamed,
    Kind::ReplayUnnamed,
    Kind::Peer,
    Kind::PeerReplay,
    Kind::LeaseBatched,
    Kind::ReplayBatched,
    Kind::SqlxLease,
    Kind::SqlxReplay,
    Kind::LeaseUnbatched,
    Kind::ReplayUnbatched,
];

/// The order rows run in, within each concurrency: each row next to its floor, so that
/// both see the same conditions.
const RUN_ORDER: [Kind; 30] = [
    Kind::Bare,
    Kind::PassThrough,
    Kind::Memory,
    Kind::Lease,
    Kind::LeaseShared,
    Kind::LeaseUnnamed,
    Kind::LeaseBatched,
    Kind::SqlxLease,
    Kind::LeaseUnbatched,
    Kind::FloorLease,
    Kind::HttpFloorLease,
    Kind::FloorLeaseNoNotify,
    Kind::Peer,
    Kind::Tx,
    Kind::SqlxTx,
    Kind::FloorTx,
    Kind::HttpFloorTx,
    Kind::Replay,
    Kind::ReplayShared,
    Kind::ReplayUnnamed,
    Kind::ReplayBatched,
    Kind::SqlxReplay,
    Kind::ReplayUnbatched,
    Kind::FloorReplay,
    Kind::HttpFloorReplay,
    Kind::PeerReplay,
    Kind::FloorSelect,
    Kind::HttpFloorSelect,
    Kind::FloorReplayShared,
    Kind::Dup,
];

impl Kind {
    fn id(self) -> &'static str {
        match self {
            Kind::Bare => "bare",
            Kind::PassThrough => "passthrough",
            Kind::Lease => "lease",
            Kind::LeaseShared => "lease_shared",
            Kind::Tx => "tx",
            Kind::SqlxTx => "sqlx_tx",
            Kind::Replay => "replay",
            Kind::ReplayShared => "replay_shared",
            Kind::Dup => "dup",
            Kind::Memory => "memory",
            Kind::FloorLease => "floor_lease",
            Kind::FloorTx => "floor_tx",
            Kind::FloorReplay => "floor_replay",
            Kind::FloorSelect => "floor_select",
            Kind::FloorReplayShared => "floor_replay_shared",
            Kind::FloorLeaseNoNotify => "floor_lease_nonotify",
            Kind::HttpFloorLease => "http_floor_lease",
            Kind::HttpFloorTx => "http_floor_tx",
            Kind::HttpFloorReplay => "http_floor_replay",
            Kind::HttpFloorSelect => "http_floor_select",
            Kind::LeaseUnnamed => "lease_unnamed",
            Kind::ReplayUnnamed => "replay_unnamed",
            Kind::Peer => "peer",
            Kind::PeerReplay => "peer_replay",
            Kind::LeaseBatched => "lease_batched",
            Kind::ReplayBatched => "replay_batched",
            Kind::SqlxLease => "sqlx_lease",
            Kind::SqlxReplay => "sqlx_replay",
            Kind::LeaseUnbatched => "lease_unbatched",
            Kind::ReplayUnbatched => "replay_unbatched",
        }
    }

    fn label(self) -> &'static str {
        match self {
            Kind::Bare => "(a) bare app, no layer",
            Kind::PassThrough => "(b) layer, pass-through (no key)",
            Kind::Lease => "(c) lease mode, new keys (the default: batched)",
            Kind::LeaseShared => "(c′) lease mode, new keys, claims on shared connections",
            Kind::Tx => "(d) transactional, new keys + 1 INSERT",
            Kind::SqlxTx => "(d-s) transactional on sqlx, new keys + 1 INSERT",
            Kind::Replay => "(e) replays (the default: batched)",
            Kind::ReplayShared => "(e′) replays, claims on shared connections",
            Kind::Dup => "(f) c duplicates of one key per round",
            Kind::Memory => "(g) MemoryStore, new keys",
            Kind::FloorLease => "(h) floor: claim + completion",
            Kind::FloorTx => "(i) floor: BEGIN+claim, INSERT, completion+COMMIT",
            Kind::FloorReplay => "(j) floor: claim on an existing key",
            Kind::FloorSelect => "(j′) floor: SELECT by primary key",
            Kind::FloorReplayShared => "(j‴) floor (j), pipelined on 4 shared connections",
            Kind::FloorLeaseNoNotify => "(h′) floor (h) without pg_notify",
            Kind::HttpFloorLease => "(h″) floor (h) in a bare handler, over HTTP",
            Kind::HttpFloorTx => "(i″) floor (i) in a bare handler, over HTTP",
            Kind::HttpFloorReplay => "(j″) floor (j) in a bare handler, over HTTP",
            Kind::HttpFloorSelect => "(j′ over HTTP) floor (j′) in a bare handler",
            Kind::LeaseUnnamed => {
                "(c‴) lease mode, new keys, unnamed statements (transaction pooling's mode)"
            }
            Kind::ReplayUnnamed => "(e‴) replays, unnamed statements (transaction pooling's mode)",
            Kind::Peer => "(k) peer: axum-idempotent on ruts' PostgresStore, new keys",
            Kind::PeerReplay => "(l) peer: axum-idempotent on ruts' PostgresStore, replays",
            Kind::LeaseBatched => {
                "(c-b) lease mode, new keys, batched claims, up to BENCH_BATCH_CONNECTIONS"
            }
            Kind::ReplayBatched => "(e-b) replays, batched claims, up to BENCH_BATCH_CONNECTIONS",
            Kind::LeaseUnbatched => "(c-u) lease mode, new keys, batching off",
            Kind::ReplayUnbatched => "(e-u) replays, batching off",
            Kind::SqlxLease => "(c-s) lease mode, new keys, SqlxStore on a sqlx PgPool",
            Kind::SqlxReplay => "(e-s) replays, SqlxStore on a sqlx PgPool",
        }
    }

    /// The row this one is compared with as its floor.
    fn floor(self) -> Option<Kind> {
        match self {
            Kind::PassThrough => Some(Kind::Bare),
            Kind::Lease
            | Kind::LeaseShared
            | Kind::LeaseUnnamed
            | Kind::LeaseBatched
            | Kind::SqlxLease
            | Kind::LeaseUnbatched
            | Kind::HttpFloorLease
            | Kind::Peer => Some(Kind::FloorLease),
            Kind::Tx | Kind::SqlxTx | Kind::HttpFloorTx => Some(Kind::FloorTx),
            // Replays are held to a plain read of the row by its primary key.
            Kind::Replay
            | Kind::ReplayShared
            | Kind::ReplayUnnamed
            | Kind::ReplayBatched
            | Kind::SqlxReplay
            | Kind::ReplayUnbatched
            | Kind::PeerReplay => Some(Kind::FloorSelect),
            Kind::HttpFloorReplay => Some(Kind::FloorReplay),
            Kind::HttpFloorSelect => Some(Kind::FloorSelect),
            _ => None,
        }
    }

    fn uses_db(self) -> bool {
        !matches!(self, Kind::Bare | Kind::PassThrough | Kind::Memory)
    }

    /// Requests with a key through the layer over PostgreSQL.
    fn guarded(self) -> bool {
        matches!(
            self,
            Kind::Lease
                | Kind::LeaseShared
                | Kind::LeaseUnnamed
                | Kind::Tx
                | Kind::SqlxTx
                | Kind::Replay
                | Kind::ReplayShared
                | Kind::ReplayUnnamed
                | Kind::LeaseBatched
                | Kind::ReplayBatched
                | Kind::SqlxLease
                | Kind::SqlxReplay
                | Kind::LeaseUnbatched
                | Kind::ReplayUnbatched
                | Kind::Dup
        )
    }

    /// Rows whose store sends its statements unnamed, as behind a transaction pooler
    /// (`PostgresStore::with_transaction_pooling`), over the same direct connections:
    /// what that mode costs the database, alone.
    /// The peer's rows: `axum-idempotent` behind `ruts`' session layer, each worker's
    /// requests carrying the cookie of the session it logged in to.
    fn peer(self) -> bool {
        matches!(self, Kind::Peer | Kind::PeerReplay)
    }

    fn unnamed(self) -> bool {
        matches!(self, Kind::LeaseUnnamed | Kind::ReplayUnnamed)
    }

    /// Rows whose store runs its claims on shared connections
    /// (`PostgresStore::with_shared_claim_connections`, `BENCH_SHARED_CLAIM_CONNECTIONS`).
    fn shared(self) -> bool {
        matches!(self, Kind::LeaseShared | Kind::ReplayShared)
    }

    /// Rows whose store batches its claims (`PostgresStore::with_batched_claims`,
    /// `BENCH_BATCH_CONNECTIONS`, `BENCH_BATCH_MAX`).
    fn batched(self) -> bool {
        matches!(self, Kind::LeaseBatched | Kind::ReplayBatched)
    }

    fn over_http(self) -> bool {
        !matches!(
            self,
            Kind::FloorLease
                | Kind::FloorTx
                | Kind::FloorReplay
                | Kind::FloorSelect
                | Kind::FloorReplayShared
                | Kind::FloorLeaseNoNotify
        )
    }

    /// Distinct statements each connection prepares (each is one commit of its own).
    fn prepared_per_connection(self) -> f64 {
        match self {
            Kind::Lease
            | Kind::LeaseShared
            | Kind::Dup
            | Kind::LeaseBatched
            | Kind::LeaseUnbatched
            | Kind::FloorLease
            | Kind::FloorLeaseNoNotify => 2.0,
            Kind::HttpFloorLease => 2.0,
            Kind::Tx | Kind::SqlxTx | Kind::FloorTx | Kind::HttpFloorTx => 3.0,
            Kind::Replay
            | Kind::ReplayShared
            | Kind::FloorReplay
            | Kind::FloorSelect
            | Kind::FloorReplayShared
            | Kind::ReplayBatched
            | Kind::ReplayUnbatched
            | Kind::HttpFloorReplay
            | Kind::HttpFloorSelect => 1.0,
            Kind::Bare | Kind::PassThrough | Kind::Memory => 0.0,
            // Parsed with every execution: nothing prepared.
            Kind::LeaseUnnamed | Kind::ReplayUnnamed => 0.0,
            // sqlx prepares each statement on first use: the read alone outside a
            // transaction (its own commit); the write inside the one it runs in.
            Kind::Peer | Kind::PeerReplay => 1.0,
            // The statements of (c) and (e), prepared by sqlx on first use.
            Kind::SqlxLease => 2.0,
            Kind::SqlxReplay => 1.0,
        }
    }
}

// ---------------------------------------------------------------------------------------
// The database: a database of its own (so that its commit counters are ours alone), a
// fresh schema per run, counters, and the CPU of our backends.
// ---------------------------------------------------------------------------------------

struct Db {
    base: support::BenchDatabase,
    row_url: String,
}

fn with_param(url: &str, param: &str) -> String {
    if url.contains('?') {
        format!("{url}&{param}")
    } else {
        format!("{url}?{param}")
    }
}

/// `url` with its host and port replaced by `addr`.
fn via(url: &str, addr: SocketAddr) -> String {
    let start = url.find("://").map_or(0, |i| i + 3);
    let end = url[start..]
        .find(['/', '?'])
        .map_or(url.len(), |i| start + i);
    let host = url[start..end].rfind('@').map_or(start, |i| start + i + 1);
    format!("{}{addr}{}", &url[..host], &url[end..])
}

/// The host and port `url` names, resolved.
fn address_of(url: &str) -> SocketAddr {
    let config: tokio_postgres::Config = url.parse().expect("BENCH_DATABASE_URL");
    let host = match config.get_hosts().first() {
        Some(tokio_postgres::config::Host::Tcp(h)) => h.clone(),
        _ => "127.0.0.1".to_owned(),
    };
    let port = config.get_ports().first().copied().unwrap_or(5432);
    std::net::ToSocketAddrs::to_socket_addrs(&(host.as_str(), port))
        .expect("resolve the database host")
        .next()
        .expect("an address for the database host")
}

impl Db {
    /// The rows connect through `proxy` if there is one; the observer connects directly.
    async fn open(url: &str, proxy: Option<SocketAddr>, commit_delay: Duration) -> Self {
        let mut rows = proxy.map_or_else(|| url.to_owned(), |addr| via(url, addr));
        if !commit_delay.is_zero() {
            // -c commit_delay=N -c commit_siblings=0, for the rows' sessions alone.
            let options = format!(
                "options=-c%20commit_delay%3D{}%20-c%20commit_siblings%3D0",
                commit_delay.as_micros()
            );
            rows = with_param(&rows, &options);
        }
        Self {
            base: support::BenchDatabase::open(url, "tower_idempotency_bench_admin").await,
            row_url: with_param(&rows, &format!("application_name={ROW_APP}")),
        }
    }

    /// (xact_commit, xact_rollback) of the benchmark database.
    async fn commits(&self) -> (i64, i64) {
        let row = self
            .base
            .admin
            .query_one(
                "SELECT xact_commit, xact_rollback FROM pg_stat_database WHERE datname = $1",
                &[&self.base.name],
            )
            .await
            .expect("pg_stat_database");
        (row.get(0), row.get(1))
    }

    /// Waits until every connection of the rows has gone: a backend flushes its counters
    /// when it exits, so the commit counters are then complete.
    async fn wait_closed(&self) {
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let n: i64 = self
                .base
                .admin
                .query_one(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = $1 AND application_name = $2",
                    &[&self.base.name, &ROW_APP],
                )
                .await
                .expect("pg_stat_activity")
                .get(0);
            if n == 0 {
                return;
            }
            assert!(Instant::now() < deadline, "{n} connections did not close");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn backend_pids(&self) -> Vec<i32> {
        self.base
            .admin
            .query(
                "SELECT pid FROM pg_stat_activity WHERE datname = $1 AND application_name = $2",
                &[&self.base.name, &ROW_APP],
            )
            .await
            .expect("pg_stat_activity")
            .iter()
            .map(|r| r.get(0))
            .collect()
    }

    async fn sample(&self, with_pg: bool) -> Sample {
        let mut pg = BTreeMap::new();
        if with_pg {
            for pid in self.backend_pids().await {
                if let Some(t) = proc_ticks(&format!("/proc/{pid}/stat")) {
                    pg.insert(pid, t);
                }
            }
        }
        let (busy, total) = system_ticks();
        Sample {
            app: proc_ticks("/proc/self/stat").unwrap_or(0),
            pg,
            busy,
            total,
        }
    }

    async fn drop_database(&self) {
        self.base.drop_if_created().await;
    }
}

/// utime + stime of a process, in clock ticks.
fn proc_ticks(path: &str) -> Option<u64> {
    let stat = std::fs::read_to_string(path).ok()?;
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    Some(fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?)
}

/// (busy, total) ticks of the whole machine.
fn system_ticks() -> (u64, u64) {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let Some(cpu) = stat.lines().next() else {
        return (0, 0);
    };
    let v: Vec<u64> = cpu
        .split_whitespace()
        .skip(1)
        .filter_map(|x| x.parse().ok())
        .collect();
    let total: u64 = v.iter().sum();
    let idle = v.get(3).copied().unwrap_or(0) + v.get(4).copied().unwrap_or(0);
    (total - idle, total)
}

/// Clock ticks per second (`getconf CLK_TCK`, 100 on Linux).
const TICK_US: f64 = 10_000.0;

struct Sample {
    app: u64,
    pg: BTreeMap<i32, u64>,
    busy: u64,
    total: u64,
}

/// Commits a connection costs: its start-up, and each statement it prepares.
#[derive(Clone, Copy)]
struct Overhead {
    per_connection: f64,
    per_prepare: f64,
}

async fn calibrate(db: &Db) -> Overhead {
    async fn round(db: &Db, conns: usize, prepares: usize) -> f64 {
        db.wait_closed().await;
        let (before, _) = db.commits().await;
        let pool = pool_for_url(&db.row_url, conns).expect("pool");
        let mut held = Vec::new();
        for _ in 0..conns {
            held.push(pool.get().await.expect("connection"));
        }
        for c in &held {
            for i in 0..prepares {
                c.prepare_cached(&format!("SELECT {i}::int + $1::int"))
                    .await
                    .expect("prepare");
            }
        }
        drop(held);
        pool.close();
        db.wait_closed().await;
        let (after, _) = db.commits().await;
        (after - before) as f64
    }
    let connect = round(db, 4, 0).await / 4.0;
    let prepare = (round(db, 4, 3).await / 4.0 - connect) / 3.0;
    Overhead {
        per_connection: connect,
        per_prepare: prepare,
    }
}

// ---------------------------------------------------------------------------------------
// The floor: the store's statements, issued directly.
// ---------------------------------------------------------------------------------------

struct Sql {
    claim: String,
    complete: String,
    complete_no_notify: String,
    select: String,
    insert: String,
}

impl Sql {
    fn new(store: &PostgresStore, schema: &str) -> Self {
        let t = |s: &str| {
            s.replace("{t}", store.table())
                .replace("{s}", &format!("\"{schema}\""))
        };
        let (claim, complete) = store.claim_and_completion_sql();
        Self {
            claim: claim.to_owned(),
            complete: complete.to_owned(),
            complete_no_notify: t(COMPLETE_NO_NOTIFY_SQL),
            select: t(SELECT_SQL),
            insert: t(INSERT_SQL),
        }
    }
}

struct Floor {
    pool: Pool,
    /// Connections held for the whole row and shared by every worker, each query
    /// pipelined with the others on its connection (row j‴).
    shared: tokio::sync::OnceCell<Vec<deadpool_postgres::Object>>,
    sql: Arc<Sql>,
    statements: AtomicU64,
    fingerprint: [u8; 32],
    headers: Bytes,
    channel: String,
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The notification payload the store sends: a digest of the key.
fn key_id(key: &str) -> String {
    hex(&Sha256::digest(key.as_bytes())[..16])
}

/// A fencing token for a fresh claim (the store draws a random one).
fn fresh_token() -> i64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    ((n.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 2) as i64).max(1)
}

/// Connections of the pipelined floor (j‴).
const SHARED_CONNECTIONS: usize = 4;

fn err(e: impl std::fmt::Display) -> String {
    e.to_string()
}

impl Floor {
    fn new(pool: Pool, sql: Arc<Sql>) -> Self {
        let mut h = HeaderMap::new();
        h.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        Self {
            pool,
            shared: tokio::sync::OnceCell::new(),
            sql,
            statements: AtomicU64::new(0),
            fingerprint: Sha256::digest(REQUEST_BODY).into(),
            headers: StoredResponse::encode_headers(&h),
            channel: "idempotency_keys_done".to_owned(),
        }
    }

    fn count(&self) {
        self.statements.fetch_add(1, Ordering::Relaxed);
    }

    async fn claim(&self, client: &deadpool_postgres::Client, key: &str) -> Result<i64, String> {
        let stmt = client.prepare_cached(&self.sql.claim).await.map_err(err)?;
        self.count();
        let fp: &[u8] = &self.fingerprint;
        let rows = client
            // The last: the claim's holder, as a store with liveness names itself.
            .query(
                &stmt,
                &[
                    &"",
                    &key,
                    &fp,
                    &LEASE_MS,
                    &TTL_MS,
                    &fresh_token(),
                    &Some(1_i64),
                ],
            )
            .await
            .map_err(err)?;
        let row = rows.first().ok_or("claim: no row")?;
        match row.get::<_, Option<i64>>("claimed") {
            Some(token) => Ok(token),
            None => Err(format!("claim: {key} was not new")),
        }
    }

    async fn complete(
        &self,
        client: &deadpool_postgres::Client,
        key: &str,
        token: i64,
        notify: bool,
    ) -> Result<(), String> {
        let sql = if notify {
            &self.sql.complete
        } else {
            &self.sql.complete_no_notify
        };
        let stmt = client.prepare_cached(sql).await.map_err(err)?;
        self.count();
        let (h, b): (&[u8], &[u8]) = (&self.headers, RESPONSE_BODY);
        let id = key_id(key);
        let rows = if notify {
            client
                .query(
                    &stmt,
                    &[
                        &"",
                        &key,
                        &token,
                        &201i16,
                        &h,
                        &b,
                        &TTL_MS,
                        &self.channel,
                        &id,
                    ],
                )
                .await
        } else {
            client
                .query(&stmt, &[&"", &key, &token, &201i16, &h, &b, &TTL_MS])
                .await
        }
        .map_err(err)?;
        if rows.len() == 1 {
            Ok(())
        } else {
            Err("completion: no row".into())
        }
    }

    /// Lease mode: the claim, then the completion, each on a connection from the pool.
    async fn lease(&self, key: &str, notify: bool) -> Result<(), String> {
        let token = {
            let client = self.pool.get().await.map_err(err)?;
            self.claim(&client, key).await?
        };
        let client = self.pool.get().await.map_err(err)?;
        self.complete(&client, key, token, notify).await
    }

    /// Transactional mode: BEGIN with the claim, the handler's INSERT, the completion
    /// with COMMIT, on one connection.
    async fn tx(&self, key: &str) -> Result<(), String> {
        let client = self.pool.get().await.map_err(err)?;
        let (begun, token) =
            tokio::join!(client.batch_execute(BEGIN_SQL), self.claim(&client, key));
        begun.map_err(err)?;
        let token = token?;
        let insert = client.prepare_cached(&self.sql.insert).await.map_err(err)?;
        client
            .execute(&insert, &[&key, &1250i64, &"EUR"])
            .await
            .map_err(err)?;
        // Prepared first (cached), so that its Execute goes out before the COMMIT.
        client
            .prepare_cached(&self.sql.complete)
            .await
            .map_err(err)?;
        let (completed, committed) = tokio::join!(
            self.complete(&client, key, token, true),
            client.batch_execute("COMMIT")
        );
        completed?;
        committed.map_err(err)
    }

    /// A replay: the claim statement on an existing key returns its stored response.
    async fn replay(&self, key: &str) -> Result<(StatusCode, HeaderMap, Bytes), String> {
        let client = self.pool.get().await.map_err(err)?;
        self.replay_on(&client, key).await
    }

    /// The claim statement on an existing key, on `client`.
    async fn replay_on(
        &self,
        client: &deadpool_postgres::Client,
        key: &str,
    ) -> Result<(StatusCode, HeaderMap, Bytes), String> {
        let stmt = client.prepare_cached(&self.sql.claim).await.map_err(err)?;
        self.count();
        let fp: &[u8] = &self.fingerprint;
        let rows = client
            // The last: the claim's holder, as a store with liveness names itself.
            .query(
                &stmt,
                &[
                    &"",
                    &key,
                    &fp,
                    &LEASE_MS,
                    &TTL_MS,
                    &fresh_token(),
                    &Some(1_i64),
                ],
            )
            .await
            .map_err(err)?;
        let row = rows.first().ok_or("replay: no row")?;
        if row.get::<_, Option<&str>>("state") != Some("completed") {
            return Err(format!("replay: {key} was not completed"));
        }
        stored(row)
    }

    /// A replay as (j), but on one of `SHARED_CONNECTIONS` connections that every
    /// worker uses at once, instead of a connection of its own from the pool: each
    /// statement still commits on its own (its own `Sync`), and tokio-postgres pipelines
    /// the statements of concurrent workers on a connection.
    async fn replay_shared(
        &self,
        worker: usize,
        key: &str,
    ) -> Result<(StatusCode, HeaderMap, Bytes), String> {
        let shared = self
            .shared
            .get_or_try_init(|| async {
                let mut held = Vec::with_capacity(SHARED_CONNECTIONS);
                for _ in 0..SHARED_CONNECTIONS {
                    let client = self.pool.get().await.map_err(err)?;
                    client.prepare_cached(&self.sql.claim).await.map_err(err)?;
                    held.push(client);
                }
                Ok::<_, String>(held)
            })
            .await?;
        self.replay_on(&shared[worker % SHARED_CONNECTIONS], key)
            .await
    }

    /// A replay read as a plain SELECT by primary key.
    async fn select(&self, key: &str) -> Result<(StatusCode, HeaderMap, Bytes), String> {
        let client = self.pool.get().await.map_err(err)?;
        let stmt = client.prepare_cached(&self.sql.select).await.map_err(err)?;
        self.count();
        let row = client
            .query_opt(&stmt, &[&"", &key])
            .await
            .map_err(err)?
            .ok_or("select: no row")?;
        stored(&row)
    }
}

fn stored(row: &tokio_postgres::Row) -> Result<(StatusCode, HeaderMap, Bytes), String> {
    let status: i16 = row.try_get("status").map_err(err)?;
    let status = StatusCode::from_u16(u16::try_from(status).map_err(err)?).map_err(err)?;
    let headers = StoredResponse::decode_headers(row.try_get("headers").map_err(err)?)
        .ok_or("undecodable headers")?;
    let body: &[u8] = row.try_get("body").map_err(err)?;
    Ok((status, headers, Bytes::copy_from_slice(body)))
}

// ---------------------------------------------------------------------------------------
// The app
// ---------------------------------------------------------------------------------------

fn created() -> Response {
    (
        StatusCode::CREATED,
        [(CONTENT_TYPE, "application/json")],
        RESPONSE_BODY,
    )
        .into_response()
}

fn internal(e: impl std::fmt::Display) -> Response {
    (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response()
}

async fn create(_body: Bytes) -> Response {
    created()
}

/// Transactional mode: one row written in the request's transaction.
async fn create_in_tx(
    State(sql): State<Arc<Sql>>,
    key: IdempotencyKey,
    tx: TransactionHandle,
    _body: Bytes,
) -> Response {
    insert_payment(&sql, &key, &tx).await
}

/// Transactional mode on sqlx: the same row, written through the request's
/// `SqlxTransaction`.
async fn create_in_sqlx_tx(
    State(sql): State<Arc<Sql>>,
    key: IdempotencyKey,
    tx: SqlxTransaction,
    _body: Bytes,
) -> Response {
    use sqlx::Executor as _;
    let mut conn = match tx.connection().await {
        Ok(c) => c,
        Err(e) => return internal(e),
    };
    let insert = sqlx::query(&sql.insert)
        .bind(key.as_str())
        .bind(1250i64)
        .bind("EUR");
    if let Err(e) = conn.execute(insert).await {
        return internal(e);
    }
    created()
}

async fn insert_payment(sql: &Sql, key: &IdempotencyKey, tx: &TransactionHandle) -> Response {
    let client = match tx.client().await {
        Ok(c) => c,
        Err(e) => return internal(e),
    };
    let insert = match client.prepare_cached(&sql.insert).await {
        Ok(s) => s,
        Err(e) => return internal(e),
    };
    if let Err(e) = client
        .execute(&insert, &[&key.as_str(), &1250i64, &"EUR"])
        .await
    {
        return internal(e);
    }
    created()
}

/// The handlers of the race: the app's own, counting their runs.
#[derive(Clone)]
struct Counted {
    runs: Arc<AtomicU64>,
    sql: Arc<Sql>,
}

async fn create_counted(State(counted): State<Counted>, _body: Bytes) -> Response {
    counted.runs.fetch_add(1, Ordering::SeqCst);
    created()
}

async fn create_in_tx_counted(
    State(counted): State<Counted>,
    key: IdempotencyKey,
    tx: TransactionHandle,
    _body: Bytes,
) -> Response {
    counted.runs.fetch_add(1, Ordering::SeqCst);
    insert_payment(&counted.sql, &key, &tx).await
}

fn key_of(headers: &HeaderMap) -> Option<&str> {
    headers.get("idempotency-key").and_then(|v| v.to_str().ok())
}

fn no_key() -> Response {
    (StatusCode::BAD_REQUEST, "no key").into_response()
}

/// The floor in a handler: what an app would do by hand, without the layer.
async fn floor_lease_handler(
    State(floor): State<Arc<Floor>>,
    headers: HeaderMap,
    _body: Bytes,
) -> Response {
    let Some(key) = key_of(&headers) else {
        return no_key();
    };
    match floor.lease(key, true).await {
        Ok(()) => created(),
        Err(e) => internal(e),
    }
}

async fn floor_tx_handler(
    State(floor): State<Arc<Floor>>,
    headers: HeaderMap,
    _body: Bytes,
) -> Response {
    let Some(key) = key_of(&headers) else {
        return no_key();
    };
    match floor.tx(key).await {
        Ok(()) => created(),
        Err(e) => internal(e),
    }
}

async fn floor_replay_handler(
    State(floor): State<Arc<Floor>>,
    headers: HeaderMap,
    _body: Bytes,
) -> Response {
    let Some(key) = key_of(&headers) else {
        return no_key();
    };
    replayed(floor.replay(key).await)
}

/// (j′) in a handler: the stored response read by its primary key and sent back, what
/// an app answering retries from its own table would do per request, with the HTTP
/// that every row of the layer carries.
async fn floor_select_handler(
    State(floor): State<Arc<Floor>>,
    headers: HeaderMap,
    _body: Bytes,
) -> Response {
    let Some(key) = key_of(&headers) else {
        return no_key();
    };
    replayed(floor.select(key).await)
}

fn replayed(stored: Result<(StatusCode, HeaderMap, Bytes), String>) -> Response {
    match stored {
        Ok((status, headers, body)) => {
            let mut res = (status, body).into_response();
            *res.headers_mut() = headers;
            res.headers_mut()
                .insert("idempotent-replayed", HeaderValue::from_static("true"));
            res
        }
        Err(e) => internal(e),
    }
}

struct Server {
    addr: SocketAddr,
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<()>,
}

async fn serve(app: Router) -> Server {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(async move {
                let _ = stopped.await;
            })
            .await
            .expect("serve");
    });
    Server { addr, stop, task }
}

impl Server {
    async fn shutdown(self) {
        let _ = self.stop.send(());
        let _ = tokio::time::timeout(Duration::from_secs(10), self.task).await;
    }
}

type HttpClient = Client<HttpConnector, Full<Bytes>>;

fn http_client() -> HttpClient {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(1024)
        .build(connector)
}

/// One request; the status and whether it was a replay.
async fn send(
    client: &HttpClient,
    uri: &str,
    key: Option<&str>,
    cookie: Option<&str>,
) -> Result<String, String> {
    let mut req = http::Request::post(uri).header(CONTENT_TYPE, "application/json");
    if let Some(key) = key {
        req = req.header("idempotency-key", key);
    }
    if let Some(cookie) = cookie {
        req = req.header(http::header::COOKIE, cookie);
    }
    let req = req
        .body(Full::new(Bytes::from_static(REQUEST_BODY)))
        .map_err(err)?;
    let res = client.request(req).await.map_err(err)?;
    let status = res.status();
    let replayed = res.headers().contains_key("idempotent-replayed");
    let body = res.into_body().collect().await.map_err(err)?.to_bytes();
    if status.is_server_error() {
        return Err(format!("{status}: {}", String::from_utf8_lossy(&body)));
    }
    Ok(if replayed {
        format!("{} replayed", status.as_u16())
    } else {
        status.as_u16().to_string()
    })
}

/// A wire client's reply as an outcome, like [`send`]'s.
fn outcome(reply: wire::Reply) -> Result<String, String> {
    if reply.status >= 500 {
        return Err(format!(
            "{}: {}",
            reply.status,
            String::from_utf8_lossy(&reply.body)
        ));
    }
    Ok(if reply.replayed {
        format!("{} replayed", reply.status)
    } else {
        reply.status.to_string()
    })
}

// ---------------------------------------------------------------------------------------
// The load
// ---------------------------------------------------------------------------------------

type OpFuture = Pin<Box<dyn Future<Output = Result<String, String>> + Send>>;
type Op = Arc<dyn Fn(usize, u64) -> OpFuture + Send + Sync>;

struct Load {
    measured: u64,
    total: u64,
    errors: u64,
    first_error: Option<String>,
    latencies: Vec<u64>,
    outcomes: BTreeMap<String, u64>,
    start: Sample,
    end: Sample,
    window: f64,
}

struct Worker {
    measured: u64,
    total: u64,
    errors: u64,
    first_error: Option<String>,
    latencies: Vec<u64>,
    outcomes: BTreeMap<String, u64>,
}

/// `c` workers, each calling `op` back to back: `warmup` seconds, then `secs` measured.
/// In `lockstep`, every worker sends its n-th request together with the others (the
/// duplicates row), round after round.
async fn run_load(db: &Db, c: usize, s: &Settings, lockstep: bool, op: Op) -> Load {
    let begin = Instant::now();
    let measure_from = begin + Duration::from_secs_f64(s.warmup);
    let end = measure_from + Duration::from_secs_f64(s.secs);
    let barrier = Arc::new(Barrier::new(c));
    let stop = Arc::new(AtomicBool::new(false));
    let mut workers = Vec::new();
    for w in 0..c {
        let (op, barrier, stop) = (op.clone(), barrier.clone(), stop.clone());
        workers.push(tokio::spawn(async move {
            let mut me = Worker {
                measured: 0,
                total: 0,
                errors: 0,
                first_error: None,
                latencies: Vec::with_capacity(1 << 14),
                outcomes: BTreeMap::new(),
            };
            let mut seq = 0u64;
            loop {
                if lockstep {
                    if barrier.wait().await.is_leader() {
                        stop.store(Instant::now() >= end, Ordering::SeqCst);
                    }
                    barrier.wait().await;
                    if stop.load(Ordering::SeqCst) {
                        break;
                    }
                }
                let t0 = Instant::now();
                if !lockstep && t0 >= end {
                    break;
                }
                let result = op(w, seq).await;
                let dt = t0.elapsed();
                seq += 1;
                me.total += 1;
                match result {
                    Err(e) => {
                        me.errors += 1;
                        me.first_error.get_or_insert(e);
                    }
                    Ok(outcome) if t0 >= measure_from => {
                        me.measured += 1;
                        me.latencies.push(dt.as_nanos() as u64);
                        *me.outcomes.entry(outcome).or_default() += 1;
                    }
                    Ok(_) => {}
                }
            }
            me
        }));
    }
    tokio::time::sleep_until(measure_from.into()).await;
    let start = db.sample(true).await;
    tokio::time::sleep_until(end.into()).await;
    let end_sample = db.sample(true).await;
    let mut load = Load {
        measured: 0,
        total: 0,
        errors: 0,
        first_error: None,
        latencies: Vec::new(),
        outcomes: BTreeMap::new(),
        start,
        end: end_sample,
        window: s.secs,
    };
    for w in workers {
        let me = w.await.expect("worker");
        load.measured += me.measured;
        load.total += me.total;
        load.errors += me.errors;
        if load.first_error.is_none() {
            load.first_error = me.first_error;
        }
        load.latencies.extend(me.latencies);
        for (k, v) in me.outcomes {
            *load.outcomes.entry(k).or_default() += v;
        }
    }
    load.latencies.sort_unstable();
    load
}

fn percentile(sorted: &[u64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1] as f64 / 1e6
}

// ---------------------------------------------------------------------------------------
// One row
// ---------------------------------------------------------------------------------------

struct RowResult {
    kind: Kind,
    c: usize,
    requests: u64,
    rps: f64,
    p50_ms: f64,
    p99_ms: f64,
    statements: Option<f64>,
    commits: Option<f64>,
    rollbacks: Option<f64>,
    app_cpu_us: f64,
    pg_cpu_us: f64,
    machine_busy: f64,
    other_cpu: f64,
    rps_min: f64,
    rps_max: f64,
    ratio_floor: Option<f64>,
    ratio_bare: Option<f64>,
    errors: u64,
    outcomes: String,
    /// The process's resident memory once the row was done and its server shut down.
    rss_mib: f64,
}

struct Ctx {
    settings: Settings,
    db: Db,
    schema: String,
    table: String,
    sql: Arc<Sql>,
    overhead: Overhead,
    /// The peer's sessions, once logged in (if a row of the peer or the race runs).
    peer: Option<Peer>,
}

impl Ctx {
    fn store(&self) -> PostgresStore {
        PostgresStore::new(pool_for_url(&self.db.row_url, self.settings.pool_size).expect("pool"))
            .with_schema_name(&self.schema)
            .expect("schema name")
            .with_notifications(self.db.row_url.parse().expect("url"))
    }

    /// The shared claim connections of `kind`'s store: none but for (c′) and (e′).
    fn shared_claim_connections(&self, kind: Kind) -> usize {
        if kind.shared() {
            self.settings.shared_claim_connections
        } else {
            0
        }
    }

    fn floor(&self) -> Arc<Floor> {
        Arc::new(Floor::new(
            pool_for_url(&self.db.row_url, self.settings.pool_size).expect("pool"),
            self.sql.clone(),
        ))
    }
}

fn replay_key(w: usize, seq: u64, n: usize) -> String {
    format!("replay-{}", (w as u64 * 7919 + seq * 31) % n as u64)
}

async fn run_row(ctx: &Ctx, kind: Kind, c: usize, round: usize) -> RowResult {
    let db = &ctx.db;
    db.wait_closed().await;
    let (commits_before, rollbacks_before) = db.commits().await;
    let n_replay = ctx.settings.replay_keys;
    let tag = format!("{}-c{c}-r{round}", kind.id());

    let mut store: Option<PostgresStore> = None;
    let mut floor: Option<Arc<Floor>> = None;
    let mut server: Option<Server> = None;
    let mut peer_db: Option<PgPool> = None;

    let router = match kind {
        Kind::Bare => Some(Router::new().route("/payments", post(create))),
        Kind::PassThrough => {
            let st = ctx.store();
            store = Some(st.clone());
            Some(
                Router::new()
                    .route("/payments", post(create))
                    .layer(IdempotencyLayer::new(st)),
            )
        }
        Kind::Lease
        | Kind::LeaseShared
        | Kind::LeaseUnnamed
        | Kind::Replay
        | Kind::ReplayShared
        | Kind::ReplayUnnamed
        | Kind::LeaseBatched
        | Kind::ReplayBatched
        | Kind::LeaseUnbatched
        | Kind::ReplayUnbatched
        | Kind::Dup => {
            let st = ctx
                .store()
                .with_shared_claim_connections(ctx.shared_claim_connections(kind))
                .with_transaction_pooling(kind.unnamed());
            let st = if kind.batched() {
                st.with_batched_claims(ctx.settings.batch_connections, ctx.settings.batch_max)
            } else if matches!(kind, Kind::LeaseUnbatched | Kind::ReplayUnbatched) {
                st.with_batched_claims(0, 1)
            } else {
                st
            };
            store = Some(st.clone());
            Some(
                Router::new()
                    .route("/payments", post(create))
                    .layer(IdempotencyLayer::new(st)),
            )
        }
        Kind::SqlxLease | Kind::SqlxReplay => {
            // A pool of the size of (c)'s, and a connection of its own to LISTEN on,
            // as (c)'s notification connection.
            let pool = peer_pool(&db.row_url, ctx.settings.pool_size);
            peer_db = Some(pool.clone());
            let st = SqlxStore::new(pool)
                .with_notification_pool(peer_pool(&db.row_url, 1))
                .with_kept_connections(ctx.settings.sqlx_kept)
                .with_schema_name(&ctx.schema)
                .expect("schema name");
            Some(
                Router::new()
                    .route("/payments", post(create))
                    .layer(IdempotencyLayer::new(st)),
            )
        }
        Kind::Tx => {
            let st = ctx.store();
            store = Some(st.clone());
            Some(
                Router::new()
                    .route("/payments", post(create_in_tx))
                    .with_state(ctx.sql.clone())
                    .layer(IdempotencyLayer::transactional(st)),
            )
        }
        Kind::SqlxTx => {
            // The app's own sqlx pool, as the peer's (its connections counted, and
            // closed, as the peer's are).
            let pool = peer_pool(&db.row_url, ctx.settings.pool_size);
            peer_db = Some(pool.clone());
            let st = SqlxStore::new(pool)
                .with_kept_connections(ctx.settings.sqlx_kept)
                .with_schema_name(&ctx.schema)
                .expect("schema name");
            Some(
                Router::new()
                    .route("/payments", post(create_in_sqlx_tx))
                    .with_state(ctx.sql.clone())
                    .layer(IdempotencyLayer::transactional(st)),
            )
        }
        Kind::Memory => Some(
            Router::new()
                .route("/payments", post(create))
                .layer(IdempotencyLayer::new(MemoryStore::new())),
        ),
        Kind::Peer | Kind::PeerReplay => {
            let peer = ctx.peer.as_ref().expect("the peer's sessions");
            let pool = peer_pool(&db.row_url, ctx.settings.pool_size);
            peer_db = Some(pool.clone());
            Some(peer_router(
                peer_store(pool, &peer.schema, false).await,
                post(create),
            ))
        }
        Kind::HttpFloorLease
        | Kind::HttpFloorTx
        | Kind::HttpFloorReplay
        | Kind::HttpFloorSelect => {
            let f = ctx.floor();
            floor = Some(f.clone());
            let handler = match kind {
                Kind::HttpFloorLease => post(floor_lease_handler),
                Kind::HttpFloorTx => post(floor_tx_handler),
                Kind::HttpFloorSelect => post(floor_select_handler),
                _ => post(floor_replay_handler),
            };
            Some(Router::new().route("/payments", handler).with_state(f))
        }
        Kind::FloorLease
        | Kind::FloorTx
        | Kind::FloorReplay
        | Kind::FloorSelect
        | Kind::FloorReplayShared
        | Kind::FloorLeaseNoNotify => {
            floor = Some(ctx.floor());
            None
        }
    };

    let op: Op = if let Some(router) = router {
        let srv = serve(router).await;
        let uri: Arc<str> = Arc::from(format!("http://{}/payments", srv.addr));
        let addr = srv.addr;
        server = Some(srv);
        let client = http_client();
        // The peer's workers each carry the cookie of the session they logged in to.
        let cookies: Arc<[String]> = match &ctx.peer {
            Some(peer) if kind.peer() => Arc::from(&peer.cookies[..c]),
            _ => Arc::from(vec![String::new(); c]),
        };
        let wire = (ctx.settings.client == "wire").then(|| {
            Arc::new(if kind.peer() {
                wire::Clients::with_cookies(addr, cookies.to_vec())
            } else {
                wire::Clients::new(addr, c)
            })
        });
        let tag: Arc<str> = Arc::from(tag.as_str());
        Arc::new(move |w, seq| {
            let (client, wire, uri, tag, cookies) = (
                client.clone(),
                wire.clone(),
                uri.clone(),
                tag.clone(),
                cookies.clone(),
            );
            Box::pin(async move {
                let key = match kind {
                    Kind::Bare | Kind::PassThrough => None,
                    Kind::Replay
                    | Kind::ReplayShared
                    | Kind::ReplayUnnamed
                    | Kind::ReplayBatched
                    | Kind::SqlxReplay
                    | Kind::ReplayUnbatched
                    | Kind::HttpFloorReplay
                    | Kind::HttpFloorSelect
                    | Kind::PeerReplay => Some(replay_key(w, seq, n_replay)),
                    Kind::Dup => Some(format!("{tag}-round-{seq}")),
                    _ => Some(format!("{tag}-w{w}-{seq}")),
                };
                match wire {
                    Some(wire) => outcome(wire.post(w, key.as_deref(), REQUEST_BODY).await?),
                    None => {
                        let cookie = Some(cookies[w].as_str()).filter(|c| !c.is_empty());
                        send(&client, &uri, key.as_deref(), cookie).await
                    }
                }
            })
        })
    } else {
        let f = floor.clone().expect("floor");
        let tag: Arc<str> = Arc::from(tag.as_str());
        Arc::new(move |w, seq| {
            let (f, tag) = (f.clone(), tag.clone());
            Box::pin(async move {
                let key = format!("{tag}-w{w}-{seq}");
                match kind {
                    Kind::FloorLease => f.lease(&key, true).await.map(|()| "ok".into()),
                    Kind::FloorLeaseNoNotify => f.lease(&key, false).await.map(|()| "ok".into()),
                    Kind::FloorTx => f.tx(&key).await.map(|()| "ok".into()),
                    Kind::FloorReplay => f
                        .replay(&replay_key(w, seq, n_replay))
                        .await
                        .map(|_| "ok".into()),
                    Kind::FloorReplayShared => f
                        .replay_shared(w, &replay_key(w, seq, n_replay))
                        .await
                        .map(|_| "ok".into()),
                    _ => f
                        .select(&replay_key(w, seq, n_replay))
                        .await
                        .map(|_| "ok".into()),
                }
            })
        })
    };

    let load = run_load(db, c, &ctx.settings, kind == Kind::Dup, op).await;

    if let Some(srv) = server {
        srv.shutdown().await;
    }
    let statements = match (&store, &floor) {
        (Some(st), _) => Some(st.metrics().statements as f64 / load.total.max(1) as f64),
        (None, Some(f)) => {
            Some(f.statements.load(Ordering::Relaxed) as f64 / load.total.max(1) as f64)
        }
        _ => None,
    };
    let pool = store
        .as_ref()
        .map(|s| s.pool().clone())
        .or_else(|| floor.as_ref().map(|f| f.pool.clone()));
    // The connections the row opened, once they are closed.
    let connections = if let Some(pool) = pool {
        // Shared connections are taken out of the pool; they open and prepare too.
        let connections = (pool.status().size + ctx.shared_claim_connections(kind)) as f64;
        pool.close();
        Some(connections)
    } else if let Some(pool) = peer_db {
        let connections = f64::from(pool.size());
        pool.close().await;
        Some(connections)
    } else {
        None
    };
    let (commits, rollbacks) = if let Some(connections) = connections {
        drop(store);
        drop(floor);
        db.wait_closed().await;
        let (commits_after, rollbacks_after) = db.commits().await;
        let overhead = connections
            * (ctx.overhead.per_connection
                + ctx.overhead.per_prepare * kind.prepared_per_connection());
        let total = load.total.max(1) as f64;
        (
            Some(((commits_after - commits_before) as f64 - overhead).max(0.0) / total),
            Some((rollbacks_after - rollbacks_before) as f64 / total),
        )
    } else {
        (None, None)
    };

    let n = load.measured.max(1) as f64;
    let pg_ticks: u64 = load
        .end
        .pg
        .iter()
        .map(|(pid, t)| t.saturating_sub(load.start.pg.get(pid).copied().unwrap_or(0)))
        .sum();
    let busy = (load.end.busy - load.start.busy) as f64;
    let total = (load.end.total - load.start.total).max(1) as f64;
    let outcomes = load
        .outcomes
        .iter()
        .filter(|_| kind.over_http())
        .map(|(k, v)| format!("{k}: {:.0}%", *v as f64 * 100.0 / n))
        .collect::<Vec<_>>()
        .join(", ");
    if let Some(e) = &load.first_error {
        eprintln!("  {} c={c}: {} errors, first: {e}", kind.id(), load.errors);
    }
    RowResult {
        kind,
        c,
        requests: load.measured,
        rps: load.measured as f64 / load.window,
        p50_ms: percentile(&load.latencies, 0.50),
        p99_ms: percentile(&load.latencies, 0.99),
        statements,
        commits: if kind.uses_db() { commits } else { Some(0.0) },
        rollbacks,
        app_cpu_us: (load.end.app - load.start.app) as f64 * TICK_US / n,
        pg_cpu_us: pg_ticks as f64 * TICK_US / n,
        machine_busy: busy / total,
        other_cpu: (busy - (load.end.app - load.start.app) as f64 - pg_ticks as f64).max(0.0)
            / total,
        rps_min: 0.0,
        rps_max: 0.0,
        ratio_floor: None,
        ratio_bare: None,
        errors: load.errors,
        outcomes,
        rss_mib: memory_kib("VmRSS") as f64 / 1024.0,
    }
}

/// A `/proc/self/status` figure in KiB (`VmRSS`: resident now).
fn memory_kib(field: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            status.lines().find_map(|line| {
                let rest = line.strip_prefix(field)?.strip_prefix(':')?;
                rest.trim().trim_end_matches("kB").trim().parse().ok()
            })
        })
        .unwrap_or(0)
}

// ---------------------------------------------------------------------------------------
// Set-up: the schema, the payments table, the keys to replay.
// ---------------------------------------------------------------------------------------

async fn precreate_replays(ctx: &Ctx) {
    let store = ctx.store();
    let app = Router::new()
        .route("/payments", post(create))
        .layer(IdempotencyLayer::new(store.clone()));
    let srv = serve(app).await;
    complete_replay_keys(&srv, ctx.settings.replay_keys, None).await;
    srv.shutdown().await;
    store.pool().close();
}

/// Sends `replay-0` … `replay-{n-1}` once each (with `cookie`, if any), 16 at a time.
async fn complete_replay_keys(srv: &Server, n: usize, cookie: Option<&str>) {
    let uri: Arc<str> = Arc::from(format!("http://{}/payments", srv.addr));
    let cookie: Option<Arc<str>> = cookie.map(Arc::from);
    let client = http_client();
    let next = Arc::new(AtomicU64::new(0));
    let n = n as u64;
    let mut tasks = Vec::new();
    for _ in 0..16 {
        let (client, uri, next, cookie) =
            (client.clone(), uri.clone(), next.clone(), cookie.clone());
        tasks.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= n {
                    break;
                }
                let outcome = send(
                    &client,
                    &uri,
                    Some(&format!("replay-{i}")),
                    cookie.as_deref(),
                )
                .await
                .expect("pre-create a key");
                assert_eq!(outcome, "201", "pre-create a key");
            }
        }));
    }
    for t in tasks {
        t.await.expect("pre-create");
    }
}

// ---------------------------------------------------------------------------------------
// The peer: `axum-idempotent` over `ruts`' PostgreSQL session store.
//
// It keeps a key's response as a field of the session the request carries, and caches
// nothing for a request without a session; so each worker logs in first (`POST /login`,
// which writes a field of a new session and answers with its cookie), before any row
// runs, and sends that cookie with every request, as a logged-in browser would.
// ---------------------------------------------------------------------------------------

/// The session cookie's name.
const PEER_COOKIE: &str = "session";
/// The session table, in a schema of its own (`<schema>_peer`).
const PEER_TABLE: &str = "sessions";
/// How long a session's fields, and so a cached response, live: as long as our keys.
const PEER_TTL_SECS: i64 = TTL_MS / 1000;

struct Peer {
    schema: String,
    /// `name=value` of a session cookie for each worker, and one more for the race.
    cookies: Vec<String>,
}

/// A sqlx pool of `size` connections, opened on demand as the store's deadpool pool is,
/// and like it handing out an idle connection without a round trip to test it (sqlx's
/// default pings each one first: that round trip is left out, in the peer's favour,
/// unless `BENCH_SQLX_TEST_BEFORE_ACQUIRE=true` asks for sqlx's default, to measure it).
fn peer_pool(url: &str, size: usize) -> PgPool {
    let options: PgConnectOptions = url.parse().expect("BENCH_DATABASE_URL, for sqlx");
    PgPoolOptions::new()
        .max_connections(u32::try_from(size).expect("pool size"))
        .test_before_acquire(env_or("BENCH_SQLX_TEST_BEFORE_ACQUIRE", false))
        .connect_lazy_with(options)
}

async fn peer_store(pool: PgPool, schema: &str, create_table: bool) -> Arc<SessionPgStore> {
    let store = PostgresStoreBuilder::new(pool)
        .schema_name(schema)
        .expect("schema name")
        .table_name(PEER_TABLE)
        .expect("table name")
        .create_table(create_table)
        .build()
        .await
        .expect("the session store");
    Arc::new(store)
}

/// The key from the `Idempotency-Key` header, as ours; a response kept as long as ours;
/// a replay marked with our header, which the clients count replays by.
fn peer_options() -> IdempotentOptions {
    IdempotentOptions::default()
        .use_idempotency_key_header(Some("idempotency-key"), false)
        .expire_after(PEER_TTL_SECS)
        .replay_header_name("idempotent-replayed")
}

/// The app with the peer's layers in the order its documentation gives (cookies, then
/// sessions, then idempotency): `/payments`, and `/login`.
fn peer_router(store: Arc<SessionPgStore>, payments: MethodRouter) -> Router {
    Router::new()
        .route("/payments", payments)
        .route("/login", post(peer_login))
        .layer(IdempotentLayer::<SessionPgStore>::new(peer_options()))
        .layer(
            SessionLayer::new(store)
                .with_cookie_options(CookieOptions::build().name(PEER_COOKIE).path("/")),
        )
        .layer(CookieManagerLayer::new())
}

async fn peer_login(session: Session<SessionPgStore>) -> Response {
    let ttl = match Ttl::new(PEER_TTL_SECS) {
        Ok(ttl) => ttl,
        Err(e) => return internal(e),
    };
    match session
        .set("customer", &"cus_8e03978e40d5", ttl, None)
        .await
    {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => internal(e),
    }
}

/// Logs in; the session cookie, `name=value`.
async fn login(client: &HttpClient, addr: SocketAddr) -> String {
    let req = http::Request::post(format!("http://{addr}/login"))
        .body(Full::new(Bytes::new()))
        .expect("the login request");
    let res = client.request(req).await.expect("log in");
    assert_eq!(res.status(), StatusCode::NO_CONTENT, "log in");
    let cookie = res
        .headers()
        .get(http::header::SET_COOKIE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .expect("a session cookie")
        .trim()
        .to_owned();
    assert!(
        cookie.starts_with(&format!("{PEER_COOKIE}=")),
        "the session cookie: {cookie}"
    );
    cookie
}

/// The peer's session table; a session logged in for each worker of the largest
/// concurrency, and one for the race; the keys to replay completed through the peer in
/// the first session, and their stored responses copied to every other session, as if
/// each had completed them.
async fn peer_setup(ctx: &Ctx) -> Peer {
    let schema = format!("{}_peer", ctx.schema);
    let pool = peer_pool(&ctx.db.row_url, 4);
    let store = peer_store(pool.clone(), &schema, true).await;
    let srv = serve(peer_router(store.clone(), post(create))).await;
    let client = http_client();
    let workers = ctx.settings.concurrency.iter().copied().max().unwrap_or(1);
    let mut cookies = Vec::with_capacity(workers + 1);
    for _ in 0..=workers {
        cookies.push(login(&client, srv.addr).await);
    }
    complete_replay_keys(&srv, ctx.settings.replay_keys, Some(&cookies[0])).await;
    let table = format!("\"{schema}\".\"{PEER_TABLE}\"");
    let copied = sqlx::query(&format!(
        "INSERT INTO {table} (session_id, field, value, hot_cache_ttl, expires_at)
         SELECT other.session_id, done.field, done.value, done.hot_cache_ttl, done.expires_at
           FROM {table} done
           JOIN {table} other ON other.field = 'customer' AND other.session_id <> done.session_id
          WHERE done.field LIKE 'idem:replay-%'"
    ))
    .execute(&pool)
    .await
    .expect("copy the stored responses to every session")
    .rows_affected();
    assert_eq!(
        copied,
        (workers * ctx.settings.replay_keys) as u64,
        "stored responses copied"
    );
    sqlx::query(&format!("ANALYZE {table}"))
        .execute(&pool)
        .await
        .expect("analyze the session table");
    srv.shutdown().await;
    drop(store);
    pool.close().await;
    Peer { schema, cookies }
}

// ---------------------------------------------------------------------------------------
// The race: duplicates of one key sent at once, each on a connection of its own opened
// beforehand; how many times the handler ran. The handler is the rows' (it answers at
// once, which leaves a check-then-write design the narrowest window).
// ---------------------------------------------------------------------------------------

#[derive(Clone, Copy)]
enum Racer {
    Lease,
    Tx,
    Peer,
}

const RACERS: [Racer; 3] = [Racer::Lease, Racer::Tx, Racer::Peer];

impl Racer {
    fn id(self) -> &'static str {
        match self {
            Racer::Lease => "lease",
            Racer::Tx => "tx",
            Racer::Peer => "peer",
        }
    }

    fn label(self) -> &'static str {
        match self {
            Racer::Lease => "(c) lease mode",
            Racer::Tx => "(d) transactional",
            Racer::Peer => "(k) peer: axum-idempotent on ruts' PostgresStore",
        }
    }
}

struct RaceResult {
    racer: Racer,
    /// The handler's runs in each round.
    runs: Vec<u64>,
    outcomes: BTreeMap<String, u64>,
    errors: u64,
}

async fn race(ctx: &Ctx, racer: Racer) -> RaceResult {
    let n = ctx.settings.race_duplicates;
    let counted = Counted {
        runs: Arc::new(AtomicU64::new(0)),
        sql: ctx.sql.clone(),
    };
    let mut store: Option<PostgresStore> = None;
    let mut peer_db: Option<PgPool> = None;
    let mut cookie = String::new();
    let router = match racer {
        Racer::Lease | Racer::Tx => {
            let st = ctx.store();
            store = Some(st.clone());
            if let Racer::Lease = racer {
                Router::new()
                    .route("/payments", post(create_counted))
                    .with_state(counted.clone())
                    .layer(IdempotencyLayer::new(st))
            } else {
                Router::new()
                    .route("/payments", post(create_in_tx_counted))
                    .with_state(counted.clone())
                    .layer(IdempotencyLayer::transactional(st))
            }
        }
        Racer::Peer => {
            let peer = ctx.peer.as_ref().expect("the peer's sessions");
            cookie = peer.cookies.last().expect("the race's session").clone();
            let pool = peer_pool(&ctx.db.row_url, ctx.settings.pool_size);
            peer_db = Some(pool.clone());
            peer_router(
                peer_store(pool, &peer.schema, false).await,
                post(create_counted).with_state(counted.clone()),
            )
        }
    };
    let srv = serve(router).await;
    let wire = Arc::new(wire::Clients::with_cookies(srv.addr, vec![cookie; n]));
    // Every connection opened first, by a request without a key.
    let opened: Vec<_> = (0..n)
        .map(|w| {
            let wire = wire.clone();
            tokio::spawn(async move {
                let _ = wire.post(w, None, REQUEST_BODY).await;
            })
        })
        .collect();
    for t in opened {
        t.await.expect("open a connection");
    }
    let mut result = RaceResult {
        racer,
        runs: Vec::new(),
        outcomes: BTreeMap::new(),
        errors: 0,
    };
    for round in 0..ctx.settings.race_trials {
        counted.runs.store(0, Ordering::SeqCst);
        let key: Arc<str> = Arc::from(format!("race-{}-{round}", racer.id()));
        let barrier = Arc::new(Barrier::new(n));
        let sent: Vec<_> = (0..n)
            .map(|w| {
                let (wire, key, barrier) = (wire.clone(), key.clone(), barrier.clone());
                tokio::spawn(async move {
                    barrier.wait().await;
                    outcome(wire.post(w, Some(&key), REQUEST_BODY).await?)
                })
            })
            .collect();
        for t in sent {
            match t.await.expect("a duplicate") {
                Ok(o) => *result.outcomes.entry(o).or_default() += 1,
                Err(e) => {
                    if result.errors == 0 {
                        eprintln!("  race {}: first error: {e}", racer.id());
                    }
                    result.errors += 1;
                }
            }
        }
        result.runs.push(counted.runs.load(Ordering::SeqCst));
    }
    srv.shutdown().await;
    if let Some(st) = store {
        st.pool().close();
    }
    if let Some(pool) = peer_db {
        pool.close().await;
    }
    ctx.db.wait_closed().await;
    result
}

fn print_race(results: &[RaceResult], n: usize) {
    println!();
    println!("The race: {n} duplicates of one key at once, the handler's runs in each round");
    println!();
    println!("| layer | handler runs per round | outcomes over the rounds |");
    println!("|---|---|---|");
    for r in results {
        let total: u64 = r.outcomes.values().sum::<u64>() + r.errors;
        let mut outcomes = r
            .outcomes
            .iter()
            .map(|(k, v)| format!("{k}: {v}"))
            .collect::<Vec<_>>()
            .join(", ");
        if r.errors > 0 {
            outcomes.push_str(&format!(", errors: {}", r.errors));
        }
        println!(
            "| {} | {} | {outcomes} (of {total}) |",
            r.racer.label(),
            r.runs
                .iter()
                .map(u64::to_string)
                .collect::<Vec<_>>()
                .join(", "),
        );
    }
}

fn write_race_csv(results: &[RaceResult], n: usize, path: &PathBuf) {
    let mut out = String::from("layer,label,duplicates,round,handler_runs\n");
    for r in results {
        for (round, runs) in r.runs.iter().enumerate() {
            out.push_str(&format!(
                "{},\"{}\",{n},{round},{runs}\n",
                r.racer.id(),
                r.racer.label()
            ));
        }
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).expect("create the output directory");
    }
    std::fs::write(path, out).expect("write the race's CSV");
}

// ---------------------------------------------------------------------------------------
// Output
// ---------------------------------------------------------------------------------------

fn fmt_opt(v: Option<f64>, digits: usize) -> String {
    v.map_or("—".into(), |v| format!("{v:.digits$}"))
}

fn print_table(results: &[RowResult]) {
    println!();
    println!(
        "| row | c | req/s (min–max) | p50 ms | p99 ms | stmts/req | commits/req | app CPU µs/req | PG CPU µs/req | × floor | × bare | outcomes |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|");
    for kind in KINDS {
        for r in results.iter().filter(|r| r.kind == kind) {
            let (floor, bare) = (r.ratio_floor, r.ratio_bare);
            let mut outcomes = r.outcomes.clone();
            if r.errors > 0 {
                outcomes.push_str(&format!(" errors: {}", r.errors));
            }
            println!(
                "| {} | {} | {:.0} ({:.0}–{:.0}) | {:.2} | {:.2} | {} | {} | {:.0} | {:.0} | {} | {} | {} |",
                r.kind.label(),
                r.c,
                r.rps,
                r.rps_min,
                r.rps_max,
                r.p50_ms,
                r.p99_ms,
                fmt_opt(r.statements, 2),
                fmt_opt(r.commits, 2),
                r.app_cpu_us,
                r.pg_cpu_us,
                fmt_opt(floor, 2),
                fmt_opt(bare, 2),
                outcomes,
            );
        }
    }
}

/// Our rows beside the peer's, at each concurrency: throughput over the peer's, paired
/// by round, and the CPU each spends per request, the app's and PostgreSQL's.
fn print_against_peer(results: &[RowResult], against: &[(Kind, usize, Kind, f64)]) {
    if against.is_empty() {
        return;
    }
    let find = |kind: Kind, c: usize| results.iter().find(|r| r.kind == kind && r.c == c);
    println!();
    println!(
        "| row | c | × the peer's req/s | req/s | app CPU µs/req | PG CPU µs/req | the peer's req/s | its app CPU µs/req | its PG CPU µs/req |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    for &(kind, c, peer, ratio) in against {
        let (Some(ours), Some(theirs)) = (find(kind, c), find(peer, c)) else {
            continue;
        };
        println!(
            "| {} | {c} | {ratio:.2} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} |",
            kind.label(),
            ours.rps,
            ours.app_cpu_us,
            ours.pg_cpu_us,
            theirs.rps,
            theirs.app_cpu_us,
            theirs.pg_cpu_us,
        );
    }
}

fn write_csv(results: &[RowResult], path: &PathBuf) {
    let mut out = String::from(
        "row,label,concurrency,requests,rps,rps_min,rps_max,p50_ms,p99_ms,statements_per_req,commits_per_req,rollbacks_per_req,app_cpu_us_per_req,pg_cpu_us_per_req,machine_busy,other_cpu,ratio_floor,ratio_bare,errors,outcomes,rss_mib\n",
    );
    for r in results {
        let (floor, bare) = (r.ratio_floor, r.ratio_bare);
        let opt = |v: Option<f64>| v.map_or(String::new(), |v| format!("{v:.4}"));
        out.push_str(&format!(
            "{},\"{}\",{},{},{:.1},{:.1},{:.1},{:.4},{:.4},{},{},{},{:.1},{:.1},{:.3},{:.3},{},{},{},\"{}\",{:.1}\n",
            r.kind.id(),
            r.kind.label().replace('"', "\"\""),
            r.c,
            r.requests,
            r.rps,
            r.rps_min,
            r.rps_max,
            r.p50_ms,
            r.p99_ms,
            opt(r.statements),
            opt(r.commits),
            opt(r.rollbacks),
            r.app_cpu_us,
            r.pg_cpu_us,
            r.machine_busy,
            r.other_cpu,
            opt(floor),
            opt(bare),
            r.errors,
            r.outcomes,
            r.rss_mib,
        ));
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).expect("create the output directory");
    }
    std::fs::write(path, out).expect("write the CSV");
}

// ---------------------------------------------------------------------------------------
// Split cores (`BENCH_CORES=split`): PostgreSQL alone on the first CPU, the app and the
// load generator on the others, as when the database has a machine of its own. Pinned
// with `taskset`; PostgreSQL's processes get every CPU back when the run ends.
// ---------------------------------------------------------------------------------------

fn split_cores() -> bool {
    match env_or("BENCH_CORES", "shared".to_owned()).as_str() {
        "shared" => false,
        "split" => true,
        other => panic!("BENCH_CORES={other:?}: shared or split"),
    }
}

fn app_cpus() -> String {
    let n = cpus_of_machine();
    assert!(n >= 2, "BENCH_CORES=split needs at least 2 CPUs");
    format!("1-{}", n - 1)
}

/// Pins every thread of `pid` to `cpus` (a `taskset` CPU list); whether it could.
fn try_pin(pid: i32, cpus: &str) -> bool {
    std::process::Command::new("taskset")
        .args(["--all-tasks", "--cpu-list", "--pid", cpus, &pid.to_string()])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|status| status.success())
}

fn pin(pid: i32, cpus: &str) {
    assert!(
        try_pin(pid, cpus),
        "taskset (util-linux) could not pin process {pid} to CPUs {cpus}: pinning PostgreSQL needs its user or root"
    );
}

/// The parent process of `pid`.
fn parent_of(pid: i32) -> Option<i32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat[stat.rfind(')')? + 2..]
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// The postmaster and its children (backends started later inherit its CPUs).
struct PinnedPostgres {
    postmaster: i32,
}

impl PinnedPostgres {
    async fn pin(db: &Db) -> Self {
        let backend: i32 = db
            .base
            .admin
            .query_one("SELECT pg_backend_pid()", &[])
            .await
            .expect("pg_backend_pid")
            .get(0);
        let postmaster = parent_of(backend).expect("the postmaster's pid");
        let pinned = Self { postmaster };
        pinned.set("0");
        eprintln!(
            "split cores: PostgreSQL (postmaster {postmaster}) on CPU 0, this process on CPUs {}",
            app_cpus()
        );
        pinned
    }

    fn set(&self, cpus: &str) {
        pin(self.postmaster, cpus);
        for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
            let Some(pid) = entry.file_name().to_str().and_then(|p| p.parse().ok()) else {
                continue;
            };
            if parent_of(pid) == Some(self.postmaster) {
                // A backend may exit in between: nothing to pin then.
                try_pin(pid, cpus);
            }
        }
    }
}

impl Drop for PinnedPostgres {
    fn drop(&mut self) {
        self.set(&format!("0-{}", cpus_of_machine() - 1));
    }
}

/// Every CPU of the machine, whatever this process is pinned to.
fn cpus_of_machine() -> usize {
    std::fs::read_to_string("/proc/stat")
        .unwrap_or_default()
        .lines()
        .filter(|l| l.starts_with("cpu") && l.as_bytes().get(3).is_some_and(u8::is_ascii_digit))
        .count()
        .max(1)
}

// ---------------------------------------------------------------------------------------

fn main() {
    // Started again as the delay proxy (`BENCH_DB_DELAY_US`)?
    delay::serve_if_asked();
    // `cargo bench` passes `--bench`; nothing else is read from the command line.
    // Pinned before the runtime starts, so that its workers (one per CPU it may use)
    // are pinned too.
    if split_cores() {
        pin(std::process::id() as i32, &app_cpus());
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(run());
}

async fn run() {
    let settings = Settings::from_env();
    let proxy = (!settings.db_delay.is_zero()).then(|| {
        let proxy = delay::DelayProxy::start(address_of(&settings.url), settings.db_delay);
        eprintln!(
            "the rows reach PostgreSQL through a proxy ({}) that holds each direction for {} µs",
            proxy.addr,
            settings.db_delay.as_micros()
        );
        proxy
    });
    let db = Db::open(
        &settings.url,
        proxy.as_ref().map(|p| p.addr),
        settings.commit_delay,
    )
    .await;
    let _postgres_pinned = if split_cores() {
        Some(PinnedPostgres::pin(&db).await)
    } else {
        None
    };
    let schema = format!(
        "bench_{}_{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs())
    );

    eprintln!("calibrating the commit counters ...");
    let overhead = calibrate(&db).await;
    eprintln!(
        "  a connection's start-up = {:.2} commits, a prepared statement = {:.2}",
        overhead.per_connection, overhead.per_prepare
    );

    let setup = PostgresStore::new(pool_for_url(&db.row_url, 2).expect("pool"))
        .with_schema_name(&schema)
        .expect("schema name");
    setup.migrate().await.expect("migrate");
    let table = setup.table().to_owned();
    setup
        .pool()
        .get()
        .await
        .expect("connection")
        .batch_execute(&format!(
            "CREATE TABLE \"{schema}\".payments (
                 id text PRIMARY KEY,
                 amount bigint NOT NULL,
                 currency text NOT NULL,
                 created_at timestamptz NOT NULL DEFAULT now())"
        ))
        .await
        .expect("create the payments table");
    let sql = Arc::new(Sql::new(&setup, &schema));
    setup.pool().close();
    drop(setup);

    let mut ctx = Ctx {
        sql,
        settings,
        db,
        schema,
        table,
        overhead,
        peer: None,
    };
    eprintln!(
        "schema {}, table {}; pre-creating {} keys to replay ...",
        ctx.schema, ctx.table, ctx.settings.replay_keys
    );
    precreate_replays(&ctx).await;

    // All rows by default, except the experiment (j‴), which runs only when named; the
    // race too, unless rows are named without it.
    let named = ctx.settings.rows.clone();
    let selected = |k: Kind| match named.as_ref() {
        Some(rows) => rows.iter().any(|r| r == k.id()),
        None => k != Kind::FloorReplayShared,
    };
    let race_selected = ctx.settings.race_trials > 0
        && named
            .as_ref()
            .is_none_or(|rows| rows.iter().any(|r| r == "race"));
    if selected(Kind::Peer) || selected(Kind::PeerReplay) || race_selected {
        eprintln!(
            "the peer: schema {}_peer; logging in, completing {} keys to replay ...",
            ctx.schema, ctx.settings.replay_keys
        );
        ctx.peer = Some(peer_setup(&ctx).await);
    }
    let ctx = ctx;
    let mut runs: Vec<Vec<RowResult>> = Vec::new();
    // Memory must not grow with the keys the layer has seen: resident memory before the
    // rows and after each.
    let rss_before = memory_kib("VmRSS") as f64 / 1024.0;
    let mut keys_seen = 0u64;
    for round in 1..=ctx.settings.repeat {
        eprintln!("round {round} of {}", ctx.settings.repeat);
        let mut slot = 0;
        for &c in &ctx.settings.concurrency {
            for kind in RUN_ORDER {
                if !selected(kind) || (kind == Kind::Dup && c < 2) {
                    continue;
                }
                let r = run_row(&ctx, kind, c, round).await;
                eprintln!(
                    "{:>22} c={c:<3} {:>8.0} req/s  p50 {:>6.2} ms  p99 {:>6.2} ms  stmts {}  commits {}  app {:.0} µs  pg {:.0} µs  other {:.0}%  rss {:.1} MiB",
                    kind.id(),
                    r.rps,
                    r.p50_ms,
                    r.p99_ms,
                    fmt_opt(r.statements, 2),
                    fmt_opt(r.commits, 2),
                    r.app_cpu_us,
                    r.pg_cpu_us,
                    r.other_cpu * 100.0,
                    r.rss_mib
                );
                if kind.guarded() {
                    keys_seen += r.requests;
                }
                if round == 1 {
                    runs.push(Vec::new());
                }
                runs[slot].push(r);
                slot += 1;
            }
        }
    }
    // Ratios are paired: row and floor of the same round (they ran seconds apart), then
    // the median over the rounds.
    let median = |mut v: Vec<f64>| -> Option<f64> {
        v.sort_by(f64::total_cmp);
        (!v.is_empty()).then(|| v[v.len() / 2])
    };
    let paired = |slot: &Vec<RowResult>, other: Kind| -> Option<f64> {
        let theirs = runs
            .iter()
            .find(|rs| rs[0].kind == other && rs[0].c == slot[0].c)?;
        median(
            slot.iter()
                .zip(theirs)
                .map(|(a, b)| a.rps / b.rps)
                .collect(),
        )
    };
    // Against the peer: our rows over the peer's of the same round, then the median.
    let against_peer: Vec<(Kind, usize, Kind, f64)> = runs
        .iter()
        .filter_map(|rs| {
            let kind = rs[0].kind;
            let peer = match kind {
                Kind::Lease
                | Kind::LeaseShared
                | Kind::LeaseUnbatched
                | Kind::Tx
                | Kind::HttpFloorLease => Kind::Peer,
                Kind::Replay
                | Kind::ReplayShared
                | Kind::ReplayUnbatched
                | Kind::HttpFloorReplay
                | Kind::HttpFloorSelect => Kind::PeerReplay,
                _ => return None,
            };
            paired(rs, peer).map(|ratio| (kind, rs[0].c, peer, ratio))
        })
        .collect();
    let ratios: Vec<(Option<f64>, Option<f64>)> = runs
        .iter()
        .map(|rs| {
            let kind = rs[0].kind;
            (
                kind.floor().and_then(|f| paired(rs, f)),
                if kind.over_http() {
                    paired(rs, Kind::Bare)
                } else {
                    None
                },
            )
        })
        .collect();
    // Each row: the round with the median throughput, and the spread over the rounds.
    let results: Vec<RowResult> = runs
        .into_iter()
        .zip(ratios)
        .map(|(mut rs, (ratio_floor, ratio_bare))| {
            rs.sort_by(|a, b| a.rps.total_cmp(&b.rps));
            let (min, max) = (rs[0].rps, rs[rs.len() - 1].rps);
            let mut median = rs.swap_remove(rs.len() / 2);
            median.rps_min = min;
            median.rps_max = max;
            median.ratio_floor = ratio_floor;
            median.ratio_bare = ratio_bare;
            median
        })
        .collect();

    print_table(&results);
    print_against_peer(&results, &against_peer);
    if race_selected {
        let mut raced = Vec::new();
        for racer in RACERS {
            eprintln!("race: {}", racer.id());
            raced.push(race(&ctx, racer).await);
        }
        print_race(&raced, ctx.settings.race_duplicates);
        let csv = ctx.settings.out_dir.join("e2e-race.csv");
        write_race_csv(&raced, ctx.settings.race_duplicates, &csv);
        eprintln!("wrote {}", csv.display());
    }
    println!(
        "\nmemory: resident {rss_before:.1} MiB before the rows, {:.1} MiB after them; {keys_seen} keyed requests measured through the layer",
        memory_kib("VmRSS") as f64 / 1024.0,
    );
    let csv = ctx.settings.out_dir.join("e2e.csv");
    write_csv(&results, &csv);
    eprintln!("\nwrote {}", csv.display());

    // The schema (and the database, if this run created it) goes.
    ctx.db.wait_closed().await;
    let (cleanup, conn) = ctx
        .settings
        .url
        .parse::<tokio_postgres::Config>()
        .expect("url")
        .connect(NoTls)
        .await
        .expect("connect");
    let conn = tokio::spawn(conn);
    cleanup
        .batch_execute(&format!(
            "DROP SCHEMA \"{0}\" CASCADE; DROP SCHEMA IF EXISTS \"{0}_peer\" CASCADE",
            ctx.schema
        ))
        .await
        .expect("drop the schemas");
    drop(cleanup);
    let _ = conn.await;
    ctx.db.wait_closed().await;
    ctx.db.drop_database().await;
}
