//! PostgreSQL-specific guarantees: replicas, statement counts, outages, migrations.

mod common;

use std::{sync::Arc, time::Duration};

use axum::body::Body;
use common::{
    TestSchema, app, post, post_with_headers,
    proxy::PgProxy,
    replicas::{a_duplicate_waits_on_another_replica, woken_by_a_notification},
    req, send,
};
use tower_idempotency::{IdempotencyLayer, Outcome, store::PostgresStore};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_replicas_with_their_own_pools_run_each_key_once() {
    two_replicas_run_each_key_once(&common::database_url()).await;
}

/// Some services make every transaction serializable by default (`ALTER DATABASE … SET
/// default_transaction_isolation`). Duplicates that race to insert one key then meet a
/// row committed after their snapshot, which PostgreSQL reports as a serialization
/// failure rather than a conflict: the store looks again, so they still get 201 or
/// 409, never 503, and each key runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn duplicates_race_safely_where_transactions_default_to_serializable() {
    let url = common::serializable_url();
    let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .expect("connect");
    tokio::spawn(conn);
    let isolation = client
        .query_one("SHOW transaction_isolation", &[])
        .await
        .expect("show");
    assert_eq!(isolation.get::<_, String>(0), "serializable");
    two_replicas_run_each_key_once(&url).await;
}

/// Two replicas, each with a pool of its own on `url`, get ten requests at once for
/// each of twenty keys: each key runs once, and ends completed in the shared table.
async fn two_replicas_run_each_key_once(url: &str) {
    let schema = TestSchema::new();
    let (a, b) = (schema.store_at(url, 8).await, schema.store_at(url, 8).await);
    let (router_a, counter_a) = app(IdempotencyLayer::new(a));
    let (router_b, counter_b) = app(IdempotencyLayer::new(b));
    let keys: Vec<String> = (0..20).map(|i| format!("key-{i}")).collect();
    duplicate_burst([&router_a, &router_b], &keys, 10, "100").await;
    for key in &keys {
        assert_eq!(
            counter_a.runs_of(key) + counter_b.runs_of(key),
            1,
            "{key} ran more than once"
        );
    }
    // A completion that failed at first (its pool wait, or its retries after losing
    // races) is retried in the background for up to a lease: allow it that long.
    all_completed(&schema, 20).await;
}

/// Waits (up to a default lease, 30 s) until the test's table holds `n` rows, every one
/// of them completed.
async fn all_completed(schema: &TestSchema, n: i64) {
    let sql = format!(
        "SELECT count(*) FILTER (WHERE state = 'completed'), count(*) FROM \"{}\".idempotency_keys",
        schema.name
    );
    let mut seen = (0, 0);
    for _ in 0..300 {
        let rows = schema.query(&sql).await;
        seen = (rows[0].get::<_, i64>(0), rows[0].get::<_, i64>(1));
        if seen == (n, n) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("(completed, rows) = {seen:?}, not ({n}, {n})");
}

/// Sends `per_key` requests for each of `keys` at once, alternating between the two
/// routers, each handler taking `delay_ms`; every one is answered 201 or 409.
async fn duplicate_burst(
    routers: [&axum::Router; 2],
    keys: &[String],
    per_key: usize,
    delay_ms: &str,
) {
    let barrier = Arc::new(tokio::sync::Barrier::new(keys.len() * per_key));
    let mut tasks = Vec::new();
    for key in keys {
        for i in 0..per_key {
            let router = routers[i % 2].clone();
            let (key, barrier, delay_ms) = (key.clone(), barrier.clone(), delay_ms.to_owned());
            tasks.push(tokio::spawn(async move {
                let r = req("POST")
                    .header("idempotency-key", key.as_str())
                    .header("x-delay-ms", delay_ms)
                    .body(Body::from("{}"))
                    .expect("request");
                barrier.wait().await;
                (key, send(&router, r).await)
            }));
        }
    }
    for t in tasks {
        let (key, r) = t.await.expect("request task");
        assert!(
            matches!(r.status.as_u16(), 201 | 409),
            "{key}: {}",
            r.status
        );
    }
}

/// A pool built without a wait timeout (deadpool's default) still bounds how long the
/// store waits for one of its connections: claims whose requests gave up on them (503
/// at the store timeout) do not queue for a connection without end, and none of them
/// lands once connections free. Batched (the default), the three claims wait in one
/// batch, for one connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn claims_given_up_on_do_not_queue_for_a_connection_without_end() {
    given_up_claims_stop_waiting_for_a_connection(|store| store, 1).await;
}

/// The same, batching off: each claim waits for a connection of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn claims_given_up_on_do_not_queue_for_a_connection_without_end_unbatched() {
    given_up_claims_stop_waiting_for_a_connection(|store| store.with_batched_claims(0, 1), 3).await;
}

/// Three claims given up on while the pool's one connection is held: `waiting`
/// checkouts wait for it, then give up, and none of the claims lands.
async fn given_up_claims_stop_waiting_for_a_connection(
    configure: impl FnOnce(PostgresStore) -> PostgresStore,
    waiting: usize,
) {
    let schema = TestSchema::new();
    schema.store().await;
    let config: tokio_postgres::Config = common::database_url().parse().expect("url");
    let manager = deadpool_postgres::Manager::new(config, tokio_postgres::NoTls);
    let pool = deadpool_postgres::Pool::builder(manager)
        .max_size(1)
        .build()
        .expect("pool");
    assert!(pool.timeouts().wait.is_none());
    let store = configure(
        PostgresStore::new(pool.clone())
            .with_schema_name(&schema.name)
            .expect("schema name"),
    );
    let held = pool.get().await.expect("the pool's one connection");
    let layer = IdempotencyLayer::new(store).store_timeout(Duration::from_millis(200));
    let (router, counter) = app(layer);
    for i in 0..3 {
        assert_eq!(
            send(&router, post(&format!("k{i}"), "{}")).await.status,
            503
        );
    }
    // Their claims still wait for the connection, in tasks of their own, then give up.
    assert_eq!(pool.status().waiting, waiting);
    common::eventually(|| pool.status().waiting == 0).await;
    drop(held);
    assert_eq!(send(&router, post("other", "{}")).await.status, 201);
    let rows = schema
        .query(&format!(
            "SELECT count(*) FROM \"{}\".idempotency_keys WHERE key LIKE 'k%'",
            schema.name
        ))
        .await;
    assert_eq!(rows[0].get::<_, i64>(0), 0);
    assert_eq!(counter.runs(), 1);
}

