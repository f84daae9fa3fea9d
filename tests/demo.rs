//! End to end: the payments demo (`examples/payments`) as real processes, over HTTP,
//! against a real PostgreSQL (`DATABASE_URL`, by default
//! `postgres://postgres@127.0.0.1:5432/postgres`).
//!
//! The demo binary is the one `cargo test` builds into `target/<profile>/examples/`
//! (`cargo build --example payments` builds it too). Each test runs the demo in a schema
//! of its own and drops that schema when it ends, whether it passed or panicked.

#![cfg(all(feature = "postgres", feature = "axum"))]

mod common;

use std::{
    io::{BufRead, BufReader},
    net::SocketAddr,
    path::PathBuf,
    process::{Child, Command, Stdio},
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
        mpsc,
    },
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use bytes::Bytes;
use http::{HeaderMap, Method, Request, StatusCode, header};
use http_body_util::{BodyExt, Full};
use hyper_util::{
    client::legacy::{Client, connect::HttpConnector},
    rt::TokioExecutor,
};
use serde_json::{Value, json};

type HttpClient = Client<HttpConnector, Full<Bytes>>;
type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The payment of the acceptance check: its 300 ms delay keeps the first request
/// running while the others arrive.
const SLOW_PAYMENT: &str = r#"{"amount":1250,"currency":"EUR","delay_ms":300}"#;

/// How many times to poll for something before giving up, and how long between polls.
const POLL_ATTEMPTS: u32 = 300;
const POLL_INTERVAL: Duration = Duration::from_millis(100);

use common::database_url;

/// `target/<profile>/examples/payments`, next to this test's `target/<profile>/deps/`.
fn demo_binary() -> PathBuf {
    let exe = std::env::current_exe().expect("the path of the test binary");
    let profile_dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("the test binary lives in target/<profile>/deps/");
    let bin = profile_dir
        .join("examples")
        .join(format!("payments{}", std::env::consts::EXE_SUFFIX));
    assert!(
        bin.is_file(),
        "the payments demo is not built at {}: run `cargo build --example payments` \
         (or `cargo test`, which builds the examples) first",
        bin.display()
    );
    bin
}

/// How the demo's line with the address it serves on starts (its first line, unless a
/// warning came before it).
const LISTENING: &str = "payments demo listening on http://";

/// The first of `lines` not read yet that starts with `prefix`, or `None` when the demo
/// ends or prints none within the polling bound.
fn first_line_starting_with(lines: &mpsc::Receiver<String>, prefix: &str) -> Option<String> {
    for _ in 0..POLL_ATTEMPTS {
        match lines.recv_timeout(POLL_INTERVAL) {
            Ok(line) if line.starts_with(prefix) => return Some(line),
            Ok(_) | Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => return None,
        }
    }
    None
}

fn client() -> HttpClient {
    Client::builder(TokioExecutor::new()).build_http()
}

/// A fresh schema for one test, dropped (with everything the demo created in it) when
/// this guard goes out of scope, also during a panic.
struct Schema {
    name: String,
    url: String,
}

impl Schema {
    fn new() -> Self {
        static SEQ: AtomicU64 = AtomicU64::new(0);
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let seq = SEQ.fetch_add(1, Ordering::Relaxed);
        Self {
            name: format!("demo_t_{}_{nanos}_{seq}", std::process::id()),
            url: database_url(),
        }
    }
}

impl Drop for Schema {
    fn drop(&mut self) {
        let sql = common::drop_schema_sql(&self.name);
        let url = self.url.clone();
        // A thread of its own with its own runtime: the test's runtime may be the one
        // unwinding, and a runtime cannot be blocked on from inside another.
        let dropped = std::thread::spawn(move || -> Result<(), BoxError> {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            rt.block_on(async {
                let (client, connection) =
                    tokio_postgres::connect(&url, tokio_postgres::NoTls).await?;
                let connection = tokio::spawn(connection);
                client.batch_execute(&sql).await?;
                drop(client);
                let _ = connection.await;
                Ok(())
            })
        })
        .join();
        match dropped {
            Ok(Ok(())) => {}
            Ok(Err(e)) => eprintln!("could not drop schema {}: {e}", self.name),
            Err(_) => eprintln!(
                "could not drop schema {}: the cleanup thread panicked",
                self.name
            ),
        }
    }
}

/// A running demo process, killed when this guard goes out of scope.
struct Demo {
    child: Child,
    addr: SocketAddr,
    /// The lines the demo prints on stdout, as they come.
    stdout: mpsc::Receiver<String>,
}

impl Demo {
    /// Starts the demo on a port of its own, on `schema` in PostgreSQL, or on the memory
    /// store when `schema` is `None` (then `DATABASE_URL` is removed from its environment).
    fn start(schema: Option<&Schema>) -> Self {
        Self::start_with(schema, &[])
    }

    /// Like [`start`](Self::start), with more command-line arguments.
    ///
    /// The demo binds port 0 and the test reads the port it was given from the line
    /// that says where it listens. A port found free beforehand could be taken by
    /// anything else on the machine before the demo binds it.
    fn start_with(schema: Option<&Schema>, args: &[&str]) -> Self {
        let mut cmd = Command::new(demo_binary());
        cmd.arg("--addr").arg("127.0.0.1:0").args(args);
        match schema {
            // Behind the suite's transaction pooler (`TI_POOLER_URL`), as a deployment
            // behind one would run it: statements through the pooler, `LISTEN` direct.
            Some(schema) => match common::pooler_url() {
                Some(pooler) => {
                    cmd.arg("--database-url").arg(pooler);
                    cmd.arg("--transaction-pooler");
                    cmd.arg("--listen-url").arg(&schema.url);
                    cmd.arg("--schema").arg(&schema.name);
                }
                None => {
                    cmd.arg("--database-url").arg(&schema.url);
                    cmd.arg("--schema").arg(&schema.name);
                }
            },
            None => {
                cmd.env_remove("DATABASE_URL");
            }
        }
        cmd.env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let mut child = cmd.spawn().expect("start the payments demo");
        let pid = child.id();
        let out = child.stdout.take().expect("the demo's stdout");
        let (tx, rx) = mpsc::channel();
        // Drains stdout until the process ends, so the demo never blocks on a full pipe.
        // The lines also go to the test's captured output, shown when a test fails.
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                println!("[demo {pid}] {line}");
                let _ = tx.send(line);
            }
        });
        let addr = first_line_starting_with(&rx, LISTENING)
            .ok_or_else(|| "it did not say where it listens".to_owned())
            .and_then(|line| {
                line[LISTENING.len()..]
                    .parse::<SocketAddr>()
                    .map_err(|e| format!("its address in {line:?}: {e}"))
            });
        let addr = addr.unwrap_or_else(|why| {
            // Not yet in a guard that kills it: kill it here, so that it is not left running.
            let _ = child.kill();
            let status = child.wait().map(|s| s.to_string());
            panic!("the demo (pid {pid}) did not start: {why}; exit: {status:?}")
        });
        Self {
            child,
            addr,
            stdout: rx,
        }
    }

    /// The first line of stdout (from those not read yet) that starts with `prefix`.
    fn line_starting_with(&self, prefix: &str) -> String {
        first_line_starting_with(&self.stdout, prefix).unwrap_or_else(|| {
            panic!(
                "the demo at {} printed no line starting with {prefix:?}",
                self.addr
            )
        })
    }

    /// Polls `GET /stats` until the demo answers 200.
    async fn wait_ready(&mut self, client: &HttpClient) {
        for _ in 0..POLL_ATTEMPTS {
            if let Some(status) = self.child.try_wait().expect("the demo's status") {
                panic!("the demo at {} exited before serving: {status}", self.addr);
            }
            if let Ok(reply) = request(client, Method::GET, self.addr, "/stats", None, "").await
                && reply.status == StatusCode::OK
            {
                return;
            }
            tokio::time::sleep(POLL_INTERVAL).await;
        }
        panic!("the demo at {} did not become ready", self.addr);
    }
}

impl Demo {
    /// SIGKILL: the process dies where it stands, with no chance to clean up.
    fn kill9(&mut self) {
        self.child.kill().expect("SIGKILL the demo");
        self.child.wait().expect("reap the demo");
    }
}

