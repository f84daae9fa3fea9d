//! Support for the integration tests: a schema per test on the real PostgreSQL, a test
//! app behind the layer, a wire-level proxy that counts and cuts, and the layer suite
//! that runs against every store.
#![allow(dead_code, unreachable_pub, missing_docs)]

pub mod completions;
pub mod ledger;
pub mod proxy;
pub mod replicas;
pub mod suite;

use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use axum::{
    Router,
    body::{Body, Bytes},
    extract::State,
    http::{HeaderMap, Request, StatusCode},
    response::{IntoResponse, Response},
};
use http_body_util::BodyExt;
use tower::ServiceExt;
use tower_idempotency::{
    IdempotencyKey, IdempotencyLayer, Outcome,
    store::{PostgresStore, pool_for_url},
};

pub fn database_url() -> String {
    std::env::var("DATABASE_URL")
        .ok()
        .filter(|u| !u.is_empty())
        .unwrap_or_else(|| "postgres://postgres@127.0.0.1:5432/postgres".into())
}

/// With `TI_GENERATIONS` set (to a period in seconds), the stores of
/// [`TestSchema::store_at`] keep their table in generations of that period
/// (`with_generations`): the suites run again over a partitioned table.
pub fn generations() -> Option<Duration> {
    std::env::var("TI_GENERATIONS")
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok())
        .map(Duration::from_secs)
}

/// The transaction-pooling PgBouncer the suite runs through, if `TI_POOLER_URL` names
/// one (see [`TestSchema::store_at`]).
pub fn pooler_url() -> Option<String> {
    std::env::var("TI_POOLER_URL")
        .ok()
        .filter(|u| !u.is_empty())
}

/// Returns once every connection `store` holds is back in its pool: a transactional
/// replay rolls its transaction back in a task of its own, and a test that ends before
/// it has run would leave that transaction open, blocking the drop of its schema.
pub async fn idle(store: &PostgresStore) {
    eventually(|| {
        let status = store.pool().status();
        status.available == status.size
    })
    .await;
}

/// `database_url()` with every transaction of its connections serializable by default,
/// as `ALTER DATABASE … SET default_transaction_isolation` would make them.
pub fn serializable_url() -> String {
    url_with_default_isolation("serializable")
}

/// `DATABASE_URL` with `options` (URL-encoded `-c name=value` settings) for its
/// connections.
pub fn url_with_options(options: &str) -> String {
    let url = database_url();
    let separator = if url.contains('?') { '&' } else { '?' };
    format!("{url}{separator}options={options}")
}

/// `DATABASE_URL` as `user` (no password: for a role of the test's own on a server that
/// trusts local connections).
#[allow(dead_code)] // not every test binary uses it
pub fn url_as(user: &str) -> String {
    with_user(&database_url(), user)
}

/// `url` as `user` (no password).
#[allow(dead_code)] // not every test binary uses it
pub fn with_user(url: &str, user: &str) -> String {
    let (scheme, rest) = url.split_once("://").expect("a postgres:// URL");
    let host = rest.split_once('@').map_or(rest, |(_, host)| host);
    format!("{scheme}://{user}@{host}")
}

/// A login role of its own for one test, dropped (with its privileges) when the test
/// ends, whether it passed or panicked.
#[allow(dead_code)] // not every test binary uses it
pub struct TestRole {
    pub name: String,
}

#[allow(dead_code)]
impl TestRole {
    pub async fn new() -> Self {
        let role = Self {
            name: unique_name("ti_role"),
        };
        role.run(&format!("CREATE ROLE \"{}\" LOGIN", role.name))
            .await;
        role
    }

    /// Runs `sql` as the server's superuser (grants, say).
    pub async fn run(&self, sql: &str) {
        let (client, conn) = tokio_postgres::connect(&database_url(), tokio_postgres::NoTls)
            .await
            .expect("connect");
        tokio::spawn(conn);
        client.batch_execute(sql).await.expect("as the superuser");
    }
}

impl Drop for TestRole {
    fn drop(&mut self) {
        let name = &self.name;
        let sql = format!(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '{name}';
             DROP OWNED BY \"{name}\";
             DROP ROLE \"{name}\""
        );
        if let Err(e) = run_from_drop(sql) {
            eprintln!("could not drop test role {name}: {e}");
        }
    }
}

