//! Recorded steps (`IdempotencyKey::step`): a step recorded under a key is not run
//! again by a later run of the key; a step that ran without being recorded is; a holder
//! whose key was taken over records nothing; steps are taken in order.
//!
//! Holders that crash are processes of their own: this test binary, started again with
//! `TI_STEPS_CHILD` naming what it runs, and killed with SIGKILL.

mod common;

use std::{
    io::{BufRead, BufReader},
    process::{Child, Command, Stdio},
    sync::mpsc,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use axum::{
    Router,
    extract::State,
    http::{StatusCode, header::CONTENT_TYPE},
    routing::post,
};
use bytes::Bytes;
use common::{TestSchema, database_url, post_with_headers, send};
use sha2::{Digest, Sha256};
use tower_idempotency::{
    Fingerprint, IdempotencyKey, IdempotencyLayer, Outcome, Scope, StepError,
    job::JobRunner,
    store::{
        Claim, ClaimRequest, Fenced, MemoryStore, PostgresStore, RecordedStep, Store, pool_for_url,
    },
};

/// How often this process ran each step itself.
#[derive(Clone, Default)]
struct Ran {
    runs: Arc<AtomicUsize>,
    charge: Arc<AtomicUsize>,
}

/// A payment: the charge a recorded step (its result, the process that made it), then,
/// with `x-hang-after`, a wait that never ends (the process is killed there); with
/// `x-hang-inside`, the charge itself never returns.
async fn pay(
    State(ran): State<Ran>,
    key: IdempotencyKey,
    headers: http::HeaderMap,
) -> Result<(StatusCode, String), StepError> {
    ran.runs.fetch_add(1, Ordering::SeqCst);
    let inside = headers.contains_key("x-hang-inside");
    let charge: String = key
        .step("charge", || async {
            ran.charge.fetch_add(1, Ordering::SeqCst);
            println!("\ncharging: ");
            if inside {
                std::future::pending::<()>().await;
            }
            format!("charged by {}", std::process::id())
        })
        .await?;
    println!("\ncharged: ");
    if headers.contains_key("x-hang-after") {
        std::future::pending::<()>().await;
    }
    if headers.contains_key("x-fail-after") {
        return Ok((StatusCode::SERVICE_UNAVAILABLE, charge));
    }
    Ok((StatusCode::CREATED, charge))
}

fn router(layer: IdempotencyLayer) -> (Router, Ran) {
    let ran = Ran::default();
    let router = Router::new()
        .route("/payments", post(pay))
        .layer(layer)
        .with_state(ran.clone());
    (router, ran)
}

/// This test binary, started again to send one request with `headers` through a layer
/// on `schema` (a store with liveness), its handler hanging where they say.
struct Holder(Child, mpsc::Receiver<String>);

impl Holder {
    fn start(schema: &TestSchema, key: &str, hang: &str) -> Self {
        let mut child = Command::new(std::env::current_exe().expect("the test binary"))
            .args(["--exact", "child", "--nocapture", "--test-threads=1"])
            .env("TI_STEPS_CHILD", hang)
            .env("TI_STEPS_SCHEMA", &schema.name)
            .env("TI_STEPS_KEY", key)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start the holder");
        let stdout = BufReader::new(child.stdout.take().expect("stdout"));
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in stdout.lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        Self(child, lines)
    }

    /// Waits (at most 60 s: a bound, not a timing claim) for a line with `what`.
    fn wait_for(&self, what: &str) {
        loop {
            match self.1.recv_timeout(Duration::from_secs(60)) {
                Ok(line) if line.contains(what) => return,
                Ok(_) => {}
                Err(e) => panic!("the holder never printed {what:?}: {e}"),
            }
        }
    }

    fn kill9(&mut self) {
        self.0.kill().expect("SIGKILL the holder");
        self.0.wait().expect("the holder ends");
    }
}

impl Drop for Holder {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn child_store(schema: &str) -> PostgresStore {
    let url = database_url();
    PostgresStore::new(pool_for_url(&url, 4).expect("pool"))
        .with_schema_name(schema)
        .expect("schema")
        .with_notifications(url.parse().expect("url"))
}

/// What a holder process runs, by `TI_STEPS_CHILD`: the header it sends
/// (`x-hang-after`, `x-hang-inside`) through a lease-mode layer, or `transactional`:
/// `x-hang-after` through a transactional one, or `resumable`: `x-hang-after` through
/// a lease-mode layer registered as resumable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn child() {
    let Ok(hang) = std::env::var("TI_STEPS_CHILD") else {
        return;
    };
    let schema = std::env::var("TI_STEPS_SCHEMA").expect("schema");
    let key = std::env::var("TI_STEPS_KEY").expect("key");
    let store = child_store(&schema);
    store.start_liveness().await.expect("liveness");
    let (layer, hang) = match hang.as_str() {
        "transactional" => (IdempotencyLayer::transactional(store), "x-hang-after"),
        "resumable" => {
            let layer = IdempotencyLayer::new(store).resumable("payments", [CONTENT_TYPE]);
            (layer, "x-hang-after")
        }
        lease => (IdempotencyLayer::new(store), lease),
    };
    let (router, _) = router(layer);
    send(&router, post_with_headers(&key, &[(hang, "1")])).await;
    unreachable!("the request hangs until the process is killed");
}

/// Retries `key` through `router` until it is no longer answered 409 (the dead
/// holder's key taken over).
async fn retry(router: &Router, key: &str) -> common::Reply {
    for _ in 0..2000 {
        let reply = send(router, post_with_headers(key, &[])).await;
        if reply.status != StatusCode::CONFLICT {
            return reply;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("the dead holder's key was never taken over");
}

async fn steps_rows(schema: &TestSchema) -> i64 {
    let sql = format!(
        "SELECT count(*) FROM \"{}\".idempotency_keys_steps",
        schema.name
    );
    schema.query(&sql).await[0].get(0)
}

/// A process killed after its charge was recorded: the retry, in another process,
/// gets the recorded charge and does not charge again; the steps are forgotten once the
/// key completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_after_a_recorded_step_resumes_without_running_it_again() {
    let schema = TestSchema::new();
    let store = schema.store().await;
    let mut holder = Holder::start(&schema, "after", "x-hang-after");
    holder.wait_for("charged: ");
    assert_eq!(
        steps_rows(&schema).await,
        1,
        "recorded before the step returned"
    );
    holder.kill9();
    let (router, ran) = router(IdempotencyLayer::new(store));
    let reply = retry(&router, "after").await;
    assert_eq!(reply.status, StatusCode::CREATED);
    assert_eq!(reply.outcome, Some(Outcome::Executed));
    assert_eq!(ran.charge.load(Ordering::SeqCst), 0, "charged again");
    let charged = String::from_utf8_lossy(&reply.body).into_owned();
    assert_eq!(charged, format!("charged by {}", holder.0.id()));
    assert_eq!(steps_rows(&schema).await, 0, "completion forgets the steps");
    let replay = send(&router, post_with_headers("after", &[])).await;
    assert_eq!(replay.outcome, Some(Outcome::Replayed));
    assert_eq!(replay.body, reply.body);
}

/// A process killed inside its charge (nothing recorded): the retry charges, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_inside_a_step_runs_it_again_once() {
    let schema = TestSchema::new();
    let store = schema.store().await;
    let mut holder = Holder::start(&schema, "inside", "x-hang-inside");
    holder.wait_for("charging: ");
    holder.kill9();
    assert_eq!(steps_rows(&schema).await, 0);
    let (router, ran) = router(IdempotencyLayer::new(store));
    let reply = retry(&router, "inside").await;
    assert_eq!(reply.status, StatusCode::CREATED);
    assert_eq!(ran.charge.load(Ordering::SeqCst), 1);
    assert_eq!(
        String::from_utf8_lossy(&reply.body),
        format!("charged by {}", std::process::id())
    );
    let replay = send(&router, post_with_headers("inside", &[])).await;
    assert_eq!(replay.outcome, Some(Outcome::Replayed));
    assert_eq!(ran.charge.load(Ordering::SeqCst), 1);
}

fn request<'a>(scope: &'a Scope, key: &'a str, input: &[u8], lease: Duration) -> ClaimRequest<'a> {
    ClaimRequest {
        scope,
        key,
        fingerprint: Fingerprint::new(Sha256::digest(input).into()),
        lease,
        ttl: Duration::from_secs(3600),
    }
}

fn charge(n: u32, name: &str, result: &str) -> RecordedStep {
    RecordedStep {
        n,
        name: name.into(),
        result: Bytes::from(serde_json::to_vec(result).expect("json")),
    }
}

/// A holder whose lapsed lease was taken over can neither read nor record steps; the
/// one that took it over reads what it recorded before, and records its own. Every
/// store.
async fn fenced_out_holder_records_nothing(store: &dyn Store) {
    let scope = Scope::new("acct");
    let first = request(&scope, "fenced", b"in", Duration::from_millis(200));
    let Claim::Acquired(old) = store.claim(&first).await.expect("claim") else {
        panic!("a new key");
    };
    let recorded = store.record_step(&old, &charge(0, "charge", "ch_1")).await;
    assert_eq!(recorded.expect("record"), Fenced::Kept);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let second = request(&scope, "fenced", b"in", Duration::from_secs(60));
    let Claim::Acquired(new) = store.claim(&second).await.expect("claim") else {
        panic!("the lapsed lease taken over");
    };
    assert_eq!(new.token, old.token.next());
    let late = store.record_step(&old, &charge(1, "ship", "sh_old")).await;
    assert_eq!(late.expect("record"), Fenced::LeaseLost);
    assert_eq!(store.steps(&old).await.expect("read"), None);
    let steps = store.steps(&new).await.expect("read").expect("held");
    assert_eq!(steps, vec![charge(0, "charge", "ch_1")]);
    let own = store.record_step(&new, &charge(1, "ship", "sh_new")).await;
    assert_eq!(own.expect("record"), Fenced::Kept);
    let steps = store.steps(&new).await.expect("read").expect("held");
    assert_eq!(steps.len(), 2);
    assert_eq!(steps[1], charge(1, "ship", "sh_new"));
    // Released: the steps go with the key, and a new claim starts with none.
    assert_eq!(store.release(&new).await.expect("release"), Fenced::Kept);
    let Claim::Acquired(fresh) = store.claim(&second).await.expect("claim") else {
        panic!("released");
    };
    assert_eq!(store.steps(&fresh).await.expect("read"), Some(vec![]));
}

#[tokio::test]
async fn a_fenced_out_holder_cannot_record_a_step_in_memory() {
    fenced_out_holder_records_nothing(&MemoryStore::new()).await;
}

#[tokio::test]
async fn a_fenced_out_holder_cannot_record_a_step_in_postgres() {
    let schema = TestSchema::new();
    fenced_out_holder_records_nothing(&schema.store().await).await;
    assert_eq!(steps_rows(&schema).await, 0);
}

/// A migrated store of the sqlx driver in `schema`.
#[cfg(feature = "sqlx")]
async fn sqlx_store(schema: &TestSchema) -> tower_idempotency::store::SqlxStore {
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect(&database_url())
        .await
        .expect("pool");
    let store = tower_idempotency::store::SqlxStore::new(pool)
        .with_schema_name(&schema.name)
        .expect("schema name");
    store.migrate().await.expect("migrate");
    store
}

#[cfg(feature = "sqlx")]
#[tokio::test]
async fn a_fenced_out_holder_cannot_record_a_step_on_sqlx() {
    let schema = TestSchema::new();
    fenced_out_holder_records_nothing(&sqlx_store(&schema).await).await;
    assert_eq!(steps_rows(&schema).await, 0);
}

#[cfg(feature = "sqlx")]
#[tokio::test]
async fn jobs_take_their_steps_in_order_on_sqlx() {
    let schema = TestSchema::new();
    let store: Arc<dyn Store> = Arc::new(sqlx_store(&schema).await);
    jobs_resume_after_a_takeover(store.clone()).await;
    jobs_resume_in_order(store).await;
    assert_eq!(steps_rows(&schema).await, 0);
}

/// A job's run after a takeover gets the recorded step, runs the next, and a run that
/// asks for its steps in another order is refused, and runs nothing.
async fn jobs_resume_in_order(store: Arc<dyn Store>) {
    let scope = Scope::new("worker");
    let stale = request(&scope, "job", b"input", Duration::from_millis(100));
    let Claim::Acquired(dead) = store.claim(&stale).await.expect("claim") else {
        panic!("a new key");
    };
    let recorded = store.record_step(&dead, &charge(0, "charge", "ch_7")).await;
    assert_eq!(recorded.expect("record"), Fenced::Kept);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let runner = JobRunner::new(store.clone());
    let ran = Arc::new(AtomicUsize::new(0));
    let out_of_order = runner
        .run(&scope, "job", b"input", |ctx| {
            let ran = ran.clone();
            async move {
                ctx.key
                    .step(
                        "refund",
                        || async move { ran.fetch_add(1, Ordering::SeqCst) },
                    )
                    .await
                    .map(|_| Bytes::new())
            }
        })
        .await;
    let Err(tower_idempotency::job::JobError::Failed(StepError::OutOfOrder { n, asked, recorded })) =
        out_of_order
    else {
        panic!("asked out of order: {out_of_order:?}");
    };
    assert_eq!(
        (n, asked.as_str(), recorded.as_str()),
        (0, "refund", "charge")
    );
    assert_eq!(ran.load(Ordering::SeqCst), 0);
    // The failed run released the key, and its steps with it: a run starts anew.
    let done = runner
        .run(&scope, "job", b"input", |ctx| {
            let ran = ran.clone();
            async move {
                let charge: String = ctx
                    .key
                    .step("charge", || async move {
                        ran.fetch_add(1, Ordering::SeqCst);
                        "ch_8".to_owned()
                    })
                    .await?;
                Ok::<_, StepError>(Bytes::from(charge))
            }
        })
        .await
        .expect("run");
    assert_eq!(
        done,
        tower_idempotency::job::JobOutcome::Ran(Bytes::from("ch_8"))
    );
    assert_eq!(ran.load(Ordering::SeqCst), 1);
}

/// A job taken over resumes after its recorded step.
async fn jobs_resume_after_a_takeover(store: Arc<dyn Store>) {
    let scope = Scope::new("worker");
    let stale = request(&scope, "resumed", b"input", Duration::from_millis(100));
    let Claim::Acquired(dead) = store.claim(&stale).await.expect("claim") else {
        panic!("a new key");
    };
    let recorded = store.record_step(&dead, &charge(0, "charge", "ch_7")).await;
    assert_eq!(recorded.expect("record"), Fenced::Kept);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let runner = JobRunner::new(store.clone());
    let ran = Arc::new(AtomicUsize::new(0));
    let done = runner
        .run(&scope, "resumed", b"input", |ctx| {
            let ran = ran.clone();
            async move {
                let charge: String = ctx
                    .key
                    .step("charge", || async {
                        ran.fetch_add(1, Ordering::SeqCst);
                        "ch_again".to_owned()
                    })
                    .await?;
                let shipped: String = ctx
                    .key
                    .step("ship", || async {
                        ran.fetch_add(1, Ordering::SeqCst);
                        "sh_1".to_owned()
                    })
                    .await?;
                Ok::<_, StepError>(Bytes::from(format!("{charge} {shipped}")))
            }
        })
        .await
        .expect("run");
    assert_eq!(
        done,
        tower_idempotency::job::JobOutcome::Ran(Bytes::from("ch_7 sh_1"))
    );
    assert_eq!(
        ran.load(Ordering::SeqCst),
        1,
        "only the step not recorded ran"
    );
}

#[tokio::test]
async fn jobs_take_their_steps_in_order_in_memory() {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    jobs_resume_after_a_takeover(store.clone()).await;
    jobs_resume_in_order(store).await;
}

#[tokio::test]
async fn jobs_take_their_steps_in_order_in_postgres() {
    let schema = TestSchema::new();
    let store: Arc<dyn Store> = Arc::new(schema.store().await);
    jobs_resume_after_a_takeover(store.clone()).await;
    jobs_resume_in_order(store).await;
    assert_eq!(steps_rows(&schema).await, 0);
}

/// A key the layer did not hand over has nowhere to record a step: nothing runs.
#[tokio::test]
async fn a_key_made_by_hand_runs_no_step() {
    let key = IdempotencyKey::new(Scope::anonymous(), "k");
    let ran = AtomicUsize::new(0);
    let step = key
        .step("charge", || async { ran.fetch_add(1, Ordering::SeqCst) })
        .await;
    assert!(
        matches!(step, Err(StepError::Unrecorded { .. })),
        "{step:?}"
    );
    assert_eq!(ran.load(Ordering::SeqCst), 0);
}

/// In transactional mode, a step is recorded apart from the request's transaction: a
/// handler that charged and then failed (its transaction rolled back) leaves the charge
/// recorded, and the retry gets it, without charging again; the commit forgets it.
#[tokio::test]
async fn a_rolled_back_transaction_keeps_its_recorded_step() {
    let schema = TestSchema::new();
    let store = schema.store().await;
    let (router, ran) = router(IdempotencyLayer::transactional(store));
    let failed = send(&router, post_with_headers("tx", &[("x-fail-after", "1")])).await;
    assert_eq!(failed.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(failed.outcome, Some(Outcome::Released));
    assert_eq!(steps_rows(&schema).await, 1, "the rollback kept the step");
    let reply = send(&router, post_with_headers("tx", &[])).await;
    assert_eq!(reply.status, StatusCode::CREATED);
    assert_eq!(ran.charge.load(Ordering::SeqCst), 1, "charged again");
    assert_eq!(
        String::from_utf8_lossy(&reply.body),
        format!("charged by {}", std::process::id())
    );
    assert_eq!(steps_rows(&schema).await, 0, "the commit forgets the steps");
    // Another request under a key rolled back does not get its steps.
    let failed = send(&router, post_with_headers("tx2", &[("x-fail-after", "1")])).await;
    assert_eq!(failed.status, StatusCode::SERVICE_UNAVAILABLE);
    let other = common::req("POST")
        .header("idempotency-key", "tx2")
        .body(axum::body::Body::from("{\"other\":1}"))
        .expect("request");
    assert_eq!(send(&router, other).await.status, StatusCode::CREATED);
    assert_eq!(ran.charge.load(Ordering::SeqCst), 3);
}

/// A process killed in transactional mode after its charge was recorded: its
/// transaction rolls back, and the retry gets the charge.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_in_transactional_mode_keeps_the_recorded_step() {
    let schema = TestSchema::new();
    let store = schema.store().await;
    let mut holder = Holder::start(&schema, "tx-crash", "transactional");
    holder.wait_for("charged: ");
    holder.kill9();
    let (router, ran) = router(IdempotencyLayer::transactional(store));
    let reply = retry(&router, "tx-crash").await;
    assert_eq!(reply.status, StatusCode::CREATED);
    assert_eq!(ran.charge.load(Ordering::SeqCst), 0, "charged again");
    assert_eq!(
        String::from_utf8_lossy(&reply.body),
        format!("charged by {}", holder.0.id())
    );
}

/// A transactional handler whose transaction ended under it (its session terminated,
/// and gone) records no step: a retry may hold the key by then.
#[tokio::test]
async fn a_transaction_ended_under_its_handler_records_no_step() {
    static SHIPPED: std::sync::Mutex<Option<String>> = std::sync::Mutex::new(None);
    async fn cut(
        key: IdempotencyKey,
        tx: tower_idempotency::transactional::TransactionHandle,
    ) -> StatusCode {
        let first: Result<u32, StepError> = key.step("charge", || async { 1 }).await;
        assert_eq!(first.expect("recorded while the transaction runs"), 1);
        let client = tx.client().await.expect("client");
        let pid: i32 = client
            .query_one("SELECT pg_backend_pid()", &[])
            .await
            .expect("pid")
            .get(0);
        let _ = client
            .execute("SELECT pg_terminate_backend(pg_backend_pid())", &[])
            .await;
        drop(client);
        // The session is gone once the server no longer lists it (its exit may come a
        // moment after its client hears of it).
        let (watcher, connection) = tokio_postgres::connect(&database_url(), tokio_postgres::NoTls)
            .await
            .expect("connect");
        tokio::spawn(connection);
        for _ in 0..500 {
            let listed: i64 = watcher
                .query_one(
                    "SELECT count(*) FROM pg_stat_activity WHERE pid = $1",
                    &[&pid],
                )
                .await
                .expect("pg_stat_activity")
                .get(0);
            if listed == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let shipped = key.step("ship", || async { 2 }).await;
        *SHIPPED.lock().expect("lock") = Some(format!("{shipped:?}"));
        StatusCode::OK
    }
    let schema = TestSchema::new();
    let store = schema.store_direct(4).await;
    let router = Router::new()
        .route("/payments", post(cut))
        .layer(IdempotencyLayer::transactional(store));
    let reply = send(&router, post_with_headers("cut", &[])).await;
    assert_eq!(
        reply.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "not committed"
    );
    let shipped = SHIPPED
        .lock()
        .expect("lock")
        .clone()
        .expect("the handler ran");
    assert_eq!(shipped, r#"Err(LeaseLost { name: "ship" })"#);
    let names = schema
        .query(&format!(
            "SELECT name FROM \"{}\".idempotency_keys_steps ORDER BY n",
            schema.name
        ))
        .await;
    let names: Vec<String> = names.iter().map(|r| r.get(0)).collect();
    assert_eq!(names, ["charge"]);
}

/// `(state, token)` of `key`'s row.
async fn key_row(schema: &TestSchema, key: &str) -> (String, i64) {
    let sql = format!(
        "SELECT state, token FROM \"{}\".idempotency_keys WHERE key = '{key}'",
        schema.name
    );
    let rows = schema.query(&sql).await;
    let row = rows.first().expect("the key's row");
    (row.get(0), row.get(1))
}

/// The completer of a resumable route never runs a live holder's key, however long
/// it looks (several times liveness's grace); once that holder's process is killed,
/// it takes the key over and runs it to its end, with no client retrying: the charge
/// recorded by the dead process is replayed, not made again, and a later request with
/// the key gets the stored response.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_completer_finishes_a_dead_holder_s_key_and_never_a_live_one_s() {
    let schema = TestSchema::new();
    let store = schema.store().await;
    store.start_liveness().await.expect("liveness");
    let layer = IdempotencyLayer::new(store).resumable("payments", [CONTENT_TYPE]);
    let ran = Ran::default();
    let completer = layer.spawn_completer(post(pay).with_state(ran.clone()));
    let mut holder = Holder::start(&schema, "resumable", "resumable");
    holder.wait_for("charged: ");
    let (state, token) = key_row(&schema, "resumable").await;
    assert_eq!(state, "running");
    // Alive: left alone, for more than twice the grace after which a silent holder
    // counts as gone.
    for _ in 0..12 {
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(
            key_row(&schema, "resumable").await,
            ("running".into(), token)
        );
    }
    assert_eq!(
        ran.runs.load(Ordering::SeqCst),
        0,
        "a live holder's key was run"
    );
    holder.kill9();
    let mut finished = false;
    for _ in 0..600 {
        if key_row(&schema, "resumable").await.0 == "completed" {
            finished = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(finished, "the dead holder's key was never finished");
    assert_eq!(key_row(&schema, "resumable").await.1, token + 1);
    assert_eq!(ran.runs.load(Ordering::SeqCst), 1);
    assert_eq!(ran.charge.load(Ordering::SeqCst), 0, "charged again");
    let (router, _) = router(layer);
    let replay = send(&router, post_with_headers("resumable", &[])).await;
    assert_eq!(replay.outcome, Some(Outcome::Replayed));
    assert_eq!(replay.status, StatusCode::CREATED);
    assert_eq!(
        String::from_utf8_lossy(&replay.body),
        format!("charged by {}", holder.0.id())
    );
    completer.abort();
}

/// The steps of a transactional request rolled back and never retried are forgotten
/// by the background purge once a day old.
#[tokio::test]
async fn stale_transactional_steps_are_purged() {
    let schema = TestSchema::new();
    let store = schema
        .store()
        .await
        .with_background_purge(Some(Duration::from_millis(20)));
    let (router, _) = router(IdempotencyLayer::transactional(store.clone()));
    let failed = send(
        &router,
        post_with_headers("stale", &[("x-fail-after", "1")]),
    )
    .await;
    assert_eq!(failed.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(steps_rows(&schema).await, 1);
    let aged = format!(
        "UPDATE \"{}\".idempotency_keys_steps SET recorded_at = now() - interval '25 hours'",
        schema.name
    );
    schema.query(&aged).await;
    // Any lease-mode claim starts the store's background purge.
    let scope = Scope::anonymous();
    let _ = store
        .claim(&request(&scope, "other", b"x", Duration::from_secs(1)))
        .await;
    let mut purged = false;
    for _ in 0..500 {
        if steps_rows(&schema).await == 0 {
            purged = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(purged, "the stale steps were never purged");
}