impl Demo {
    /// SIGTERM: the demo stops taking payments and finishes those in flight.
    fn terminate(&mut self) {
        let status = Command::new("kill")
            .arg("-TERM")
            .arg(self.child.id().to_string())
            .status()
            .expect("run kill");
        assert!(status.success());
    }
}

impl Drop for Demo {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A response, read in full.
#[derive(Debug, Clone)]
struct Reply {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
}

impl Reply {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", String::from_utf8_lossy(&self.body)))
    }

    fn replayed(&self) -> bool {
        self.header("idempotent-replayed") == Some("true")
    }

    /// Asserts a problem document of `status` whose `type` ends with `#slug`.
    fn assert_problem(&self, status: StatusCode, slug: &str) {
        assert_eq!(self.status, status, "{self:?}");
        assert_eq!(
            self.header("content-type"),
            Some("application/problem+json"),
            "{self:?}"
        );
        let ty = self.json()["type"]
            .as_str()
            .map(str::to_owned)
            .unwrap_or_default();
        assert!(
            ty.ends_with(&format!("#{slug}")),
            "type {ty:?}, expected #{slug}"
        );
    }
}

async fn request(
    client: &HttpClient,
    method: Method,
    addr: SocketAddr,
    path: &str,
    key: Option<&str>,
    body: &str,
) -> Result<Reply, BoxError> {
    request_with(client, method, addr, path, key, body, &[]).await
}

/// [`request`] with more header fields.
async fn request_with(
    client: &HttpClient,
    method: Method,
    addr: SocketAddr,
    path: &str,
    key: Option<&str>,
    body: &str,
    headers: &[(&str, &str)],
) -> Result<Reply, BoxError> {
    let mut req = Request::builder()
        .method(method)
        .uri(format!("http://{addr}{path}"));
    for (name, value) in headers {
        req = req.header(*name, *value);
    }
    if let Some(key) = key {
        req = req.header("idempotency-key", key);
    }
    let typed = headers
        .iter()
        .any(|(name, _)| name.eq_ignore_ascii_case("content-type"));
    if !body.is_empty() && !typed {
        req = req.header(header::CONTENT_TYPE, "application/json");
    }
    let res = client
        .request(req.body(Full::new(Bytes::from(body.to_owned())))?)
        .await?;
    let (parts, body) = res.into_parts();
    let body = body.collect().await?.to_bytes();
    Ok(Reply {
        status: parts.status,
        headers: parts.headers,
        body,
    })
}

async fn post_payment(
    client: &HttpClient,
    addr: SocketAddr,
    key: Option<&str>,
    body: &str,
) -> Reply {
    request(client, Method::POST, addr, "/payments", key, body)
        .await
        .unwrap_or_else(|e| panic!("POST /payments on {addr}: {e}"))
}

async fn stats(client: &HttpClient, addr: SocketAddr) -> Value {
    let reply = request(client, Method::GET, addr, "/stats", None, "")
        .await
        .unwrap_or_else(|e| panic!("GET /stats on {addr}: {e}"));
    assert_eq!(reply.status, StatusCode::OK, "{reply:?}");
    reply.json()
}

/// Sends `n` concurrent `POST /payments` of [`SLOW_PAYMENT`] with one key, alternating
/// between two processes. Every answer must be a 201 or a 409 `in-progress` with
/// `Retry-After`; the 201s must be byte-identical and all but one replays (one
/// execution). Returns the 201s.
async fn one_key_split_over(
    client: &HttpClient,
    addrs: [SocketAddr; 2],
    key: &'static str,
    n: usize,
) -> Vec<Reply> {
    let start = Arc::new(tokio::sync::Barrier::new(n));
    let tasks: Vec<_> = (0..n)
        .map(|i| {
            let addr = addrs[i % 2];
            let (client, start) = (client.clone(), start.clone());
            tokio::spawn(async move {
                start.wait().await;
                post_payment(&client, addr, Some(key), SLOW_PAYMENT).await
            })
        })
        .collect();
    let mut replies = Vec::with_capacity(n);
    for task in tasks {
        replies.push(task.await.expect("a request task"));
    }
    let mut created = Vec::new();
    for reply in &replies {
        match reply.status {
            StatusCode::CREATED => created.push(reply.clone()),
            StatusCode::CONFLICT => {
                assert!(
                    reply.header("retry-after").is_some(),
                    "409 without Retry-After: {reply:?}"
                );
                reply.assert_problem(StatusCode::CONFLICT, "in-progress");
            }
            _ => panic!(
                "expected 201 or 409, got {reply:?}; all statuses: {:?}",
                replies
                    .iter()
                    .map(|r| r.status.as_u16())
                    .collect::<Vec<_>>()
            ),
        }
    }
    println!(
        "{} x 201, {} x 409",
        created.len(),
        replies.len() - created.len()
    );
    assert!(
        !created.is_empty(),
        "no 201 among {} replies",
        replies.len()
    );
    let first = created[0].body.clone();
    assert!(
        created.iter().all(|r| r.body == first),
        "the 201 bodies differ: {:?}",
        created
            .iter()
            .map(|r| String::from_utf8_lossy(&r.body))
            .collect::<Vec<_>>()
    );
    // One execution; every other 201 is a replay of it.
    assert_eq!(
        created.iter().filter(|r| !r.replayed()).count(),
        1,
        "{created:?}"
    );
    let payment = created[0].json();
    assert_eq!(payment["amount"], 1250);
    assert_eq!(payment["currency"], "EUR");
    created
}

/// The acceptance check: 100 concurrent requests with one key, over two processes that
/// share one database, charge once and all get the same answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_key_over_two_processes_charges_once() {
    let schema = Schema::new();
    let mut a = Demo::start(Some(&schema));
    let mut b = Demo::start(Some(&schema));
    let client = client();
    a.wait_ready(&client).await;
    b.wait_ready(&client).await;

    const KEY: &str = "acceptance-payment-1";
    const REQUESTS: usize = 100;
    let created = one_key_split_over(&client, [a.addr, b.addr], KEY, REQUESTS).await;
    let first = created[0].body.clone();

    // A retry, as a client answered 409 would make it, gets the stored response.
    let retried = retry_until_created(&client, b.addr, KEY, SLOW_PAYMENT).await;
    assert_eq!(retried.body, first);
    assert!(
        retried.replayed(),
        "the retry was not a replay: {retried:?}"
    );

    // Both processes read the same database.
    let once = json!({"handler_runs": 1, "psp_calls": 1, "charges": 1, "payments": 1});
    assert_eq!(stats(&client, a.addr).await, once);
    assert_eq!(stats(&client, b.addr).await, once);
}

/// The acceptance check over both drivers: one process keeps its keys through
/// tokio-postgres, the other through sqlx (`--driver sqlx`), on one table; 100
/// concurrent requests with one key charge once, and a retry on either is a replay.
#[cfg(feature = "sqlx")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_key_over_a_tokio_postgres_and_a_sqlx_process_charges_once() {
    let schema = Schema::new();
    let mut a = Demo::start(Some(&schema));
    let mut b = Demo::start_with(Some(&schema), &["--driver", "sqlx"]);
    let client = client();
    a.wait_ready(&client).await;
    b.wait_ready(&client).await;

    const KEY: &str = "two-drivers-payment-1";
    let created = one_key_split_over(&client, [a.addr, b.addr], KEY, 100).await;
    let first = created[0].body.clone();
    for addr in [a.addr, b.addr] {
        let retried = retry_until_created(&client, addr, KEY, SLOW_PAYMENT).await;
        assert_eq!(retried.body, first);
        assert!(
            retried.replayed(),
            "the retry was not a replay: {retried:?}"
        );
    }
    let once = json!({"handler_runs": 1, "psp_calls": 1, "charges": 1, "payments": 1});
    assert_eq!(stats(&client, a.addr).await, once);
    assert_eq!(stats(&client, b.addr).await, once);
}