/// `DATABASE_URL` with connections whose transactions default to `level`
/// (`serializable`, or `repeatable%5C%20read`: a space in `options` is escaped).
pub fn url_with_default_isolation(level: &str) -> String {
    url_with_options(&format!("-c%20default_transaction_isolation%3D{level}"))
}

/// A port on 127.0.0.1 where connections are refused for as long as the returned socket
/// lives: it is bound, without `SO_REUSEADDR`, and never listens, so nothing else on the
/// machine can start listening there in the meantime.
pub fn refusing_port() -> (tokio::net::TcpSocket, u16) {
    let socket = tokio::net::TcpSocket::new_v4().expect("a TCP socket");
    socket
        .bind(([127, 0, 0, 1], 0).into())
        .expect("bind 127.0.0.1:0");
    let port = socket.local_addr().expect("the bound address").port();
    (socket, port)
}

/// A name no other test (in this or another process) uses.
pub fn unique_name(prefix: &str) -> String {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    format!(
        "{prefix}_{}_{}_{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed),
        nanos
    )
}

/// Drops schema `name` with everything in it. After a failed test, a connection of the
/// test's own runtime (not polled while the drop blocks it) may still hold a lock in the
/// schema, inside a transaction it will never end: its backend is ended first. Bounded
/// all the same.
pub fn drop_schema_sql(name: &str) -> String {
    format!(
        "SET lock_timeout = '10s';
         SELECT pg_terminate_backend(l.pid) FROM pg_locks l
           JOIN pg_class c ON c.oid = l.relation
           JOIN pg_namespace n ON n.oid = c.relnamespace
          WHERE n.nspname = '{name}' AND l.pid <> pg_backend_pid();
         DROP SCHEMA IF EXISTS \"{name}\" CASCADE"
    )
}

/// Runs `sql` on a connection of its own, on a thread and runtime of its own: for a
/// `Drop`, which may run inside an async test.
fn run_from_drop(sql: String) -> Result<(), String> {
    let done = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async move {
            // A server at `max_connections` for a moment (other suites running beside
            // this one) refuses the connection: it is tried again, a few times.
            let mut attempt = 0;
            let (client, conn) = loop {
                match tokio_postgres::connect(&database_url(), tokio_postgres::NoTls).await {
                    Ok(connected) => break connected,
                    Err(_) if attempt < 10 => {
                        attempt += 1;
                        tokio::time::sleep(Duration::from_millis(200 * attempt)).await;
                    }
                    Err(e) => return Err(e),
                }
            };
            tokio::spawn(conn);
            client.batch_execute(&sql).await
        })
    })
    .join();
    match done {
        Ok(Ok(())) => Ok(()),
        other => Err(format!("{other:?}")),
    }
}

/// `TI_BATCHED_CLAIMS=connections,max`: stores of `TestSchema::store_at` batch their
/// claims so.
pub fn batched_claims() -> Option<(usize, usize)> {
    let value = std::env::var("TI_BATCHED_CLAIMS").ok()?;
    let (connections, max) = value.split_once(',')?;
    Some((connections.trim().parse().ok()?, max.trim().parse().ok()?))
}

/// `store` with its lease-mode claims on `n` shared connections
/// (`with_shared_claim_connections`), and not batched, whatever `TI_BATCHED_CLAIMS`
/// says: batching turns shared claim connections off, and a test of them must run
/// with them. `store` itself with `n` = 0.
#[allow(dead_code)] // not every test binary uses it
pub fn sharing_claims(store: PostgresStore, n: usize) -> PostgresStore {
    if n == 0 {
        return store;
    }
    store
        .with_batched_claims(0, 1)
        .with_shared_claim_connections(n)
}

/// A schema of its own for one test, dropped (with everything in it) when the test
/// ends, whether it passed or panicked.
pub struct TestSchema {
    pub name: String,
}

impl TestSchema {
    pub fn new() -> Self {
        Self {
            name: unique_name("ti_test"),
        }
    }

    /// A migrated store on a pool of its own (a "replica").
    pub async fn store(&self) -> PostgresStore {
        self.store_at(&database_url(), 16).await
    }

