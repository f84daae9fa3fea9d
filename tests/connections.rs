//! The store's connections, seen from outside: pools for a URL that names several
//! hosts, shared claim connections, the reserve that serves running claims when the
//! pool is all checked out, and a transaction pooler the store is not built for.
//!
//! A host that is gone without a word is a local listener that accepts connections and
//! never answers; one that refuses is a port bound and never listened on. Everything
//! else is the PostgreSQL at `DATABASE_URL`.

mod common;

use std::{net::SocketAddr, task::Poll, time::Duration};

use common::TestSchema;
use deadpool_postgres::{Object, Pool, PoolError, TimeoutType, Timeouts};
use tokio::net::TcpListener;
use tokio_postgres::config::{Config, Host};
use tower_idempotency::{
    Fingerprint, Scope,
    store::{Claim, ClaimRequest, Lease, PostgresStore, Store, StoreErrorKind, pool_for_url},
};

/// A port on this machine that accepts connections and never answers, as a frozen
/// primary does (its connections are never closed by it either), and counts them.
struct Silent {
    port: u16,
    /// The peer of each connection accepted, in the order accepted.
    accepted: tokio::sync::mpsc::UnboundedReceiver<SocketAddr>,
    seen: usize,
}

impl Silent {
    async fn bind() -> Self {
        Self::on(TcpListener::bind("127.0.0.1:0").await.expect("bind"))
    }

    fn on(listener: TcpListener) -> Self {
        let port = listener.local_addr().expect("its address").port();
        let (tx, accepted) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((socket, peer)) = listener.accept().await {
                held.push(socket);
                if tx.send(peer).is_err() {
                    break;
                }
            }
        });
        Self {
            port,
            accepted,
            seen: 0,
        }
    }

    /// How many connections others have made to it so far. It connects to itself and
    /// counts those accepted before its own: a listener accepts in the order the
    /// connections were made.
    async fn connections(&mut self) -> usize {
        let marker = tokio::net::TcpStream::connect(("127.0.0.1", self.port))
            .await
            .expect("connect to the silent host");
        let marker = marker.local_addr().expect("its address");
        loop {
            let peer = self.accepted.recv().await.expect("the listener runs");
            if peer == marker {
                return self.seen;
            }
            self.seen += 1;
        }
    }
}

/// A connection string for the test database with `first` (a port on this machine)
/// named before its own host, as a primary that is gone is named before its promoted
/// standby, and `target_session_attrs=read-write`.
fn behind(first: u16) -> String {
    let db: Config = common::database_url().parse().expect("DATABASE_URL");
    let quoted = |value: &str| format!("'{}'", value.replace('\\', "\\\\").replace('\'', "\\'"));
    let mut hosts = vec!["127.0.0.1".to_owned()];
    let mut ports = vec![first.to_string()];
    for (i, host) in db.get_hosts().iter().enumerate() {
        hosts.push(match host {
            Host::Tcp(host) => host.clone(),
            #[cfg(unix)]
            Host::Unix(path) => path.to_string_lossy().into_owned(),
        });
        let port = db.get_ports().get(i).or(db.get_ports().first());
        ports.push(port.copied().unwrap_or(5432).to_string());
    }
    let mut settings = format!(
        "host={} port={} target_session_attrs=read-write",
        quoted(&hosts.join(",")),
        quoted(&ports.join(","))
    );
    if let Some(user) = db.get_user() {
        settings += &format!(" user={}", quoted(user));
    }
    if let Some(password) = db.get_password() {
        let password = String::from_utf8_lossy(password);
        settings += &format!(" password={}", quoted(&password));
    }
    if let Some(dbname) = db.get_dbname() {
        settings += &format!(" dbname={}", quoted(dbname));
    }
    settings
}

/// A new connection from `pool` (the ones it holds are checked out), which answers.
async fn serves(pool: &Pool) -> Object {
    let client = pool.get().await.expect("a connection to the test database");
    let one: i32 = client
        .query_one("SELECT 1", &[])
        .await
        .expect("a statement")
        .get(0);
    assert_eq!(one, 1);
    client
}

#[tokio::test]
async fn a_host_that_does_not_answer_is_raced_by_the_next_and_then_passed_over() {
    let mut silent = Silent::bind().await;
    let pool = pool_for_url(&behind(silent.port), 4).expect("pool");
    // Tried first, it never answers: the next host, raced beside it, gives the
    // connection.
    let _first = serves(&pool).await;
    assert_eq!(
        silent.connections().await,
        1,
        "the first host was not tried"
    );
    // The next connections start with the host that answered.
    let _second = serves(&pool).await;
    let _third = serves(&pool).await;
    assert_eq!(
        silent.connections().await,
        1,
        "the silent host was tried again"
    );
    assert_eq!(pool.status().size, 3);
}