/// `--driver sqlx --mode transactional`: 100 concurrent requests with one key over a
/// sqlx process and a tokio-postgres one, both transactional, on one table: one
/// execution, one charge, one payment (recorded through the sqlx transaction when the
/// sqlx process ran it), and a retry on either replays.
#[cfg(feature = "sqlx")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn transactional_duplicates_over_a_sqlx_and_a_tokio_postgres_process_commit_once() {
    const KEY: &str = "tx-sqlx-payment-1";
    let schema = Schema::new();
    let mut a = Demo::start_with(
        Some(&schema),
        &["--driver", "sqlx", "--mode", "transactional"],
    );
    let mut b = Demo::start_with(Some(&schema), &["--mode", "transactional"]);
    let client = client();
    a.wait_ready(&client).await;
    b.wait_ready(&client).await;

    let created = one_key_split_over(&client, [a.addr, b.addr], KEY, 100).await;
    let first = created[0].body.clone();
    for addr in [a.addr, b.addr] {
        let retried = retry_until_created(&client, addr, KEY, SLOW_PAYMENT).await;
        assert_eq!(retried.body, first);
        assert!(
            retried.replayed(),
            "the retry was not a replay: {retried:?}"
        );
    }
    let once = json!({"handler_runs": 1, "psp_calls": 1, "charges": 1, "payments": 1});
    assert_eq!(stats(&client, a.addr).await, once);
    // The sqlx process alone, so that its own transaction records the payment.
    const ALONE: &str = "tx-sqlx-payment-2";
    let paid = retry_until_created(&client, a.addr, ALONE, SLOW_PAYMENT).await;
    assert!(!paid.replayed());
    let twice = json!({"handler_runs": 2, "psp_calls": 2, "charges": 2, "payments": 2});
    assert_eq!(stats(&client, b.addr).await, twice);
}

/// Requests the layer or the handler refuse.
#[tokio::test]
async fn invalid_requests_are_refused() {
    let schema = Schema::new();
    let mut demo = Demo::start(Some(&schema));
    let client = client();
    demo.wait_ready(&client).await;
    let payment = r#"{"amount":1250,"currency":"EUR"}"#;

    // Refused by the layer: the handler does not run.
    post_payment(&client, demo.addr, None, payment)
        .await
        .assert_problem(StatusCode::BAD_REQUEST, "key-missing");
    let long_key = "k".repeat(256);
    post_payment(&client, demo.addr, Some(&long_key), payment)
        .await
        .assert_problem(StatusCode::BAD_REQUEST, "key-malformed");

    // Refused by the handler: it ran, charged nothing, and its 422 is not stored, so
    // the corrected payment goes through under the same key, charged once.
    let bad_body = r#"{"amount":0,"currency":"EUR"}"#;
    let refused = post_payment(&client, demo.addr, Some("bad-body-1"), bad_body).await;
    assert_eq!(
        refused.status,
        StatusCode::UNPROCESSABLE_ENTITY,
        "{refused:?}"
    );
    assert_eq!(
        refused.header("content-type"),
        Some("application/problem+json")
    );
    assert!(!refused.replayed());
    let again = post_payment(&client, demo.addr, Some("bad-body-1"), bad_body).await;
    assert_eq!(again.status, StatusCode::UNPROCESSABLE_ENTITY, "{again:?}");
    assert!(!again.replayed(), "{again:?}");
    let corrected = post_payment(&client, demo.addr, Some("bad-body-1"), payment).await;
    assert_eq!(corrected.status, StatusCode::CREATED, "{corrected:?}");
    let replayed = post_payment(&client, demo.addr, Some("bad-body-1"), payment).await;
    assert!(replayed.replayed(), "{replayed:?}");
    assert_eq!(replayed.body, corrected.body);

    // Each of these is refused the same way, and charges nothing.
    let bad_bodies = [
        "",
        "[]",
        "not json",
        r#"{"currency":"EUR"}"#,
        r#"{"amount":-5,"currency":"EUR"}"#,
        r#"{"amount":12.5,"currency":"EUR"}"#,
        r#"{"amount":1e3,"currency":"EUR"}"#,
        r#"{"amount":99999999999999999999,"currency":"EUR"}"#,
        r#"{"amount":1250,"currency":"eur"}"#,
        r#"{"amount":1250,"currency":"EURO"}"#,
        r#"{"amount":1250}"#,
        r#"{"amount":1250,"currency":"EUR","delay_ms":60001}"#,
        r#"{"amount":1250,"currency":"EUR","delay_ms":-1}"#,
        r#"{"amount":1250,"currency":"EUR","note":"x"}"#,
        r#"{"amount":-1,"currency":"EUR","amount":5}"#,
        r#"{"amount":5,"currency":"EUR","currency":"USD"}"#,
    ];
    for (i, body) in bad_bodies.iter().enumerate() {
        post_payment(&client, demo.addr, Some(&format!("bad-{i}")), body)
            .await
            .assert_problem(
                StatusCode::UNPROCESSABLE_ENTITY,
                "payments-demo-invalid-payment",
            );
    }

    assert_eq!(
        stats(&client, demo.addr).await,
        json!({
            "handler_runs": 3 + bad_bodies.len(),
            "psp_calls": 1,
            "charges": 1,
            "payments": 1
        })
    );
}

/// Without a database the demo runs on the memory store, and still replays.
#[tokio::test]
async fn without_a_database_the_demo_uses_the_memory_store() {
    let mut demo = Demo::start(None);
    let store = demo.line_starting_with("store:");
    assert!(store.starts_with("store: memory"), "{store:?}");
    let client = client();
    demo.wait_ready(&client).await;

    let payment = r#"{"amount":500,"currency":"USD"}"#;
    let first = post_payment(&client, demo.addr, Some("memory-1"), payment).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    assert!(!first.replayed());
    let again = post_payment(&client, demo.addr, Some("memory-1"), payment).await;
    assert_eq!(again.status, StatusCode::CREATED, "{again:?}");
    assert!(again.replayed(), "{again:?}");
    assert_eq!(again.body, first.body);

    assert_eq!(
        stats(&client, demo.addr).await,
        json!({"handler_runs": 1, "psp_calls": 1, "charges": 1, "payments": 1})
    );
}

/// Runs the demo with `args` until it exits by itself (within 30 s, else it is killed
/// and the test fails): its exit status and what it printed on stderr.
fn demo_exits(args: &[&str]) -> (std::process::ExitStatus, String) {
    let mut child = Command::new(demo_binary())
        .args(args)
        .env("NO_COLOR", "1")
        .env_remove("DATABASE_URL")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the payments demo");
    let mut stderr = child.stderr.take().expect("the demo's stderr");
    let reading = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = std::io::Read::read_to_string(&mut stderr, &mut text);
        text
    });
    for _ in 0..POLL_ATTEMPTS {
        if let Some(status) = child.try_wait().expect("the demo's status") {
            return (status, reading.join().expect("stderr read"));
        }
        std::thread::sleep(POLL_INTERVAL);
    }
    let _ = child.kill();
    let _ = child.wait();
    panic!(
        "the demo did not exit: {}",
        reading.join().unwrap_or_default()
    );
}

/// A role with no rights on a fresh database: the demo stops at start-up and says why,
/// in PostgreSQL's words and with its SQLSTATE, and which right migrating needs.
#[tokio::test]
async fn a_role_with_no_rights_on_a_fresh_database_makes_the_demo_print_permission_denied() {
    let role = common::TestRole::new().await;
    let db = common::TestDatabase::new().await;
    let url = db.url_as(&role.name);
    let (status, stderr) = tokio::task::spawn_blocking(move || {
        demo_exits(&["--addr", "127.0.0.1:0", "--database-url", &url])
    })
    .await
    .expect("join");
    assert!(!status.success(), "{stderr}");
    assert!(stderr.contains("permission denied"), "{stderr}");
    assert!(stderr.contains("(SQLSTATE 42501)"), "{stderr}");
    assert!(stderr.contains("CREATE on the database"), "{stderr}");
}

/// `--print-migration-sql` prints the store's migrations for `--schema` and exits,
/// without a database.
#[test]
fn the_demo_prints_its_migrations_as_sql() {
    let out = Command::new(demo_binary())
        .args(["--print-migration-sql", "--schema", "ledger"])
        .env_remove("DATABASE_URL")
        .stdin(Stdio::null())
        .output()
        .expect("run the payments demo");
    assert!(out.status.success(), "{out:?}");
    let sql = String::from_utf8(out.stdout).expect("UTF-8");
    assert!(
        sql.contains("CREATE TABLE IF NOT EXISTS \"ledger\".\"idempotency_keys\""),
        "{sql}"
    );
    assert!(
        sql.contains(
            "INSERT INTO \"ledger\".\"idempotency_keys_migrations\" (version) VALUES (1);"
        ),
        "{sql}"
    );
}

