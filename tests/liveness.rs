//! Liveness (`PostgresStore::with_liveness`): a running key whose holder's process is
//! gone is taken over within about a second of PostgreSQL seeing it gone, long before
//! its lease lapses; a live holder's key is never taken over so, whatever happens
//! around it.
//!
//! Holders that die or stall are processes of their own: this test binary, started
//! again with `TI_LIVENESS_CHILD` naming what it runs, killed with SIGKILL, or stopped
//! with SIGSTOP (its runtime, its heartbeat and its reconnections frozen, its TCP
//! connections kept by the kernel) and let go with SIGCONT. Each "never" test claims
//! its key with a lease far longer than the test, so that nothing but liveness could
//! take it over, and has a duplicate claim it again and again for longer than the
//! grace, then lets the holder complete it with its own token.
//!
//! Through a database restart, a crash and a failover the tests need a server of their
//! own: they are `#[ignore]`d here, and run by `.ci/liveness` on a primary and a
//! standby it makes for them.

mod common;

use std::{
    io::{BufRead, BufReader, Write},
    process::{Child, ChildStdin, Command, Stdio},
    sync::mpsc,
    time::{Duration, SystemTime},
};

use bytes::Bytes;
use common::{
    TestSchema, app, database_url, eventually, pooler_url, post_with_headers, proxy::PgProxy, send,
};
use http::StatusCode;
use tower_idempotency::{
    Fingerprint, IdempotencyLayer, Outcome, Scope, StoredResponse,
    job::{JobOutcome, JobRunner},
    store::{Claim, ClaimRequest, Fenced, PostgresStore, Store, pool_for_url},
};

const A: Fingerprint = Fingerprint::new([7; 32]);

/// The lease of the claims of the "never" tests: far longer than any of them runs, so
/// that only liveness could take their key over.
const LONG_LEASE: Duration = Duration::from_secs(600);

/// How long a duplicate keeps claiming a live holder's key: several times the grace
/// (1 s) after which a silent holder whose lock is free counts as gone.
const EXPOSURE: Duration = Duration::from_secs(4);

fn request<'a>(scope: &'a Scope, key: &'a str, lease: Duration) -> ClaimRequest<'a> {
    ClaimRequest {
        scope,
        key,
        fingerprint: A,
        lease,
        ttl: Duration::from_secs(3600),
    }
}

fn response() -> StoredResponse {
    StoredResponse {
        status: StatusCode::OK,
        headers: http::HeaderMap::new(),
        body: Bytes::from_static(b"done by its holder"),
    }
}

/// A store on `schema` of a child process, which does not own the schema: its pool
/// through the transaction pooler if the suite runs behind one, its notification (and
/// liveness) connection to `url` directly.
fn child_store(schema: &str, url: &str) -> PostgresStore {
    let (pool_url, pooling) = match pooler_url() {
        Some(pooler) if url == database_url() => (pooler, true),
        _ => (url.to_owned(), false),
    };
    PostgresStore::new(pool_for_url(&pool_url, 4).expect("pool"))
        .with_transaction_pooling(pooling)
        .with_schema_name(schema)
        .expect("schema")
        .with_notifications(url.parse().expect("url"))
}

/// This test binary, started again to run `role` (see `child`) on `schema`.
struct Holder {
    child: Child,
    stdin: ChildStdin,
    lines: mpsc::Receiver<String>,
}

impl Holder {
    fn start(role: &str, schema: &TestSchema, key: &str) -> Self {
        Self::start_at(role, schema, key, &database_url())
    }

    fn start_at(role: &str, schema: &TestSchema, key: &str, url: &str) -> Self {
        let mut child = Command::new(std::env::current_exe().expect("the test binary"))
            .args(["--exact", "child", "--nocapture", "--test-threads=1"])
            .env("TI_LIVENESS_CHILD", role)
            .env("TI_LIVENESS_SCHEMA", &schema.name)
            .env("TI_LIVENESS_KEY", key)
            .env("TI_LIVENESS_URL", url)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start the holder");
        let stdin = child.stdin.take().expect("stdin");
        let stdout = BufReader::new(child.stdout.take().expect("stdout"));
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in stdout.lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        Self {
            child,
            stdin,
            lines,
        }
    }