#[tokio::test]
async fn a_new_key_costs_two_statements_and_a_replay_one() {
    let schema = TestSchema::new();
    let proxy = PgProxy::start().await;
    let store = schema.store_at(&proxy.url(), 1).await;
    let (router, _) = app(IdempotencyLayer::new(store.clone()));
    // Warm the connection's statement cache: preparing is not executing, but keep the
    // first measurement free of connection set-up all the same.
    send(&router, post("warm-up", "{}")).await;

    let counted =
        |proxy: &PgProxy, store: &PostgresStore| (proxy.executes(), store.statements_executed());
    let before = counted(&proxy, &store);
    assert_eq!(
        send(&router, post("k", "{}")).await.outcome,
        Some(Outcome::Executed)
    );
    let after_new = counted(&proxy, &store);
    assert_eq!(
        after_new.0 - before.0,
        2,
        "statements on the wire for a new key"
    );
    assert_eq!(
        after_new.1 - before.1,
        2,
        "statements the store counted for a new key"
    );

    assert_eq!(
        send(&router, post("k", "{}")).await.outcome,
        Some(Outcome::Replayed)
    );
    let after_replay = counted(&proxy, &store);
    assert_eq!(
        after_replay.0 - after_new.0,
        1,
        "statements on the wire for a replay"
    );
    assert_eq!(after_replay.1 - after_new.1, 1);

    assert_eq!(send(&router, post("k", "{\"other\":1}")).await.status, 422);
    assert_eq!(
        proxy.executes() - after_replay.0,
        1,
        "a mismatch is one statement too"
    );

    // Pass-through costs nothing.
    let before = proxy.executes();
    send(&router, req("POST").body(Body::from("{}")).unwrap()).await;
    send(
        &router,
        req("GET")
            .header("idempotency-key", "k")
            .body(Body::empty())
            .unwrap(),
    )
    .await;
    assert_eq!(proxy.executes(), before);
}