/// On the memory store the demo's memory is bounded: it says so when it starts, the
/// store and the demo's ledger keep the last keys only, and `/stats` still counts every
/// run, charge and payment. A key evicted from both is a new key: it runs, and is
/// charged, again.
#[tokio::test]
async fn on_the_memory_store_the_demo_keeps_the_last_keys_and_counts_them_all() {
    let mut demo = Demo::start_with(None, &["--memory-max-keys", "3"]);
    let store = demo.line_starting_with("store:");
    assert!(store.starts_with("store: memory"), "{store:?}");
    assert!(store.contains("at most 3 keys or 64 MiB"), "{store:?}");
    assert!(
        store.contains("the last 3 charges and payments"),
        "{store:?}"
    );
    let client = client();
    demo.wait_ready(&client).await;

    let payment = r#"{"amount":500,"currency":"USD"}"#;
    for i in 0..5 {
        let key = format!("bounded-{i}");
        let reply = post_payment(&client, demo.addr, Some(&key), payment).await;
        assert_eq!(reply.status, StatusCode::CREATED, "{reply:?}");
        assert!(!reply.replayed(), "{reply:?}");
    }
    assert_eq!(
        stats(&client, demo.addr).await,
        json!({"handler_runs": 5, "psp_calls": 5, "charges": 5, "payments": 5})
    );
    // The last keys are kept, and replayed.
    let last = post_payment(&client, demo.addr, Some("bounded-4"), payment).await;
    assert_eq!(last.status, StatusCode::CREATED, "{last:?}");
    assert!(last.replayed(), "{last:?}");
    // The first went, from the store and from the provider's memory alike.
    let first = post_payment(&client, demo.addr, Some("bounded-0"), payment).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    assert!(!first.replayed(), "{first:?}");
    assert_eq!(
        stats(&client, demo.addr).await,
        json!({"handler_runs": 6, "psp_calls": 6, "charges": 6, "payments": 6})
    );
}

/// One query on the test's database, outside the demo.
async fn query(sql: &str) -> Vec<tokio_postgres::Row> {
    let (client, connection) = tokio_postgres::connect(&database_url(), tokio_postgres::NoTls)
        .await
        .expect("connect");
    tokio::spawn(connection);
    client.query(sql, &[]).await.expect("query")
}