    /// The rest of the first line the child prints that starts with `prefix` (at most
    /// 60 s: a bound, not a timing claim).
    fn line(&self, prefix: &str) -> String {
        loop {
            match self.lines.recv_timeout(Duration::from_secs(60)) {
                Ok(line) => {
                    // The harness may have begun the line with the test's name.
                    if let Some(at) = line.find(prefix) {
                        return line[at + prefix.len()..].trim().to_owned();
                    }
                }
                Err(e) => panic!("the holder never printed {prefix:?}: {e}"),
            }
        }
    }

    fn tell(&mut self, what: &str) {
        writeln!(self.stdin, "{what}").expect("tell the holder");
    }

    fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .args([signal, &self.child.id().to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill {signal}");
    }

    /// SIGKILL, and waits until the process is gone.
    fn kill9(&mut self) {
        self.child.kill().expect("SIGKILL the holder");
        self.child.wait().expect("the holder ends");
    }

    /// SIGSTOP: nothing of it runs, its connections stay open.
    fn stop(&self) {
        self.signal("-STOP");
    }

    fn resume(&self) {
        self.signal("-CONT");
    }

    /// Lets the holder complete its key with its own token; what that found.
    fn complete(&mut self) -> String {
        self.tell("complete");
        self.line("completed: ")
    }
}

impl Drop for Holder {
    fn drop(&mut self) {
        // A stopped process takes SIGKILL too.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What a holder process runs, by `TI_LIVENESS_CHILD`:
/// - `claim`: claims the key for `LONG_LEASE` (its lock held first), prints
///   `claimed: <token> <holder id>`, then completes it when told (`complete`), and
///   prints `completed: kept` or `completed: lost`;
/// - `layer`: sends a request with the key through the layer (the default 30 s lease),
///   whose handler never returns; prints `running: ` once it runs;
/// - `job`: runs a job with the key through a `JobRunner` (the default lease), whose
///   work never returns; prints `running: ` once it runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn child() {
    let Ok(role) = std::env::var("TI_LIVENESS_CHILD") else {
        return;
    };
    let schema = std::env::var("TI_LIVENESS_SCHEMA").expect("schema");
    let key = std::env::var("TI_LIVENESS_KEY").expect("key");
    let url = std::env::var("TI_LIVENESS_URL").expect("url");
    let store = child_store(&schema, &url);
    store.start_liveness().await.expect("liveness");
    let scope = Scope::anonymous();
    match role.as_str() {
        "claim" => {
            let Claim::Acquired(lease) = store
                .claim(&request(&scope, &key, LONG_LEASE))
                .await
                .expect("claim")
            else {
                panic!("the holder's key was taken");
            };
            let holder = store.holder_id().expect("a holder");
            println!("\nclaimed: {} {holder}", lease.token);
            let mut line = String::new();
            std::io::stdin().read_line(&mut line).expect("told");
            // A restart or a failover may have cut the pool's connections: the first
            // statements find them closed.
            let mut completed = None;
            for _ in 0..50 {
                match store
                    .complete(&lease, &response(), Duration::from_secs(3600))
                    .await
                {
                    Ok(fenced) => {
                        completed = Some(fenced);
                        break;
                    }
                    Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
                }
            }
            match completed.expect("the completion reached the database") {
                Fenced::Kept => println!("\ncompleted: kept"),
                Fenced::LeaseLost => println!("\ncompleted: lost"),
            }
        }
        "layer" => {
            let (router, counter) = app(IdempotencyLayer::new(store));
            tokio::spawn(async move {
                send(&router, post_with_headers(&key, &[("x-held", "1")])).await
            });
            eventually(|| counter.runs() == 1).await;
            println!("\nrunning: ");
            std::future::pending::<()>().await;
        }
        "job" => {
            let runner = JobRunner::new(store);
            let (started, running) = tokio::sync::oneshot::channel();
            tokio::spawn(async move {
                let _ = runner
                    .run(&scope, &key, b"the job", |_| async move {
                        let _ = started.send(());
                        std::future::pending::<Result<Bytes, std::io::Error>>().await
                    })
                    .await;
            });
            running.await.expect("the work started");
            println!("\nrunning: ");
            std::future::pending::<()>().await;
        }
        other => panic!("no such role {other:?}"),
    }
}

/// `(state, token, holder, locked_until, created_at)` of `key`'s row.
async fn row(
    schema: &TestSchema,
    key: &str,
) -> (String, i64, Option<i64>, Option<SystemTime>, SystemTime) {
    let rows = schema
        .query(&format!(
            "SELECT state, token, holder, locked_until, created_at
             FROM \"{}\".idempotency_keys WHERE key = '{key}'",
            schema.name
        ))
        .await;
    let r = rows.first().expect("the key's row");
    (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4))
}

/// The database's clock now.
async fn db_now(schema: &TestSchema) -> SystemTime {
    schema.query("SELECT now()").await[0].get(0)
}

/// Has `store` claim `key` again and again for `EXPOSURE`: each answer must be that the
/// key runs (a store error counts too, while the database restarts); never acquired.
/// Returns how many claims found it running.
async fn never_taken_over(store: &PostgresStore, key: &str) -> usize {
    let scope = Scope::anonymous();
    let until = tokio::time::Instant::now() + EXPOSURE;
    let mut running = 0;
    while tokio::time::Instant::now() < until {
        match store.claim(&request(&scope, key, LONG_LEASE)).await {
            Ok(Claim::Running { .. }) => running += 1,
            Ok(Claim::Acquired(lease)) => panic!("a live holder's key was taken over: {lease:?}"),
            Ok(other) => panic!("unexpected claim: {other:?}"),
            Err(_) => {}
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(store.metrics().gone_holder_takeovers, 0);
    running
}

/// The handler of a request whose process is then killed runs once more, on a
/// duplicate after the kill, with the default 30 s lease: the key was taken over (the
/// next token) while the dead holder's lease still had most of its time to run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_holder_s_key_is_taken_over_long_before_its_lease_lapses() {
    let schema = TestSchema::new();
    let store = schema.store().await;
    let (router, counter) = app(IdempotencyLayer::new(store.clone()));
    let mut holder = Holder::start("layer", &schema, "killed");
    holder.line("running: ");
    let (state, token, dead, lease_end, _) = row(&schema, "killed").await;
    assert_eq!(state, "running");
    assert!(dead.is_some(), "the claim names its holder");
    holder.kill9();
    let killed_at = db_now(&schema).await;
    // Nothing ran here before the kill; the retries run the handler once, after it.
    let mut statuses = Vec::new();
    let reply = loop {
        let reply = send(&router, post_with_headers("killed", &[])).await;
        statuses.push(reply.status.as_u16());
        if reply.status != StatusCode::CONFLICT {
            break reply;
        }
        assert!(statuses.len() < 2000, "never taken over: {statuses:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(reply.status, StatusCode::CREATED, "{statuses:?}");
    assert_eq!(reply.outcome, Some(Outcome::Executed));
    assert_eq!(counter.runs_of("killed"), 1);
    let (state, new_token, new_holder, _, taken_at) = row(&schema, "killed").await;
    assert_eq!((state.as_str(), new_token), ("completed", token + 1));
    assert_eq!(new_holder, store.holder_id());
    assert_eq!(store.metrics().gone_holder_takeovers, 1);
    let lease_end = lease_end.expect("a running claim's lease");
    let left = lease_end.duration_since(taken_at).unwrap_or_default();
    assert!(
        left >= Duration::from_secs(10),
        "taken over {left:?} before the dead holder's lease would have lapsed"
    );
    println!(
        "taken over {:?} after the kill, {left:?} before the lease lapsed",
        taken_at.duration_since(killed_at).unwrap_or_default()
    );
}

/// The same for a `JobRunner`: a redelivery of a job whose worker process was killed
/// runs it, long before the default lease lapses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_worker_s_job_is_run_again_long_before_its_lease_lapses() {
    let schema = TestSchema::new();
    let store = schema.store().await;
    let runner = JobRunner::new(store.clone());
    let mut holder = Holder::start("job", &schema, "job");
    holder.line("running: ");
    let (_, token, _, lease_end, _) = row(&schema, "job").await;
    holder.kill9();
    let scope = Scope::anonymous();
    let mut deliveries = 0;
    let outcome = loop {
        deliveries += 1;
        let outcome = runner
            .run(&scope, "job", b"the job", |_| async {
                Ok::<_, std::io::Error>(Bytes::from_static(b"ran again"))
            })
            .await
            .expect("the redelivery");
        if !matches!(outcome, JobOutcome::Running { .. }) {
            break outcome;
        }
        assert!(deliveries < 2000, "never taken over");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(outcome, JobOutcome::Ran(Bytes::from_static(b"ran again")));
    let (state, new_token, _, _, taken_at) = row(&schema, "job").await;
    assert_eq!((state.as_str(), new_token), ("completed", token + 1));
    let left = lease_end
        .expect("a running claim's lease")
        .duration_since(taken_at)
        .unwrap_or_default();
    assert!(
        left >= Duration::from_secs(10),
        "taken over {left:?} before the lease"
    );
}

/// A redelivery of a job that another worker runs is told to come back within a
/// second, not when that worker's 30 s lease lapses: were that worker to die, its job
/// would be free by then.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redelivery_of_a_running_job_is_told_to_come_back_within_a_second() {
    let schema = TestSchema::new();
    let (first, second) = (schema.store().await, schema.store().await);
    let scope = Scope::anonymous();
    let (started, running) = tokio::sync::oneshot::channel();
    let worker = {
        let scope = scope.clone();
        tokio::spawn(async move {
            JobRunner::new(first)
                .run(&scope, "job", b"the job", |_| async move {
                    let _ = started.send(());
                    std::future::pending::<Result<Bytes, std::io::Error>>().await
                })
                .await
        })
    };
    running.await.expect("the work started");
    let redelivered = JobRunner::new(second)
        .run(&scope, "job", b"the job", |_| async {
            Ok::<_, std::io::Error>(Bytes::from_static(b"ran twice"))
        })
        .await
        .expect("the redelivery");
    let JobOutcome::Running { retry_after } = redelivered else {
        panic!("not running: {redelivered:?}");
    };
    assert!(retry_after <= Duration::from_secs(1), "{retry_after:?}");
    worker.abort();
}

/// A live holder's key, claimed again and again by a duplicate, is never taken over,
/// and its holder completes it with its own token (behind `TI_POOLER_URL`, both pools
/// go through the transaction pooler, the liveness connections straight to the
/// database).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_holder_s_key_is_never_taken_over() {
    let schema = TestSchema::new();
    let duplicate = schema.store().await;
    let mut holder = Holder::start("claim", &schema, "live");
    holder.line("claimed: ");
    assert!(never_taken_over(&duplicate, "live").await > 0);
    assert_eq!(holder.complete(), "kept");
}

/// A holder whose process is stopped (SIGSTOP: its runtime stalled, no heartbeat, its
/// connections open) keeps its key: its lock is its session's, not its runtime's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_holder_s_key_is_never_taken_over() {
    let schema = TestSchema::new();
    let duplicate = schema.store().await;
    let mut holder = Holder::start("claim", &schema, "stalled");
    holder.line("claimed: ");
    holder.stop();
    assert!(never_taken_over(&duplicate, "stalled").await > 0);
    holder.resume();
    assert_eq!(holder.complete(), "kept");
}

/// The pid of the session that holds `holder`'s lock, if one does.
async fn lock_session(schema: &TestSchema, holder: i64) -> Option<i32> {
    schema
        .query(&format!(
            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 1
               AND ((classid::bigint << 32) | objid::bigint) = {holder}"
        ))
        .await
        .first()
        .map(|r| r.get(0))
}

/// A holder whose liveness connection is ended on the server (an administrator's
/// `pg_terminate_backend`, a proxy resetting it) and cannot connect again for a while
/// keeps its key: it goes on renewing its sign of life from its pool.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_reconnecting_its_liveness_connection_is_never_taken_over() {
    let schema = TestSchema::new();
    let duplicate = schema.store().await;
    let proxy = PgProxy::start().await;
    // Its pool straight to the database, its liveness connection through the proxy.
    let holder = schema
        .store()
        .await
        .with_notifications(proxy.url().parse().expect("url"));
    holder.start_liveness().await.expect("liveness");
    let id = holder.holder_id().expect("a holder");
    let scope = Scope::anonymous();
    let Claim::Acquired(lease) = holder
        .claim(&request(&scope, "reconnecting", LONG_LEASE))
        .await
        .expect("claim")
    else {
        panic!("not acquired");
    };
    let session = lock_session(&schema, id).await.expect("the lock's session");
    proxy.refuse(true);
    schema
        .query(&format!("SELECT pg_terminate_backend({session})"))
        .await;
    eventually(|| !holder.is_live()).await;
    assert!(never_taken_over(&duplicate, "reconnecting").await > 0);
    assert!(
        proxy.refused() > 0,
        "the holder tried to reconnect, and could not"
    );
    assert!(holder.metrics().liveness_heartbeats > 0);
    proxy.refuse(false);
    eventually(|| holder.is_live()).await;
    assert_eq!(
        holder
            .complete(&lease, &response(), Duration::from_secs(3600))
            .await
            .expect("complete"),
        Fenced::Kept
    );
}