/// A layer in transition (`previous_scope_with`) costs a replay, a 409 and a 422
/// nothing more, and a key new in its scope one primary-key read: the look-up under the
/// previous scope. Where the two scopes are one (no principal, no credential), nothing.
#[tokio::test]
async fn a_transition_costs_one_read_per_new_key_and_nothing_per_replay() {
    let schema = TestSchema::new();
    let proxy = PgProxy::start().await;
    let store = schema.store_at(&proxy.url(), 1).await;
    let layer = IdempotencyLayer::new(store.clone())
        .previous_scope_with(tower_idempotency::Scope::from_authorization);
    let (router, _) = common::app_behind_auth(layer);
    send(&router, common::post_as("acct7.first", "warm-up", "{}")).await;
    let cost = |req| {
        let (router, proxy) = (router.clone(), &proxy);
        async move {
            let before = proxy.executes();
            let reply = send(&router, req).await;
            (reply.outcome, proxy.executes() - before)
        }
    };
    assert_eq!(
        cost(common::post_as("acct7.first", "k", "{}")).await,
        (Some(Outcome::Executed), 3),
        "the claim, the look-up, the completion"
    );
    assert_eq!(
        cost(common::post_as("acct7.second", "k", "{}")).await,
        (Some(Outcome::Replayed), 1)
    );
    assert_eq!(
        cost(common::post_as("acct7.second", "k", "{\"a\":1}")).await,
        (Some(Outcome::Mismatch), 1)
    );
    assert_eq!(
        cost(post("anonymous", "{}")).await,
        (Some(Outcome::Executed), 2),
        "one scope before and after: nothing to look up"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_takes_no_row_lock_and_writes_nothing() {
    let schema = TestSchema::new();
    let store = schema.store().await;
    let table = store.table().to_owned();
    // A claim that waited for a row lock would be answered 503 after this.
    let layer = IdempotencyLayer::new(store).store_timeout(Duration::from_secs(2));
    let (router, counter) = app(layer);
    let first = send(&router, post("k", "{}")).await;
    assert_eq!(first.status, 201);
    let version = format!("SELECT xmin::text FROM {table} WHERE key = 'k'");
    let before: String = schema.query(&version).await[0].get(0);

    // Another transaction holds the row locked while the key is replayed.
    let locker = begin(&format!("SELECT 1 FROM {table} WHERE key = 'k' FOR UPDATE")).await;
    let replay = send(&router, post("k", "{}")).await;
    locker.batch_execute("ROLLBACK").await.unwrap();

    assert_eq!(replay.outcome, Some(Outcome::Replayed));
    assert_eq!(replay.body, first.body);
    assert_eq!(counter.runs(), 1);
    let after: String = schema.query(&version).await[0].get(0);
    assert_eq!(before, after, "the replay wrote a new version of the row");
}

#[tokio::test]
async fn a_waiter_registered_again_writes_nothing() {
    use tower_idempotency::{
        Fingerprint, Scope,
        store::{Claim, ClaimRequest, Store},
    };
    let schema = TestSchema::new();
    let store = schema.store().await;
    let table = store.table().to_owned();
    let scope = Scope::anonymous();
    let request = ClaimRequest {
        scope: &scope,
        key: "k",
        fingerprint: Fingerprint::new([1; 32]),
        lease: Duration::from_secs(60),
        ttl: Duration::from_secs(60),
    };
    let Claim::Acquired(lease) = store.claim(&request).await.unwrap() else {
        panic!("a new key");
    };
    let version = format!("SELECT xmin::text, waiters FROM {table} WHERE key = 'k'");
    let row =
        |rows: Vec<tokio_postgres::Row>| -> (String, bool) { (rows[0].get(0), rows[0].get(1)) };
    assert!(store.register_waiter(&scope, "k").await.unwrap());
    let (flagged, waiters) = row(schema.query(&version).await);
    assert!(waiters);
    // A retry storm on the key: every turn registers again, and writes nothing.
    for _ in 0..5 {
        assert!(store.register_waiter(&scope, "k").await.unwrap());
    }
    assert_eq!(row(schema.query(&version).await), (flagged, true));
    // Done, the key is no longer running: a waiter claims again at once.
    let stored = tower_idempotency::StoredResponse {
        status: http::StatusCode::OK,
        headers: Default::default(),
        body: "done".into(),
    };
    assert!(
        store
            .complete(&lease, &stored, Duration::from_secs(60))
            .await
            .unwrap()
            .is_kept()
    );
    assert!(!store.register_waiter(&scope, "k").await.unwrap());
    assert!(!store.register_waiter(&scope, "absent").await.unwrap());
}

#[tokio::test]
async fn an_unreachable_database_is_503_and_the_handler_does_not_run() {
    let schema = TestSchema::new();
    let (_holder, closed) = common::refusing_port();
    let store =
        schema.unmigrated_store_at(&format!("postgres://postgres@127.0.0.1:{closed}/postgres"));
    let (router, counter) = app(IdempotencyLayer::new(store));
    let r = send(&router, post("k", "{}")).await;
    assert_eq!(r.status, 503);
    assert_eq!(r.problem(), "store-unavailable");
    assert_eq!(r.header("retry-after"), Some("1"));
    assert_eq!(r.outcome, Some(Outcome::StoreError));
    assert_eq!(counter.runs(), 0);
}

#[tokio::test]
async fn a_refused_connection_is_503() {
    let schema = TestSchema::new();
    let proxy = PgProxy::start().await;
    // Migrate through a direct pool; the store under test gets a fresh pool that has
    // not connected yet.
    schema.store().await;
    proxy.refuse(true);
    let store = schema.unmigrated_store_at(&proxy.url());
    let (router, counter) = app(IdempotencyLayer::new(store));
    assert_eq!(send(&router, post("k", "{}")).await.status, 503);
    assert_eq!(counter.runs(), 0);
    proxy.refuse(false);
    assert_eq!(send(&router, post("k", "{}")).await.status, 201);
    assert_eq!(counter.runs(), 1);
}

#[tokio::test]
async fn a_missing_table_is_503_not_a_run() {
    let schema = TestSchema::new();
    let store = schema.unmigrated_store_at(&common::database_url());
    let (router, counter) = app(IdempotencyLayer::new(store));
    assert_eq!(send(&router, post("k", "{}")).await.status, 503);
    assert_eq!(counter.runs(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn migrations_run_concurrently_from_many_processes_pools() {
    migrations_run_concurrently_at(&common::database_url()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn migrations_run_concurrently_where_transactions_default_to_repeatable_read() {
    migrations_run_concurrently_at(&common::url_with_default_isolation("repeatable%5C%20read"))
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn migrations_run_concurrently_where_transactions_default_to_serializable() {
    migrations_run_concurrently_at(&common::serializable_url()).await;
}

/// A role or database may set short timeouts for every statement; replicas still wait
/// for each other's migrations as long as they take.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn migrations_run_concurrently_where_statements_time_out_quickly() {
    let url = common::url_with_options("-c%20lock_timeout%3D100%20-c%20statement_timeout%3D100");
    migrations_run_concurrently_at(&url).await;
}

/// Once migrated (by an owner role, say), `migrate` needs no privilege to create
/// anything: an app role that may only read and write the table can call it at start.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_migrated_table_migrates_for_a_role_that_may_not_create_anything() {
    let schema = TestSchema::new();
    schema.store().await;
    let role = common::TestRole::new().await;
    let (s, r) = (&schema.name, &role.name);
    role.run(&format!(
        "GRANT USAGE ON SCHEMA \"{s}\" TO \"{r}\";
         GRANT SELECT, INSERT, UPDATE, DELETE ON \"{s}\".idempotency_keys TO \"{r}\";
         GRANT SELECT ON \"{s}\".idempotency_keys_migrations TO \"{r}\";"
    ))
    .await;
    let app = schema.unmigrated_store_at(&common::url_as(r));
    app.migrate().await.expect("migrate as the app's role");
    let (router, counter) = common::app(IdempotencyLayer::new(app));
    assert_eq!(send(&router, post("k", "{}")).await.status, 201);
    assert_eq!(
        send(&router, post("k", "{}")).await.outcome,
        Some(Outcome::Replayed)
    );
    assert_eq!(counter.runs(), 1);
}

/// A table dropped by hand, its record of migrations left behind: `migrate` says so,
/// rather than succeeding over a table that is not there.
#[tokio::test]
async fn a_table_dropped_by_hand_is_named_by_migrate() {
    let schema = TestSchema::new();
    let store = schema.store().await;
    schema
        .query(&format!("DROP TABLE \"{}\".idempotency_keys", schema.name))
        .await;
    let e = store
        .migrate()
        .await
        .expect_err("migrated over a missing table");
    assert_eq!(
        e.kind(),
        tower_idempotency::store::StoreErrorKind::Misconfigured
    );
    assert!(e.to_string().contains("dropped by hand"), "{e}");
}

/// Eight stores, each with its pool on `url`, migrate one fresh schema at once: all
/// eight are held at the migration lock, then let go together.
async fn migrations_run_concurrently_at(url: &str) {
    let schema = TestSchema::new();
    let separator = if url.contains('?') { '&' } else { '?' };
    let url = format!("{url}{separator}application_name={}", schema.name);
    let stores: Vec<PostgresStore> = (0..8).map(|_| schema.unmigrated_store_at(&url)).collect();
    // The migrations' advisory lock ("tidempot"), held until all eight wait for it.
    let gate = begin("SELECT pg_advisory_xact_lock(8388346167744819060)").await;
    let migrating = tokio::spawn(futures_join_all(
        stores
            .clone()
            .into_iter()
            .map(|s| async move { s.migrate().await }),
    ));
    let waiting = format!(
        "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid)
         WHERE l.locktype = 'advisory' AND NOT l.granted AND a.application_name = '{}'",
        schema.name
    );
    let mut waiters = 0;
    for _ in 0..500 {
        waiters = schema.query(&waiting).await[0].get::<_, i64>(0);
        if waiters == 8 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(waiters, 8, "not every migration reached the lock");
    // Held past any short timeout of the connections' own.
    tokio::time::sleep(Duration::from_millis(300)).await;
    gate.batch_execute("COMMIT").await.expect("commit");
    let results = migrating.await.expect("join");
    for r in results {
        r.expect("concurrent migrate");
    }
    let rows = schema
        .query(&format!(
            "SELECT count(*) FROM \"{}\".idempotency_keys_migrations",
            schema.name
        ))
        .await;
    // Every file in migrations/ applied exactly once (not those of migrations/generations/,
    // for tables in generations only).
    let files = std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/migrations"))
        .expect("migrations/")
        .filter(|entry| entry.as_ref().is_ok_and(|e| e.path().is_file()))
        .count();
    assert_eq!(rows[0].get::<_, i64>(0), files as i64);
    // And once more, idempotently.
    stores[0].migrate().await.expect("re-run");
}

async fn futures_join_all<F: std::future::Future + Send + 'static>(
    futures: impl Iterator<Item = F>,
) -> Vec<F::Output>
where
    F::Output: Send,
{
    let mut set = Vec::new();
    for f in futures {
        set.push(tokio::spawn(f));
    }
    let mut out = Vec::new();
    for h in set {
        out.push(h.await.expect("join"));
    }
    out
}

#[tokio::test]
async fn schema_and_table_names_are_validated() {
    let pool = tower_idempotency::store::pool_for_url(&common::database_url(), 1).unwrap();
    let store = PostgresStore::new(pool);
    assert!(store.clone().with_schema_name("billing").is_ok());
    for bad in ["Billing", "x\"; DROP TABLE y; --", "", "1x", "a.b"] {
        assert!(store.clone().with_schema_name(bad).is_err(), "{bad:?}");
        assert!(store.clone().with_table_name(bad).is_err(), "{bad:?}");
    }
}

#[tokio::test]
async fn purge_deletes_expired_records_in_batches() {
    let schema = TestSchema::new();
    let store = schema.store().await;
    let layer = IdempotencyLayer::new(store.clone()).ttl(Duration::from_millis(50));
    let (router, _) = app(layer);
    for i in 0..5 {
        assert_eq!(
            send(&router, post(&format!("k{i}"), "{}")).await.status,
            201
        );
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(store.purge_expired(3).await.unwrap(), 3);
    // A batch below one is one (0 deleted nothing; a negative batch failed).
    assert_eq!(store.purge_expired(0).await.unwrap(), 1);
    assert_eq!(store.purge_expired(-5).await.unwrap(), 1);
    assert_eq!(store.purge_expired(3).await.unwrap(), 0);
}

/// A waiter woken with every other when the listener connects was woken by no
/// notification, and is not counted as one.
#[tokio::test]
async fn a_waiter_woken_by_the_listener_connecting_is_not_counted_as_notified() {
    use tower_idempotency::{Scope, store::Store};
    let schema = TestSchema::new();
    let store = schema.store().await;
    assert!(!store.is_listening());
    // The first waiter starts the listener, and is woken when it connects (or by the
    // fallback timer, if that comes first).
    store.changed(&Scope::new("s"), "k").await;
    store.listen().await.expect("listens");
    let metrics = store.metrics();
    assert_eq!(metrics.notified_wakeups, 0, "{metrics:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_duplicate_on_another_replica_is_woken_by_a_notification() {
    let schema = TestSchema::new();
    // Without liveness: with it, a waiter also looks again every second, in case the
    // holder's process is gone (tests/liveness.rs); this counts the statements of a
    // waiter that only a notification wakes.
    let (a, b) = (
        schema.store().await.with_liveness(false),
        schema.store().await.with_liveness(false),
    );
    b.listen().await.expect("LISTEN connection");
    // Long enough for the duplicate to claim and register before the first completes,
    // on a loaded machine too; the 30 s lease keeps the fallback timer out of it.
    let (before, after) = woken_by_a_notification(a, b).await;
    assert_eq!(
        after.timer_wakeups, before.timer_wakeups,
        "woken by a timer, not a notification"
    );
    // Waiting cost a claim, the registration of the waiter (so that the completion
    // notifies), and a claim after the wake-up: no polling.
    assert_eq!(after.statements - before.statements, 3, "{after:?}");
}

/// The listener's check is a notification on a channel of its own: other listeners on
/// the store's channel (other replicas, other schemas with the same table name) do not
/// hear it, so checks do not multiply with the listeners.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listener_s_checks_go_to_nobody_else() {
    let schema = TestSchema::new();
    let store = schema.store().await;
    // Another listener on the store's channel, as another replica's is.
    let (client, mut connection) =
        tokio_postgres::connect(&common::database_url(), tokio_postgres::NoTls)
            .await
            .expect("connect");
    let (heard, mut hearing) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Some(Ok(message)) = std::future::poll_fn(|cx| connection.poll_message(cx)).await {
            if let tokio_postgres::AsyncMessage::Notification(n) = message {
                let _ = heard.send(n.payload().to_owned());
            }
        }
    });
    client
        .batch_execute("LISTEN \"idempotency_keys_done\"")
        .await
        .expect("LISTEN");
    // Returns once the store's listener has heard its first check back.
    store.listen().await.expect("listens");
    // Sent after that check: notifications arrive in the order they committed.
    client
        .batch_execute("NOTIFY \"idempotency_keys_done\", 'marker'")
        .await
        .expect("NOTIFY");
    let mut before_the_marker = Vec::new();
    let heard_the_marker = tokio::time::timeout(Duration::from_secs(30), async {
        while let Some(payload) = hearing.recv().await {
            if payload == "marker" {
                return true;
            }
            before_the_marker.push(payload);
        }
        false
    })
    .await;
    assert_eq!(
        heard_the_marker,
        Ok(true),
        "the listening connection went deaf"
    );
    // Tests running alongside complete keys in schemas of their own, on the same
    // channel: their key ids (32 hex digits) may come; nothing else may.
    let key_id = |p: &str| p.len() == 32 && p.bytes().all(|b| b.is_ascii_hexdigit());
    assert!(
        before_the_marker.iter().all(|p| key_id(p)),
        "{before_the_marker:?}"
    );
}

/// A listener whose runtime shut down (the store outlived the runtime that first used
/// it) no longer counts as listening, and is started again by the next use: a duplicate
/// is still woken by the completion's notification, not by the end of its wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_listener_whose_runtime_ended_is_started_again() {
    let schema = TestSchema::new();
    let (a, b) = (schema.store().await, schema.store().await);
    let elsewhere = b.clone();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime");
        runtime
            .block_on(elsewhere.listen())
            .expect("LISTEN connection");
        // The runtime ends here, and the listener task with it.
    })
    .join()
    .expect("the other runtime");
    assert!(
        !b.is_listening(),
        "a listener whose runtime ended still counts as listening"
    );
    b.listen().await.expect("LISTEN connection, started again");
    woken_by_a_notification(a, b).await;
}

/// Purgers on several replicas at once share the work: each expired row is reduced
/// once, and none of them fails or waits on another (`SKIP LOCKED`).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn purgers_on_several_replicas_reduce_each_row_once() {
    let schema = TestSchema::new();
    let store = schema.store().await;
    schema
        .query(&format!(
            "INSERT INTO \"{}\".idempotency_keys (scope, key, fingerprint, state, token, expires_at, completed_at, status, headers, body)
             SELECT '', 'k' || i, '\\x00', 'completed', i, now() - interval '1 minute', now(), 201, '\\x', '\\x'
             FROM generate_series(1, 2000) AS i",
            schema.name
        ))
        .await;
    let mut replicas = vec![store];
    for _ in 0..3 {
        replicas.push(schema.store().await);
    }
    let start = Arc::new(tokio::sync::Barrier::new(replicas.len()));
    let purgers = replicas.into_iter().map(|store| {
        let start = start.clone();
        async move {
            start.wait().await;
            let mut deleted = 0;
            loop {
                let n = store.purge_expired(50).await.expect("purge");
                deleted += n;
                if n < 50 {
                    return deleted;
                }
            }
        }
    });
    let deleted: u64 = futures_join_all(purgers).await.into_iter().sum();
    assert_eq!(deleted, 2000);
    // Each reduced once to a remembered row (the stores remember keys for 7 days).
    let left = format!(
        "SELECT count(*) FROM \"{}\".idempotency_keys WHERE headers IS NULL AND expires_at > now()",
        schema.name
    );
    assert_eq!(schema.query(&left).await[0].get::<_, i64>(0), 2000);
}

/// A store without a notification connection (a `Pool` passed to the
/// layer as it is) still lets a duplicate wait for the running request and replay it:
/// it looks again on a timer.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_duplicate_waits_and_replays_by_polling_without_a_listen_connection() {
    let schema = TestSchema::new();
    let a = schema.store().await;
    let b = PostgresStore::new(
        tower_idempotency::store::pool_for_url(&common::database_url(), 4).unwrap(),
    )
    .with_schema_name(&schema.name)
    .unwrap();
    let (before, after) = a_duplicate_waits_on_another_replica(a, b, "1500").await;
    let wakeups = after.timer_wakeups - before.timer_wakeups;
    assert!(wakeups > 0, "{after:?}");
    assert_eq!(after.notified_wakeups, before.notified_wakeups, "{after:?}");
    // A claim per look, and no registration: nothing could hear its notification.
    assert_eq!(
        after.statements - before.statements,
        wakeups + 1,
        "{after:?}"
    );
}