/// Crash in the window after the charge: the process is killed -9 while its handler
/// sleeps between charging the provider and recording the payment. After a restart the
/// retry takes the key over (its holder gone), runs the handler again, and gets the
/// charge the first run recorded as its step, without calling the provider again: one
/// provider call, one charge, one payment, and a proper 201.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_killed_after_the_charge_is_retried_into_one_payment() {
    const KEY: &str = "crash-payment-1";
    // The window between charge and record is long enough that the kill lands in it on
    // a loaded machine too.
    const PAYMENT: &str = r#"{"amount":700,"currency":"EUR","delay_ms":4000}"#;
    let schema = Schema::new();
    let client = client();
    let mut first = Demo::start_with(Some(&schema), &["--lease-ms", "500"]);
    first.wait_ready(&client).await;

    let (c, addr) = (client.clone(), first.addr);
    let in_flight = tokio::spawn(async move {
        request(&c, Method::POST, addr, "/payments", Some(KEY), PAYMENT).await
    });
    // Wait until the provider has charged: the handler is inside the window.
    let mut charged = false;
    for _ in 0..POLL_ATTEMPTS {
        if stats(&client, first.addr).await["charges"] == 1 {
            charged = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(charged, "the handler never charged");
    first.kill9();
    assert!(
        in_flight.await.expect("join").is_err(),
        "the killed process answered"
    );
    let charge_id: String = query(&format!(
        "SELECT charge_id FROM \"{}\".demo_psp_charges",
        schema.name
    ))
    .await[0]
        .get(0);
    let key_row = query(&format!(
        "SELECT state, token FROM \"{}\".idempotency_keys WHERE key = '{KEY}'",
        schema.name
    ))
    .await;
    assert_eq!(
        key_row[0].get::<_, &str>(0),
        "running",
        "the crash left the claim running"
    );
    let crashed_token: i64 = key_row[0].get(1);

    let mut second = Demo::start_with(Some(&schema), &["--lease-ms", "500"]);
    second.wait_ready(&client).await;
    let created = retry_until_created(&client, second.addr, KEY, PAYMENT).await;
    assert!(
        !created.replayed(),
        "the retry ran the handler after taking over"
    );
    let payment = created.json();
    assert_eq!(
        payment["charge_id"],
        charge_id.as_str(),
        "the retry got the first charge"
    );
    assert_eq!(payment["amount"], 700);
    assert!(
        payment["payment_id"]
            .as_str()
            .is_some_and(|p| p.starts_with("pay_"))
    );

    let replay = post_payment(&client, second.addr, Some(KEY), PAYMENT).await;
    assert!(replay.replayed());
    assert_eq!(replay.body, created.body);
    assert_eq!(
        stats(&client, second.addr).await,
        json!({"handler_runs": 2, "psp_calls": 1, "charges": 1, "payments": 1})
    );
    let key_row = query(&format!(
        "SELECT state, token FROM \"{}\".idempotency_keys WHERE key = '{KEY}'",
        schema.name
    ))
    .await;
    assert_eq!(
        (key_row[0].get::<_, &str>(0), key_row[0].get::<_, i64>(1)),
        ("completed", crashed_token + 1),
        "taken over once, then completed"
    );
}

/// SIGTERM while a payment is in flight: it finishes, its response is stored, and the
/// process exits cleanly; after a restart the retry is a replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_finishes_the_payment_in_flight() {
    const KEY: &str = "term-payment-1";
    // Long enough that the SIGTERM comes while the payment is in flight.
    const PAYMENT: &str = r#"{"amount":900,"currency":"EUR","delay_ms":4000}"#;
    let schema = Schema::new();
    let client = client();
    let mut demo = Demo::start(Some(&schema));
    demo.wait_ready(&client).await;
    let (c, addr) = (client.clone(), demo.addr);
    let in_flight = tokio::spawn(async move {
        request(&c, Method::POST, addr, "/payments", Some(KEY), PAYMENT).await
    });
    let mut charged = false;
    for _ in 0..POLL_ATTEMPTS {
        if stats(&client, demo.addr).await["charges"] == 1 {
            charged = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(charged, "the handler never charged");
    demo.terminate();
    assert!(
        !in_flight.is_finished(),
        "the payment was answered before the SIGTERM"
    );
    let answered = in_flight
        .await
        .expect("join")
        .expect("the payment in flight is answered");
    assert_eq!(answered.status, StatusCode::CREATED, "{answered:?}");
    demo.line_starting_with("stopped");
    let status = demo.child.wait().expect("wait");
    assert!(status.success(), "{status}");

    let mut again = Demo::start(Some(&schema));
    again.wait_ready(&client).await;
    let replay = post_payment(&client, again.addr, Some(KEY), PAYMENT).await;
    assert!(replay.replayed(), "{replay:?}");
    assert_eq!(replay.body, answered.body);
    assert_eq!(
        stats(&client, again.addr).await,
        json!({"handler_runs": 1, "psp_calls": 1, "charges": 1, "payments": 1})
    );
}

/// A second SIGTERM stops the demo where it stands, as a crash would, instead of
/// waiting for a long payment to finish: exit status 128 + 15, and the payment's key
/// still running in the table, to be taken over when its lease lapses.
#[tokio::test]
async fn a_second_sigterm_stops_the_demo_at_once() {
    const KEY: &str = "term-twice-1";
    const PAYMENT: &str = r#"{"amount":900,"currency":"EUR","delay_ms":60000}"#;
    let schema = Schema::new();
    let client = client();
    let mut demo = Demo::start(Some(&schema));
    demo.wait_ready(&client).await;
    let (c, addr) = (client.clone(), demo.addr);
    let _in_flight = tokio::spawn(async move {
        request(&c, Method::POST, addr, "/payments", Some(KEY), PAYMENT).await
    });
    assert!(
        wait_for_stat(&client, demo.addr, "charges", 1).await,
        "the handler never charged"
    );
    demo.terminate();
    demo.line_starting_with("shutting down");
    demo.terminate();
    // Bounded, far below the payment's 60 s: it is not waited for.
    let mut status = None;
    for _ in 0..500 {
        status = demo.child.try_wait().expect("try_wait");
        if status.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let status = status.expect("the demo still runs after a second SIGTERM");
    assert_eq!(status.code(), Some(128 + 15), "{status}");
    assert_eq!(
        key_row(&schema, KEY)
            .await
            .map(|(state, _)| state)
            .as_deref(),
        Some("running")
    );
}

/// Polls `GET /stats` on `addr` until `field` equals `value`; `false` if it never does.
async fn wait_for_stat(client: &HttpClient, addr: SocketAddr, field: &str, value: i64) -> bool {
    for _ in 0..POLL_ATTEMPTS {
        if stats(client, addr).await[field] == value {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}

/// `GET /stats/store`: the idempotency store's counters.
async fn store_stats(client: &HttpClient, addr: SocketAddr) -> Value {
    let reply = request(client, Method::GET, addr, "/stats/store", None, "")
        .await
        .unwrap_or_else(|e| panic!("GET /stats/store on {addr}: {e}"));
    assert_eq!(reply.status, StatusCode::OK, "{reply:?}");
    reply.json()
}

/// Retries `key` with `body` on `addr` until it answers 201; 409 in-progress is the
/// only other answer allowed meanwhile.
async fn retry_until_created(
    client: &HttpClient,
    addr: SocketAddr,
    key: &str,
    body: &str,
) -> Reply {
    let mut answers = Vec::new();
    loop {
        let reply = post_payment(client, addr, Some(key), body).await;
        answers.push(reply.status.as_u16());
        if reply.status == StatusCode::CREATED {
            return reply;
        }
        reply.assert_problem(StatusCode::CONFLICT, "in-progress");
        assert!(answers.len() < POLL_ATTEMPTS as usize, "{answers:?}");
        tokio::time::sleep(POLL_INTERVAL).await;
    }
}

/// The state and token of `key`'s row in the schema's key table, if it has one.
async fn key_row(schema: &Schema, key: &str) -> Option<(String, i64)> {
    query(&format!(
        "SELECT state, token FROM \"{}\".idempotency_keys WHERE key = '{key}'",
        schema.name
    ))
    .await
    .first()
    .map(|row| (row.get(0), row.get(1)))
}

/// Transactional mode, crash in the window after the charge: the claim, still
/// uncommitted, goes with the process, and so does the payment row written in its
/// transaction. Only the provider's charge (outside the transaction) survives. After a
/// restart the retry claims the key afresh, the provider returns the same charge for
/// the same derived key, and the payment commits once with its response.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transactional_crash_rolls_back_and_the_retry_commits_once() {
    transactional_crash(&["--mode", "transactional", "--lease-ms", "500"]).await;
}

/// [`transactional_crash_rolls_back_and_the_retry_commits_once`] on sqlx (`--driver
/// sqlx`): the process killed mid-handler takes its connection of the app's `PgPool`,
/// and the transaction with it.
#[cfg(feature = "sqlx")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sqlx_transactional_crash_rolls_back_and_the_retry_commits_once() {
    transactional_crash(&[
        "--driver",
        "sqlx",
        "--mode",
        "transactional",
        "--lease-ms",
        "500",
    ])
    .await;
}

/// A transactional demo process started with `args`, killed (`SIGKILL`) after the
/// charge and before the commit, then a process started with them again.
async fn transactional_crash(args: &[&str]) {
    const KEY: &str = "tx-crash-payment-1";
    // The window between charge and record is long enough that the kill lands in it on
    // a loaded machine too.
    const PAYMENT: &str = r#"{"amount":700,"currency":"EUR","delay_ms":4000}"#;
    let schema = Schema::new();
    let client = client();
    let mut first = Demo::start_with(Some(&schema), args);
    assert_eq!(first.line_starting_with("mode:"), "mode: transactional");
    first.wait_ready(&client).await;

    let (c, addr) = (client.clone(), first.addr);
    let in_flight = tokio::spawn(async move {
        request(&c, Method::POST, addr, "/payments", Some(KEY), PAYMENT).await
    });
    // The provider has charged: the handler is inside the window, before the commit.
    assert!(
        wait_for_stat(&client, first.addr, "charges", 1).await,
        "the handler never charged"
    );
    first.kill9();
    assert!(
        in_flight.await.expect("join").is_err(),
        "the killed process answered"
    );

    // Rolled back: no payment, no key. The charge was made outside the transaction.
    let payments = query(&format!(
        "SELECT payment_id FROM \"{}\".demo_payments",
        schema.name
    ))
    .await;
    assert!(payments.is_empty(), "{} payment row(s)", payments.len());
    assert_eq!(
        key_row(&schema, KEY).await,
        None,
        "the crashed claim was not rolled back"
    );
    let charges = query(&format!(
        "SELECT charge_id FROM \"{}\".demo_psp_charges",
        schema.name
    ))
    .await;
    assert_eq!(charges.len(), 1);
    let charge_id: String = charges[0].get(0);

    let mut second = Demo::start_with(Some(&schema), args);
    second.wait_ready(&client).await;
    let created = retry_until_created(&client, second.addr, KEY, PAYMENT).await;
    assert!(
        !created.replayed(),
        "nothing was stored, so the retry ran the handler: {created:?}"
    );
    let payment = created.json();
    assert_eq!(
        payment["charge_id"],
        charge_id.as_str(),
        "the provider returned the charge made before the crash"
    );
    assert_eq!(payment["amount"], 700);
    assert_eq!(payment["currency"], "EUR");

    assert_eq!(
        stats(&client, second.addr).await,
        json!({"handler_runs": 2, "psp_calls": 2, "charges": 1, "payments": 1})
    );
    let payments = query(&format!(
        "SELECT payment_id, charge_id FROM \"{}\".demo_payments",
        schema.name
    ))
    .await;
    assert_eq!(payments.len(), 1);
    assert_eq!(payments[0].get::<_, &str>(0), payment["payment_id"]);
    assert_eq!(payments[0].get::<_, &str>(1), charge_id);
    assert_eq!(
        key_row(&schema, KEY)
            .await
            .map(|(state, _)| state)
            .as_deref(),
        Some("completed"),
        "a fresh claim (the crashed one left no row), completed"
    );

    let replay = post_payment(&client, second.addr, Some(KEY), PAYMENT).await;
    assert_eq!(replay.status, StatusCode::CREATED, "{replay:?}");
    assert!(replay.replayed(), "{replay:?}");
    assert_eq!(replay.body, created.body);
    assert_eq!(
        stats(&client, second.addr).await,
        json!({"handler_runs": 2, "psp_calls": 2, "charges": 1, "payments": 1})
    );
}

/// Transactional mode over two processes: 100 concurrent requests with one key block
/// on the first one's uncommitted claim and replay its committed response (or get 409
/// if the lock timeout is hit): one execution, one charge, one payment.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn transactional_duplicates_over_two_processes_commit_once() {
    const KEY: &str = "tx-acceptance-payment-1";
    const REQUESTS: usize = 100;
    const ARGS: &[&str] = &["--mode", "transactional"];
    let schema = Schema::new();
    let mut a = Demo::start_with(Some(&schema), ARGS);
    let mut b = Demo::start_with(Some(&schema), ARGS);
    let client = client();
    a.wait_ready(&client).await;
    b.wait_ready(&client).await;

    one_key_split_over(&client, [a.addr, b.addr], KEY, REQUESTS).await;

    let once = json!({"handler_runs": 1, "psp_calls": 1, "charges": 1, "payments": 1});
    assert_eq!(stats(&client, a.addr).await, once);
    assert_eq!(stats(&client, b.addr).await, once);
    assert_eq!(
        key_row(&schema, KEY)
            .await
            .map(|(state, _)| state)
            .as_deref(),
        Some("completed")
    );
}

/// Waiting for the first request across processes: a duplicate on B, which waits,
/// is woken by the notification A's completion sends through PostgreSQL, and replays
/// A's response; no fallback timer is involved.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_duplicate_on_another_process_is_woken_by_a_notification() {
    const KEY: &str = "wait-payment-1";
    // Long enough for B's duplicate to claim and register before A completes, and
    // ending half a second from any of the waiter's own once-a-second looks (liveness:
    // the first comes a second after it starts waiting, just after A's handler starts),
    // so that the notification, not a look landing just after the completion, wakes it.
    const PAYMENT: &str = r#"{"amount":1100,"currency":"EUR","delay_ms":3500}"#;
    let schema = Schema::new();
    let client = client();
    let mut a = Demo::start(Some(&schema));
    let mut b = Demo::start_with(Some(&schema), &["--wait-ms", "10000"]);
    assert_eq!(b.line_starting_with("wait:"), "wait: 10000 ms");
    a.wait_ready(&client).await;
    b.wait_ready(&client).await;
    let before = store_stats(&client, b.addr).await;
    assert_eq!(before["store"], "postgres", "{before}");
    assert_eq!(before["listening"], true, "{before}");

    let (c, addr) = (client.clone(), a.addr);
    let on_a = tokio::spawn(async move {
        request(&c, Method::POST, addr, "/payments", Some(KEY), PAYMENT).await
    });
    assert!(
        wait_for_stat(&client, a.addr, "handler_runs", 1).await,
        "the handler on A never ran"
    );
    let on_b = post_payment(&client, b.addr, Some(KEY), PAYMENT).await;
    let on_a = on_a
        .await
        .expect("join")
        .expect("A answers the first request");
    assert_eq!(on_a.status, StatusCode::CREATED, "{on_a:?}");
    assert!(!on_a.replayed(), "{on_a:?}");
    assert_eq!(on_b.status, StatusCode::CREATED, "{on_b:?}");
    assert!(on_b.replayed(), "B ran the payment itself: {on_b:?}");
    assert_eq!(on_b.body, on_a.body);

    let store = store_stats(&client, b.addr).await;
    assert_eq!(store["listening"], true, "{store}");
    assert!(
        store["notified_wakeups"].as_u64().is_some_and(|n| n >= 1),
        "B's waiter was not woken by a notification: {store}"
    );
    assert_eq!(store["timer_wakeups"], 0, "B polled: {store}");
    assert_eq!(
        stats(&client, b.addr).await,
        json!({"handler_runs": 1, "psp_calls": 1, "charges": 1, "payments": 1})
    );
}

/// A duplicate waiting on process B for a payment running on process A, when A is
/// killed mid-payment: nothing notifies B, so it looks again when A's lease lapses,
/// takes the key over and completes the payment with the charge A recorded, the
/// provider called once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_duplicate_takes_over_from_a_killed_process() {
    const KEY: &str = "wait-crash-payment-1";
    const PAYMENT: &str = r#"{"amount":1700,"currency":"EUR","delay_ms":5000}"#;
    let schema = Schema::new();
    let client = client();
    let mut a = Demo::start_with(Some(&schema), &["--lease-ms", "1000"]);
    let mut b = Demo::start_with(Some(&schema), &["--lease-ms", "1000", "--wait-ms", "30000"]);
    a.wait_ready(&client).await;
    b.wait_ready(&client).await;

    let (c, addr) = (client.clone(), a.addr);
    let on_a = tokio::spawn(async move {
        request(&c, Method::POST, addr, "/payments", Some(KEY), PAYMENT).await
    });
    assert!(
        wait_for_stat(&client, a.addr, "charges", 1).await,
        "A never charged"
    );
    let before = store_stats(&client, b.addr).await["statements"]
        .as_u64()
        .expect("statements");
    let (c, addr) = (client.clone(), b.addr);
    let on_b = tokio::spawn(async move { post_payment(&c, addr, Some(KEY), PAYMENT).await });
    // B waits once it has claimed (finding A's claim) and registered as a waiter.
    let mut waiting = false;
    for _ in 0..POLL_ATTEMPTS {
        let now = store_stats(&client, b.addr).await["statements"].as_u64();
        if now.is_some_and(|n| n >= before + 2) {
            waiting = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(waiting, "B never waited");
    a.kill9();
    assert!(
        on_a.await.expect("join").is_err(),
        "the killed process answered"
    );

    let on_b = on_b.await.expect("join");
    assert_eq!(on_b.status, StatusCode::CREATED, "{on_b:?}");
    assert!(
        !on_b.replayed(),
        "B took over and ran the payment: {on_b:?}"
    );
    assert_eq!(
        stats(&client, b.addr).await,
        json!({"handler_runs": 2, "psp_calls": 1, "charges": 1, "payments": 1})
    );
    assert_eq!(
        key_row(&schema, KEY).await.map(|r| r.0).as_deref(),
        Some("completed")
    );
}

/// `--resumable`: a payment whose process A is killed after the charge, and that no
/// client retries, is finished by process B's completer, with the charge A recorded
/// (the provider called once); a later request with the key on B gets the replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_payment_nobody_retries_is_finished_by_another_process() {
    const KEY: &str = "resumed-payment-1";
    const PAYMENT: &str = r#"{"amount":2100,"currency":"EUR","delay_ms":4000}"#;
    let schema = Schema::new();
    let client = client();
    let mut a = Demo::start_with(Some(&schema), &["--resumable"]);
    let mut b = Demo::start_with(Some(&schema), &["--resumable"]);
    a.wait_ready(&client).await;
    b.wait_ready(&client).await;
    let (c, addr) = (client.clone(), a.addr);
    let on_a = tokio::spawn(async move {
        request(&c, Method::POST, addr, "/payments", Some(KEY), PAYMENT).await
    });
    assert!(
        wait_for_stat(&client, a.addr, "charges", 1).await,
        "A never charged"
    );
    a.kill9();
    assert!(
        on_a.await.expect("join").is_err(),
        "the killed process answered"
    );
    // Nobody retries: B finishes it (its handler sleeps the payment's 4 s again).
    let mut finished = false;
    for _ in 0..POLL_ATTEMPTS {
        if key_row(&schema, KEY)
            .await
            .is_some_and(|r| r.0 == "completed")
        {
            finished = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(finished, "the payment was never finished");
    let charge_id: String = query(&format!(
        "SELECT charge_id FROM \"{}\".demo_psp_charges",
        schema.name
    ))
    .await[0]
        .get(0);
    let replay = post_payment(&client, b.addr, Some(KEY), PAYMENT).await;
    assert_eq!(replay.status, StatusCode::CREATED, "{replay:?}");
    assert!(replay.replayed(), "{replay:?}");
    assert_eq!(replay.json()["charge_id"], charge_id.as_str());
    assert_eq!(
        stats(&client, b.addr).await,
        json!({"handler_runs": 2, "psp_calls": 1, "charges": 1, "payments": 1})
    );
}

/// Waiting is bounded: a duplicate that waits longer than `--wait-ms` for a first
/// request still running gets 409 in-progress, and the first request is not disturbed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_duplicate_gives_up_at_its_bound_with_409() {
    const KEY: &str = "wait-bound-payment-1";
    const PAYMENT: &str = r#"{"amount":1300,"currency":"EUR","delay_ms":3000}"#;
    let schema = Schema::new();
    let client = client();
    let mut demo = Demo::start_with(Some(&schema), &["--wait-ms", "300"]);
    demo.wait_ready(&client).await;

    let (c, addr) = (client.clone(), demo.addr);
    let first = tokio::spawn(async move {
        request(&c, Method::POST, addr, "/payments", Some(KEY), PAYMENT).await
    });
    assert!(
        wait_for_stat(&client, demo.addr, "handler_runs", 1).await,
        "the first request's handler never ran"
    );
    let duplicate = post_payment(&client, demo.addr, Some(KEY), PAYMENT).await;
    duplicate.assert_problem(StatusCode::CONFLICT, "in-progress");
    assert!(
        duplicate.header("retry-after").is_some(),
        "409 without Retry-After: {duplicate:?}"
    );

    let first = first
        .await
        .expect("join")
        .expect("the first request is answered");
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    assert!(!first.replayed(), "{first:?}");
    assert_eq!(
        stats(&client, demo.addr).await,
        json!({"handler_runs": 1, "psp_calls": 1, "charges": 1, "payments": 1})
    );
}

/// Posts `payment` under `key` while the demo cannot record payments: the provider
/// charges, and the answer is the 503 problem, naming no internals, with `Retry-After`.
async fn charged_but_not_recorded(
    schema: &Schema,
    client: &HttpClient,
    addr: SocketAddr,
    key: &str,
    payment: &str,
) {
    let payments = format!("\"{}\".demo_payments", schema.name);
    query(&format!(
        "ALTER TABLE {payments} RENAME TO demo_payments_away"
    ))
    .await;
    let failed = post_payment(client, addr, Some(key), payment).await;
    failed.assert_problem(
        StatusCode::SERVICE_UNAVAILABLE,
        "payments-demo-payment-failed",
    );
    assert_eq!(failed.header("retry-after"), Some("1"));
    let body = String::from_utf8_lossy(&failed.body).into_owned();
    assert!(!body.contains("demo_payments"), "{body}");
    query(&format!(
        "ALTER TABLE \"{}\".demo_payments_away RENAME TO demo_payments",
        schema.name
    ))
    .await;
}

/// A payment the backend cannot complete gets a 503 problem document that names no
/// internals, which clients retry; the key is released, and the retry completes it
/// with the charge the provider already made for that key.
#[tokio::test]
async fn a_payment_the_backend_cannot_record_is_a_503_problem_and_its_retry_charges_once() {
    let schema = Schema::new();
    let mut demo = Demo::start(Some(&schema));
    let client = client();
    demo.wait_ready(&client).await;
    let payment = r#"{"amount":700,"currency":"EUR"}"#;
    charged_but_not_recorded(&schema, &client, demo.addr, "fails-once", payment).await;
    let retried = post_payment(&client, demo.addr, Some("fails-once"), payment).await;
    assert_eq!(retried.status, StatusCode::CREATED, "{retried:?}");
    assert!(!retried.replayed());
    assert_eq!(
        stats(&client, demo.addr).await,
        json!({"handler_runs": 2, "psp_calls": 2, "charges": 1, "payments": 1})
    );
}

/// `GET /stats` on a database that cannot answer: the 503 problem document the README
/// names, saying what failed, naming no internals, and no retry advice for a payment.
#[tokio::test]
async fn stats_the_database_cannot_read_are_a_503_problem() {
    let schema = Schema::new();
    let mut demo = Demo::start(Some(&schema));
    let client = client();
    demo.wait_ready(&client).await;
    query(&format!(
        "ALTER TABLE \"{}\".demo_counters RENAME TO demo_counters_away",
        schema.name
    ))
    .await;
    let failed = request(&client, Method::GET, demo.addr, "/stats", None, "")
        .await
        .expect("GET /stats");
    failed.assert_problem(
        StatusCode::SERVICE_UNAVAILABLE,
        "payments-demo-payment-failed",
    );
    let detail = failed.json()["detail"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(detail.contains("statistics"), "{detail}");
    assert!(!detail.contains("Idempotency-Key"), "{detail}");
    let body = String::from_utf8_lossy(&failed.body).into_owned();
    assert!(!body.contains("demo_counters"), "{body}");
    query(&format!(
        "ALTER TABLE \"{}\".demo_counters_away RENAME TO demo_counters",
        schema.name
    ))
    .await;
    assert_eq!(stats(&client, demo.addr).await["charges"], 0);
}

/// After a payment failed once it was charged (its key released), the same key with
/// another amount is refused with a 422 that is not stored, and charges nothing: the
/// provider already charged that key for the first payment. A retry of the first
/// payment then completes it, with that charge.
#[tokio::test]
async fn a_released_key_sent_with_another_amount_is_refused_and_the_first_payment_completes() {
    let schema = Schema::new();
    let mut demo = Demo::start(Some(&schema));
    let client = client();
    demo.wait_ready(&client).await;
    let first = r#"{"amount":700,"currency":"EUR"}"#;
    charged_but_not_recorded(&schema, &client, demo.addr, "changed", first).await;
    let other = r#"{"amount":900,"currency":"EUR"}"#;
    for _ in 0..2 {
        let refused = post_payment(&client, demo.addr, Some("changed"), other).await;
        refused.assert_problem(
            StatusCode::UNPROCESSABLE_ENTITY,
            "payments-demo-key-used-for-another-payment",
        );
        assert!(!refused.replayed(), "the refusal was stored");
        let detail = refused.json()["detail"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        assert!(detail.contains("700 EUR"), "{detail}");
    }
    assert_eq!(key_row(&schema, "changed").await, None, "the key is held");
    let completed = post_payment(&client, demo.addr, Some("changed"), first).await;
    assert_eq!(completed.status, StatusCode::CREATED, "{completed:?}");
    assert_eq!(completed.json()["amount"], 700);
    assert_eq!(
        stats(&client, demo.addr).await,
        json!({"handler_runs": 4, "psp_calls": 4, "charges": 1, "payments": 1})
    );
    let recorded = query(&format!(
        "SELECT p.amount, c.amount FROM \"{0}\".demo_payments p
         JOIN \"{0}\".demo_psp_charges c USING (charge_id)",
        schema.name
    ))
    .await;
    assert_eq!(recorded.len(), 1);
    assert_eq!(
        (recorded[0].get::<_, i64>(0), recorded[0].get::<_, i64>(1)),
        (700, 700)
    );
}

/// `--encryption-key`: the payment's response is sealed and its key hashed, so that no
/// `bytea` column of the idempotency table holds anything of either, in both modes; and
/// the retry still gets the payment, replayed.
#[tokio::test]
async fn with_an_encryption_key_no_bytea_column_holds_the_payment_or_its_key() {
    const HEX: &str = "5f0e1d2c3b4a59687786a5b4c3d2e1f00f1e2d3c4b5a69788796a5b4c3d2e1f0";
    for mode in ["lease", "transactional"] {
        let schema = Schema::new();
        let mut demo = Demo::start_with(Some(&schema), &["--encryption-key", HEX, "--mode", mode]);
        let client = client();
        demo.wait_ready(&client).await;
        let key = format!("card-payment-{mode}-7c41");
        let body = r#"{"amount":987654,"currency":"EUR"}"#;
        let first = post_payment(&client, demo.addr, Some(&key), body).await;
        assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
        let paid = first.json();
        let retried = post_payment(&client, demo.addr, Some(&key), body).await;
        assert!(retried.replayed(), "{retried:?}");
        assert_eq!(retried.body, first.body);

        let columns = query(&format!(
            "SELECT column_name::text FROM information_schema.columns
             WHERE table_schema = '{}' AND table_name = 'idempotency_keys' AND data_type = 'bytea'",
            schema.name
        ))
        .await;
        let columns: Vec<String> = columns.iter().map(|r| r.get(0)).collect();
        assert!(columns.len() >= 3, "{columns:?}");
        let secrets = [
            paid["payment_id"].as_str().unwrap().to_owned(),
            paid["charge_id"].as_str().unwrap().to_owned(),
            "987654".to_owned(),
            key.clone(),
            "application/json".to_owned(),
        ];
        for column in &columns {
            let rows = query(&format!(
                "SELECT {column} FROM \"{}\".idempotency_keys",
                schema.name
            ))
            .await;
            assert_eq!(rows.len(), 1, "{mode}: one key");
            let bytes: Option<Vec<u8>> = rows[0].get(0);
            let bytes = bytes.unwrap_or_default();
            for secret in &secrets {
                assert!(
                    !bytes.windows(secret.len()).any(|w| w == secret.as_bytes()),
                    "{mode}: {secret} readable in column {column}"
                );
            }
        }
        // The key column holds the key's hash, not the key.
        let keys = query(&format!(
            "SELECT key FROM \"{}\".idempotency_keys",
            schema.name
        ))
        .await;
        let stored: String = keys[0].get(0);
        assert!(
            stored.starts_with("h:") && !stored.contains(&key),
            "{stored}"
        );
        demo.kill9();
    }
}

/// `POST /payments` with `key` and `body`, sent with `Authorization: Bearer <token>`.
async fn post_payment_as(
    client: &HttpClient,
    addr: SocketAddr,
    token: &str,
    key: &str,
    body: &str,
) -> Reply {
    let bearer = format!("Bearer {token}");
    request_with(
        client,
        Method::POST,
        addr,
        "/payments",
        Some(key),
        body,
        &[("authorization", &bearer)],
    )
    .await
    .unwrap_or_else(|e| panic!("POST /payments on {addr}: {e}"))
}

/// Keys are scoped by the account a bearer token names (`<account>.<secret>`): a retry
/// with a refreshed token is the same payment, replayed; another account's key is its
/// own payment; a request without `Authorization` is in the anonymous scope, as ever.
async fn keys_are_scoped_by_account(client: &HttpClient, addr: SocketAddr) {
    const KEY: &str = "account-payment-1";
    const PAYMENT: &str = r#"{"amount":1000,"currency":"EUR"}"#;
    let first = post_payment_as(client, addr, "acct7.first", KEY, PAYMENT).await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    assert!(!first.replayed(), "{first:?}");
    let refreshed = post_payment_as(client, addr, "acct7.second", KEY, PAYMENT).await;
    assert_eq!(refreshed.status, StatusCode::CREATED, "{refreshed:?}");
    assert!(
        refreshed.replayed(),
        "the refreshed token ran again: {refreshed:?}"
    );
    assert_eq!(refreshed.body, first.body);

    let other = post_payment_as(client, addr, "acct8.x", KEY, PAYMENT).await;
    assert_eq!(other.status, StatusCode::CREATED, "{other:?}");
    assert!(
        !other.replayed(),
        "another account got acct7's payment: {other:?}"
    );
    assert_ne!(other.json()["payment_id"], first.json()["payment_id"]);
    assert_ne!(other.json()["charge_id"], first.json()["charge_id"]);
    // A token without a dot names itself: the account `acct8`.
    let bare = post_payment_as(client, addr, "acct8", KEY, PAYMENT).await;
    assert!(bare.replayed(), "{bare:?}");
    assert_eq!(bare.body, other.body);

    let anonymous = post_payment(client, addr, Some(KEY), PAYMENT).await;
    assert_eq!(anonymous.status, StatusCode::CREATED, "{anonymous:?}");
    assert!(!anonymous.replayed(), "{anonymous:?}");
    let again = post_payment(client, addr, Some(KEY), PAYMENT).await;
    assert!(again.replayed(), "{again:?}");
    assert_eq!(again.body, anonymous.body);
    assert_eq!(
        stats(client, addr).await,
        json!({"handler_runs": 3, "psp_calls": 3, "charges": 3, "payments": 3})
    );
}

#[tokio::test]
async fn a_refreshed_token_pays_once_and_another_account_pays_its_own() {
    let schema = Schema::new();
    let client = client();
    let mut demo = Demo::start(Some(&schema));
    demo.wait_ready(&client).await;
    keys_are_scoped_by_account(&client, demo.addr).await;
    let scopes = query(&format!(
        "SELECT DISTINCT scope FROM \"{}\".idempotency_keys ORDER BY scope",
        schema.name
    ))
    .await;
    let scopes: Vec<&str> = scopes.iter().map(|r| r.get(0)).collect();
    assert_eq!(scopes, ["", "principal:acct7", "principal:acct8"]);
}

#[tokio::test]
async fn a_refreshed_token_pays_once_on_the_memory_store_too() {
    let client = client();
    let mut demo = Demo::start(None);
    demo.wait_ready(&client).await;
    keys_are_scoped_by_account(&client, demo.addr).await;
}

#[tokio::test]
async fn a_refreshed_token_pays_once_in_transactional_mode() {
    let schema = Schema::new();
    let client = client();
    let mut demo = Demo::start_with(Some(&schema), &["--mode", "transactional"]);
    demo.wait_ready(&client).await;
    keys_are_scoped_by_account(&client, demo.addr).await;
}

/// A client that re-serialises its JSON for a retry (other whitespace, other member
/// order, `charset=UTF-8`) gets its payment replayed, not a final 422; another amount
/// is refused.
async fn re_spelt_json_is_one_payment(client: &HttpClient, addr: SocketAddr) {
    const KEY: &str = "re-spelt-1";
    let first = post_payment(
        client,
        addr,
        Some(KEY),
        r#"{"amount":1000,"currency":"EUR"}"#,
    )
    .await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    assert!(!first.replayed(), "{first:?}");
    let re_spelt = r#"{ "currency" : "EUR", "amount" : 1000 }"#;
    let resent = post_payment(client, addr, Some(KEY), re_spelt).await;
    assert_eq!(resent.status, StatusCode::CREATED, "{resent:?}");
    assert!(resent.replayed(), "re-spelt JSON ran again: {resent:?}");
    assert_eq!(resent.body, first.body);
    let utf8 = request_with(
        client,
        Method::POST,
        addr,
        "/payments",
        Some(KEY),
        re_spelt,
        &[("content-type", "application/json; charset=UTF-8")],
    )
    .await
    .unwrap_or_else(|e| panic!("POST /payments on {addr}: {e}"));
    assert_eq!(utf8.status, StatusCode::CREATED, "{utf8:?}");
    assert!(utf8.replayed(), "charset=UTF-8 ran again: {utf8:?}");
    assert_eq!(utf8.body, first.body);
    let other = post_payment(
        client,
        addr,
        Some(KEY),
        r#"{"amount":1001,"currency":"EUR"}"#,
    )
    .await;
    other.assert_problem(StatusCode::UNPROCESSABLE_ENTITY, "key-reused");
    assert_eq!(
        stats(client, addr).await,
        json!({"handler_runs": 1, "psp_calls": 1, "charges": 1, "payments": 1})
    );
}

#[tokio::test]
async fn json_re_spelt_with_a_utf8_charset_is_one_payment() {
    let schema = Schema::new();
    let client = client();
    let mut demo = Demo::start(Some(&schema));
    demo.wait_ready(&client).await;
    re_spelt_json_is_one_payment(&client, demo.addr).await;
}

#[tokio::test]
async fn json_re_spelt_is_one_payment_on_the_memory_store_too() {
    let client = client();
    let mut demo = Demo::start(None);
    demo.wait_ready(&client).await;
    re_spelt_json_is_one_payment(&client, demo.addr).await;
}

/// `--retention-secs N`: a retry after N seconds finds the payment's response gone and
/// its key remembered (`--remember-secs`, 7 days by default): refused with `410
/// response-expired`, never charged again, with encryption on and off, on PostgreSQL
/// (both modes) and on the memory store.
#[tokio::test]
async fn a_retry_after_the_retention_is_refused_not_charged_again() {
    const HEX: &str = "5f0e1d2c3b4a59687786a5b4c3d2e1f00f1e2d3c4b5a69788796a5b4c3d2e1f0";
    let runs: [(bool, &[&str]); 4] = [
        (true, &["--retention-secs", "1", "--encryption-key", HEX]),
        (true, &["--retention-secs", "1", "--mode", "transactional"]),
        (
            true,
            &[
                "--retention-secs",
                "1",
                "--remember-secs",
                "3600",
                "--encryption-key",
                HEX,
            ],
        ),
        (false, &["--retention-secs", "1"]),
    ];
    for (on_postgres, args) in runs {
        let schema = Schema::new();
        let mut demo = Demo::start_with(on_postgres.then_some(&schema), args);
        let client = client();
        demo.wait_ready(&client).await;
        let body = r#"{"amount":4200,"currency":"EUR"}"#;
        let first = post_payment(&client, demo.addr, Some("late-retry"), body).await;
        assert_eq!(first.status, StatusCode::CREATED, "{args:?}: {first:?}");
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let late = post_payment(&client, demo.addr, Some("late-retry"), body).await;
        late.assert_problem(StatusCode::GONE, "response-expired");
        let problem = late.json();
        assert_eq!(problem["response_status"], 201, "{args:?}: {problem}");
        assert!(problem["remembered_until"].is_string(), "{problem}");
        assert_eq!(
            stats(&client, demo.addr).await,
            json!({"handler_runs": 1, "psp_calls": 1, "charges": 1, "payments": 1}),
            "{args:?}"
        );
        demo.kill9();
    }
}