    /// A migrated store on a pool of `size` connections to `url`.
    ///
    /// On a URL through a test proxy (`PgProxy::url`), the store has no liveness
    /// (`with_liveness(false)`): its liveness connection, which takes its lock at the
    /// first claim, and its heartbeat while claims run, would pass the proxy at moments
    /// of their own, among the statements a test counts, cuts or holds there. Its
    /// claims are judged by their lease alone, as the fault they test is;
    /// `tests/liveness.rs` runs liveness through proxies on purpose.
    ///
    /// With `TI_POOLER_URL` set (a transaction-pooling PgBouncer in front of the
    /// database, as `.ci/run` starts one), a store on the database's own URL goes through
    /// the pooler instead (`with_transaction_pooling`), and listens on the database
    /// directly: the suite runs again as a deployment behind a pooler would.
    pub async fn store_at(&self, url: &str, size: usize) -> PostgresStore {
        let (pool_url, pooling) = match pooler_url() {
            Some(pooler) if url == database_url() => (pooler, true),
            _ => (url.to_owned(), false),
        };
        self.store_with(url, &pool_url, pooling, size).await
    }

    /// A migrated store on `size` connections straight to the database, even with
    /// `TI_POOLER_URL` set: for a test whose handler changes its session (`SET
    /// track_activities = off`, say), which a transaction pooler would hand on to
    /// other tests' transactions.
    pub async fn store_direct(&self, size: usize) -> PostgresStore {
        let url = database_url();
        self.store_with(&url, &url, false, size).await
    }

    async fn store_with(
        &self,
        url: &str,
        pool_url: &str,
        pooling: bool,
        size: usize,
    ) -> PostgresStore {
        let mut store = PostgresStore::new(pool_for_url(pool_url, size).expect("pool"))
            .with_transaction_pooling(pooling)
            .with_schema_name(&self.name)
            .expect("schema name")
            .with_notifications(url.parse().expect("url"));
        if let Some(period) = generations() {
            store = store.with_generations(period);
        }
        if proxy::is_proxied(url) {
            store = store.with_liveness(false);
        }
        store.migrate().await.expect("migrate");
        // With `TI_BATCHED_CLAIMS=connections,max` the suite runs again with lease
        // mode's claims batched (`with_batched_claims`).
        match batched_claims() {
            Some((connections, max)) => store.with_batched_claims(connections, max),
            None => store,
        }
    }

    /// A store on `url` that has not been migrated (for stores that cannot connect).
    pub fn unmigrated_store_at(&self, url: &str) -> PostgresStore {
        PostgresStore::new(pool_for_url(url, 4).expect("pool"))
            .with_schema_name(&self.name)
            .expect("schema name")
    }

    /// How many statements on this schema's objects wait on a lock now.
    pub async fn lock_waiters(&self) -> i64 {
        let waiting = format!(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%{}%'",
            self.name
        );
        self.query(&waiting).await[0].get(0)
    }