#[tokio::test]
async fn purge_never_deletes_a_live_claim() {
    use tower_idempotency::{
        Fingerprint, Scope,
        store::{Claim, ClaimRequest, Store},
    };
    let schema = TestSchema::new();
    let store = schema.store().await;
    let scope = Scope::new("s");
    let request = ClaimRequest {
        scope: &scope,
        key: "running",
        fingerprint: Fingerprint::new([1; 32]),
        lease: Duration::from_secs(30),
        ttl: Duration::from_millis(10),
    };
    let Claim::Acquired(lease) = store.claim(&request).await.unwrap() else {
        panic!("acquired")
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(
        store.purge_expired(100).await.unwrap(),
        0,
        "the claim's lease is live"
    );
    assert!(
        store
            .renew(&lease, Duration::from_secs(30))
            .await
            .unwrap()
            .is_kept()
    );
    assert!(matches!(
        store.claim(&request).await.unwrap(),
        Claim::Running { .. }
    ));
}

/// The store's own API takes any duration; the longest are held to ten years, as the
/// layer's settings are, instead of failing every statement ("interval out of range").
#[tokio::test]
async fn the_longest_durations_are_held_to_ten_years() {
    use tower_idempotency::{
        Fingerprint, Scope, StoredResponse,
        store::{Claim, ClaimRequest, Store},
    };
    let schema = TestSchema::new();
    let store = schema.store().await;
    let scope = Scope::new("s");
    let request = ClaimRequest {
        scope: &scope,
        key: "forever",
        fingerprint: Fingerprint::new([1; 32]),
        lease: Duration::MAX,
        ttl: Duration::MAX,
    };
    let Claim::Acquired(lease) = store.claim(&request).await.expect("claim") else {
        panic!("acquired")
    };
    assert!(
        store
            .renew(&lease, Duration::MAX)
            .await
            .expect("renew")
            .is_kept()
    );
    let response = StoredResponse {
        status: axum::http::StatusCode::CREATED,
        headers: axum::http::HeaderMap::new(),
        body: axum::body::Bytes::from_static(b"ok"),
    };
    assert!(
        store
            .complete(&lease, &response, Duration::MAX)
            .await
            .expect("complete")
            .is_kept()
    );
    let years = schema
        .query(&format!(
            "SELECT round(extract(epoch FROM expires_at - now()) / (365 * 86400))::int
             FROM \"{}\".idempotency_keys",
            schema.name
        ))
        .await;
    let left: i32 = years[0].get(0);
    assert_eq!(left, 10, "years to its expiry");
}

#[tokio::test]
async fn store_errors_are_classified_by_sqlstate_and_connection_state() {
    use tower_idempotency::{
        Fingerprint, Scope,
        store::{ClaimRequest, Store, StoreErrorKind},
    };
    let scope = Scope::new("s");
    let request = ClaimRequest {
        scope: &scope,
        key: "k",
        fingerprint: Fingerprint::new([1; 32]),
        lease: Duration::from_secs(30),
        ttl: Duration::from_secs(30),
    };
    let schema = TestSchema::new();
    // No table: 42P01 undefined_table.
    let unmigrated = schema.unmigrated_store_at(&common::database_url());
    let e = unmigrated.claim(&request).await.unwrap_err();
    assert_eq!(e.kind(), StoreErrorKind::Misconfigured, "{e}");
    // Nothing listening: the connection is refused.
    let (_holder, closed) = common::refusing_port();
    let down =
        schema.unmigrated_store_at(&format!("postgres://postgres@127.0.0.1:{closed}/postgres"));
    let e = down.claim(&request).await.unwrap_err();
    assert_eq!(e.kind(), StoreErrorKind::Unavailable, "{e}");
    // A row lock held past lock_timeout: 55P03 lock_not_available.
    let store = schema.store().await;
    let Ok(tower_idempotency::store::Claim::Acquired(lease)) = store.claim(&request).await else {
        panic!("acquired")
    };
    let mut holder = store.pool().get().await.unwrap();
    let tx = holder.transaction().await.unwrap();
    tx.execute(
        &format!(
            "SELECT 1 FROM \"{}\".idempotency_keys WHERE key = 'k' FOR UPDATE",
            schema.name
        ),
        &[],
    )
    .await
    .unwrap();
    // Another replica whose sessions give up on locks after 50 ms. The schema is
    // migrated already: migrating under that timeout would race other tests' migrations
    // for the shared migration lock.
    let url = common::database_url();
    let sep = if url.contains('?') { '&' } else { '?' };
    let other = schema.unmigrated_store_at(&format!("{url}{sep}options=-c%20lock_timeout%3D50"));
    // Renewal needs the row lock the transaction above holds: it times out.
    let e = other
        .renew(&lease, Duration::from_secs(1))
        .await
        .unwrap_err();
    assert_eq!(e.kind(), StoreErrorKind::Timeout, "{e}");
    tx.rollback().await.unwrap();
}

/// Two replicas, each with its claims on two shared connections, under 200 concurrent
/// requests for 20 keys (more than the shared connections queue: the rest take pooled
/// connections): every key runs once and every duplicate is answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn shared_claim_connections_serve_concurrent_duplicates_once() {
    if not_behind_a_pooler_for("shared claim connections") {
        return;
    }
    let schema = TestSchema::new();
    let replica =
        || async { common::sharing_claims(schema.store_at(&common::database_url(), 8).await, 2) };
    let (a, b) = (replica().await, replica().await);
    let (router_a, counter_a) = app(IdempotencyLayer::new(a.clone()));
    let (router_b, counter_b) = app(IdempotencyLayer::new(b.clone()));
    let keys: Vec<String> = (0..20).map(|i| format!("key-{i}")).collect();
    duplicate_burst([&router_a, &router_b], &keys, 10, "50").await;
    all_completed(&schema, 20).await;
    let before = [a.metrics().shared_claims, b.metrics().shared_claims];
    for i in 0..20 {
        let key = format!("key-{i}");
        let runs = counter_a.runs_of(&key) + counter_b.runs_of(&key);
        assert_eq!(runs, 1, "{key} ran {runs} times");
        // Each key's response was stored: a replay on either replica returns it.
        for router in [&router_a, &router_b] {
            let replay = send(router, post(&key, "{}")).await;
            assert_eq!(replay.outcome, Some(Outcome::Replayed), "{key}");
        }
    }
    // One at a time, every replay's claim went to a shared connection.
    let after = [a.metrics().shared_claims, b.metrics().shared_claims];
    assert_eq!([after[0] - before[0], after[1] - before[1]], [20, 20]);
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

/// How many rows of the test's table are in `state`.
async fn rows_in_state(schema: &TestSchema, state: &str) -> i64 {
    let sql = format!(
        "SELECT count(*) FROM \"{}\".idempotency_keys WHERE state = '{state}'",
        schema.name
    );
    schema.query(&sql).await[0].get(0)
}

/// A statement that would wait on a row lock leaves the shared connection (after its
/// `lock_timeout`) and waits on a pooled connection of its own; the statements queued
/// behind it on the shared connection go on meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_claim_waiting_on_a_row_lock_does_not_hold_up_the_shared_connection() {
    if not_behind_a_pooler_for("shared claim connections") {
        return;
    }
    use tower_idempotency::{
        Fingerprint, Scope,
        store::{Claim, ClaimRequest, Store},
    };
    let schema = TestSchema::new();
    let store = common::sharing_claims(schema.store().await, 1);
    fn request<'a>(scope: &'a Scope, key: &'a str) -> ClaimRequest<'a> {
        ClaimRequest {
            scope,
            key,
            fingerprint: Fingerprint::new([7; 32]),
            lease: Duration::from_secs(30),
            ttl: Duration::from_secs(60),
        }
    }
    let scope = Scope::new("s");
    // Another transaction inserts the key "held" and keeps it uncommitted: a claim of
    // that key must wait for it to end.
    let locker = begin(&format!(
        "SELECT \"{}\".idempotency_keys_claim('s', 'held', '\\x00'::bytea, 30000, 60000, 1)",
        schema.name
    ))
    .await;

    let held = {
        let store = store.clone();
        let scope = scope.clone();
        tokio::spawn(async move { store.claim(&request(&scope, "held")).await })
    };
    // With one shared connection, every claim below is queued on the connection the
    // held key's claim went to. They all finish while the lock is still held.
    let others = async {
        for i in 0..20 {
            let key = format!("free-{i}");
            let claimed = store.claim(&request(&scope, &key)).await.unwrap();
            assert!(matches!(claimed, Claim::Acquired(_)), "{key}: {claimed:?}");
        }
    };
    tokio::time::timeout(Duration::from_secs(20), others)
        .await
        .expect("claims queued behind a lock wait were held up");
    assert!(
        !held.is_finished(),
        "the held key's claim did not wait for the lock"
    );
    // It moved to a pooled connection to wait there.
    common::eventually(|| store.pool().status().size == 1).await;
    assert_eq!(store.metrics().shared_claims_moved, 1);

    // The other transaction gives the key up: the waiting claim takes it.
    locker.batch_execute("ROLLBACK").await.unwrap();
    let claimed = held.await.unwrap().unwrap();
    assert!(matches!(claimed, Claim::Acquired(_)), "{claimed:?}");
    assert_eq!(rows_in_state(&schema, "running").await, 21);
}