/// A holder whose connections all stall (a slow or broken network: every byte held,
/// nothing closed) keeps its key while its sessions live on the server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_behind_a_stalled_network_is_never_taken_over() {
    let schema = TestSchema::new();
    let duplicate = schema.store().await;
    let proxy = PgProxy::start().await;
    // Its pool and its liveness connection through the proxy.
    let holder = schema.store_at(&proxy.url(), 2).await.with_liveness(true);
    holder.start_liveness().await.expect("liveness");
    let scope = Scope::anonymous();
    let Claim::Acquired(lease) = holder
        .claim(&request(&scope, "stalled-network", LONG_LEASE))
        .await
        .expect("claim")
    else {
        panic!("not acquired");
    };
    proxy.stall(true);
    assert!(never_taken_over(&duplicate, "stalled-network").await > 0);
    proxy.stall(false);
    assert_eq!(
        holder
            .complete(&lease, &response(), Duration::from_secs(3600))
            .await
            .expect("complete"),
        Fenced::Kept
    );
}

/// With liveness, a duplicate that finds its key running under a live holder still
/// costs one statement: the holder is judged in the claim itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_that_finds_a_live_holder_costs_one_statement() {
    let schema = TestSchema::new();
    let holder = schema.store().await;
    let duplicate = schema.store().await;
    holder.start_liveness().await.expect("liveness");
    let scope = Scope::anonymous();
    let Claim::Acquired(lease) = holder
        .claim(&request(&scope, "counted", LONG_LEASE))
        .await
        .expect("claim")
    else {
        panic!("not acquired");
    };
    // Past the grace, so that the holder is asked about, not only its claim's age.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let before = duplicate.metrics().statements;
    assert!(matches!(
        duplicate
            .claim(&request(&scope, "counted", LONG_LEASE))
            .await
            .expect("claim"),
        Claim::Running { .. }
    ));
    assert_eq!(duplicate.metrics().statements - before, 1);
    assert!(
        holder
            .complete(&lease, &response(), Duration::from_secs(3600))
            .await
            .expect("complete")
            .is_kept()
    );
}