    /// Returns once `n` statements on this schema's objects wait on a lock (polled,
    /// at most ~10 s: a bounded wait, not a timing claim).
    pub async fn wait_for_lock_waiters(&self, n: i64) {
        for _ in 0..500 {
            if self.lock_waiters().await >= n {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("{n} statements never waited on a lock in {}", self.name);
    }

    /// Runs one query on a fresh connection, outside every pool under test.
    pub async fn query(&self, sql: &str) -> Vec<tokio_postgres::Row> {
        let (client, conn) = tokio_postgres::connect(&database_url(), tokio_postgres::NoTls)
            .await
            .expect("connect");
        tokio::spawn(conn);
        client.query(sql, &[]).await.expect("query")
    }
}

/// The state of `key` in the test's table: (state, token).
pub async fn row(schema: &TestSchema, key: &str) -> Option<(String, i64)> {
    schema
        .query(&format!(
            "SELECT state, token FROM \"{}\".idempotency_keys WHERE key = '{key}'",
            schema.name
        ))
        .await
        .first()
        .map(|r| (r.get(0), r.get(1)))
}

/// Returns once `key` is in `state` (polled, at most ~10 s).
pub async fn wait_for_state(schema: &TestSchema, key: &str, state: &str) {
    for _ in 0..500 {
        if row(schema, key).await.is_some_and(|(s, _)| s == state) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("{key} never reached {state}");
}

impl Drop for TestSchema {
    fn drop(&mut self) {
        if let Err(e) = run_from_drop(drop_schema_sql(&self.name)) {
            eprintln!("could not drop test schema {}: {e}", self.name);
        }
    }
}

/// A database of its own for one test, dropped (its connections ended) when the test
/// ends, whether it passed or panicked: for a test that uses the store's defaults (the
/// table `public.idempotency_keys`) as an app would, without touching the shared
/// database's `public` schema.
pub struct TestDatabase {
    pub name: String,
}

#[allow(dead_code)] // not every test binary uses it
impl TestDatabase {
    pub async fn new() -> Self {
        let db = Self {
            name: unique_name("ti_test_db"),
        };
        let (client, conn) = tokio_postgres::connect(&database_url(), tokio_postgres::NoTls)
            .await
            .expect("connect");
        tokio::spawn(conn);
        client
            .batch_execute(&format!("CREATE DATABASE \"{}\"", db.name))
            .await
            .expect("create the test's database");
        db
    }

    /// `DATABASE_URL`, naming this database instead of its own.
    pub fn url(&self) -> String {
        let url = database_url();
        let (base, query) = url
            .split_once('?')
            .map_or((url.as_str(), None), |(b, q)| (b, Some(q)));
        let (scheme, rest) = base.split_once("://").expect("a postgres:// URL");
        let authority = rest
            .split_once('/')
            .map_or(rest, |(authority, _)| authority);
        let url = format!("{scheme}://{authority}/{}", self.name);
        match query {
            Some(query) => format!("{url}?{query}"),
            None => url,
        }
    }
}

#[allow(dead_code)] // not every test binary uses it
impl TestDatabase {
    /// [`url`](Self::url) as `user` (no password: for a role of the test's own).
    pub fn url_as(&self, user: &str) -> String {
        with_user(&self.url(), user)
    }

    /// Runs `sql` in this database as the server's superuser (grants, say).
    pub async fn run(&self, sql: &str) {
        let (client, conn) = tokio_postgres::connect(&self.url(), tokio_postgres::NoTls)
            .await
            .expect("connect to the test's database");
        tokio::spawn(conn);
        client.batch_execute(sql).await.expect("as the superuser");
    }
}

impl Drop for TestDatabase {
    fn drop(&mut self) {
        let sql = format!("DROP DATABASE IF EXISTS \"{}\" WITH (FORCE)", self.name);
        if let Err(e) = run_from_drop(sql) {
            eprintln!("could not drop test database {}: {e}", self.name);
        }
    }
}

/// A handler behind the layer that counts its runs, per key, and makes every run's
/// response unique, so equal responses prove a single execution.
#[derive(Clone)]
pub struct Counter {
    runs: Arc<AtomicUsize>,
    finished: Arc<AtomicUsize>,
    by_key: Arc<Mutex<HashMap<String, usize>>>,
    /// What runs sent with `x-held` wait for, one permit each.
    gate: Arc<tokio::sync::Semaphore>,
}

impl Default for Counter {
    fn default() -> Self {
        Self {
            runs: Arc::default(),
            finished: Arc::default(),
            by_key: Arc::default(),
            gate: Arc::new(tokio::sync::Semaphore::new(0)),
        }
    }
}

impl Counter {
    /// Lets `n` runs held by `x-held` go on (now, or when they come).
    pub fn let_go(&self, n: usize) {
        self.gate.add_permits(n);
    }

    /// Waits, in a handler of the test's own, for [`let_go`](Self::let_go).
    pub async fn held(&self) {
        self.gate.acquire().await.expect("the gate").forget();
    }

    pub fn runs(&self) -> usize {
        self.runs.load(Ordering::SeqCst)
    }

    /// Runs that got past their delay and produced a response.
    pub fn finished(&self) -> usize {
        self.finished.load(Ordering::SeqCst)
    }

    pub fn runs_of(&self, key: &str) -> usize {
        self.by_key
            .lock()
            .expect("lock")
            .get(key)
            .copied()
            .unwrap_or(0)
    }

    /// Counts a run of a handler of the test's own.
    pub fn count_run(&self) -> usize {
        self.count(None)
    }

    /// Counts a run of a handler of the test's own that got past its delay.
    pub fn count_finished(&self) {
        self.finished.fetch_add(1, Ordering::SeqCst);
    }

    fn count(&self, key: Option<&IdempotencyKey>) -> usize {
        if let Some(key) = key {
            *self
                .by_key
                .lock()
                .expect("lock")
                .entry(key.as_str().to_owned())
                .or_default() += 1;
        }
        self.runs.fetch_add(1, Ordering::SeqCst) + 1
    }
}

pub async fn create(
    State(counter): State<Counter>,
    key: Option<IdempotencyKey>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let run = counter.count(key.as_ref());
    if headers.contains_key("x-held") {
        counter.held().await;
    }
    if let Some(ms) = headers
        .get("x-delay-ms")
        .and_then(|v| v.to_str().ok()?.parse().ok())
    {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    counter.finished.fetch_add(1, Ordering::SeqCst);
    let status = headers
        .get("x-status")
        .and_then(|v| v.to_str().ok()?.parse().ok())
        .and_then(|s| StatusCode::from_u16(s).ok())
        .unwrap_or(StatusCode::CREATED);
    if headers.contains_key("x-panic") {
        panic!("handler panicked on purpose");
    }
    let body = serde_json::json!({
        "run": run,
        "key": key.as_ref().map(|k| k.as_str()),
        "echo": String::from_utf8_lossy(&body),
    })
    .to_string();
    let mut res = (
        status,
        [
            ("content-type", "application/json".to_owned()),
            ("x-run", run.to_string()),
            ("set-cookie", format!("session={run}")),
            ("location", format!("/payments/{run}")),
        ],
        body,
    )
        .into_response();
    if let Some(v) = headers.get("x-cache-control") {
        res.headers_mut().insert("cache-control", v.clone());
    }
    if headers.contains_key("x-no-store") {
        res.extensions_mut().insert(tower_idempotency::NoStore);
    }
    res
}

/// `POST|PATCH|GET /payments` behind `layer`. Request headers steer the handler:
/// `x-held` (it waits for [`Counter::let_go`]), `x-delay-ms`, `x-status`, `x-panic`,
/// `x-cache-control` (answered as `Cache-Control`), `x-no-store` (the answer is marked
/// [`NoStore`](tower_idempotency::NoStore)).
pub fn app(layer: IdempotencyLayer) -> (Router, Counter) {
    let counter = Counter::default();
    let router = Router::new()
        .route(
            "/payments",
            axum::routing::post(create).patch(create).get(create),
        )
        .layer(layer)
        .with_state(counter.clone());
    (router, counter)
}

/// The app's authentication, as the tests stand it in: `Authorization: Bearer
/// <account>.<secret>` names its account (a token without a dot names itself), put into
/// the request as its [`Principal`](tower_idempotency::Principal). A request without a
/// bearer token goes on without one.
pub async fn authenticate(
    mut req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let account = req
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(|token| token.split('.').next().unwrap_or(token).to_owned());
    if let Some(account) = account {
        req.extensions_mut()
            .insert(tower_idempotency::Principal::new(account));
    }
    next.run(req).await
}

/// [`app`] behind [`authenticate`], which is outside the layer (a `.layer` added after
/// it), as an app must put its authentication.
pub fn app_behind_auth(layer: IdempotencyLayer) -> (Router, Counter) {
    let (router, counter) = app(layer);
    (
        router.layer(axum::middleware::from_fn(authenticate)),
        counter,
    )
}

/// [`app_behind_auth`] with the layer on the route (`route_layer`) instead of the router.
pub fn route_behind_auth(layer: IdempotencyLayer) -> (Router, Counter) {
    let counter = Counter::default();
    let router = Router::new()
        .route(
            "/payments",
            axum::routing::post(create).patch(create).route_layer(layer),
        )
        .layer(axum::middleware::from_fn(authenticate))
        .with_state(counter.clone());
    (router, counter)
}

/// [`app`] with [`authenticate`] inside the layer (a `.layer` added before it): the
/// mistake an app can make, where the layer sees no principal.
pub fn app_with_auth_inside(layer: IdempotencyLayer) -> (Router, Counter) {
    let counter = Counter::default();
    let router = Router::new()
        .route("/payments", axum::routing::post(create))
        .layer(axum::middleware::from_fn(authenticate))
        .layer(layer)
        .with_state(counter.clone());
    (router, counter)
}

/// `POST /payments` with `key` and `body`, sent with `Authorization: Bearer <token>`.
pub fn post_as(token: &str, key: &str, body: &str) -> Request<Body> {
    req("POST")
        .header("idempotency-key", key)
        .header("authorization", format!("Bearer {token}"))
        .body(Body::from(body.to_owned()))
        .expect("request")
}

/// Polls until `f` holds, at most ~10 s: a bounded wait, not a timing claim.
pub async fn eventually(mut f: impl FnMut() -> bool) {
    for _ in 0..1000 {
        if f() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("condition not reached within the bound");
}

/// Sends `req` in a task of its own and returns once its handler runs (`counter` has
/// counted one more run): the request is then in flight, holding its key.
pub async fn in_flight(
    router: &Router,
    req: Request<Body>,
    counter: &Counter,
) -> tokio::task::JoinHandle<Reply> {
    let before = counter.runs();
    let router = router.clone();
    let task = tokio::spawn(async move { send(&router, req).await });
    eventually(|| counter.runs() > before).await;
    task
}

/// Retries `POST /payments` with `key` until a 201 (at most ~5 s, 20 ms apart); every
/// other answer must have a status in `allowed`.
pub async fn retry_until_created(router: &Router, key: &str, allowed: &[u16]) -> Reply {
    retry_until_created_with(router, || post(key, "{}"), allowed).await
}

/// [`retry_until_created`] with the request `make` builds.
pub async fn retry_until_created_with(
    router: &Router,
    mut make: impl FnMut() -> Request<Body>,
    allowed: &[u16],
) -> Reply {
    let mut statuses = Vec::new();
    loop {
        let r = send(router, make()).await;
        statuses.push(r.status.as_u16());
        if r.status == 201 {
            return r;
        }
        assert!(allowed.contains(&r.status.as_u16()), "{statuses:?}");
        assert!(statuses.len() < 250, "no 201: {statuses:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
    pub outcome: Option<Outcome>,
}

impl Reply {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).expect("json body")
    }

    /// The problem `type` anchor (`key-reused`, …) of a problem+json reply.
    pub fn problem(&self) -> String {
        assert_eq!(
            self.header("content-type"),
            Some("application/problem+json"),
            "{:?}",
            self.body
        );
        assert_eq!(self.header("cache-control"), Some("no-store"));
        let v = self.json();
        assert_eq!(v["status"], self.status.as_u16());
        let t = v["type"].as_str().expect("type");
        t.rsplit_once('#').expect("anchor").1.to_owned()
    }
}

/// [`send`], failing the test if no answer comes within 30 s: for a test whose claim is
/// that the answer is bounded, so that a regression fails it rather than hangs it.
#[allow(dead_code)] // not every test binary uses it
pub async fn send_bounded(router: &Router, req: Request<Body>) -> Reply {
    tokio::time::timeout(Duration::from_secs(30), send(router, req))
        .await
        .expect("no answer within 30 s: the request hangs")
}

pub async fn send(router: &Router, req: Request<Body>) -> Reply {
    let res = router.clone().oneshot(req).await.expect("infallible");
    let outcome = res.extensions().get::<Outcome>().copied();
    let (parts, body) = res.into_parts();
    Reply {
        status: parts.status,
        headers: parts.headers,
        body: body.collect().await.expect("body").to_bytes(),
        outcome,
    }
}

/// A request builder: `req("POST").key("k").body("{}")`.
pub fn req(method: &str) -> axum::http::request::Builder {
    Request::builder()
        .method(method)
        .uri("/payments")
        .header("content-type", "application/json")
}

pub fn post(key: &str, body: &str) -> Request<Body> {
    req("POST")
        .header("idempotency-key", key)
        .body(Body::from(body.to_owned()))
        .expect("request")
}

/// `POST /payments` with `key`, a `{}` body and `headers` (those that steer the handler:
/// `x-delay-ms`, `x-status`, `x-panic`, or any other).
pub fn post_with_headers(key: &str, headers: &[(&str, &str)]) -> Request<Body> {
    let mut builder = req("POST").header("idempotency-key", key);
    for (name, value) in headers {
        builder = builder.header(*name, *value);
    }
    builder.body(Body::from("{}")).expect("request")
}

/// A request body in chunks, with no length known in advance (as with chunked encoding).
pub struct Chunked(std::collections::VecDeque<Bytes>);

impl Chunked {
    pub fn new(chunks: &[String]) -> Self {
        Self(chunks.iter().map(|c| Bytes::from(c.clone())).collect())
    }
}

impl http_body::Body for Chunked {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        std::task::Poll::Ready(self.0.pop_front().map(|b| Ok(http_body::Frame::data(b))))
    }
}

/// A response body that sends `{"id":` and then fails, as a stream from elsewhere that
/// breaks off, or a serializer that gives up halfway.
#[derive(Default)]
pub struct BreaksOff {
    sent: bool,
}

impl http_body::Body for BreaksOff {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        let frame = if std::mem::replace(&mut self.sent, true) {
            Err(std::io::Error::other("the body broke off"))
        } else {
            Ok(http_body::Frame::data(Bytes::from_static(b"{\"id\":")))
        };
        std::task::Poll::Ready(Some(frame))
    }
}

/// A body that sends `chunks` chunks, one every `every`, and never ends if `chunks` is
/// `None`.
pub struct Trickle {
    pub left: Option<usize>,
    pub every: Duration,
    pub sleep: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
}

impl http_body::Body for Trickle {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        if self.left == Some(0) {
            return std::task::Poll::Ready(None);
        }
        let every = self.every;
        let sleep = self
            .sleep
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(every)));
        if sleep.as_mut().poll(cx).is_pending() {
            return std::task::Poll::Pending;
        }
        self.sleep = None;
        if let Some(left) = &mut self.left {
            *left -= 1;
        }
        std::task::Poll::Ready(Some(Ok(http_body::Frame::data(Bytes::from_static(b"x")))))
    }
}