/// Shared connections that the server closes are replaced when next used.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn terminated_shared_claim_connections_are_replaced() {
    use tower_idempotency::{
        Fingerprint, Scope,
        store::{Claim, ClaimRequest, Store, StoreErrorKind},
    };
    let schema = TestSchema::new();
    let app_name = common::unique_name("ti_shared");
    let url = common::database_url();
    let url = format!(
        "{url}{}application_name={app_name}",
        if url.contains('?') { '&' } else { '?' }
    );
    let store = common::sharing_claims(schema.store_at(&url, 4).await, 2);
    let scope = Scope::new("s");
    let claim = |key: String| {
        let (store, scope) = (store.clone(), scope.clone());
        async move {
            let request = ClaimRequest {
                scope: &scope,
                key: &key,
                fingerprint: Fingerprint::new([1; 32]),
                lease: Duration::from_secs(30),
                ttl: Duration::from_secs(60),
            };
            store.claim(&request).await
        }
    };
    // Two at a time, so that both shared connections are dealt claims and open.
    for i in 0..2 {
        let (a, b) = tokio::join!(claim(format!("a{i}")), claim(format!("b{i}")));
        for claimed in [a.unwrap(), b.unwrap()] {
            assert!(matches!(claimed, Claim::Acquired(_)), "{claimed:?}");
        }
    }
    // The shared connections, by what they run: claims (or, just opened, their
    // `lock_timeout`). The pool lends connections only to release claims in doubt.
    let backends = format!(
        "SELECT pid FROM pg_stat_activity WHERE application_name = '{app_name}' AND pid <> pg_backend_pid() AND (query LIKE 'SELECT f.token%' OR query LIKE 'SET lock_timeout%')"
    );
    let pids =
        |rows: Vec<tokio_postgres::Row>| -> Vec<i32> { rows.iter().map(|r| r.get(0)).collect() };
    let before = pids(schema.query(&backends).await);
    assert_eq!(before.len(), 2, "two shared connections: {before:?}");
    schema
        .query(&format!(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = '{app_name}'"
        ))
        .await;

    // A claim sent before the client has seen its connection close fails, as
    // unavailable; at most one per connection. Every later one runs on a new connection.
    // Again two at a time, so that both connections are dealt claims.
    let acquire = |key: String| {
        let claim = &claim;
        async move {
            let mut failed = 0;
            for attempt in 0.. {
                match claim(key.clone()).await {
                    Ok(Claim::Acquired(_)) => break,
                    Err(e) if e.kind() == StoreErrorKind::Unavailable && attempt < 3 => {
                        failed += 1;
                    }
                    other => panic!("{key}, attempt {attempt}: {other:?}"),
                }
            }
            failed
        }
    };
    let mut failed = 0;
    for i in 0..10 {
        let (a, b) = tokio::join!(acquire(format!("c{i}")), acquire(format!("d{i}")));
        failed += a + b;
    }
    assert!(failed <= 2, "{failed} claims failed after the cut");
    let after = pids(schema.query(&backends).await);
    assert_eq!(after.len(), 2, "{after:?}");
    assert!(
        after.iter().all(|pid| !before.contains(pid)),
        "{before:?} {after:?}"
    );
    // A claim that failed with its connection may have committed: the store releases it
    // by its token, on a pooled connection. No claim went to the pool.
    assert!(
        store.pool().status().size <= failed,
        "{:?}, {failed} claims failed",
        store.pool().status()
    );
}