/// A store whose pool logs in as a role with no rights of its own and takes on one that
/// has them in its `post_create` hook (`SET ROLE`), or, if `setup`, also given that
/// setup for the connections it makes outside the pool (`with_session_setup`): its
/// notification and liveness connection logs in as the same role, directly.
fn store_acting_as(
    schema: &TestSchema,
    login: &common::TestRole,
    writer: &common::TestRole,
    setup: bool,
) -> PostgresStore {
    use deadpool_postgres::{Hook, HookError, Manager, Pool, Runtime};
    use tower_idempotency::store::BoxFuture;
    fn acting_as(
        role: &str,
    ) -> impl for<'c> Fn(
        &'c tokio_postgres::Client,
    ) -> BoxFuture<'c, Result<(), tokio_postgres::Error>>
    + Clone
    + Send
    + Sync
    + 'static {
        let sql: std::sync::Arc<str> = format!("SET ROLE \"{role}\"").into();
        move |client| {
            let sql = sql.clone();
            Box::pin(async move { client.batch_execute(&sql).await })
        }
    }
    let url = common::url_as(&login.name);
    let config: tokio_postgres::Config = url.parse().expect("url");
    let hook = acting_as(&writer.name);
    let pool = Pool::builder(Manager::new(config.clone(), tokio_postgres::NoTls))
        .max_size(2)
        .runtime(Runtime::Tokio1)
        .create_timeout(Some(Duration::from_secs(5)))
        .post_create(Hook::async_fn(move |client, _| {
            let setting = hook(client);
            Box::pin(async move { setting.await.map_err(HookError::Backend) })
        }))
        .build()
        .expect("pool");
    let mut store = PostgresStore::new(pool)
        .with_schema_name(&schema.name)
        .expect("schema name")
        .with_background_purge(None)
        .with_notifications(config);
    if let Some(period) = common::generations() {
        store = store.with_generations(period);
    }
    if setup {
        store = store.with_session_setup(acting_as(&writer.name));
    }
    store
}

