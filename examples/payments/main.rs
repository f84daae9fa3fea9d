//! A payments service behind `IdempotencyLayer`: the crate's demo.
//!
//! ```text
//! cargo run --release --example payments -- [--addr 127.0.0.1:3000] [--database-url URL]
//!     [--lease-ms N] [--schema NAME] [--mode lease|transactional] [--wait-ms N]
//!     [--memory-max-keys N] [--transaction-pooler] [--listen-url URL]
//!     [--encryption-key HEX] [--retention-secs N] [--remember-secs N]
//!     [--print-migration-sql] [--resumable] [--driver tokio-postgres|sqlx]
//! ```
//!
//! With `DATABASE_URL` or `--database-url` it keeps keys, payments and counters in
//! PostgreSQL (migrated on start; several processes may share one database). With
//! neither it runs on the in-memory store, which keeps at most `--memory-max-keys` keys
//! (100 000 by default) or 64 MiB of them, evicting the completed keys soonest to expire
//! first; the demo's own ledger of charges and payments keeps as many, its counters
//! counting them all. However many distinct keys it is sent, its memory stays bounded.
//!
//! - `POST /payments` (Idempotency-Key required), body
//!   `{"amount": 1250, "currency": "EUR", "delay_ms": 0}` → `201`
//!   `{"payment_id", "charge_id", "amount", "currency"}`. A key the fake provider
//!   charged under for another amount or currency (its first payment failed after the
//!   charge, and was released) gets a 422 that is not stored.
//!   `Authorization: Bearer <account>.<secret>` names the payment's account (a
//!   stand-in for a token check; a token without a dot names itself): keys are scoped
//!   by account, so a retry with a refreshed token (`Bearer acct7.second` after
//!   `Bearer acct7.first`) is replayed, and another account's key is its own. Without
//!   `Authorization` (or with another scheme) keys are scoped as the layer does by
//!   default.
//! - `GET /stats` → `{"handler_runs", "psp_calls", "charges", "payments"}`.
//! - `GET /stats/store` → the idempotency store's counters (PostgreSQL): statements,
//!   notifications received, waiters woken by a notification or by the fallback timer.
//!
//! `--print-migration-sql` prints the idempotency store's migrations as SQL for
//! `--schema` (what a team applies with its own migration tool, then checks with
//! `PostgresStore::verify`), and exits; nothing connects.
//!
//! `--mode transactional` (PostgreSQL only) records the payment inside the request's
//! idempotency transaction; `--wait-ms N` makes duplicates wait up to N ms (in
//! transactional mode, at least the 5 s lock timeout) for the
//! first request instead of answering 409.
//!
//! In lease mode the provider's charge is a recorded step
//! (`IdempotencyKey::try_step`): a retry of a payment whose process died after the
//! charge gets the charge without calling the provider again. `--resumable`
//! (PostgreSQL, lease mode) registers `POST /payments` as resumable and runs its
//! completer: a payment whose process died mid-way is finished by another demo process
//! started with `--resumable` (within about a second and a half of the death), even if
//! the client never retries, and its retry gets the replay.
//!
//! `--encryption-key HEX` (64 hex digits: 32 bytes, `openssl rand -hex 32`) seals the
//! stored responses under that key (id 1) and stores keys hashed: nothing of a
//! payment's response, nor its key, can be read in the idempotency table. Give every
//! process that shares the database the same key.
//!
//! `--driver sqlx` (built with the `sqlx` feature; not with `--resumable`) keeps the
//! idempotency keys through a `sqlx::PgPool` of its own (`SqlxStore`) instead of
//! tokio-postgres (the default, `--driver tokio-postgres`): the same table, so processes
//! of either driver share one database. With `--mode transactional` the payment is
//! recorded through the request's `SqlxTransaction`; the rest of the demo's ledger
//! stays on tokio-postgres, and `GET /stats/store` counts the tokio-postgres store's
//! statements only.
//!
//! `--retention-secs N` keeps a payment's response N seconds (the layer's TTL; 24 h by
//! default); `--remember-secs N` remembers its key N seconds more once the response is
//! gone (7 days by default; 0: not at all). A retry in that time is refused with `410
//! response-expired`, never charged again; after it, the key is new.

mod backend;

use std::{net::SocketAddr, process::ExitCode, time::Duration};