/// A test that fails with a transaction open in its schema (on a connection of its own
/// runtime, which nothing polls while the schema is dropped) leaves no schema behind.
#[test]
fn a_test_schema_is_dropped_with_a_transaction_left_open_in_it() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let schema = TestSchema::new();
    let name = schema.name.clone();
    let _open = runtime.block_on(async {
        schema.store().await;
        begin(&format!(
            "LOCK TABLE \"{name}\".idempotency_keys IN ACCESS EXCLUSIVE MODE"
        ))
        .await
    });
    // Dropped while the runtime that holds the transaction's connection is idle.
    drop(schema);
    let left = runtime.block_on(async {
        let (client, conn) =
            tokio_postgres::connect(&common::database_url(), tokio_postgres::NoTls)
                .await
                .unwrap();
        tokio::spawn(conn);
        let sql = format!("SELECT count(*) FROM pg_namespace WHERE nspname = '{name}'");
        client.query_one(&sql, &[]).await.unwrap().get::<_, i64>(0)
    });
    assert_eq!(left, 0, "schema {name} was left behind");
}

/// A pending migration that must lock the table gives up at its lock timeout and
/// applies nothing, rather than wait behind a long transaction on the table with every
/// claim queued behind its lock request; run again later, it applies.
#[tokio::test]
async fn a_migration_that_cannot_lock_the_table_gives_up_and_applies_nothing() {
    use tower_idempotency::store::StoreErrorKind;
    let schema = TestSchema::new();
    let store = schema.store().await;
    let versions = format!(
        "SELECT count(*) FROM \"{}\".idempotency_keys_migrations WHERE version = 2",
        schema.name
    );
    // Migration 2, an ALTER TABLE, pending again.
    schema
        .query(&format!(
            "DELETE FROM \"{}\".idempotency_keys_migrations WHERE version = 2",
            schema.name
        ))
        .await;
    let reader = begin(&format!(
        "SELECT count(*) FROM \"{}\".idempotency_keys",
        schema.name
    ))
    .await;
    let migrated = tokio::time::timeout(Duration::from_secs(60), store.migrate())
        .await
        .expect("the migration gave up by itself");
    let error = migrated.expect_err("the table was locked");
    assert_eq!(error.kind(), StoreErrorKind::Timeout, "{error}");
    assert!(
        error.to_string().contains("migration 2 could not lock"),
        "{error}"
    );
    assert_eq!(schema.query(&versions).await[0].get::<_, i64>(0), 0);
    reader.batch_execute("ROLLBACK").await.unwrap();
    store
        .migrate()
        .await
        .expect("applies once the table is quiet");
    assert_eq!(schema.query(&versions).await[0].get::<_, i64>(0), 1);
}