#[tokio::test]
async fn an_attempt_given_up_on_before_any_host_answered_moves_on_to_the_next_host() {
    let mut silent = Silent::bind().await;
    let pool = pool_for_url(&behind(silent.port), 4).expect("pool");
    // Given up on by the pool (its create timeout) before the next host was raced
    // beside the silent one (half a second in).
    let short = Timeouts {
        create: Some(Duration::from_millis(100)),
        ..pool.timeouts()
    };
    let e = pool
        .timeout_get(&short)
        .await
        .expect_err("the silent host answered");
    assert!(matches!(e, PoolError::Timeout(TimeoutType::Create)), "{e}");
    assert_eq!(
        silent.connections().await,
        1,
        "the first host was not tried"
    );
    // The next attempt starts from the following host.
    let _client = serves(&pool).await;
    assert_eq!(
        silent.connections().await,
        1,
        "the next attempt started from the silent host again"
    );
}

#[tokio::test]
async fn a_host_that_refuses_hands_over_to_the_next() {
    let (refusing, port) = common::refusing_port();
    let pool = pool_for_url(&behind(port), 4).expect("pool");
    let _first = serves(&pool).await;
    // The refusing host listens now, and answers nothing: the next connection starts
    // with the host that gave the last one, and never gets there.
    let mut now_silent = Silent::on(refusing.listen(64).expect("listen"));
    let _second = serves(&pool).await;
    assert_eq!(
        now_silent.connections().await,
        0,
        "the next attempt started from the host that refused"
    );
}

/// `DATABASE_URL`, its connections named `name` (`application_name`): direct to the
/// database even where the suite runs behind a pooler (`TestSchema::store_at`).
fn url_named(name: &str) -> String {
    let url = common::database_url();
    let separator = if url.contains('?') { '&' } else { '?' };
    format!("{url}{separator}application_name={name}")
}

/// The backends named `name` whose last statement was a claim, or the `lock_timeout`
/// of a shared connection just opened: the store's shared claim connections.
async fn shared_backends(schema: &TestSchema, name: &str) -> Vec<i32> {
    let sql = format!(
        "SELECT pid FROM pg_stat_activity WHERE application_name = '{name}'
           AND pid <> pg_backend_pid()
           AND (query LIKE 'SELECT f.token%' OR query LIKE 'SET lock_timeout%')
         ORDER BY pid"
    );
    let rows = schema.query(&sql).await;
    rows.iter().map(|row| row.get(0)).collect()
}

fn request<'a>(scope: &'a Scope, key: &'a str) -> ClaimRequest<'a> {
    ClaimRequest {
        scope,
        key,
        fingerprint: Fingerprint::new([3; 32]),
        lease: Duration::from_secs(30),
        ttl: Duration::from_secs(60),
    }
}

async fn acquired(store: &PostgresStore, scope: &Scope, key: &str) -> Lease {
    match store.claim(&request(scope, key)).await.expect("a claim") {
        Claim::Acquired(lease) => lease,
        other => panic!("{key}: {other:?}"),
    }
}

/// Claims one at a time stay on one shared connection (one backend), however many
/// there may be; two at once are dealt one each, the second opening then.
#[tokio::test]
async fn claims_one_at_a_time_stay_on_one_shared_connection() {
    let schema = TestSchema::new();
    let name = common::unique_name("ti_shared");
    let store = common::sharing_claims(
        schema
            .store_at(&url_named(&name), 4)
            .await
            .with_background_purge(None),
        4,
    );
    let scope = Scope::new("s");
    for i in 0..6 {
        acquired(&store, &scope, &format!("k{i}")).await;
    }
    assert_eq!(store.metrics().shared_claims, 6);
    let one = shared_backends(&schema, &name).await;
    assert_eq!(one.len(), 1, "{one:?}");
    // Taken out of the pool for good: the pool has none left of its own.
    assert_eq!(store.pool().status().size, 0);

    let (a, b) = tokio::join!(acquired(&store, &scope, "a"), acquired(&store, &scope, "b"));
    drop((a, b));
    assert_eq!(store.metrics().shared_claims, 8);
    let two = shared_backends(&schema, &name).await;
    assert_eq!(two.len(), 2, "{two:?}");
    assert!(two.contains(&one[0]), "{one:?} {two:?}");
}