/// A first request on `k` whose handler blocks its thread (in `block_in_place`, or
/// outright) for several leases of 300 ms, and a retry sent when the lease would have
/// lapsed, unrenewed, three times over: the retry gets 409, then the replay, and the
/// handler runs once.
pub async fn a_blocked_handler_keeps_its_lease(layer: IdempotencyLayer, in_place: bool) {
    use std::sync::{
        Condvar, Mutex,
        atomic::{AtomicBool, Ordering},
    };

    let lease = Duration::from_millis(300);
    let counter = Counter::default();
    // Set when the first run has started blocking (a flag the test polls:
    // a waker, woken from the blocked worker, could be stuck behind it).
    let blocking = Arc::new(AtomicBool::new(false));
    let gate = Arc::new((Mutex::new(false), Condvar::new()));
    let handler = {
        let (counter, blocking, gate) = (counter.clone(), blocking.clone(), gate.clone());
        move || {
            let (counter, blocking, gate) = (counter.clone(), blocking.clone(), gate.clone());
            async move {
                let run = counter.count_run();
                let block = || {
                    blocking.store(true, Ordering::SeqCst);
                    let (open, opened) = &*gate;
                    let open = open.lock().expect("the gate");
                    // Bounded, so that a broken test fails, not hangs.
                    let _ = opened
                        .wait_timeout_while(open, Duration::from_secs(30), |o| !*o)
                        .expect("the gate");
                };
                // Only the first run blocks: a second one, the bug, answers.
                if run == 1 {
                    if in_place {
                        tokio::task::block_in_place(block);
                    } else {
                        block();
                    }
                }
                (StatusCode::CREATED, format!("run {run}"))
            }
        }
    };
    let router = axum::Router::new()
        .route("/payments", axum::routing::post(handler))
        .layer(layer.lease_duration(lease));
    let first = tokio::spawn({
        let router = router.clone();
        async move { send(&router, post("k", "{}")).await }
    });
    eventually(|| blocking.load(Ordering::SeqCst)).await;
    // Past three leases: without renewal, the key is free to take over.
    tokio::time::sleep(3 * lease).await;
    let retry = send(&router, post("k", "{}")).await;
    {
        let (open, opened) = &*gate;
        *open.lock().expect("the gate") = true;
        opened.notify_all();
    }
    let first = first.await.expect("the first request");
    assert_eq!(counter.runs(), 1, "the retry ran the handler again");
    assert_eq!(retry.status, 409);
    assert_eq!(retry.problem(), "in-progress");
    assert_eq!(first.status, 201);
    let replay = send(&router, post("k", "{}")).await;
    assert_eq!(replay.outcome, Some(Outcome::Replayed));
    assert_eq!(replay.body, first.body);
    assert_eq!(counter.runs(), 1);
}