/// A completed key that expired and is claimed afresh starts with nobody waiting on
/// it: its completion does not notify the waiters of the key's earlier life.
#[tokio::test]
async fn a_key_taken_over_after_it_completed_has_no_waiters() {
    use tower_idempotency::{
        Fingerprint, Scope, StoredResponse,
        store::{Claim, ClaimRequest, Store},
    };
    let schema = TestSchema::new();
    // Keys forgotten with their responses: a completed key is taken over once expired
    // (a remembered one is refused instead, tests/remembered.rs).
    let store = schema.store().await.remember_keys_for(Duration::ZERO);
    let scope = Scope::anonymous();
    let request = ClaimRequest {
        scope: &scope,
        key: "k",
        fingerprint: Fingerprint::new([1; 32]),
        lease: Duration::from_secs(30),
        ttl: Duration::from_millis(10),
    };
    let Claim::Acquired(lease) = store.claim(&request).await.unwrap() else {
        panic!("not acquired")
    };
    assert!(store.register_waiter(&scope, "k").await.unwrap());
    let response = StoredResponse {
        status: axum::http::StatusCode::CREATED,
        headers: axum::http::HeaderMap::new(),
        body: axum::body::Bytes::new(),
    };
    assert!(
        store
            .complete(&lease, &response, Duration::from_millis(10))
            .await
            .unwrap()
            .is_kept()
    );
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(matches!(
        store.claim(&request).await.unwrap(),
        Claim::Acquired(_)
    ));
    let waiters = format!(
        "SELECT waiters FROM \"{}\".idempotency_keys WHERE key = 'k'",
        schema.name
    );
    assert!(!schema.query(&waiters).await[0].get::<_, bool>(0));
}