/// A claim given up on before its answer leaves its shared connection in doubt: the
/// next claim runs on a new one, and the old one closes with the last claim on it.
#[tokio::test]
async fn a_claim_given_up_before_its_answer_leaves_its_shared_connection_behind() {
    let schema = TestSchema::new();
    let name = common::unique_name("ti_shared");
    let store = common::sharing_claims(
        schema
            .store_at(&url_named(&name), 4)
            .await
            .with_background_purge(None),
        1,
    );
    let scope = Scope::new("s");
    acquired(&store, &scope, "first").await;
    let old = shared_backends(&schema, &name).await;
    assert_eq!(old.len(), 1, "{old:?}");

    // Sent on the shared connection (polled once), then given up on.
    let gone = request(&scope, "gone");
    let pending = {
        let mut claiming = std::pin::pin!(store.claim(&gone));
        std::future::poll_fn(|cx| Poll::Ready(claiming.as_mut().poll(cx).is_pending())).await
    };
    assert!(pending, "answered at once");
    assert_eq!(store.metrics().shared_claims, 2, "not dealt the shared one");

    acquired(&store, &scope, "next").await;
    assert_eq!(store.metrics().shared_claims, 3);
    let mut new = Vec::new();
    for _ in 0..500 {
        new = shared_backends(&schema, &name).await;
        if new.len() == 1 && new != old {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(new.len() == 1 && new != old, "{old:?} then {new:?}");
    // Taken out of the pool for good, both of them.
    assert_eq!(store.pool().status().size, 0);
}

/// A connection of its own that has begun a transaction and run `sql` in it; the
/// transaction stays open until the test ends it.
async fn begin(sql: &str) -> tokio_postgres::Client {
    let (client, conn) = tokio_postgres::connect(&common::database_url(), tokio_postgres::NoTls)
        .await
        .expect("connect");
    tokio::spawn(conn);
    client
        .batch_execute(&format!("BEGIN; {sql}"))
        .await
        .expect("begin");
    client
}

/// With every pooled connection checked out, a running claim's renewal goes over a
/// connection the store makes outside the pool, which has no session setting of its
/// own (no `lock_timeout`, as a shared claim connection has): it waits on a row lock
/// for as long as the lock is held, then renews.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reserve_connections_open_outside_a_pool_that_is_all_checked_out() {
    let schema = TestSchema::new();
    let name = common::unique_name("ti_reserve");
    let store = schema
        .store_at(&url_named(&name), 2)
        .await
        .with_background_purge(None);
    let scope = Scope::new("s");
    let lease = acquired(&store, &scope, "k").await;
    let mut held = Vec::new();
    for _ in 0..store.pool().status().max_size {
        held.push(store.pool().get().await.expect("a pooled connection"));
    }
    let locker = begin(&format!(
        "SELECT 1 FROM \"{}\".idempotency_keys WHERE scope = 's' AND key = 'k' FOR UPDATE",
        schema.name
    ))
    .await;
    let renewing = {
        let store = store.clone();
        tokio::spawn(async move { store.renew(&lease, Duration::from_secs(30)).await })
    };
    // Waiting on the lock, well past the 50 ms a `lock_timeout` of a shared claim
    // connection would have allowed.
    let waited = format!(
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'
           AND query LIKE '%{}%' AND now() - query_start > interval '1 second'",
        schema.name
    );
    let mut waiting = 0;
    for _ in 0..500 {
        waiting = schema.query(&waited).await[0].get::<_, i64>(0);
        if waiting == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(waiting, 1, "the renewal did not wait on the lock");
    assert_eq!(store.metrics().reserve_statements, 1);
    let status = store.pool().status();
    assert_eq!((status.size, status.available), (status.max_size, 0));

    locker.batch_execute("ROLLBACK").await.expect("rollback");
    let renewed = renewing.await.expect("the renewal's task");
    assert!(renewed.expect("a renewal").is_kept(), "the lease was lost");
    assert_eq!(store.metrics().reserve_statements, 1);
    drop(held);
}

/// A PgBouncer of the test's own in transaction pooling (`.ci/pgbouncer`), on a free
/// port from 6600 on, in front of the test database; stopped when dropped.
struct PgBouncer {
    dir: std::path::PathBuf,
    port: u16,
}

impl PgBouncer {
    const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/.ci/pgbouncer");

    fn start() -> Self {
        let dir = std::env::temp_dir().join(common::unique_name("ti_pgbouncer"));
        // A port another test (or engineer) takes meanwhile makes the script refuse it:
        // the next is tried.
        for port in 6600..6700 {
            if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                continue;
            }
            let started = std::process::Command::new(Self::SCRIPT)
                .arg("start")
                .arg(&dir)
                .arg(port.to_string())
                .status()
                .expect("run .ci/pgbouncer");
            if started.success() {
                return Self { dir, port };
            }
        }
        panic!("no free port for a PgBouncer from 6600 to 6699");
    }

    /// The test database through this PgBouncer.
    fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        let stopped = std::process::Command::new(Self::SCRIPT)
            .arg("stop")
            .arg(&self.dir)
            .status();
        if !matches!(stopped, Ok(status) if status.success()) {
            eprintln!("could not stop the PgBouncer in {}", self.dir.display());
        }
    }
}