use axum::{
    Json, Router,
    extract::{Request, State},
    http::{HeaderMap, StatusCode, header},
    middleware::{self, Next},
    response::{IntoResponse, Response},
    routing::{get, post},
};
use serde_json::{Value, json};
use tower_idempotency::{
    IdempotencyKey, IdempotencyLayer, NoStore, Principal, StepError, encryption::EncryptionKeys,
    store::MemoryStore, transactional::TransactionHandle,
};

use backend::{Backend, Charged};

/// The header on a response the layer does not store (marked [`NoStore`]): its key is
/// released, so that a retry with the payment's first body can still complete it.
const NOT_STORED: &str = "payments-demo-not-stored";

struct Args {
    addr: SocketAddr,
    database_url: Option<String>,
    lease_ms: u64,
    schema: String,
    transactional: bool,
    wait_ms: u64,
    memory_max_keys: usize,
    /// `--database-url` is a transaction-pooling PgBouncer.
    transaction_pooler: bool,
    /// The database itself, for `LISTEN` behind a transaction pooler.
    listen_url: Option<String>,
    /// Seals stored responses, and hashes keys, under this key (id 1).
    encryption_key: Option<[u8; 32]>,
    /// How long a payment's response is kept (the layer's TTL).
    retention: Duration,
    /// How long a key is remembered once its response is gone.
    remember: Duration,
    /// Print the store's migrations as SQL, and exit.
    print_migration_sql: bool,
    /// Register the payments route as resumable, and run its completer.
    resumable: bool,
    /// The idempotency store's driver is sqlx (`SqlxStore`), not tokio-postgres.
    sqlx: bool,
}

const USAGE: &str = "usage: payments [--addr 127.0.0.1:3000] [--database-url URL] [--lease-ms N] [--schema NAME] [--mode lease|transactional] [--wait-ms N] [--memory-max-keys N] [--transaction-pooler] [--listen-url URL] [--encryption-key HEX] [--retention-secs N] [--remember-secs N] [--print-migration-sql] [--resumable] [--driver tokio-postgres|sqlx]";

/// 64 hex digits as 32 bytes.
fn parse_key(hex: &str) -> Result<[u8; 32], String> {
    let digits = hex.as_bytes();
    let mut key = [0u8; 32];
    if digits.len() != 64 {
        return Err(format!(
            "--encryption-key: expected 64 hex digits (32 bytes), got {}",
            digits.len()
        ));
    }
    for (byte, pair) in key.iter_mut().zip(digits.chunks(2)) {
        let pair = std::str::from_utf8(pair).ok();
        *byte = pair
            .and_then(|p| u8::from_str_radix(p, 16).ok())
            .ok_or("--encryption-key: expected 64 hex digits (0-9, a-f)")?;
    }
    Ok(key)
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        addr: SocketAddr::from(([127, 0, 0, 1], 3000)),
        database_url: std::env::var("DATABASE_URL").ok().filter(|u| !u.is_empty()),
        lease_ms: 30_000,
        schema: "payments_demo".into(),
        transactional: false,
        wait_ms: 0,
        memory_max_keys: MemoryStore::DEFAULT_MAX_ENTRIES,
        transaction_pooler: false,
        listen_url: None,
        encryption_key: None,
        retention: Duration::from_secs(24 * 3600),
        remember: tower_idempotency::store::DEFAULT_REMEMBER,
        print_migration_sql: false,
        resumable: false,
        sqlx: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = |name: &str| {
            it.next()
                .ok_or_else(|| format!("{name} needs a value\n{USAGE}"))
        };
        match flag.as_str() {
            "--addr" => {
                let v = value("--addr")?;
                args.addr = v.parse().map_err(|e| format!("--addr {v:?}: {e}"))?;
            }
            "--database-url" => args.database_url = Some(value("--database-url")?),
            "--lease-ms" => {
                let v = value("--lease-ms")?;
                args.lease_ms = v.parse().ok().filter(|ms| *ms >= 10).ok_or_else(|| {
                    format!("--lease-ms {v:?}: expected milliseconds, at least 10")
                })?;
            }
            "--schema" => args.schema = value("--schema")?,
            "--mode" => {
                args.transactional = match value("--mode")?.as_str() {
                    "lease" => false,
                    "transactional" => true,
                    other => {
                        return Err(format!("--mode {other:?}: expected lease or transactional"));
                    }
                }
            }
            "--wait-ms" => {
                let v = value("--wait-ms")?;
                args.wait_ms = v
                    .parse()
                    .map_err(|_| format!("--wait-ms {v:?}: expected milliseconds"))?;
            }
            "--memory-max-keys" => {
                let v = value("--memory-max-keys")?;
                args.memory_max_keys = v.parse().ok().filter(|n| *n >= 1).ok_or_else(|| {
                    format!("--memory-max-keys {v:?}: expected a count, at least 1")
                })?;
            }
            "--transaction-pooler" => args.transaction_pooler = true,
            "--listen-url" => args.listen_url = Some(value("--listen-url")?),
            "--encryption-key" => {
                args.encryption_key = Some(parse_key(&value("--encryption-key")?)?)
            }
            "--retention-secs" => {
                let v = value("--retention-secs")?;
                let secs: u64 = v.parse().ok().filter(|&s| s >= 1).ok_or_else(|| {
                    format!("--retention-secs {v:?}: expected seconds, at least 1")
                })?;
                args.retention = Duration::from_secs(secs);
            }
            "--remember-secs" => {
                let v = value("--remember-secs")?;
                let secs: u64 = v
                    .parse()
                    .map_err(|_| format!("--remember-secs {v:?}: expected seconds"))?;
                args.remember = Duration::from_secs(secs);
            }
            "--print-migration-sql" => args.print_migration_sql = true,
            "--resumable" => args.resumable = true,
            "--driver" => {
                args.sqlx = match value("--driver")?.as_str() {
                    "tokio-postgres" => false,
                    "sqlx" => true,
                    other => {
                        return Err(format!(
                            "--driver {other:?}: expected tokio-postgres or sqlx"
                        ));
                    }
                }
            }
            "-h" | "--help" => return Err(USAGE.into()),
            other => return Err(format!("unknown argument {other:?}\n{USAGE}")),
        }
    }
    Ok(args)
}