/// Rows of `table` (qualified), counted.
async fn rows_of(schema: &TestSchema, table: &str) -> i64 {
    schema.query(&format!("SELECT count(*) FROM {table}")).await[0].get(0)
}

/// Polls until `table` holds `n` rows, at most ~10 s: a bounded wait, not a timing claim.
async fn until_rows(schema: &TestSchema, table: &str, n: i64) {
    for _ in 0..1000 {
        if rows_of(schema, table).await == n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("{table} did not come to {n} rows");
}

/// A store a layer uses deletes its expired rows by itself; one built without the
/// background purge keeps them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_in_use_purges_its_expired_rows_by_itself() {
    let schema = TestSchema::new();
    // Keys forgotten with their responses, so that the purge deletes rows (it reduces
    // them to remembered ones otherwise: tests/remembered.rs).
    let purging = schema
        .store()
        .await
        .remember_keys_for(Duration::ZERO)
        .with_background_purge(Some(Duration::from_millis(20)));
    let keeping = schema
        .store()
        .await
        .with_table_name("kept_keys")
        .unwrap()
        // Turned off after a period as short as the other's: `None` must win.
        .with_background_purge(Some(Duration::from_millis(20)))
        .with_background_purge(None);
    keeping.migrate().await.unwrap();
    let tables = [purging.table().to_owned(), keeping.table().to_owned()];
    for store in [purging.clone(), keeping.clone()] {
        let layer = IdempotencyLayer::new(store).ttl(Duration::from_millis(1));
        let (router, _) = app(layer);
        for key in ["a", "b", "c"] {
            assert_eq!(send(&router, post(key, "{}")).await.status, 201);
        }
    }
    until_rows(&schema, &tables[0], 0).await;
    assert_eq!(rows_of(&schema, &tables[1]).await, 3);
}

/// Replicas purge in turn: while another holds the table's purge lock, a replica's
/// rounds delete nothing; once it lets go, the next round does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_purge_in_turn() {
    use sha2::Digest;
    let schema = TestSchema::new();
    let proxy = PgProxy::start().await;
    // Keys forgotten with their responses: the purge deletes the rows, as counted here.
    let store = schema
        .store_at(&proxy.url(), 4)
        .await
        .remember_keys_for(Duration::ZERO)
        .with_background_purge(Some(Duration::from_millis(20)));
    let table = store.table().to_owned();
    // The lock another replica's round holds while it deletes a batch.
    let digest = sha2::Sha256::digest(format!("tower-idempotency purge {table}"));
    let lock = i64::from_be_bytes(digest[..8].try_into().unwrap());
    let other_replica = begin(&format!("SELECT pg_advisory_xact_lock({lock})")).await;

    let (router, counter) = app(IdempotencyLayer::new(store).ttl(Duration::from_millis(1)));
    for key in ["a", "b", "c"] {
        assert_eq!(send(&router, post(key, "{}")).await.status, 201);
    }
    // A claim still running, however short its TTL, is never purged.
    let held = post_with_headers("held", &[("x-held", "1")]);
    let held = common::in_flight(&router, held, &counter).await;
    // Rounds pass while the other replica holds the turn, and delete nothing (each
    // is one statement through the proxy; nothing else runs meanwhile).
    let rounds = || proxy.executes();
    let before = rounds();
    common::eventually(|| rounds() >= before + 3).await;
    assert_eq!(rows_of(&schema, &table).await, 4);
    other_replica.batch_execute("COMMIT").await.unwrap();
    until_rows(&schema, &table, 1).await;
    let before = rounds();
    common::eventually(|| rounds() >= before + 3).await;
    assert_eq!(rows_of(&schema, &table).await, 1);
    counter.let_go(1);
    assert_eq!(held.await.unwrap().status, 201);
    until_rows(&schema, &table, 0).await;
}

/// Whether the suite runs behind a transaction pooler (`TI_POOLER_URL`), where `what`
/// is off by design (`PostgresStore::with_transaction_pooling`): the test then says so
/// and stops. The suite's direct run covers it.
fn not_behind_a_pooler_for(what: &str) -> bool {
    let pooled = common::pooler_url().is_some();
    if pooled {
        eprintln!("{what}: off behind a transaction pooler");
    }
    pooled
}