/// The number in the name tokio-postgres gives the next statement it prepares in this
/// process, at least (`s<n>`, from a counter of its own): read from the name of one
/// prepared now, which only its `Debug` shows.
async fn next_statement_number() -> usize {
    let (client, conn) = tokio_postgres::connect(&common::database_url(), tokio_postgres::NoTls)
        .await
        .expect("connect");
    tokio::spawn(conn);
    let statement = client.prepare("SELECT 1").await.expect("prepare");
    let shown = format!("{statement:?}");
    let name = shown
        .split("name: \"s")
        .nth(1)
        .and_then(|rest| rest.split('"').next())
        .and_then(|n| n.parse::<usize>().ok())
        .unwrap_or_else(|| panic!("no statement name in {shown}"));
    name + 1
}

/// Behind a transaction-pooling PgBouncer, a store not built for it prepares its
/// statements on one server session and runs them on whichever the pooler lends next:
/// where another client prepared a statement of the same name (another replica, whose
/// driver counts its statements from 0 too), or where the statement does not exist.
/// Either error says so, and what to set; the same store built
/// `with_transaction_pooling` claims through the same pooler.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn behind_a_transaction_pooler_a_store_not_built_for_it_says_so() {
    let schema = TestSchema::new();
    schema.store_direct(2).await;
    let bouncer = PgBouncer::start();
    let scope = Scope::new("s");
    let not_built_for_it = || {
        PostgresStore::new(pool_for_url(&bouncer.url(), 1).expect("pool"))
            .with_schema_name(&schema.name)
            .expect("schema name")
            .with_background_purge(None)
    };
    let says_so = |e: tower_idempotency::store::StoreError, sqlstate: &str| {
        assert_eq!(e.kind(), StoreErrorKind::Misconfigured, "{e}");
        let shown = e.to_string();
        assert!(shown.contains(&format!("(SQLSTATE {sqlstate})")), "{shown}");
        assert!(
            shown.contains("behind a transaction-pooling proxy"),
            "{shown}"
        );
        assert!(shown.contains("with_transaction_pooling(true)"), "{shown}");
    };

    // Another client's statements, prepared on the pooler's one server session under
    // every name the store's driver may give its next ones (it counts them in this
    // process, other tests' included: a margin of 2 000).
    let (other, conn) = tokio_postgres::connect(&bouncer.url(), tokio_postgres::NoTls)
        .await
        .expect("connect through the pooler");
    tokio::spawn(conn);
    let next = next_statement_number().await;
    let prepared: String = (next..next + 2_000)
        .map(|n| format!("PREPARE s{n} AS SELECT 1;"))
        .collect();
    other.batch_execute(&prepared).await.expect("prepare");
    let claimed = not_built_for_it().claim(&request(&scope, "taken")).await;
    says_so(claimed.expect_err("a statement name taken"), "42P05");
    other
        .batch_execute("DEALLOCATE ALL")
        .await
        .expect("deallocate");
    drop(other);

    for pooling in [false, true] {
        let store = not_built_for_it().with_transaction_pooling(pooling);
        // The pooler's one server session runs the first claim (prepared there, when
        // not built for the pooler)...
        acquired(&store, &scope, &format!("first-{pooling}")).await;
        // ... and is then held by another client's transaction.
        let (holder, conn) = tokio_postgres::connect(&bouncer.url(), tokio_postgres::NoTls)
            .await
            .expect("connect through the pooler");
        tokio::spawn(conn);
        holder
            .batch_execute("BEGIN; SELECT 1")
            .await
            .expect("a transaction");
        let key = format!("second-{pooling}");
        let claimed = store.claim(&request(&scope, &key)).await;
        holder.batch_execute("ROLLBACK").await.expect("rollback");
        if pooling {
            assert!(matches!(claimed, Ok(Claim::Acquired(_))), "{claimed:?}");
            continue;
        }
        says_so(
            claimed.expect_err("a statement prepared on another server session"),
            "26000",
        );
    }
}