/// A pool whose hook sets its sessions' role: the liveness connection and the
/// heartbeat's, made outside the pool, write the holders table as the pool's
/// connections do once the store is given the same setup, as its reserve is. Without
/// it, the liveness connection, as the login role, may not register, and
/// `start_liveness` says so, with the database's words.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_liveness_connections_run_the_apps_session_setup() {
    use tower_idempotency::store::StoreErrorKind;
    let schema = TestSchema::new();
    schema.store().await;
    let writer = common::TestRole::new().await;
    let login = common::TestRole::new().await;
    let (s, w, l) = (&schema.name, &writer.name, &login.name);
    writer
        .run(&format!(
            "ALTER ROLE \"{w}\" NOLOGIN;
             ALTER ROLE \"{l}\" NOINHERIT;
             GRANT \"{w}\" TO \"{l}\";
             GRANT USAGE ON SCHEMA \"{s}\" TO \"{w}\";
             GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA \"{s}\" TO \"{w}\";"
        ))
        .await;

    let without = store_acting_as(&schema, &login, &writer, false);
    let e = without
        .start_liveness()
        .await
        .expect_err("registered as the login role");
    assert_eq!(e.kind(), StoreErrorKind::Misconfigured, "{e}");
    assert!(e.to_string().contains("SQLSTATE 42501"), "{e}");
    assert!(e.to_string().contains("_holders"), "{e}");
    assert!(!without.is_live());
    drop(without);

    let store = store_acting_as(&schema, &login, &writer, true);
    store
        .start_liveness()
        .await
        .expect("liveness as the writer");
    assert!(store.is_live());
    let holder = store.holder_id().expect("a holder").to_string();
    assert!(registered(&schema, &holder).await);
    // A claim running past a heartbeat: renewed on the heartbeat's connection, made by
    // the pool's manager outside the pool, as the writer.
    let scope = Scope::anonymous();
    let Claim::Acquired(lease) = store
        .claim(&request(&scope, "k", LONG_LEASE))
        .await
        .expect("claim")
    else {
        panic!("not acquired");
    };
    eventually(|| store.metrics().liveness_heartbeats >= 2).await;
    assert!(
        store
            .complete(&lease, &response(), Duration::from_secs(3600))
            .await
            .expect("complete")
            .is_kept()
    );
}