/// The idempotency store through sqlx (`--driver sqlx`): a pool of its own to `url`
/// and up to 8 connections kept beside it, its statements unnamed behind a
/// transaction pooler, listening on `--listen-url`
/// there, migrated.
#[cfg(feature = "sqlx")]
async fn sqlx_store(
    url: &str,
    args: &Args,
    direct: bool,
) -> Result<tower_idempotency::store::SqlxStore, backend::Error> {
    use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
    use tower_idempotency::store::SqlxStore;

    let pool = |url: &str, size: u32| {
        let options = url.parse::<PgConnectOptions>();
        let pooled = args.transaction_pooler;
        async move {
            let mut options = options?;
            if pooled {
                // Behind a transaction pooler no statement is cached on a connection.
                options = options.statement_cache_capacity(0);
            }
            PgPoolOptions::new()
                .max_connections(size)
                .acquire_timeout(Duration::from_secs(5))
                .connect_with(options)
                .await
        }
    };
    // A few connections kept out of the pool for the store's statements, which then
    // skip the round trip sqlx's pool makes to test each connection given back to it.
    let mut store = SqlxStore::new(pool(url, 32).await?)
        .with_kept_connections(8)
        .with_schema_name(&args.schema)?
        .with_transaction_pooling(args.transaction_pooler)
        .with_background_purge(Some(backend::PURGE_EVERY))
        .remember_keys_for(args.remember);
    if let Some(listen) = &args.listen_url {
        store = store.with_notification_pool(pool(listen, 1).await?);
    }
    store.migrate().await?;
    if args.wait_ms > 0 && direct {
        store.listen().await?;
    }
    Ok(store)
}