/// A shell command the server's own suite (`.ci/liveness`) gives in `var`.
fn run_command(var: &str) {
    let command = std::env::var(var)
        .unwrap_or_else(|_| panic!("{var} is not set: run this test with .ci/liveness"));
    let status = Command::new("sh")
        .args(["-c", &command])
        .status()
        .expect("run the command");
    assert!(status.success(), "{var}: {command}");
}

/// Returns once the database answers (at most ~30 s: a bound, not a timing claim).
async fn answering(schema: &TestSchema) {
    for _ in 0..300 {
        let url = database_url();
        if let Ok(Ok((client, conn))) = tokio::time::timeout(
            Duration::from_secs(2),
            tokio_postgres::connect(&url, tokio_postgres::NoTls),
        )
        .await
        {
            tokio::spawn(conn);
            if client.simple_query("SELECT 1").await.is_ok() {
                return;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("the database of {} never answered again", schema.name);
}

/// Whether `holder` is registered on the server as it runs now.
async fn registered(schema: &TestSchema, holder: &str) -> bool {
    schema
        .query(&format!(
            "SELECT count(*) FROM \"{}\".idempotency_keys_holders
             WHERE holder = {holder} AND postmaster_start = pg_postmaster_start_time()",
            schema.name
        ))
        .await[0]
        .get::<_, i64>(0)
        == 1
}

/// Has `store` claim `key` until it takes it over; the lease of the holder it took
/// over still had at least 10 s to run when it did.
async fn taken_over(schema: &TestSchema, store: &PostgresStore, key: &str) {
    let (_, token, _, lease_end, _) = row(schema, key).await;
    let scope = Scope::anonymous();
    let mut claims = 0;
    loop {
        claims += 1;
        match store.claim(&request(&scope, key, LONG_LEASE)).await {
            Ok(Claim::Acquired(lease)) => {
                assert_eq!(lease.token.get(), token + 1);
                break;
            }
            Ok(Claim::Running { .. }) | Err(_) => {}
            Ok(other) => panic!("unexpected claim: {other:?}"),
        }
        assert!(claims < 2000, "never taken over");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(store.metrics().gone_holder_takeovers, 1);
    let (_, _, _, _, taken_at) = row(schema, key).await;
    let left = lease_end
        .expect("a running claim's lease")
        .duration_since(taken_at)
        .unwrap_or_default();
    assert!(
        left >= Duration::from_secs(10),
        "taken over {left:?} before the lease"
    );
}

/// Across a clean restart of the database (every session ends, every lock is freed,
/// the unlogged table of holders is kept), a holder stopped all along, which can
/// neither reconnect nor renew its sign of life, keeps its key: its registration names
/// the server's previous start, and counts no more. Once it runs again, it registers
/// anew, and its death is then seen as any other: the key it claimed before the
/// restart is taken over long before its lease lapses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "restarts its server: run by .ci/liveness on a server of its own"]
async fn across_a_restart_a_stalled_holder_keeps_its_key_then_registers_again() {
    let schema = TestSchema::new();
    let duplicate = schema.store().await;
    let mut holder = Holder::start("claim", &schema, "restart");
    let claimed = holder.line("claimed: ");
    let id = claimed.split(' ').nth(1).expect("the holder id").to_owned();
    holder.stop();
    run_command("LIVENESS_RESTART");
    answering(&schema).await;
    assert!(never_taken_over(&duplicate, "restart").await > 0);
    holder.resume();
    for _ in 0..300 {
        if registered(&schema, &id).await {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        registered(&schema, &id).await,
        "the holder never registered again"
    );
    holder.kill9();
    taken_over(&schema, &duplicate, "restart").await;
}

/// Across a crash of the database (a backend killed: the server ends every session and
/// starts again, its start time unchanged, its unlogged tables emptied), a stopped
/// holder keeps its key, and completes it with its own token once it runs again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "crashes its server: run by .ci/liveness on a server of its own"]
async fn across_a_crash_a_stalled_holder_keeps_its_key() {
    let schema = TestSchema::new();
    let duplicate = schema.store().await;
    let mut holder = Holder::start("claim", &schema, "crash");
    holder.line("claimed: ");
    holder.stop();
    let started: SystemTime = schema.query("SELECT pg_postmaster_start_time()").await[0].get(0);
    // A backend of the test's own, killed with SIGKILL: the postmaster then ends every
    // other session (the watcher's too) and starts over.
    let connect = || async {
        let (client, conn) = tokio_postgres::connect(&database_url(), tokio_postgres::NoTls)
            .await
            .expect("connect");
        tokio::spawn(conn);
        client
    };
    let (victim, watcher) = (connect().await, connect().await);
    let pid: i32 = victim
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .expect("its pid")
        .get(0);
    let status = Command::new("kill")
        .args(["-9", &pid.to_string()])
        .status()
        .expect("run kill");
    assert!(status.success(), "kill -9 a backend (run as root)");
    for _ in 0..500 {
        if watcher.simple_query("SELECT 1").await.is_err() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(watcher.is_closed(), "the server did not start over");
    answering(&schema).await;
    let after: SystemTime = schema.query("SELECT pg_postmaster_start_time()").await[0].get(0);
    assert_eq!(after, started, "a crash, not a restart");
    assert!(never_taken_over(&duplicate, "crash").await > 0);
    holder.resume();
    assert_eq!(holder.complete(), "kept");
}

/// Across a failover (the primary stopped hard, its standby promoted: a lock table that
/// never held the holder's lock), a stopped holder keeps its key, and completes it with
/// its own token on the new primary once it runs again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "fails its server over: run by .ci/liveness on a pair of its own"]
async fn across_a_failover_a_stalled_holder_keeps_its_key() {
    let schema = TestSchema::new();
    let duplicate = schema.store().await;
    let mut holder = Holder::start("claim", &schema, "failover");
    holder.line("claimed: ");
    // The standby has the claim before the primary goes.
    let standby = std::env::var("LIVENESS_STANDBY_URL")
        .expect("LIVENESS_STANDBY_URL is not set: run this test with .ci/liveness");
    let (client, conn) = tokio_postgres::connect(&standby, tokio_postgres::NoTls)
        .await
        .expect("connect to the standby");
    tokio::spawn(conn);
    let has_it = format!(
        "SELECT count(*) FROM \"{}\".idempotency_keys WHERE key = 'failover'",
        schema.name
    );
    for _ in 0..300 {
        if let Ok(rows) = client.query(&has_it, &[]).await
            && rows[0].get::<_, i64>(0) == 1
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    drop(client);
    holder.stop();
    run_command("LIVENESS_FAIL_OVER");
    answering(&schema).await;
    assert!(never_taken_over(&duplicate, "failover").await > 0);
    holder.resume();
    assert_eq!(holder.complete(), "kept");
}