#[cfg(not(feature = "sqlx"))]
async fn sqlx_store(
    _: &str,
    _: &Args,
    _: bool,
) -> Result<tower_idempotency::store::PostgresStore, backend::Error> {
    Err("--driver sqlx: this demo was built without the sqlx feature (cargo run --features sqlx --example payments)".into())
}

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,tower_idempotency=info".into()),
        )
        .init();
    let args = match parse_args() {
        Ok(args) => args,
        Err(msg) => {
            eprintln!("{msg}");
            return ExitCode::from(2);
        }
    };
    if args.print_migration_sql {
        return match backend::migration_sql(args.database_url.as_deref(), &args.schema) {
            Ok(sql) => {
                print!("{sql}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("payments: {}", backend::describe(&*e));
                ExitCode::from(2)
            }
        };
    }
    match run(args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("payments: {}", backend::describe(&*e));
            ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> Result<(), backend::Error> {
    if args.resumable && (args.transactional || args.database_url.is_none()) {
        return Err(
            "--resumable needs PostgreSQL (DATABASE_URL or --database-url) and lease mode".into(),
        );
    }
    if args.sqlx && (args.resumable || args.database_url.is_none()) {
        return Err(
            "--driver sqlx needs PostgreSQL (DATABASE_URL or --database-url), without --resumable"
                .into(),
        );
    }
    let lease = Duration::from_millis(args.lease_ms);
    let (backend, layer, store_name) = match &args.database_url {
        Some(url) => {
            let listen_url = args.listen_url.as_deref();
            let (backend, store) = Backend::postgres(
                url,
                &args.schema,
                args.transaction_pooler,
                listen_url,
                args.remember,
            )
            .await?;
            let direct = !args.transaction_pooler || listen_url.is_some();
            if args.wait_ms > 0 && direct {
                // Waiting duplicates are woken by notifications from the first request,
                // whichever process runs it.
                store.listen().await?;
            }
            if !args.transactional && direct && !args.sqlx {
                // From the first payment on, a payment running here when this process
                // dies is taken over by a retry within a second, not after its lease.
                store.start_liveness().await?;
            }
            let name = format!(
                "postgres (schema {}, table {}; keys past their TTL purged every {} s{})",
                args.schema,
                store.table(),
                backend::PURGE_EVERY.as_secs(),
                if args.transaction_pooler {
                    "; through a transaction pooler"
                } else {
                    ""
                }
            );
            let (layer, name) = if args.sqlx {
                let store = sqlx_store(url, &args, direct).await?;
                let layer = if args.transactional {
                    IdempotencyLayer::transactional(store)
                } else {
                    IdempotencyLayer::new(store)
                };
                (layer, format!("{name}; through sqlx"))
            } else if args.transactional {
                (IdempotencyLayer::transactional(store), name)
            } else {
                (IdempotencyLayer::new(store), name)
            };
            (backend, layer, name)
        }
        None if args.transactional => {
            return Err(
                "--mode transactional needs PostgreSQL: set DATABASE_URL or --database-url".into(),
            );
        }
        None => {
            let store = MemoryStore::new()
                .with_max_entries(args.memory_max_keys)
                .remember_keys_for(args.remember);
            let name = format!(
                "memory (in-process; set DATABASE_URL or --database-url to use PostgreSQL); \
                 at most {} keys or {} MiB of them, each kept as long as its retention \
                 unless evicted first to make room; the demo's ledger keeps \
                 the last {} charges and payments",
                store.max_entries(),
                store.max_bytes() >> 20,
                args.memory_max_keys
            );
            (
                Backend::memory(args.memory_max_keys),
                IdempotencyLayer::new(store),
                name,
            )
        }
    };
    let layer = match args.encryption_key {
        Some(key) => layer.encrypt_responses(EncryptionKeys::new(1, key)),
        None => layer,
    };
    let layer = layer
        .require_key(true)
        .ttl(args.retention)
        .lease_duration(lease)
        .wait_for_running(Duration::from_millis(args.wait_ms));
    let layer = if args.resumable {
        layer.resumable("payments", [header::CONTENT_TYPE])
    } else {
        layer
    };
    let shutdown = layer.shutdown_handle();
    // The payments route's handler, without the layer: what the completer runs for a
    // payment another process left half-done.
    let completer = args
        .resumable
        .then(|| layer.spawn_completer(post(create_payment).with_state(backend.clone())));

    let app = Router::new()
        .route("/payments", post(create_payment).route_layer(layer))
        .route("/stats", get(stats))
        .route("/stats/store", get(store_stats))
        // Outside the idempotency layer (a `.layer` wraps the routes before it), so that
        // the principal is in the request when the layer scopes its key.
        .layer(middleware::from_fn(authenticate))
        .with_state(backend);

    let listener = tokio::net::TcpListener::bind(args.addr).await?;
    let addr = listener.local_addr()?;
    println!("payments demo listening on http://{addr}");
    println!("store: {store_name}");
    println!("lease: {} ms", args.lease_ms);
    println!(
        "mode: {}",
        if args.transactional {
            "transactional"
        } else {
            "lease"
        }
    );
    println!("wait: {} ms", args.wait_ms);
    println!(
        "retention: {} s; keys remembered {} s more",
        args.retention.as_secs(),
        args.remember.as_secs()
    );
    if completer.is_some() {
        println!("resumable: payments left half-done by a process that died are finished here");
    }
    if args.encryption_key.is_some() {
        println!("encryption: stored responses sealed, keys hashed (key id 1)");
    }
    let closing = shutdown.clone();
    let mut signals = Termination::new();
    axum::serve(listener, app)
        .with_graceful_shutdown(async move {
            signals.next().await;
            println!("shutting down: no new payments; finishing those in flight");
            // A second signal stops the process where it stands, as a crash would:
            // payments still running lose their handlers. The same streams listen
            // on, so a second signal close behind the first is not lost.
            tokio::spawn(async move {
                let signal = signals.next().await;
                eprintln!("payments: a second signal; stopping at once");
                std::process::exit(128 + signal);
            });
            closing.close();
        })
        .await?;
    // Every claimed payment stores its response before the process exits; what a
    // stuck database keeps from finishing is recovered by lease expiry.
    if tokio::time::timeout(lease, shutdown.drain()).await.is_err() {
        eprintln!(
            "payments: {} payment(s) still storing; their keys free when their leases lapse",
            shutdown.in_flight()
        );
    }
    println!("stopped");
    Ok(())
}

/// Ctrl-C (SIGINT) and SIGTERM, listened for from creation on.
struct Termination {
    #[cfg(unix)]
    streams: Option<(tokio::signal::unix::Signal, tokio::signal::unix::Signal)>,
}

impl Termination {
    fn new() -> Self {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{SignalKind, signal};
            let streams = signal(SignalKind::interrupt())
                .and_then(|interrupt| {
                    signal(SignalKind::terminate()).map(|terminate| (interrupt, terminate))
                })
                .ok();
            Self { streams }
        }
        #[cfg(not(unix))]
        {
            Self {}
        }
    }

    /// The next signal's number.
    async fn next(&mut self) -> i32 {
        const SIGINT: i32 = 2;
        #[cfg(unix)]
        {
            const SIGTERM: i32 = 15;
            let Some((interrupt, terminate)) = &mut self.streams else {
                return std::future::pending().await;
            };
            tokio::select! {
                _ = interrupt.recv() => SIGINT,
                _ = terminate.recv() => SIGTERM,
            }
        }
        #[cfg(not(unix))]
        {
            let _ = tokio::signal::ctrl_c().await;
            SIGINT
        }
    }
}

/// The demo's authentication, a stand-in for a token check: `Authorization: Bearer
/// <account>.<secret>` names its account, put into the request as its [`Principal`], so
/// that the layer scopes keys by account: a client that refreshed its token retries as
/// the same account. A request without a bearer token goes on without a principal, and
/// its keys are scoped by the layer's default.
async fn authenticate(mut req: Request, next: Next) -> Response {
    if let Some(account) = bearer_account(req.headers()) {
        let principal = Principal::new(account);
        req.extensions_mut().insert(principal);
    }
    next.run(req).await
}

/// The account a bearer token names: what comes before its first dot, or the whole
/// token without one. `None` without a bearer token, or with an empty account.
fn bearer_account(headers: &HeaderMap) -> Option<&str> {
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?.trim();
    let (scheme, token) = value.split_once([' ', '\t'])?;
    if !scheme.eq_ignore_ascii_case("bearer") {
        return None;
    }
    let token = token.trim_start();
    let account = token.split_once('.').map_or(token, |(account, _)| account);
    (!account.is_empty()).then_some(account)
}

/// A 422 for a body the demo cannot accept. Not stored (the layer's default for a
/// 422): nothing was charged, and the client may send the corrected payment under the
/// same key.
fn invalid(detail: impl Into<String>) -> Response {
    problem(
        StatusCode::UNPROCESSABLE_ENTITY,
        "payments-demo-invalid-payment",
        "Invalid payment",
        &detail.into(),
    )
}

/// A problem document (RFC 9457) of `status`, its type the README's anchor `slug`.
fn problem(status: StatusCode, slug: &str, title: &str, detail: &str) -> Response {
    let body = json!({
        "type": format!("https://docs.rs/tower-idempotency/latest/tower_idempotency/#{slug}"),
        "title": title,
        "status": status.as_u16(),
        "detail": detail,
    });
    (
        status,
        [(header::CONTENT_TYPE, "application/problem+json")],
        body.to_string(),
    )
        .into_response()
}

struct Payment {
    amount: i64,
    currency: String,
    delay_ms: u64,
}

/// The fields a payment may have, each at most once: a body naming one twice is
/// refused, not read as its last value (a proxy or a log reading the first would see
/// another payment than the one charged).
#[derive(serde::Deserialize)]
struct Once {
    #[serde(rename = "amount")]
    _amount: Option<serde::de::IgnoredAny>,
    #[serde(rename = "currency")]
    _currency: Option<serde::de::IgnoredAny>,
    #[serde(rename = "delay_ms")]
    _delay_ms: Option<serde::de::IgnoredAny>,
}

fn parse_payment(body: &[u8]) -> Result<Payment, String> {
    let value: Value =
        serde_json::from_slice(body).map_err(|e| format!("the body is not JSON: {e}"))?;
    let obj = value.as_object().ok_or("the body must be a JSON object")?;
    serde_json::from_slice::<Once>(body).map_err(|e| format!("a field appears twice: {e}"))?;
    if let Some(unknown) = obj
        .keys()
        .find(|k| !["amount", "currency", "delay_ms"].contains(&k.as_str()))
    {
        return Err(format!(
            "unknown field {unknown:?}; expected amount, currency, delay_ms"
        ));
    }
    let amount = obj
        .get("amount")
        .and_then(Value::as_i64)
        .filter(|a| *a > 0)
        .ok_or("amount must be a positive integer (minor units)")?;
    let currency = obj
        .get("currency")
        .and_then(Value::as_str)
        .filter(|c| c.len() == 3 && c.bytes().all(|b| b.is_ascii_uppercase()))
        .ok_or("currency must be 3 uppercase letters, e.g. \"EUR\"")?
        .to_owned();
    let delay_ms = match obj.get("delay_ms") {
        None | Some(Value::Null) => 0,
        Some(v) => v
            .as_u64()
            .filter(|d| *d <= 60_000)
            .ok_or("delay_ms must be an integer from 0 to 60000")?,
    };
    Ok(Payment {
        amount,
        currency,
        delay_ms,
    })
}

/// The request's transaction, in transactional mode: of the tokio-postgres store, or,
/// with `--driver sqlx`, of the sqlx one.
enum Transaction {
    TokioPostgres(TransactionHandle),
    #[cfg(feature = "sqlx")]
    Sqlx(tower_idempotency::transactional::SqlxTransaction),
}

async fn create_payment(
    State(backend): State<Backend>,
    key: IdempotencyKey,
    tx: Option<TransactionHandle>,
    #[cfg(feature = "sqlx")] sqlx_tx: Option<tower_idempotency::transactional::SqlxTransaction>,
    body: axum::body::Bytes,
) -> Response {
    let tx = tx.map(Transaction::TokioPostgres);
    #[cfg(feature = "sqlx")]
    let tx = tx.or(sqlx_tx.map(Transaction::Sqlx));
    // Every attempt that reaches the handler is counted, on its own.
    if let Err(e) = backend.count_handler_run().await {
        return internal(e);
    }
    let payment = match parse_payment(&body) {
        Ok(p) => p,
        Err(detail) => return invalid(detail),
    };
    // The provider gets a key derived from the client's, so a retry cannot charge twice.
    let psp_key = key.derive("psp");
    let charging = || backend.charge(&psp_key, payment.amount, &payment.currency);
    let charged = match &tx {
        // In lease mode the charge is a recorded step: a retry after a crash (this
        // process killed after the charge) gets the recorded charge, and the provider
        // is not called again.
        None => key.try_step("charge", charging).await.map_err(|e| match e {
            StepError::Failed(e) => e,
            other => other.to_string().into(),
        }),
        // In transactional mode a crash rolls the payment back, and the retry asks the
        // provider again, which charges once under the derived key.
        Some(_) => charging().await,
    };
    let charge_id = match charged {
        Ok(Charged::Charge(id)) => id,
        // Reachable only when the key holds no record: its first payment failed after
        // the charge, and was released for a retry; this one has another body.
        Ok(Charged::OtherPayment { amount, currency }) => {
            return key_used_for_another_payment(amount, &currency);
        }
        Err(e) => return internal(e),
    };
    // The window in which a real service could crash after charging.
    tokio::time::sleep(Duration::from_millis(payment.delay_ms)).await;
    let payment_id = format!("pay_{}", &key.derive("payment")[..24]);
    // In transactional mode the payment commits with the stored response, or not at all.
    let recorded = match &tx {
        Some(Transaction::TokioPostgres(tx)) => {
            backend
                .record_payment_in(
                    tx,
                    &payment_id,
                    &charge_id,
                    payment.amount,
                    &payment.currency,
                )
                .await
        }
        #[cfg(feature = "sqlx")]
        Some(Transaction::Sqlx(tx)) => {
            backend
                .record_payment_in_sqlx(
                    tx,
                    &payment_id,
                    &charge_id,
                    payment.amount,
                    &payment.currency,
                )
                .await
        }
        None => {
            backend
                .record_payment(&payment_id, &charge_id, payment.amount, &payment.currency)
                .await
        }
    };
    if let Err(e) = recorded {
        return internal(e);
    }
    (
        StatusCode::CREATED,
        Json(json!({
            "payment_id": payment_id,
            "charge_id": charge_id,
            "amount": payment.amount,
            "currency": payment.currency,
        })),
    )
        .into_response()
}

/// A 422 for a key the provider charged under for another payment. Not stored: the
/// key's first payment (charged, never recorded) can still be completed by a retry
/// with its own body, and the provider charges nothing twice.
fn key_used_for_another_payment(amount: i64, currency: &str) -> Response {
    let mut res = problem(
        StatusCode::UNPROCESSABLE_ENTITY,
        "payments-demo-key-used-for-another-payment",
        "Idempotency-Key used for another payment",
        &format!(
            "the payment provider already charged {amount} {currency} under this Idempotency-Key; \
             retry that payment with its own body to complete it, or send this one with a new key"
        ),
    );
    res.headers_mut().insert(
        header::HeaderName::from_static(NOT_STORED),
        header::HeaderValue::from_static("true"),
    );
    res.extensions_mut().insert(NoStore);
    res
}

/// A 503 for a payment the backend could not complete. The cause goes to the log, not
/// to the client; the key is released (a 5xx is not stored), so a retry with it runs
/// again, and the provider, given the same derived key, charges once.
fn internal(e: backend::Error) -> Response {
    tracing::error!(error = %backend::describe(&*e), "payment failed");
    backend_failed("the payment could not be completed; retry with the same Idempotency-Key")
}

/// The problem document of a backend failure, saying `detail`: a 503 with
/// `Retry-After: 1`, since the database failed (every failure of the backend is one),
/// which a client retries as it retries the layer's own 503s.
fn backend_failed(detail: &str) -> Response {
    let mut res = problem(
        StatusCode::SERVICE_UNAVAILABLE,
        "payments-demo-payment-failed",
        "Payment failed",
        detail,
    );
    res.headers_mut()
        .insert(header::RETRY_AFTER, header::HeaderValue::from_static("1"));
    res
}

async fn store_stats(State(backend): State<Backend>) -> Response {
    match backend.store_metrics() {
        Some(m) => Json(json!({
            "store": "postgres",
            "statements": m.statements,
            "notifications": m.notifications,
            "notified_wakeups": m.notified_wakeups,
            "timer_wakeups": m.timer_wakeups,
            "listening": backend.is_listening(),
        }))
        .into_response(),
        None => Json(json!({"store": "memory"})).into_response(),
    }
}

async fn stats(State(backend): State<Backend>) -> Response {
    match backend.stats().await {
        Ok(s) => Json(json!({
            "handler_runs": s.handler_runs,
            "psp_calls": s.psp_calls,
            "charges": s.charges,
            "payments": s.payments,
        }))
        .into_response(),
        Err(e) => {
            tracing::error!(error = %backend::describe(&*e), "statistics unavailable");
            backend_failed("the statistics could not be read; try again")
        }
    }
}
